"""DPO: the loss against hand-computed values, chunked == dense on loss and gradients, seeded curves, policies."""

import math
import os
import subprocess

import pytest
import torch
from conftest import make_cfg
from helpers import axes_of, history, runs, tiny_model

from rlrun import tasks
from rlrun.config import validate
from rlrun.losses.dpo import dpo_loss, sequence_logprobs
from rlrun.recipes.dpo import encode_pairs, pair_logprobs


def logsig(x):
    return -math.log1p(math.exp(-x))


def test_dpo_loss_hand_computed_with_label_smoothing_and_sft():
    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-2.0, -2.0])
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    z = [0.5 * ((-1 + 1.5) - (-3 + 2)), 0.5 * ((-2 + 2) - (-1 + 2))]  # 0.75, -0.5
    assert loss.item() == pytest.approx(-(logsig(z[0]) + logsig(z[1])) / 2, rel=1e-6)
    assert m["rewards/accuracy"] == 0.5 and m["rewards/margin"] == pytest.approx(sum(z) / 2)
    assert m["rewards/chosen"] == pytest.approx((0.25 + 0) / 2)  # 0.5 * (pc - rc) = 0.25, 0
    assert m["rewards/rejected"] == pytest.approx((-0.5 + 0.5) / 2)  # 0.5 * (pr - rr) = -0.5, 0.5
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    expected = sum(-0.9 * logsig(x) - 0.1 * logsig(-x) for x in z) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    nll = torch.tensor([0.4, 0.2])
    loss2, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, chosen_nll=nll, sft_coef=2.0, num_pairs=4)
    assert loss2.item() == pytest.approx((-(logsig(z[0]) + logsig(z[1])) + 2.0 * 0.6) / 4, rel=1e-6)


def test_sequence_logprobs_sum_and_mean():
    lp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    idx = torch.tensor([0, 0, 1, 1])
    assert sequence_logprobs(lp, idx, 3, torch.tensor([2, 2, 0])).tolist() == [-3.0, -7.0, 0.0]
    assert sequence_logprobs(lp, idx, 2, torch.tensor([2, 2]), average=True).tolist() == [-1.5, -3.5]


@pytest.mark.parametrize("average", [False, True])
def test_chunked_equals_dense_for_dpo_loss_and_gradients(average):
    sizes = dict(intermediate_size=64, layers=1, heads=4, kv_heads=2, max_positions=64, vocab_size=300,
                 tie_embeddings=True)
    model, tok = tiny_model(0, **sizes)
    reference, _ = tiny_model(1, **sizes)
    pairs = [  # uneven prompt and response lengths: padding inside the batch
        {"id": 0, "prompt": "1+2=", "chosen": "3", "rejected": "14"},
        {"id": 1, "prompt": "12+30=", "chosen": "42", "rejected": "7"},
        {"id": 2, "prompt": "hello ", "chosen": "world, how are you", "rejected": "x"},
    ]
    batch = encode_pairs(tok, pairs, torch.device("cpu"))
    assert batch.attention_mask.float().mean() < 1  # there is padding
    results = {}
    for name in ("dense", "chunked"):
        model.zero_grad()
        with torch.no_grad():
            rc, rr = pair_logprobs(reference, batch, axes_of(name, 5).head, axes_of().layout, average)
        pc, pr = pair_logprobs(model, batch, axes_of(name, 5).head, axes_of().layout, average)
        loss, metrics = dpo_loss(pc, pr, rc, rr, beta=0.3, label_smoothing=0.05)
        loss.backward()
        results[name] = (loss.detach(), metrics, {k: p.grad.clone() for k, p in model.named_parameters()}, rc, rr)
    (ld, md, gd, rcd, rrd), (lc, mc, gc, rcc, rrc) = results["dense"], results["chunked"]
    assert torch.allclose(lc, ld, rtol=1e-5) and torch.allclose(rcc, rcd, rtol=1e-5) and torch.allclose(rrc, rrd)
    # rewards/* are beta x differences of sequence logprobs (here down to -108, whose fp32 ulp is 7.6e-6): they
    # agree to a few ulps of the largest sequence logprob, not to a relative 1e-5 of their own small value
    scale = max(t.abs().max().item() for t in (rcd, rrd))
    for k in md:
        assert mc[k] == pytest.approx(md[k], rel=1e-5, abs=1e-6 * scale), k
    for k in gd:
        err = ((gc[k] - gd[k]).abs().max() / gd[k].abs().max()).item()
        assert err < 1e-5, (k, err)


