"""Errors that are the user's input, not a bug: the CLI prints them as one message and exits 2, no traceback.

They live here, free of heavy imports, so the CLI can catch them without importing torch through the modules that
raise them (each of those modules re-exports its error, so `except tasks.TaskError` keeps working).
`ConfigError` lives with the validator in `rlrun.config`.
"""


class ModelError(ValueError):
    """A model path or model option that cannot be used."""


class TaskError(ValueError):
    """A data file or task option that cannot be used."""


class TrackingError(RuntimeError):
    """The tracking URI or experiment cannot be used."""


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for."""


class ExportError(RuntimeError):
    """An export folder rlrun must not replace (it holds files rlrun did not write) or cannot write."""


class RolloutError(RuntimeError):
    """rollout=vllm cannot start (vLLM missing, or a setting it refuses)."""


class RecordError(ValueError):
    """A rollout record (rollout.record, rollout.path) that cannot be written, read or replayed by this config."""


class LinkError(RuntimeError):
    """A symbolic link where rlrun would create or write a file of its own: refused, nothing written through it."""


class FaultError(RuntimeError):
    """A process rlrun started died or stopped answering, for a cause outside the config (killed, stopped, hung):
    one message naming it and what to do, exit 1 (not 2: the config was not at fault)."""


class DivergedError(RuntimeError):
    """Training diverged (a non-finite loss): the settings' doing (learning rate, precision, reward scale)."""


class CheckError(RuntimeError):
    """A sweep job whose configuration failed `rlrun check` (a probe named): marked FAILED before it trains."""
