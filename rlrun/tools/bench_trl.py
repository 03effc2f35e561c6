"""`python -m rlrun.bench trl`: rlrun's GRPO run and TRL's GRPOTrainer on the same work, side by side.

The workload (README, "rlrun and TRL side by side"): the embedded tiny Llama after its warm start, saved with
save_pretrained and loaded by both; the task's training prompts in rlrun's order (TRL reads them unshuffled);
rlrun's reward; DAPO, clip 0.2 / 0.28, no KL; 8 prompts x 16 completions = 128 sequences per optimizer step,
micro-batches of 64; lr 1e-3 constant, Adam betas (0.9, 0.99), grad clip 1.0; fp32; the task's new tokens (4 by
default; `--task varied_lengths`: sums of 2-12 operands with worked answers of 1-32 tokens, 40 at most). rlrun runs
with its defaults otherwise plus the task's best exact settings (`TASKS`: batching=shared_prompt on
varied_lengths), with only evaluation and export off (TRL does neither here); TRL with the arguments that make its
run the same work. `--impls` adds rlrun_async (rollout.pipeline=async K=1: not exact, its learning beside it) and
trl_cb (TRL generating with transformers' continuous batching).

Each round runs every impl, one after the other, each in its own process (so peaks do not mix) with `--threads`
threads, and rotates which goes first. A round's speed is the median wall time of its steps after the first
`--warmup`, from one step's end to the next (generation, scoring, logprob passes, update and logging included).
Round r uses seed r, so the rounds also give the mean reward curve over seeds (learning parity).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import resource
import statistics
import tempfile
import time
from typing import Any

import torch

from .. import render
from ..meters import MIB

PROMPTS_PER_STEP, GROUP, MICRO, LR = 8, 16, 64, 1e-3  # the tiny model's workload
# --model: the tiny model's work is the embedded default after its warm start (--task picks the task); a real
# model's is its experiment (sizes, task, sampling, LoRA), read from the composed config for both rlrun and TRL
MODELS = {"tiny": [], "smollm2": ["experiment=smollm2"]}
# --task: the rlrun overrides that make the work, and rlrun's best exact settings for it beyond the defaults
# (logprob_policy=window and train.skip_zero_advantage are defaults already)
TASKS = {"default": ([], []), "varied_lengths": (["experiment=varied_lengths"], ["batching=shared_prompt"])}
# --impls: rlrun's runs (their overrides) and TRL's (GRPOConfig settings beyond the workload's)
RLRUN = {"rlrun": [], "rlrun_async": ["rollout.pipeline=async", "rollout.max_staleness=1"]}
TRL: dict[str, dict[str, Any]] = {"trl": {}, "trl_cb": {"use_transformers_continuous_batching": True}}
IMPLS = (*RLRUN, *TRL)


def available() -> bool:
    return importlib.util.find_spec("trl") is not None


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ..cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def work(task: str, seed: int, model: str = "tiny"):
    """The validated config of the work with `seed` (model, task, rollout length): `task`'s on the tiny model, a
    real model's experiment otherwise."""
    from ..config import validate

    return validate(compose(["tracking=none", f"seed={seed}", *(MODELS[model] or TASKS[task][0])]))


def sizes(cfg, model: str) -> dict:
    """The workload's sizes and settings, the same for rlrun and TRL: the tiny model's, else the experiment's."""
    if model == "tiny":
        return dict(prompts=PROMPTS_PER_STEP, group=GROUP, micro=MICRO, lr=LR, temperature=1.0, lora=None,
                    new_tokens=cfg.rollout.max_new_tokens)
    t, lora = cfg.train, cfg.model.lora
    return dict(prompts=t.rollout_batch // t.group_size, group=t.group_size, micro=t.micro_batch, lr=t.lr,
                temperature=cfg.rollout.temperature, new_tokens=cfg.rollout.max_new_tokens,
                lora=(lora.rank, lora.alpha) if lora.enabled else None)


