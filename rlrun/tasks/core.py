"""`load` / `load_pairs`: the `task` config node -> rows (train / eval) and bound rewards; the historic `build` /
`build_pairs`; `check_config`, the cheap checks a CLI can run without reading data."""

from __future__ import annotations

import numbers
import random
from dataclasses import dataclass, field

from . import scoring
from .arith import arith_examples, arith_pairs
from .base import MISSING, TaskError, opt, short
from .chat import Formatter, template_setting
from .lengths import cut_prompts
from .loading import MAX_ROW_BYTES, Split, load_splits, read_jsonl, resolve
from .scoring import load_reward

NAMES = ("arith", "jsonl", "dataset")
DEFAULTS = {
    "split": "train", "eval_split": None, "eval_size": 0, "max_rows": None,
    "prompt_key": "prompt", "answer_key": "answer", "chosen_key": "chosen", "rejected_key": "rejected",
    "add_generation_prompt": True, "system_prompt": None, "reward": None, "rewards": None, "max_prompt_tokens": None,
}  # chat_template: 'auto' for dataset; false for arith and jsonl, whose prompts were always fed as they are


@dataclass
class Task:
    """Rows to train and evaluate on, and the rewards that score completions (see rlrun.tasks)."""

    name: str
    train: list[dict]
    eval: list[dict]
    rewards: list[scoring.Reward] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # from loading; check_lengths returns them too

    def score(self, completions: list[str], rows: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
        return scoring.score(self.rewards, completions, rows)

    @property
    def reward_names(self) -> list[str]:
        return [r.name for r in self.rewards]


def _options(cfg) -> tuple[dict, list[str]]:
    """(the task options with defaults filled in, the problems found). Reads no data, imports no reward."""
    name, p = opt(cfg, "name"), []
    if name not in NAMES:
        return {"name": name}, [f"task={name!r} is not supported; supported: {list(NAMES)}."]
    o = {k: opt(cfg, k, d) for k, d in DEFAULTS.items()}
    o.update(name=name, chat_template=opt(cfg, "chat_template", "auto" if name == "dataset" else False))
    checks = (lambda: template_setting(o["chat_template"]), lambda: scoring.parse_rewards(o["reward"], o["rewards"]))
    for check in checks:
        try:
            check()
        except TaskError as e:
            p.append(str(e))
    if not isinstance(o["add_generation_prompt"], bool):
        p.append(f"task.add_generation_prompt={o['add_generation_prompt']!r} must be true or false.")
    if o["system_prompt"] is not None and not (isinstance(o["system_prompt"], str) and o["system_prompt"].strip()):
        p.append(f"task.system_prompt={o['system_prompt']!r} must be a non-empty string or null.")
    n = o["max_prompt_tokens"]
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        p.append(f"task.max_prompt_tokens={n!r} must be a positive integer or null.")
    e = o["eval_size"]
    if isinstance(e, bool) or not (isinstance(e, int) and e >= 0 or isinstance(e, float) and 0 <= e < 1):
        p.append(f"task.eval_size={e!r} must be a count (int >= 0) or a fraction in [0, 1) of the training rows.")
    if name == "arith":
        o.update(size=opt(cfg, "size"), max_operand=opt(cfg, "max_operand"), ops=opt(cfg, "ops"))
        ops = o["ops"] if isinstance(o["ops"], list) else [o["ops"]]
        if not ops or any(op not in ("+", "-", "*") for op in ops):
            p.append(f"task.ops={ops} must be a non-empty list of '+', '-', '*'.")
        for k, low in (("size", 1), ("max_operand", 0)):
            if isinstance(o[k], bool) or not isinstance(o[k], int) or o[k] < low:
                p.append(f"task.{k}={o[k]!r} must be an integer >= {low}.")
    else:
        o["path"] = opt(cfg, "path", MISSING)
        if name == "jsonl" and o["path"] in (MISSING, None, ""):
            p.append("task=jsonl needs task.path=FILE (JSONL with 'prompt' and 'answer' fields).")
    if name == "dataset":
        p += _dataset_problems(o)
    elif o["eval_split"] is not None:
        p.append(f"task.eval_split is for task=dataset; task={name} holds out rows with task.eval_size.")
    return o, p


def _dataset_problems(o: dict) -> list[str]:
    p = []
    try:
        resolve(o["path"])
    except TaskError as e:
        p.append(str(e))
    for k in ("split", "prompt_key", "answer_key", "chosen_key", "rejected_key"):
        if not (isinstance(o[k], str) and o[k]):
            p.append(f"task.{k}={o[k]!r} must be a non-empty string.")
    if o["eval_split"] is not None:
        if not (isinstance(o["eval_split"], str) and o["eval_split"]) or o["eval_split"] == o["split"]:
            p.append(f"task.eval_split={o['eval_split']!r} must name another split than task.split={o['split']!r}.")
        if o["eval_size"]:
            p.append("set task.eval_split (a split of the data) or task.eval_size (rows held out of task.split), "
                     "not both.")
    m = o["max_rows"]
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        p.append(f"task.max_rows={m!r} must be a positive integer or null (all rows).")
    return p


def check_config(cfg) -> list[str]:
    """Problems with the `task` node, each a sentence with the fix; cheap (no data read, nothing imported): for
    the CLI's validation. `load` / `load_pairs` raise the same messages."""
    return _options(cfg)[1]


def options(cfg) -> dict:
    o, problems = _options(cfg)
    if problems:
        raise TaskError(" ".join(problems))
    return o


def _text(value, where: str, key: str) -> str:
    """An answer / chosen / rejected cell as text: numbers become their str() (CSV and parquet type them)."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value:
        return str(value)
    what = "missing (null)" if value is None else "empty" if isinstance(value, str) else \
        f"{short(value)} ({type(value).__name__})"
    raise TaskError(f"{where}: {key} is {what}; every row needs non-empty text there.")


def _columns(split: Split, keys: list[str], o: dict) -> None:
    for k in keys:
        if o[k] not in split.columns:
            raise TaskError(f"{split.path} (split {split.name!r}): task.{k}={o[k]!r} is not a column; its columns "
                            f"are {split.columns}. Set task.{k}=<one of them>.")


def _rows(split: Split, o: dict, fmt: Formatter, pairs: bool) -> list[dict]:
    """Rows of a loaded split: GRPO {**columns, prompt: text, answer}; DPO {prompt, chosen, rejected}."""
    keys = ["prompt_key", "chosen_key", "rejected_key"] if pairs else ["prompt_key", "answer_key"]
    _columns(split, keys, o)
    if not split.rows:
        raise TaskError(f"{split.path}: split {split.name!r} has no rows.")
    out = []
    for i, rec in enumerate(split.rows):
        where = split.where(i)
        prompt = fmt(rec[o["prompt_key"]], where, f"task.prompt_key={o['prompt_key']!r}")
        if pairs:
            row = {"prompt": prompt}
            for side in ("chosen", "rejected"):
                key = o[f"{side}_key"]
                row[side] = _text(rec[key], where, f"task.{side}_key={key!r}")
        else:
            key = o["answer_key"]
            row = {**rec, "prompt": prompt, "answer": _text(rec[key], where, f"task.answer_key={key!r}")}
        for name in ("prompt", "chosen", "rejected") if pairs else ("prompt", "answer"):  # any format (parquet,
            if len(row[name].encode()) > MAX_ROW_BYTES:  # csv: no lines); only the texts built here
                raise TaskError(f"{where}: the {name} is longer than {MAX_ROW_BYTES:,} bytes; longer texts are "
                                "refused (far longer than any model's context). Shorten or drop that row.")
        out.append(row)
    return out


def _held_out(rows: list[dict], eval_rows: list[dict] | None, eval_size, seed: int, what: str):
    """(train, eval, warnings). With eval_size, distinct prompts are drawn with the seed (a count or fraction of
    them); every row of a drawn prompt leaves train, and eval keeps one row per prompt. With an eval split,
    train rows whose prompt is also in eval are dropped (counted in a warning). Train keeps its order."""
    if eval_rows is None and not eval_size:
        return rows, [], []
    warnings, from_split = [], eval_rows is not None
    if not from_split:
        first = {}
        for r in rows:
            first.setdefault(r["prompt"], r)
        prompts, n = list(first.values()), len(first)
        k = eval_size if isinstance(eval_size, int) else max(1, round(eval_size * n))
        if k >= n:
            raise TaskError(f"task.eval_size={eval_size} holds out {k} of the {n} distinct {what} prompts, leaving "
                            "none to train on; lower it.")
        picked = sorted(random.Random(f"rlrun-eval-{seed}").sample(range(n), k))
        eval_rows = [prompts[i] for i in picked]
    held = {r["prompt"] for r in eval_rows}
    train = [r for r in rows if r["prompt"] not in held]
    if not train:
        raise TaskError(f"every training prompt is also in the eval split ({len(held)} prompts); nothing is left "
                        "to train on.")
    if from_split and len(train) < len(rows):
        warnings.append(f"{len(rows) - len(train)} of {len(rows)} training rows have a prompt that is also in the "
                        "eval split; they were left out of training.")
    return train, eval_rows, warnings


def _read(o: dict, seed: int, tokenizer, pairs: bool):
    """(train rows, eval-split rows or None), prompts formatted, before holding out."""
    fmt = Formatter(tokenizer, o["chat_template"], o["add_generation_prompt"], o["system_prompt"])
    if o["name"] == "dataset":
        names = [("task.split", o["split"])] + ([("task.eval_split", o["eval_split"])] if o["eval_split"] else [])
        splits = load_splits(o["path"], names, o["max_rows"])
        rows = _rows(splits[0], o, fmt, pairs)
        return rows, (_rows(splits[1], o, fmt, pairs) if len(splits) > 1 else None)
    if o["name"] == "arith":
        ops = list(o["ops"])
        rows = arith_examples(o["size"], o["max_operand"], ops, seed)
        rows = arith_pairs(rows, seed) if pairs else rows
    else:
        rows = read_jsonl(o["path"], ("prompt", "chosen", "rejected") if pairs else ("prompt", "answer"))
    if fmt.use:  # arith / jsonl default to chat_template=false: these rows stay the very same objects
        where = o.get("path") or "task=arith"
        rows = [dict(r, prompt=fmt(r["prompt"], f"{where} row {i}", "prompt")) for i, r in enumerate(rows)]
    return rows, None


def load(cfg, seed: int, tokenizer=None) -> Task:
    """The GRPO task of the `task` config node (see rlrun.tasks for the contract)."""
    o = options(cfg)
    rows, eval_rows = _read(o, seed, tokenizer, pairs=False)
    train, held, warnings = _held_out(rows, eval_rows, o["eval_size"], seed, "training")
    fields = set().union(*(r.keys() for r in (train[:1] + held[:1])))
    rewards = scoring.load_rewards(o["reward"], o["rewards"], fields)
    task = Task(o["name"], train, held, rewards, warnings)
    if o["max_prompt_tokens"] is not None and tokenizer is not None:
        cut_prompts(task, tokenizer, o["max_prompt_tokens"])
    return task


def load_pairs(cfg, seed: int, tokenizer=None) -> tuple[list[dict], list[dict]]:
    """(train pairs, eval pairs) for loss=dpo: rows {prompt, chosen, rejected} (the caller adds "id")."""
    o = options(cfg)
    rows, eval_rows = _read(o, seed, tokenizer, pairs=True)
    train, held, _ = _held_out(rows, eval_rows, o["eval_size"], seed, "pair")
    return train, held


def build_pairs(cfg, seed: int) -> list[dict]:
    """Preference pairs for `loss=dpo` from the same `task` options: synthetic from `arith`, or a JSONL file with
    `prompt`, `chosen`, `rejected`. Historic entry point: `load_pairs` is the one with a tokenizer."""
    if cfg.name == "arith":
        return arith_pairs(arith_examples(cfg.size, cfg.max_operand, list(cfg.ops), seed), seed)
    if cfg.name == "jsonl":
        return read_jsonl(cfg.path, ("prompt", "chosen", "rejected"))
    if cfg.name == "dataset":
        return load_pairs(cfg, seed)[0]
    raise TaskError(f"task={cfg.name!r} has no preference pairs; use task=arith, task=jsonl or task=dataset.")


def build(cfg, seed: int):
    """(examples, reward_fn) for the `task` config group. Historic entry point (one `reward`): `load` is the one
    with eval rows, several rewards and chat templates."""
    if cfg.name == "arith":
        ops = list(cfg.ops)
        bad = [op for op in ops if op not in "+-*"]
        if bad or not ops:
            raise TaskError(f"task.ops={ops} must be a non-empty list of '+', '-', '*'.")
        examples = arith_examples(cfg.size, cfg.max_operand, ops, seed)
    elif cfg.name == "jsonl":
        examples = read_jsonl(cfg.path, ("prompt", "answer"))
    else:
        raise TaskError(f"task={cfg.name!r} has no GRPO examples through build(); use rlrun.tasks.load.")
    return examples, load_reward(cfg.reward)

