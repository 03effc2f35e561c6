"""The generation worker of rollout.pipeline=async: a process of its own with its own copy of the policy.

It builds the policy from the run's config (the same architecture, tokenizer and LoRA wrapping as the trainer's),
loads the trainer's weights, builds the run's rollout engine (`rollout=hf`: this copy; `rollout=vllm`: its engine,
synced from this copy), and then handles the trainer's messages strictly in order:
  ("weights", v, slot)          copy the weights of version v out of a shared slot; reply ("loaded", v)
  ("generate", r, v, prompts, seeds)   rollout r with version v; reply ("rollout", r, v, payload, busy_s, idle_s)
  ("stop",)
Any exception is sent back as ("error", traceback) before the worker exits. It ignores SIGINT and SIGTERM (Ctrl-C
and a scheduler's SIGTERM reach the whole process group: the trainer finishes its step, checkpoints the rollouts
in flight, and then stops the worker), and exits by itself when the trainer is gone.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import time
import traceback

import torch


def to_payload(roll) -> dict:
    """A rollout as plain data (numpy arrays by value): nothing shared with the sending process survives it."""
    return {f.name: (v.detach().cpu().numpy() if isinstance(v := getattr(roll, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(roll)}


def from_payload(payload: dict, device):
    from ..rollout import Rollout

    return Rollout(**{k: (torch.from_numpy(v).to(device) if hasattr(v, "dtype") else v) for k, v in payload.items()})


def build(cfg, state: dict, device: str):
    """(policy, tokenizer, rollout engine) of the run's config, with the weights `state`."""
    from .. import models, registry

    policy, tokenizer = models.build(cfg.model, cfg.seed)
    if cfg.model.lora.enabled:
        policy = models.add_lora(policy, cfg.model.lora)
    policy.load_state_dict(state)
    # not requires_grad_(False): it changes which CPU kernels the linear layers take, and so the last bits of the
    # logprobs; generation runs under no_grad anyway, and K=0 must draw what the trainer's own process draws
    policy.to(device).eval()
    engine = registry.get("rollout", cfg.rollout.name).build(cfg.rollout, policy, tokenizer, torch.device(device))
    return policy, tokenizer, engine


def main(cfg, state, slots, inbox, outbox, threads: int, device: str, version: int, parent: int, build=build) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the trainer decides when this process ends (close())
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        policy, _, engine = build(cfg, state, device)
        del state
        params = dict(policy.named_parameters())
        outbox.put(("ready", version))
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
    except BaseException:  # noqa: BLE001 - whatever it is, the trainer must hear of it
        outbox.put(("error", traceback.format_exc()))
