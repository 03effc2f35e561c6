"""task=word_problems and the rewards it is scored with (math-verify, format), and the random-reward control."""

import random
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlrun import tasks
from rlrun.tasks import rewards
from rlrun.tasks.word_problems import word_problems

YAML = Path(__file__).resolve().parents[3] / "conf" / "task" / "word_problems.yaml"



def read_ops(prompt: str) -> int:
    """Evaluate a problem's text the way a reader would, from its sentences (an independent check of the answers)."""
    import re

    count = 0
    for sentence in prompt.split(". "):
        if m := re.search(r"has (\d+) boxes with (\d+) ", sentence):
            count = int(m[1]) * int(m[2])
        elif m := re.search(r"has (\d+) ", sentence):
            count = int(m[1])
        elif m := re.search(r"(?:gets|buys|finds|gives \w+) (\d+) more", sentence):
            count += int(m[1])
        elif m := re.search(r"(?:gives|loses|gives away|uses) (\d+)", sentence):
            count -= int(m[1])
    return count


def test_problems_are_reproducible_and_their_answers_are_what_the_text_says():
    rows = word_problems(300, 20, ["+", "-", "*"], 3, None, seed=4)
    assert rows == word_problems(300, 20, ["+", "-", "*"], 3, None, seed=4)
    assert rows != word_problems(300, 20, ["+", "-", "*"], 3, None, seed=5)
    for r in rows:
        assert int(r["answer"]) == read_ops(r["prompt"]) >= 0, r
    steps = [r["prompt"].count("Then ") + 1 for r in rows]
    assert min(steps) == 1 and max(steps) == 3 and steps.count(1) > steps.count(3)  # most problems short
    assert any("boxes" in r["prompt"] for r in rows)
    assert all("boxes" not in r["prompt"] for r in word_problems(100, 20, ["+", "-"], 1, None, seed=4))


def test_the_task_feeds_the_instruction_through_the_chat_template_and_holds_prompts_out():
    from rlrun import models

    tok = models.char_tokenizer()
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    cfg = OmegaConf.load(YAML)
    cfg.size, cfg.eval_size = 200, 10
    task = tasks.load(cfg, 0, tok)
    assert len(task.eval) == 10 and not {r["prompt"] for r in task.eval} & {r["prompt"] for r in task.train}
    p = task.train[0]["prompt"]
    assert p.startswith("[user] ") and p.endswith("The answer is \\boxed{7}.\n[assistant] ")
    totals, per = task.score(["so the answer is \\boxed{" + task.train[0]["answer"] + "}.", "no idea"],
                             task.train[:2])
    assert per["correct"] == [1.0, 0.0] and per["correct_any"] == [1.0, 0.0] and totals == [1.2, 0.0]
    # a right answer in another form earns the partial credit only; a wrong boxed answer nothing (no reward for
    # the form alone: it was gamed, every answer boxed as the instruction's example)
    answer = task.train[0]["answer"]
    wrong = "The answer is \\boxed{" + str(int(answer) + 1) + "}."
    totals, _ = task.score([f"so it is {answer}", wrong], task.train[:2])
    assert totals == [0.2, 0.0]
    pairs, _ = tasks.load_pairs(cfg, 0, tok)

    assert all(p["chosen"] != p["rejected"] and p["chosen"].startswith("\\boxed{") for p in pairs)


@pytest.mark.parametrize("completion,answer,strict,lenient", [
    ("The final answer is \\boxed{6}.", "6", 1.0, 1.0),
    ("so she has 10 - 4 = 6 pencils left.", "6", 0.0, 1.0),   # right, but not in the asked-for form
    ("The answer is $\\frac{7}{2}$.", "3.5", 1.0, 1.0),        # equal as numbers, not as text
    ("\\boxed{6.0}", "6", 1.0, 1.0),
    ("\\boxed{7}", "6", 0.0, 0.0),
    ("\\boxed{}", "6", 0.0, 0.0),
    ("", "6", 0.0, 0.0),
])
def test_math_verify_reads_the_answer_as_trl_does(completion, answer, strict, lenient):
    assert rewards.math_verify(completion, answer) == strict
    assert rewards.math_verify(completion, answer, lenient=True) == lenient


def test_math_verify_refuses_a_reference_it_cannot_read():
    with pytest.raises(ValueError, match="cannot read the reference answer"):
        rewards.math_verify("\\boxed{6}", "")


def test_the_random_reward_ignores_the_completion_and_follows_the_seed():
    random.seed(3)
    a = [rewards.random_reward("x") for _ in range(5)]
    random.seed(3)
    b = [rewards.random_reward("something else") for _ in range(5)]
    assert a == b and len(set(a)) == 5 and all(0 <= v < 1 for v in a)
