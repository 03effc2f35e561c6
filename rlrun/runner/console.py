"""The console: the end-of-run table, where the results are, sample tables, and progress (tqdm on a terminal,
plain lines when stdout is not one)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Protocol

from tqdm import tqdm

from .. import render, tracking


def format_rows(rows: list[dict], width: int = 40) -> str:
    """A small aligned text table of sample rows (values cut to `width` characters, newlines shown as ⏎)."""
    def cell(v):
        text = f"{v:.3f}" if isinstance(v, float) else str(v)
        text = text.replace("\n", "⏎")
        return text if len(text) <= width else text[: width - 1] + "…"

    keys = list(rows[0])
    return render.table(keys, [[cell(r.get(k)) for k in keys] for r in rows], left=len(keys))


def end_table(summary: dict[str, float], steps: int | None = None) -> str:
    """The run's headline numbers as a short aligned table (from `Summary.result()`)."""
    rows = []
    for curve, label in (("reward", "reward (mean of first / last 3 steps)"),
                         ("accuracy", "reward accuracy (mean of first / last 3 steps)")):
        if f"{curve}_first" in summary:
            rows.append((label, f"{render.num(summary[f'{curve}_first'], '.3f')} → "
                                f"{render.num(summary.get(f'{curve}_last'), '.3f')}"))
    for key in sorted(k for k in summary if k.startswith("eval_") and k.endswith("_first")):
        name = key.removeprefix("eval_").removesuffix("_first").replace("_", " ")
        first, last = render.num(summary[key], ".3f"), render.num(summary.get(key[:-6] + "_last"), ".3f")
        rows.append((f"eval {name} (first / last evaluation)", f"{first} → {last}"))
    if "loss_last" in summary:
        rows.append(("loss (last step)", render.num(summary["loss_last"], ".4g")))
    if "step_s" in summary:  # the metered phases of a step: evaluation and checkpoints are not in it
        rows.append(("step time (mean, no eval)", f"{render.num(summary['step_s'], '.3g')} s"))
    if "tokens_per_s" in summary:
        rows.append(("tokens / s, whole step", f"{render.num(summary['tokens_per_s'], '.0f')} trained"))
    toks = [f"{render.num(summary[k], '.0f')} {what}" for k, what in
            (("gen_tokens_per_s", "generated"), ("train_tokens_per_s", "trained")) if k in summary]
    if toks:
        rows.append(("tokens / s, by phase (mean)", ", ".join(toks)))
    if "load_1m" in summary:  # a slow run on a busy machine is told apart afterwards
        cores = os.cpu_count() or 1
        rows.append(("machine load (1-min average, mean)", f"{summary['load_1m']:.1f} on {cores} cores, this run "
                     "included"))
    from ..meters import PHASES

    peaks = [(p, summary[f"max_{p}_peak_mib"]) for p in PHASES if f"max_{p}_peak_mib" in summary]  # step order
    if peaks:
        rows.append(("peak memory, MiB", "  ".join(f"{p} {render.num(v, '.0f')}" for p, v in peaks)))
    width = max((len(k) for k, _ in rows), default=0)
    head = f"rlrun: run finished ({steps} steps)" if steps is not None else "rlrun: run finished"
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])


def results_hint(cfg, tracker) -> str:
    """How to open the results: the `mlflow ui` command for a sqlite store (absolute path, so it works from any
    folder), then the run's page and the experiment's runs (rlrun's saved view), both on MLflow's model-training
    view (tracking/ui.py); and the run's output folder."""
    lines = []
    run_id = getattr(tracker, "run_id", None)
    if run_id and getattr(cfg.tracking, "uri", None):  # a tracking option with a store
        uri = cfg.tracking.uri
        try:
            exp = tracker.client.get_run(run_id).info.experiment_id
        except Exception:  # noqa: BLE001 - a hint only
            exp = None
        local = uri.startswith("sqlite:///")
        port = getattr(cfg.tracking, "ui_port", None) or tracking.UI_PORT
        base = f"http://127.0.0.1:{port}" if local else uri.rstrip("/")
        pages = [] if exp is None or not (local or uri.startswith(("http://", "https://"))) else [
            f"{tracking.ui.run_page(base, exp, run_id)}  (this run)", f"{tracking.ui.runs_page(base, exp)}  (all runs)"]
        if local:
            lines.append(f"  results: mlflow ui --port {port} --backend-store-uri {tracking.absolute_uri(uri)}, "
                         "then open")
        lines += [f"  {'results:' if i == 0 and not local else ' ' * 8} {page}" for i, page in enumerate(pages)]
        if not pages:
            lines.append(f"  results: {uri}   (run {run_id})" if not local else f"           run {run_id}")
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        lines.append(f"  output:  {HydraConfig.get().runtime.output_dir}")
    return "\n".join(lines)


