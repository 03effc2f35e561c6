import json

import pytest

from rlrun import tasks


def test_partial_credit():
    assert tasks.partial_credit("7", "7") == 1.0
    assert tasks.partial_credit("5", "7") == 0.5  # digits, right length, no match
    assert tasks.partial_credit("12", "17") == pytest.approx(0.25 + 0.25 + 0.125)
    assert tasks.partial_credit("x", "7") == 0.25  # right length only
    assert tasks.partial_credit("a1b2", "7") == 0.125  # half the characters are digits
    assert tasks.partial_credit("", "7") == 0.0


def test_arith_examples_are_correct_and_seeded():
    ex = tasks.arith_examples(200, 9, ["+", "-", "*"], seed=1)
    assert ex == tasks.arith_examples(200, 9, ["+", "-", "*"], seed=1)
    for e in ex:
        a, op, b = e["prompt"][0], e["prompt"][1], e["prompt"][2]
        assert int(e["answer"]) == eval(f"{a}{op}{b}") >= 0


def test_jsonl_task_and_custom_reward(tmp_path, cfg_factory):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "answer": "yo"}) + "\n\n" + json.dumps({"prompt": "a", "answer": "b"}))
    cfg = cfg_factory("task=jsonl", f"task.path={path}", "task.reward=rlrun.tasks:exact_match")
    examples, reward = tasks.build(cfg.task, 0)
    assert examples == [{"prompt": "hi", "answer": "yo"}, {"prompt": "a", "answer": "b"}]
    assert reward is tasks.exact_match


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": "a", "answer": "b"}\n{oops\n', ":2: not valid JSON"),
    ('{"prompt": "a"}\n', ":1: missing or non-string field(s) ['answer']"),
    ('[1, 2]\n', ":1: expected a JSON object"),
    ("", "has no records"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(tasks.TaskError) as e:
        tasks.read_jsonl(str(path), ("prompt", "answer"))
    assert needle in str(e.value) and "bad.jsonl" in str(e.value)


def test_missing_file_and_bad_reward(tmp_path):
    with pytest.raises(tasks.TaskError, match="cannot be read"):
        tasks.read_jsonl(str(tmp_path / "nope.jsonl"), ("prompt",))
    with pytest.raises(tasks.TaskError, match="module:function"):
        tasks.load_reward("rlrun.tasks:no_such_fn")


def test_prompt_stream_covers_each_epoch():
    ex = [{"prompt": str(i)} for i in range(5)]
    stream = tasks.prompt_stream(ex, 0)
    first = [next(stream)["prompt"] for _ in range(5)]
    assert sorted(first) == ["0", "1", "2", "3", "4"]
