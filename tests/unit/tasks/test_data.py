"""task=dataset: local files through the `datasets` library, column mapping, chat templates, held-out rows,
rewards from the working directory and from files, length checks, and every bad input with its message."""

import gzip
import json
import re
import shutil
import sys

import datasets
import pytest
from omegaconf import OmegaConf

from rlrun import tasks
from rlrun.models import char_tokenizer

GSM = [  # GSM8K's shape: question / answer with the final number after '####'
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 1,200 pens; 200 are sold. Left?", "answer": "1200 - 200 = 1000\n#### 1,000"},
    {"question": "Half of 10?", "answer": "10 / 2 = 5\n#### 5"},
    {"question": "Twice 21?", "answer": "#### 42"},
]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def task_cfg(path, **options):
    """The `task` node of task=dataset (conf/task/dataset.yaml's defaults), with `options` over it."""
    base = {"name": "dataset", "path": str(path), "split": "train", "eval_split": None, "eval_size": 0,
            "max_rows": None, "prompt_key": "prompt", "answer_key": "answer", "chosen_key": "chosen",
            "rejected_key": "rejected", "chat_template": "auto", "add_generation_prompt": True,
            "system_prompt": None, "reward": None, "max_prompt_tokens": None,
            "rewards": [{"fn": "rlrun.tasks.rewards:exact_match", "weight": 1.0}]}
    return OmegaConf.create({**base, **options})


@pytest.fixture
def chat_tok():
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def write(tmp_path, rows, fmt, name="data"):
    """`rows` written by `datasets` in format `fmt`; returns the path to give task.path."""
    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / f"{name}.{fmt}"
    if fmt == "jsonl":
        ds.to_json(str(path))
    elif fmt == "json":
        path.write_text(json.dumps(rows))  # one JSON array
    elif fmt == "jsonl.gz":
        with gzip.open(path, "wt") as f:
            f.write("\n".join(json.dumps(r) for r in rows))
    elif fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "csv":
        ds.to_csv(str(path), index=False)
    elif fmt in ("arrow", "saved", "saved_dict"):
        folder = tmp_path / name
        (datasets.DatasetDict(train=ds) if fmt == "saved_dict" else ds).save_to_disk(str(folder))
        if fmt != "arrow":
            return folder
        shutil.copy(next(folder.glob("*.arrow")), path)
    elif fmt == "folder":
        path = tmp_path / name
        path.mkdir()
        ds.to_parquet(str(path / "train.parquet"))
    return path