def test_synthetic_pairs_and_jsonl_pairs(tmp_path):
    pairs = tasks.arith_pairs(tasks.arith_examples(50, 4, ["+"], 0), 0)
    assert all(p["chosen"] != p["rejected"] and str(eval(p["prompt"][:-1])) == p["chosen"] for p in pairs)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    with pytest.raises(tasks.TaskError, match=r"p.jsonl:2: missing or non-string field\(s\) \['rejected'\]"):
        tasks.load_pairs(validate(make_cfg("loss=dpo", "task=jsonl", f"task.path={path}")).task, 0)


def dpo_run(tmp_path, *overrides):
    from conftest import make_cfg, new_store

    from rlrun.cli import run

    new_store(tmp_path)
    summary = run(make_cfg("loss=dpo", "experiment=smoke", "train.steps=6", "train.lr=1e-2", *overrides,
                           tmp_path=tmp_path))
    client, (r,) = runs(tmp_path / "mlflow.db")
    return summary, {k: history(client, r.info.run_id, k) for k in ("loss", "grad_norm", "rewards/accuracy",
                                                                    "entropy")}


@pytest.mark.slow
def test_seeded_dpo_runs_dense_chunked_window_give_the_same_curve(tmp_path):
    s_dense, dense = dpo_run(tmp_path / "dense")
    assert len(dense["loss"]) == 6 and min(dense["grad_norm"]) > 1e-4
    _, chunked = dpo_run(tmp_path / "chunked", "head=chunked")
    pairs_16 = ("task.size=16", "task.eval_size=0")  # all 16 pairs train
    s_window, window = dpo_run(tmp_path / "window", "logprob_policy=window", *pairs_16)
    s_always, always = dpo_run(tmp_path / "always", "logprob_policy=always", *pairs_16)
    assert len(dense["entropy"]) == 6 and min(dense["entropy"]) > 0  # the policy's token entropy, every step
    for got, ref in ((chunked, dense), (window, always)):
        for k in ("loss", "grad_norm", "entropy"):
            assert torch.allclose(torch.tensor(got[k]), torch.tensor(ref[k]), rtol=1e-4, atol=1e-6), k
    # 16 pairs, 8 per step: the reference pass runs for the first epoch (2 steps) only under window
    assert s_always["passes_ref_run"] == 48 and s_window["passes_ref_run"] == 16
    assert s_window["passes_ref_skipped"] == 32


@pytest.mark.slow
def test_dpo_reward_accuracy_rises_on_the_synthetic_task(tmp_path):
    from conftest import make_cfg, new_store

    from rlrun.cli import run

    new_store(tmp_path)
    summary = run(make_cfg("loss=dpo", "train.steps=60", "train.batch_size=32", "train.micro_batch=32",
                           tmp_path=tmp_path))
    assert summary["accuracy_first"] < 0.6 and summary["accuracy_last"] > 0.85


@pytest.mark.slow
def test_rlrun_loss_dpo_as_typed(tmp_path):
    env = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
    r = subprocess.run(["rlrun", "loss=dpo", "head=chunked", "experiment=smoke", "progress=false"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    client, (run_,) = runs(tmp_path / "mlflow.db")
    assert run_.info.status == "FINISHED"
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
                "logps/rejected", "mem/train_peak_mib", "time/ref_logprobs_s", "throughput/train_tokens_per_s"):
        assert len(history(client, run_.info.run_id, key)) == 3, key
    r = subprocess.run(["rlrun", "loss=dpo", "logprob_policy=skip", "head=tiled"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "needs the reference logprobs" in r.stderr and "cannot be fused" in r.stderr
