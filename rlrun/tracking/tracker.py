"""The contract every tracker keeps (`Tracker`), and tracking=none's tracker, which records nothing."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Tracker(Protocol):
    """What the run frame, the recipes and the bench call on a tracker. A tracker is built by `tracking.start` as
    `Factory(cfg, config, run_name, resume_run_id, previous_spill)` (the registry's `tracking` entry)."""

    run_id: str | None  # the store's id of the run; None where nothing is stored
    stores: bool  # keeps runs in the MLflow store at tracking.uri: sweeps get a parent run, resume=<run id> works

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The metrics of one step (the code's names: `loss`, `time/step_s`, `eval/accuracy`)."""

    def tags(self, tags: dict[str, str]) -> None: ...

    def summary(self, metrics: dict[str, float]) -> None:
        """The run's summary (`Summary.result()`), once at the end."""

    def text(self, text: str, name: str) -> None:
        """`text` as a file `name` of the run."""

    def table(self, rows: list[dict], name: str) -> None:
        """Rows with the same keys as a table `name` (ends in .json)."""

    def artifacts(self, folder: str, name: str) -> None:
        """The files of `folder` under `name` in the run."""

    def describe(self, text: str) -> None:
        """Append `text` to the run's description."""

    def dataset(self, name: str, digest: str, source: str, context: str, profile: dict) -> None:
        """A dataset the run read or wrote (MLflow: a dataset input with `digest`, its `context` tag and `profile`),
        e.g. the rollout record a run wrote or replayed; `source`: the local folder."""

    def flush(self) -> None:
        """Return once everything logged so far is stored (or kept to send later)."""

    def finish(self, status: str) -> None:
        """The final status: FINISHED, FAILED or KILLED; the last call."""


class Null:
    """tracking=none: records nothing."""

    run_id: str | None = None  # nothing is stored
    stores = False

    def __init__(self, *_args, **_kwargs):  # takes what MLflow takes, so `start` builds either the same way
        pass

    def log(self, step, metrics):
        pass

    def tags(self, tags):
        pass

    def summary(self, metrics):
        pass

    def text(self, text, name):
        pass

    def table(self, rows, name):
        pass

    def artifacts(self, folder, name):
        pass

    def describe(self, text):
        pass

    def dataset(self, name, digest, source, context, profile):
        pass

    def flush(self):
        pass

    def finish(self, status):
        pass
