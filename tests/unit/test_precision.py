"""train.precision=bf16 (rlrun/precision.py): on engine=single fp32 master weights, gradients and AdamW state with the
backbone's forward under bf16 autocast; on engine=deepspeed DeepSpeed's bf16 block; the run says which path ran;
(slow) a short seeded bf16 run trains with every head."""

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import make_cfg
from helpers import HEADS
from test_batching import micros_of

from rlrun import axes, models, precision
from rlrun.config import validate
from rlrun.engine import single
from rlrun.meters import Meter
from rlrun.recipes import grpo


def train_once(*overrides):
    """One GRPO optimizer step (two micro-batches) of the tiny model through the single engine as a run sets it up;
    -> (engine, dtypes of the tensors the forward saved for backward, gradients before the step)."""
    cfg = validate(make_cfg("experiment=smoke", "train.batch_size=12", "train.micro_batch=6",
                            "train.rollout_batch=12", "train.group_size=4", *overrides))
    model, tok = models.build(cfg.model, 0)
    precision.apply(model, cfg)
    engine = single.Engine(cfg, model, None, grad_accum=2)
    saved = set()

    def pack(t):
        saved.add(t.dtype)
        return t

    s = SimpleNamespace(engine=engine, meter=Meter(torch.device("cpu")),
                        axes=axes.resolve(cfg, head_size=7, temperature=cfg.rollout.temperature))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        grpo.train_step(cfg, s, micros_of(tok, micro_batch=6), 0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    engine.step()
    return engine, saved, grads


@pytest.mark.parametrize("head", ["dense", "chunked"])
def test_bf16_keeps_fp32_master_weights_gradients_and_optimizer_state(head):
    ref_engine, ref_saved, ref_grads = train_once(f"head={head}")
    engine, saved, grads = train_once(f"head={head}", "train.precision=bf16")
    assert precision.autocasting(engine.model) and not precision.autocasting(ref_engine.model)
    assert torch.bfloat16 in saved and torch.bfloat16 not in ref_saved  # the forward computed in bf16 ...
    flat, ref_flat = (torch.cat([g.flatten() for g in x.values()]) for x in (grads, ref_grads))
    error = ((flat - ref_flat).norm() / ref_flat.norm()).item()
    assert 1e-5 < error < 0.05, error  # ... and its gradients are fp32's to bf16 accuracy
    params = dict(engine.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}  # the master weights
    assert {g.dtype for g in grads.values()} == {torch.float32} and grads.keys() == params.keys()
    state = engine.optimizer.state
    assert len(state) == len(params)
    for p in params.values():
        assert state[p]["exp_avg"].dtype == state[p]["exp_avg_sq"].dtype == torch.float32


def test_a_tiny_update_lands_on_the_fp32_master():
    """What the master copy is for: an AdamW step of lr 1e-6 moves fp32 weights, and would round away on almost all
    bf16 weights (one bf16 step of a weight of 0.02 is 1.2e-4, of a norm weight of 1 is 7.8e-3)."""
    engine, *_ = train_once("train.precision=bf16", "train.lr=1e-6", "train.lr_schedule=constant")
    fresh, _ = models.build(validate(make_cfg("experiment=smoke")).model, 0)
    before = dict(fresh.named_parameters())
    moved = bf16_moved = total = 0
    for name, p in engine.model.named_parameters():
        old = before[name].detach()
        moved += int((p.detach() != old).sum())
        bf16_moved += int((p.detach().bfloat16() != old.bfloat16()).sum())
        total += p.numel()
    assert moved > 0.9 * total and bf16_moved < 0.05 * total, (moved, bf16_moved, total)


def test_the_reference_copy_runs_under_autocast_too_and_deepcopies_keep_the_wrap():
    cfg = validate(make_cfg("experiment=smoke", "train.precision=bf16"))
    model, _ = models.build(cfg.model, 0)
    ref = copy.deepcopy(model).requires_grad_(False)
    for m in (model, ref):
        precision.apply(m, cfg)
    twin = copy.deepcopy(model)
    assert all(precision.autocasting(m) for m in (model, ref, twin))
    ids = torch.randint(4, 30, (2, 8))
    with torch.no_grad():
        a = models.hidden_states(models.split(model)[0], ids, torch.ones_like(ids))
        b = models.hidden_states(models.split(twin)[0], ids, torch.ones_like(ids))
    assert torch.equal(a, b)


def test_one_meaning_on_both_engines():
    from rlrun.engine.deepspeed import ds_config

    for overrides, path, ds_bf16 in [((), "fp32", False), (("train.precision=bf16",), "bf16-autocast", None),
                                     (("engine=deepspeed", "train.precision=bf16"), "bf16-deepspeed", True),
                                     (("engine=deepspeed", "train.precision=bf16", "engine.dtype=bf16"),
                                      "bf16-deepspeed", True),
                                     (("engine=deepspeed",), "fp32", False)]:
        cfg = validate(make_cfg("experiment=smoke", *overrides))
        assert precision.path(cfg) == path, overrides
        if ds_bf16 is not None and cfg.engine.name == "deepspeed":
            assert ds_config(cfg, 1)["bf16"] == {"enabled": ds_bf16}, overrides


@pytest.mark.slow  # three seeded runs of 24 steps after a (cached) warm start, ~1-2 min each on 2 cores
@pytest.mark.parametrize("head", HEADS)
def test_a_seeded_bf16_run_trains_with_every_head(tmp_path, head):
    from helpers import history
    from test_runs import run_in

    _, client, r = run_in(tmp_path, "train.precision=bf16", f"head={head}", "train.steps=24", "eval.every=0",
                          "export.enabled=false")
    assert r.data.tags["rlrun.precision"] == "bf16-autocast"
    loss, reward = (history(client, r.info.run_id, k) for k in ("loss", "reward_mean"))
    assert len(loss) == 24 and all(torch.isfinite(torch.tensor(loss)))
    first, last = sum(reward[:4]) / 4, sum(reward[-4:]) / 4
    assert last > first + 0.05, reward  # fp32 and bf16 (dense) go from ~0.71 to ~0.82 over these steps