def warm_policy(cfg, seed: int):
    """(policy, tokenizer, task) of `cfg`: the model as a run starts from it (the embedded one warm-started)."""
    from .. import models, tasks, warmstart

    policy, tokenizer = models.build(cfg.model, seed)
    task = tasks.load(cfg.task, seed, tokenizer)
    if warmstart.applies(cfg):  # as a run decides (auto: the embedded model on arith only, never a real model)
        warmstart.warm_start(policy, tokenizer, task.train, dataclasses.asdict(cfg.warm_start), seed,
                             cache=cfg.warm_start.cache)
    return policy, tokenizer, task


def prepare(folder: str, seed: int, steps: int, task_name: str = "default", model: str = "tiny"):
    """(the model folder both load, the first `steps` steps' prompt rows in the order rlrun draws them with `seed`):
    the tiny model warm-started and written to `folder`, or a real model's cached folder as it is."""
    from .. import export, models, registry, tasks

    cfg = work(task_name, seed, model)
    if model == "tiny":
        policy, tokenizer, task = warm_policy(cfg, seed)
        export.export(policy, tokenizer, folder)
    else:
        folder = registry.get("model", cfg.model.name).folder(cfg.model)
        _, tokenizer = models.load_hf_config(folder)
        task = tasks.load(cfg.task, seed, tokenizer)
    stream = tasks.prompt_stream(task.train, seed)
    return folder, [dict(next(stream)) for _ in range(steps * sizes(cfg, model)["prompts"])]


def rlrun_overrides(model_dir: str, steps: int, seed: int, uri: str, extra: list[str], task: str = "default",
                    impl: str = "rlrun", model: str = "tiny") -> list[str]:
    """rlrun's default run on the workload: only what the workload fixes, and what TRL does not do here; then the
    task's best exact settings, the impl's (async) and `extra`. A real model: its experiment as it is."""
    if model != "tiny":
        return [*MODELS[model], f"train.steps={steps}", f"seed={seed}", "eval.every=0", "export.enabled=false",
                "progress=false", f"tracking.uri={uri}", *RLRUN[impl], *extra]
    work_args, best = TASKS[task]
    new_tokens = work(task, seed).rollout.max_new_tokens
    return [*work_args, "model=hf", f"model.path={model_dir}", f"train.steps={steps}", f"seed={seed}",
            f"train.rollout_batch={PROMPTS_PER_STEP * GROUP}", f"train.batch_size={PROMPTS_PER_STEP * GROUP}",
            f"train.group_size={GROUP}", f"train.micro_batch={MICRO}", f"train.lr={LR}",
            "train.lr_schedule=constant", f"rollout.max_new_tokens={new_tokens}", "loss=dapo", "loss.kl_coef=0",
            "eval.every=0", "export.enabled=false", "progress=false", f"tracking.uri={uri}", *best, *RLRUN[impl],
            *extra]


@contextlib.contextmanager
def rlrun_run(overrides, run_name: str):
    """rlrun with `overrides(uri)` in this process, in a temporary folder with its own store `uri` (the run's spill
    file and output stay there); yields `history(name)`: the run's metric `name` (the code's name) by step."""
    from .. import cli
    from ..tracking import metric_key, open_client

    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        uri = f"sqlite:///{tmp}/mlflow.db"
        cli.run(compose(overrides(uri)), run_name)
        client = open_client(uri)
        [run] = client.search_runs([client.get_experiment_by_name("rlrun").experiment_id])
        yield lambda name: sorted(client.get_metric_history(run.info.run_id, metric_key(name)), key=lambda m: m.step)


def rlrun_child(a, model_dir: str, seed: int, log_path: str, impl: str, out_path: str) -> None:
    """One rlrun run of the workload in this (fresh) process; saves per-step wall times, rewards and lengths."""
    render.quiet(log_path)
    torch.set_num_threads(a.threads)
    with rlrun_run(lambda uri: rlrun_overrides(model_dir, a.steps, seed, uri, a.rlrun_args, a.task, impl, a.model),
                   f"bench-trl-{impl}") as history:
        # a step's metrics are logged as it ends: consecutive timestamps (ms) bound each step's wall time
        ends = [m.timestamp / 1000 for m in history("loss")]
        phases = {k: [m.value for m in history(f"time/{k}_s")] for k in
                  ("generate", "old_logprobs", "ref_logprobs", "train")}
        result = {"step_s": [b - e for e, b in zip(ends, ends[1:])],
                  "reward": [m.value for m in history("reward_mean")],
                  "length": [m.value for m in history("response_len_mean")],
                  "phases": {k: v for k, v in phases.items() if v}}
    torch.save({**result, "rss": peak_rss()}, out_path)


