"""The memory plan (rlrun/plan.py): its head arithmetic equals the bytes the heads allocate, head.size=auto picks
the largest tile within the budget, `rlrun plan` prints it without building anything, every run logs it, and
(slow) its predictions for whole runs are within the README's target of what the runs measure."""

import subprocess
from pathlib import Path

import pytest
import torch
from conftest import make_cfg, new_store
from helpers import history, runs

from rlrun import plan, registry
from rlrun.config import ConfigError, validate
from rlrun.losses import objective
from rlrun.meters import MIB, Meter

ROOT = Path(__file__).resolve().parent.parent


def shapes(vocab=65536, hidden=32, head_trainable=True):
    return plan.Shapes(vocab=vocab, hidden=hidden, intermediate=4 * hidden, layers=1, kv_dim=hidden,
                       params=vocab * hidden, trainable=vocab * hidden, head_trainable=head_trainable, param_bytes=4)


@pytest.mark.parametrize("name", ["dense", "tiled", "chunked"])
@pytest.mark.parametrize("grad", [False, True], ids=["logprobs", "loss+backward"])
def test_head_arithmetic_is_what_the_heads_allocate(name, grad):
    """Measured growth of one head call (CPU RSS; 32 MiB tiles, so the allocator adds nothing) vs head_parts, plus
    the lm-head gradient the planner counts with the other gradients. A head that kept one more tile or logits
    copy alive would be 32 or 128 MiB over."""
    n, vocab, hidden, size = 512, 65536, 32, 128
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g, requires_grad=grad)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=grad)
    targets = torch.randint(0, vocab, (n,), generator=g)
    meter = Meter(torch.device("cpu"), phases=("call",))
    for _ in range(2):  # the first call also sets up thread pools and kernels
        meter.new_step()
        with meter.phase("call"):
            if grad:
                f = objective("dapo", torch.randn(n), torch.randn(n) - 5, None, None, clip_low=0.2, clip_high=0.28)
                head = registry.get("head", name)
                loss, _ = head.loss(h, w, targets, torch.ones(n, dtype=torch.bool), f, n, 1.0, size)
                loss.backward()
            else:
                with torch.no_grad():
                    registry.get("head", name).logprobs(h, w, targets, 1.0, size)
        h.grad = w.grad = None
    predicted = sum(plan.head_parts(name, size, n, shapes(vocab, hidden), grad=grad).values())
    predicted += vocab * hidden * 4 if grad else 0  # w.grad
    assert meter.growth["call"] == pytest.approx(predicted, rel=0.05, abs=3 * MIB)


def test_auto_size_is_the_largest_tile_within_the_budget():
    s = shapes(vocab=151936, hidden=512)
    for budget_mib in (400, 600, 1000):
        budget = budget_mib * MIB
        size = plan.auto_size(budget, 4096, s, "tiled", accumulate=True)
        assert size % 16 == 0
        used = sum(plan.head_parts("tiled", size, 4096, s, grad=True, accumulate=True).values())
        more = sum(plan.head_parts("tiled", size + 16, 4096, s, grad=True, accumulate=True).values())
        assert used <= budget < more, (budget_mib, size)
    assert plan.auto_size(100 * 2**30, 4096, s, "chunked", accumulate=False) == 4096  # never beyond the micro-batch
    with pytest.raises(ConfigError, match=r"raise head.memory_budget_mib \(16 tokens need \d+\) or set head.size=N"):
        plan.auto_size(300 * MIB, 4096, s, "tiled", accumulate=True)  # the fp32 lm-head gradient alone is 297 MiB


def planned(*overrides, **kw):
    cfg = validate(make_cfg(*overrides))
    return cfg, plan.predict(cfg, *plan.inputs(cfg), **kw)


