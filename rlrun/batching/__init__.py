"""batching=padded|packed|shared_prompt: how the training passes lay out the sequences they compute.

`padded` (the baseline) runs each micro-batch as it is: `micro_batch` rows padded to the longest prompt (left)
and response (right). `packed` and `shared_prompt` compute the same tokens without most of the padding: the
sequences of a pass (a rollout's micro-batches for a logprob pass, an optimizer step's for training) are laid end
to end in rows as long as the pass's longest sequence (first fit, longest first, so rows are nearly full), as many
rows per forward as fit `batching.max_tokens` positions (dynamic batch size); each sequence has its own positions
(0, 1, ...) and an attention mask that never crosses it. `shared_prompt` also lays out each run of sequences with
the same prompt (a GRPO group, a DPO pair) as the prompt once followed by each completion, every completion
attending to the prompt and to itself only, its positions continuing from the prompt's. Every response token is
predicted from the same context as in `padded`, so logprobs, losses and gradients are `padded`'s up to summation
order.

A `Pack` is one such forward. The heads see what they see under `padded`: the hidden states that predict the
response tokens, flattened, and per-token tensors gathered from the micro-batches (`gather`); results go back to
each micro-batch's own layout (`scatter`), so the rollout buffer, the logprob policies and checkpoints are the
same for every option. The mask is a dense [rows, 1, W, W] boolean (sdpa and eager attention take it): rows about
one sequence long keep its cost, and attention's, near what the sequences need (one row of max_tokens positions
would cost max_tokens^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import algorithms
from ..config import ConfigError
from .exchange import balance  # noqa: F401  (data parallel: even token loads; the recipes call it as batching.balance)


@dataclass
class Unit:
    """One sequence (packed) or one prompt with its completions (shared_prompt), laid out contiguously."""

    tokens: list[torch.Tensor]  # the prompt, then each completion's tokens but its last (only a target)
    parts: list[tuple[int, torch.Tensor]]  # per completion: (micro-batch index, its flat indices in targets)

    def __len__(self) -> int:
        return sum(len(t) for t in self.tokens)


@dataclass
class Pack:
    """One forward: [rows, W] ids and positions, and the mask; `select` the positions (of the flattened
    [rows * W]) whose hidden states predict the targets; `parts` where each run of targets comes from (micro-batch
    index, flat indices), one per sequence, in the order of `select`."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor  # [rows, 1, W, W] bool: True where a query may attend to a key
    select: torch.Tensor  # [n]
    parts: list[tuple[int, torch.Tensor]]


def rows(micro):
    """(prompt tokens, response tokens, flat indices of its targets) of each row of a padded micro-batch that has
    a response (the prompt without its left padding, the response up to its last valid token)."""
    p, r = micro.prompt_len, micro.input_ids.shape[1] - micro.prompt_len
    valid = micro.mask.view(-1, r)
    for b in range(micro.input_ids.shape[0]):
        n = int(valid[b].sum())
        if n:
            prompt = micro.input_ids[b, :p][micro.attention_mask[b, :p].bool()]
            yield prompt, micro.input_ids[b, p : p + n], b * r + torch.arange(n, device=micro.mask.device)


def micro_rows(micros):
    """(micro-batch index, prompt, response, flat indices) of every row of `micros` with a response, in order."""
    return ((index, *row) for index, micro in enumerate(micros) for row in rows(micro))


def units(sequences, shared: bool, max_tokens: int) -> list[Unit]:
    """Units of `sequences` ((index, prompt, response, flat indices), in order); with `shared`, consecutive ones
    with the same prompt in one unit (split where it would exceed `max_tokens`)."""
    out: list[Unit] = []
    for index, prompt, response, flat in sequences:
        last = out[-1] if out else None
        if (shared and last is not None and torch.equal(last.tokens[0], prompt)
                and len(last) + len(response) - 1 <= max_tokens):
            last.tokens.append(response[:-1])
            last.parts.append((index, flat))
            continue
        unit = Unit([prompt, response[:-1]], [(index, flat)])
        if len(unit) > max_tokens:
            raise ConfigError([f"batching.max_tokens={max_tokens} is smaller than one sequence of this run "
                               f"({len(prompt)} prompt + {len(response)} response tokens = {len(unit) + 1}); "
                               f"set batching.max_tokens>={len(unit) + 1} (or batching=padded)."])
        out.append(unit)
    return out


