"""Data parallel with packed / shared_prompt (rlrun/batching/exchange.py): whole prompt groups move between ranks so
that their token loads are even, and nothing else changes: every optimizer step covers the same sequences, each
sequence arrives intact. Ranks are threads here, with a gather that meets like torch.distributed's."""

import threading
from types import SimpleNamespace

import pytest
import torch
from helpers import LAYOUTS, tiny_model
from test_batching import rollout

from rlrun import axes, batching
from rlrun.batching import exchange
from rlrun.recipes import grpo


class Rank:
    """What `balance` uses of an engine, for one of `world` threads: every gather meets the other ranks'."""

    def __init__(self, rank, world, board, barrier):
        self.rank, self.world, self.board, self.barrier = rank, world, board, barrier

    def gather(self, obj):
        self.board[self.rank] = obj
        self.barrier.wait()
        out = list(self.board)
        self.barrier.wait()
        return out


def on_ranks(world, fn):
    """fn(rank engine) on `world` threads at once -> each rank's result."""
    board, barrier, out = [None] * world, threading.Barrier(world), [None] * world

    def run(r):
        out[r] = fn(Rank(r, world, board, barrier))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out


def cfg(how, group, micro):
    return SimpleNamespace(batching=SimpleNamespace(name=how, max_tokens=10_000),
                           train=SimpleNamespace(group_size=group, micro_batch=micro))


def balance(c, engine, rows, roll, **kw):
    """batching.balance under the layout of `c`'s batching option."""
    return batching.balance(c, engine, axes.of(batching=c.batching.name).layout, rows, roll, **kw)


def sequences(rows, roll):
    """Each row as what training reads of it: its row, prompt and response tokens, sampler logprobs, text, end."""
    p = roll.prompt_len
    valid = roll.response_mask
    return [(rows[i]["id"], roll.input_ids[i, :p][roll.attention_mask[i, :p].bool()].tolist(),
             roll.input_ids[i, p:][valid[i]].tolist(), roll.gen_logprobs[i][valid[i]].tolist(), roll.completions[i],
             bool(roll.finished[i])) for i in range(len(rows))]


