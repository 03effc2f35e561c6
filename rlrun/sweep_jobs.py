"""A sweep's jobs, known before any runs (Hydra's basic sweeper): each job's overrides, the keys that tell them apart,
the repeats (report.repeats) and the checks that refuse a sweep as a whole (an invalid job, jobs that cannot share
one record, no job at all). Called by the sweep's callback (sweep.py) before its parent run exists."""

from __future__ import annotations

import sys

from omegaconf import OmegaConf


def swept_keys(config) -> list[str]:
    """The keys whose values differ between the sweep's jobs, in the order of the overrides ([] where the jobs
    are not known up front)."""
    try:
        todo = jobs(config)
    except Exception:  # noqa: BLE001 - a sweeper that is not the basic one
        return []
    given = [dict((k.lstrip("+~"), v) for k, v in (o.split("=", 1) for o in job if "=" in o)) for job in todo]
    keys = dict.fromkeys(k for job in given for k in job)
    return [k for k in keys if len({job.get(k) for job in given}) > 1]


def jobs(config) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper will launch them (sweeper params, then the command line)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    args = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    overrides = OverridesParser.create().parse_overrides(args)
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def count(config) -> str:
    try:
        return f"{len(jobs(config))} jobs"
    except Exception:  # noqa: BLE001 - a sweeper that is not the basic one: its jobs are not known up front
        return "jobs"


def refuse_invalid_jobs(config, config_name) -> None:
    """Compose and validate every job's config before any job runs; refuse the sweep (exit 2) listing each invalid
    job in full. Only for Hydra's basic sweeper (other sweepers choose their jobs as they go)."""
    if "BasicSweeper" not in str(config.hydra.sweeper.get("_target_", "")):
        wanted = [k for k, on in (("report.replay", config.report.replay), ("report.repeats",
                                                                           config.report.repeats > 1)) if on]
        if wanted:  # job 0 must be the one that records; repeats are a key of the basic sweeper's grid
            print(f"rlrun: error: {' and '.join(wanted)} need(s) Hydra's basic sweeper (its jobs known up front); "
                  f"this sweep uses {config.hydra.sweeper.get('_target_')}. Drop {' and '.join(wanted)} or the "
                  "hydra/sweeper override", file=sys.stderr)
            sys.exit(2)
        return
    from hydra import compose

    from .config import ConfigError, validate

    bad = []
    todo = jobs(config)
    if not todo:
        refuse_empty(config)
    composed = []
    for overrides in todo:
        try:
            composed.append(compose(config_name=config_name, overrides=overrides))
            validate(composed[-1])
        except ConfigError as e:
            bad.append(f"job {','.join(overrides)}:\n" + "\n".join(f"    - {p}" for p in e.problems))
        except Exception as e:  # noqa: BLE001 - a job that does not even compose is as invalid
            bad.append(f"job {','.join(overrides)}:\n    - {type(e).__name__}: {e}")
    unpaired = refuse_unpaired(config, todo, composed) if config.report.replay and not bad else []
    if unpaired:
        print("rlrun: sweep refused, its jobs cannot share one record (report.replay; no job was run):\n  - "
              + "\n  - ".join(unpaired), file=sys.stderr)
        sys.exit(2)
    if bad:
        print(f"rlrun: sweep refused, {len(bad)} of {len(todo)} jobs are invalid (no job was run):\n"
              + "\n".join(bad), file=sys.stderr)
        sys.exit(2)


def expand_repeats(config) -> None:
    """report.repeats=N: every job N times, interleaved (every job once, then every job again), so that load on the
    machine that comes and goes falls on every option alike. `report.repeat=0,...,N-1` becomes the basic sweeper's
    first key (its outermost loop: the sweeper reads this same config when it builds its jobs)."""
    n = int(OmegaConf.select(config, "report.repeats", default=1) or 1)
    if n <= 1 or "BasicSweeper" not in str(config.hydra.sweeper.get("_target_", "")):
        return
    from omegaconf import open_dict

    with open_dict(config):
        params = dict(config.hydra.sweeper.get("params") or {})
        params.pop("report.repeat", None)
        config.hydra.sweeper.params = {"report.repeat": ",".join(map(str, range(n))), **params}


def refuse_unpaired(config, todo: list[list[str]], composed) -> list[str]:
    """report.replay: why the jobs cannot share one record (rollout/paired.py); a launcher that runs jobs side by
    side cannot replay a record still being written."""
    from .rollout import paired

    if "BasicLauncher" not in str(config.hydra.launcher.get("_target_", "")):
        return [f"report.replay: the jobs replay the first job's record, so they run one after another; the launcher "
                f"{config.hydra.launcher.get('_target_')} runs them side by side. Drop hydra/launcher=... or "
                "report.replay"]
    keys = swept_keys(config)
    names = [",".join(o for o in job if o.split("=", 1)[0].lstrip("+~") in keys) or str(n) for n, job in
             enumerate(todo)]
    return paired.problems(composed, names, str(config.hydra.sweep.dir))


def refuse_empty(config) -> None:
    """A sweep with no job (a swept key with no values, e.g. seed='range(0,0)'): one line and exit 2, before the
    parent run exists (it used to end FAILED with exit 0)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    args = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    empty = [a for a, o in zip(args, OverridesParser.create().parse_overrides(args))
             if o.is_sweep_override() and not list(o.sweep_string_iterator())]
    print(f"rlrun: error: the sweep has no jobs: {', '.join(empty) or 'its swept keys'} give(s) no values; give "
          "every swept key at least one value, e.g. seed='range(0,3)' or seed=0,1,2", file=sys.stderr)
    sys.exit(2)


def sweep_name(config, config_name: str | None, overrides: list[str]) -> str:
    """A sweep's name in MLflow, so that two sweeps are told apart in the runs table: report.name; else its config's
    name (`-cd sweeps -cn NAME`); else what it sweeps, the overrides with more than one value (`head=dense,tiled`)
    but the repeats report.repeats added."""
    given = OmegaConf.select(config, "report.name", default=None)
    if given:
        return str(given)
    if config_name and config_name != "config":
        return config_name
    swept = [o for o in swept_overrides(overrides) if not o.startswith("report.repeat=")]
    return " ".join(swept)[:120] or "sweep"


def swept_overrides(overrides: list[str]) -> list[str]:
    """The overrides that give a sweep more than one value (Hydra's parser: `head=dense,tiled`, `range(...)`,
    not a list value `train.betas=[0.9,0.99]`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - Hydra refuses such a sweep itself, with its own message
        return []
    return [o for o, p in zip(overrides, parsed) if p.is_sweep_override()]