FORMATS = ["jsonl", "json", "jsonl.gz", "parquet", "csv", "arrow", "saved", "saved_dict", "folder"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_gives_the_same_rows_and_gsm8k_scores(tmp_path, fmt):
    path = write(tmp_path, GSM, fmt)
    cfg = task_cfg(path, prompt_key="question", rewards=["rlrun.tasks.rewards:numeric_match"])
    task = tasks.load(cfg, 0, char_tokenizer())  # no template: the question is the prompt as it is
    assert task.train == [dict(r, prompt=r["question"]) for r in GSM] and task.eval == []
    completions = ["3 plus 4 is 7", "so 1000 pens", "about 6", "#### 42.0"]
    assert task.score(completions, task.train) == ([1.0, 1.0, 0.0, 1.0], {"numeric_match": [1.0, 1.0, 0.0, 1.0]})


def test_renamed_columns_and_numbers_as_answers(tmp_path):
    path = write(tmp_path, [{"q": "1+1=", "sol": 2, "level": 1}, {"q": "2+3=", "sol": 5, "level": 2}], "csv")
    task = tasks.load(task_cfg(path, prompt_key="q", answer_key="sol", max_rows=1), 0, None)
    assert task.train == [{"q": "1+1=", "sol": "2", "level": "1", "prompt": "1+1=", "answer": "2"}]  # CSV: text


def test_csv_cells_reach_the_reward_as_the_text_in_the_file(tmp_path):
    """CSV has no types: an answer column that looks numeric keeps its characters (read as float, then str()'d,
    '007' became '7.0' and no exact match could score it)."""
    path = tmp_path / "data.csv"
    path.write_text("question,answer,level\nq1,007,1\nq2,1.50,2\nq3,+3,3\nq4,1e3,4\nq5,12,5\n")
    task = tasks.load(task_cfg(str(path), prompt_key="question", rewards=["rlrun.tasks.rewards:exact_match"]), 0, None)
    assert [r["answer"] for r in task.train] == ["007", "1.50", "+3", "1e3", "12"]
    assert [r["level"] for r in task.train] == ["1", "2", "3", "4", "5"]
    assert task.score(["007", "1.50"], task.train[:2])[0] == [1.0, 1.0]


def test_messages_prompts_through_the_chat_template(tmp_path, chat_tok):
    rows = [{"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"},
            {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
             "answer": "4"}]
    path = write(tmp_path, rows, "parquet")
    task = tasks.load(task_cfg(path, prompt_key="messages", system_prompt="Think."), 0, chat_tok)
    assert [r["prompt"] for r in task.train] == [
        "<system>Think.\n<user>1+1?\n<assistant>",
        "<system>Be terse.\n<user>2+2?\n<assistant>",  # the row's own system message wins
    ]
    assert task.train[0]["messages"] == rows[0]["messages"]  # the original column stays, for rewards
    task = tasks.load(task_cfg(path, prompt_key="messages", add_generation_prompt=False), 0, chat_tok)
    assert task.train[0]["prompt"] == "<user>1+1?\n"


def test_text_prompts_and_the_template_setting(tmp_path, chat_tok):
    path = write(tmp_path, [{"prompt": "1+1=", "answer": "2"}], "jsonl")
    assert tasks.load(task_cfg(path), 0, chat_tok).train[0]["prompt"] == "<user>1+1=\n<assistant>"  # auto
    assert tasks.load(task_cfg(path, chat_template=False), 0, chat_tok).train[0]["prompt"] == "1+1="
    assert tasks.load(task_cfg(path), 0, char_tokenizer()).train[0]["prompt"] == "1+1="  # auto, no template
    with pytest.raises(tasks.TaskError, match="task.chat_template=true but the tokenizer has no chat template"):
        tasks.load(task_cfg(path, chat_template=True), 0, char_tokenizer())
    with pytest.raises(tasks.TaskError, match="task.system_prompt needs a chat template"):
        tasks.load(task_cfg(path, system_prompt="Think."), 0, char_tokenizer())


def test_messages_without_a_template_are_refused(tmp_path, chat_tok):
    path = write(tmp_path, [{"prompt": [{"role": "user", "content": "hi"}], "answer": "yo"}], "jsonl")
    with pytest.raises(tasks.TaskError, match=r"data.jsonl:1: the prompt \(task.prompt_key='prompt'\) is a list of "
                                              r"messages, but no chat template is applied"):
        tasks.load(task_cfg(path, chat_template=False), 0, chat_tok)


def test_eval_split_from_a_folder(tmp_path):
    folder = tmp_path / "gsm"
    folder.mkdir()
    datasets.Dataset.from_list(GSM[:3]).to_json(str(folder / "train.jsonl"))
    datasets.Dataset.from_list(GSM[2:]).to_json(str(folder / "test.jsonl"))
    task = tasks.load(task_cfg(folder, prompt_key="question", eval_split="test"), 0, None)
    assert [r["question"] for r in task.train] == [GSM[0]["question"], GSM[1]["question"]]
    assert [r["question"] for r in task.eval] == [GSM[2]["question"], GSM[3]["question"]]
    assert task.warnings == ["1 of 3 training rows have a prompt that is also in the eval split; they were left "
                             "out of training."]
    assert tasks.check_lengths(task, char_tokenizer(), None, None) == task.warnings
    with pytest.raises(tasks.TaskError, match=r"task.eval_split='validation' is not a split of .*gsm; its splits: "
                                              r"\['test', 'train'\]"):
        tasks.load(task_cfg(folder, prompt_key="question", eval_split="validation"), 0, None)


def test_eval_size_is_deterministic_and_disjoint(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    path = write(tmp_path, rows, "jsonl")
    a = tasks.load(task_cfg(path, eval_size=0.25), 3, None)
    assert len(a.eval) == 5 and len(a.train) == 15
    assert not {r["prompt"] for r in a.eval} & {r["prompt"] for r in a.train}
    assert a.train == [r for r in rows if r not in a.eval]  # train keeps the file's order
    assert tasks.load(task_cfg(path, eval_size=0.25), 3, None).eval == a.eval
    assert tasks.load(task_cfg(path, eval_size=0.25), 4, None).eval != a.eval
    assert len(tasks.load(task_cfg(path, eval_size=2), 3, None).eval) == 2
    with pytest.raises(tasks.TaskError, match="task.eval_size=20 holds out 20 of the 20 distinct training prompts"):
        tasks.load(task_cfg(path, eval_size=20), 3, None)


def test_dpo_pairs_through_the_loader(tmp_path, chat_tok):
    rows = [{"q": f"{i}+1=", "good": str(i + 1), "bad": str(i + 2)} for i in range(10)]
    path = write(tmp_path, rows, "parquet")
    cfg = task_cfg(path, prompt_key="q", chosen_key="good", rejected_key="bad", eval_size=2, chat_template=False)
    train, held = tasks.load_pairs(cfg, 0, chat_tok)
    assert len(train) == 8 and len(held) == 2 and train[0] == {"prompt": "0+1=", "chosen": "1", "rejected": "2"}
    assert tasks.load_pairs(cfg, 0, None) == (train, held)  # chat_template=false: the tokenizer plays no part
    with pytest.raises(tasks.TaskError, match=r"task.chosen_key='chosen' is not a column; its columns are "
                                              r"\['q', 'good', 'bad'\]"):
        tasks.load_pairs(task_cfg(path, prompt_key="q"), 0, None)


CSV_TEXT = "question,answer,level\nq1,007,1\nq2,1.50,2\nq3,+3,3\n"


@pytest.mark.parametrize("kind", ["csv.gz", "csv.bz2", "csv.xz", "folder of csv"])
def test_compressed_csv_and_a_folder_of_csv_keep_the_text_in_the_file(tmp_path, kind):
    """Was: a.csv.gz failed with UnicodeDecodeError (its header was read uncompressed); a folder of CSVs typed its
    columns, so '007' reached the reward as '7'."""
    import bz2
    import lzma

    if kind == "folder of csv":
        path = tmp_path / "data"
        path.mkdir()
        (path / "train.csv").write_text(CSV_TEXT)
        (path / "test.csv").write_text(CSV_TEXT.replace("q1,007", "q9,0.10"))
    else:
        path = tmp_path / f"data.{kind}"
        opener = {"gz": gzip.open, "bz2": bz2.open, "xz": lzma.open}[kind.split(".")[1]]
        with opener(path, "wt") as f:
            f.write(CSV_TEXT)
    task = tasks.load(task_cfg(path, prompt_key="question"), 0, None)
    assert [(r["answer"], r["level"]) for r in task.train] == [("007", "1"), ("1.50", "2"), ("+3", "3")]
    if kind == "folder of csv":
        split = tasks.load(task_cfg(path, prompt_key="question", split="test"), 0, None)
        assert split.train[0]["answer"] == "0.10"


JSON_ROWS = '[{"q": "a", "answer": 1.50, "level": 7}, {"q": "b", "answer": 7, "level": 1.5}, ' \
            '{"q": "c", "answer": 1e3, "level": 2}, {"q": "d", "answer": "12", "level": 3}]'


@pytest.mark.parametrize("kind", ["json", "jsonl", "jsonl.gz", "folder of jsonl"])
def test_json_numbers_reach_the_reward_as_written(tmp_path, kind):
    """Was: the answer 1.50 reached the reward as '1.5' and 7 as '7.0' (pyarrow makes a column of ints and floats
    float); a number column keeps the file's type per cell (7 an int)."""
    records = json.loads(JSON_ROWS)
    lines = [json.dumps(r) for r in records]
    text = "\n".join(line.replace('"answer": 1.5,', '"answer": 1.50,').replace('"answer": 1000.0', '"answer": 1e3')
                     for line in lines) + "\n"
    if kind == "json":
        path = tmp_path / "data.json"
        path.write_text(JSON_ROWS)
    elif kind == "jsonl":
        path = tmp_path / "data.jsonl"
        path.write_text(text)
    elif kind == "jsonl.gz":
        path = tmp_path / "data.jsonl.gz"
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path = tmp_path / "data"
        path.mkdir()
        (path / "train.jsonl").write_text(text)
        (path / "test.jsonl").write_text(text)
    task = tasks.load(task_cfg(path, prompt_key="q"), 0, None)
    assert [r["answer"] for r in task.train] == ["1.50", "7", "1e3", "12"]
    levels = [r["level"] for r in task.train]
    assert levels == [7, 1.5, 2, 3] and [type(v) for v in levels] == [int, float, int, int]
    assert task.score(["1.50", "7"], task.train[:2])[0] == [1.0, 1.0]


def test_parquet_numbers_become_their_value_as_text(tmp_path):
    """Parquet stores values, not characters: an int answer reads '7', a float its shortest repr ('1.5', and 7.0 as
    '7.0'), a decimal keeps its scale ('1.50'). Store answers as strings to keep them exactly (docs/data.md)."""
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    decimals = pa.array([decimal.Decimal(x) for x in ("1.50", "7", "0.10")], pa.decimal128(5, 2))
    cols = {"q": ["a", "b", "c"], "i": [7, 8, 9], "f": [1.5, 7.0, 1e3], "d": decimals}
    pq.write_table(pa.table(cols), tmp_path / "data.parquet")
    got = {k: [r["answer"] for r in tasks.load(task_cfg(tmp_path / "data.parquet", prompt_key="q", answer_key=k), 0,
                                               None).train] for k in ("i", "f", "d")}
    assert got == {"i": ["7", "8", "9"], "f": ["1.5", "7.0", "1000.0"], "d": ["1.50", "7.00", "0.10"]}


# --- bad inputs ------------------------------------------------------------------------------------------------


def test_missing_file_and_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tasks.TaskError, match=r"task.path='data/train.jsonl': no such file or folder \(relative "
                                              r"paths start at the working directory .*\); rlrun reads local data"):
        tasks.load(task_cfg("data/train.jsonl"), 0, None)
    with pytest.raises(tasks.TaskError) as e:
        tasks.load(task_cfg("openai/gsm8k"), 0, None)
    assert "task.path='openai/gsm8k' is not a local file or folder" in str(e.value)
    assert "rlrun never downloads data" in str(e.value)
    assert "datasets.load_dataset('openai/gsm8k').save_to_disk('gsm8k')" in str(e.value)


def test_missing_column_lists_the_columns(tmp_path):
    path = write(tmp_path, GSM, "parquet")
    with pytest.raises(tasks.TaskError) as e:
        tasks.load(task_cfg(path), 0, None)
    assert str(e.value) == (f"{path} (split 'train'): task.prompt_key='prompt' is not a column; its columns are "
                            "['question', 'answer']. Set task.prompt_key=<one of them>.")


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": 5, "answer": "b"}\n\n{"prompt": 6, "answer": "c"}\n',
     r"data.jsonl:1: the prompt \(task.prompt_key='prompt'\) is 5 \(int\); need text or a list of"),
    ('{"prompt": "a", "answer": "b"}\n\n{"prompt": 5, "answer": "c"}\n',
     r"data.jsonl:3: field 'prompt' is a number here but a string on line 1; a column needs one type in every row"),
    ('{"prompt": "a", "answer": "b"}\n{"prompt": "c", "answer": ""}\n',
     r"data.jsonl:2: task.answer_key='answer' is empty; every row needs non-empty text there."),
    ('{"prompt": "a", "answer": "b"}\n{"prompt": "  ", "answer": "d"}\n',
     r"data.jsonl:2: the prompt \(task.prompt_key='prompt'\) is empty."),
    ('{"prompt": "a", "answer": "b"}\n{oops\n', r"data.jsonl:2: not valid JSON"),
    ('{"prompt": [{"role": "user"}], "answer": "b"}\n',
     r"data.jsonl:1: message 0 of the prompt .* each message needs string 'role' and 'content'."),
])
def test_malformed_rows_name_file_and_line(tmp_path, chat_tok, content, needle):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(tasks.TaskError, match=needle):
        tasks.load(task_cfg(path), 0, chat_tok)


