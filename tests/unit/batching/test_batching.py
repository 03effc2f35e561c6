"""batching=packed|shared_prompt compute what batching=padded computes (rlrun/batching): the mask never lets a
token see another sequence (packed) or another completion (shared_prompt); logprobs, loss, gradients and metrics
equal padded's to fp32 tolerance for every head and objective; seeded runs give padded's curves."""

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import HEADS, LAYOUTS, axes_of, history, tiny_model

from rlrun import batching, registry
from rlrun.config import ConfigError
from rlrun.meters import Meter
from rlrun.recipes import grpo
from rlrun.rollout import Rollout

PAD = 0


def rollout(tok, prompts, lengths, seed=0):
    """A rollout of len(lengths) rows: prompt i // group of `prompts` (left-padded), responses of the given valid
    lengths (right-padded, garbage after the end as generation leaves it)."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    group = rows // len(prompts)
    P, R = max(map(len, prompts)), max(lengths)
    ids = torch.full((rows, P + R), PAD)
    am = torch.zeros(rows, P + R, dtype=torch.long)
    for r in range(rows):
        p = prompts[r // group]
        ids[r, P - len(p):P], am[r, P - len(p):P] = torch.tensor(p), 1
        ids[r, P:] = torch.randint(4, len(tok), (R,), generator=g)
        am[r, P:P + lengths[r]] = 1
    response_mask = am[:, P:].bool()
    return Rollout(input_ids=ids, attention_mask=am, prompt_len=P, response_mask=response_mask,
                   gen_logprobs=torch.where(response_mask, -torch.rand(rows, R, generator=g) - 0.5, 0.0),
                   completions=[""] * rows, finished=torch.ones(rows, dtype=torch.bool))


def micros_of(tok, micro_batch=3):
    """Groups of 4 completions of 3 prompts of very different lengths: 1-token and long responses."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14], [15, 16, 17]]
    lengths = [1, 12, 5, 1, 3, 12, 12, 2, 1, 1, 7, 12]
    roll = rollout(tok, prompts, lengths)
    adv = torch.linspace(-1.0, 1.0, len(lengths))
    return grpo.split_rollout(roll, adv, micro_batch)