def test_plan_of_a_config_names_what_dominates():
    cfg, p = planned("head=chunked", "model.vocab_size=65536", "rollout.max_new_tokens=8", "logprob_policy=always",
                     "loss.kl_coef=0.01", "model.lora.enabled=true")
    assert list(p.phases) == ["generate", "old_logprobs", "ref_logprobs", "train"]
    assert p.tokens == 64 * 8
    assert p.phases["old_logprobs"].dominant().startswith("one chunked tile (128 tokens x vocab 65536")
    assert "reference copy" not in p.phases["train"].resident  # adapters_off: no second model
    assert "next lm-head gradient" not in p.phases["train"].parts  # LoRA: the lm head is frozen
    _, window = planned()  # the default: window policy, kl 0: no extra pass
    assert list(window.phases) == ["generate", "train"]
    assert "next lm-head gradient" in window.phases["train"].parts  # two micro-batches per step, head trainable
    _, dpo = planned("loss=dpo", "head=chunked")
    assert list(dpo.phases) == ["ref_logprobs", "train"] and "reference copy" in dpo.phases["train"].resident


def test_packed_forwards_are_planned_by_their_token_budget():
    """batching=packed: a forward's activations and head tokens are bounded by batching.max_tokens (not rows x
    positions), plus its mask (rows x width^2 booleans: max_tokens x the row width at most)."""
    _, padded = planned("logprob_policy=always")
    _, small = planned("logprob_policy=always", "batching=packed", "batching.max_tokens=64")
    _, large = planned("logprob_policy=always", "batching=packed", "batching.max_tokens=100000")
    saved = "activations saved for backward"
    assert small.phases["train"].parts[saved] < padded.phases["train"].parts[saved]
    assert large.phases["train"].parts[saved] >= padded.phases["train"].parts[saved]  # a whole step in one forward
    assert small.phases["train"].parts["attention mask (64 positions in rows of 8, bool)"] == 64 * 8  # 4 + 4 new
    assert "attention mask" not in " ".join(padded.phases["train"].parts)


def test_shared_prompt_is_planned_with_each_groups_prompt_once():
    """A step's 128 sequences (8 groups of 16) of at most 4 prompt + 4 response positions: packed lays out
    128 x 8 positions, shared_prompt 8 x 4 + 128 x 4, in rows of one group (4 + 16 x 4); under a small budget
    both are bounded by it."""
    per_token = plan.SAVED_H * 32 + plan.SAVED_I * 128  # the tiny model's saved activations per position and layer
    saved = "activations saved for backward"
    for budget, packed_n, shared_n in ((100_000, 128 * 8, 8 * 4 + 128 * 4), (64, 64, 64)):
        _, packed = planned("batching=packed", f"batching.max_tokens={budget}")
        cfg, shared = planned("batching=shared_prompt", f"batching.max_tokens={budget}")
        assert cfg.train.group_size == 16 and shared.seq_len == 8
        assert packed.phases["train"].parts[saved] == 3 * packed_n * per_token * 4
        assert shared.phases["train"].parts[saved] == 3 * shared_n * per_token * 4
    width = 4 + 16 * 4
    assert shared.phases["train"].parts["attention mask (64 positions in rows of 64, bool)"] == 64 * 64
    _, large = planned("batching=shared_prompt", "batching.max_tokens=100000")
    assert large.phases["train"].parts[f"attention mask (544 positions in rows of {width}, bool)"] == 544 * width


def test_device_plan_counts_offload_zero_and_the_fits_line(monkeypatch):
    over = ("model.vocab_size=65536", "logprob_policy=always", "offload=on")
    cfg, cpu = planned(*over)
    _, cuda = planned(*over, device_type="cuda")
    adam = "optimizer state (AdamW: 2 x trainable)"
    assert adam in cpu.phases["old_logprobs"].resident and adam not in cuda.phases["old_logprobs"].resident
    assert adam in cuda.phases["train"].resident  # back on the device to train
    monkeypatch.setenv("WORLD_SIZE", "4")  # validation checks batch sizes against the ranks
    _, zero3 = planned("engine=deepspeed", "engine.zero_stage=3", "train.micro_batch=16", *over, world=4,
                       device_type="cuda")
    assert zero3.phases["train"].resident["weights"] == cpu.phases["train"].resident["weights"] // 4
    assert zero3.phases["generate"].parts["weights gathered for generate (ZeRO-3)"] > 0
    text = plan.table(cpu, cuda, device_gib=0.01)
    assert "planned for 1 rank(s)" in text and "on a CUDA device of 0.01 GiB" in text and "does not fit" in text


