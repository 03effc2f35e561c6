"""Objectives against hand-computed values (DAPO, CISPO, KL estimators, TIS, token-level normalisation)."""

import math

import pytest
import torch

from rlrun.losses import cispo_loss, dapo_loss, kl, masked_total, objective, summarize

LN = math.log


def test_dapo_hand_computed_with_clipfrac():
    # ratios 1.5 (A>0, clipped at 1.28), 0.5 (A<0, clipped at 0.8 wins: -A*0.8 > -A*0.5), 1.1 (inside), masked.
    old = torch.zeros(4)
    lp = torch.tensor([LN(1.5), LN(0.5), LN(1.1), LN(9.0)], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0, 5.0])
    mask = torch.tensor([True, True, True, False])
    loss, m = dapo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # per token: max(-1*1.5, -1*1.28) = -1.28 ; max(0.5, 0.8) = 0.8 ; max(-2.2, -2.2) = -2.2
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2.2) / 3, abs=1e-6)
    assert m["clipfrac"] == pytest.approx(2 / 3)  # clipped term wins for tokens 1 (-1.28 > -1.5) and 2 (0.8 > 0.5)
    assert m["ratio_max"] == pytest.approx(1.5, rel=1e-6) and m["ratio_min"] == pytest.approx(0.5, rel=1e-6)
    loss.backward()
    # clipped tokens carry no gradient; the inside token's gradient is -A * ratio / n
    assert lp.grad[0].item() == 0 and lp.grad[1].item() == 0 and lp.grad[3].item() == 0
    assert lp.grad[2].item() == pytest.approx(-2.0 * 1.1 / 3, rel=1e-6)


def test_dapo_clipfrac_counts_token_where_clipped_term_wins_for_positive_advantage():
    lp = torch.tensor([LN(1.5)])
    loss, m = dapo_loss(lp, torch.zeros(1), torch.tensor([1.0]), torch.tensor([True]), clip_low=0.2, clip_high=0.28)
    # -1.5 vs -1.28: the max is the clipped term (-1.28), it wins
    assert loss.item() == pytest.approx(-1.28, abs=1e-6)
    assert m["clipfrac"] == 1.0


def test_cispo_hand_computed():
    lp = torch.tensor([LN(1.5), LN(0.5), LN(1.1)], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0])
    mask = torch.ones(3, dtype=torch.bool)
    loss, m = cispo_loss(lp, torch.zeros(3), adv, mask, clip_high=0.28)
    weights = torch.tensor([1.28, 0.5, 1.1])  # capped at 1.28, no lower bound
    expected = (-(adv * weights * lp.detach())).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert m["clipfrac"] == pytest.approx(1 / 3)  # share of tokens with ratio > cap
    loss.backward()
    # stop-gradient weight: d/dlp = -A * w / n
    assert torch.allclose(lp.grad, -adv * weights / 3, rtol=1e-6)


def test_cispo_optional_lower_bound():
    lp = torch.tensor([LN(0.5)], requires_grad=True)
    loss, m = cispo_loss(lp, torch.zeros(1), torch.tensor([1.0]), torch.tensor([True]), clip_high=0.28, clip_low=0.2)
    assert loss.item() == pytest.approx(-0.8 * LN(0.5), rel=1e-6)
    assert m["clipfrac"] == 1.0


@pytest.mark.parametrize("est,expected", [
    ("k1", lambda lp, ref: lp - ref),
    ("k2", lambda lp, ref: 0.5 * (ref - lp) ** 2),
    ("k3", lambda lp, ref: math.exp(ref - lp) - 1 - (ref - lp)),
])
def test_kl_estimators(est, expected):
    lp, ref = -1.2, -0.7
    assert kl(torch.tensor([lp]), torch.tensor([ref]), est).item() == pytest.approx(expected(lp, ref), rel=1e-6)


def test_kl_term_and_metric():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    loss, m = dapo_loss(lp, lp.detach(), torch.zeros(2), torch.ones(2, dtype=bool), ref_logprobs=ref, kl_coef=0.5,
                        kl_estimator="k1")
    k1 = torch.tensor([0.5, -1.0])
    assert loss.item() == pytest.approx(0.5 * k1.mean().item(), rel=1e-6)
    assert m["kl"] == pytest.approx(k1.mean().item(), rel=1e-6)


def test_truncated_importance_sampling_weights_policy_term():
    lp = torch.tensor([-1.0, -1.0])
    old = torch.tensor([-1.0, -1.0])
    gen = torch.tensor([-1.5, -0.5])  # weights exp(0.5)=1.65 and exp(-0.5)=0.61; cap 1.5
    adv = torch.tensor([1.0, 1.0])
    loss, m = dapo_loss(lp, old, adv, torch.ones(2, dtype=bool), gen_logprobs=gen, tis_cap=1.5)
    w = torch.tensor([1.5, math.exp(-0.5)])
    assert loss.item() == pytest.approx((-w).mean().item(), rel=1e-6)
    assert m["is_weight_max"] == pytest.approx(1.5) and m["is_weight_min"] == pytest.approx(math.exp(-0.5), rel=1e-6)


def test_skipped_old_pass_uses_detached_current_logprobs():
    lp = torch.tensor([-1.0, -3.0], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    f = objective("dapo", adv, None)
    loss_tok, stats = f(lp)
    assert torch.equal(stats["ratio"], torch.ones(2))  # ratio value 1 ...
    masked_total(loss_tok, torch.ones(2, dtype=bool), 2).backward()
    assert torch.allclose(lp.grad, -adv / 2)  # ... gradient intact: d(ratio)/d(lp) = 1


def test_global_token_count_makes_micro_batches_sum_to_full_batch():
    torch.manual_seed(0)
    lp = torch.randn(10, requires_grad=True)
    old = lp.detach() + 0.1 * torch.randn(10)
    adv, mask = torch.randn(10), torch.rand(10) > 0.3
    full, _ = dapo_loss(lp, old, adv, mask)
    n = int(mask.sum())
    parts = [dapo_loss(lp[s], old[s], adv[s], mask[s], num_tokens=n)[0] for s in (slice(0, 4), slice(4, 10))]
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-6)


def test_summarize_ignores_masked_tokens():
    stats = {"ratio": torch.tensor([1.0, 100.0]), "clipped": torch.tensor([1.0, 1.0])}
    m = summarize(stats, torch.tensor([True, False]))
    assert m["ratio_max"] == 1.0 and m["clipfrac"] == 1.0


def test_library_defaults_are_the_config_defaults():
    # the one-call library forms keep keyword defaults; they must be conf/loss/*.yaml's
    import inspect
    from pathlib import Path

    from omegaconf import OmegaConf

    from rlrun import losses
    from rlrun.losses.dpo import dpo_loss

    conf = Path(__file__).resolve().parents[3] / "conf" / "loss"
    dapo, cispo, dpo = (OmegaConf.load(conf / f"{n}.yaml") for n in ("dapo", "cispo", "dpo"))
    objective = inspect.signature(losses.objective).parameters
    for key in ("clip_low", "clip_high", "kl_coef", "kl_estimator", "entropy_coef"):
        assert objective[key].default == dapo[key], key
    assert objective["tis_cap"].default is None and not dapo.tis.enabled
    assert cispo.clip_low is None and cispo.clip_high == dapo.clip_high  # cispo_loss: clip_low=None, as its doc says
    for key in ("beta", "label_smoothing", "sft_coef"):
        assert inspect.signature(dpo_loss).parameters[key].default == dpo[key], key
