"""loss.agg and loss=gspo through every head, against a reference written from the formulas (objectives_reference.py,
float64, one sequence at a time): loss, gradients (hidden states and lm-head weight) and metrics of a whole
optimizer step of micro-batches with different token counts on two ranks (simulated here;
tests/distributed/test_distributed.py runs the same step on two real ranks), for each head x agg mode x dapo/cispo/gspo,
with KL k1/k3 and TIS."""

import pytest
import torch
from helpers import HEADS, LAYOUTS
from objectives_reference import SHAPES, make_step, micros_of, rank_step, reference, rel_err
from torch.utils.flop_counter import FlopCounterMode

from rlrun import registry
from rlrun.losses import agg, combine, gspo_loss, objective

LOSSES = ("dapo", "cispo", "gspo")
VARIANTS = [("k1", 1.5), ("k3", None)]  # (KL estimator, TIS cap)


def simulated_ranks(step):
    """A gather over the two ranks of SHAPES, as the engine's: every rank's counts, in rank order."""
    return lambda _mine: [agg.counts(micros_of(step, r)) for r in range(len(SHAPES))]


def run_ranks(step, head, loss, agg_mode, **kw):
    """(loss, grad hidden per rank and micro-batch, grad weight, metrics) of the step over both ranks: what the
    ranks' losses, their gradients all-reduced and their stats combined give."""
    got = [rank_step(step, r, head, loss, agg_mode, gather=simulated_ranks(step), **kw) for r in range(len(SHAPES))]
    return (sum(g[0] for g in got), [g[1] for g in got], sum(g[2] for g in got),
            combine([p for g in got for p in g[3]]))


def assert_matches(got, want, what):
    assert rel_err(got[0], want[0]) < 1e-5, f"{what}: loss {got[0]} vs {want[0]}"
    for r, per_rank in enumerate(want[1]):
        for m, grad in enumerate(per_rank):
            assert rel_err(got[1][r][m], grad) < 1e-5, f"{what}: grad hidden of rank {r} micro-batch {m}"
    assert rel_err(got[2], want[2]) < 1e-5, f"{what}: grad weight"
    expected = {k: v for k, v in want[3].items() if k != "loss"}
    assert got[3].keys() == expected.keys(), what
    for k, v in expected.items():
        assert got[3][k] == pytest.approx(v, rel=1e-5, abs=1e-7), f"{what}: metric {k}"


@pytest.mark.parametrize("kl,tis", VARIANTS, ids=["k1-tis", "k3"])
@pytest.mark.parametrize("agg_mode", agg.MODES)
@pytest.mark.parametrize("loss", LOSSES)
def test_every_head_matches_the_reference(loss, agg_mode, kl, tis):
    step = make_step()
    want = reference(step, loss, agg_mode, kl=kl, tis=tis)
    assert 0 < want[3]["clipfrac"] < 1  # the step exercises clipping (gspo: whole sequences) and its absence
    for head in HEADS:  # size 4: sequences span tiles, tiles span sequences
        assert_matches(run_ranks(step, head, loss, agg_mode, kl=kl, tis=tis, size=4), want, f"{head} {loss} {agg_mode}")


@pytest.mark.parametrize("agg_mode", agg.MODES)
def test_gspo_token_form_is_the_sequence_ratio_with_its_own_gradient(agg_mode):
    """The GSPO-token form rlrun computes (sg[s] p_t / sg[p_t]) against autograd through s = exp(mean(lp - old))
    itself: the same loss and gradients for every aggregation (weights equal within a sequence)."""
    step = make_step(1)
    token = reference(step, "gspo", agg_mode, kl="k3", tis=None, form="token")
    sequence = reference(step, "gspo", agg_mode, kl="k3", tis=None, form="sequence")
    assert rel_err(token[0], sequence[0]) < 1e-12
    assert rel_err(token[2], sequence[2]) < 1e-12
    for r in range(len(SHAPES)):
        for a, b in zip(token[1][r], sequence[1][r]):
            assert rel_err(a, b) < 1e-12


