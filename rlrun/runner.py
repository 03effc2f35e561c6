"""The run frame both recipes share: everything a training run needs once, so a recipe is only its step body.

`run` is what the CLI calls after validation: restore a checkpoint (if resuming), open the tracker, hand over to
the recipe for `loss.name`, and end the MLflow run FINISHED, FAILED or KILLED (never RUNNING).

`Frame` owns setup (seed, models, engine, meter), the loop over steps (progress bar, deferred Ctrl-C/SIGTERM,
checkpoints, restore), metric reduction across ranks, logging and the run summary. State that is checkpointed is
declared once: the `stateful` objects a recipe hands to `Frame.steps` (each with `state_dict`/`load_state_dict`)
are saved into every checkpoint and restored from it by name, together with the engine's state and the RNGs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import random
import time
from collections import deque

import numpy as np
import torch
from tqdm import tqdm

from . import checkpoint, models, plan, ranks, registry, signals, tracking
from .config import ConfigError
from .meters import Meter

log = logging.getLogger("rlrun")


class NonFiniteLossError(FloatingPointError):
    pass


def run(cfg, raw, run_name: str | None, train) -> dict:
    """Train one validated config with `train` (a recipe's `train(cfg, raw, tracker, resume)`); `cfg` is typed,
    `raw` the composed DictConfig that is logged and checkpointed. Once the MLflow run exists every way out ends it
    FINISHED, FAILED or KILLED (SIGTERM arrives as KeyboardInterrupt: cli.main installs that at process start)."""
    state = load_resume(cfg, raw) if cfg.resume else None
    checkpoint.check_writable(cfg.checkpoint.dir)
    # Data parallel: only rank 0 talks to MLflow (and draws progress); the others record nothing.
    main_rank = ranks.is_main()
    resume_id = state and state["run_id"]
    tracker = tracking.Null()
    try:
        if main_rank:  # inside the try: a signal just after the run is created still ends it (tracking.MLflow)
            tracker = tracking.start(cfg.tracking, raw, run_name, resume_run_id=resume_id,
                                     previous_spill=state and state.get("spill"))
        summary = train(cfg, raw, tracker, state)
    except KeyboardInterrupt:
        end(tracker, "KILLED", "interrupted (KeyboardInterrupt)")
        raise
    except BaseException as e:
        end(tracker, "FAILED", f"{type(e).__name__}: {e}")
        raise
    finally:
        if cfg.engine.name == "deepspeed":
            registry.get("engine", "deepspeed").shutdown()
    with signals.held():  # a Ctrl-C now waits until the run is marked FINISHED
        tracker.summary(summary)
        tracker.describe(tracking.headline(summary))
        tracker.finish("FINISHED")
    if main_rank:
        print(end_table(summary, cfg.train.steps) + "\n" + results_hint(cfg, tracker), flush=True)
    return summary


def end(tracker, status: str, error: str) -> None:
    """Mark the run `status` with its error; a second signal waits until that is done."""
    with signals.held():
        try:
            tracker.tags({"error": error})
        finally:
            tracker.finish(status)


def load_resume(cfg, raw) -> dict:
    """The checkpoint to continue from, refused when it trained something else or on another number of ranks."""
    where = cfg.checkpoint.dir if cfg.resume is True else str(cfg.resume)
    if cfg.resume is not True and not os.path.exists(where) and tracking.is_run_id(where):
        where = tracking.checkpoint_dir_of(cfg.tracking, where)  # resume=<MLflow run id>
    state, path = checkpoint.load_latest(where)
    now = cfg_flat(raw)
    changed = checkpoint.changed_keys(state["config"], now)
    if changed:
        raise ConfigError([f"resume from {path}: {k} was {state['config'].get(k)!r}, now {now.get(k)!r}; a "
                           "resumed run must train the same thing (only train.steps, the head, logging and "
                           "tracking may change)" for k in changed])
    world = ranks.world_size()
    if state.get("world_size", 1) != world:
        raise ConfigError([f"resume from {path}: the checkpoint was written by {state.get('world_size', 1)} "
                           f"rank(s), this launch has {world}; resume with the same number of processes."])
    log.info("resuming from %s at step %d", path, state["step"])
    return state


DEAD_GRADIENT_STEPS = 5  # consecutive steps of a zero or non-finite gradient norm before the warning
DEAD_GRADIENTS_TAG = "rlrun.warning.dead_gradients"


def watch_gradients(history_state: dict, grad_norm: float) -> str | None:
    """Training that died quietly (e.g. train.lr=1e6: the weights blew up, then every gradient is exactly 0): the
    warning text the first time the gradient norm has been exactly 0 or non-finite for DEAD_GRADIENT_STEPS
    consecutive steps, else None. `history_state` is a dict the caller keeps for the run (start with {}); the
    warning is given once per run. Call once per optimizer step with that step's grad norm; on a text, warn in the
    console and set the run tag DEAD_GRADIENTS_TAG to it."""
    dead = not math.isfinite(grad_norm) or grad_norm == 0.0
    history_state["dead"] = history_state.get("dead", 0) + 1 if dead else 0
    history_state["steps"] = history_state.get("steps", 0) + 1
    if history_state["dead"] < DEAD_GRADIENT_STEPS or history_state.get("warned"):
        return None
    history_state["warned"] = True
    what = "exactly 0" if grad_norm == 0.0 else f"non-finite ({grad_norm})"
    return (f"the gradient norm has been zero or non-finite for {history_state['dead']} consecutive steps "
            f"(now {what}, step {history_state['steps'] - 1} of this process): training has stopped learning, "
            "usually from a learning rate far too high (train.lr) that broke the weights; lower train.lr or check "
            "the loss and reward.")


def cfg_flat(raw) -> dict[str, str]:
    from omegaconf import OmegaConf

    return tracking.flatten(OmegaConf.to_container(raw, resolve=True))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def check_finite(loss: torch.Tensor, step: int, fix: str) -> None:
    if not torch.isfinite(loss):
        raise NonFiniteLossError(f"loss is {loss.item()} at step {step}; {fix}")


# Keys of a checkpoint that the frame (step, rng, run_id, config) and the engines (model, optimizer, scheduler,
# reference, world_size, deepspeed_checkpoint) write; a recipe's stateful objects take other names.
RESERVED = {"step", "rng", "run_id", "spill", "config", "model", "optimizer", "scheduler", "reference", "world_size",
            "deepspeed_checkpoint"}


class Frame:
    """Setup and the per-step frame of one run. The recipe builds it (the policy and its tokenizer), loads its data
    with `tokenizer`, calls `start` (warm start, reference, engine), then reads `engine` and `meter` and calls
    `steps`, `reduce` and `log`."""

    def __init__(self, cfg, raw, tracker, *, curve: str):
        self.cfg, self.raw, self.tracker = cfg, raw, tracker
        seed_everything(cfg.seed)
        self.policy, self.tokenizer = models.build(cfg.model, cfg.seed)
        self.summary = Summary(curve)
        self.bar = None
        self.last_samples: list[dict] = []  # the last samples table, printed at the end of the run
        self.exported: str | None = None
        self.grad_watch: dict = {}  # consecutive dead-gradient steps (watch_gradients)
        self.warnings: list[str] = []  # about the data and settings, all in the run tag rlrun.warnings

    def start(self, *, grad_accum: int, with_reference: bool, warm_rows: list[dict],
              reference_path: str | None = None, plan_rows: list[dict] | None = None) -> None:
        """Warm-start the policy (when `warm_start` applies) on `warm_rows` ({prompt, answer}), copy the reference
        from it, and hand both to the engine; then plan the run's memory from its shapes and `plan_rows` (the
        training rows; default `warm_rows`), choosing head.size=auto."""
        cfg, tracker, policy = self.cfg, self.tracker, self.policy
        if cfg.warm_start.enabled is True or (cfg.warm_start.enabled == "auto" and cfg.model.name == "tiny"):
            from .warmstart import warm_start

            with self.meter_once("warm_start"):
                warm_start(policy, self.tokenizer, warm_rows, dataclasses.asdict(cfg.warm_start), cfg.seed,
                           cache=cfg.warm_start.cache)
        lora = cfg.model.lora
        # LoRA: the reference pass can run the policy with its adapters disabled (models.reference), no copy
        adapters_off = lora.enabled and lora.reference == "adapters_off" and reference_path is None
        reference = None
        if with_reference and not adapters_off:
            reference = frozen_reference(policy, reference_path, cfg.model.dtype)
        if lora.enabled:  # after the warm start and the reference copy: both are of the base model
            policy = models.add_lora(policy, lora)
        shapes = plan.shapes_of(policy, cfg.model.dtype)  # before the engine partitions it (ZeRO-3)
        self.engine = registry.get("engine", cfg.engine.name).Engine(cfg, policy, reference, grad_accum)
        del self.policy  # the engine owns it now (wrapped, moved, maybe partitioned)
        self.plan_memory(shapes, plan_rows or warm_rows)
        tracker.tags({"rlrun.device": self.engine.device.type, "rlrun.torch": torch.__version__,
                      "rlrun.world_size": str(self.engine.world)})
        if cfg.offload.enabled and not self.engine.offload_effective():
            log.info("offload=on on a CPU-only run: optimizer state already lives in host memory, nothing moves.")
            tracker.tags({"offload.effective": "false"})
        self.meter = Meter(self.engine.device)

    def plan_memory(self, shapes, rows: list[dict]) -> None:
        """Predict each phase's memory (rlrun/plan.py), resolve head.size=auto with it, and log the plan as plan/*
        at step 0 beside the measured mem/*, with its parts as the artifact plan.txt."""
        cfg, engine = self.cfg, self.engine
        try:
            n_rows, seq_len, tokens = plan.lengths(cfg, self.tokenizer, rows)
            size = plan.resolve_size(cfg, shapes, tokens, engine.device.type, engine.world)
            if cfg.head.size == "auto":  # resolved once, here, before any pass reads it; rank 0's choice for all
                size = engine.gather(size)[0]
                log.info("head.size=auto: %d tokens per %s tile (head.memory_budget_mib=%s)", size, cfg.head.name,
                         cfg.head.memory_budget_mib)
                self.tracker.tags({"rlrun.head.size": str(size)})
                cfg.head.size = size
            self.plan = plan.predict(cfg, shapes, n_rows, seq_len, tokens, world=engine.world,
                                     device_type=engine.device.type)
        except Exception as e:  # noqa: BLE001 - the plan is information; only head.size=auto depends on it
            if cfg.head.size == "auto":
                raise
            self.warn([f"no memory plan for this run ({type(e).__name__}: {e}); training goes on without plan/*."])
            return
        self.tracker.log(0, plan.metrics(self.plan))
        self.tracker.text(plan.table(self.plan) + "\n\n" + plan.detail(self.plan), "plan.txt")

    @contextlib.contextmanager
    def meter_once(self, what: str):
        """Time a one-off setup phase and log it as `time/<what>_s` (at step 0)."""
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        log.info("%s: %.1f s", what.replace("_", " "), seconds)
        self.tracker.log(0, {f"time/{what}_s": seconds})

    def steps(self, start: int, stateful: dict, desc: str, evaluate=None):
        """Yield the steps from `start` on. Before a step that is a multiple of `eval.every`, and after the last
        step, `evaluate()` (-> rlrun.evaluate.Evaluation) runs on the held-out rows and is logged at that step.
        After each step: checkpoint `stateful` when due; on Ctrl-C / SIGTERM, checkpoint and stop
        (KeyboardInterrupt) after that step. At the end: export the policy. Use as `with
        contextlib.closing(frame.steps(...)) as steps:` so the signal handlers are restored as soon as the loop
        ends, however it ends."""
        stateful = {**stateful, "summary": self.summary}
        taken = RESERVED & set(stateful)  # the frame's and the engines' own keys of a checkpoint
        assert not taken, f"stateful names {sorted(taken)} collide with checkpoint keys"
        total = self.cfg.train.steps
        self.bar = progress(start, total, desc, enabled=self.cfg.progress and self.engine.main,
                            every=self.cfg.log.every)
        every = self.cfg.eval.every if evaluate is not None else 0
        with signals.deferred() as stop:
            for step in self.bar:
                if every and step % every == 0:
                    self.evaluate(step, evaluate)
                self.meter.new_step()
                yield step
                self.maybe_checkpoint(step, stop["stop"], stateful)
            if every and total > start:
                self.evaluate(total, evaluate)
            self.export()
            if self.last_samples and self.engine.main:
                log.info("last samples:\n%s", format_rows(self.last_samples))

    def restore(self, resume: dict | None, stateful: dict) -> int:
        """Load a checkpoint's state into the engine, the RNGs and `stateful`; returns the step to continue from."""
        if resume is None:
            return 0
        self.engine.load_state_dict(resume)
        for name, obj in {**stateful, "summary": self.summary}.items():
            obj.load_state_dict(resume[name])
        set_rng_state(resume["rng"])
        return resume["step"]

    def maybe_checkpoint(self, step: int, stop: bool, stateful: dict) -> None:
        """Write a checkpoint after `step` when due (every N steps, the last step, or a stop signal)."""
        c, done = self.cfg.checkpoint, step + 1
        stop = any(self.engine.gather(stop))  # a signal that reached one rank stops all of them after the same step
        if c.dir and ((c.every and done % c.every == 0) or done == self.cfg.train.steps or stop):
            self.tracker.flush()  # every step up to here is in the store: a resume from this checkpoint logs none twice
            state = {"step": done, "rng": rng_state(), "run_id": self.tracker.run_id,
                     "spill": getattr(self.tracker, "spill_path", None), "config": cfg_flat(self.raw),
                     **{name: obj.state_dict() for name, obj in stateful.items()}}
            path = self.engine.save(c.dir, done, state, c.keep)
            if path:
                log.info("checkpoint %s", path)
            if c.export:
                self.export(os.path.join(c.dir, f"{checkpoint.tag(done)}_model"), log_artifact=False)
        if stop:
            raise KeyboardInterrupt

    def evaluate(self, step: int, evaluate) -> None:
        """Held-out evaluation, timed and metered as its own phase (outside the step's `time/step_s`)."""
        meter = Meter(self.engine.device)
        with meter.phase("eval"):
            result = evaluate()
        m = {**result.metrics, **meter.metrics()}
        m.pop("time/step_s")
        self.summary.add(m)
        self.tracker.log(step, m)
        if result.samples:
            self.samples(step, result.samples, "eval")

    def samples(self, step: int, rows: list[dict], kind: str) -> None:
        """A table of a few prompts, completions, answers and rewards; the last one is printed at the end."""
        self.last_samples = rows
        self.tracker.table(rows, f"samples/{kind}_step_{step:06d}.json")

    def export(self, folder: str | None = None, log_artifact: bool = True) -> None:
        """The policy and its tokenizer, written with save_pretrained (ZeRO-3: gathered, rank 0 writes)."""
        from .export import export

        folder = folder or (self.cfg.export.enabled and export_dir(self.cfg))
        if not folder:
            return
        path = export(self.engine.model, self.tokenizer, folder, engine=self.engine, lora=self.cfg.model.lora.export)
        if path:
            self.exported = path
            log.info("exported the policy to %s", path)
            if log_artifact:
                self.tracker.artifacts(path, "model")

    def warn(self, warnings: list[str]) -> None:
        """Warnings about the data that may cost the run (answers longer than max_new_tokens, ...): shown once, on
        the console and as a run tag."""
        for w in warnings:
            log.warning("%s", w)
        if warnings:
            self.warnings += warnings
            self.tracker.tags({"rlrun.warnings": "\n".join(self.warnings)})

    def reduce(self, part: dict) -> list[dict]:
        """This rank's small per-step numbers -> every rank's (sums, counts, min/max and per-sequence values only)."""
        return self.engine.gather({**part, "meter": self.meter.metrics()})

    def log(self, step: int, m: dict[str, float], **postfix) -> None:
        text = watch_gradients(self.grad_watch, m["grad_norm"])
        if text:  # training that died quietly: say so once, in the console and on the run
            log.warning(text)
            self.tracker.tags({DEAD_GRADIENTS_TAG: text})
        self.summary.add(m)
        self.tracker.log(step, m)
        self.bar.set_postfix(**postfix)


def format_rows(rows: list[dict], width: int = 40) -> str:
    """A small aligned text table of sample rows (values cut to `width` characters, newlines shown as ⏎)."""
    def cell(v):
        text = f"{v:.3f}" if isinstance(v, float) else str(v)
        text = text.replace("\n", "⏎")
        return text if len(text) <= width else text[: width - 1] + "…"

    keys = list(rows[0])
    table = [keys] + [[cell(r.get(k)) for k in keys] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(keys))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table)


def export_dir(cfg) -> str | None:
    """`export.dir`, or `model/` in the run's output folder (Hydra's run dir); None outside a Hydra run."""
    if cfg.export.dir:
        return cfg.export.dir
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return os.path.join(HydraConfig.get().runtime.output_dir, "model")


def frozen_reference(policy, path: str | None, dtype: str):
    """The reference model: a frozen copy of the initial policy, or a local checkpoint."""
    ref = models.load_hf(path, dtype)[0] if path else copy.deepcopy(policy)
    return ref.requires_grad_(False)


def meter_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per-rank meter readings -> the slowest rank's times, the largest peak, and each rank's peaks (world > 1)."""
    out = {k: max(p[k] for p in parts if k in p) for k in {k for p in parts for k in p}}
    if len(parts) > 1:
        for r, p in enumerate(parts):
            out.update({f"{k.replace('mem/', f'mem/rank{r}/')}": v for k, v in p.items() if k.startswith("mem/")})
    return out


class Summary:
    """Run-level numbers accumulated step by step, so a checkpoint carries a few numbers, not every step's metrics:
    mean throughput and step time, max peak memory per phase, pass totals, the first and last 3 values of `curve`
    (their means are `<curve>_first` / `<curve>_last`), and the last loss."""

    MEANS = {"gen_tokens_per_s": "throughput/gen_tokens_per_s",
             "train_tokens_per_s": "throughput/train_tokens_per_s", "step_s": "time/step_s"}

    def __init__(self, curve: str):
        self.curve = curve
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.peaks: dict[str, float] = {}
        self.first: list[float] = []
        self.last: deque[float] = deque(maxlen=3)
        self.latest: dict[str, float] = {}  # pass totals and the loss of the last step
        self.evals: dict[str, list[float]] = {}  # eval/* metric -> [first, last]

    def add(self, m: dict[str, float]) -> None:
        for name, key in self.MEANS.items():
            if key in m and math.isfinite(m[key]):
                self.sums[name] = self.sums.get(name, 0.0) + m[key]
                self.counts[name] = self.counts.get(name, 0) + 1
        for key, v in m.items():
            if key.startswith("mem/"):
                self.peaks[key] = max(self.peaks.get(key, v), v)
        if self.curve in m:
            if len(self.first) < 3:
                self.first.append(m[self.curve])
            self.last.append(m[self.curve])
        if any(k.startswith("eval/") for k in m):  # an evaluation, logged on its own
            for k, v in m.items():
                if k.startswith("eval/"):
                    self.evals[k] = [self.evals.get(k, [v])[0], v]
            return
        self.latest = {k: v for k, v in m.items() if k == "loss" or (k.startswith("passes/") and k.endswith("_total"))}

    def result(self) -> dict[str, float]:
        out = {name: self.sums[name] / self.counts[name] for name in self.sums}
        out.update({k.replace("mem/", "max_"): v for k, v in self.peaks.items()})
        for key, v in self.latest.items():
            if key.startswith("passes/"):
                out["passes_" + key.removeprefix("passes/").removesuffix("_total")] = v
        if self.first:
            name = self.curve.split("/")[-1].replace("_mean", "")
            out[f"{name}_first"] = float(np.mean(self.first))
            out[f"{name}_last"] = float(np.mean(self.last))
        if "loss" in self.latest:
            out["loss_last"] = self.latest["loss"]
        for k, (first, last) in self.evals.items():
            name = k.replace("/", "_").replace("@", "_at_")
            out[f"{name}_first"], out[f"{name}_last"] = first, last
        return out

    def state_dict(self) -> dict:
        return {"sums": dict(self.sums), "counts": dict(self.counts), "peaks": dict(self.peaks),
                "first": list(self.first), "last": list(self.last), "latest": dict(self.latest),
                "evals": {k: list(v) for k, v in self.evals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.sums, self.counts, self.peaks = dict(state["sums"]), dict(state["counts"]), dict(state["peaks"])
        self.first, self.latest = list(state["first"]), dict(state["latest"])
        self.last = deque(state["last"], maxlen=3)
        self.evals = {k: list(v) for k, v in state["evals"].items()}



# --- The console: the end-of-run table, where the results are, and progress when stdout is not a terminal ---


def _num(v: float | None, spec: str = ".3g") -> str:
    return "–" if v is None or not math.isfinite(v) else format(v + 0.0, spec)  # + 0.0: no "-0"


def end_table(summary: dict[str, float], steps: int | None = None) -> str:
    """The run's headline numbers as a short aligned table (from `Summary.result()`)."""
    rows = []
    for curve, label in (("reward", "reward (mean of first / last 3 steps)"),
                         ("accuracy", "reward accuracy (mean of first / last 3 steps)")):
        if f"{curve}_first" in summary:
            rows.append((label, f"{_num(summary[f'{curve}_first'], '.3f')} → "
                                f"{_num(summary.get(f'{curve}_last'), '.3f')}"))
    for key in sorted(k for k in summary if k.startswith("eval_") and k.endswith("_first")):
        name = key.removeprefix("eval_").removesuffix("_first").replace("_", " ")
        rows.append((f"eval {name} (first / last evaluation)", f"{_num(summary[key], '.3f')} → "
                                                                f"{_num(summary.get(key[:-6] + '_last'), '.3f')}"))
    if "loss_last" in summary:
        rows.append(("loss (last step)", _num(summary["loss_last"], ".4g")))
    if "step_s" in summary:
        rows.append(("step time (mean)", f"{_num(summary['step_s'], '.3g')} s"))
    toks = [f"{_num(summary[k], '.0f')} {what}" for k, what in
            (("gen_tokens_per_s", "generated"), ("train_tokens_per_s", "trained")) if k in summary]
    if toks:
        rows.append(("tokens / s (mean)", ", ".join(toks)))
    from .meters import PHASES

    peaks = [(p, summary[f"max_{p}_peak_mib"]) for p in PHASES if f"max_{p}_peak_mib" in summary]  # step order
    if peaks:
        rows.append(("peak memory, MiB", "  ".join(f"{p} {_num(v, '.0f')}" for p, v in peaks)))
    width = max((len(k) for k, _ in rows), default=0)
    head = f"rlrun: run finished ({steps} steps)" if steps is not None else "rlrun: run finished"
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])


def results_hint(cfg, tracker) -> str:
    """How to open the results: the `mlflow ui` command for a sqlite store (absolute path, so it works from any
    folder) and the run's page, or the run's URL on a server (opened on MLflow's model-training view); and the
    run's output folder."""
    lines = []
    run_id = getattr(tracker, "run_id", None)
    if run_id and cfg.tracking.name == "mlflow":
        uri = cfg.tracking.uri
        try:
            exp = tracker.client.get_run(run_id).info.experiment_id
            page = f"/#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning"
        except Exception:  # noqa: BLE001 - a hint only
            page = None
        if uri.startswith("sqlite:///"):
            lines.append(f"  results: mlflow ui --backend-store-uri {tracking.absolute_uri(uri)}")
            lines.append(f"           then http://127.0.0.1:5000{page}" if page else f"           run {run_id}")
        elif uri.startswith(("http://", "https://")) and page:
            lines.append(f"  results: {uri.rstrip('/')}{page}")
        else:
            lines.append(f"  results: {uri}   (run {run_id})")
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        lines.append(f"  output:  {HydraConfig.get().runtime.output_dir}")
    return "\n".join(lines)


class PlainProgress:
    """Progress for logs that are not a terminal (SLURM, `> file`): one plain line every `every` steps and at the
    last step, instead of a bar redrawn every step. Iterates like tqdm over `range(start, total)` and takes
    `set_postfix` like it."""

    def __init__(self, start: int, total: int, desc: str, every: int | None = None, enabled: bool = True, out=None):
        import sys

        self.start, self.total, self.desc = start, total, desc
        self.every = every or max(1, round(total / 40))  # ~40 lines per run
        self.enabled, self.out = enabled, out or sys.stderr
        self.postfix: dict = {}
        self.t0 = None

    def set_postfix(self, **postfix) -> None:
        self.postfix = postfix

    def __iter__(self):
        import time

        self.t0 = time.perf_counter()
        for step in range(self.start, self.total):
            yield step
            done = step + 1
            if self.enabled and (done % self.every == 0 or done == self.total):
                rate = (done - self.start) / max(time.perf_counter() - self.t0, 1e-9)
                extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
                print(f"{self.desc}: step {done}/{self.total} ({rate:.2f} steps/s) {extra}".rstrip(),
                      file=self.out, flush=True)

    def close(self) -> None:
        pass


def progress(start: int, total: int, desc: str, enabled: bool, every: int | None = None):
    """The step iterator of `Frame.steps`: tqdm's bar on a terminal, `PlainProgress` lines otherwise."""
    import sys

    if enabled and not sys.stderr.isatty():
        return PlainProgress(start, total, desc, every)
    return tqdm(range(start, total), desc=desc, unit="step", dynamic_ncols=True, initial=start, total=total,
                disable=not enabled)
