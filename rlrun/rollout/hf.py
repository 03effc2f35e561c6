"""Generation with transformers' `generate`: sampled completions plus the sampler's own logprobs.

Sampling is Gumbel-max with one seeded generator per sequence: token = argmax(logits/T (top-p filtered) + Gumbel
noise), which is an exact draw from the tempered, filtered distribution. Because each sequence's noise depends
only on its own seed, the completions do not depend on how the rollout is split into batches or ranks: a 2-rank
run samples exactly what a 1-rank run samples. Only the sampled token's logprob is kept per step (not the
`[batch, vocab]` scores of every step).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from . import Rollout


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """-inf outside the smallest set of tokens whose probability reaches top_p (the top token always stays)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


class SeededSampler(LogitsProcessor):
    """Turns greedy decoding into per-sequence seeded sampling and records the sampled tokens' logprobs."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature, self.top_p = temperature, top_p
        self.logprobs: list[torch.Tensor] = []  # [B] per generated token
        self.last: torch.Tensor | None = None  # this step's log-distribution, read once the token is known

    def collect(self, tokens: torch.Tensor) -> None:
        if self.last is not None:
            self.logprobs.append(self.last.gather(-1, tokens[:, None]).squeeze(-1))
            self.last = None

    def __call__(self, input_ids, scores):
        self.collect(input_ids[:, -1])  # the token chosen at the previous step
        logp = torch.log_softmax(top_p_filter(scores.float() / self.temperature, self.top_p), -1)
        self.last = logp
        u = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in self.generators]).to(scores.device)
        exponential = -torch.log(u.clamp_(min=1e-20))  # Exp(1); logp - log(Exp(1)) = logp + Gumbel(0, 1)
        return logp - torch.log(exponential.clamp_(min=1e-20))


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], cfg, device, seeds: list[int]) -> Rollout:
    """`seeds`: one sampling seed per prompt (see the module docstring)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    sampler = SeededSampler(seeds, cfg.temperature, cfg.top_p)
    out = model.generate(
        **enc,
        do_sample=False,  # the sampler draws; greedy picks its argmax
        logits_processor=LogitsProcessorList([sampler]),
        max_new_tokens=cfg.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        return_dict_in_generate=True,
    )
    prompt_len = enc.input_ids.shape[1]
    response = out.sequences[:, prompt_len:]
    sampler.collect(response[:, -1])
    gen_logprobs = torch.stack(sampler.logprobs, dim=1)
    return Rollout.from_response(enc.input_ids, enc.attention_mask, response, gen_logprobs, tokenizer)


class HFRollout:
    """rollout=hf: transformers' generate on the policy itself, so there are no weights to sync."""

    needs_sync = False

    def __init__(self, cfg, tokenizer, device):
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device

    def generate(self, model, prompts: list[str], seeds: list[int]) -> Rollout:
        return generate(model, self.tokenizer, prompts, self.cfg, self.device, seeds)

    def sync(self, model) -> None:
        pass


def build(cfg, model, tokenizer, device) -> HFRollout:
    return HFRollout(cfg, tokenizer, device)
