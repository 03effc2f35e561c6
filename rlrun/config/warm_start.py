"""What the warm start does, as config: whether it runs and what it computes. Plain functions of the config (no
torch), so that a replay record (rlrun/rollout/record.py) can fix them below the warm start's own layer."""

DEFAULTS = {"steps": 300, "batch_size": 64, "lr": 3e-3, "weight_decay": 0.1, "wrong_prob": 0.75, "offsets": [1]}


def options(cfg) -> dict:
    """The warm-start options as a plain dict (OmegaConf nodes included), defaults filled in; `enabled` and
    `cache` say whether and how to run, not what is computed, so they are left out (and out of the cache key)."""
    if hasattr(cfg, "_metadata"):  # an OmegaConf node
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg, resolve=True)
    out = {**DEFAULTS, **{k: v for k, v in dict(cfg or {}).items() if k not in ("enabled", "cache")}}
    out["offsets"] = [int(o) for o in out["offsets"]]
    return out


def on_embedded_task(cfg) -> bool:
    """Whether the run trains on the task built in code (task=arith), not on the user's data."""
    return cfg.task.name == "arith"


def applies(cfg) -> bool:
    """warm_start.enabled: true, or auto for the embedded random-init model on its own synthetic task (task=arith,
    whose answers the warm start's off-by-one labels are made for); never on the user's data unless asked."""
    enabled = cfg.warm_start.enabled
    return enabled is True or (enabled == "auto" and cfg.model.name == "tiny" and on_embedded_task(cfg))
