"""train.skip_zero_advantage (rlrun/recipes/skipping.py): completions of advantage 0 leave the train pass and the
old-policy pass, and the step's loss and gradients equal those of the run that computes them, for every head,
batching layout, GRPO loss and loss.agg; where a zero-advantage token still has a gradient (KL, entropy bonus) the
rows stay in and the run says why."""

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import HEADS, axes_of, history, tiny_model
from test_batching import rollout

from rlrun import registry
from rlrun.losses.bound import Objective
from rlrun.meters import Meter
from rlrun.recipes import grpo, skipping

ALL_LAYOUTS = list(registry.REGISTRY["batching"])
AGGS = ["token_mean", "seq_mean_token_mean"]


def micros_of(tok, micro_batch=3):
    """Three groups of 4 completions: group 0 all equal (advantage 0: micro-batch 0 has nothing to train), group 1
    with one completion at its group's mean (advantage exactly 0), group 2 all different; one row of group 2 has
    no valid token (as train.overlong=filter leaves a row)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14], [15, 16, 17]]
    lengths = [1, 12, 5, 1, 3, 12, 12, 2, 1, 1, 7, 12]
    roll = rollout(tok, prompts, lengths)
    roll.response_mask[9] = False
    adv = torch.tensor([0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 1.0, 0.5, 0.25, -0.5, 1.5, -1.25])
    return grpo.split_rollout(roll, adv, micro_batch)


def loss_cfg(loss="dapo", agg="token_mean", kl=0.0, entropy=0.0, tis=False):
    return SimpleNamespace(name=loss, clip_low=0.2, clip_high=0.28, kl_coef=kl, kl_estimator="k3", entropy_coef=entropy,
                           tis=SimpleNamespace(enabled=tis, cap=2.0, level="token", mode="truncate", low=0.5),
                           agg=agg, agg_max_tokens=None)


def step(model, micros, head, how, skip, lcfg):
    """The old-policy pass, then grpo.train_step on a perturbed copy of `model` -> (loss, stats parts, grads,
    layout counts, old-pass counts, the micro-batches with their old logprobs, the pass's mismatch sums)."""
    model = copy.deepcopy(model)
    cfg = SimpleNamespace(loss=lcfg)
    engine = SimpleNamespace(model=model, gather=lambda x: [x], world=1, device=torch.device("cpu"),
                             backward=lambda t, boundary=None: t.backward())
    ax = axes_of(head, 16, 0.9, how, 64, loss=lcfg, skip_zero_advantage=skip)
    s = SimpleNamespace(engine=engine, meter=Meter(torch.device("cpu")), axes=ax)
    micros, old_counts = copy.deepcopy(micros), {}
    with torch.no_grad():
        if ax.objective.skip_zero_advantage:
            passed, passed_old, old = skipping.logprobs(ax.layout, model, micros, ax.head, old_counts)
        else:
            passed, passed_old = micros, ax.layout.logprobs(model, micros, ax.head, old_counts)
            old = passed_old
    for mb, lp in zip(micros, old):
        mb.old_logprobs, mb.ref_logprobs = lp, lp + 0.03
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())))
    total, _, parts, layout = grpo.train_step(cfg, s, micros, 0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, parts, grads, layout, old_counts, micros, grpo.mismatch(passed, passed_old)


def trained_tokens(micros):
    return sum(int(m.mask.view(m.input_ids.shape[0], -1)[skipping.trained_rows(m)].sum()) for m in micros)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss", ["dapo", "cispo", "gspo"])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("how", ALL_LAYOUTS)
def test_loss_and_gradients_equal_the_run_that_computes_every_row(how, head, loss, agg):
    model, tok = tiny_model()
    micros = micros_of(tok)
    lcfg = loss_cfg(loss, agg, tis=loss == "cispo")
    ref_total, ref_parts, ref_grads, ref_layout, ref_old, ref_micros, _ = step(model, micros, head, how, False, lcfg)
    total, parts, grads, layout, old, got_micros, _ = step(model, micros, head, how, True, lcfg)
    assert abs(total - ref_total) <= 1e-5 * abs(ref_total) + 1e-7
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():  # every weight: backbone, embeddings, lm head
        assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), name
    # the statistics are over the trained tokens, but the policy-gradient term's, 0 on every dropped token
    n = trained_tokens(micros)
    assert n < sum(int(m.mask.sum()) for m in micros)
    assert parts["pg_loss"][1] == ref_parts["pg_loss"][1] and parts["ratio"][1] == n < ref_parts["ratio"][1]
    assert parts["pg_loss"][0] == pytest.approx(ref_parts["pg_loss"][0], rel=1e-5, abs=1e-7)
    # the old pass's logprobs of every trained row are the full pass's; the dropped rows' are never computed
    for m, got, ref in zip(micros, got_micros, ref_micros):
        rows = skipping.trained_rows(m)
        valid = m.mask.view(m.input_ids.shape[0], -1)[rows]
        mine, theirs = (x.old_logprobs.view(m.input_ids.shape[0], -1)[rows][valid] for x in (got, ref))
        assert torch.allclose(mine, theirs, atol=1e-5)
    # deterministic measures of the work left out: positions computed by the train and old passes, rows dropped
    assert layout["positions"] < ref_layout["positions"] and old["positions"] < ref_old["positions"]
    assert layout["forwards"] == ref_layout["forwards"] if how == "padded" else layout["forwards"] <= ref_layout[
        "forwards"]
    assert layout["skipped_rows"] == 6 and layout["rows"] == 12 and "skipped_rows" not in ref_layout
    assert layout["skipped_tokens"] == sum(int(m.mask.sum()) for m in micros) - n