def shares(prompts, lengths, world, group):
    """Each rank's (rows, rollout): a global rollout of `prompts` (group rows each) sliced as rank_slice does."""
    _, tok = tiny_model()
    per = len(lengths) // world
    out = []
    for r in range(world):
        mine = prompts[r * per // group : (r + 1) * per // group]
        roll = rollout(tok, mine, lengths[r * per : (r + 1) * per], seed=r)
        roll.completions = [f"row {r * per + i}" for i in range(per)]
        out.append(([{"id": r * per + i} for i in range(per)], roll))
    return out


def test_heavy_groups_are_dealt_to_the_lighter_rank_block_by_block():
    """2 ranks, groups of 2, micro-batches of 2: each group is a block. Rank 0 holds two long groups, rank 1 two
    short ones; the second block's long group goes to rank 1 and its short one to rank 0."""
    prompts = [[5, 6, 7], [8, 9, 10], [11], [12]]
    lengths = [9, 7, 8, 6, 1, 2, 3, 1]  # rank 0: groups of 3+9-1 + 3+7-1 = 20, 3+8-1 + 3+6-1 = 18; rank 1: 3, 4
    before = shares(prompts, lengths, 2, 2)
    c = cfg("packed", 2, 2)
    assert [exchange.loads(roll, 2, 2, False) for _, roll in before] == [[20, 18], [3, 4]]
    assert exchange.assign([[20, 18], [3, 4]], 1) == [[(0, 0), (1, 1)], [(1, 0), (0, 1)]]
    layouts = [{}, {}]
    totals = [[float(i) for i in range(4)], [float(10 + i) for i in range(4)]]  # rewards travel with their rows
    moved = on_ranks(2, lambda e: balance(c, e, *before[e.rank], pad_id=0, layout=layouts[e.rank],
                                                  extra={"totals": totals[e.rank],
                                                         "shaped": torch.tensor(totals[e.rank])}))
    after = [(rows, roll) for rows, roll, _ in moved]
    assert [x["totals"] for _, _, x in moved] == [[0.0, 1.0, 12.0, 13.0], [10.0, 11.0, 2.0, 3.0]]
    assert [x["shaped"].tolist() for _, _, x in moved] == [x["totals"] for _, _, x in moved]
    assert layouts == [{"exchange": {"groups_moved": 2}}] * 2  # one group each way, counted alike on every rank
    got = [sequences(*x) for x in after]
    was = [sequences(*x) for x in before]
    assert got == [was[0][:2] + was[1][2:], was[1][:2] + was[0][2:]]  # each sequence intact, in its block's place
    positions = [sum(len(u) for u in batching.units(batching.micro_rows(grpo.split_rollout(roll, torch.zeros(4), 2)),
                                                    False, 10_000)) for _, roll in after]
    assert positions == [20 + 4, 3 + 18]  # the ratio of the ranks' loads, 38 / 7 before, is 24 / 21 after


@pytest.mark.parametrize("how", LAYOUTS)
@pytest.mark.parametrize("micro", [2, 8])
def test_every_step_covers_the_same_sequences_and_groups_stay_whole(micro, how):
    """4 ranks, long-tailed lengths, groups of 4 and micro-batches of 2 (a group spans 2 micro-batches) or of 8
    (a micro-batch holds 2 groups): micro-batch j of every rank (trained in the same optimizer step) holds the
    sequences micro-batch j of some rank held before; groups stay whole and in order; loads even out."""
    g = torch.Generator().manual_seed(0)
    group, world, n_prompts = 4, 4, 32
    prompts = [list(range(5, 5 + int(x))) for x in torch.randint(1, 30, (n_prompts,), generator=g)]
    lengths = torch.exp(2.5 + torch.randn(n_prompts * group, generator=g)).round().clamp(1, 60).long().tolist()
    before = shares(prompts, lengths, world, group)
    after = on_ranks(world, lambda e: balance(cfg(how, group, micro), e, *before[e.rank], pad_id=0)[:2])
    old, new = [slots(x, micro) for x in before], [slots(x, micro) for x in after]
    for j in range(len(old[0])):  # the same sequences in micro-slot j, over all ranks
        assert set().union(*(o[j] for o in old)) == set().union(*(n[j] for n in new))
    for rows, _ in after:  # whole groups: ids g * group ... g * group + group - 1, consecutive
        ids = [r["id"] for r in rows]
        assert all(ids[i] % group == 0 and ids[i + group - 1] == ids[i] + group - 1 for i in range(0, len(ids), group))
    shared = how == "shared_prompt"
    load = [sum(exchange.loads(roll, group, group, shared)) for _, roll in after]
    old_load = [sum(exchange.loads(roll, group, group, shared)) for _, roll in before]
    assert sorted(r["id"] for rows, _ in after for r in rows) == list(range(len(lengths)))
    assert max(old_load) / min(old_load) > 1.3 and max(load) / min(load) < 1.15, (load, old_load)


def slots(share, micro):
    """The sequences of each micro-batch of a rank's share, as sets of strings."""
    seqs = sequences(*share)
    return [{str(s) for s in seqs[j : j + micro]} for j in range(0, len(seqs), micro)]


def test_one_process_and_padded_move_nothing():
    before = shares([[5, 6], [7]], [3, 1, 2, 2], 1, 2)[0]
    one = SimpleNamespace(world=1, rank=0)
    assert balance(cfg("packed", 2, 2), one, *before, pad_id=0) == (*before, {})
    two = on_ranks(2, lambda e: balance(cfg("padded", 2, 2), e, *shares([[5, 6], [7]], [3, 1, 2, 2], 2, 2)[
        e.rank], pad_id=0)[:2])
    assert [sequences(*x) for x in two] == [sequences(*x) for x in shares([[5, 6], [7]], [3, 1, 2, 2], 2, 2)]


def test_unit_rows():
    assert exchange.unit_rows(16, 64) == (16, 4)  # a micro-batch of 4 groups: groups dealt one by one
    assert exchange.unit_rows(16, 8) == (16, 1)  # a group over 2 micro-batches moves whole
    assert exchange.unit_rows(4, 6) == (12, 1)  # neither: the block of lcm rows moves whole