def allowed(p):
    """What a forward's mask must be, from its positions and targets alone: a unit starts where the positions
    restart at 0 (a padding position is a unit of its own); each completion's own positions are those that predict
    its targets but the first (which is its prompt's last); a query may see an earlier key of its row and unit, in
    the prompt (part 0) or in its own completion."""
    rows, width = p.input_ids.shape
    unit = (p.position_ids.flatten() == 0).cumsum(0)
    part = torch.zeros(rows * width, dtype=torch.long)
    start = 0
    for c, (_, flat) in enumerate(p.parts, 1):
        part[p.select[start + 1 : start + len(flat)]] = c
        start += len(flat)
    q, k = torch.meshgrid(torch.arange(rows * width), torch.arange(rows * width), indexing="ij")
    return (q // width == k // width) & (k <= q) & (unit[q] == unit[k]) & ((part[k] == 0) | (part[k] == part[q]))


def flat_mask(p):
    """The forward's [rows, 1, W, W] mask as one [rows * W, rows * W] matrix (rows never see each other)."""
    return torch.block_diag(*p.mask[:, 0])


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("max_tokens", [21, 60, 10_000])
def test_the_mask_never_crosses_a_sequence_or_a_completion(shared, max_tokens):
    """packed: a token sees its own sequence only, positions restart per sequence; shared_prompt: a completion
    sees its prompt and itself, its positions continue from the prompt's; every forward holds rows of at most the
    longest unit and at most max_tokens positions, every response token is computed once."""
    _, tok = tiny_model()
    micros = micros_of(tok)
    found = batching.units(batching.micro_rows(micros), shared=shared, max_tokens=max_tokens)
    # each group's prompt once (a group over max_tokens split, its prompt repeated), or each sequence
    assert len(found) == (12 if not shared else 3 if max_tokens >= 60 else 5)
    longest = max(len(u) for u in found)
    forwards = batching.packs(micros, shared=shared, max_tokens=max_tokens)
    for p in forwards:
        rows, width = p.input_ids.shape
        assert width <= longest and rows * width <= max(max_tokens, longest)
        assert torch.equal(flat_mask(p), allowed(p))
        start = 0
        for _, flat in p.parts:  # the prompt's last position, then the completion's, continuing from it
            sel = p.select[start : start + len(flat)]
            first = int(p.position_ids.flatten()[sel[0]])
            assert p.position_ids.flatten()[sel].tolist() == list(range(first, first + len(sel)))
            assert p.position_ids.flatten()[sel[0] - first] == 0  # the prompt starts at 0
            start += len(flat)
    assert max(len(p.input_ids) for p in forwards) > 1 or max_tokens < 2 * longest  # several rows per forward
    flat = sorted((m, f) for p in forwards for m, part in p.parts for f in part.tolist())
    assert flat == sorted((m, f) for m, mb in enumerate(micros) for f in mb.mask.nonzero().flatten().tolist())


def test_rows_are_first_fit_longest_first_and_nearly_full():
    sizes = [9, 1, 5, 5, 3, 2, 2, 8, 1, 4]
    found = [batching.Unit([torch.zeros(n)], []) for n in sizes]
    rows = batching.rows_of(found)
    assert [[len(u) for u in r] for r in rows] == [[9], [8, 1], [5, 4], [5, 3, 1], [2, 2]]


def test_every_target_is_predicted_from_the_token_before_it():
    _, tok = tiny_model()
    micros = micros_of(tok)
    for shared in (False, True):
        for p in batching.packs(micros, shared=shared, max_tokens=20):
            ids = p.input_ids.flatten()
            targets = batching.gather(p, [m.targets for m in micros])
            flat_prev = []
            for m, flat in p.parts:  # the token before each target in the padded row
                micro, r = micros[m], micros[m].input_ids.shape[1] - micros[m].prompt_len
                for f in flat.tolist():
                    flat_prev.append(int(micro.input_ids[f // r, micro.prompt_len + f % r - 1]))
            assert ids[p.select].tolist() == flat_prev
            assert len(targets) == len(p.select) and p.input_ids.numel() <= 20


def test_a_sequence_over_the_budget_is_refused_with_the_numbers():
    _, tok = tiny_model()
    with pytest.raises(ConfigError, match=r"batching.max_tokens=12 is smaller than one sequence .*9 prompt \+ 12 "
                                          r"response tokens = 21.*batching.max_tokens>=21"):
        batching.packs(micros_of(tok), shared=False, max_tokens=12)


def step(model, micros, head, how, loss="dapo", max_tokens=64, activations="keep", agg="token_mean", agree=None):
    """grpo.train_step on a copy of `model` with `head`, batching=`how`, `activations` and loss.agg=`agg` -> (loss,
    metrics parts, grads, micro-batches, layout counts)."""
    from rlrun import activations as acts

    model = copy.deepcopy(model)
    acts.apply(model, SimpleNamespace(name=activations, every=1))
    cfg = SimpleNamespace(
        loss=SimpleNamespace(name=loss, clip_low=0.2, clip_high=0.28, kl_coef=0.05 if loss == "cispo" else 0.0,
                             kl_estimator="k3", tis=SimpleNamespace(enabled=loss == "cispo", cap=2.0, level="token",
                                                                      mode="truncate", low=0.5),
                             entropy_coef=0.0, agg=agg, agg_max_tokens=None),
        rollout=SimpleNamespace(temperature=0.9, max_new_tokens=12),
        batching=SimpleNamespace(name=how, max_tokens=max_tokens),
        activations=SimpleNamespace(name=activations, every=1))
    boundaries = []
    engine = SimpleNamespace(model=model, gather=lambda x: [x], world=1, device=torch.device("cpu"),
                             backward=lambda t, boundary=None: (boundaries.append(boundary), t.backward()))
    s = SimpleNamespace(engine=engine, meter=Meter(torch.device("cpu")),
                        axes=axes_of(head, 16, 0.9, how, max_tokens, activations, loss=cfg.loss, agree=agree))
    micros = copy.deepcopy(micros)
    for kind in ("old", "ref"):  # the passes through the same layout, then a perturbed policy trains on them
        with torch.no_grad():
            passed = s.axes.layout.logprobs(model, micros, s.axes.head)
        for mb, lp in zip(micros, passed):
            setattr(mb, f"{kind}_logprobs", lp + (0.03 if kind == "ref" else 0.0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())))
    total, _, parts, layout = grpo.train_step(cfg, s, micros, 0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    layout["boundaries"] = boundaries
    return total, parts, grads, micros, layout


@pytest.mark.parametrize("loss", ["dapo", "cispo"])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("how", LAYOUTS)
def test_loss_gradients_and_metrics_equal_padded(head, how, loss):
    model, tok = tiny_model()
    micros = micros_of(tok)
    ref_total, ref_parts, ref_grads, ref_micros, padded = step(model, micros, head, "padded", loss)
    total, parts, grads, got_micros, layout = step(model, micros, head, how, loss)
    assert abs(total - ref_total) <= 1e-5 * abs(ref_total) + 1e-7
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():  # every weight: backbone, embeddings, lm head
        assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), name
    assert set(parts) == set(ref_parts)
    for k, (s_, n, lo, hi) in parts.items():
        rs, rn, rlo, rhi = ref_parts[k]
        assert n == rn and abs(s_ - rs) <= 1e-5 * max(abs(rs), 1.0) and abs(lo - rlo) < 1e-5 and abs(hi - rhi) < 1e-5
    for mb, ref in zip(got_micros, ref_micros):  # the logprob passes, back in each micro-batch's layout
        assert torch.allclose(mb.old_logprobs[mb.mask], ref.old_logprobs[ref.mask], atol=1e-5)
    assert layout["positions"] < padded["positions"] and 1 < layout["forwards"] < padded["forwards"]


@pytest.mark.parametrize("how", LAYOUTS)
@pytest.mark.parametrize("head", HEADS)
def test_a_sequence_that_fills_the_budget_exactly(head, how):
    """max_tokens = the longest sequence (9 prompt + 12 response tokens lay out 20 positions): a forward of one
    full row holds it; the 1-token responses beside it (predicted from their prompt's last position, laying out
    no position of their own) are computed too; loss, gradients and metrics are padded's."""
    model, tok = tiny_model()
    micros = micros_of(tok)
    assert min(int(m.mask.view(m.input_ids.shape[0], -1).sum(1).min()) for m in micros) == 1
    found = batching.packs(micros, how == "shared_prompt", 20)
    assert any(p.input_ids.shape == (1, 20) and not (p.position_ids[0, 1:] == 0).any() for p in found)
    ref_total, ref_parts, ref_grads, *_ = step(model, micros, head, "padded", "cispo")
    total, parts, grads, *_ = step(model, micros, head, how, "cispo", max_tokens=20)
    assert abs(total - ref_total) <= 1e-5 * abs(ref_total) + 1e-7
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), name
    for k, (s_, n, lo, hi) in parts.items():
        rs, rn, rlo, rhi = ref_parts[k]
        assert n == rn and abs(s_ - rs) <= 1e-5 * max(abs(rs), 1.0) and abs(lo - rlo) < 1e-5 and abs(hi - rhi) < 1e-5


@pytest.mark.parametrize("head", HEADS)
def test_a_rank_with_fewer_packs_runs_empty_ones_and_the_result_is_unchanged(head):
    """Under ZeRO every rank makes as many forwards and backwards: one with fewer packs runs empty ones (one
    padding token, no target), which add nothing; only the last backward is the accumulation boundary."""
    model, tok = tiny_model()
    micros = micros_of(tok)
    total, parts, grads, _, one = step(model, micros, head, "packed")
    # another rank makes 2 more forwards (the agreement setup binds to the layout: batching.agree(engine))
    total2, parts2, grads2, _, two = step(model, micros, head, "packed", agree=lambda n: n + 2)
    assert two["forwards"] == one["forwards"] + 2 and two["positions"] == one["positions"]
    assert two["boundaries"] == [False] * (two["forwards"] - 1) + [True]
    assert total2 == total and parts2 == parts
    assert all(torch.equal(g, grads2[n]) for n, g in grads.items())


def test_shared_prompt_computes_each_prompt_once():
    model, tok = tiny_model()
    micros = micros_of(tok)
    size = {shared: sum(len(u) for u in batching.units(batching.micro_rows(micros), shared, 64))
            for shared in (False, True)}
    # 3 groups of 4: 3 of each group's prompts (9 + 1 + 3 tokens) are not recomputed
    assert size[False] - size[True] == 3 * (9 + 1 + 3)
    *_, packed = step(model, micros, "dense", "packed")
    *_, shared = step(model, micros, "dense", "shared_prompt")
    assert shared["positions"] < packed["positions"] and shared["sequences"] == packed["sequences"] == 12


def test_every_pass_counts_positions_forwards_and_sequences():
    """The layout metrics of a logprob pass (and of training: the same counts): padded computes every micro-batch
    whole (4 micro-batches of 3 rows x 21 positions); packed its forwards' positions, far fewer."""
    model, tok = tiny_model()
    micros = micros_of(tok)
    counts = {}
    for how in ("padded", *LAYOUTS):
        counts[how] = {}
        a = axes_of("dense", 16, 1.0, how, 64)
        with torch.no_grad():
            a.layout.logprobs(model, micros, a.head, counts=counts[how])
    assert counts["padded"] == {"positions": 4 * 3 * 21, "forwards": 4, "sequences": 12}
    for how in LAYOUTS:
        found = batching.packs(micros, how == "shared_prompt", 64)
        assert counts[how] == {"positions": sum(p.input_ids.numel() for p in found), "forwards": len(found),
                               "sequences": 12}
    assert counts["shared_prompt"]["positions"] < counts["packed"]["positions"] < counts["padded"]["positions"]
    m = batching.metrics([{**counts["padded"], "real": 100}, {**counts["packed"], "real": 100}],
                         [{"old": counts["packed"]}, {"old": counts["shared_prompt"], "ref": counts["padded"]}])
    assert m["batching/train_positions"] == 252 + counts["packed"]["positions"]
    assert m["batching/train_seqs_per_forward"] == 24 / (4 + counts["packed"]["forwards"])
    assert m["batching/padding_frac"] == 1 - 200 / m["batching/train_positions"]
    assert m["batching/old_positions"] == counts["packed"]["positions"] + counts["shared_prompt"]["positions"]
    assert m["batching/ref_positions"] == 252 and m["batching/ref_seqs_per_forward"] == 3.0
    assert m["batching/rank_positions_ratio"] == 252 / counts["packed"]["positions"]
    assert m["batching/rank1/train_positions"] == counts["packed"]["positions"]


def test_a_budget_below_a_response_is_refused():
    from conftest import make_cfg

    from rlrun.config import validate

    with pytest.raises(ConfigError) as e:
        validate(make_cfg("batching=packed", "batching.max_tokens=8", "rollout.max_new_tokens=16"))
    assert "batching.max_tokens=8 cannot hold one sequence" in str(e.value)
    validate(make_cfg("batching=shared_prompt", "loss=dpo"))  # DPO packs its pairs too


PAIRS = [{"id": 0, "prompt": "1+1=", "chosen": "2", "rejected": "three hundred"},
         {"id": 1, "prompt": "12+30=", "chosen": "42, since 12+30 is 42", "rejected": "4"},
         {"id": 2, "prompt": "7=", "chosen": "7", "rejected": "seven"}]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("how", LAYOUTS)
def test_dpo_pairs_equal_padded(head, how):
    """DPO: chosen and rejected share their prompt (shared_prompt); sequence logprobs, loss and gradients are
    padded's."""
    from rlrun.losses.dpo import dpo_loss
    from rlrun.recipes.dpo import encode_pairs, pair_logprobs

    model, tok = tiny_model()
    batch = encode_pairs(tok, PAIRS, torch.device("cpu"))

    def run(name):
        m = copy.deepcopy(model)
        a = axes_of(head, 7, 1.0, name, 40)
        chosen, rejected = pair_logprobs(m, batch, a.head, a.layout, False)
        ref_chosen, ref_rejected = chosen.detach() - torch.tensor([0.3, -0.3, 0.1]), rejected.detach()
        loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1, label_smoothing=0.0,
                                 chosen_nll=None, sft_coef=0.0, num_pairs=len(PAIRS))
        loss.backward()
        return chosen, rejected, loss, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}, metrics

    ref, got = run("padded"), run(how)
    assert torch.allclose(got[0], ref[0], atol=1e-5) and torch.allclose(got[1], ref[1], atol=1e-5)
    assert abs(got[2].item() - ref[2].item()) < 1e-6
    for name, g in ref[3].items():
        assert torch.allclose(got[3][name], g, rtol=1e-4, atol=1e-6), name
    assert {"rewards/accuracy", "rewards/margin", "rewards/chosen", "rewards/rejected"} <= set(ref[4])
    assert 0 < ref[4]["rewards/accuracy"] < 1  # the pairs disagree, so accuracy is not trivially 0 or 1
    for key, value in ref[4].items():  # every DPO metric: rewards, accuracy, margin, logps
        assert got[4].keys() == ref[4].keys() and abs(got[4][key] - value) <= 1e-5 * max(abs(value), 1.0), key
    rows = list(batching.pair_rows(batch.input_ids, batch.attention_mask, batch.predicts))
    units = batching.units(rows, how == "shared_prompt", 40)
    assert len(units) == (3 if how == "shared_prompt" else 6)  # each pair's prompt once, or each sequence