def trl_child(a, model_dir: str, rows: list[dict], seed: int, log_path: str, impl: str, out_path: str) -> None:
    """One TRL GRPOTrainer run of the workload in this (fresh) process (`impl`'s settings, TRL)."""
    render.quiet(log_path)
    torch.set_num_threads(a.threads)
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer


    cfg = work(a.task, seed, a.model)
    size = sizes(cfg, a.model)
    reward = trl_rewards(cfg, seed, AutoTokenizer.from_pretrained(model_dir))

    class Record(TrainerCallback):
        def __init__(self):
            self.ends, self.logs = [], []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.logs.append(logs)

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, use_cpu=True,
            seed=seed, max_steps=a.steps, per_device_train_batch_size=size["micro"],
            gradient_accumulation_steps=size["prompts"] * size["group"] // size["micro"],
            num_generations=size["group"], max_completion_length=size["new_tokens"], temperature=size["temperature"],
            top_p=1.0, top_k=0, shuffle_dataset=False,
            learning_rate=size["lr"], lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.99,
            weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
            scale_rewards="group", bf16=False, fp16=False, model_init_kwargs={"dtype": torch.float32}, **TRL[impl],
        )
        record = Record()
        data = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[record],
                              peft_config=lora_config(cfg) if size["lora"] else None)
        trainer.train()
    torch.save({"step_s": [b - e for e, b in zip(record.ends, record.ends[1:])],
                "reward": [x["rewards/reward/mean"] for x in record.logs],  # the task's, as rlrun's reward_mean
                "length": [x["completions/mean_length"] for x in record.logs], "phases": {}, "rss": peak_rss()},
               out_path)


def trl_rewards(cfg, seed: int, tokenizer) -> list:
    """rlrun's reward as TRL's reward functions: the task's score (loaded with the model's tokenizer, which a chat
    template needs; TRL logs it as rewards/reward/mean) and train.overlong=penalty's shaping where trained with."""
    from .. import tasks
    from ..recipes.sampling import overlong_of

    task, t, new = tasks.load(cfg.task, seed, tokenizer), cfg.train, cfg.rollout.max_new_tokens

    def reward(completions, answer, **_):
        return task.score(completions, [{"answer": x} for x in answer])[0]

    def overlong_penalty(completions, completion_ids, **_):  # TRL's ids end with EOS where it was generated
        length = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.float32)
        return overlong_of(length, new, t.overlong_buffer, t.overlong_penalty_factor).tolist()

    return [reward, overlong_penalty] if t.overlong == "penalty" else [reward]


def lora_config(cfg):
    """peft's LoraConfig of the experiment's model.lora, for TRL (rlrun builds its own: rlrun.models.add_lora)."""
    import peft

    lora = cfg.model.lora
    targets = list(lora.target_modules)
    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                           target_modules="all-linear" if targets == ["all-linear"] else targets,
                           task_type="CAUSAL_LM")


def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def round_row(impl: str, r: dict, warmup: int, sequences: int = PROMPTS_PER_STEP * GROUP) -> dict:
    """A run's speed: median step wall time after `warmup` steps, and what follows from it."""
    step_s = statistics.median(r["step_s"][warmup:])
    tokens = statistics.mean(r["length"]) * sequences  # completion tokens per step
    return {"impl": impl, "step_s": step_s, "steps_per_s": 1 / step_s, "tokens_per_s": tokens / step_s,
            "peak_rss_mib": r["rss"] / MIB, **{f"{k}_s": statistics.median(v[warmup:])
                                                 for k, v in r["phases"].items()}}