def test_malformed_rows_of_other_formats_name_the_row(tmp_path):
    path = write(tmp_path, [{"prompt": "a", "answer": "b"}, {"prompt": "c", "answer": None}], "parquet")
    with pytest.raises(tasks.TaskError, match=r"data.parquet \(train row 1\): task.answer_key='answer' is missing "
                                              r"\(null\)"):
        tasks.load(task_cfg(path), 0, None)
    empty = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"prompt": [], "answer": []}).to_parquet(str(empty))
    with pytest.raises(tasks.TaskError, match=r"empty.parquet' has no rows."):
        tasks.load(task_cfg(empty), 0, None)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(tasks.TaskError, match=r"empty.jsonl' has no rows."):
        tasks.load(task_cfg(tmp_path / "empty.jsonl"), 0, None)
    other = tmp_path / "data.txt"
    other.write_text("hello")
    with pytest.raises(tasks.TaskError, match=r"unknown file type .txt; supported: \['.arrow', '.csv', '.json', "):
        tasks.load(task_cfg(other), 0, None)


@pytest.mark.parametrize("folder,files,held", [
    ("data", [], "it is empty"),
    ("x.jsonl", [], "it is empty"),  # a folder named like a file
    ("notes", ["readme.txt", "sub/a.md"], "it holds readme.txt, sub/a.md"),
])
def test_a_folder_without_data_files_is_one_message(tmp_path, folder, files, held):
    """Was: datasets' "EmptyDatasetError: Couldn't resolve pattern ** with resolver functools.partial(...)"."""
    path = tmp_path / folder
    path.mkdir()
    for name in files:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text("hello")
    with pytest.raises(tasks.TaskError) as e:
        tasks.load(task_cfg(path), 0, None)
    named = " (named like a .jsonl file)" if folder.endswith(".jsonl") else ""
    assert str(e.value).startswith(f"task.path='{path}' is a folder{named} with no data file in it ({held}). "
                                   "task=dataset reads a file (.jsonl, .json, .parquet, .csv, .arrow"), str(e.value)
    assert "point task.path at one of those" in str(e.value) and "resolve pattern" not in str(e.value)


