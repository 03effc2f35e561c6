"""The truth of `rlrun check` (rlrun/check/truth.py) and the probes that hold a configuration against it
(rlrun/check/objective.py): the truth's formulas against numbers worked by hand from the papers; the probes pass on
right configurations and fail on a fault injected into each objective term, normaliser and data-side decision
(faults the `vs baseline` probe cannot see: the baseline runs the same objective code and data path)."""

import contextlib
import math

import pytest
import torch
from conftest import make_cfg
from helpers import rewritten

from rlrun import check, losses, models
from rlrun.check import objective, steps, truth
from rlrun.config import validate
from rlrun.heads import dense
from rlrun.losses import agg, bound, cispo, dapo
from rlrun.recipes import grpo, sampling, skipping
from rlrun.rollout import Rollout

F64 = torch.float64


def t(*x):
    return torch.tensor(x, dtype=F64)


def seq(lp, old, adv=1.0, ref=None, gen=None, entropy=None):
    s = truth.Seq([0], [0] * len(lp), True, adv, t(*old), t(*(ref or old)), t(*(gen or old)))
    s.logprobs, s.entropy = t(*lp).requires_grad_(), t(*(entropy or [0.0] * len(lp)))
    return s


# -- the truth, by hand -------------------------------------------------------------------------------------------

def test_dapo_clips_where_the_clip_binds_and_passes_no_gradient_there():
    spec = truth.Spec("dapo", 0.2, 0.28)
    s = seq([math.log(1.5), math.log(0.5), math.log(1.1)], [0.0, 0.0, 0.0], adv=1.0)
    loss, ratio, clipped = truth.policy_term(spec, s)
    assert torch.allclose(loss, t(-1.28, -0.5, -1.1)) and clipped.tolist() == [1.0, 0.0, 0.0]
    loss.sum().backward()
    assert torch.allclose(s.logprobs.grad, t(0.0, -0.5, -1.1))  # d(-r)/dlp = -r where unclipped
    neg = seq([math.log(1.5), math.log(0.5)], [0.0, 0.0], adv=-1.0)
    loss, _, clipped = truth.policy_term(spec, neg)
    assert torch.allclose(loss, t(1.5, 0.8)) and clipped.tolist() == [0.0, 1.0]


def test_cispo_weights_the_logprob_by_the_detached_capped_ratio():
    spec = truth.Spec("cispo", None, 0.28)
    s = seq([math.log(1.5), math.log(0.1)], [0.0, 0.0], adv=2.0)
    loss, _, clipped = truth.policy_term(spec, s)
    assert torch.allclose(loss, t(-2 * 1.28 * math.log(1.5), -2 * 0.1 * math.log(0.1)))
    loss.sum().backward()
    assert torch.allclose(s.logprobs.grad, t(-2 * 1.28, -2 * 0.1)) and clipped.tolist() == [1.0, 0.0]


def test_gspo_clips_the_sequence_ratio_a_mean_over_its_tokens():
    spec = truth.Spec("gspo", 3e-4, 4e-4)
    inside = seq([1e-4, 3e-4], [0.0, 0.0], adv=1.0)  # s = exp(2e-4): inside the clip
    loss, ratio, clipped = truth.policy_term(spec, inside)
    assert torch.allclose(ratio, t(math.exp(2e-4), math.exp(2e-4))) and clipped.tolist() == [0.0, 0.0]
    loss.sum().backward()
    assert torch.allclose(inside.logprobs.grad, -ratio)  # gradient s_i per token (GSPO-token)
    outside = seq([0.1, 0.3], [0.0, 0.0], adv=1.0)  # s = exp(0.2): clipped at 1 + 4e-4, no gradient
    loss, _, clipped = truth.policy_term(spec, outside)
    loss.sum().backward()
    assert torch.allclose(loss, t(-1.0004, -1.0004)) and outside.logprobs.grad.abs().max() == 0


def test_the_kl_estimators_are_schulmans():
    lp, ref = t(-1.0), t(-2.0)  # log q = -1
    assert truth.kl_estimate(lp, ref, "k1").item() == pytest.approx(1.0)
    assert truth.kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5)
    assert truth.kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(-1))