@pytest.mark.slow  # two fresh processes importing torch and transformers
def test_rlrun_plan_prints_the_plan_and_writes_nothing(tmp_path):
    r = subprocess.run(["rlrun", "plan", "head=tiled", "head.size=auto", "head.memory_budget_mib=100",
                        "model.vocab_size=151936", "plan.device_gib=24"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "head tile 112 tokens" in r.stdout and "train" in r.stdout and "on a CUDA device of 24 GiB" in r.stdout
    sweep = subprocess.run(["rlrun", "plan", "-cd", str(ROOT / "sweeps"), "-cn", "smoke"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)  # a sweep config: its base config, once
    assert sweep.returncode == 0 and sweep.stdout.count("largest part of the growth") == 1, sweep.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/, multirun/ or mlflow.db
    bad = subprocess.run(["rlrun", "plan", "head=tiled", "head.size=auto", "head.memory_budget_mib=1",
                          "model.vocab_size=151936"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "raise head.memory_budget_mib" in bad.stderr and "Traceback" not in bad.stderr


def test_a_run_logs_its_plan_and_the_tile_it_chose(tmp_path):
    new_store(tmp_path)
    cfg = make_cfg("experiment=smoke", "head=chunked", "head.size=auto", "head.memory_budget_mib=10",
                   "model.vocab_size=65536", "train.micro_batch=8", "rollout.max_new_tokens=16", "train.steps=2",
                   "eval.every=0", tmp_path=tmp_path)
    from rlrun.cli import run

    run(cfg, "planned")
    client, [r] = runs(tmp_path / "mlflow.db")
    size = int(r.data.tags["rlrun.head.size"])
    assert size == history(client, r.info.run_id, "plan/head_size")[0]
    assert size == 32  # 10 MiB / (65536 x 4 bytes per token) = 40 tokens, down to a multiple of 16 (of 128)
    for phase in ("generate", "train"):
        assert history(client, r.info.run_id, f"plan/{phase}_growth_mib")[0] > 0
        assert history(client, r.info.run_id, f"mem/{phase}_growth_mib")
    assert "plan.txt" in {a.path for a in client.list_artifacts(r.info.run_id)}


@pytest.mark.slow  # three short runs with vocabularies of 16k-65k, each in its own process (~2 min)
@pytest.mark.parametrize("point", [dict(head="dense", vocab=16384, tokens=512, lora=False),
                                   dict(head="chunked", vocab=65536, tokens=512, lora=False),
                                   dict(head="tiled", vocab=65536, tokens=2048, lora=True)],
                         ids=["dense-16k-512", "chunked-65k-512", "tiled-65k-2048-lora"])
def test_plan_predicts_what_runs_measure(point):
    from rlrun.render import in_child
    from rlrun.tools import bench_plan

    result = in_child(bench_plan.child, point, 3)  # the median of 3 steps' growth (RSS is process-wide: see bench_plan)
    assert set(bench_plan.CHECKED) <= set(result), result
    for phase in bench_plan.CHECKED:
        predicted, measured = result[phase]
        assert bench_plan.within(predicted, measured), (phase, predicted, measured)


def test_rlrun_plan_sizes_an_auto_tile_for_the_device_planned_for():
    """`rlrun plan head.size=auto` with no budget takes a tenth of plan.device_gib (the device the plan is for), not
    of this machine's free memory."""
    from rlrun.config import validate

    def tile(gib):
        cfg = validate(make_cfg("head=tiled", "head.size=auto", "model.vocab_size=151936", f"plan.device_gib={gib}"))
        text = plan.report(cfg)
        assert f"within a tenth of plan.device_gib={gib:g} GiB" in text, text[:300]
        return int(text.split("head.size=auto: ")[1].split()[0])

    assert tile(0.5) < tile(80)