@pytest.mark.slow  # ~5 s: loads data through `datasets` (its first import)
def test_unimportable_rewards_say_why(tmp_path, monkeypatch):
    path = write(tmp_path, GSM, "jsonl")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_rw.py").write_text("def score(completion, answer):\n    return 1.0 +\n")
    (tmp_path / "failing_rw.py").write_text("import math\n\nX = undefined_name\n")

    def error(spec):
        with pytest.raises(tasks.TaskError) as e:
            tasks.load(task_cfg(path, prompt_key="question", rewards=[spec]), 0, None)
        return str(e.value)

    assert error("no_such_module_rw:score") == (
        f"task.rewards[0].fn='no_such_module_rw:score': no module named 'no_such_module_rw' (looked in the working "
        f"directory {tmp_path} and the installed packages). Put no_such_module_rw.py in the working directory, give "
        "a file path ('path/to/file.py:function'), or install the module.")
    assert "rlrun/tasks/rewards.py has no function 'nope'; it defines ['answer_number', 'exact_match', 'format', " \
           "'length_penalty', 'math_verify', 'numeric_match', 'partial_credit', " \
           "'random_reward']" in error("rlrun.tasks.rewards:nope")
    assert error("broken_rw:score") == (f"task.rewards[0].fn='broken_rw:score': {tmp_path}/broken_rw.py:2: syntax "
                                        "error (invalid syntax); fix the file.")
    assert error("broken_rw.py:score").endswith("broken_rw.py:2: syntax error (invalid syntax); fix the file.")
    assert f"raised NameError: name 'undefined_name' is not defined at {tmp_path}/failing_rw.py:3" in \
        error("failing_rw:X")
    assert "no file " in error("rewards/missing.py:score")
    assert error("justaname") == ("task.rewards[0].fn='justaname' must be 'module:function' or "
                                  "'path/to/file.py:function'.")