def test_tis_truncates_or_masks_per_token_and_takes_the_product_per_sequence():
    s = seq([0.0, 0.0], [math.log(3.0), math.log(0.3)], gen=[0.0, 0.0])
    assert torch.allclose(truth.importance_weight(truth.Spec("dapo", 0.2, 0.28, tis_level="token", tis_cap=2.0), s),
                          t(2.0, 0.3))
    mask = truth.Spec("dapo", 0.2, 0.28, tis_level="token", tis_mode="mask", tis_cap=2.0, tis_low=0.5)
    assert truth.importance_weight(mask, s).tolist() == [0.0, 0.0]
    sequence = truth.Spec("dapo", 0.2, 0.28, tis_level="sequence", tis_cap=2.0)
    assert torch.allclose(truth.importance_weight(sequence, s), t(0.9, 0.9))  # 3 x 0.3


def test_each_aggregation_weights_tokens_as_its_paper_does():
    seqs = [seq([0.0], [0.0], adv=1.0), seq([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], adv=1.0)]  # pg term -1 per token
    want = {"token_mean": -4 / 4, "seq_mean_token_mean": -(1 / 1 + 3 / 3) / 2, "seq_mean_token_sum": -(1 + 3) / 2,
            "seq_mean_token_sum_norm": -(1 + 3) / (2 * 5)}
    for mode, value in want.items():
        loss, _, _ = truth.objective(truth.Spec("dapo", 0.2, 0.28, agg=mode, agg_max_tokens=5), seqs)
        assert loss.item() == pytest.approx(value), mode


def test_the_top_p_set_keeps_tokens_until_their_mass_reaches_top_p():
    z = torch.log(t(0.5, 0.3, 0.2))[None]
    lp = truth.filtered_log_softmax(z, 0.7, 0)[0]
    assert torch.allclose(lp[:2], torch.log(t(0.5 / 0.8, 0.3 / 0.8))) and lp[2] == float("-inf")
    assert truth.filtered_log_softmax(z, 0.5, 0)[0].isfinite().tolist() == [True, False, False]
    assert truth.filtered_log_softmax(z, 1.0, 2)[0].isfinite().tolist() == [True, True, False]
    # a drawn token the set leaves out (weights moved since the draw) stays in: rlrun's choice (docs/objectives.md)
    kept = truth.filtered_log_softmax(z, 0.5, 0, drawn=torch.tensor([2]))[0]
    assert torch.allclose(kept[[0, 2]], torch.log(t(0.5 / 0.7, 0.2 / 0.7))) and kept[1] == float("-inf")


def test_the_data_decisions_by_hand():
    assert truth.overlong_penalty(6, 10, 4, 1.0) == 0.0 and truth.overlong_penalty(8, 10, 4, 2.0) == -1.0
    assert truth.overlong_penalty(10, 10, 4, 1.0) == -1.0 and truth.overlong_penalty(11, 10, 4, 1.0) == -1.0
    a = truth.group_advantages([0.0, 1.0, 3.0, 3.0], 2, scale=True)
    assert a[0] == pytest.approx(-0.5 / (math.sqrt(0.5) + 1e-4)) and a[2:] == [0.0, 0.0]
    assert truth.group_advantages([0.0, 1.0], 2, scale=False) == [-0.5, 0.5]
    assert truth.informative_groups([1, 1, 0, 1, 2, 2], 2) == [False, True, False]
    assert truth.skips_zero_advantage(True, 0.0, 0.0) and not truth.skips_zero_advantage(True, 0.1, 0.0)


def test_dpo_by_hand():
    loss = truth.dpo(t(1.0), t(-1.0), t(0.0), t(0.0), beta=0.5, label_smoothing=0.0)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)))
    smoothed = truth.dpo(t(1.0), t(-1.0), t(0.0), t(0.0), beta=0.5, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(0.9 * math.log(1 + math.exp(-1)) + 0.1 * math.log(1 + math.exp(1)))


def test_the_truth_imports_nothing_of_the_training_code():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(truth.__file__).read_text())
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "dataclasses", "torch"}, imported


# -- the probes against it ----------------------------------------------------------------------------------------

CONTEXTS: dict = {}


