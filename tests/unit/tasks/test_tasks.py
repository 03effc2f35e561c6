import hashlib
import json
import subprocess
import sys

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


def test_arith_with_more_terms_and_worked_answers(cfg_factory):
    """task.max_terms / task.worked (experiment=varied_lengths): 2 to max_terms operands of one operator, evaluated
    left to right, results never negative; the worked answer is every running value, its last the plain answer;
    lengths long-tailed (most short, some at the cap); pairs reject a wrong last value, the steps kept."""
    import collections

    ex = tasks.arith_examples(2000, 9, ["+", "-", "*"], 1, max_terms=12, worked=True)
    plain = tasks.arith_examples(2000, 9, ["+", "-", "*"], 1, max_terms=12)
    assert [e["prompt"] for e in ex] == [e["prompt"] for e in plain]
    for e, q in zip(ex, plain):
        op = next(c for c in e["prompt"] if c in "+-*")
        operands = [int(x) for x in e["prompt"][:-1].split(op)]
        running = [operands[0]]
        for x in operands[1:]:
            running.append(eval(f"{running[-1]}{op}{x}"))
        assert e["answer"] == ",".join(map(str, running[1:])) and q["answer"] == str(running[-1]) and min(running) >= 0
    terms = collections.Counter(len(e["answer"].split(",")) + 1 for e in ex)
    assert set(terms) == set(range(2, 13)) and terms[2] > terms[3] > terms[5] > terms[8] > 0
    for pair in tasks.arith_pairs(ex[:50], 0):
        *steps, last = pair["rejected"].split(",")
        assert steps == pair["chosen"].split(",")[:-1] and last != pair["chosen"].split(",")[-1]
    cfg = cfg_factory("experiment=varied_lengths", "task.eval_size=0")
    assert tasks.load(cfg.task, 0, None).train == tasks.arith_examples(1000, 9, ["+"], 0, 12, True)


def test_jsonl_task_and_custom_reward(tmp_path, cfg_factory):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "answer": "yo"}) + "\n\n" + json.dumps({"prompt": "a", "answer": "b"}))
    cfg = cfg_factory("task=jsonl", f"task.path={path}", "task.reward=rlrun.tasks:exact_match")
    task = tasks.load(cfg.task, 0, None)
    assert task.train == [{"prompt": "hi", "answer": "yo"}, {"prompt": "a", "answer": "b"}] and task.eval == []
    assert [r.fn for r in task.rewards] == [tasks.exact_match]


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


# --- the new API on the historic tasks: identical rows, rewards and pairs ---------------------------------------


def test_arith_through_load_is_the_seeded_examples_bit_for_bit(cfg_factory):
    cfg = cfg_factory("task.ops=[+,-,*]", "task.max_operand=9", "task.eval_size=0")
    old = tasks.arith_examples(1000, 9, ["+", "-", "*"], 3)
    task = tasks.load(cfg.task, 3, None)
    assert task.train == old and task.eval == [] and task.reward_names == ["partial_credit"]
    completions = ["7", "12", "", "x", " 9 ", "a1b2", "100", "-3"] * 4
    rows = task.train[: len(completions)]
    totals, per = task.score(completions, rows)
    expected = [tasks.partial_credit(c, r["answer"]) for c, r in zip(completions, rows)]
    assert totals == expected and per == {"partial_credit": expected}
    assert all(type(v) is float for v in totals)
    assert tasks.load_pairs(cfg.task, 3, None) == (tasks.arith_pairs(old, 3), [])


def test_jsonl_through_load_is_the_file_and_its_pairs(tmp_path, cfg_factory):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "answer": "yo"}) + "\n\n" + json.dumps({"prompt": "a", "answer": "b"}))
    cfg = cfg_factory("task=jsonl", f"task.path={path}", "task.reward=rlrun.tasks:exact_match")
    task = tasks.load(cfg.task, 0, None)
    assert task.train == tasks.read_jsonl(str(path), ("prompt", "answer")) and task.eval == []
    assert task.score(["yo", "a"], task.train) == ([1.0, 0.0], {"exact_match": [1.0, 0.0]})
    path.write_text('{"prompt": "a", "answer": "b"}\n{oops\n')
    with pytest.raises(tasks.TaskError, match=r"t.jsonl:2: not valid JSON"):  # the historic reader's errors
        tasks.load(cfg.task, 0, None)