def test_rewards_from_the_working_directory_and_from_a_file(tmp_path, monkeypatch):
    path = write(tmp_path, GSM, "jsonl")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "cwd_rewards_t", raising=False)
    (tmp_path / "cwd_rewards_t.py").write_text("def score(completion, answer, question, **kw):\n"
                                               "    return float(question.startswith(completion))\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mine.py").write_text("def shorter(completion, prompt, limit):\n"
                                              "    return float(len(completion) < limit)\n")
    rewards = ["cwd_rewards_t:score", {"fn": "lib/mine.py:shorter", "weight": 0.5, "kwargs": {"limit": 4}},
               {"fn": str(tmp_path / "lib" / "mine.py") + ":shorter", "name": "short2", "kwargs": {"limit": 9}}]
    task = tasks.load(task_cfg(path, prompt_key="question", rewards=rewards), 0, None)
    assert task.reward_names == ["score", "shorter", "short2"]
    totals, per = task.score(["Tom", "A box"], task.train[:2])
    assert per == {"score": [1.0, 1.0], "shorter": [1.0, 0.0], "short2": [1.0, 1.0]}
    assert totals == [2.5, 2.0]
    assert str(tmp_path) not in sys.path  # the working directory was on sys.path for the import only


def test_legacy_reward_key_and_both_keys(tmp_path):
    path = write(tmp_path, [{"prompt": "1+1=", "answer": "2"}], "jsonl")
    task = tasks.load(task_cfg(path, reward="rlrun.tasks:partial_credit", rewards=None), 0, None)
    assert task.score(["2", "3"], task.train * 2) == ([1.0, 0.5], {"partial_credit": [1.0, 0.5]})
    with pytest.raises(tasks.TaskError, match=r"set task.reward \(one function\) or task.rewards \(a list\), not both"):
        tasks.load(task_cfg(path, reward="rlrun.tasks:partial_credit"), 0, None)
    with pytest.raises(tasks.TaskError, match=r"no reward is set \(task.reward and task.rewards are empty\)"):
        tasks.load(task_cfg(path, rewards=[]), 0, None)
    with pytest.raises(tasks.TaskError, match=r"task.rewards\[0\] has unknown key\(s\) \['wieght'\]"):
        tasks.load(task_cfg(path, rewards=[{"fn": "rlrun.tasks:exact_match", "wieght": 2}]), 0, None)


