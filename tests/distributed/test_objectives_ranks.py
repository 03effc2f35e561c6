"""The objectives of issue 31 on two real ranks (torchrun, gloo): loss.agg normalised over the step's micro-batches
and ranks, gspo's sequence ratio, through every head (against the float64 reference of objectives_reference.py);
and 2-rank DeepSpeed runs with gspo, a per-sequence aggregation, dynamic sampling and the overlong penalty, whose
curves equal one process's (tests/distributed/test_distributed.py's check)."""

import json

import pytest
import torch
from objectives_reference import SHAPES, make_step, reference, rel_err

from rlrun.losses import combine

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_every_head_loss_and_agg_on_two_real_ranks_matches_the_reference(tmp_path):
    from torchrun import ROOT, torchrun

    out = torchrun(2, [str(ROOT / "tests" / "objectives_ranks.py"), str(tmp_path / "ranks.json")], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads((tmp_path / "ranks.json").read_text())
    assert len(got) == 3 * 3 * 4 * 2
    step, wants = make_step(), {}
    for key, g in got.items():
        head, loss, mode, kl, tis = key.split("/")
        kl, tis = None if kl == "None" else kl, None if tis == "None" else float(tis)
        want = wants.setdefault((loss, mode, kl, tis), reference(step, loss, mode, kl=kl, tis=tis))
        assert rel_err(g["loss"], want[0]) < 1e-5, key
        assert rel_err(torch.tensor(g["grad_w"]), want[2]) < 1e-5, key
        for r in range(len(SHAPES)):
            for m, grad in enumerate(want[1][r]):
                assert rel_err(torch.tensor(g["grad_h"][r][m]), grad) < 1e-5, (key, r, m)
        metrics = combine(g["parts"])
        expected = {k: v for k, v in want[3].items() if k != "loss"}
        assert metrics.keys() == expected.keys(), key
        for k, v in expected.items():
            assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (key, k)


NEW = ["loss=gspo", "loss.clip_low=0.05", "loss.clip_high=0.08", "loss.agg=seq_mean_token_sum_norm",
       "train.dynamic_sampling=true", "task.reward=helpers:half_constant_reward", "task.max_operand=6",
       "train.overlong=penalty", "train.overlong_buffer=3"]


@pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None, reason="needs DeepSpeed")
@pytest.mark.parametrize("stage, batching", [(2, "padded"), (3, "packed")])
def test_two_ranks_with_the_new_objectives_match_one(tmp_path, stage, batching):
    """Dynamic sampling chooses globally (rank 1 may train on groups rank 0 generated), gspo's ratios and the
    aggregation's counts span the ranks: the 2-rank curves are one process's."""
    from helpers import history, runs
    from test_distributed import EQUIV, assert_close, curves, single_process
    from torchrun import rlrun

    extra = [f"batching={batching}", "batching.max_tokens=64"] if batching != "padded" else []
    one = single_process(tmp_path / "one", *NEW, *extra)
    client1, (r1,) = runs(tmp_path / "one" / "mlflow.db")
    out = rlrun(2, tmp_path, *EQUIV, *NEW, *extra, "engine=deepspeed", f"engine.zero_stage={stage}")
    assert out.returncode == 0, out.stderr[-3000:]
    run, two = curves(tmp_path / "mlflow.db")
    assert_close(two, one)
    client2, _ = runs(tmp_path / "mlflow.db")
    for key in ("dynamic_sampling/dropped_frac", "dynamic_sampling/sequences", "dynamic_sampling/rounds"):
        assert history(client2, run.info.run_id, key) == history(client1, r1.info.run_id, key), key
    assert max(history(client1, r1.info.run_id, "dynamic_sampling/dropped_frac")) > 0  # groups were dropped
