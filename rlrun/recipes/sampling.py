"""Which completions a GRPO rollout trains on: dynamic sampling (train.dynamic_sampling) and overlong completions
(train.overlong). The GRPO recipe calls `draw` for a rollout's completions (rollout.pipeline=async: `prompts_of`
for the generator's request and `scored` for what it returns) and `trained` for the rollout its loss sees;
everything else of a rollout (advantages, logprob passes, the window decision) is the recipe's, unchanged.

Dynamic sampling (DAPO, arXiv:2503.14476 section 3.2; verl `algorithm.filter_groups`, NeMo-RL
`use_dynamic_sampling`): a prompt group whose rewards are all equal has zero advantage everywhere, so it carries no
policy gradient. Such groups are dropped and another round of `rollout_batch / group_size` prompts is generated,
until the rollout holds `rollout_batch / group_size` groups with a signal or `train.dynamic_sampling_max_rounds`
rounds have run; then the rollout is completed with the earliest dropped groups (zero advantage) and a warning says
so. Groups surplus to the rollout are discarded (as DAPO does), never carried to the next rollout. Equality is
judged on the reward the advantages are computed from (the task's reward plus the overlong penalty).

Data parallel: every rank reads the same prompt stream and generates its slice of each round, as without dynamic
sampling; the choice is global: the groups are ordered by (round, rank, position), the first ones with a signal are
kept, and rank r trains on the r-th share of them (sent to it by the rank that generated them when that is another
one). So a run of W ranks trains on the rollout a run of one process trains on. Each row's sampling seed depends
on (run seed, rollout, row, round); round 0 draws what a run without dynamic sampling draws.

Overlong (DAPO section 3.4; NeMo-RL `overlong_filtering`, TRL `mask_truncated_completions`): `filter` masks the
completions cut at rollout.max_new_tokens (no EOS) out of the loss (they still count in their group's advantages);
`penalty` adds DAPO's soft overlong punishment to the reward, min(0, -(L - (L_max - B)) / B) x factor for a response
of L tokens (EOS included), L_max = rollout.max_new_tokens, B = train.overlong_buffer: 0 up to L_max - B, then
linearly down to -factor at L_max.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import batching as packing
from ..rollout import Rollout
from ..runner import rank_slice

log = logging.getLogger("rlrun")
PROGRESS_S = 10.0  # dynamic sampling: a line on its rounds this often while one rollout takes more than one


@dataclass
class Drawn:
    """This rank's share of a rollout: its examples (group_size rows per group), the rollout, the task's rewards
    and the reward the advantages use (`shaped`: the task's total plus the overlong penalty, or the total itself)."""

    rows: list[dict]
    roll: Rollout
    totals: list[float]
    by_reward: dict[str, list[float]]
    shaped: torch.Tensor


class Totals:
    """Groups generated and dropped over the run (dynamic sampling): checkpointed, so a resumed run logs the same
    cumulative share."""

    def __init__(self):
        self.generated = self.dropped = 0

    def state_dict(self) -> dict:
        return {"generated": self.generated, "dropped": self.dropped}

    def load_state_dict(self, state: dict) -> None:
        self.generated, self.dropped = state["generated"], state["dropped"]


def sample_seed(seed: int, rollout: int, row: int, round_: int = 0) -> int:
    """The sampling seed of one sequence: fixed by (run seed, rollout number, row in the global rollout, dynamic
    sampling round), so the same sequence is drawn whichever rank generates it; round 0 is the seed without
    dynamic sampling."""
    key = (rollout, row) if round_ == 0 else (rollout, row, round_)
    return int(np.random.SeedSequence(seed, spawn_key=key).generate_state(1)[0])


def overlong_penalty(roll: Rollout, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """[rows] DAPO's soft overlong punishment (module docstring), <= 0."""
    return overlong_of(roll.response_mask.sum(1).float().cpu(), max_new_tokens, buffer, factor)


def overlong_of(length: torch.Tensor, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """The punishment of responses of `length` tokens, EOS included (also TRL's reward in `bench trl`)."""
    return torch.clamp(-(length - (max_new_tokens - buffer)) / buffer * factor, max=0.0)


_warned: dict = {"run": None}  # the cfg.train of the run last warned about (held: `is` never matches a new one)


def _said(train) -> bool:
    """Whether this run (its cfg.train, one object for the whole run) was warned already; remembers it if not."""
    if _warned["run"] is train:
        return True
    _warned["run"] = train
    return False


def trained(roll: Rollout, train, stats: dict | None = None) -> Rollout:
    """The rollout the loss sees: with train.overlong=filter, the completions cut at max_new_tokens have no valid
    token (their rows still run in padded micro-batches; packed ones skip them). Counts the rows and those filtered
    in `stats` (the step's: `metrics` logs the filtered share), and warns once per run (`train` is the run's
    cfg.train) when a rollout had every completion filtered: it trains nothing."""
    if train.overlong != "filter":
        return roll
    rows, cut = len(roll.completions), int((~roll.finished).sum())
    if stats is not None:
        stats["overlong_rows"] = stats.get("overlong_rows", 0) + rows
        stats["overlong_filtered"] = stats.get("overlong_filtered", 0) + cut
    if rows and cut == rows and not _said(train):
        log.warning("train.overlong=filter filtered every completion of a rollout (all %d were cut at "
                    "rollout.max_new_tokens): it trains nothing, its gradient is 0. Raise rollout.max_new_tokens, or "
                    "use train.overlong=penalty (or keep); the share filtered is logged as overlong/filtered_frac. "
                    "(Said once per run.)", rows)
    return dataclasses.replace(roll, response_mask=roll.response_mask & roll.finished[:, None])


def prompts_of(cfg, s, prompts, rollout: int, round_: int = 0):
    """This rank's rows of one round of rollout `rollout` (its slice of `rollout_batch / group_size` prompt groups,
    each prompt group_size times), their prompt texts and sampling seeds."""
    t, engine = cfg.train, s.engine
    groups = rank_slice([next(prompts) for _ in range(t.rollout_batch // t.group_size)], engine)  # whole groups
    rows = [ex for ex in groups for _ in range(t.group_size)]
    first_row = engine.rank * len(rows)
    seeds = [sample_seed(cfg.seed, rollout, first_row + i, round_) for i in range(len(rows))]
    return rows, [ex["prompt"] for ex in rows], seeds


def scored(cfg, s, rows: list[dict], roll: Rollout) -> Drawn:
    """A generated round scored by the task's rewards, with the overlong penalty where asked."""
    totals, by_reward = s.data.score(roll.completions, rows)
    return shape(cfg, rows, roll, totals, by_reward)


def shape(cfg, rows: list[dict], roll: Rollout, totals: list[float], by_reward: dict) -> Drawn:
    """A scored round (`totals`, `by_reward`: the task's rewards) with the overlong penalty where asked: a rollout
    replayed from a record is shaped here too, since train.overlong is a training-side choice."""
    t = cfg.train
    shaped = torch.tensor(totals, dtype=torch.float32)
    if t.overlong == "penalty":
        penalty = overlong_penalty(roll, cfg.rollout.max_new_tokens, t.overlong_buffer, t.overlong_penalty_factor)
        shaped, by_reward = shaped + penalty, {**by_reward, "overlong_penalty": penalty.tolist()}
    return Drawn(rows, roll, totals, by_reward, shaped)


def generate(cfg, s, prompts, rollout: int, round_: int) -> Drawn:
    """One round: this rank's slice of `rollout_batch / group_size` prompt groups, generated and scored."""
    rows, texts, seeds = prompts_of(cfg, s, prompts, rollout, round_)
    with s.meter.phase("generate"), s.engine.generation():
        roll = s.rollout.generate(s.engine.model, texts, seeds)
    return scored(cfg, s, rows, roll)


def balanced(cfg, s, d: Drawn, layout: dict) -> Drawn:
    """This rank's share after the ranks even out their token loads (batching packed / shared_prompt on several
    ranks: rlrun/batching/exchange.py); the rewards travel with their rows."""
    extra = {"totals": d.totals, "shaped": d.shaped, **{f"reward/{k}": v for k, v in d.by_reward.items()}}
    rows, roll, extra = packing.balance(cfg, s.engine, s.axes.layout, d.rows, d.roll, s.tokenizer.pad_token_id,
                                        layout, extra)
    return Drawn(rows, roll, extra["totals"], {k[7:]: v for k, v in extra.items() if k.startswith("reward/")},
                 extra["shaped"])


def informative(shaped: torch.Tensor, group_size: int) -> list[bool]:
    """Per group: whether its rewards differ (a group of equal rewards has zero advantage everywhere)."""
    grouped = shaped.view(-1, group_size)
    return (grouped.amax(1) != grouped.amin(1)).tolist()


def draw(cfg, s, prompts, rollout: int, stats: dict, totals: Totals | None = None) -> Drawn:
    """This rank's share of the next rollout: one round, or with dynamic sampling as many as needed (module
    docstring). Adds what dynamic sampling did to `stats` (summed over the step's rollouts) and `totals`."""
    t, engine = cfg.train, s.engine
    first = generate(cfg, s, prompts, rollout, 0)
    if not t.dynamic_sampling:
        return first
    need, rounds, flags, start = t.rollout_batch // t.group_size, [first], [], time.perf_counter()
    said = start
    while True:
        flags.append(engine.gather(informative(rounds[-1].shaped, t.group_size)))  # every rank's, rank order
        found = sum(sum(f) for r in flags for f in r)
        if found >= need or len(rounds) == t.dynamic_sampling_max_rounds:
            break
        if engine.main and time.perf_counter() - said >= PROGRESS_S:  # a step that takes long says why
            said = time.perf_counter()
            log.info("dynamic sampling, rollout %d: round %d of at most %d (train.dynamic_sampling_max_rounds), %d "
                     "of %d prompt groups with a reward signal so far, %.0f s", rollout, len(rounds) + 1,
                     t.dynamic_sampling_max_rounds, found, need, said - start)
        rounds.append(generate(cfg, s, prompts, rollout, len(rounds)))
    order = [(k, r, i) for k, per_rank in enumerate(flags) for r, f in enumerate(per_rank) for i in range(len(f))]
    signal = [key for key in order if flags[key[0]][key[1]][key[2]]]
    filled = max(need - len(signal), 0)
    chosen = sorted(signal[:need] + [key for key in order if not flags[key[0]][key[1]][key[2]]][:filled])
    extra = time.perf_counter() - start if len(rounds) > 1 else 0.0
    dropped = len(order) - len(signal)
    for key, value in (("groups", len(order)), ("dropped", dropped), ("filled", filled), ("rounds", len(rounds)),
                       ("extra_s", extra)):
        stats[key] = stats.get(key, 0) + value
    if totals is not None:
        totals.generated, totals.dropped = totals.generated + len(order), totals.dropped + dropped
    if filled and engine.main:
        log.warning("dynamic sampling: %d of %d prompt groups had equal rewards after "
                    "train.dynamic_sampling_max_rounds=%d rounds; the rollout is completed with %d of them (zero "
                    "advantage, no policy gradient). Raise train.dynamic_sampling_max_rounds, or check the reward "
                    "(are the prompts all solved, or all failed?).", dropped, len(order), len(rounds), filled)
    out = share(rounds, chosen, engine, t.group_size, s.tokenizer.pad_token_id)
    stats["sequences"] = stats.get("sequences", 0) + len(out.rows)  # this rank's: summed over ranks in `metrics`
    return out


def share(rounds: list[Drawn], chosen: list[tuple], engine, group_size: int, pad_id: int) -> Drawn:
    """This rank's share of the `chosen` groups ((round, rank, position), in order), fetched from the ranks that
    generated them when they are not all its own."""
    per_rank = len(chosen) // engine.world
    mine = chosen[engine.rank * per_rank : (engine.rank + 1) * per_rank]
    own = all(r == rank for rank in range(engine.world) for _, r, _ in chosen[rank * per_rank : (rank + 1) * per_rank])
    if own:  # every rank trains on groups it generated (the same answer on every rank: no collective or all)
        return concat([group(rounds[k], i, group_size) for k, _, i in mine], pad_id)
    held = {key: group(rounds[key[0]], key[2], group_size, cpu=True) for key in chosen if key[1] == engine.rank}
    every = {k: v for part in engine.gather(held) for k, v in part.items()}
    out = concat([every[key] for key in mine], pad_id)
    return dataclasses.replace(out, roll=to(out.roll, engine.device))


def group(d: Drawn, i: int, group_size: int, cpu: bool = False) -> Drawn:
    """Group `i` of a round (its `group_size` rows), on the CPU when it is to be sent to another rank."""
    sl = slice(i * group_size, (i + 1) * group_size)
    roll = dataclasses.replace(d.roll, input_ids=d.roll.input_ids[sl], attention_mask=d.roll.attention_mask[sl],
                               response_mask=d.roll.response_mask[sl], gen_logprobs=d.roll.gen_logprobs[sl],
                               completions=d.roll.completions[sl], finished=d.roll.finished[sl])
    return Drawn(d.rows[sl], to(roll, "cpu") if cpu else roll, d.totals[sl],
                 {k: v[sl] for k, v in d.by_reward.items()}, d.shaped[sl])


def to(roll: Rollout, device) -> Rollout:
    return dataclasses.replace(roll, **{f.name: getattr(roll, f.name).to(device) for f in dataclasses.fields(roll)
                                        if isinstance(getattr(roll, f.name), torch.Tensor)})


def concat(parts: list[Drawn], pad_id: int) -> Drawn:
    """Groups of possibly different rounds as one rollout: prompts left-padded to the longest, responses
    right-padded to the widest (what one generate call of those rows would hold, up to padding)."""
    p, w = max(d.roll.prompt_len for d in parts), max(d.roll.response_mask.shape[1] for d in parts)

    def cat(name: str, value, split: bool = True):
        out = []
        for d in parts:
            x, n = getattr(d.roll, name), d.roll.prompt_len
            pad = torch.nn.functional.pad
            if not split:  # response-only columns (response_mask, gen_logprobs): no prompt to pad
                out.append(pad(x, (0, w - x.shape[1]), value=value))
                continue
            prompt, response = x[:, :n], x[:, n:]
            out.append(torch.cat([pad(prompt, (p - n, 0), value=value), pad(response, (0, w - response.shape[1]),
                                                                               value=value)], 1))
        return torch.cat(out)

    roll = Rollout(input_ids=cat("input_ids", pad_id), attention_mask=cat("attention_mask", 0), prompt_len=p,
                   response_mask=cat("response_mask", False, split=False),
                   gen_logprobs=cat("gen_logprobs", 0.0, split=False),
                   completions=[c for d in parts for c in d.roll.completions],
                   finished=torch.cat([d.roll.finished for d in parts]))
    return Drawn([r for d in parts for r in d.rows], roll, [x for d in parts for x in d.totals],
                 {k: [x for d in parts for x in d.by_reward[k]] for k in parts[0].by_reward},
                 torch.cat([d.shaped for d in parts]))


def metrics(by_rank: list[dict], totals: Totals | None) -> dict[str, float]:
    """overlong/filtered_frac (train.overlong=filter: the share of the step's completions filtered out of the loss,
    over ranks) and dynamic_sampling/*: the share of generated groups dropped (this step and over the run), rounds,
    groups completing a rollout at the bound, the sequences of the step's rollouts (over ranks), and the extra
    generation time (the slowest rank's)."""
    out = {}
    rows = sum(p.get("overlong_rows", 0) for p in by_rank)
    if rows:
        out["overlong/filtered_frac"] = sum(p.get("overlong_filtered", 0) for p in by_rank) / rows
    if totals is None or "groups" not in by_rank[0]:
        return out
    s = by_rank[0]  # the counts are global: every rank has the same
    return {**out, "dynamic_sampling/dropped_frac": s["dropped"] / max(s["groups"], 1),
            "dynamic_sampling/dropped_frac_total": totals.dropped / max(totals.generated, 1),
            "dynamic_sampling/rounds": float(s["rounds"]), "dynamic_sampling/filled_groups": float(s["filled"]),
            "dynamic_sampling/sequences": float(sum(p["sequences"] for p in by_rank)),
            "time/dynamic_sampling_extra_s": max(p["extra_s"] for p in by_rank)}
