"""The batching options as objects (the registry's `batching` entries): how a pass lays out its sequences.

Setup binds the run's layout once, to `batching.max_tokens` and to the agreement over ranks (`agree`: every rank
makes as many forwards). The recipes call its passes and never name it:

- `logprobs(backbone, micros, head, counts)`: per-token logprobs of each micro-batch's response (no grad);
- `forwards(backbone, micros, fields, counts)`: each forward of a training pass (hidden states, per-token tensors,
  mask, boundary);
- `pair_hidden(backbone, batch, counts)`: DPO's hidden states that predict a batch's targets.

`padded` runs each micro-batch as it is; `packed` and `shared_prompt` compute the same tokens in packs
(rlrun/batching/__init__.py), `shared_prompt` with each group's prompt once. What is true of each is said here:
`exactness`, `phases`, whether ranks exchange groups to even their loads (`exchanges`), whether a group's prompt
is laid out once (`shares_prompt`), and its memory term for the planner (`planned_forward`).
"""

from __future__ import annotations

import torch

from .. import models
from . import count, count_pack, forwards, gather, hidden, packs, pair_hidden, planned_forward, scatter

PHASES = ("old_logprobs", "ref_logprobs", "train")


def response_hidden(backbone, micro) -> torch.Tensor:
    """Hidden states that predict a padded micro-batch's response tokens, flattened to [N, H]."""
    h = models.hidden_states(backbone, micro.input_ids, micro.attention_mask)
    p = micro.prompt_len
    return h[:, p - 1 : -1].reshape(-1, h.shape[-1])


class Padded:
    """batching=padded (the baseline): each micro-batch as it is, rows padded to the longest."""

    exactness = "baseline"
    phases = PHASES
    exchanges = False  # ranks keep their slice: every row costs the same
    shares_prompt = False
    packs = False  # a forward is a micro-batch (train.micro_batch sizes it)

    def __init__(self, cfg=None, agree=None):
        self.max_tokens: int = getattr(cfg, "max_tokens", None) or 0  # positions per forward (0: padded has none)
        self.agree = agree  # n -> the largest n over ranks (batching.agree(engine); None on one process)

    def logprobs(self, model, micros, head, counts: dict | None = None) -> list[torch.Tensor]:
        """Per-token logprobs of each micro-batch's response under `model` through `head` (a heads.Bound), in
        its layout; `counts`: the pass's positions, forwards and sequences (batching.count)."""
        backbone, weight = models.split(model)
        for m in micros:
            count(counts, m.input_ids.numel(), m.input_ids.shape[0])
        return [head.logprobs(response_hidden(backbone, m), weight, m.targets) for m in micros]

    def forwards(self, backbone, micros, fields: tuple[str, ...], counts: dict):
        """(hidden states, {field: per-token tensor}, mask, boundary None: the engine counts micro-batches)."""
        for mb in micros:
            count(counts, mb.input_ids.numel(), mb.input_ids.shape[0])
            yield response_hidden(backbone, mb), {f: getattr(mb, f) for f in fields}, mb.mask, None

    def pair_hidden(self, backbone, batch, counts: dict | None = None) -> torch.Tensor:
        count(counts, batch.input_ids.numel(), batch.input_ids.shape[0])
        return models.hidden_states(backbone, batch.input_ids, batch.attention_mask)[:, :-1][batch.predicts]

    def planned_forward(self, cfg, rows: int, seq_len: int, response: int) -> tuple[int, int, int] | None:
        """(positions of a forward, positions of its rows, response tokens of a forward) for the planner; None: the
        micro-batch as it is."""
        return None


class Packed(Padded):
    """batching=packed: a pass's sequences end to end in rows of about one sequence, as many rows per forward as
    fit max_tokens, each sequence attending to itself only. padded's numbers up to summation order."""

    exactness = "fp_tolerance"
    exchanges = True  # with data parallel, groups move between ranks so that their token loads are even
    packs = True  # a forward holds batching.max_tokens positions

    def __init__(self, cfg=None, agree=None):
        super().__init__(cfg, agree)
        if not self.max_tokens:  # built without a batching config (a tool's or a test's): say what it lacks
            raise ValueError(f"{type(self).__name__} lays out forwards of batching.max_tokens positions: build it "
                             "from a batching config that sets max_tokens (conf/batching/)")

    def logprobs(self, model, micros, head, counts=None):
        """As padded's, computed in packs and put back in each micro-batch's layout (0 where masked)."""
        backbone, weight = models.split(model)
        # float64 where check's arbiter runs a float64 copy of the model (the heads compute in it there)
        dtype = torch.float64 if weight.dtype == torch.float64 else micros[0].gen_logprobs.dtype
        out = [torch.zeros_like(m.gen_logprobs, dtype=dtype) for m in micros]
        for p in packs(micros, self.shares_prompt, self.max_tokens, self.agree):
            count_pack(counts, p)
            targets = gather(p, [m.targets for m in micros])
            scatter(p, head.logprobs(hidden(backbone, p), weight, targets), out)
        return out

    def forwards(self, backbone, micros, fields, counts):
        """(hidden, tensors, all-valid mask, boundary True on the last forward) of each pack."""
        for p, t, last in forwards(micros, self.shares_prompt, self.max_tokens, fields, counts, self.agree):
            yield hidden(backbone, p), t, torch.ones_like(t["targets"], dtype=torch.bool), last

    def pair_hidden(self, backbone, batch, counts=None):
        return pair_hidden(backbone, batch, self.shares_prompt, self.max_tokens, self.agree, counts)

    def planned_forward(self, cfg, rows, seq_len, response):
        return planned_forward(cfg, rows, seq_len, response, self.shares_prompt)


class SharedPrompt(Packed):
    """batching=shared_prompt: packed, with each group's prompt (a GRPO group, a DPO pair) laid out once and each
    completion attending to it and to itself."""

    shares_prompt = True