def test_prompt_stream_order_and_state_are_unchanged():
    stream = tasks.prompt_stream([{"prompt": str(i)} for i in range(5)], 7)
    first = [next(stream)["prompt"] for _ in range(7)]
    assert first == ["4", "0", "3", "1", "2", "2", "3"]  # the values of the single-module rlrun/tasks.py
    state = stream.state_dict()
    assert state["pos"] == 2 and state["order"] == [2, 3, 1, 4, 0]
    again = tasks.prompt_stream([{"prompt": str(i)} for i in range(5)], 0)
    again.load_state_dict(state)
    assert [next(again)["prompt"] for _ in range(3)] == [next(stream)["prompt"] for _ in range(3)]


def test_arith_data_is_unchanged():
    """Digests of the rows and pairs of the single-module rlrun/tasks.py (a golden run depends on them)."""
    ex = tasks.arith_examples(1000, 9, ["+", "-", "*"], 3)
    digest = hashlib.sha1(json.dumps(ex).encode()).hexdigest()
    assert digest == "5f22b44c6d3e0f1f86cfc540aefc61845785dcec"
    digest = hashlib.sha1(json.dumps(tasks.arith_pairs(ex, 3)).encode()).hexdigest()
    assert digest == "ab21815861ed6a2cad2fb423b302235aca265c52"


def test_arith_eval_size_holds_out_distinct_prompts(cfg_factory):
    cfg = cfg_factory("task.eval_size=5")
    task = tasks.load(cfg.task, 0, None)
    held = {r["prompt"] for r in task.eval}
    assert len(task.eval) == len(held) == 5  # one row per held-out prompt
    assert not held & {r["prompt"] for r in task.train}
    examples = tasks.arith_examples(1000, 9, ["+"], 0)  # conf/task/arith.yaml's problems
    assert len(task.train) + sum(r["prompt"] in held for r in examples) == 1000
    assert tasks.load(cfg.task, 0, None).eval == task.eval != tasks.load(cfg.task, 1, None).eval


def test_task_problems_are_the_configs(cfg_factory):
    # one validator: the typed config refuses what the task loader would trip on, every problem at once
    from rlrun.config import ConfigError, validate

    with pytest.raises(ConfigError) as e:
        validate(cfg_factory("task.size=0", "task.ops=[/]", "task.eval_size=1.5", "task.chat_template=maybe",
                             "task.system_prompt=' '"))
    for needle in ("task.size=0", "task.ops[0]='/'", "task.eval_size=1.5", "task.chat_template='maybe'",
                   "task.system_prompt=' ' must be a non-empty string"):
        assert needle in str(e.value)
    with pytest.raises(ConfigError, match=r"task.eval_split='train' must name another split than task.split="):
        validate(cfg_factory("task=dataset", "task.path=x", "task.eval_split=train"))
    with pytest.raises(ConfigError, match=r"set task.eval_split \(a split of the data\) or task.eval_size"):
        validate(cfg_factory("task=dataset", "task.path=x", "task.eval_split=test", "task.eval_size=2"))


def test_package_import_stays_light():
    code = "import sys, rlrun.tasks; print(sorted(m for m in ('torch', 'datasets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- rewards: the calling rule, weights, names, and what a reward may return ------------------------------------


def _task(rewards, rows=None, **extra):
    """A Task over `rows` with `rewards` (the list form), through the public loader on a JSONL file."""
    return tasks.Task("t", rows or [{"prompt": "p", "answer": "7", "level": 2}], [],
                      tasks.scoring.load_rewards(None, rewards, {"prompt", "answer", "level", *extra}))


def kw_reward(completion, **kwargs):
    return float(sorted(kwargs) == ["answer", "level", "prompt", "scale"]) * kwargs["scale"]


def named_reward(completion, prompt, level=0):
    return float(level) + len(prompt)


def target_reward(completion, target):  # historic: the second positional parameter is the answer
    return float(completion == target)


def positional_only(completion, gold, /):
    return float(completion == gold)


def needs_pattern(completion, pattern):
    return 1.0


def test_calling_rule():
    t = _task([{"fn": "test_tasks:kw_reward", "kwargs": {"scale": 3}}, "test_tasks:named_reward",
               {"fn": "test_tasks:positional_only", "weight": 0.5}])
    totals, per = t.score(["7"], t.train)
    assert per == {"kw_reward": [3.0], "named_reward": [3.0], "positional_only": [1.0]}
    assert totals == [3.0 + 3.0 + 0.5]
    with pytest.raises(tasks.TaskError, match=r"needs argument\(s\) \['pattern'\].*kwargs: \{NAME: value\}"):
        _task(["test_tasks:needs_pattern"])
    with pytest.raises(tasks.TaskError, match=r"needs argument\(s\) \['target'\]"):
        _task(["test_tasks:target_reward"])  # under task.rewards parameters are bound by name
    legacy = tasks.scoring.load_rewards("test_tasks:target_reward", None, {"prompt", "answer"})
    assert tasks.Task("t", [], [], legacy).score(["7", "8"], [{"prompt": "p", "answer": "7"}] * 2)[0] == [1.0, 0.0]
    with pytest.raises(tasks.TaskError, match=r"task.rewards\[0\].kwargs \['nope'\] are not parameters"):
        _task([{"fn": "test_tasks:named_reward", "kwargs": {"nope": 1}}])
    with pytest.raises(tasks.TaskError, match="are both named 'exact_match'"):
        _task(["rlrun.tasks:exact_match", "rlrun.tasks.rewards:exact_match"])
    t = _task(["rlrun.tasks:exact_match", {"fn": "rlrun.tasks.rewards:exact_match", "name": "em2", "weight": 0}])
    assert t.score(["7"], t.train) == ([1.0], {"exact_match": [1.0], "em2": [1.0]})  # weight 0: logged only