def sweep_job(cfg) -> bool:
    """Whether this run is one job of a sweep (its console output is shortened): it has a parent run, or Hydra
    launched it in a multirun (tracking=none has no parent)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if getattr(cfg.tracking, "parent_run_id", None):
        return True
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def header(cfg, tracker) -> str:
    """The run's first lines: what runs (the objective, model, task and every axis's option, the steps and device),
    then where its results go (`results_hint`: the MLflow run and the output folder). A sweep job's: the first line."""
    from .. import registry

    what = [f"loss={cfg.loss.name}", f"model={cfg.model.name}", f"task={cfg.task.name}"]
    moved = []  # the axes away from their baseline option: the rest need no words
    for g in registry.AXES:
        chosen = registry.option_of(cfg, g)
        if chosen is not None and chosen != registry.baseline(g):
            moved.append(f"{registry.key_of(g).removesuffix('.name')}={chosen}")
    device = getattr(cfg.engine, "device", None)  # the single-process engine's; DeepSpeed's ranks say their own
    line = (f"rlrun: {' '.join(what)}, {cfg.train.steps} steps" + (f" on {device}" if device else "")
            + (f"; {' '.join(moved)}, other axes at their baselines" if moved else "; every axis at its baseline"))
    if sweep_job(cfg):
        return line
    line += load_note()
    hint = results_hint(cfg, tracker).replace("  results:", "  logging:", 1)
    return f"{line}\n{hint}" if hint else line


def load_note() -> str:
    """The machine's load as the run starts, where it is busy (a 1-minute load average past half its cores): the
    first step of a real model took 866 s against 15.6 s idle, with no word of why. Nothing on an idle machine."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except OSError:  # no load average on this platform
        return ""
    if load <= cores / 2:
        return ""
    return (f"\n  machine: load {load:.1f} on {cores} cores as the run starts (other work): its steps run slower "
            "than on an idle machine, and its times say so at the end")


class PlainProgress:
    """Progress for logs that are not a terminal (SLURM, `> file`): one plain line every `every` steps and at the
    last step, instead of a bar redrawn every step. Iterates like tqdm over `range(start, total)` and takes
    `set_postfix` like it."""

    def __init__(self, start: int, total: int, desc: str, every: int | None = None, enabled: bool = True, out=None):
        self.start, self.total, self.desc = start, total, desc
        self.every = every or max(1, round(total / 40))  # ~40 lines per run
        self.enabled, self.out = enabled, out or sys.stderr
        self.postfix: dict = {}
        self.t0: float | None = None  # set when iteration starts

    def set_postfix(self, **postfix) -> None:
        self.postfix = postfix

    def __iter__(self) -> Iterator[int]:
        self.t0 = time.perf_counter()
        for step in range(self.start, self.total):
            yield step
            done = step + 1
            if self.enabled and (done % self.every == 0 or done == self.total):
                rate = (done - self.start) / max(time.perf_counter() - self.t0, 1e-9)
                extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
                left = (self.total - done) / rate  # the mean step so far: evaluations included
                eta = f", ~{render.duration(left)} left" if done < self.total else ""
                print(f"{self.desc}: step {done}/{self.total} ({rate:.2f} steps/s{eta}) {extra}".rstrip(),
                      file=self.out, flush=True)

    def close(self) -> None:
        pass


class Progress(Protocol):
    """What `progress` returns (tqdm's bar or a PlainProgress): the steps, and the numbers shown beside them."""

    def __iter__(self) -> Iterator[int]: ...

    def set_postfix(self, **postfix) -> None: ...

    def close(self) -> None: ...


def progress(start: int, total: int, desc: str, enabled: bool, every: int | None = None) -> Progress:
    """The step iterator of `Frame.steps`: tqdm's bar on a terminal, `PlainProgress` lines otherwise."""
    if enabled and not sys.stderr.isatty():
        return PlainProgress(start, total, desc, every)
    return tqdm(range(start, total), desc=desc, unit="step", dynamic_ncols=True, initial=start, total=total,
                disable=not enabled)