@pytest.mark.slow  # three seeded runs (~20 s)
def test_seeded_runs_give_paddeds_curves(tmp_path):
    from test_runs import loss_curve

    _, ref, _ = loss_curve(tmp_path / "padded")
    for how in LAYOUTS:
        _, got, r = loss_curve(tmp_path / how, f"batching={how}", "batching.max_tokens=64")
        assert got["reward_mean"] == ref["reward_mean"]
        for key in ("loss", "grad_norm", "clipfrac"):
            assert torch.allclose(torch.tensor(got[key]), torch.tensor(ref[key]), rtol=1e-4, atol=1e-6), (how, key)
        for key in ("batching/padding_frac", "batching/train_positions"):  # the tails of rows only
            got_, ref_ = history_of(tmp_path / how, key), history_of(tmp_path / "padded", key)
            assert len(got_) == 5 and all(g <= r for g, r in zip(got_, ref_)), (how, key, got_, ref_)


@pytest.mark.slow  # 8 seeded runs (~60 s)
@pytest.mark.parametrize("how", LAYOUTS)
def test_offload_and_every_logprob_policy_compose_with_batching(tmp_path, how):
    """offload=on and logprob_policy=always|window|skip (with old-policy and reference passes that run, or are
    skipped) give the curves of the same run with batching=padded."""
    from test_runs import assert_same_curves, loss_curve

    for extra in (["offload=on", "logprob_policy=always", "loss.kl_coef=0.05"], ["logprob_policy=window",
                  "train.batch_size=4", "train.num_iterations=2"], ["logprob_policy=skip"]):
        name = "-".join(x.split("=")[1] for x in extra[:1])
        _, ref, _ = loss_curve(tmp_path / f"padded-{name}", *extra)
        _, got, r = loss_curve(tmp_path / f"{how}-{name}", *extra, f"batching={how}", "batching.max_tokens=64")
        assert_same_curves(got, ref)
        assert passes(r.data.metrics) == passes(runs_metrics(tmp_path / f"padded-{name}")), extra
        assert len(passes(r.data.metrics)) >= 4