def rows(*overrides) -> dict:
    """probe -> Row of the truth probes on the smoke config with `overrides` (one build per configuration: the
    faults below are injected into what the probes run, not into the build)."""
    if overrides not in CONTEXTS:
        with torch.random.fork_rng():
            CONTEXTS[overrides] = check.build(validate(make_cfg("experiment=smoke", *overrides)))
    with torch.random.fork_rng():
        return {r.probe: r for r in objective.truth_rows(CONTEXTS[overrides])}


RIGHT = [[], ["loss=cispo", "loss.kl_coef=0.1", "loss.kl_estimator=k2", "head=tiled", "batching=packed"],
         ["loss=gspo", "loss.tis.enabled=true", "loss.tis.level=sequence", "head=chunked",
          "batching=shared_prompt"],
         ["loss.tis.enabled=true", "loss.tis.mode=mask", "loss.entropy_coef=0.01", "rollout.temperature=0.7",
          "rollout.top_p=0.8", "activations=checkpoint"],
         ["loss.agg=seq_mean_token_sum_norm", "train.scale_advantages=false", "train.overlong=penalty",
          "train.overlong_buffer=3", "train.dynamic_sampling=true", "model.lora.enabled=true",
          "train.precision=bf16"],
         ["loss.agg=seq_mean_token_mean", "train.overlong=filter", "rollout.top_k=5", "loss.kl_coef=0.05",
          "loss.kl_estimator=k1"]]


@pytest.mark.slow  # a check build each (~4 s)
@pytest.mark.parametrize("overrides", RIGHT, ids=lambda o: " ".join(o) or "smoke")
def test_the_truth_probes_pass_on_configurations_that_are_right(overrides):
    got = rows(*overrides)
    assert set(got) == {"objective vs truth", "data decisions"}
    assert all(r.ok for r in got.values()), {k: r.measured for k, r in got.items()}


def test_the_probe_step_is_off_policy_enough_that_clips_and_caps_act():
    got = rows("loss.tis.enabled=true")["objective vs truth"]
    measured = got.measured
    low, high = (int(measured.split("clipped ")[1].split(" low / ")[i].split()[0]) for i in (0, 1))
    assert got.ok and low > 0 and high > 0, measured
    assert int(measured.split("token TIS ")[1].split()[0]) > 0, measured


def wrong_kl(estimator):
    def kl(logprobs, ref_logprobs, est="k3"):
        log_r = ref_logprobs - logprobs
        if est == estimator:
            return {"k1": log_r, "k2": log_r.square(), "k3": torch.expm1(log_r) + log_r}[est]  # a sign, a 1/2
        return {"k1": -log_r, "k2": 0.5 * log_r.square(), "k3": torch.expm1(log_r) - log_r}[est]

    return kl


def uncapped_tis(log_ratio, mode, cap, low):
    ratio = torch.exp(log_ratio)
    return ratio if mode == "truncate" else torch.where((ratio <= cap), ratio, torch.zeros_like(ratio))


