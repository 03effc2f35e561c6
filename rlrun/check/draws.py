"""`data decisions`' checks of how the recipe draws a rollout (recipes/sampling.py), with no model: a generator and a
reward that answer from a table stand in for the run's, and what the recipe does with them is held to its
definition written here.

- `seeds`: the sampling seeds `sampling.prompts_of` gives the rows of two rollouts (and, with dynamic sampling, two
  rounds) are all distinct, and each row's is the same on one process as on two ranks. A group drawn with one seed
  has identical completions: every advantage 0, nothing learned, every numeric probe green (the check draws its
  probe rollout with seeds of its own).
- `rounds`: dynamic sampling's `sampling.draw` over crafted rounds, where one group has equal raw rewards but
  unequal shaped ones (the overlong penalty of unequal lengths) and one has equal both: the groups it keeps are the
  first `rollout_batch / group_size` whose *shaped* rewards differ, in round order, filled in order with the others
  when too few do (DAPO sec. 3.2 judges the reward the advantages are computed from).
- `sampler_draws` (on the `sampler filter` row): the sampler's draws from fixed distributions against the filtered
  distribution they should follow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from types import SimpleNamespace

import torch

from .. import registry
from ..recipes import sampling
from ..rollout import Rollout
from . import truth


def engine(rank: int = 0, world: int = 1):
    """What `sampling.prompts_of` and `draw` use of an engine, on one process standing for rank `rank` of `world`."""
    return SimpleNamespace(rank=rank, world=world, main=rank == 0, device="cpu", gather=lambda obj: [obj],
                           generation=contextlib.nullcontext, model=None)


def seeds(cfg) -> tuple[str, bool]:
    """The seeds check (module docstring): (what it measured, whether it holds)."""
    t = cfg.train
    rounds = (0, 1) if t.dynamic_sampling else (0,)

    def of(rollout: int, round_: int, rank: int = 0, world: int = 1) -> list[int]:
        stream = ({"prompt": f"prompt {i}"} for i in itertools.count())  # every rank reads the same stream
        return sampling.prompts_of(cfg, SimpleNamespace(engine=engine(rank, world)), stream, rollout, round_)[2]

    every = [s for rollout in (0, 1) for r in rounds for s in of(rollout, r)]
    distinct = len(set(every)) == len(every)
    groups = t.rollout_batch // t.group_size
    ranks = None if groups % 2 else [s for rank in (0, 1) for s in of(0, 0, rank, 2)] == of(0, 0)
    said = (f"seeds {len(set(every))} distinct of {len(every)} rows ({len(rounds)} round(s) of 2 rollouts)"
            + ("" if ranks is None else f", on 2 ranks {'the same' if ranks else 'OTHERS'}"))
    return said, distinct and ranks is not False


def kept_groups(shaped: list[list[list[float]]], need: int) -> list[tuple[int, int]]:
    """The truth of dynamic sampling's choice: (round, group) of the first `need` groups whose shaped rewards
    differ, in round order, then the earliest others until there are `need`; in round order."""
    order = [(k, g) for k, groups in enumerate(shaped) for g in range(len(groups))]
    signal = [key for key in order if len(set(shaped[key[0]][key[1]])) > 1]
    rest = [key for key in order if key not in signal]
    return sorted(signal[:need] + rest[: max(need - len(signal), 0)])


def rounds(cfg, tokenizer, meter) -> tuple[str, bool] | None:
    """The rounds check (module docstring), or None without dynamic sampling."""
    t, width = cfg.train, cfg.rollout.max_new_tokens
    if not t.dynamic_sampling:
        return None
    g, need = max(2, t.group_size), 3  # 3 groups a rollout: round 0 has one with signal by its shaped reward only
    run = dataclasses.replace(cfg, train=dataclasses.replace(
        t, group_size=g, rollout_batch=need * g, dynamic_sampling_max_rounds=max(2, min(t.dynamic_sampling_max_rounds,
                                                                                        3))))
    spread = [float(i % 2) for i in range(g)]
    # per round, per group: (raw rewards, response lengths: `width` runs to the limit, past the overlong buffer)
    table = [[([1.0] * g, [1] * g), ([1.0] * g, [width] + [1] * (g - 1)), (spread, [1] * g)],
             [(spread, [1] * g)] * need]  # round 1 on: signal everywhere
    group_of: dict[str, tuple[int, int]] = {}  # a row's prompt -> (round, group)
    rewards: list[float] = []

    def generate(model, texts, seeds):
        round_ = len({k for k, _ in group_of.values()})  # the round being drawn
        k = min(round_, 1)  # (round 1's table stands for every later round's)
        for i, text in enumerate(texts):
            group_of.setdefault(text, (round_, i // g))
        rewards[:] = [x for group in table[k] for x in group[0]]
        return fake_rollout(tokenizer, len(texts), [n for group in table[k] for n in group[1]], width)

    stream = ({"prompt": f"prompt {i}"} for i in itertools.count())
    s = SimpleNamespace(engine=engine(), meter=meter, tokenizer=tokenizer, rollout=SimpleNamespace(generate=generate),
                        data=SimpleNamespace(score=lambda completions, rows: (list(rewards), {})))
    out = sampling.draw(run, s, stream, 0, {})
    got = sorted({group_of[row["prompt"]] for row in out.rows})
    drawn = 1 + max(k for k, _ in group_of.values())
    penalty = t.overlong == "penalty"
    shaped = [[[x + (truth.overlong_penalty(n, width, t.overlong_buffer, t.overlong_penalty_factor) if penalty else 0.0)
                for x, n in zip(*group)] for group in table[min(k, 1)]] for k in range(drawn)]
    want = kept_groups(shaped, need)
    said = (f"dynamic sampling's {drawn} rounds keep groups {got} (truth {want}"
            + (", one of round 0's with signal by its overlong penalty only)" if penalty else ")"))
    return said, got == want


def fake_rollout(tokenizer, rows: int, lengths: list[int], width: int) -> Rollout:
    """A rollout of `rows` one-token prompts whose responses end with EOS after `lengths[i]` tokens (a length of
    `width` runs to the limit: cut, no EOS)."""
    eos, token = tokenizer.eos_token_id, (tokenizer.eos_token_id + 1) % max(2, len(tokenizer))
    response = torch.full((rows, width), token, dtype=torch.long)
    for i, n in enumerate(lengths):
        if n < width:
            response[i, n - 1] = eos
    prompt = torch.full((rows, 1), token, dtype=torch.long)
    return Rollout.from_response(prompt, torch.ones_like(prompt), response, torch.zeros(rows, width), tokenizer)


DRAWS = 20000  # draws of each test distribution: the TV's sampling noise is ~0.006 at these sizes
DRAWS_TOL = 0.02  # total variation; a sampler missing the Gumbel's log measured 0.06-0.10 on peaked distributions
TEST_LOGITS = ((4.0, 2.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0), (1.0, 0.9, 0.8, 0.7, 0.2, 0.1, 0.0, -3.0))


def sampler_draws(cfg) -> tuple[str, bool | None]:
    """The configuration's sampler (rollout=hf's seeded Gumbel-max, at its temperature, top-p and top-k) drawing
    DRAWS tokens from fixed distributions, one row and seed each, against the truth's filtered distribution
    (truth.filtered_log_softmax): their total variation at most DRAWS_TOL. Every other probe takes the drawn tokens
    as given (the logprob recorded is the drawn token's, whatever drew it): a biased draw passed them all. None for
    a sampler that is not rlrun's (vLLM's)."""
    r = cfg.rollout
    name = getattr(registry.get("rollout", r.name), "PROBE_SAMPLER", r.name)
    sampler_of = getattr(registry.get("rollout", name), "SeededSampler", None)
    if sampler_of is None:
        return "draws: the generator's own sampler, not probed", None
    worst = 0.0
    for logits in TEST_LOGITS:
        z = torch.tensor(logits, dtype=torch.float64)
        sampler = sampler_of([cfg.seed * DRAWS + i for i in range(DRAWS)], r.temperature, r.top_p, 1, r.top_k)
        scores = z.float().expand(DRAWS, -1).clone()
        tokens = sampler(torch.zeros(DRAWS, 1, dtype=torch.long), scores).argmax(-1)
        seen = torch.bincount(tokens, minlength=len(logits)).double() / DRAWS
        want = truth.filtered_log_softmax((z / r.temperature)[None], r.top_p, r.top_k)[0].exp()
        worst = max(worst, 0.5 * (seen - want).abs().sum().item())
    return f"draws' TV {worst:.3f} from the filtered distribution ({DRAWS} a distribution)", worst <= DRAWS_TOL