# --- lengths ---------------------------------------------------------------------------------------------------


@pytest.mark.slow  # ~5 s: loads data through `datasets` (its first import)
def test_length_warnings_have_numbers(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "what is 3+4? answer in words:", "answer": "seven"},
            {"prompt": "x" * 40, "answer": "eight"}]
    task = tasks.load(task_cfg(write(tmp_path, rows, "jsonl")), 0, None)
    tok = char_tokenizer()
    assert tasks.check_lengths(task, tok, 4, 256) == [
        "2 of 3 answers are longer than rollout.max_new_tokens=4 tokens (the longest is 5 tokens: 'seven'). "
        "Completions stop at that length, so a reward that needs the whole answer in the completion can never be "
        "earned on those rows: raise rollout.max_new_tokens to at least 5 (not needed when the reward extracts part "
        "of the answer, as numeric_match does with '####')."]
    with pytest.raises(tasks.TaskError) as e:  # one prompt past the context: refused, the cut named as a fix
        tasks.check_lengths(task, tok, 8, 40)
    assert str(e.value) == (
        "1 of 3 prompts do not fit the model's context: prompt + rollout.max_new_tokens=8 > 40 positions (the "
        "longest prompt is 40 tokens). Set task.max_prompt_tokens=32 (keeps the last 32 tokens of each), shorten "
        "or drop them, lower rollout.max_new_tokens, or use a model with a longer context.")
    cut = tasks.load(task_cfg(write(tmp_path, rows, "jsonl", "cut"), max_prompt_tokens=32), 0, tok)
    assert cut.train[2]["prompt"] == "x" * 32 and cut.train[1]["prompt"] == rows[1]["prompt"]  # the others stay
    assert cut.warnings == ["1 of 3 prompts were longer than task.max_prompt_tokens=32 tokens (the longest 40) and "
                            "keep only their last 32 tokens."]
    assert tasks.check_lengths(cut, tok, 8, 40) == cut.warnings  # it fits now: no error, the cut said once
    with pytest.raises(tasks.TaskError, match=r"all 3 prompts are too long: the shortest is 4 tokens \+ "
                                              r"rollout.max_new_tokens=8 > the model's context of 10 positions"):
        tasks.check_lengths(task, tok, 8, 10)
    with pytest.raises(tasks.TaskError, match="the task has no rows"):
        tasks.check_lengths([], tok, 8, 10)
    pairs = [{"prompt": "1+1=", "chosen": "2", "rejected": "three"}, {"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
    assert tasks.check_lengths(pairs, tok, None, 9) == [
        "1 of 2 pairs are longer than the model's context of 9 positions (prompt + longer response + EOS; the "
        "longest is 10 tokens): shorten or drop them, or use a model with a longer context."]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_row_over_the_size_limit_is_refused_before_tokenizing_naming_where(tmp_path, fmt, monkeypatch):
    from rlrun.tasks import dataset, loading

    monkeypatch.setattr(loading, "MAX_ROW_BYTES", 4096)  # the same check as at 1 MiB, with a small file
    monkeypatch.setattr(dataset, "MAX_ROW_BYTES", 4096)
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "x" * 5000, "answer": "3"}]
    path = write(tmp_path, rows, fmt)
    where = f"{path}:2: this line" if fmt == "jsonl" else f"{path} (train row 1): the prompt"
    refused = r" is longer than 4,096 bytes; longer .* are refused .*Shorten or drop"
    with pytest.raises(tasks.TaskError, match=re.escape(where) + refused):
        tasks.load(task_cfg(path), 0, char_tokenizer())