def test_the_aggregations_weigh_tokens_as_their_formulas_say():
    step = make_step()
    micros = micros_of(step, 0)
    tokens, seqs = agg.totals([agg.counts(micros_of(step, r)) for r in range(2)])
    lengths = [agg.lengths(m) for m in micros]
    assert tokens == sum(int(m.mask.sum()) for r in range(2) for m in micros_of(step, r))
    assert seqs == sum(int((agg.lengths(m) > 0).sum()) for r in range(2) for m in micros_of(step, r))
    assert (lengths[1] == 0).any()  # a row without a valid token is no sequence
    for mode, per_row in [("seq_mean_token_mean", lambda n: 1 / (seqs * n)), ("seq_mean_token_sum", lambda n: 1 / seqs),
                          ("seq_mean_token_sum_norm", lambda n: 1 / (seqs * 12))]:
        out, divisor, count = agg.prepare(micros, mode, 12, lambda _: [agg.counts(micros_of(step, r))
                                                                        for r in range(2)], False)
        assert divisor == 1 and count == tokens
        for m, mb, n_rows in zip(micros, out, lengths):
            width = m.mask.numel() // m.input_ids.shape[0]
            for b, n in enumerate(n_rows.tolist()):
                row = mb.weights[b * width : (b + 1) * width]
                assert torch.allclose(row[:n], torch.full((n,), per_row(max(n, 1)), dtype=torch.float32)), mode
                assert (row[n:] == 0).all()
    same, divisor, count = agg.prepare(micros, "token_mean", 12, lambda mine: [mine], False)
    assert all(a is b and a.weights is None and a.seq is None for a, b in zip(same, micros)) and divisor == count


def test_gspo_without_an_old_policy_pass_is_ratio_one():
    """logprob_policy=skip: no old logprobs, every sequence ratio is 1 (no sweep, nothing clipped), so gspo is the
    policy gradient -A * grad logprob, as dapo's under skip."""
    step = make_step(2)
    for head in HEADS:
        g = run_ranks(step, head, "gspo", "seq_mean_token_mean", kl=None, tis=None, size=4, skip_old=True)
        d = run_ranks(step, head, "dapo", "seq_mean_token_mean", kl=None, tis=None, size=4, skip_old=True)
        assert g[3]["ratio_min"] == g[3]["ratio_max"] == 1.0 and g[3]["clipfrac"] == 0.0
        assert rel_err(g[2], d[2]) < 1e-6 and rel_err(g[0], d[0]) < 1e-6


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("how", LAYOUTS)
def test_gspo_and_a_per_sequence_aggregation_through_packs_equal_padded(head, how):
    """Packs gather each token's weight and sequence id from its micro-batch (every sequence whole in one pack):
    the training step's loss, every weight's gradient and the metrics are padded's (test_batching's check)."""
    from helpers import tiny_model
    from test_batching import micros_of, step

    model, tok = tiny_model()
    micros = micros_of(tok)
    ref_total, ref_parts, ref_grads, *_ = step(model, micros, head, "padded", "gspo", agg="seq_mean_token_mean")
    total, parts, grads, *_ = step(model, micros, head, how, "gspo", agg="seq_mean_token_mean")
    assert ref_parts["ratio"][2] < 1 < ref_parts["ratio"][3]  # off-policy: sequence ratios on both sides of 1
    assert abs(total - ref_total) <= 1e-5 * abs(ref_total) + 1e-7
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), name
    for k, (s_, n, lo, hi) in parts.items():
        rs, rn, rlo, rhi = ref_parts[k]
        assert n == rn and abs(s_ - rs) <= 1e-5 * max(abs(rs), 1.0) and abs(lo - rlo) < 1e-5 and abs(hi - rhi) < 1e-5


def head_flops(head, loss, n=48, size=8):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, 16, generator=g, requires_grad=True)
    weight = (torch.randn(97, 16, generator=g) * 0.3).requires_grad_()
    targets, mask = torch.randint(0, 97, (n,), generator=g), torch.ones(n, dtype=torch.bool)
    adv, seq = torch.randn(n, generator=g), torch.arange(n) // 12
    f = objective(loss, adv, torch.full((n,), -4.5), seq=seq, mask=mask)
    with FlopCounterMode(display=False) as counter:
        out, _ = registry.get("head", head).loss(hidden, weight, targets, mask, f, n, 1.0, size)
        out.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("head", HEADS)
def test_gspo_costs_tiled_one_more_logits_matmul_and_the_others_nothing(head):
    """The extra cost of a sequence-level loss, counted: tiled sweeps its tiles once more without gradient (one
    [tokens, hidden] x [hidden, vocab] matmul: 2 N H V FLOPs); dense and chunked already hold every logprob."""
    extra = head_flops(head, "gspo") - head_flops(head, "dapo")
    assert extra == (2 * 48 * 16 * 97 if head == "tiled" else 0)


