"""engine=deepspeed on 2 CPU ranks (gloo), launched with torchrun as a user would.

Equivalence: a 2-rank run samples the same completions as a 1-rank run (per-sequence seeded sampling), splits
every rollout by prompt group, and normalises the loss by the global token count, so its curves equal the 1-rank
curves of the same global batch up to float reduction order (tolerance below).
"""

import pytest
from conftest import make_cfg, new_store
from helpers import HEADS, history, runs
from torchrun import rlrun

from rlrun import cli

pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None,
                                 reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")]

# Every optimizer step takes a whole rollout (batch == rollout), so the global batch of each step is the same for
# 1 and 2 ranks (with a smaller batch, data-parallel steps take a different split of the same rollouts). Two
# iterations per rollout: every other step is off-policy, so the ratio, clipping and KL matter.
EQUIV = ["experiment=smoke", "train.steps=4", "train.micro_batch=2", "train.num_iterations=2", "loss.kl_coef=0.05",
         "rollout.max_new_tokens=6"]
CURVES = ("loss", "grad_norm", "reward_mean", "clipfrac", "mismatch/gen_vs_train_abs")
RTOL = 1e-5  # float reduction order differs (gloo all-reduce, other micro-batches); passes at 1e-6 here


def curves(db, run=None):
    client, found = runs(db)
    run = run or found[0]
    return run, {k: history(client, run.info.run_id, k) for k in CURVES}


def single_process(tmp_path, *overrides):
    new_store(tmp_path)
    cli.run(make_cfg(*EQUIV, *overrides, tmp_path=tmp_path), "single")
    return curves(tmp_path / "mlflow.db")[1]


def assert_close(a: dict, b: dict):
    for key in CURVES:
        assert len(a[key]) == len(b[key]) == (2 if key in ("reward_mean", "mismatch/gen_vs_train_abs") else 4), key
        assert a[key] == pytest.approx(b[key], rel=RTOL, abs=1e-7), key
    assert max(a["grad_norm"]) > 0.1  # not a trivially zero gradient


@pytest.mark.parametrize("stage, batching", [(3, "packed"), (2, "shared_prompt")])
def test_packed_two_ranks_match_one_padded(tmp_path, stage, batching):
    """Packing under ZeRO: whole groups exchanged so that the ranks' loads are even (rlrun/batching/exchange.py),
    each rank packs its share (as many forwards on both, the last one the boundary), and the run equals the padded
    run of one process. Two groups per rank, so that a group can change rank."""
    size = ["train.rollout_batch=16", "train.batch_size=16"]
    one = single_process(tmp_path / "one", *size)
    out = rlrun(2, tmp_path, *EQUIV, *size, "engine=deepspeed", f"engine.zero_stage={stage}", f"batching={batching}",
                "batching.max_tokens=64")  # several rows per forward, fewer forwards than padded's micro-steps
    assert out.returncode == 0, out.stderr[-3000:]
    run, two = curves(tmp_path / "mlflow.db")
    assert_close(two, one)
    client, [padded] = runs(tmp_path / "one" / "mlflow.db")
    m, key = run.data.metrics, "system/batching/"
    assert m[key + "padding_frac"] < padded.data.metrics[key + "padding_frac"]
    per_rank = [m[key + f"rank{r}/train_positions"] for r in (0, 1)]  # the last step's
    assert sum(per_rank) == m[key + "train_positions"]
    assert m[key + "rank_positions_ratio"] == max(per_rank) / min(per_rank)
    moved = history(runs(tmp_path / "mlflow.db")[0], run.info.run_id, key + "groups_moved")
    assert len(moved) == 2 and sum(moved) > 0  # each rollout (every other step) exchanged, and groups moved


