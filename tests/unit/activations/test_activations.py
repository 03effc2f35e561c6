"""activations=checkpoint|offload train what activations=keep trains (rlrun/activations): the same loss, gradients
and metrics for every head, GRPO and DPO, LoRA on and off; checkpoint keeps only the layers' inputs (bytes saved
for backward, counted); the logprob passes are unaffected; offload moves nothing on CPU and says so."""

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import HEADS, axes_of, history, tiny_model
from test_batching import PAIRS, micros_of, step

from rlrun import activations, models

WIDE = dict(hidden_size=64, intermediate_size=256, layers=4, heads=2, kv_heads=2)


def saved_bytes(model, ids) -> int:
    """Bytes autograd saves for the backward of one forward of the backbone (saved-tensor hooks)."""
    backbone, _ = models.split(model)
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = models.hidden_states(backbone, ids, torch.ones_like(ids))
    h.sum().backward()
    return total


@pytest.mark.parametrize("every", [1, 2])
def test_checkpoint_keeps_only_the_layers_inputs(every):
    ids = torch.randint(4, 30, (4, 32))
    keep, _ = tiny_model(0, **WIDE)
    ckpt = copy.deepcopy(keep)
    activations.apply(ckpt, SimpleNamespace(name="checkpoint", every=every))
    assert activations.checkpointed(ckpt) == list(range(0, 4, every))
    one_input = ids.numel() * WIDE["hidden_size"] * 4  # a layer's input: [4, 32, 64] fp32
    full, kept = saved_bytes(keep, ids), saved_bytes(ckpt, ids)
    per_layer = full / 4  # what one layer saves when it keeps everything (the layers are alike)
    checkpointed = len(activations.checkpointed(ckpt))
    assert kept >= checkpointed * one_input  # each checkpointed layer keeps its input
    assert kept <= full - checkpointed * (per_layer - 2 * one_input)  # ... and little else of its own
    assert kept < full / (8 if every == 1 else 1.8)


def test_a_deepcopy_runs_its_own_layers():
    """The wrapper is an instance attribute bound to its layer: a copied model (the reference copy, an export's
    merge) recomputes its own layers, not the original's."""
    model, _ = tiny_model(0, **WIDE)
    activations.apply(model, SimpleNamespace(name="checkpoint", every=1))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    ids = torch.randint(4, 30, (2, 8))
    a = models.hidden_states(models.split(model)[0], ids, torch.ones_like(ids))
    b = models.hidden_states(models.split(twin)[0], ids, torch.ones_like(ids))
    assert not torch.allclose(a, b)
    assert vars(models.split(twin)[0].layers[0])["forward"].__self__ is models.split(twin)[0].layers[0]


@pytest.mark.parametrize("loss", ["dapo", "cispo"])
@pytest.mark.parametrize("head", HEADS)
def test_grpo_checkpoint_equals_keep(head, loss):
    model, tok = tiny_model()
    micros = micros_of(tok)
    ref_total, ref_parts, ref_grads, ref_micros, _ = step(model, micros, head, "padded", loss)
    total, parts, grads, got_micros, _ = step(model, micros, head, "padded", loss, activations="checkpoint")
    assert total == pytest.approx(ref_total, rel=1e-6, abs=1e-9)
    for name, g in ref_grads.items():
        assert torch.allclose(grads[name], g, rtol=1e-5, atol=1e-7), name
    assert parts.keys() == ref_parts.keys()
    for k, v in parts.items():
        assert v == pytest.approx(ref_parts[k], rel=1e-6, abs=1e-9), k
    for mb, ref in zip(got_micros, ref_micros):  # the no-grad passes: unaffected
        assert torch.equal(mb.old_logprobs, ref.old_logprobs)


def test_checkpoint_composes_with_packing_and_lora():
    pytest.importorskip("peft")
    model, tok = tiny_model()
    lora = SimpleNamespace(enabled=True, rank=4, alpha=8.0, dropout=0.0, target_modules=["all-linear"],
                           reference="adapters_off", export="merged")
    policy = models.add_lora(model, lora)
    micros = micros_of(tok)
    ref = step(policy, micros, "chunked", "shared_prompt")
    got = step(policy, micros, "chunked", "shared_prompt", activations="checkpoint")
    assert got[0] == pytest.approx(ref[0], rel=1e-6)
    assert ref[2] and all("lora_" in n for n in ref[2])  # only the adapters train
    for name, g in ref[2].items():
        assert torch.allclose(got[2][name], g, rtol=1e-5, atol=1e-7), name


def test_dpo_checkpoint_equals_keep():
    from rlrun.losses.dpo import dpo_loss
    from rlrun.recipes.dpo import encode_pairs, pair_logprobs

    model, tok = tiny_model()
    batch = encode_pairs(tok, PAIRS, torch.device("cpu"))

    def run(name):
        m = copy.deepcopy(model)
        activations.apply(m, SimpleNamespace(name=name, every=1))
        a = axes_of("tiled", 7)
        chosen, rejected = pair_logprobs(m, batch, a.head, a.layout, False)
        loss, _ = dpo_loss(chosen, rejected, chosen.detach() - 0.1, rejected.detach() + 0.2, beta=0.1,
                           label_smoothing=0.0, chosen_nll=None, sft_coef=0.0, num_pairs=len(PAIRS))
        loss.backward()
        return loss.item(), {n: p.grad for n, p in m.named_parameters()}

    (ref_loss, ref), (loss, got) = run("keep"), run("checkpoint")
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert all(torch.allclose(got[n], g, rtol=1e-5, atol=1e-7) for n, g in ref.items())


def test_offload_saves_to_host_on_an_accelerator_and_moves_nothing_on_cpu():
    cfg = SimpleNamespace(name="offload", every=1)
    on_gpu, on_cpu = activations.option(cfg, "cuda"), activations.option(cfg, "cpu")
    assert isinstance(on_gpu.saving(), torch.autograd.graph.save_on_cpu)
    assert on_gpu.saving() is on_gpu.saving()  # built once, entered by every train pass
    assert not isinstance(on_cpu.saving(), torch.autograd.graph.save_on_cpu)
    assert not on_cpu.effective() and on_gpu.effective()
    assert activations.option(SimpleNamespace(name="checkpoint", every=1), "cpu").effective()


@pytest.mark.slow  # three seeded runs (~20 s)
def test_seeded_runs_give_keeps_curves(tmp_path):
    from helpers import runs
    from test_runs import loss_curve

    _, ref, _ = loss_curve(tmp_path / "keep")
    for how in ("checkpoint", "offload"):
        _, got, r = loss_curve(tmp_path / how, f"activations={how}")
        assert got["reward_mean"] == ref["reward_mean"]
        for key in ("loss", "grad_norm", "clipfrac"):
            assert torch.allclose(torch.tensor(got[key]), torch.tensor(ref[key]), rtol=1e-5, atol=1e-7), (how, key)
    client, [r] = runs(tmp_path / "offload" / "mlflow.db")
    assert r.data.tags["activations.effective"] == "false"
    assert history(client, r.info.run_id, "loss")