def test_the_historic_jsonl_reader_refuses_an_oversized_line_too(tmp_path, monkeypatch):
    from rlrun.tasks import loading

    monkeypatch.setattr(loading, "MAX_ROW_BYTES", 4096)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n" + json.dumps({"prompt": "y" * 5000,
                                                                                      "answer": "b"}) + "\n")
    with pytest.raises(tasks.TaskError, match=re.escape(f"{path}:2: this line is")):
        loading.read_jsonl(str(path), ("prompt", "answer"))


@pytest.mark.parametrize("reader", ["dataset", "jsonl"])
def test_bytes_that_are_not_utf8_are_named_by_line_and_column(tmp_path, reader):
    from rlrun.tasks import loading

    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff\xfe", "answer": "3"}\n')
    with pytest.raises(tasks.TaskError, match=re.escape(f"{path}:2: not UTF-8 text (byte 0xff at column 13); save "
                                                        "the file as UTF-8.")):
        if reader == "dataset":
            tasks.load(task_cfg(path), 0, char_tokenizer())
        else:
            loading.read_jsonl(str(path), ("prompt", "answer"))


def test_a_cut_prompt_fits_its_token_budget_with_a_byte_level_tokenizer():
    """A cut inside a multi-byte character decodes to U+FFFD, which re-encodes longer: the cut goes further."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from rlrun.tasks import lengths

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["テストの文です。", "hello world"] * 20, vocab_size=300, min_frequency=1)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    prompt = "質問:テスト文章の最後の部分です。答えは?" * 3
    task = tasks.Task("t", [{"prompt": prompt, "answer": "1"}], [], [])
    for n in (5, 8, 12, 16):
        row = {"prompt": prompt, "answer": "1"}
        task.train, task.warnings = [row], []
        lengths.cut_prompts(task, tok, n)
        assert 0 < len(tok(row["prompt"], add_special_tokens=False)["input_ids"]) <= n
        assert "\ufffd" not in row["prompt"][:1] and prompt.endswith(row["prompt"])


def test_task_rewards_replace_the_tasks_default_reward(tmp_path, monkeypatch, caplog):
    """task=arith ships reward: partial_credit; `task.rewards=[...]` on the command line replaces it (it needed
    task.reward=null); both given on the command line is still refused."""
    import logging

    from rlrun.tasks import core

    path = write(tmp_path, [{"prompt": "1+1=", "answer": "2"}], "jsonl")
    cfg = task_cfg(path, reward="rlrun.tasks:partial_credit", rewards=["rlrun.tasks.rewards:exact_match"])
    monkeypatch.setattr(core, "given_on_command_line", lambda key: False)  # reward: the YAML file's default
    with caplog.at_level(logging.INFO, logger="rlrun"):
        task = tasks.load(cfg, 0, None)
    assert [r.name for r in task.rewards] == ["exact_match"]
    assert "task.rewards replaces the task's default task.reward=rlrun.tasks:partial_credit" in caplog.text
    monkeypatch.setattr(core, "given_on_command_line", lambda key: key == "task.reward")  # both given
    with pytest.raises(tasks.TaskError, match="not both"):
        tasks.load(cfg, 0, None)


def test_given_on_command_line_reads_hydras_overrides(monkeypatch):
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from rlrun.tasks import core

    assert core.given_on_command_line("task.reward")  # outside a Hydra run: everything is given
    hydra_cfg = OmegaConf.create({"hydra": {"overrides": {"task": ["task.rewards=[x:y]", "+task.reward=a:b"]}}})
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra_cfg.hydra))
    assert core.given_on_command_line("task.reward") and not core.given_on_command_line("task.size")