def summarize(rounds: list[dict[str, dict]], warmup: int, last: int, sequences: int = PROMPTS_PER_STEP * GROUP
              ) -> list[dict]:
    """One row per implementation: medians over rounds of each round's numbers, each round's steps/s, the mean
    reward curve over rounds (seeds), its mean over all steps and over the last `last` steps."""
    rows = []
    for impl in IMPLS:
        runs = [rnd[impl] for rnd in rounds if impl in rnd]
        if not runs:
            continue
        per_round = [round_row(impl, r, warmup, sequences) for r in runs]
        keys = dict.fromkeys(k for p in per_round for k in p if k != "impl")
        row = {k: statistics.median(p[k] for p in per_round if k in p) for k in keys}
        curve = mean_curve([r["reward"] for r in runs])
        row.update(impl=impl, rounds_steps_per_s=[p["steps_per_s"] for p in per_round], reward_curve=curve,
                   reward_mean=statistics.mean(curve), reward_last=statistics.mean(curve[-last:]))
        rows.append(row)
    return rows


def mean_curve(curves: list[list[float]]) -> list[float]:
    n = min(len(c) for c in curves)
    return [statistics.mean(c[i] for c in curves) for i in range(n)]


def table(rows: list[dict], a) -> str:
    model = getattr(a, "model", "tiny")
    cfg = work(a.task, 0, model)
    size, best = sizes(cfg, model), (TASKS[a.task][1] if model == "tiny" else MODELS[model])
    what = (f"the embedded model, task {a.task}" if model == "tiny" else
            f"{model} ({cfg.task.name}{', LoRA r' + str(size['lora'][0]) if size['lora'] else ''}, temperature "
            f"{size['temperature']}, lr {size['lr']:g})")
    lines = [f"GRPO (DAPO) on {what}, {size['prompts']} prompts x {size['group']} completions "
             f"per step, micro {size['micro']}, {size['new_tokens']} new tokens at most, fp32, "
             f"{a.threads} thread(s) a process; rlrun with {' '.join([*best, *a.rlrun_args]) or 'its defaults'}; "
             f"{a.rounds} interleaved round(s) of {a.steps} steps; medians over rounds of the median step after "
             f"{a.warmup}"
             + (f"\n(--jobs {a.jobs}: the runs overlapped, so the speed columns are not measurements)"
                if a.jobs > 1 else "")]
    num = render.num
    body = [[r["impl"], num(r["steps_per_s"], ".2f"), ",".join(num(x, ".2f") for x in r["rounds_steps_per_s"]),
             num(r["step_s"] * 1000, ".0f"), num(r["tokens_per_s"], ".0f"), num(r["peak_rss_mib"], ".0f"),
             num(r["reward_mean"], ".3f"), num(r["reward_last"], ".3f")] for r in rows]
    lines.append(render.table(["impl", "steps/s", "rounds", "step ms", "compl tok/s", "peak RSS MiB",
                               "reward, all steps", f"last {a.last}"], body))
    by = {r["impl"]: r for r in rows}
    trl = max((r for r in rows if r["impl"] in TRL), key=lambda r: r["steps_per_s"], default=None)
    for r in rows:
        if r["impl"] in RLRUN and trl is not None:
            diff = {k: r[k] - trl[k] for k in ("reward_mean", "reward_last")}
            lines.append(f"{r['impl']} / {trl['impl']} steps/s: {r['steps_per_s'] / trl['steps_per_s']:.2f}x; mean "
                         f"reward (over seeds), {r['impl']} - {trl['impl']}: {diff['reward_mean']:+.3f} over all "
                         f"steps, {diff['reward_last']:+.3f} over the last {a.last}")
    if "rlrun_async" in by:
        lines.append("(rlrun_async generates in a process of its own beside the trainer: two processes, not exact)")
    phases = [k for k in ("generate_s", "old_logprobs_s", "ref_logprobs_s", "train_s") if k in by.get("rlrun", {})]
    if phases:
        lines.append("rlrun phases (median ms per step): " + ", ".join(
            f"{k[:-2]} {by['rlrun'][k] * 1000:.0f}" for k in phases))
    return "\n".join(lines)


