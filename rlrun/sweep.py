"""Sweeps: one MLflow parent run per Hydra multirun, one child run per job, figures at the end.

Registered as a Hydra callback in conf/config.yaml (it also refuses, before Hydra creates it, an output folder
that cannot be written: `folders.refuse_unwritable`). The parent run id reaches the jobs as
`tracking.parent_run_id`, read from RLRUN_PARENT_RUN_ID (our own variable, inherited by launchers that run jobs
in other processes; never MLFLOW_RUN_ID, which would make start_run resume the parent). A failed job is marked
FAILED with its error and the sweep goes on; at the end the parent run is FINISHED only if every job finished,
and the command exits non-zero listing the failures.

Jobs are named by what tells them apart: the keys whose values differ between the sweep's jobs reach the jobs as
RLRUN_SWEEP_KEYS, and a job's run is named by its overrides of those keys (`head=tiled`; tracking.short_name), its full
overrides kept in the tag `rlrun.overrides`. The parent and its children share the tag `rlrun.sweep_group`, by
which the experiment's saved view `rlrun` groups them (tracking/ui.py), with the swept keys as columns.

Before any job runs, every job's config is composed and validated: a sweep with an invalid job is refused as a
whole (exit 2), each invalid job listed with all its problems. At the end the parent run carries the comparison
(its description: the answer in one line, then one line per job, cheapest first; the table `comparison.json`) and
the figures, and the command prints where to look: the runs view and the parent run, on MLflow's model-training
view.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from . import algorithms, render, signals, tracking
from .folders import refuse_links, refuse_outside, refuse_unwritable
from .sweep_jobs import count, expand_repeats, jobs, refuse_invalid_jobs, sweep_name, swept_keys
from .tracking import ui

ENV = "RLRUN_PARENT_RUN_ID"
KEYS_ENV = tracking.SWEEP_KEYS_ENV
# parent runs whose jobs a launcher submitted to a cluster and left running there (rlrun/cluster/submit.py): their
# end is collect's (python -m rlrun.cluster collect), once the jobs end, not this process's
SUBMITTED: set[str] = set()
log = logging.getLogger("rlrun.sweep")


class SweepCallback(Callback):
    def __init__(self):
        self.client: Any = None  # the MlflowClient of a tracked sweep (tracking.connect's), set with parent_id
        self.parent_id: Any = None  # the parent run's id (str) once on_multirun_start has created it
        self.ended = False
        self.figures_dir: str | None = None  # where the comparison is drawn (hydra.sweep.dir/figures)
        self.baseline = None  # report.baseline
        self.total: int | None = None  # the jobs, where they are known and run in this process (progress lines)
        self.times: list[float] = []  # each ended job's seconds
        self.job_start = 0.0
        self.group: str | None = None  # the tag its parent and jobs share (tracking/ui.py)
        # (job, error) of each job that failed in this process (the basic launcher's): counted even where the store
        # holds no run for it, so the exit status and the count never depend on the store
        self.job_errors: list[tuple[str, str]] = []
        self.jobs_ended = 0  # the jobs that ended in this process, failed or not
        self.said: str | None = None  # the sweep's answer for its console (tools/verdict.console), once drawn

    def on_run_start(self, config, config_name=None, **kwargs):
        refuse_outside(config)
        refuse_unwritable(config.hydra.run.dir, "hydra.run.dir")
        refuse_links(config.hydra.run.dir, config.hydra.job.name, "hydra.run.dir")

    def on_multirun_start(self, config, config_name=None, **kwargs):
        refuse_outside(config)
        refuse_unwritable(config.hydra.sweep.dir, "hydra.sweep.dir")
        expand_repeats(config)
        refuse_invalid_jobs(config, config_name)
        if "BasicLauncher" in str(config.hydra.launcher.get("_target_", "")):  # other launchers: jobs elsewhere
            with contextlib.suppress(Exception):  # a sweeper that chooses its jobs as it goes: no count
                self.total = len(jobs(config))
        if not tracking.stores(config.tracking):
            return
        try:  # Hydra only warns about a callback's exception: a store that cannot be used would fail every job
            self.client, exp_id = tracking.connect(config.tracking.uri, config.tracking.experiment)
        except tracking.TrackingError as e:
            print(f"rlrun: error: {e} (no job was run)", file=sys.stderr)
            sys.exit(2)
        tracking.mark_experiment_kind(self.client, exp_id)
        hidden = set(OmegaConf.select(config, "hydra.job.config.override_dirname.exclude_keys") or [])
        hidden |= {"tracking.uri", "tracking.experiment"}  # where it is logged, not what it runs
        overrides = [o for o in config.hydra.overrides.task if o.split("=", 1)[0].lstrip("+~") not in hidden]
        params = config.hydra.sweeper.get("params")
        sweep_params = OmegaConf.to_container(params, resolve=False) if params else {}
        name = sweep_name(config, config_name, overrides)
        rest = [o for o in overrides if o not in name.split(" ")]  # what the name does not already say
        run_name = f"{name}: {','.join(rest)}"[:250] if rest else name
        keys = swept_keys(config)
        paired_tags, pairing = {}, ""
        if config.report.replay:  # the record every job trains on (rollout/paired.py)
            from .rollout import paired

            record_dir = paired.folder(str(config.hydra.sweep.dir))
            paired_tags = {"rlrun.record": record_dir}
            pairing = (f", paired: the first job records the rollouts it trains on to {record_dir} and the others "
                       "replay them")
        self.group = f"{run_name} ({time.strftime('%Y-%m-%d %H:%M')})"
        try:  # a store that opens but takes no write (locked by another process): said now, not by every job
            run = self.client.create_run(exp_id, run_name=run_name,
                                         tags={"rlrun.kind": "sweep", "rlrun.sweep": name, **tracking.standard_tags(),
                                               ui.GROUP_TAG: self.group,
                                               **paired_tags,
                                               "mlflow.note.content": f"Sweep `{name}`: {count(config)}{pairing} "
                                               "(the comparison appears here when the sweep ends)."})
        except Exception as e:  # noqa: BLE001 - any failure here means the store cannot take the sweep's runs
            print(f"rlrun: error: {tracking.unusable(config.tracking.uri, e)} (no job was run)", file=sys.stderr)
            sys.exit(2)
        self.parent_id = run.info.run_id
        self.figures_dir = os.path.join(str(config.hydra.sweep.dir), "figures")
        self.baseline = OmegaConf.select(config, "report.baseline", default=None)
        ui.prepare(self.client, exp_id, tuple(ui.param_of(config, k) for k in keys),
                   tracking.metric_key(algorithms.of(config.loss.name).curve))
        tracking.log_params(self.client, self.parent_id, tracking.flatten(
            {"sweep": {"name": name, "overrides": ",".join(overrides), "params": sweep_params}}))
        cfg = OmegaConf.to_container(config, resolve=False)
        self.client.log_dict(self.parent_id, cfg, "sweep_config.yaml")
        os.environ[ENV] = self.parent_id
        os.environ[KEYS_ENV] = ",".join(keys)
        # Ctrl-C or SIGTERM to the sweep (with joblib the jobs run in worker processes that the launcher kills):
        # Python exits before on_multirun_end, and this marks what is still RUNNING as KILLED on the way out.
        signals.interrupt_on_signals()
        atexit.register(self.end_interrupted)
        log.info("sweep %s: MLflow parent run %s", name, self.parent_id)

    def on_job_start(self, config, **kwargs):
        self.job_start = time.monotonic()

    def on_job_end(self, config, job_return, **kwargs):
        """One line per ended job with the time left, from the mean job so far (a sweep runs for minutes to hours
        and a job's own output scrolls its start away). A failed job is remembered (`job_errors`)."""
        self.jobs_ended += 1
        value = getattr(job_return, "_return_value", None)  # `return_value` re-raises a job's exception
        if isinstance(value, dict) and "error" in value:  # cli.sweep_job's return for a failed job
            self.job_errors.append((" ".join(job_return.overrides or []) or "job", str(value["error"])))
        elif str(getattr(job_return, "status", "")) == "JobStatus.FAILED":
            self.job_errors.append((" ".join(job_return.overrides or []) or "job",
                                    f"{type(job_return._return_value).__name__}: {job_return._return_value}"))
        if self.total is None:
            return
        self.times.append(time.monotonic() - self.job_start)
        left = (self.total - len(self.times)) * sum(self.times) / len(self.times)
        log.info("sweep: job %d of %d ended after %s; %s", len(self.times), self.total, render.duration(self.times[-1]),
                 f"about {render.duration(left)} left (the mean job so far)" if left else "the last one")

    def end_interrupted(self):
        """At exit, if the sweep never reached on_multirun_end: its RUNNING children and the parent -> KILLED."""
        if self.parent_id is None or self.ended:
            return
        with signals.held(), contextlib.suppress(Exception):
            exp = self.client.get_run(self.parent_id).info.experiment_id
            running = self.client.search_runs([exp], f"tags.mlflow.parentRunId = '{self.parent_id}' and "
                                                     "attributes.status = 'RUNNING'", max_results=5000)
            for run_id in [r.info.run_id for r in running] + [self.parent_id]:
                self.client.set_tag(run_id, "error", "the sweep ended before its jobs did (Ctrl-C, SIGTERM or a "
                                                     "launcher error)")
                self.client.set_terminated(run_id, "KILLED")
            jobs = (f"{len(running)} job(s) still running marked KILLED with it" if running else
                    "no job was still running (each had already ended: FINISHED, FAILED or KILLED by its own process)")
            print(f"rlrun: the sweep ended early; its parent run is marked KILLED, {jobs}", file=sys.stderr)
            self.draw_finished()

    def draw_finished(self) -> None:
        """An interrupted sweep's comparison of the jobs that finished (figures, table, equivalence), as its end
        would have drawn it for them: nothing they measured is left unread."""
        from .tools import report

        _, runs = report.child_runs(self.client, self.parent_id)
        finished = [r for r in runs if r.info.status == "FINISHED"]
        if finished and self.figures_dir:
            print(f"rlrun: drawing the comparison of the {len(finished)} finished job(s): {self.figures_dir}",
                  file=sys.stderr)
            self.draw(report, finished, self.figures_dir, self.baseline,
                  left_out=[r for r in runs if r.info.status != "FINISHED"])
            if self.said:
                print(self.said, file=sys.stderr)

    def on_multirun_end(self, config, **kwargs):
        if self.parent_id is None:  # tracking=none (or a sweep that never started): the jobs this process ran
            if self.job_errors:
                self.exit_failed(self.job_errors, max(self.total or 0, self.jobs_ended))
            return
        if self.parent_id in SUBMITTED:  # the jobs run on the cluster: the parent stays RUNNING until collected
            self.ended = True
            return
        from .tools import report

        os.environ.pop(ENV, None)
        os.environ.pop(KEYS_ENV, None)
        self.ended = True  # the parent gets its status here: nothing left for end_interrupted
        status = "FAILED"
        try:  # Hydra only warns about exceptions in callbacks: never leave the parent RUNNING
            _, runs = report.child_runs(self.client, self.parent_id)
            failed = [r for r in runs if r.info.status != "FINISHED"]
            finished = [r for r in runs if r.info.status == "FINISHED"]
            if finished:
                baseline = OmegaConf.select(config, "report.baseline", default=None)
                self.draw(report, finished, os.path.join(str(config.hydra.sweep.dir), "figures"), baseline,
                          left_out=failed)
            status = "FAILED" if failed or not runs or self.job_errors else "FINISHED"
        except Exception as e:
            self.client.set_tag(self.parent_id, "error", f"{type(e).__name__}: {e}"[:5000])
            raise
        finally:
            self.client.set_terminated(self.parent_id, status)
        exp_id = self.client.get_run(self.parent_id).info.experiment_id
        view = ui.sweep_view(self.client, exp_id, self.parent_id, self.group) if self.group else None
        if self.said:
            print(self.said, flush=True)
        print(links(config.tracking.uri, exp_id, self.parent_id,
                    OmegaConf.select(config, "tracking.ui_port", default=tracking.UI_PORT), view=view), flush=True)
        if not runs and not self.job_errors:  # a sweeper that chose no job (the basic one refuses that before)
            print("rlrun: error: the sweep ran no job; the parent run is marked FAILED", file=sys.stderr)
            sys.exit(1)
        listed = [(r.data.tags.get("mlflow.runName") or "job", f"{r.info.status} ({r.data.tags.get('error', '')})")
                  for r in failed]
        if len(self.job_errors) > len(listed):  # jobs whose failure the store holds no run for (it refused them)
            listed = self.job_errors
        if listed:
            self.exit_failed(listed, max(len(runs), self.total or 0, self.jobs_ended, len(listed)))

    @staticmethod
    def exit_failed(failed: list[tuple[str, str]], total: int) -> None:
        """Exit 1 naming each failed job: a sweep with a failed job never exits 0."""
        lines = [f"  - {name}: {error}" for name, error in failed]
        print(f"rlrun: {len(failed)} of {total} sweep jobs failed:\n" + "\n".join(lines), file=sys.stderr)
        sys.exit(1)

    def draw(self, report, runs, out, baseline=None, left_out=()):
        """The sweep's figures on the parent, its comparison table, and its equivalence check: equivalence/*
        metrics and equivalence.txt, or (no baseline among the jobs) a warning and the tag rlrun.equivalence.
        `left_out`: the jobs that did not finish (diverged, failed, killed), named in the answer, never ranked."""
        got = report.gather(self.client, runs, baseline)  # read once: the figures and the description use it
        figs, (rows, problems) = report.figures(self.client, runs, runs[0].data.tags.get("rlrun.device", "cpu"),
                                                baseline, got)
        report.write(figs, (rows, problems), out)
        tracking.log_figures(self.client, self.parent_id, figs)
        render.close(figs)
        self.describe(report, runs, got, left_out)
        if rows or problems:
            self.client.log_artifact(self.parent_id, os.path.join(out, "equivalence.txt"))
        if rows:
            diffs = {k: [r[k] for r in rows if k in r] for k in ("loss", "reward_mean")}
            tracking.log_metrics(self.client, self.parent_id,
                                 {f"equivalence/max_abs_diff_{k}": max(v) for k, v in diffs.items() if v}
                                 | {"equivalence/runs_compared": float(len(rows))})
        for problem in problems:
            log.warning("equivalence: %s", problem)
        self.client.set_tag(self.parent_id, "rlrun.equivalence", "; ".join(problems) if problems else
                            f"{len(rows)} run(s) compared with their baseline" if rows else "nothing to compare")
        log.info("figures: %s", out)

    def describe(self, report, runs, got, left_out=()):
        """The comparison (`got`: report.gather's) as the parent's description (tools/note.py) and as the table
        `comparison.json`; the children renamed to the overrides that tell them apart."""
        names, data, params, answer = got.names, got.data, got.params, got.answer
        for run, name in zip(runs, names):
            if run.data.tags.get("mlflow.runName") != name:
                self.client.set_tag(run.info.run_id, "mlflow.runName", name)
        note = self.client.get_run(self.parent_id).data.tags.get("mlflow.note.content", "").split(" (the ")[0]
        rows = report.rows_of(names, data)
        from .tools import noise_floor, verdict
        from .tools import note as note_of

        for name, run in zip(names, runs):  # each job's `rlrun check` (report.check_jobs)
            if run.data.tags.get("rlrun.check"):
                answer[1].setdefault(verdict.option_of(name), {})["check"] = run.data.tags["rlrun.check"]
        for name, run in zip(names, runs):
            row = answer[1][verdict.option_of(name)]
            self.mark_verdict(run, verdict.brief(row))
            tracking.log_metrics(self.client, run.info.run_id, verdict.metrics(row))
        found = noise_floor.rows(names, data, params)  # a paired sweep: the options against the exact floor
        if found and found[1]:  # in the answer's line: MLflow folds the description after a few lines
            answer = (f"{answer[0]} {noise_floor.brief(found)}", answer[1])
        if left_out:  # a diverged or failed job is not ranked, and the answer says which were left out
            answer = (f"{answer[0]} {left_out_text(left_out)}", answer[1])
        # one line per option: its first repeat's table row under the option's name (the cost pools the repeats)
        firsts = {verdict.option_of(r["run"]): {**r, "run": verdict.option_of(r["run"])} for r in reversed(rows)}
        repeats = max(v.get("repeats", 1) for v in answer[1].values())
        paced = any(v.get("paced") for v in answer[1].values())  # timed on the steps at the machine's full pace
        over = f" over {repeats} interleaved repeats" if repeats > 1 else ""
        spread = (f"on the steps at the machine's full pace{over}, with their interquartile range" if paced else
                  f"over {repeats} interleaved repeats: the median of the repeats' medians, with their range"
                  if repeats > 1 else "with their interquartile range")
        text = (f"{note_of.comparison_note(list(firsts.values())[::-1], report.SPECS, answer)}"
                + (f"\n\n{noise_floor.text(found)}" if found and found[1] else "")
                + f"\n\n{note.rstrip('.')}. Cost: the median seconds per step, after the first {verdict.WARMUP}, "
                f"of the phases the varying options change, {spread}; runs whose ranges "
                "overlap: no difference measured. Reward / acc: the last step's mean reward (GRPO) or reward accuracy "
                "(DPO); s/step: the job console's step time (evaluation and checkpoints left out); tokens/s: trained "
                "tokens over that time; growth: the step's largest phase at the median step. Figures and the table "
                "comparison.json: Artifacts.\n")
        self.client.set_tag(self.parent_id, "mlflow.note.content", text)
        self.said = verdict.console(answer)
        recorded = [n for n, p in zip(names, params) if p.get("rollout.record") not in (None, "", "None")]
        if recorded:  # a paired sweep: the whole step of the others holds no generation
            self.said += (f"\n  paired: {', '.join(recorded)} generated and recorded the rollouts, the others replayed "
                          "them: their whole step has no generation, so compare the answer above, not step times")
        self.client.log_table(self.parent_id, {c: [None if isinstance(r[c], float) and r[c] != r[c] else r[c]
                                                   for r in rows] for c in report.COLUMNS}, "comparison.json")

    def mark_verdict(self, run, brief: str) -> None:
        """A job's answer as its tag and its description's first line (the runs table's Description column,
        tracking/ui.py); the line a drawing during the sweep put there is replaced, not repeated."""
        tags = run.data.tags
        text, old = tags.get("mlflow.note.content", ""), tags.get(ui.VERDICT_TAG)
        if old and text.startswith(f"{old}.\n\n"):
            text = text[len(old) + 3 :]
        self.client.set_tag(run.info.run_id, ui.VERDICT_TAG, brief)
        self.client.set_tag(run.info.run_id, "mlflow.note.content", f"{brief}.\n\n{text}" if text else f"{brief}.")


def left_out_text(runs) -> str:
    """The jobs the comparison leaves out, each with its status and the start of its error."""
    named = [f"{r.data.tags.get('mlflow.runName') or r.info.run_id} ({r.info.status}"
             + (f": {r.data.tags['error'][:120]}" if r.data.tags.get("error") else "") + ")" for r in runs]
    return f"Left out, not finished: {'; '.join(named)}."


def links(uri: str, exp_id: str, run_id: str, port: int = tracking.UI_PORT, view: str | None = None) -> str:
    """Where a sweep's results are: the runs view, the parent run (MLflow's model-training view) and, with the
    sweep's own saved `view` (ui.sweep_view), its jobs' answers as bars (the chart view); for a store that is
    neither a sqlite file nor a tracking server, its URI and the parent's id. `port`: tracking.ui_port."""
    if uri.startswith("sqlite:"):
        base = f"http://127.0.0.1:{port}"
        head = f" mlflow ui --port {port} --backend-store-uri {tracking.absolute_uri(uri)}, then"
    elif uri.startswith(("http://", "https://")):
        base, head = uri.rstrip("/"), ""
    else:
        return f"rlrun: sweep results: {uri}, parent run {run_id}"
    compare = f"\n  compare: {ui.compare_page(base, exp_id, view)}" if view else ""
    return (f"rlrun: sweep results:{head}\n  runs:    {ui.runs_page(base, exp_id)}\n"
            f"  parent:  {ui.run_page(base, exp_id, run_id)}{compare}")