def unmasked_sequence_is(old, gen, mask, rows_, mode, cap, low):  # the held-out trial's F04: padding summed in
    log_ratio = (old - gen).view(rows_, -1).sum(1, keepdim=True)
    return losses.tis_weight(log_ratio, mode, cap, low).expand(rows_, mask.numel() // rows_).reshape(-1).detach()


def mean_sequence_is(old, gen, mask, rows_, mode, cap, low):
    log_ratio = torch.where(mask.bool(), old - gen, 0.0).view(rows_, -1).mean(1, keepdim=True)  # mean, not sum
    return losses.tis_weight(log_ratio, mode, cap, low).expand(rows_, mask.numel() // rows_).reshape(-1).detach()


def swapped_dapo_clip(logprobs, old_logprobs, advantages, *, clip_low, clip_high, **_):
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_high, 1.0 + clip_low)
    loss = torch.maximum(-advantages * ratio, clipped)
    return loss, {"ratio": ratio.detach(), "clipped": (clipped > -advantages * ratio).float()}


def undetached_cispo(logprobs, old_logprobs, advantages, *, clip_high, clip_low=None, **_):
    ratio = torch.exp(logprobs - old_logprobs)
    weight = torch.clamp(ratio, max=1.0 + clip_high)  # the gradient flows through the weight too
    return -advantages * weight * logprobs, {"ratio": ratio.detach(), "clipped": (ratio > 1 + clip_high).float()}


def summed_sequence_ratio(values, seq, mask):
    valid = mask.bool()
    sums = values.new_zeros(int(seq.max()) + 1).index_add_(0, seq, torch.where(valid, values, 0.0))
    return sums[seq]  # GSPO's log ratio summed, not averaged, over the sequence


def seq_mean_without_length(micro, agg_mode, num_seqs, max_tokens):
    if agg_mode != "seq_mean_token_mean":
        return REAL["weights"](micro, agg_mode, num_seqs, max_tokens)
    return torch.where(micro.mask.bool(), torch.full(micro.mask.shape, 1.0 / num_seqs), 0.0)


def normaliser_times_accumulation(gathered):  # huggingface/trl#5619: T scaled by the micro-batches of a step
    return max(sum(c[0] for c in gathered), 1) * 2, max(sum(c[1] for c in gathered), 1)


def entropy_bonus_sign(monkeypatch):
    real = bound.objective

    def flipped(*args, **kwargs):
        f = real(*args, **kwargs)
        inner = f.per_token

        def per_token(logprobs, sl=slice(None), entropy=None):
            loss, stats = inner(logprobs, sl, entropy)
            return (loss + 2 * f.entropy_coef * entropy if entropy is not None else loss), stats

        f.per_token = per_token
        return f

    monkeypatch.setattr(bound, "objective", flipped)


def patched(target, name, value):
    def inject(monkeypatch):
        monkeypatch.setattr(target, name, value)

    return inject


def response_mask_past_eos(prompt_ids, prompt_mask, response, gen_logprobs, tokenizer):
    roll = REAL["from_response"](prompt_ids, prompt_mask, response, gen_logprobs, tokenizer)
    roll.response_mask = torch.ones_like(roll.response_mask)  # padding after EOS counted (trl#6369's class)
    return roll


@contextlib.contextmanager
def adapters_left_on(engine):
    yield engine.reference if engine.reference is not None else engine.model  # adapters not disabled


def strided_groups(rewards, group_size, scale=True):
    """Advantages over groups of every n-th row instead of consecutive rows (a permutation and its inverse)."""
    permuted = rewards.view(group_size, -1).t().reshape(-1)
    return REAL["group_advantages"](permuted, group_size, scale).view(-1, group_size).t().reshape(-1)


REAL = {"weights": agg.weights, "from_response": Rollout.from_response, "log_softmax": dense.log_softmax,
        "group_advantages": grpo.group_advantages}

FAULTS = [  # (what, inject, overrides, the probe that must fail)
    ("k1 sign", patched(losses, "kl", wrong_kl("k1")), ["loss.kl_coef=0.1", "loss.kl_estimator=k1"], "objective"),
    ("k2 without 1/2", patched(losses, "kl", wrong_kl("k2")), ["loss.kl_coef=0.1", "loss.kl_estimator=k2"],
     "objective"),
    ("k3 sign", patched(losses, "kl", wrong_kl("k3")), ["loss.kl_coef=0.1"], "objective"),
    ("TIS cap ignored", patched(losses, "tis_weight", uncapped_tis), ["loss.tis.enabled=true"], "objective"),
    ("TIS mask floor ignored", patched(losses, "tis_weight", uncapped_tis),
     ["loss.tis.enabled=true", "loss.tis.mode=mask"], "objective"),
    ("sequence TIS a mean", patched(bound, "sequence_is_weights",
                                    mean_sequence_is), ["loss.tis.enabled=true", "loss.tis.level=sequence"],
     "objective"),
    ("sequence TIS over padding too", patched(bound, "sequence_is_weights", unmasked_sequence_is),
     ["loss.tis.enabled=true", "loss.tis.level=sequence"], "objective"),
    ("DAPO bounds swapped", patched(dapo, "token_loss",
                                    swapped_dapo_clip), [], "objective"),
    ("CISPO weight not detached", patched(cispo, "token_loss",
                                          undetached_cispo), ["loss=cispo"], "objective"),
    ("GSPO ratio summed", patched(losses, "sequence_mean", summed_sequence_ratio), ["loss=gspo"], "objective"),
    ("seq_mean_token_mean without L_i", patched(agg, "weights", seq_mean_without_length),
     ["loss.agg=seq_mean_token_mean"], "objective"),
    ("normaliser x accumulation", patched(agg, "totals", normaliser_times_accumulation), [], "objective"),
    ("entropy bonus sign", entropy_bonus_sign, ["loss.entropy_coef=0.05"], "objective"),
    ("temperature left out of the head", patched(dense, "log_softmax",
                                                 lambda h, w, temperature, *a: REAL["log_softmax"](h, w, 1.0, *a)),
     ["rollout.temperature=0.7"], "objective"),
    ("overlong filter not applied", patched(sampling, "trained", lambda roll, train, stats=None: roll),
     ["train.overlong=filter"], "data"),
    ("overlong penalty buffer off by one", patched(sampling, "overlong_of", lambda n, m, b, f: torch.clamp(
        -(n - (m - b - 1)) / b * f, max=0.0)), ["train.overlong=penalty", "train.overlong_buffer=3"], "data"),
    ("skip drops negative advantages", patched(skipping, "trained_rows", lambda m: (
        m.advantages.view(m.input_ids.shape[0], -1)[:, 0] > 0) & m.mask.view(m.input_ids.shape[0], -1).any(1)),
     [], "data"),
    ("dynamic sampling keeps by the mean", patched(sampling, "informative", lambda shaped, g: (
        shaped.view(-1, g).mean(1) != 0).tolist()), ["train.dynamic_sampling=true"], "data"),
    ("groups strided", patched(grpo, "group_advantages", strided_groups), [], "data"),
    ("padding after EOS in the loss", patched(Rollout, "from_response", staticmethod(response_mask_past_eos)), [],
     "data"),
    ("adapters left on in the reference pass", patched(models, "reference", adapters_left_on),
     ["model.lora.enabled=true", "loss.kl_coef=0.1"], "data"),
    # the recipe's wiring (grpo.consume): the held-out trial's F11 and F12, and two more of their kind
    ("advantages from the raw reward", rewritten(grpo, "consume", "group_advantages(d.shaped,", "group_advantages("
                                                 "reward,"), ["train.overlong=penalty", "train.overlong_buffer=3"],
     "data"),
    ("the skip's old pass written to the first rows", rewritten(
        skipping, "logprobs", "out.view(m.input_ids.shape[0], -1)[rows] =",
        "out.view(m.input_ids.shape[0], -1)[: int(rows.sum())] ="), ["logprob_policy=always"], "data"),
    ("the old logprobs as the reference", rewritten(grpo, "consume", "mb.ref_logprobs = lp",
                                                    "mb.ref_logprobs = mb.old_logprobs"),
     ["logprob_policy=always", "loss.kl_coef=0.1"], "data"),
    # how the recipe draws (check/draws.py): the held-out trial's F30 and F14
    ("one seed per prompt group", rewritten(sampling, "prompts_of", "first_row + i, round_)",
                                            "first_row + i // t.group_size, round_)"), [], "data"),
    ("dynamic sampling's rounds judged on the raw reward", rewritten(
        sampling, "draw", "informative(rounds[-1].shaped,", "informative(torch.tensor(rounds[-1].totals),"),
     ["train.dynamic_sampling=true", "train.overlong=penalty", "train.overlong_buffer=3"], "data"),
    ("one copy of a rollout for num_iterations", rewritten(grpo, "consume", "buffer.add(micros, t.num_iterations)",
                                                           "buffer.add(micros, 1)"), ["train.num_iterations=2"],
     "data"),
]
PROBE = {"objective": "objective vs truth", "data": "data decisions"}


@pytest.mark.slow  # a check build per configuration (~4 s), the probes (~1 s)
@pytest.mark.parametrize("what,inject,overrides,probe", FAULTS, ids=[f[0] for f in FAULTS])
def test_each_injected_fault_fails_its_truth_probe_and_passes_without_it(monkeypatch, what, inject, overrides,
                                                                         probe):
    assert rows(*overrides)[PROBE[probe]].ok, rows(*overrides)[PROBE[probe]].measured  # right without the fault
    inject(monkeypatch)
    got = rows(*overrides)[PROBE[probe]]
    assert got.ok is False, f"{what}: {got.measured}"


@pytest.mark.parametrize("overrides", [[], ["rollout.temperature=0.7", "rollout.top_p=0.8"], ["rollout.top_k=3"]],
                         ids=["plain", "tempered top-p", "top-k"])
def test_the_sampler_s_draws_follow_the_filtered_distribution_and_a_biased_one_fails(monkeypatch, overrides):
    """The held-out trial's F19: the Gumbel trick missing its log (logp + Exp(1)) draws from another distribution,
    and every probe that takes the drawn tokens as given passed it."""
    from rlrun.check import draws
    from rlrun.rollout import hf

    cfg = validate(make_cfg("experiment=smoke", *overrides))
    said, ok = draws.sampler_draws(cfg)
    assert ok is True, said
    rewritten(hf, "perturbed", "return logp - torch.log(exponential.clamp_(min=1e-20))",
              "return logp + exponential")(monkeypatch)
    said, ok = draws.sampler_draws(cfg)
    assert ok is False, said


@pytest.mark.slow  # a check build (~4 s)
def test_a_recipe_schedule_off_its_definition_fails_the_logprob_schedule(monkeypatch):
    """The held-out trial's F12: the window without num_iterations (the old pass skipped for a rollout whose second
    pass trains after a step) passed, since the probe computed the schedule itself."""
    ctx = CONTEXTS.get(("train.num_iterations=2",)) or check.build(validate(make_cfg("experiment=smoke",
                                                                                     "train.num_iterations=2")))
    assert steps.logprob_schedule(ctx).ok is True
    rewritten(grpo, "schedule", ") * t.num_iterations", ")")(monkeypatch)
    row = steps.logprob_schedule(ctx)
    assert row.ok is False and "window 2, " in row.measured, row


@pytest.mark.slow  # a check build (~4 s)
def test_a_nan_beside_exact_numbers_fails_the_probe(monkeypatch):
    """max(0.0, nan) is 0.0 in Python: a NaN gradient beside an exact loss must still fail."""
    assert rows()["objective vs truth"].ok
    monkeypatch.setattr(objective, "rel_grads", lambda got, want: float("nan"))
    assert rows()["objective vs truth"].ok is False


# -- DPO against its truth ----------------------------------------------------------------------------------------

def dpo_rows(*overrides) -> dict:
    from rlrun.check import dpo as check_dpo

    key = ("dpo", *overrides)
    if key not in CONTEXTS:
        with torch.random.fork_rng():
            cfg = validate(make_cfg("experiment=smoke", "loss=dpo", *overrides))
            CONTEXTS[key] = check_dpo.build(cfg, check.baseline_config)
    with torch.random.fork_rng():
        return {r.probe: r for r in check_dpo.truth_rows(CONTEXTS[key])}


def swapped_cache(monkeypatch):
    from rlrun.recipes import dpo as recipe

    real = recipe.reference_logprobs

    def swapped(cfg, s, cache, batch):
        known, counts, layout = real(cfg, s, cache, batch)
        return {k: (r, c) for k, (c, r) in known.items()}, counts, layout  # chosen and rejected swapped

    monkeypatch.setattr(recipe, "reference_logprobs", swapped)


def dpo_loss_with(**wrong):
    def inject(monkeypatch):
        from rlrun.losses import dpo as loss

        real = loss.dpo_loss

        def faulty(pc, pr, rc, rr, *, beta=0.1, label_smoothing=0.0, chosen_nll=None, sft_coef=0.0, num_pairs=None):
            if "smoothing_sign" in wrong:  # the smoothed term with the margin's sign
                return real(pc, pr, rc, rr, beta=beta, label_smoothing=-label_smoothing, chosen_nll=chosen_nll,
                            sft_coef=sft_coef, num_pairs=num_pairs)
            if "nll_summed" in wrong:  # the SFT term on the chosen's summed NLL, not its mean
                return real(pc, pr, rc, rr, beta=beta, label_smoothing=label_smoothing, chosen_nll=-pc,
                            sft_coef=sft_coef, num_pairs=num_pairs)
            return real(pc, pr, rc, rr, beta=beta * beta, label_smoothing=label_smoothing,  # beta applied twice
                        chosen_nll=chosen_nll, sft_coef=sft_coef, num_pairs=num_pairs)

        monkeypatch.setattr(loss, "dpo_loss", faulty)

    return inject


DPO_FAULTS = [
    ("reference cache chosen and rejected swapped", swapped_cache, [], "data"),
    ("adapters left on in the reference pass", patched(models, "reference", adapters_left_on),
     ["model.lora.enabled=true"], "data"),
    ("beta applied twice", dpo_loss_with(beta_twice=True), [], "objective"),
    ("label smoothing's sign", dpo_loss_with(smoothing_sign=True), ["loss.label_smoothing=0.1"], "objective"),
    ("SFT term on the summed NLL", dpo_loss_with(nll_summed=True), ["loss.sft_coef=0.5"], "objective"),
]


@pytest.mark.slow  # a DPO check build per configuration (~3 s)
@pytest.mark.parametrize("overrides", [[], ["head=chunked", "batching=packed", "loss.label_smoothing=0.1",
                                            "loss.sft_coef=0.5", "loss.average_logprobs=true"],
                                       ["model.lora.enabled=true", "batching=shared_prompt", "train.precision=bf16"]],
                         ids=["dpo", "chunked-packed-smoothed-sft-average", "lora-shared-bf16"])
def test_the_dpo_truth_probes_pass_on_configurations_that_are_right(overrides):
    got = dpo_rows(*overrides)
    assert all(r.ok for r in got.values()), {k: r.measured for k, r in got.items()}


@pytest.mark.slow  # a DPO check build per configuration (~3 s)
@pytest.mark.parametrize("what,inject,overrides,probe", DPO_FAULTS, ids=[f[0] for f in DPO_FAULTS])
def test_each_injected_dpo_fault_fails_its_truth_probe(monkeypatch, what, inject, overrides, probe):
    assert dpo_rows(*overrides)[PROBE[probe]].ok
    inject(monkeypatch)
    got = dpo_rows(*overrides)[PROBE[probe]]
    assert got.ok is False, f"{what}: {got.measured}"


# -- master weights: AdamW written apart, the precision's claimed compute dtype ------------------------------------

def test_adamw_s_first_step_by_hand():
    w, g = t(1.0, -2.0), t(0.5, -1e-3)
    step = truth.adamw_first_step(w, g, lr=0.1, weight_decay=0.01)
    assert torch.allclose(step, t(-0.1 * (0.5 / (0.5 + 1e-8) + 0.01), -0.1 * (-1e-3 / (1e-3 + 1e-8) - 0.02)))


def master_row(*overrides):
    cfg = validate(make_cfg("experiment=smoke", *overrides))
    with torch.random.fork_rng():
        ctx = check.build(cfg)
        return steps.master_weights(ctx)


@pytest.mark.slow  # a check build each (~3 s)
def test_master_weights_holds_the_run_s_optimizer_to_adamw_written_apart(monkeypatch):
    assert master_row().ok
    from rlrun.engine import single

    real = single.optimizer

    def lr_scaled(model, train_cfg):  # the run's builder with the learning rate scaled (a warm-up factor kept)
        import dataclasses

        return real(model, dataclasses.replace(train_cfg, lr=train_cfg.lr * 0.5))

    monkeypatch.setattr(single, "optimizer", lr_scaled)
    got = master_row()
    assert got.ok is False and "update max rel diff" in got.measured, got.measured


@pytest.mark.slow  # a check build (~3 s)
def test_master_weights_fails_a_precision_that_does_not_compute_in_its_claimed_dtype(monkeypatch):
    """huggingface/trl#4867's class: a precision knob whose path leaves the activations as they were."""
    row = master_row("train.precision=bf16")
    assert row.ok and "matmuls bfloat16" in row.measured, row.measured
    from rlrun import precision

    monkeypatch.setattr(precision, "_autocast", lambda model: None)  # bf16 claimed, nothing autocast
    row = master_row("train.precision=bf16")
    assert row.ok is False and "matmuls float32" in row.measured, row.measured
