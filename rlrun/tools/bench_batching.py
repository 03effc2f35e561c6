"""`python -m rlrun.bench batching`: padded vs packed vs shared_prompt on a workload that looks like reasoning data.

The workload is built in code (nothing downloaded): `--prompts` prompts of `--group` completions each, prompt and
completion lengths drawn from a log-normal distribution (long-tailed: most short, a few long, capped), so that a
padded micro-batch is mostly padding and a group repeats its prompt `--group` times. Each option runs, in its own
process, the two passes batching changes on the same seeded rollout and weights: the old-policy logprob pass and
the training pass (forward and backward of every micro-batch of one optimizer step, the DAPO loss through the
`--head` head), `--repeat` times after a warm-up. It prints, per option: train-phase and logprob-phase response
tokens/s, the step time of the two passes, the positions computed and the share that is padding, the peak memory
growth of the train phase, and the max difference of loss and gradients from `padded`; and logs it to MLflow.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import torch

from .. import registry, render

OPTIONS = tuple(registry.REGISTRY["batching"])  # every batching option, the baseline first


def lengths(n: int, median: float, cap: int, g: torch.Generator) -> list[int]:
    """`n` long-tailed lengths: log-normal around `median` (sigma 1), at least 1, at most `cap`."""
    x = torch.exp(math.log(median) + torch.randn(n, generator=g))
    return x.round().clamp(1, cap).long().tolist()


def workload(a, vocab: int):
    """(rollout, advantages): `a.prompts` x `a.group` rows, left-padded prompts, right-padded responses."""
    from ..rollout import Rollout

    g = torch.Generator().manual_seed(a.seed)
    prompt_lens = lengths(a.prompts, a.prompt_median, a.prompt_cap, g)
    response_lens = lengths(a.prompts * a.group, a.response_median, a.response_cap, g)
    rows, P, R = len(response_lens), max(prompt_lens), max(response_lens)
    ids = torch.randint(4, vocab, (rows, P + R), generator=g)
    am = torch.zeros(rows, P + R, dtype=torch.long)
    for r in range(rows):
        p = prompt_lens[r // a.group]
        ids[r, :P] = ids[(r // a.group) * a.group, :P]  # a group shares its prompt
        am[r, P - p : P], am[r, P : P + response_lens[r]] = 1, 1
    ids = ids.masked_fill(am == 0, 0)
    response_mask = am[:, P:].bool()
    roll = Rollout(input_ids=ids, attention_mask=am, prompt_len=P, response_mask=response_mask,
                   gen_logprobs=torch.where(response_mask, -torch.rand(rows, R, generator=g) - 0.5, 0.0),
                   completions=[""] * rows, finished=torch.ones(rows, dtype=torch.bool))
    return roll, torch.randn(rows, generator=g)


def child(option: str, a, out_path: str) -> None:
    """One option in this fresh process: the old pass and the train pass, timed and metered; saves the numbers,
    the loss and the gradients."""
    from omegaconf import OmegaConf

    from .. import axes, models
    from ..meters import MIB, Meter
    from ..recipes import grpo

    torch.set_num_threads(a.threads or torch.get_num_threads())
    model_cfg = OmegaConf.create({"name": "tiny", "arch": "qwen2", "hidden_size": a.hidden, "layers": a.layers,
                                  "intermediate_size": 4 * a.hidden, "heads": a.hidden // 32,
                                  "kv_heads": a.hidden // 32, "max_positions": 4096, "vocab_size": a.vocab,
                                  "tie_embeddings": False, "dtype": "float32"})
    model, _ = models.build(model_cfg, a.seed)
    roll, adv = workload(a, a.vocab)
    micros = grpo.split_rollout(roll, adv, a.micro_batch)
    tis = SimpleNamespace(enabled=False, level="token", mode="truncate", cap=2.0, low=0.5)
    cfg = SimpleNamespace(loss=SimpleNamespace(name="dapo", clip_low=0.2, clip_high=0.28, kl_coef=0.0,
                                               kl_estimator="k3", tis=tis, entropy_coef=0.0, agg="token_mean",
                                               agg_max_tokens=None),
                          rollout=SimpleNamespace(temperature=1.0, max_new_tokens=a.response_cap),
                          batching=SimpleNamespace(name=option, max_tokens=a.max_tokens),
                          activations=SimpleNamespace(name="keep", every=1))
    meter = Meter(torch.device("cpu"))
    engine = SimpleNamespace(model=model, gather=lambda x: [x], backward=lambda t, boundary=None: t.backward(),
                             device=torch.device("cpu"),
                             world=1)
    s = SimpleNamespace(engine=engine, meter=meter, axes=axes.of(a.head, a.tile_size, 1.0, option, a.max_tokens,
                                                                  loss=cfg.loss, max_new_tokens=a.response_cap))
    times: dict[str, list[float]] = {"old": [], "train": []}
    for _ in range(a.repeat + 1):  # the first is a warm-up
        work = copy.deepcopy(micros)
        model.zero_grad(set_to_none=True)
        meter.new_step()
        with meter.phase("old_logprobs"), torch.no_grad():
            old = s.axes.layout.logprobs(model, work, s.axes.head)
        for mb, lp in zip(work, old):
            mb.old_logprobs = lp
        loss, _, _, layout = grpo.train_step(cfg, s, work, 0)
        times["old"].append(meter.seconds["old_logprobs"])
        times["train"].append(meter.seconds["train"])
    tokens = int(roll.response_mask.sum())
    torch.save({"old_s": min(times["old"][1:]), "train_s": min(times["train"][1:]), "tokens": tokens,
                "positions": layout["positions"], "real": layout["real"], "forwards": layout["forwards"],
                "train_growth_mib": meter.growth["train"] / MIB, "loss": loss,
                "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}, out_path)


def rows_of(results: dict[str, dict]) -> list[dict]:
    base = results.get("padded")
    rows = []
    for option, r in results.items():
        if "error" in r:
            rows.append({"impl": option, "error": r["error"]})
            continue
        row = {"impl": option, "train_tokens_per_s": r["tokens"] / r["train_s"],
               "logprob_tokens_per_s": r["tokens"] / r["old_s"], "step_s": r["train_s"] + r["old_s"],
               "positions": float(r["positions"]), "forwards": float(r["forwards"]),
               "padding_frac": max(0.0, 1 - r["real"] / r["positions"]), "train_growth_mib": r["train_growth_mib"]}
        if base and "error" not in base:
            row["loss_rel_diff"] = abs(r["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-12)
            row["grad_max_rel_diff"] = max(((g - base["grads"][n]).abs().max() / base["grads"][n].abs().max()).item()
                                           for n, g in r["grads"].items())
            row["train_speedup"] = row["train_tokens_per_s"] / (base["tokens"] / base["train_s"])
        rows.append(row)
    return rows


def table(rows: list[dict], a, workload_text: str) -> str:
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["impl"], f"failed: {r['error']}"])
            continue
        body.append([r["impl"], render.num(r["train_tokens_per_s"], ".0f"), render.num(r.get("train_speedup"), ".2f"),
                     render.num(r["logprob_tokens_per_s"], ".0f"), render.num(r["step_s"], ".3f"),
                     f"{r['positions']:.0f}", render.num(100 * r["padding_frac"], ".0f") + "%",
                     f"{r['forwards']:.0f}", render.num(r["train_growth_mib"], ".0f"),
                     render.num(r.get("loss_rel_diff"), ".1e"), render.num(r.get("grad_max_rel_diff"), ".1e")])
    head = ["batching", "train tok/s", "x padded", "logprob tok/s", "step s", "positions", "padding", "forwards",
            "train peak MiB", "loss diff", "grad diff"]
    return "\n".join([workload_text, render.table(head, body)])


def describe(a) -> str:
    roll, _ = workload(a, a.vocab)
    am, P = roll.attention_mask, roll.prompt_len
    real, padded = int(am.sum()), am.numel()
    prompt = int(am[:, :P].sum())
    return (f"workload: {a.prompts} prompts x {a.group} completions, prompt / response lengths log-normal (median "
            f"{a.prompt_median} / {a.response_median}, cap {a.prompt_cap} / {a.response_cap}); {real} real tokens "
            f"in {padded} padded positions (padding {1 - real / padded:.0%}); prompts are {prompt / real:.0%} of the "
            f"real tokens, {(prompt - prompt // a.group) / real:.0%} repeated; model hidden {a.hidden} x "
            f"{a.layers} layers, vocab {a.vocab}, head {a.head}, micro-batch {a.micro_batch}, max_tokens "
            f"{a.max_tokens}, {a.threads or torch.get_num_threads()} threads")


def rank_loads(a) -> str:
    """Data parallel on this workload: the ranks' token loads (largest / smallest) as each rank's slice of the
    rollout has them, and after rlrun.batching.exchange evens them out (the plan only: nothing is timed)."""
    from ..batching import exchange

    roll, _ = workload(a, a.vocab)
    unit, per_block = exchange.unit_rows(a.group, a.micro_batch)
    out = []
    for world in (2, 4, 8):
        rows = len(roll.completions) // world
        if rows % a.group or rows % a.micro_batch:
            continue
        for how in ("packed", "shared_prompt"):
            by_rank = [exchange.loads(SimpleNamespace(attention_mask=roll.attention_mask[r * rows : (r + 1) * rows],
                                                      response_mask=roll.response_mask[r * rows : (r + 1) * rows],
                                                      prompt_len=roll.prompt_len), unit, a.group, how != "packed")
                       for r in range(world)]
            before = [sum(x) for x in by_rank]
            after = [sum(by_rank[r][u] for r, u in mine) for mine in exchange.assign(by_rank, per_block)]
            out.append(f"{world} ranks {how} {max(before) / min(before):.2f} -> {max(after) / min(after):.2f}")
    return "ranks' token loads, largest / smallest, sliced -> balanced: " + ("; ".join(out) or "one rank only")


def bench(a, log_mlflow) -> list[dict]:
    from tqdm import tqdm

    results = {o: render.in_child(child, o, a) for o in tqdm(a.options, desc="batching", unit="option")}
    rows = rows_of(results)
    text = table(rows, a, describe(a)) + "\n" + rank_loads(a)
    print(text)
    log_mlflow(a, rows, text, "batching")
    return rows


def add_parser(sub, func) -> None:
    b = sub.add_parser("batching", help="padded vs packed vs shared_prompt on a long-tailed workload",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    b.add_argument("--options", type=lambda t: t.split(","), default=list(OPTIONS))
    b.add_argument("--prompts", type=int, default=8)
    b.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO's G)")
    b.add_argument("--prompt-median", type=float, default=64)
    b.add_argument("--prompt-cap", type=int, default=512)
    b.add_argument("--response-median", type=float, default=48)
    b.add_argument("--response-cap", type=int, default=512)
    b.add_argument("--micro-batch", type=int, default=8)
    b.add_argument("--max-tokens", type=int, default=1024)
    b.add_argument("--hidden", type=int, default=128)
    b.add_argument("--layers", type=int, default=2)
    b.add_argument("--vocab", type=int, default=4096)
    b.add_argument("--head", default="chunked", choices=list(registry.REGISTRY["head"]))
    b.add_argument("--tile-size", type=int, default=256)
    b.add_argument("--repeat", type=int, default=3, help="timed repeats after a warm-up (the fastest is reported)")
    b.add_argument("--threads", type=int, default=0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="'none' to skip MLflow")
    b.set_defaults(func=func)
