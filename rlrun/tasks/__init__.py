"""Tasks: prompts with verifiable answers (or preference pairs) and the rewards that score completions.

The recipes call:

    task = tasks.load(cfg, seed, tokenizer)   # cfg: the `task` config node; tokenizer may be None (no template)
    task.train        # list[dict]: "prompt" (the exact text fed to the tokenizer, chat template applied),
                      #   "answer" (str), plus the row's other columns (task=dataset)
    task.eval         # list[dict]: held-out rows (may be empty), whose prompts never occur in task.train
    task.score(completions, rows) -> (totals, {reward name: values})   # lists of floats, one per completion
    train_pairs, eval_pairs = tasks.load_pairs(cfg, seed, tokenizer)   # rows {prompt, chosen, rejected}
    warnings = tasks.check_lengths(task_or_rows, tokenizer, max_new_tokens, max_positions)

`cfg` is the validated `task` node (rlrun/config holds its defaults and checks). `Task` and `TaskReader` in
protocol.py are the contract; the reader of each kind is `registry.get("task", name)`.

Task kinds (`task.name`): `arith` (synthetic, from the seed: arith.py), `jsonl` (the historic reader, jsonl.py:
string fields `prompt` and `answer`, or `prompt` / `chosen` / `rejected`), `dataset` (dataset.py: local files or
folders through the `datasets` library: jsonl, json, parquet, csv, arrow, a folder of such files whose names give
the splits, or a `save_to_disk` folder; nothing is ever downloaded: a hub name is refused, saying how to download
it first). Column mapping: task.prompt_key / answer_key / chosen_key / rejected_key. Held out: task.eval_split
(another split) or task.eval_size (an int count or a float fraction of the distinct training prompts, drawn with
the seed; all rows of a drawn prompt leave train). task.max_rows keeps the first rows of each split. A mapped
column keeps its own name in the row too; a column literally named `prompt` / `answer` is replaced by the mapped
values.

check_lengths counts tokens as the rollout encodes them (no special tokens): it refuses GRPO prompts that with
rollout.max_new_tokens overflow max_positions (task.max_prompt_tokens=N, applied by `load`, keeps each prompt's
last N tokens instead), warns about answers longer than max_new_tokens and DPO pairs longer than the context (the
loader's own warnings come first), and raises TaskError when there are no rows or every pair is too long.

Prompts are text or chat messages ([{role, content}]). task.chat_template: auto (apply the tokenizer's template
when it has one; the default of task=dataset), true (a tokenizer without one is an error), false (prompts are fed
as they are, and a messages prompt is an error; the default of arith and jsonl). Text becomes one user message;
task.system_prompt (needs a template) goes first unless the row starts with a system message;
task.add_generation_prompt (default true).

Rewards: `task.reward: module:function` (one, weight 1) or `task.rewards: [{fn, weight: 1.0, name, kwargs}]`
(entries may also be plain 'module:function' strings), not both. `fn` is `module:function` (imported with the
working directory on sys.path for that import, so rewards.py beside you works) or `path/to/file.py:function`.
A reward's name (default: the function's name) is logged as rewards/<name>/mean; weight 0 logs it without using it.
The total is the weighted sum; one reward of weight 1.0 gives its values bit for bit. Library:
rlrun.tasks.rewards (exact_match, numeric_match, format, length_penalty, partial_credit).

How a reward is called, per completion (not with a batch, as TRL's are): `fn(completion, ...)`, where
- a function with **kwargs gets every row field by keyword: answer, prompt (the formatted text), the row's other
  columns, then the entry's kwargs (which win over a column of the same name);
- otherwise it gets, by keyword, the fields and kwargs its parameters name;
- the historic form: under `task.reward`, a required second positional parameter that no field names receives
  the answer positionally, so `f(completion, answer)` and `f(completion, target)` work as always (under
  `task.rewards`, `f(completion, answer)` works by name, and `f(completion, target)` is refused: a forgotten
  kwarg must not silently get the answer); a positional-only second parameter always gets the answer;
- a required parameter nothing provides, or a kwarg the function does not take, is refused when the task loads.
A reward must return a finite number: int, float, bool (True is 1.0) or a numpy scalar. Raising (SystemExit
included), or returning None, NaN, inf, a string, a list or a tensor stops with one TaskError naming the reward,
the completion's place, its prompt and answer, and the value; so does a weighted total that is not finite. Each call
gets copies of the row's mutable values (a list column changed by one call is unchanged for the next) and the
working directory is restored after it.

A run calls the rewards in one worker process (`with tasks.isolated(task, cfg.task.reward_timeout_s, seed):`,
worker.py): a call bounded by task.reward_timeout_s, os._exit / KeyboardInterrupt / a crash inside a reward a
TaskError naming it, SIGTERM never held up by a hung reward. Outside that block (a library caller), `task.score`
calls them in the calling process, unbounded.
"""

from __future__ import annotations

from .arith import arith_examples, arith_pairs
from .base import TaskError
from .core import Task, isolated, load, load_pairs
from .lengths import check_lengths
from .loading import read_jsonl
from .rewards import exact_match, partial_credit
from .scoring import load_reward
from .stream import PromptStream, prompt_stream

__all__ = [
    "PromptStream", "Task", "TaskError", "arith_examples", "arith_pairs", "check_lengths", "exact_match", "isolated",
    "load", "load_pairs", "load_reward", "partial_credit", "prompt_stream", "read_jsonl",
]
