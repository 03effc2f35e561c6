"""The generation worker of rollout.pipeline=async: a process of its own with its own copy of the policy.

It builds the policy from the run's config (the same architecture, tokenizer and LoRA wrapping as the trainer's),
loads the trainer's weights, builds the run's rollout engine (`rollout=hf`: this copy; `rollout=vllm`: its engine,
synced from this copy), and then handles the trainer's messages strictly in order:
  ("weights", v, slot)          copy the weights of version v out of a shared slot; reply ("loaded", v)
  ("generate", r, v, prompts, seeds)   rollout r with version v; reply ("rollout", r, v, payload, busy_s, idle_s)
  ("stop",)
Any exception is sent back before the worker exits: ("user_error", message) for the user's or the machine's (a
ModelError, RolloutError, out of device memory: one message), else ("error", traceback). It ignores SIGINT,
SIGTERM and SIGHUP (the trainer finishes its step, checkpoints the rollouts in flight, and then stops the worker),
runs in a process group of its own (the trainer kills it and whatever it started together), kills that group
when the trainer dies, and beats a heartbeat (a shared time stamp, every HEARTBEAT_S, from a thread of its own):
the trainer gives up on a generator silent for rollout.worker_timeout_s (stopped, hung) instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import threading
import time
import traceback

import torch

from .. import procs, signals
from ..config import ConfigError
from ..errors import CheckpointError, ExportError, LinkError, ModelError, RolloutError, TaskError

HEARTBEAT_S = 1.0  # how often the generator says it is alive (pipeline.HEARTBEAT_S, read by the trainer)
USER_ERRORS = (ConfigError, ModelError, TaskError, CheckpointError, ExportError, RolloutError, LinkError)


def to_payload(roll) -> dict:
    """A rollout as plain data (numpy arrays by value): nothing shared with the sending process survives it."""
    return {f.name: (v.detach().cpu().numpy() if isinstance(v := getattr(roll, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(roll)}


def from_payload(payload: dict, device):
    from ..rollout import Rollout

    fields: dict = {k: (torch.from_numpy(v).to(device) if hasattr(v, "dtype") else v) for k, v in payload.items()}
    return Rollout(**fields)


def build(cfg, state: dict, device: str):
    """(policy, tokenizer, rollout engine) of the run's config, with the weights `state`: the generator's copy of
    the policy comes from the one builder of every copy (rlrun.policy), on the trainer's precision path."""
    from .. import models, policy, registry

    base, tokenizer = models.build(cfg.model, cfg.seed)
    generator = policy.build(cfg, "generator", base=base, state=state, device=device)
    engine = registry.get("rollout", cfg.rollout.name).build(cfg.rollout, generator, tokenizer, torch.device(device))
    return generator, tokenizer, engine


def main(cfg, state, slots, inbox, outbox, threads: int, device: str, version: int, parent: int, build=build,
         beat=None) -> None:
    os.setpgid(0, 0)  # a process group of its own: the trainer ends it and all it started together (procs.py)
    procs.die_with_parent(parent)  # the trainer killed (kill -9): this process kills its group
    for sig in signals.SIGNALS:  # the trainer decides when this process ends (close())
        signal.signal(sig, signal.SIG_IGN)
    if beat is not None:  # a sign of life, even while a rollout is generated; none while the process is stopped
        threading.Thread(target=_heartbeat, args=(beat,), name="rlrun-heartbeat", daemon=True).start()
    torch.set_num_threads(threads)
    try:
        policy, _, engine = build(cfg, state, device)
        del state
        outbox.put(("ready", version))
        _serve(policy, engine, slots, inbox, outbox, version, parent)
    except BaseException as e:  # noqa: BLE001 - whatever it is, the trainer must hear of it
        user = isinstance(e, USER_ERRORS) or type(e).__name__ == "OutOfMemoryError"
        outbox.put(("user_error", f"{type(e).__name__}: {e}" if type(e).__name__ == "OutOfMemoryError" else str(e))
                   if user else ("error", traceback.format_exc()))
    finally:  # its last message sent, it ends with everything it started (vLLM's engine process): its group. The
        outbox.close()  # trainer's death may be seen late here (getppid, PR_SET_PDEATHSIG), so it is not left to that
        outbox.join_thread()
        procs.end_group()


def _heartbeat(beat) -> None:
    while True:
        beat.value = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        time.sleep(HEARTBEAT_S)


def _serve(policy, engine, slots, inbox, outbox, version: int, parent: int) -> None:
    """The trainer's messages, in order, until ("stop",) or the trainer is gone."""
    params = dict(policy.named_parameters())
    idle_since = time.perf_counter()
    while True:
        try:
            msg = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the trainer is gone (kill -9): nothing to generate for
                return
            continue
        if msg[0] == "stop":
            return
        if msg[0] == "weights":
            _, version, slot = msg
            loading = time.perf_counter()
            with torch.no_grad():
                for name, value in slots[slot].items():
                    params[name].copy_(value)
            if engine.needs_sync:
                engine.sync(policy)
            outbox.put(("loaded", version))
            idle_since += time.perf_counter() - loading  # copying weights is not idle time
            continue
        _, index, wanted, prompts, seeds = msg
        if wanted != version:  # the trainer orders its messages so that this never happens
            raise RuntimeError(f"rollout {index} asks for weights version {wanted}, the worker holds {version}")
        start = time.perf_counter()
        with torch.no_grad():
            roll = engine.generate(policy, prompts, seeds)
        done = time.perf_counter()
        outbox.put(("rollout", index, version, to_payload(roll), done - start, start - idle_since))
        idle_since = done