def test_a_micro_batch_with_nothing_to_train_keeps_one_masked_row():
    """Under padded every micro-batch keeps its forward (the engine counts them; ZeRO's collectives run in each):
    one left with no row to train keeps its first row, every token masked."""
    _, tok = tiny_model()
    micros = micros_of(tok)
    kept, counts = skipping.drop(micros)
    assert [m.input_ids.shape[0] for m in kept] == [1, 1, 3, 2]
    assert not kept[0].mask.any() and torch.equal(kept[0].input_ids, micros[0].input_ids[:1])
    assert counts == {"rows": 12, "skipped_rows": 6,
                      "skipped_tokens": sum(int(m.mask.sum()) for m in micros) - trained_tokens(micros)}
    for m, k in zip(micros[1:], kept[1:]):  # every per-token field cut with its row
        rows = skipping.trained_rows(m)
        for f in skipping.PER_TOKEN:
            x = getattr(m, f)
            if x is not None:
                assert torch.equal(getattr(k, f), x.view(3, -1)[rows].reshape(-1)), f
        assert bool((k.advantages != 0).all())
    assert skipping.drop(kept[1:])[1]["skipped_rows"] == 0  # what is left has nothing more to drop


def test_the_mismatch_metric_is_over_the_trained_rows():
    """The old pass's logprobs of a dropped row are 0 (never read); the generator-vs-trainer mismatch is taken over
    the rows the pass computed, not against those zeros."""
    model, tok = tiny_model()
    micros = micros_of(tok)
    *_, ref_mismatch = step(model, micros, "dense", "padded", False, loss_cfg())
    *_, got_micros, got_mismatch = step(model, micros, "dense", "padded", True, loss_cfg())
    assert got_mismatch[2] == trained_tokens(micros) < ref_mismatch[2]
    assert got_mismatch[0] / got_mismatch[2] == pytest.approx(ref_mismatch[0] / ref_mismatch[2], rel=0.5)
    assert not got_micros[0].old_logprobs.any()


@pytest.mark.parametrize("lcfg, reason", [(loss_cfg(kl=0.05), "loss.kl_coef=0.05"),
                                          (loss_cfg(entropy=0.01), "loss.entropy_coef=0.01")])
def test_a_term_with_a_gradient_at_advantage_0_keeps_the_rows_in(lcfg, reason):
    o = Objective(lcfg, 12, skip_zero_advantage=True)
    assert not o.skip_zero_advantage and reason in o.kept_reason
    assert Objective(loss_cfg(), 12, skip_zero_advantage=True).skip_zero_advantage
    assert Objective(loss_cfg(), 12, skip_zero_advantage=False).kept_reason == "train.skip_zero_advantage=false"


@pytest.mark.slow  # two seeded runs of 5 steps (~15 s)
def test_a_seeded_run_gives_the_curves_of_the_run_without_it(tmp_path):
    """The default (on) against train.skip_zero_advantage=false, on a reward whose groups tie for half the prompts:
    the same samples, the loss and gradient norms to fp32 tolerance at every step, rows really dropped, and the tag
    says whether it is on."""
    from test_runs import SMOKE, assert_same_curves, run_in

    HALF = [SMOKE, "task.reward=helpers:half_constant_reward", "task.max_operand=6"]  # even answers: groups tie
    curves, tags = {}, {}
    for skip in ("true", "false"):
        _, client, r = run_in(tmp_path / skip, *HALF, "train.steps=5", "train.lr=1e-2", "rollout.max_new_tokens=6",
                              f"train.skip_zero_advantage={skip}")
        curves[skip] = {k: history(client, r.info.run_id, k) for k in ("loss", "reward_mean", "grad_norm")}
        curves[skip]["skipped"] = history(client, r.info.run_id, "system/passes/skipped_rows_frac")
        tags[skip] = r.data.tags["rlrun.skip_zero_advantage"]
    assert_same_curves(curves["true"], curves["false"])
    assert len(curves["true"]["skipped"]) == 5 and max(curves["true"]["skipped"]) > 0 and not curves["false"]["skipped"]
    assert tags == {"true": "on", "false": "off (train.skip_zero_advantage=false)"}
    _, client, r = run_in(tmp_path / "kl", SMOKE, "train.steps=1", "loss.kl_coef=0.01", "logprob_policy=always")
    assert "loss.kl_coef=0.01" in r.data.tags["rlrun.skip_zero_advantage"]
    assert not history(client, r.info.run_id, "system/passes/skipped_rows_frac")
