"""engine=deepspeed on 2 CPU ranks (gloo), launched with torchrun as a user would.

Equivalence: a 2-rank run samples the same completions as a 1-rank run (per-sequence seeded sampling), splits
every rollout by prompt group, and normalises the loss by the global token count, so its curves equal the 1-rank
curves of the same global batch up to float reduction order (tolerance below).
"""

import pytest
from conftest import make_cfg
from distributed import rlrun
from helpers import history, runs

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
    cli.run(make_cfg(*EQUIV, *overrides, tmp_path=tmp_path), "single")
    return curves(tmp_path / "mlflow.db")[1]


def assert_close(a: dict, b: dict):
    for key in CURVES:
        assert len(a[key]) == len(b[key]) == (2 if key in ("reward_mean", "mismatch/gen_vs_train_abs") else 4), key
        assert a[key] == pytest.approx(b[key], rel=RTOL, abs=1e-7), key
    assert max(a["grad_norm"]) > 0.1  # not a trivially zero gradient


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_match_one(tmp_path, stage):
    one = single_process(tmp_path / "one")
    out = rlrun(2, tmp_path, *EQUIV, "engine=deepspeed", f"engine.zero_stage={stage}")
    assert out.returncode == 0, out.stderr[-3000:]
    run, two = curves(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlrun.world_size"] == "2"
    assert_close(two, one)
    # per-rank peak memory is gathered: the max and each rank's
    assert {"mem/train_peak_mib", "mem/rank0/train_peak_mib", "mem/rank1/train_peak_mib"} <= set(run.data.metrics)