def passes(metrics):
    """The logprob passes run and skipped (counts, not their estimated seconds)."""
    return {k: v for k, v in metrics.items() if k.startswith("system/passes/") and not k.endswith("_s_est")}


def runs_metrics(folder):
    from helpers import runs

    _, [r] = runs(folder / "mlflow.db")
    return r.data.metrics


def history_of(folder, key):
    from helpers import runs

    client, [r] = runs(folder / "mlflow.db")
    return history(client, r.info.run_id, key)


@pytest.mark.slow  # two seeded DPO runs (~10 s)
def test_a_seeded_dpo_run_gives_paddeds_curves(tmp_path):
    from test_runs import run_in

    curves, layout = {}, {}
    for how in ("padded", "shared_prompt"):
        _, client, r = run_in(tmp_path / how, "experiment=smoke", "loss=dpo", "train.steps=4", f"batching={how}")
        curves[how] = {k: history(client, r.info.run_id, k) for k in ("loss", "grad_norm", "rewards/margin",
                                                                      "rewards/accuracy")}
        layout[how] = {k: history(client, r.info.run_id, f"batching/{k}") for k in (
            "train_positions", "ref_positions", "padding_frac", "train_seqs_per_forward")}
    for key, ref in curves["padded"].items():
        assert len(ref) == 4 and torch.allclose(torch.tensor(curves["shared_prompt"][key]), torch.tensor(ref),
                                                rtol=1e-4, atol=1e-6), key
    padded, shared = layout["padded"], layout["shared_prompt"]  # each pair's prompt once: fewer positions
    assert all(s < p for s, p in zip(shared["train_positions"], padded["train_positions"]))
    assert len(shared["ref_positions"]) >= 1 and min(padded["padding_frac"]) > 0 == max(shared["padding_frac"])
    assert padded["train_seqs_per_forward"] == [8.0] * 4  # train.micro_batch=4 pairs: 8 sequences


@pytest.mark.parametrize("name", [n for n in LAYOUTS if registry.get("batching", n).packs])
def test_a_packing_layout_built_without_max_tokens_says_what_it_lacks(name):
    # built from no config, max_tokens was None and the first pack failed deep inside `units` with a TypeError
    with pytest.raises(ValueError, match="batching.max_tokens"):
        registry.get("batching", name)()
    assert registry.get("batching", name)(SimpleNamespace(max_tokens=64)).max_tokens == 64
