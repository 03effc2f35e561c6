"""Data parallel with packed / shared_prompt: whole prompt groups exchanged between ranks so that their token loads
are even (GRPO).

Each rank generates its own share of a rollout (whole prompt groups, `rank_slice`), and with batching=packed a
rank's work is the tokens of its share, which a long-tailed length distribution makes uneven: every rank waits for
the slowest at each optimizer step. After generation, `balance` moves generated groups between ranks so that the
positions each rank computes are about equal. It changes nothing but who computes what:

- sampling seeds are per global row and generation has already happened on the home rank, so the sequences are
  the ones a padded run draws;
- only whole groups move (advantages are normalised within a group, on the rank that holds it);
- only blocks at the same place of every rank's share are exchanged: a block is lcm(group_size, micro_batch) rows,
  whole groups and whole micro-batches, and micro-batch j of every rank is trained in the same optimizer step, so
  each optimizer step covers the very sequences it covered before, and the loss divides by the same global token
  count: the gradient is the same sum, in another order.

A block holding several groups (micro_batch a multiple of group_size) has its groups dealt out one by one; other
blocks move whole. The plan is the same on every rank (computed from every rank's loads); a rank sends only the
groups it gives away. One process, or batching=padded: nothing moves.
"""

from __future__ import annotations

import math

import torch

from ..rollout import Rollout


def unit_rows(group: int, micro: int) -> tuple[int, int]:
    """(rows per unit that can move, units per block): a block is lcm(group, micro) rows; its groups move one by
    one when it is one micro-batch of whole groups or one group of whole micro-batches, else the block moves."""
    block = math.lcm(group, micro)
    unit = group if block in (group, micro) else block
    return unit, block // unit


def loads(roll, unit: int, group: int, shared: bool) -> list[int]:
    """About the positions each unit of `unit` rows lays out: every sequence's prompt and response but its last
    token (packed), each group of `group` rows with its prompt once (shared_prompt)."""
    prompt = roll.attention_mask[:, : roll.prompt_len].sum(1)
    response = roll.response_mask.sum(1)
    tokens = torch.where(response > 0, prompt + response - 1, 0)
    out = []
    for start in range(0, len(response), unit):
        n = int(tokens[start : start + unit].sum())
        if shared:  # each group's prompt once
            p = prompt[start : start + unit]
            n -= int(p.sum()) - int(p[::group].sum())
        out.append(n)
    return out


def assign(by_rank: list[list[int]], per_block: int) -> list[list[tuple[int, int]]]:
    """For each rank, the (home rank, unit index) of the units it trains, in order. Block after block, the block's
    units of every rank, heaviest first, go to the rank with the least load so far that has room in this block
    (a tie keeps a unit at home): the greedy longest-processing-time rule, within each block."""
    world = len(by_rank)
    total = [0] * world
    out: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for start in range(0, len(by_rank[0]), per_block):
        pool = sorted(((by_rank[r][u], r, u) for r in range(world) for u in range(start, start + per_block)),
                      key=lambda x: (-x[0], x[1], x[2]))
        room = [per_block] * world
        for load, r, u in pool:
            dest = min((d for d in range(world) if room[d]), key=lambda d: (total[d], d != r, d))
            out[dest].append((r, u))
            room[dest] -= 1
            total[dest] += load
    return out


def take(rows: list[dict], roll, start: int, n: int, extra: dict | None = None) -> dict:
    """Rows [start, start + n) of a rollout (and of each of `extra`), on the CPU: what a rank sends for a unit it
    gives away."""
    p, end = roll.prompt_len, start + n
    return {"rows": rows[start:end], "extra": {k: v[start:end] for k, v in (extra or {}).items()},
            "completions": roll.completions[start:end],
            "finished": roll.finished[start:end].cpu(), "prompt_ids": roll.input_ids[start:end, :p].cpu(),
            "prompt_mask": roll.attention_mask[start:end, :p].cpu(),
            "response_ids": roll.input_ids[start:end, p:].cpu(), "response_mask": roll.response_mask[start:end].cpu(),
            "gen_logprobs": roll.gen_logprobs[start:end].cpu()}


def assemble(parts: list[dict], pad_id: int, device) -> tuple[list[dict], Rollout]:
    """(rows, rollout) of `parts` in order, prompts left-padded and responses right-padded to the longest."""
    P = max(x["prompt_ids"].shape[1] for x in parts)
    R = max(x["response_ids"].shape[1] for x in parts)

    def pad(t, width, left, value):
        extra = width - t.shape[1]
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    ids = torch.cat([torch.cat([pad(x["prompt_ids"], P, True, pad_id), pad(x["response_ids"], R, False, pad_id)], 1)
                     for x in parts])
    response_mask = torch.cat([pad(x["response_mask"], R, False, False) for x in parts])
    prompt_mask = torch.cat([pad(x["prompt_mask"], P, True, 0) for x in parts])
    roll = Rollout(input_ids=ids.to(device), prompt_len=P, response_mask=response_mask.to(device),
                   attention_mask=torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], 1).to(device),
                   gen_logprobs=torch.cat([pad(x["gen_logprobs"], R, False, 0.0) for x in parts]).to(device),
                   completions=[c for x in parts for c in x["completions"]],
                   finished=torch.cat([x["finished"] for x in parts]).to(device))
    return [r for x in parts for r in x["rows"]], roll


def balance(cfg, engine, batching, rows: list[dict], roll, pad_id: int, layout: dict | None = None,
            extra: dict | None = None):
    """(rows, rollout, extra) of this rank after the exchange (see the module's docstring); as they are on one
    process or under a `batching` layout that does not exchange (padded). `extra`: per-row values that travel with
    their rows (lists or tensors: the rewards). `layout["exchange"]["groups_moved"]`: adds the groups that changed
    rank."""
    extra = extra or {}
    if engine.world == 1 or not batching.exchanges:
        return rows, roll, extra
    t = cfg.train
    unit, per_block = unit_rows(t.group_size, t.micro_batch)
    plan = assign(engine.gather(loads(roll, unit, t.group_size, batching.shares_prompt)), per_block)
    if layout is not None:
        moved = layout.setdefault("exchange", {})
        moved["groups_moved"] = moved.get("groups_moved", 0) + sum(
            r != d for d, mine in enumerate(plan) for r, _ in mine) * unit // t.group_size
    leaving = {u: take(rows, roll, u * unit, unit, extra) for d, mine in enumerate(plan) if d != engine.rank
               for r, u in mine if r == engine.rank}
    sent = engine.gather(leaving)
    parts = [take(rows, roll, u * unit, unit, extra) if r == engine.rank else sent[r][u] for r, u in plan[engine.rank]]
    rows, roll = assemble(parts, pad_id, roll.input_ids.device)
    joined = {k: torch.cat([x["extra"][k] for x in parts]) if isinstance(v, torch.Tensor)
              else [e for x in parts for e in x["extra"][k]] for k, v in extra.items()}
    return rows, roll, joined