def test_a_sequence_level_objective_refuses_per_token_calls_before_its_ratios_are_fixed():
    f = objective("gspo", torch.zeros(3), torch.zeros(3), seq=torch.zeros(3, dtype=torch.long),
                  mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="sequence-level"):
        f(torch.zeros(3))
    assert objective("gspo", torch.zeros(3)).fix is None  # no old-policy pass: every ratio is 1
    assert objective("dapo", torch.zeros(3), torch.zeros(3)).fix is None


def test_gspo_loss_hand_computed():
    """Two sequences: log ratios (0.1, 0.3) -> s = e^0.2 (clipped at 1.0004 for A > 0), (-0.0001, 0.0001, 0) -> s = 1
    (inside). seq_mean_token_mean: (1/2) (clipped term + (-A2 * 1)); gradient only through the unclipped sequence:
    d/dlp_t = (1/2) (1/3) (-A2) s2 for each of its tokens."""
    old = torch.zeros(5)
    lp = torch.tensor([0.1, 0.3, -1e-4, 1e-4, 0.0], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0, -2.0])
    seq, mask = torch.tensor([0, 0, 1, 1, 1]), torch.ones(5, dtype=torch.bool)
    w = torch.tensor([1 / 4, 1 / 4, 1 / 6, 1 / 6, 1 / 6])  # 1 / (S L_s), S = 2
    total, m = gspo_loss(lp, old, adv, mask, seq, num_tokens=1, weights=w)
    assert total.item() == pytest.approx(0.5 * (-1.0004) + 0.5 * 2.0, rel=1e-6)
    assert m["clipfrac"] == pytest.approx(2 / 5) and m["ratio_max"] == pytest.approx(torch.e**0.2, rel=1e-6)
    total.backward()
    assert torch.allclose(lp.grad, torch.tensor([0, 0, 1 / 3, 1 / 3, 1 / 3]), atol=1e-6)


def test_library_gspo_defaults_are_the_config_defaults():
    from pathlib import Path

    from omegaconf import OmegaConf

    from rlrun.losses import gspo

    conf = OmegaConf.load(Path(__file__).resolve().parents[3] / "conf" / "loss" / "gspo.yaml")
    assert (gspo.CLIP_LOW, gspo.CLIP_HIGH) == (conf.clip_low, conf.clip_high) == (3e-4, 4e-4)  # GSPO's (section 5.1)


def test_the_heads_bench_runs_gspo_on_rlruns_heads_and_refuses_the_peers(tmp_path):
    from rlrun.tools import bench, bench_heads

    a = bench.parser().parse_args(["heads", "--loss", "gspo", "--tokens", "32", "--seqs", "4", "--hidden", "8",
                                   "--vocab", "50", "--tile-size", "8", "--impls", "dense,tiled", "--device", "cpu",
                                   "--tracking-uri", "none"])
    results = {}
    for name in ("dense", "tiled"):
        bench_heads.child(name, a, tmp_path / f"{name}.pt")
        results[name] = torch.load(tmp_path / f"{name}.pt")
    rows = bench_heads.heads_rows(["dense", "tiled"], results)
    assert rows[1]["err_loss"] < 1e-5 and rows[1]["err_grad_w"] < 1e-4 and rows[1]["err_grad_h"] < 1e-4
    assert bench_heads.format_table(rows, a).startswith("GSPO fwd+bwd")
    with pytest.raises(SystemExit):
        bench.main(["heads", "--loss", "gspo", "--impls", "dense,deepspeed", "--tracking-uri", "none"])


def test_the_plan_counts_what_the_objectives_add():
    from conftest import make_cfg

    from rlrun import plan
    from rlrun.config import validate

    cfg = validate(make_cfg("loss=gspo", "head=tiled", "loss.agg=seq_mean_token_sum"))
    assert plan.objective_parts(cfg, 1000, 100) == {
        "loss.agg=seq_mean_token_sum: per-token weights of the step (fp32)": 4000,
        "loss=gspo: per-token sequence ids of the step (int64)": 8000,
        "loss=gspo on tiled: logprobs of the first sweep (fp32)": 400}
    assert plan.objective_parts(validate(make_cfg()), 1000, 100) == {}  # dapo, token_mean: nothing
    text = plan.report(validate(make_cfg("train.dynamic_sampling=true", "loss=gspo")))
    assert "dynamic sampling: rollouts of 3 earlier round(s)" in text and "loss=gspo: per-token sequence ids" in text
