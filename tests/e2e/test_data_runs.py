"""`task=dataset` end to end: a few GRPO and DPO steps on a file and on a saved dataset, with renamed columns;
`messages` prompts through a model whose tokenizer has a chat template; a GSM8K-style file with numeric_match."""

from __future__ import annotations

import pytest
from helpers import history, runs, tiny_model
from test_data import TEMPLATE, write

from rlrun.cli import run

pytestmark = pytest.mark.slow

QA = [{"q": f"{a}+{b}=", "a": str(a + b), "good": str(a + b), "bad": str(a + b + 1)}
      for a in range(5) for b in range(4)]
SMOKE = ["experiment=smoke", "train.steps=2", "export.enabled=false", "task=dataset"]


def steps_logged(tmp_path, *keys):
    client, (r, *_) = runs(tmp_path / "mlflow.db")
    assert r.info.status == "FINISHED", r.data.tags.get("error")
    return r, {k: len(history(client, r.info.run_id, k)) for k in keys}


# one file and one save_to_disk folder: every format gives the same rows (test_data, in process), so training on
# each of them would repeat the same runs
@pytest.mark.parametrize("fmt", ["jsonl", "saved_dict"])
def test_grpo_and_dpo_train_on_a_file_and_a_saved_dataset_with_renamed_columns(tmp_path, cfg_factory, fmt):
    path = write(tmp_path, QA, fmt)
    keys = [f"task.path={path}", "task.prompt_key=q", "task.answer_key=a", "task.eval_size=4"]
    run(cfg_factory(*SMOKE, *keys, tmp_path=tmp_path))
    r, n = steps_logged(tmp_path, "loss", "rewards/exact_match/mean", "eval/accuracy")
    assert n == {"loss": 2, "rewards/exact_match/mean": 2, "eval/accuracy": 2}  # eval before step 0 and at the end
    run(cfg_factory(*SMOKE, *keys, "loss=dpo", "head=chunked", "task.chosen_key=good", "task.rejected_key=bad",
                    tmp_path=tmp_path))
    r, n = steps_logged(tmp_path, "loss", "rewards/accuracy", "eval/margin")
    assert r.data.params["loss.name"] == "dpo" and n == {"loss": 2, "rewards/accuracy": 2, "eval/margin": 2}


def test_gsm8k_style_file_with_numeric_match_trains(tmp_path, cfg_factory):
    rows = [{"question": f"what is {a} plus {b}? ", "answer": f"{a} plus {b} is {a + b}.\n#### {a + b}"}
            for a in range(6) for b in range(6)]
    path = write(tmp_path, rows, "jsonl")
    run(cfg_factory(*SMOKE, f"task.path={path}", "task.prompt_key=question", "train.steps=3",
                    "task.rewards=[{fn: rlrun.tasks.rewards:numeric_match, weight: 1.0}]", tmp_path=tmp_path))
    r, n = steps_logged(tmp_path, "loss", "rewards/numeric_match/mean")
    assert n == {"loss": 3, "rewards/numeric_match/mean": 3}
    assert "answers are longer than rollout.max_new_tokens" in r.data.tags["rlrun.warnings"]


def test_messages_prompts_through_a_models_chat_template(tmp_path, cfg_factory):
    """A local model (model=hf) whose tokenizer has a chat template; prompts given as message lists."""
    model, tok = tiny_model(0, intermediate_size=64, layers=1, max_positions=128)
    tok.chat_template = TEMPLATE
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    rows = [{"messages": [{"role": "user", "content": r["q"]}], "a": r["a"]} for r in QA]
    path = write(tmp_path, rows, "jsonl")
    run(cfg_factory(*SMOKE, "model=hf", f"model.path={tmp_path / 'm'}", f"task.path={path}",
                    "task.prompt_key=messages", "task.answer_key=a", "log.samples_every=1", tmp_path=tmp_path))
    r, n = steps_logged(tmp_path, "loss")
    assert n == {"loss": 2}
    client, _ = runs(tmp_path / "mlflow.db")
    import json

    table = json.loads(open(client.download_artifacts(r.info.run_id, "samples/train_step_000000.json",
                                                      str(tmp_path))).read())
    prompt = table["data"][0][0]
    from rlrun.tasks.chat import Formatter

    rendered = {Formatter(tok, "auto", True, None)(row["messages"], "t", "prompt") for row in rows}
    assert prompt in rendered and prompt not in {r["q"] for r in QA}  # the template's rendering, not the content