def layout(unit: Unit, offset: int):
    """(ids, positions, unit-relative part ids, select) of one unit placed at `offset` in its pack."""
    prompt, completions = unit.tokens[0], unit.tokens[1:]
    n_prompt, d = len(prompt), prompt.device
    ids, positions, part = [prompt], [torch.arange(n_prompt, device=d)], [torch.zeros(n_prompt, dtype=torch.long,
                                                                                       device=d)]
    select, start = [], offset + n_prompt
    for c, tokens in enumerate(completions, 1):
        ids.append(tokens)
        positions.append(n_prompt + torch.arange(len(tokens), device=d))
        part.append(torch.full((len(tokens),), c, device=d))
        # response token 0 is predicted from the prompt's last position, token j from the completion's (j-1)th
        select.append(torch.cat([torch.tensor([offset + n_prompt - 1], device=d),
                                 start + torch.arange(len(tokens), device=d)]))
        start += len(tokens)
    return torch.cat(ids), torch.cat(positions), torch.cat(part), torch.cat(select)


def pack(rows: list[list[Unit]], device) -> Pack:
    """One forward of `rows`, each row its units laid end to end, right-padded to the longest row; a padding
    position attends to itself only and predicts nothing."""
    width = max(sum(map(len, row)) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    positions, part, unit = torch.zeros_like(ids), torch.zeros_like(ids), torch.full_like(ids, -1)  # -1: padding
    select, parts, u = [], [], 0
    for b, row in enumerate(rows):
        offset = 0
        for x in row:
            i, p, c, sel = layout(x, offset)
            end = offset + len(i)
            ids[b, offset:end], positions[b, offset:end], part[b, offset:end], unit[b, offset:end] = i, p, c, u
            select.append(sel + b * width)  # into the forward's [rows * width] flattened positions
            parts += x.parts
            offset, u = end, u + 1
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    key, query = (unit[:, None, :], part[:, None, :]), (unit[:, :, None], part[:, :, None])
    # the same unit (not padding), and the key in its prompt (part 0) or in the query's own completion
    same = (query[0] == key[0]) & (key[0] >= 0) & ((key[1] == 0) | (query[1] == key[1]))
    mask = (causal & same) | torch.eye(width, dtype=torch.bool, device=device)
    return Pack(input_ids=ids, position_ids=positions, mask=mask[:, None], select=torch.cat(select), parts=parts)


def agree(engine):
    """n -> the largest n over ranks (every rank makes as many forwards: ZeRO's collectives run in each); None on
    one process."""
    return (lambda n: max(engine.gather(n))) if engine.world > 1 else None


def empty(device) -> Pack:
    """A forward of one padding token that predicts nothing: what a rank with fewer packs runs so that every rank
    makes the same number of forwards and backwards (ZeRO's collectives run in each)."""
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    return Pack(input_ids=one, position_ids=one, mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
                select=torch.zeros(0, dtype=torch.long, device=device), parts=[])


def rows_of(found: list[Unit]) -> list[list[Unit]]:
    """Units in rows as long as the longest one: first fit, longest first, so that rows are nearly full (the
    attention of a row costs its length squared, so rows stay about one sequence long)."""
    width = max(map(len, found), default=0)
    rows: list[list[Unit]] = []
    free: list[int] = []
    for x in sorted(found, key=len, reverse=True):
        b = next((i for i, f in enumerate(free) if f >= len(x)), len(rows))
        if b == len(rows):
            rows.append([])
            free.append(width)
        rows[b].append(x)
        free[b] -= len(x)
    return rows


def packs(micros, shared: bool, max_tokens: int, agree=None, sequences=None) -> list[Pack]:
    """The forwards that compute every response token of `micros` (or of `sequences`, as `units` takes them):
    units in rows as long as the longest unit (`rows_of`), as many rows per forward as fit `max_tokens`
    positions; `agree(n)`: the number every rank makes (the largest), padded with `empty`."""
    found = units(micro_rows(micros) if sequences is None else sequences, shared, max_tokens)
    rows = rows_of(found)
    per = max(1, max_tokens // max(map(len, found), default=1))  # rows per forward
    device = found[0].tokens[0].device if found else "cpu"
    out = [pack(rows[i : i + per], device) for i in range(0, len(rows), per)]
    return out + [empty(device) for _ in range((agree(len(out)) if agree else len(out)) - len(out))]


def hidden(backbone, p: Pack) -> torch.Tensor:
    """[n, H]: the hidden states that predict the pack's targets."""
    out = backbone(input_ids=p.input_ids, attention_mask=p.mask, position_ids=p.position_ids, use_cache=False)
    return out.last_hidden_state.flatten(0, 1)[p.select]


def gather(p: Pack, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The pack's targets' entries of per-micro-batch flat tensors (targets, advantages, logprobs...)."""
    return torch.cat([tensors[m][flat] for m, flat in p.parts]) if p.parts else tensors[0][:0]


def scatter(p: Pack, values: torch.Tensor, out: list[torch.Tensor]) -> None:
    """Write the pack's per-target `values` into each micro-batch's flat tensor in `out`."""
    start = 0
    for m, flat in p.parts:
        out[m][flat] = values[start : start + len(flat)]
        start += len(flat)


def by_passes(micros) -> list[list]:
    """The micro-batches in groups whose old / reference passes ran alike (a step can span two rollouts with
    different logprob-pass decisions; one forward's objective needs one kind), each group in order."""
    def kind(m):
        return m.old_logprobs is None, m.ref_logprobs is None

    return [[m for m in micros if kind(m) == k] for k in dict.fromkeys(map(kind, micros))]


def forwards(micros, shared: bool, max_tokens: int, fields: tuple[str, ...], counts: dict, agree=None):
    """(pack, {field: per-target tensor or None}, last) of each forward a non-padded pass makes over `micros`
    (`agree`: as in `packs`, over the whole pass); adds the positions computed and the forwards made to `counts`."""
    todo = [(p, same) for same in by_passes(micros) for p in packs(same, shared, max_tokens)]
    n = max(agree(len(todo)) if agree else len(todo), 1)  # one forward at least: a step of masked rows (overlong)
    todo += [(empty(micros[0].input_ids.device), micros)] * (n - len(todo))
    for i, (p, same) in enumerate(todo):
        count_pack(counts, p)
        yield p, {f: None if getattr(same[0], f) is None else gather(p, [getattr(m, f) for m in same])
                  for f in fields}, i == n - 1


def count(counts: dict | None, positions: int, sequences: int) -> None:
    """Add one forward of `positions` computed positions holding `sequences` sequences to a pass's `counts`."""
    if counts is not None:
        for key, n in (("positions", positions), ("forwards", 1), ("sequences", sequences)):
            counts[key] = counts.get(key, 0) + n


def count_pack(counts: dict | None, p: Pack) -> None:
    count(counts, p.input_ids.numel() if p.parts else 0, len(p.parts))  # an empty pack computes nothing real


def pass_metrics(name: str, by_rank: list[dict]) -> dict[str, float]:
    """One pass's layout over ranks: positions computed, forwards made, and sequences per forward (the rows of a
    micro-step: train.micro_batch when padded; as many as fit batching.max_tokens when packed)."""
    forwards = sum(r.get("forwards", 0) for r in by_rank)
    return {f"batching/{name}_positions": float(sum(r.get("positions", 0) for r in by_rank)),
            f"batching/{name}_forwards": float(forwards),
            f"batching/{name}_seqs_per_forward": sum(r.get("sequences", 0) for r in by_rank) / max(forwards, 1)}


def metrics(by_rank: list[dict], logprob: list[dict] | None = None) -> dict[str, float]:
    """A step's layout over ranks. `by_rank`: each rank's train-pass counts (and `real`, its tokens that are not
    padding); `logprob`: each rank's {pass name ("old", "ref"): counts} of the logprob passes the step ran, and
    "exchange": the groups `balance` moved between ranks. The train pass also gives the share of positions that
    are padding (packed: only the ends of rows; shared_prompt computes fewer positions than tokens) and, with
    data parallel, each rank's positions and their balance (largest / smallest)."""
    positions = [r["positions"] for r in by_rank]
    real = sum(r["real"] for r in by_rank)
    out = {**pass_metrics("train", by_rank),
           "batching/padding_frac": max(0.0, 1.0 - real / max(sum(positions), 1))}
    if len(by_rank) > 1:
        out["batching/rank_positions_ratio"] = max(positions) / max(min(positions), 1)
        out.update({f"batching/rank{r}/train_positions": float(n) for r, n in enumerate(positions)})
    passes = logprob or []
    for name in dict.fromkeys(k for r in passes for k in r):  # a pass this step skipped logs nothing
        if name == "exchange":  # data parallel: the same plan on every rank (exchange.balance)
            out["batching/groups_moved"] = float(passes[0][name]["groups_moved"])
        else:
            out.update(pass_metrics(name, [r.get(name, {}) for r in passes]))
    return out


def pair_rows(input_ids, attention_mask, predicts):
    """DPO's sequences (chosen rows, then rejected, right-padded, prompt first) as `units` takes them: each pair's
    chosen then its rejected, so that shared_prompt lays out their prompt once; flat indices into the batch's
    targets (the predicted positions, row-major)."""
    flat = torch.zeros(predicts.shape, dtype=torch.long, device=predicts.device)
    flat[predicts] = torch.arange(int(predicts.sum()), device=predicts.device)
    half = input_ids.shape[0] // 2
    for i in (r for k in range(half) for r in (k, half + k)):
        start = int(predicts[i].float().argmax()) + 1  # the first response position
        n = int(predicts[i].sum())
        yield 0, input_ids[i, :start], input_ids[i, start : start + n], flat[i, start - 1 : start - 1 + n]


def pair_hidden(backbone, batch, shared: bool, max_tokens: int, agree=None, counts: dict | None = None) -> torch.Tensor:
    """[N, H] hidden states that predict a DPO batch's targets, in their order, computed packed or with each pair's
    prompt once (`shared`); `counts`: as `count` takes it."""
    sequences = pair_rows(batch.input_ids, batch.attention_mask, batch.predicts)
    found = packs([], shared, max_tokens, agree, sequences)
    for p in found:
        count_pack(counts, p)
    h = [hidden(backbone, p) for p in found]
    order = torch.cat([flat for p in found for _, flat in p.parts])
    out = h[0].new_zeros(len(batch.targets), h[0].shape[-1])
    return out.index_copy(0, order, torch.cat(h))


def planned_forward(cfg, rows: int, seq_len: int, response: int, shared: bool) -> tuple[int, int, int]:
    """batching=packed|shared_prompt: (positions of a forward, positions of its rows, response tokens of a forward)
    for a pass over `rows` sequences of at most `seq_len` positions, `response` of them the response. A forward
    holds at most batching.max_tokens positions in rows as long as the longest unit: a sequence (packed) or a group
    with its prompt once (`shared`: train.group_size completions, a DPO pair's 2), so a pass lays out at most
    groups x prompt + rows x response positions; whole units, so a forward's share of response tokens is the
    pass's (the heads' tokens: with small micro-batches the bench plan over-predicted dense by 40% taking all
    max_tokens positions for responses)."""
    b, positions, width = cfg.batching, rows * seq_len, seq_len
    if shared:
        group = algorithms.of(cfg).prompt_rows(cfg)
        prompt = seq_len - response
        positions = -(-rows // group) * prompt + rows * response
        width = prompt + min(group, rows) * response
    forward = min(b.max_tokens, positions)
    return forward, min(b.max_tokens, width), -(-forward * rows * response // positions)
