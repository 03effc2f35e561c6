"""Generation with transformers' `generate`: sampled completions plus the sampler's own logprobs."""

from __future__ import annotations

import torch

from . import Rollout


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], cfg, device) -> Rollout:
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    sample = cfg.temperature > 0
    out = model.generate(
        **enc,
        do_sample=sample,
        temperature=cfg.temperature if sample else None,
        top_p=cfg.top_p if sample else None,
        top_k=0 if sample else None,  # transformers' default top_k=50 would silently truncate the distribution
        max_new_tokens=cfg.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        output_scores=True,
        return_dict_in_generate=True,
    )
    prompt_len = enc.input_ids.shape[1]
    response = out.sequences[:, prompt_len:]
    # `scores` are the processed logits the sampler drew from (temperature, top-p applied).
    steps = [torch.log_softmax(s.float(), -1).gather(-1, response[:, i, None]) for i, s in enumerate(out.scores)]
    gen_logprobs = torch.cat(steps, dim=1)
    return Rollout.from_response(enc.input_ids, enc.attention_mask, response, gen_logprobs, tokenizer)
