"""Rollout engines. Each module has `build(cfg, model, tokenizer, device)` returning an object with
`generate(model, prompts, seeds) -> Rollout` (one sampling seed per prompt) and `sync(model)`, which copies the
current weights into the engine (`needs_sync` False: the engine samples from `model` itself, nothing to copy), and
`reserved(cfg, device_gib)`, what it takes of a CUDA device besides the policy (the planner). The contract:
rollout/protocol.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rollout:
    input_ids: torch.Tensor  # [B, P + R] left-padded prompt then response
    attention_mask: torch.Tensor  # [B, P + R]
    prompt_len: int  # P
    response_mask: torch.Tensor  # [B, R] response tokens up to and including EOS
    gen_logprobs: torch.Tensor  # [B, R] logprobs of the sampled tokens under the sampler
    completions: list[str]
    finished: torch.Tensor  # [B] bool: stopped at EOS (else hit max_new_tokens)

    @staticmethod
    def from_response(prompt_ids, prompt_mask, response, gen_logprobs, tokenizer) -> Rollout:
        is_eos = response == tokenizer.eos_token_id
        # valid = every token up to and including the first EOS
        after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0
        response_mask = ~after_eos
        pad = torch.full_like(response, tokenizer.pad_token_id)
        response = torch.where(response_mask, response, pad)
        completions = tokenizer.batch_decode(torch.where(is_eos, pad, response), skip_special_tokens=True)
        return Rollout(
            input_ids=torch.cat([prompt_ids, response], 1),
            attention_mask=torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], 1),
            prompt_len=prompt_ids.shape[1],
            response_mask=response_mask,
            gen_logprobs=torch.where(response_mask, gen_logprobs, 0.0),
            completions=completions,
            finished=is_eos.any(1),
        )

