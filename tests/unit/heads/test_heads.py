"""tiled and chunked reproduce dense (loss, both gradients, every metric) and never build [tokens, vocab] logits."""

import contextlib
import itertools

import pytest
import torch
from helpers import HEAD_ALTERNATIVES, HEADS, tiled_heads
from torch.utils._python_dispatch import TorchDispatchMode

from rlrun import registry
from rlrun.losses import objective, summarize

N, H, V = 37, 24, 97


def inputs(seed=0, masked_tile=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.2
    targets = torch.randint(0, V, (N,), generator=g)
    mask = torch.rand(N, generator=g) > 0.25
    if masked_tile:
        mask[8:16] = False  # with size 8, the second tile has no valid token
    adv = torch.randn(N, generator=g)
    noise = lambda s: s * torch.randn(N, generator=g)  # noqa: E731
    return hidden, weight, targets, mask, adv, noise


def run_head(name, hidden, weight, targets, mask, make_objective, temperature, size, top_p=1.0, top_k=0):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    head = registry.get("head", name)
    loss, stats = head.loss(h, w, targets, mask, make_objective(), int(mask.sum()), temperature, size, top_p=top_p,
                            top_k=top_k)
    loss.backward()
    return loss.detach(), h.grad, w.grad, summarize(stats, mask)


def assert_close(a, b, what):
    err = ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
    assert err < 1e-5, f"{what}: max relative error {err:.2e}"


CASES = list(itertools.product(["dapo", "cispo"], [None, "k1", "k2", "k3"], [1.0, 0.7], [False, True]))


@pytest.mark.parametrize("loss_name,kl_est,temperature,tis", CASES)
@pytest.mark.parametrize("size", [8, 5, 1000])  # 8: tile without valid token; 5: does not divide 37; 1000: > tokens
def test_heads_match_dense(loss_name, kl_est, temperature, tis, size):
    hidden, weight, targets, mask, adv, noise = inputs(masked_tile=True)
    with torch.no_grad():
        cur = registry.get("head", "dense").logprobs(hidden, weight, targets, temperature)
    old, ref, gen = cur + noise(0.5), cur + noise(0.2), cur + noise(0.1)

    def make_objective():
        return objective(loss_name, adv, old, ref if kl_est else None, gen,
                         clip_low=0.2 if loss_name == "dapo" else None, clip_high=0.28,
                         kl_coef=0.05 if kl_est else 0.0, kl_estimator=kl_est or "k3",
                         tis_cap=1.5 if tis else None)

    dense = run_head("dense", hidden, weight, targets, mask, make_objective, temperature, size)
    assert 0 < dense[3]["clipfrac"] < 1  # the case exercises clipping on both sides of the mask
    for name in HEAD_ALTERNATIVES:
        got = run_head(name, hidden, weight, targets, mask, make_objective, temperature, size)
        assert_close(got[0], dense[0], f"{name} loss")
        assert_close(got[1], dense[1], f"{name} grad hidden")
        assert_close(got[2], dense[2], f"{name} grad weight")
        assert got[3].keys() == dense[3].keys()
        for k in dense[3]:
            assert got[3][k] == pytest.approx(dense[3][k], rel=1e-5, abs=1e-7), f"{name} metric {k}"


@pytest.mark.parametrize("loss_name,entropy_coef,temperature", [("dapo", 0.01, 1.0), ("cispo", 0.3, 0.7),
                                                                  ("dapo", -0.2, 1.3)])
@pytest.mark.parametrize("size", [8, 5, 1000])
def test_entropy_bonus_matches_dense_autograd(loss_name, entropy_coef, temperature, size):
    """loss - entropy_coef * entropy: tiled and chunked carry the entropy's gradient by hand; dense is autograd."""
    hidden, weight, targets, mask, adv, noise = inputs(3, masked_tile=True)

    def make_objective():
        return objective(loss_name, adv, None, clip_low=0.2 if loss_name == "dapo" else None, clip_high=0.28,
                         entropy_coef=entropy_coef)

    dense = run_head("dense", hidden, weight, targets, mask, make_objective, temperature, size)
    plain = run_head("dense", hidden, weight, targets, mask,
                     lambda: objective(loss_name, adv, None, clip_low=0.2 if loss_name == "dapo" else None),
                     temperature, size)
    assert (dense[2] - plain[2]).abs().max() > 1e-3 * plain[2].abs().max()  # the bonus moves the gradient
    for name in HEAD_ALTERNATIVES:
        got = run_head(name, hidden, weight, targets, mask, make_objective, temperature, size)
        assert_close(got[0], dense[0], f"{name} loss")
        assert_close(got[1], dense[1], f"{name} grad hidden")
        assert_close(got[2], dense[2], f"{name} grad weight")
        assert got[3]["entropy"] == pytest.approx(dense[3]["entropy"], rel=1e-6)


@pytest.mark.parametrize("name", HEADS)
def test_entropy_metric_is_the_tempered_distributions_entropy(name):
    hidden, weight, targets, mask, adv, _ = inputs(4)
    logits = (hidden @ weight.T) / 0.8
    expected = torch.distributions.Categorical(logits=logits).entropy()[mask].mean().item()
    f = objective("dapo", adv, None)
    _, stats = registry.get("head", name).loss(hidden, weight, targets, mask, f, int(mask.sum()), 0.8, 6)
    assert summarize(stats, mask)["entropy"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("name", HEAD_ALTERNATIVES)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_match_dense_with_and_without_grad(name, temperature):
    hidden, weight, targets, *_ = inputs(1)
    ref = registry.get("head", "dense").logprobs(hidden, weight, targets, temperature)
    with torch.no_grad():
        got = registry.get("head", name).logprobs(hidden, weight, targets, temperature, 6)
        assert_close(got, ref, "no-grad logprobs")
    # with grad: any loss on top (here a weighted sum) gets dense's gradients
    coef = torch.randn(N)
    grads = []
    for head in ("dense", name):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        (registry.get("head", head).logprobs(h, w, targets, temperature, 6) * coef).sum().backward()
        grads.append((h.grad, w.grad))
    assert_close(grads[1][0], grads[0][0], "grad hidden")
    assert_close(grads[1][1], grads[0][1], "grad weight")


def test_bf16_weight_accumulates_in_fp32():
    hidden, weight, targets, *_ = inputs(2)
    ref = registry.get("head", "dense").logprobs(hidden.bfloat16().float(), weight.bfloat16().float(), targets)
    got = registry.get("head", "chunked").logprobs(hidden.bfloat16(), weight.bfloat16(), targets, 1.0, 8)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05  # bf16 matmul, fp32 logsumexp


def grad_errors(head, h, w, targets, adv, temperature=0.9, size=64, forward=contextlib.nullcontext):
    """Relative L2 errors of dloss/dh and dloss/dW of `head` ('naive': a bf16 matmul whose logits are cast to fp32
    afterwards, what dense did before) against fp64 on the same inputs (bf16 inputs are exact in fp64); the head's
    forward runs in the context `forward()`, its backward outside."""
    n = targets.shape[0]
    mask = torch.ones(n, dtype=torch.bool)

    def grads(x, y, call):
        x, y = x.clone().requires_grad_(), y.clone().requires_grad_()
        f = objective("dapo", adv.to(x.dtype), None, None, None, clip_low=0.2, clip_high=0.28)
        call(x, y, f).backward()
        return x.grad.double(), y.grad.double()

    def plain(x, y, f):  # dense by hand: fp64 for the reference, bf16 matmul then fp32 for 'naive'
        logp = torch.log_softmax((x @ y.T).to(torch.float64 if x.dtype == torch.float64 else torch.float32)
                                 / temperature, -1)
        return f(logp.gather(-1, targets[:, None]).squeeze(-1), slice(None), None)[0].sum() / n

    ref = grads(h.double(), w.double(), plain)
    if head == "naive":
        got = grads(h, w, plain)
    else:
        def call(x, y, f):
            with forward():
                return registry.get("head", head).loss(x, y, targets, mask, f, n, temperature, size)[0]

        got = grads(h, w, call)
    return [((a - b).norm() / b.norm()).item() for a, b in zip(got, ref)]


def bf16_case(n=256, vocab=32768, hidden=64):
    """Logits of std ~10, as a trained LM's: their bf16 rounding (~0.04 at 10) is what moves the softmax."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, generator=g) * 10 / hidden**0.5).bfloat16()
    return h, w, torch.randint(0, vocab, (n,), generator=g), torch.randn(n, generator=g)


def test_bf16_gradients_are_as_accurate_as_dense_and_better_than_a_bf16_matmul():
    """Vocab 32768, bf16 hidden states and lm-head weight (DeepSpeed's bf16 mode): each head computes the logits and
    softmax in fp32 (heads/common.py `logits`), so tiled's and chunked's gradients w.r.t. both are at least as
    close to fp64 as dense's, and what remains is the bf16 storage of the gradient itself (~2^-9). A bf16 matmul
    with its logits cast to fp32 afterwards (Liger #1432) is several times further off."""
    h, w, targets, adv = bf16_case()
    err = {head: grad_errors(head, h, w, targets, adv) for head in ("naive", "dense", *HEAD_ALTERNATIVES)}
    for head in HEAD_ALTERNATIVES:
        for i, what in enumerate(("hidden", "lm-head weight")):
            assert err[head][i] <= err["dense"][i] * (1 + 1e-6), (head, what, err)
            assert err[head][i] < 2**-8, (head, what, err)  # bf16's own rounding of the stored gradient
            assert err["naive"][i] > 5 * err[head][i], (head, what, err)


@pytest.mark.parametrize("name", HEADS)
def test_heads_ignore_a_callers_autocast(name):
    """train.precision=bf16 on engine=single: fp32 master weights, the backbone's forward under autocast. A head
    called inside an autocast region still computes fp32 logits from the fp32 weight: its gradients are
    fp32-accurate, where a bf16 matmul would be ~2% off."""
    h, w, targets, adv = bf16_case()
    errors = grad_errors(name, h.float(), w.float(), targets, adv,
                         forward=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert max(errors) < 1e-5, errors


class MaxTensor(TorchDispatchMode):
    """Largest tensor any op produces: a deterministic stand-in for 'did the full logits ever exist'."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def saved_bytes(fn):
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(total), out


@pytest.mark.parametrize("name", tiled_heads())
def test_memory_is_one_tile_not_all_tokens(name):
    n, h, v, size = 512, 16, 2000, 64
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    mask = torch.ones(n, dtype=torch.bool)
    adv = torch.randn(n, generator=g)

    def step(head):
        f = objective("dapo", adv, None)
        loss, _ = registry.get("head", head).loss(hidden, weight, targets, mask, f, n, 1.0, size)
        return loss

    dense_saved, _ = saved_bytes(lambda: step("dense"))
    assert dense_saved >= n * v * 4  # dense keeps at least the [tokens, vocab] fp32 logits for backward

    with MaxTensor() as mode:
        saved, loss = saved_bytes(lambda: step(name))
        loss.backward()
    # saved for backward: O(tokens x hidden + vocab x hidden), no vocab-sized term per token
    assert saved <= 2 * (n * h + v * h) * 4 + 16 * n * 4
    # no tensor ever reached [tokens, vocab]; the largest is one tile's logits
    assert mode.max_numel == size * v
    hidden.grad = weight.grad = None
    with MaxTensor() as mode:
        step("dense").backward()
    assert mode.max_numel >= n * v


def test_real_model_tied_embeddings_all_heads_same_grads():
    from helpers import tiny_model

    from rlrun import models

    model, tok = tiny_model(0, arch="qwen2", intermediate_size=64, layers=1, heads=4, kv_heads=2, max_positions=64,
                            tie_embeddings=True)
    backbone, weight = models.split(model)
    assert weight is model.get_input_embeddings().weight  # tied: one parameter
    ids = torch.randint(4, len(tok), (3, 9))
    mask = torch.ones_like(ids)
    adv = torch.randn(3 * 8)
    grads = {}
    for name in HEADS:
        model.zero_grad()
        hid = models.hidden_states(backbone, ids, mask)[:, :-1].reshape(-1, 32)
        f = objective("cispo", adv, None, clip_low=None)
        head = registry.get("head", name)
        loss, _ = head.loss(hid, weight, ids[:, 1:].reshape(-1), torch.ones(24, dtype=bool), f, 24, 0.8, 5)
        loss.backward()
        grads[name] = {k: p.grad.clone() for k, p in model.named_parameters()}
    for name in HEAD_ALTERNATIVES:
        for k in grads["dense"]:
            assert_close(grads[name][k], grads["dense"][k], f"{name} {k}")


class MaxVocabTensor(TorchDispatchMode):
    """Largest newly allocated tensor with a vocab-sized last dim (logits-like) that any op creates; views and
    in-place results (e.g. the transposed lm-head weight) share an input's storage and are not counted."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.max_numel = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab
                    and t.untyped_storage().data_ptr() not in storages):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dapo", "dpo"])
def test_no_step_of_a_training_run_builds_full_logits(cfg_factory, loss):
    """Whole training steps (generation, old / reference passes, training) with tiled or chunked never create
    a [tokens, vocab] tensor: the largest logits-like tensor is one tile, or one generation step [batch, vocab]."""
    from rlrun.cli import run

    vocab, size = 5000, 7
    results = {}
    heads = ["dense", "chunked"] + (["tiled"] if loss == "dapo" else [])
    for head in heads:
        cfg = cfg_factory("experiment=smoke", f"loss={loss}", f"head={head}", f"head.size={size}", "train.steps=2",
                          f"model.vocab_size={vocab}", "rollout.max_new_tokens=16", "train.micro_batch=8",
                          "rollout.temperature=1.0", "eval.every=0",  # eval generates [20, vocab] per token
                          # every row trained: the dense head's whole micro-batch is the logits measured here
                          *(["train.skip_zero_advantage=false"] if loss == "dapo" else []))
        with MaxVocabTensor(vocab) as mode:
            run(cfg)
        results[head] = mode.max_numel
    generation_step = 8 * vocab  # rollout batch x vocab: one decoding step's scores (GRPO only)
    for head in heads[1:]:
        assert results[head] <= max(size * vocab, generation_step if loss == "dapo" else 0), (head, results)
    # dense: the whole micro-batch's response tokens x vocab (GRPO 128 tokens; DPO's short answers 32 tokens)
    assert results["dense"] >= (16 if loss == "dapo" else 4) * size * vocab


# -- rollout.top_p, rollout.top_k: the trainer's logprobs are the sampler's filtered, renormalised distribution -----

FILTERS = [(0.1, 0), (0.5, 0), (0.8, 0), (0.95, 0), (1.0, 1), (1.0, 5), (0.8, 5), (0.5, 3)]  # (top_p, top_k)


def test_the_heads_filtered_set_is_the_samplers():
    """heads/common.top_p_drop keeps exactly the tokens rollout/hf.top_p_filter keeps (the sampler's set: top_k
    first, then top_p of those renormalised), plus the target where the sampler's set would have dropped it."""
    from rlrun.heads.common import top_p_drop
    from rlrun.rollout.hf import top_p_filter

    g = torch.Generator().manual_seed(5)
    z = torch.randn(40, V, generator=g) * 3
    for top_p, top_k in FILTERS:
        sampler = torch.isinf(top_p_filter(z, top_p, top_k))
        assert torch.equal(top_p_drop(z, None, top_p, top_k), sampler)
        if top_k:  # the k most likely, no more (top_p may keep fewer)
            kept_per_row = (~sampler).sum(-1)
            assert (kept_per_row <= top_k).all() and ((kept_per_row == top_k).all() or top_p < 1.0)
            assert torch.equal(~sampler & (z >= z.topk(top_k, -1).values[:, -1:]), ~sampler)
        targets = torch.randint(0, V, (40,), generator=g)
        kept = ~top_p_drop(z, targets, top_p, top_k)
        assert kept[torch.arange(40), targets].all()
        assert torch.equal(kept | ~sampler, kept) and int((kept & sampler).sum()) <= 40  # only targets added


@pytest.mark.parametrize("top_p,top_k", [(0.5, 0), (0.8, 0), (1.0, 5), (0.8, 5)])
@pytest.mark.parametrize("size", [8, 5, 1000])
def test_heads_at_top_p_match_dense_and_are_its_renormalised_distribution(top_p, top_k, size):
    hidden, weight, targets, mask, adv, noise = inputs(7, masked_tile=True)
    z = (hidden @ weight.T) / 0.9
    from rlrun.rollout.hf import top_p_filter

    filtered = top_p_filter(z, top_p, top_k)
    filtered[torch.arange(N), targets] = z[torch.arange(N), targets]  # the drawn token is in the set
    expected = torch.log_softmax(filtered, -1)[torch.arange(N), targets]
    for name in HEADS:
        got = registry.get("head", name).logprobs(hidden, weight, targets, 0.9, size, top_p=top_p, top_k=top_k)
        assert torch.allclose(got, expected, atol=1e-5), name
    with torch.no_grad():
        old = expected + noise(0.3)

    def make_objective():
        return objective("dapo", adv, old, clip_low=0.2, clip_high=0.28, entropy_coef=0.01)

    dense = run_head("dense", hidden, weight, targets, mask, make_objective, 0.9, size, top_p, top_k)
    full = run_head("dense", hidden, weight, targets, mask, make_objective, 0.9, size)
    assert (dense[2] - full[2]).abs().max() > 1e-3 * full[2].abs().max()  # the filter changes the gradient
    for name in HEAD_ALTERNATIVES:
        got = run_head(name, hidden, weight, targets, mask, make_objective, 0.9, size, top_p, top_k)
        assert_close(got[0], dense[0], f"{name} loss")
        assert_close(got[1], dense[1], f"{name} grad hidden")
        assert_close(got[2], dense[2], f"{name} grad weight")
        assert got[3]["entropy"] == pytest.approx(dense[3]["entropy"], rel=1e-5)
