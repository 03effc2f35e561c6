"""rlrun on a CUDA device (marker `gpu`: skipped, in one line, without one; conftest.skip_without_cuda).

They ran on an H100 and an H200 (2026-11-27, all 10 passing: docs/gpu.md); CI has no GPU. They check what CPU runs
cannot: CUDA's allocator as the meter reads it, optimizer state leaving the device and coming back, the
heads' equivalence in CUDA kernels, a run on the device, and `python -m rlrun.bench gpu` end to end at a small size.
"""

import subprocess
import sys

import pytest
import torch
from helpers import HEADS

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def test_meter_reads_the_allocators_growth_of_a_phase():
    from rlrun.meters import Meter

    meter = Meter(CUDA, phases=("train",))
    keep = torch.empty(2**20, dtype=torch.uint8, device=CUDA)  # allocated before the phase: not its growth
    with meter.phase("train"):
        x = torch.empty(8 * 2**20, dtype=torch.uint8, device=CUDA)
        del x
    assert meter.growth["train"] == 8 * 2**20
    assert meter.peak["train"] >= 9 * 2**20 and keep.numel() == 2**20


def test_offload_moves_adams_state_off_the_device_and_back_bit_for_bit():
    from rlrun import offload

    model = torch.nn.Linear(256, 512).to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.randn(4, 256, device=CUDA)).sum().backward()
    opt.step()
    before = {k: v.clone() for s in opt.state.values() for k, v in s.items() if v.device.type == "cuda"}
    params = sum(p.numel() for p in model.parameters())
    allocated = torch.cuda.memory_allocated()
    assert offload.to_host(opt, True, CUDA) == 2 * 4 * params  # exp_avg, exp_avg_sq (step stays on the host)
    assert allocated - torch.cuda.memory_allocated() >= 2 * 4 * params
    assert offload.to_device(opt, True, CUDA) == 2 * 4 * params
    after = {k: v for s in opt.state.values() for k, v in s.items() if v.device.type == "cuda"}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", HEADS)
def test_heads_on_cuda_agree_with_the_fp64_reference(impl, dtype):
    from rlrun.tools import bench, gpu_heads

    g = bench.parser().parse_args(["gpu", "--tokens", "1024", "--hidden", "256", "--vocab", "32768",
                                   "--tile-size", "256"])
    errs = gpu_heads.errors(impl, gpu_heads.bench_args(g, dtype))  # the gpu command's own device: cuda
    assert max(errs.values()) <= gpu_heads.TOLERANCE[dtype], errs


@pytest.mark.slow
def test_a_run_trains_on_the_device(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rlrun", "experiment=smoke", "engine.device=cuda", "tracking=none",
                        f"hydra.run.dir={tmp_path}/out"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_bench_gpu_heads_end_to_end_at_a_small_size(tmp_path):
    docs = tmp_path / "benchmarks-gpu.md"
    r = subprocess.run([sys.executable, "-m", "rlrun.bench", "gpu", "--only", "heads", "--tokens", "1024",
                        "--vocab", "16384", "--hidden", "256", "--tile-size", "256", "--impls", "dense,tiled,chunked",
                        "--docs", str(docs), "--tracking-uri", "none"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "6 of 6 checks ok" in r.stdout and "tiled fp32" in docs.read_text()


@pytest.mark.slow
def test_the_compiled_decode_replays_cuda_graphs_and_draws_eagers_tokens():
    """rollout.decode=compiled on CUDA (inductor with its CUDA graph trees): the tokens of the eager decode, the
    sampler's logprobs to fp32 tolerance, compiled once per bucket and not again for the same rollout."""
    from test_decoding import grouped, rollout_cfg
    from test_rollout import tiny

    from rlrun.rollout import decoding, hf

    model, tok = tiny("qwen2", True)
    model.to(CUDA)
    prompts, seeds = grouped()
    eager = hf.generate(model, tok, prompts, rollout_cfg("eager"), CUDA, seeds)
    before = decoding.COMPILES.count
    got = hf.generate(model, tok, prompts, rollout_cfg("compiled"), CUDA, seeds)
    assert decoding.COMPILES.count > before and not decoding.COMPILES.failed
    assert torch.equal(got.input_ids, eager.input_ids)
    torch.testing.assert_close(got.gen_logprobs, eager.gen_logprobs, rtol=0, atol=1e-4)
    before = decoding.COMPILES.count
    again = hf.generate(model, tok, prompts, rollout_cfg("compiled"), CUDA, seeds)
    assert decoding.COMPILES.count == before and torch.equal(again.input_ids, got.input_ids)