def bad_reward(completion, answer, **row):
    return row["level"]


@pytest.mark.parametrize("value,needle", [
    (None, "returned None (NoneType); a reward must return a finite number (float, int or bool)."),
    (float("nan"), "returned nan; a reward must be finite."),
    (float("inf"), "returned inf; a reward must be finite."),
    ("0.5", "returned '0.5' (str); a reward must return a finite number"),
    ([1.0, 0.0], "rlrun calls a reward once per completion (not with a batch, as TRL does)"),
])
def test_a_bad_reward_value_names_the_reward_the_row_and_the_value(value, needle):
    t = _task(["test_tasks:bad_reward"], rows=[{"prompt": "ok", "answer": "1", "level": 0.0},
                                               {"prompt": "3+4=", "answer": "7", "level": value}])
    with pytest.raises(tasks.TaskError) as e:
        t.score(["a", "b"], t.train)
    msg = str(e.value)
    assert msg.startswith("reward 'bad_reward' (test_tasks:bad_reward) on completion 1 of 2 (prompt '3+4=', "
                          "answer '7', completion 'b')") and needle in msg, msg


def raising_reward(completion, answer):
    raise RuntimeError("reward server unreachable")


def test_a_raising_reward_is_one_message_with_its_line():
    t = _task(["test_tasks:raising_reward"])
    with pytest.raises(tasks.TaskError, match=r"raised RuntimeError: reward server unreachable at .*test_tasks.py:\d+"):
        t.score(["x"], t.train)


def test_bools_and_numpy_scalars_count_as_numbers():
    import numpy as np

    t = _task(["test_tasks:bad_reward"], rows=[{"prompt": "p", "answer": "a", "level": v}
                                               for v in (True, False, np.float32(0.25), np.bool_(True), 2)])
    assert t.score(list("abcde"), t.train)[0] == [1.0, 0.0, 0.25, 1.0, 2.0]


def test_reward_library():
    from rlrun.tasks import rewards as R

    assert R.numeric_match("so 1,234 apples", answer="3 boxes\n#### 1234") == 1.0
    assert R.numeric_match("it is 12.50", answer="#### 12.5") == 1.0
    assert R.numeric_match("-3", answer="minus three: -3") == 1.0  # no '####': the answer's last number
    assert R.numeric_match("42 then 41", answer="#### 42") == 0.0  # the completion's last number counts
    assert R.numeric_match("no number", answer="#### 4") == 0.0
    with pytest.raises(ValueError, match="has no number"):
        R.numeric_match("4", answer="four")
    assert R.format("<think>a\nb</think> 4", pattern=r"<think>.*</think>") == 1.0
    assert R.format("x 4", pattern=r"\d+", fullmatch=True) == 0.0
    assert R.length_penalty("", max_chars=10) == 0.0 and R.length_penalty("x" * 5, max_chars=10) == -0.5
    assert R.length_penalty("x" * 50, max_chars=10) == -1.0
    assert R.exact_match is tasks.exact_match and R.partial_credit is tasks.partial_credit


def test_a_typed_config_node_reads_like_a_composed_one(cfg_factory):
    """The `task` node reaches load() as a dataclass (the validated config): same rows, same rewards."""
    from rlrun.config import validate

    cfg = cfg_factory("task.size=50", "task.max_operand=4", "task.eval_size=0", "task.reward=null",
                      "task.rewards=[{fn: 'rlrun.tasks:exact_match', weight: 2.0, name: em}]")
    task = tasks.load(validate(cfg).task, 0, None)
    assert task.train == tasks.load(cfg.task, 0, None).train == tasks.arith_examples(50, 4, ["+"], 0)
    assert task.reward_names == ["em"]
    assert task.score([task.train[0]["answer"]], task.train[:1]) == ([2.0], {"em": [1.0]})
