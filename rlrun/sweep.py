"""Sweeps: one MLflow parent run per Hydra multirun, one child run per job, figures at the end.

Registered as a Hydra callback in conf/config.yaml. The parent run id reaches the jobs as
`tracking.parent_run_id`, read from RLRUN_PARENT_RUN_ID (our own variable, inherited by launchers that run jobs
in other processes; never MLFLOW_RUN_ID, which would make start_run resume the parent). A failed job is marked
FAILED with its error and the sweep goes on; at the end the parent run is FINISHED only if every job finished,
and the command exits non-zero listing the failures.
"""

from __future__ import annotations

import logging
import os
import sys

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from . import tracking

ENV = "RLRUN_PARENT_RUN_ID"
log = logging.getLogger("rlrun.sweep")


class SweepCallback(Callback):
    def __init__(self):
        self.client = None
        self.parent_id = None

    def on_multirun_start(self, config, config_name=None, **kwargs):
        if config.tracking.name != "mlflow":
            return
        self.client, exp_id = tracking.connect(config.tracking.uri, config.tracking.experiment)
        overrides = list(config.hydra.overrides.task)
        name = config_name if config_name and config_name != "config" else "sweep"
        params = config.hydra.sweeper.get("params")
        sweep_params = OmegaConf.to_container(params, resolve=False) if params else {}
        run = self.client.create_run(exp_id, run_name=f"{name}: {','.join(overrides)}"[:250],
                                     tags={"rlrun.kind": "sweep", "rlrun.sweep": name})
        self.parent_id = run.info.run_id
        tracking.log_params(self.client, self.parent_id, tracking.flatten(
            {"sweep": {"name": name, "overrides": ",".join(overrides), "params": sweep_params}}))
        cfg = OmegaConf.to_container(config, resolve=False)
        self.client.log_dict(self.parent_id, cfg, "sweep_config.yaml")
        os.environ[ENV] = self.parent_id
        log.info("sweep %s: MLflow parent run %s", name, self.parent_id)

    def on_multirun_end(self, config, **kwargs):
        if self.parent_id is None:
            return
        from . import report

        os.environ.pop(ENV, None)
        status = "FAILED"
        try:  # Hydra only warns about exceptions in callbacks: never leave the parent RUNNING
            _, runs = report.child_runs(self.client, self.parent_id)
            failed = [r for r in runs if r.info.status != "FINISHED"]
            finished = [r for r in runs if r.info.status == "FINISHED"]
            if finished:
                self.draw(report, finished, os.path.join(str(config.hydra.sweep.dir), "figures"))
            status = "FAILED" if failed or not runs else "FINISHED"
        except Exception as e:
            self.client.set_tag(self.parent_id, "error", f"{type(e).__name__}: {e}"[:5000])
            raise
        finally:
            self.client.set_terminated(self.parent_id, status)
        if failed:
            lines = [f"  - {r.data.tags.get('mlflow.runName')}: {r.info.status} "
                     f"({r.data.tags.get('error', '')[:300]})" for r in failed]
            print(f"rlrun: {len(failed)} of {len(runs)} sweep jobs failed:\n" + "\n".join(lines), file=sys.stderr)
            sys.exit(1)

    def draw(self, report, runs, out):
        figs, rows = report.figures(self.client, runs, runs[0].data.tags.get("rlrun.device", "cpu"))
        report.write(figs, rows, out)
        tracking.log_figures(self.client, self.parent_id, figs)
        if rows:
            self.client.log_artifact(self.parent_id, os.path.join(out, "equivalence.txt"))
            diffs = {k: [r[k] for r in rows if k in r] for k in ("loss", "reward_mean")}
            tracking.log_metrics(self.client, self.parent_id,
                                 {f"equivalence/max_abs_diff_{k}": max(v) for k, v in diffs.items() if v})
        log.info("figures: %s", out)