def figure(rows: list[dict], path: str, task: str = "default") -> str:
    fig, (ax,) = render.figure(7, [4])
    for r in rows:
        ax.plot(range(len(r["reward_curve"])), r["reward_curve"], label=f"{r['impl']} ({r['steps_per_s']:.2f} steps/s)")
    ax.set(xlabel="optimizer step", ylabel="mean reward (mean over seeds)",
           title=f"rlrun vs TRL GRPOTrainer: same work (task {task})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return render.save(fig, path, dpi=120)


def run_children(todo: list[tuple], jobs: int) -> dict:
    """{(round, impl): result} of each child in `todo` [(round, impl, log path, (target, *args))], `jobs` at a
    time (more than one: the runs overlap, so their speeds are not measured)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    def one(item):
        r, impl, log_path, call = item
        res = render.in_child(*call)
        if "error" in res:
            raise SystemExit(f"{render.tail(log_path)}\ntrl bench: the {impl} run of round {r} failed "
                             f"({res['error']}); the end of its output is above")
        return (r, impl), res

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return dict(tqdm(pool.map(one, todo), total=len(todo), desc="trl bench", unit="run"))


def bench(a, log_mlflow) -> list[dict]:
    """The benchmark; `log_mlflow` logs the result (rlrun.tools.bench's own, passed in so that this module does not
    import the one that imports it)."""
    impls = [i for i in a.impls.split(",") if i]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise SystemExit(f"trl bench: unknown --impls {','.join(unknown)}; choose from {','.join(IMPLS)}")
    if any(i in TRL for i in impls) and not available():
        print("(skipped TRL's runs: TRL is not installed; pip install -e '.[bench]')")
        impls = [i for i in impls if i not in TRL]
    todo = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            model_dir = os.path.join(tmp, f"model-seed{r}")
            model_dir, rows = prepare(model_dir, r, a.steps, a.task, a.model)
            for impl in impls[r % len(impls):] + impls[:r % len(impls)]:  # rotate who goes first
                log_path = os.path.join(tmp, f"{impl}-{r}.log")
                call = ((rlrun_child, a, model_dir, r, log_path, impl) if impl in RLRUN
                        else (trl_child, a, model_dir, rows, r, log_path, impl))
                todo.append((r, impl, log_path, call))
        results = run_children(todo, a.jobs)
    rounds = [{impl: results[r, impl] for impl in impls} for r in range(a.rounds)]
    size = sizes(work(a.task, 0, a.model), a.model)
    rows = summarize(rounds, a.warmup, a.last, size["prompts"] * size["group"])
    text = table(rows, a)
    print(text)
    if a.figure:
        print(f"figure: {figure(rows, a.figure, a.task if a.model == 'tiny' else a.model)}")
    log_mlflow(a, [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows], text, "trl",
               curves={f"reward_mean/{r['impl']}": r["reward_curve"] for r in rows},
               files=[a.figure] if a.figure else [])
    return rows


def add_parser(sub, log_mlflow) -> None:
    import argparse

    t = sub.add_parser("trl", help="rlrun's default GRPO run vs TRL's GRPOTrainer on the same work (needs .[bench])",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--steps", type=int, default=50, help="optimizer steps per run")
    t.add_argument("--rounds", type=int, default=3, help="interleaved rounds; round r uses seed r")
    t.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of its median")
    t.add_argument("--last", type=int, default=10, help="steps at the end whose mean reward is compared")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--jobs", type=int, default=1, help="runs at a time; > 1 for learning parity only (the runs "
                   "overlap, so their speeds are not measured)")
    t.add_argument("--impls", default="rlrun,trl", help="of " + ",".join(IMPLS) + ": rlrun_async is "
                   "rollout.pipeline=async K=1, trl_cb TRL generating with transformers' continuous batching")
    t.add_argument("--task", default="default", choices=list(TASKS),
                   help="varied_lengths: experiment=varied_lengths, rlrun with batching=shared_prompt")
    t.add_argument("--model", default="tiny", choices=list(MODELS),
                   help="smollm2: SmolLM2-135M-Instruct's experiment (experiment=smollm2) for both, instead of --task")
    t.add_argument("--rlrun-args", nargs="*", default=[], help="extra rlrun overrides, e.g. logprob_policy=always")
    t.add_argument("--figure", default="bench_trl.png", help="mean reward curves (PNG); '' for none")
    t.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="'none' to skip MLflow")
    # a partial, not a lambda: `a` (func included) is pickled into each child process
    t.set_defaults(func=functools.partial(bench, log_mlflow=log_mlflow))