def two_ranks_match_one(tmp_path, stage: int, one_also=(), two_also=()) -> dict:
    """The 2-rank run of EQUIV under ZeRO-`stage` (in tmp_path) against one process's (in tmp_path/one), each with
    its own extra overrides: the same curves, and the per-rank memory gathered. -> the 2-rank curves."""
    one = single_process(tmp_path / "one", *one_also)
    out = rlrun(2, tmp_path, *EQUIV, "engine=deepspeed", f"engine.zero_stage={stage}", *two_also)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "shm_comm" not in out.stdout + out.stderr  # DeepSpeed's inference-only kernel: neither built nor loaded
    run, two = curves(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlrun.world_size"] == "2"
    assert_close(two, one)
    # per-rank peak memory is gathered: the max and each rank's
    assert {"system/mem/train_peak_mib", "system/mem/rank0/train_peak_mib",
            "system/mem/rank1/train_peak_mib"} <= set(run.data.metrics)
    return two


def test_two_ranks_match_one(tmp_path):  # ZeRO-3; ZeRO-2 in the record-and-replay test below
    two_ranks_match_one(tmp_path, 3)


def test_two_ranks_dropping_zero_advantage_rows_match_one_process_that_keeps_them(tmp_path):
    """train.skip_zero_advantage under ZeRO-2, on a reward whose groups tie for half the prompts (no KL: the rows
    really leave): each rank drops its own rows, a micro-batch left empty still runs its forward and backward (the
    collectives), and the curves equal one process computing every row."""
    tied = ["task.reward=helpers:half_constant_reward", "task.max_operand=6", "loss.kl_coef=0"]
    one = single_process(tmp_path / "one", *tied, "train.skip_zero_advantage=false")
    out = rlrun(2, tmp_path, *EQUIV, *tied, "engine=deepspeed", "engine.zero_stage=2")
    assert out.returncode == 0, out.stderr[-3000:]
    run, two = curves(tmp_path / "mlflow.db")
    assert run.data.tags["rlrun.skip_zero_advantage"] == "on"
    for key in ("loss", "grad_norm", "reward_mean"):  # the token statistics are over the trained rows only
        assert two[key] == pytest.approx(one[key], rel=RTOL, abs=1e-7), key
    skipped = history(runs(tmp_path / "mlflow.db")[0], run.info.run_id, "system/passes/skipped_rows_frac")
    assert len(skipped) == 4 and min(skipped) > 0


def test_async_two_ranks_match_one(tmp_path):
    """rollout.pipeline=async under ZeRO-2: each rank publishes its (replicated) weights to a generator of its own,
    which draws that rank's share with the same seeds; the curves equal one process's async run."""
    async_ = ["rollout.pipeline=async", "rollout.max_staleness=1"]
    one = single_process(tmp_path / "one", *async_)
    out = rlrun(2, tmp_path, *EQUIV, *async_, "engine=deepspeed", "engine.zero_stage=2")
    assert out.returncode == 0, out.stderr[-3000:]
    run, two = curves(tmp_path / "mlflow.db")
    assert_close(two, one)
    # one step off, and each rollout's second pass (num_iterations=2) one step later still
    assert run.data.metrics["train/staleness_max"] == 2.0


def test_two_ranks_match_one_under_zero2_and_record_and_replay_as_one_process(tmp_path):
    """ZeRO-2, both runs recording (rollout.record): 2 ranks train as one process, and rank 0 writes the whole
    rollouts, the very ones the 1-process run records (same tokens, rewards and padding; the sampler's logprobs to
    float reduction order). The 1-process record replayed on 2 ranks (each rank its rows) trains as the 2-rank run
    that generated them."""
    import torch

    from rlrun.rollout import record

    two = two_ranks_match_one(tmp_path, 2, one_also=[f"rollout.record={tmp_path}/one/rec"],
                              two_also=[f"rollout.record={tmp_path}/rec"])
    a, b = record.Record(str(tmp_path / "one" / "rec")), record.Record(str(tmp_path / "rec"))
    assert len(a) == len(b) == 2
    for n in range(2):
        (ta, ma), (tb, mb) = a.read(n, "cpu"), b.read(n, "cpu")
        assert {k: ma[k] for k in ("prompt_len", "rows", "completions", "totals", "by_reward", "version")} == \
            {k: mb[k] for k in ("prompt_len", "rows", "completions", "totals", "by_reward", "version")}
        for k in ("input_ids", "attention_mask", "response_mask", "finished"):
            assert torch.equal(ta[k], tb[k]), (n, k)
        torch.testing.assert_close(ta["gen_logprobs"], tb["gen_logprobs"], rtol=RTOL, atol=1e-6)

    (tmp_path / "replay").mkdir()
    out = rlrun(2, tmp_path / "replay", *EQUIV, "engine=deepspeed", "engine.zero_stage=2", "rollout=replay",
                f"rollout.path={tmp_path}/one/rec")
    assert out.returncode == 0, out.stderr[-3000:]
    run, replayed = curves(tmp_path / "replay" / "mlflow.db")
    assert run.data.tags["rlrun.replay.rollouts"] == "2" and run.data.tags["rlrun.world_size"] == "2"
    assert_close(replayed, two)


@pytest.mark.parametrize("tied", [False, True])  # tied: the lm-head weight is also the embedding ZeRO-3 gathers
def test_heads_under_zero3_match_dense_and_one_process(tmp_path, tied):
    import json

    import torch
    from torchrun import ROOT, torchrun

    from rlrun import losses, models, registry

    out = torchrun(2, [str(ROOT / "tests" / "zero3_heads.py"), str(tmp_path / "heads.json"), str(tied)], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads((tmp_path / "heads.json").read_text())

    # the same global batch in one process, no DeepSpeed, dense head
    cfg = make_cfg("experiment=smoke", f"model.tie_embeddings={tied}")
    policy, _ = models.build(cfg.model, 0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (8, 10), generator=gen)
    adv = torch.randn(8, generator=gen)
    backbone, weight = models.split(policy)
    hidden = models.hidden_states(backbone, ids, torch.ones_like(ids))[:, :-1].flatten(0, 1)
    targets = ids[:, 1:].reshape(-1)
    a = adv[:, None].expand(-1, 9).reshape(-1)
    old = torch.full_like(a, -4.0)
    objective = losses.objective("dapo", a, old, None, old, clip_low=0.2, clip_high=0.28, kl_coef=0.0,
                                 kl_estimator="k3", tis_cap=None)
    loss, _ = registry.get("head", "dense").loss(hidden, weight, targets, torch.ones_like(targets, dtype=torch.bool),
                                                 objective, targets.numel(), 1.0, 7)
    loss.backward()
    ref = weight.grad.flatten()
    assert ref.norm() > 1e-3
    for name in HEADS:
        assert got[name]["gathered_numel"] == weight.numel()  # the weight really was partitioned by ZeRO-3
        assert got[name]["loss"] == pytest.approx(loss.item(), rel=1e-5), name
        assert got[name]["loss"] == pytest.approx(got["dense"]["loss"], rel=1e-6), name
        g = torch.tensor(got[name]["grad"])
        assert torch.allclose(g, torch.tensor(got["dense"]["grad"]), rtol=1e-5, atol=1e-7), name
        assert torch.allclose(g, ref, rtol=1e-4, atol=1e-6), name


def test_a_failing_rank_ends_the_run_failed(tmp_path):
    out = rlrun(2, tmp_path, "experiment=smoke", "engine=deepspeed", "task.reward=helpers:fail_on_rank1_second_rollout",
                "engine.timeout_s=60", "eval.every=0")  # the reward counts training rollouts only
    assert out.returncode != 0
    assert "reward server unreachable (test)" in out.stderr  # rank 1's own error is shown
    client, found = runs(tmp_path / "mlflow.db")
    (run,) = found
    assert run.info.status == "FAILED"
    assert "another rank stopped" in run.data.tags["error"]
    assert len(history(client, run.info.run_id, "loss")) == 1  # the step logged before the failure is kept


def test_offload_round_trips_under_zero(tmp_path):
    """offload=on gives the curve of offload=off (test_two_ranks_match_one), with its phases timed. On CPU the
    optimizer state already lives in host memory, so nothing moves here (the run says so in its tags); the GPU
    path (DeepSpeed's offload_states / reload_states) is not run here."""
    one = single_process(tmp_path / "one")
    out = rlrun(2, tmp_path, *EQUIV, "engine=deepspeed", "offload=on")
    assert out.returncode == 0, out.stderr[-3000:]
    run, two = curves(tmp_path / "mlflow.db")
    assert_close(two, one)
    assert {"system/time/offload_s", "system/time/onload_s"} <= set(run.data.metrics)
    assert run.data.tags["offload.effective"] == "false"


def test_dpo_two_ranks_match_one(tmp_path):
    dpo = ["loss=dpo", "head=chunked", "train.steps=3", "train.batch_size=8", "train.micro_batch=2"]
    new_store(tmp_path / "one")
    cli.run(make_cfg(*dpo, tmp_path=tmp_path / "one"), "one")
    client, (ref,) = runs(tmp_path / "one" / "mlflow.db")
    out = rlrun(2, tmp_path, *dpo, "engine=deepspeed", "engine.zero_stage=3")
    assert out.returncode == 0, out.stderr[-3000:]
    client2, (run,) = runs(tmp_path / "mlflow.db")
    for key in ("loss", "grad_norm", "rewards/accuracy", "rewards/margin"):
        a, b = history(client2, run.info.run_id, key), history(client, ref.info.run_id, key)
        assert len(a) == len(b) == 3 and a == pytest.approx(b, rel=RTOL, abs=1e-7), key
    assert max(history(client, ref.info.run_id, "grad_norm")) > 0.1


@pytest.mark.parametrize("loss,stage", [("dapo", 3), ("dpo", 2)])
def test_sigkill_two_ranks_then_resume_gives_the_same_curve(tmp_path, loss, stage):
    """Checkpoints are DeepSpeed's own (save_checkpoint/load_checkpoint) plus each rank's loop state and RNG."""
    import os
    import signal
    import time

    from test_checkpoint import KILL_SEED, curve, kill_point, logged_steps

    from rlrun import checkpoint

    args = ["experiment=smoke", f"loss={loss}", "train.steps=8", "engine=deepspeed", f"engine.zero_stage={stage}",
            "checkpoint.every=2"]
    (tmp_path / "base").mkdir()
    (tmp_path / "run").mkdir()
    base = rlrun(2, tmp_path / "base", *args)
    assert base.returncode == 0, base.stderr[-3000:]
    at = kill_point(f"sigkill-2ranks-{loss}-{stage}", 3, 6)  # >= 3: the first checkpoint (after step 2) exists
    p = rlrun(2, tmp_path / "run", *args, f"checkpoint.dir={tmp_path}/run/ckpt", wait=False)
    deadline = time.time() + 300
    while p.poll() is None and logged_steps(tmp_path / "run" / "mlflow.db") < at and time.time() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, f"the run ended before it could be killed after step {at}: " + p.stderr.read()[-2000:]
    os.killpg(p.pid, signal.SIGKILL)  # every rank and the launcher, at once
    p.wait(timeout=60)
    logged = logged_steps(tmp_path / "run" / "mlflow.db")
    where = f"SIGKILL once {at} steps were logged (RLRUN_TEST_KILL_SEED={KILL_SEED}), {logged} logged by then"
    # a sealed checkpoint (its manifest written last) to resume from: a periodic one, at or before the last step
    saved = checkpoint.load_latest(str(tmp_path / "run" / "ckpt"))[0]["step"]
    assert saved % 2 == 0 and 2 <= saved <= logged, f"{where}: newest sealed checkpoint after step {saved}"
    r = rlrun(2, tmp_path / "run", *args, f"checkpoint.dir={tmp_path}/run/ckpt", "resume=true")
    assert r.returncode == 0, f"{where}: " + r.stderr[-3000:]
    run_, steps, values = curve(tmp_path / "run" / "mlflow.db")
    _, base_steps, base_values = curve(tmp_path / "base" / "mlflow.db")
    assert run_.info.status == "FINISHED", where
    assert steps == base_steps == list(range(8)), where  # no missing, no duplicated step
    assert values == base_values, f"{where}, resumed from the checkpoint after step {saved}"  # bit for bit


def test_resume_refuses_another_number_of_ranks(tmp_path):
    args = ["experiment=smoke", "train.steps=2", "engine=deepspeed", f"checkpoint.dir={tmp_path}/ckpt"]
    assert rlrun(2, tmp_path, *args).returncode == 0
    out = rlrun(1, tmp_path, *args, "resume=true", "train.steps=4")
    assert out.returncode != 0  # torchrun reports any failed rank as 1; rlrun itself exits 2 (a user error)
    assert "written by 2 rank(s), this launch has 1" in out.stderr
