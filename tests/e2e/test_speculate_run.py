"""A run with speculation trains on the completions a run without it trains on (issue #71's certificate over a
run, not one decode): 20 steps of the smoke experiment with rollout.speculate=prompt and =history against =off, on a
small task so that prompts come back (history then drafts from a prompt's earlier completions)."""

import pytest
import torch
from conftest import make_cfg, new_store
from helpers import history, runs

from rlrun.cli import run

pytestmark = pytest.mark.slow  # three 20-step runs (~10 s each)

STEPS = 20
SMALL = ("experiment=smoke", f"train.steps={STEPS}", "task.size=16", "task.eval_size=4", "rollout.max_new_tokens=8",
         "eval.every=0")


def curves(tmp_path, *overrides) -> dict[str, list[float]]:
    new_store(tmp_path)
    run(make_cfg(*SMALL, *overrides, tmp_path=tmp_path))
    client, rs = runs(tmp_path / "mlflow.db")
    keys = ("reward_mean", "response_len_mean", "loss", "grad_norm", "rollout/speculation/acceptance",
            "rollout/speculation/tokens_per_pass")
    return {k: history(client, rs[0].info.run_id, k) for k in keys}


@pytest.mark.parametrize("speculate", ["prompt", "history"])
def test_a_run_with_speculation_trains_on_plain_decodings_completions(tmp_path, speculate):
    plain = curves(tmp_path / "off")
    got = curves(tmp_path / speculate, f"rollout.speculate={speculate}")
    assert len(got["reward_mean"]) == STEPS
    # the same completions every step: the same rewards and lengths (a flipped token would change either, and
    # every later step's weights with it)
    assert got["reward_mean"] == plain["reward_mean"] and got["response_len_mean"] == plain["response_len_mean"]
    for key in ("loss", "grad_norm"):  # the verify pass rounds in another order: fp32 tolerance, step after step
        assert torch.allclose(torch.tensor(got[key]), torch.tensor(plain[key]), rtol=1e-4, atol=1e-6), key
    # speculation acted (drafts verified, some accepted), and off logs nothing of it
    assert len(got["rollout/speculation/acceptance"]) == STEPS and max(got["rollout/speculation/acceptance"]) > 0
    assert min(got["rollout/speculation/tokens_per_pass"]) >= 1.0
    assert plain["rollout/speculation/acceptance"] == []
