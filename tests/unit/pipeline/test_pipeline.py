"""rollout.pipeline=async: the schedule (which weights generate which rollout), the worker process (versions,
weights, slow sides, failures), the rollout-correction options, and seeded runs (K=0 is sync, async is
reproducible, resume, Ctrl-C)."""

import copy
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import TEST_PATH, make_cfg
from helpers import HEADS, history, runs

from rlrun import losses, models, pipeline
from rlrun.batching.layouts import response_hidden
from rlrun.config import validate
from rlrun.recipes.grpo import split_rollout
from rlrun.rollout import hf


# -- the schedule -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window,grad_accum", [(2, 2), (4, 2), (2, 4), (3, 2), (6, 4)])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_rollout_is_first_trained_at_most_k_steps_after_its_weights(window, grad_accum, k):
    firsts = [pipeline.first_step(r, window, grad_accum) for r in range(40)]
    # the synchronous loop: rollout r is generated when the buffer runs short at the start of step firsts[r]
    enqueued = 0
    for step in range(max(firsts) + 1):
        while enqueued * window < (step + 1) * grad_accum:
            assert firsts[enqueued] == step
            enqueued += 1
    versions = [pipeline.version(r, window, grad_accum, k) for r in range(40)]
    assert all(0 <= f - v <= k for f, v in zip(firsts, versions))
    assert versions == sorted(versions)  # the worker loads versions in order
    assert [v for f, v in zip(firsts, versions) if f >= k] == [f - k for f in firsts if f >= k]  # exactly K, once
    if k == 0:
        assert versions == firsts  # K=0: the weights of the step that trains on it, as sync


def test_threads_split_the_cores_on_cpu():
    total = torch.get_num_threads()
    trainer, worker = pipeline.threads(None, torch.device("cpu"))
    assert worker == max(1, total // 2) and trainer == max(1, total - worker)
    assert pipeline.threads(1, torch.device("cpu"))[1] == 1


# -- the worker -------------------------------------------------------------------------------------------------------
def cfg_for(*overrides):
    return validate(make_cfg("experiment=smoke", "rollout.pipeline=async", "train.steps=20", *overrides))


def test_nothing_is_requested_for_steps_the_run_will_not_take():
    cfg = cfg_for("train.steps=3", "rollout.max_staleness=2")
    pipe = pipeline.Pipeline(cfg, window=1, grad_accum=1, device=torch.device("cpu"))
    sent = []
    pipe.proc, pipe.published = object(), 0  # no worker: the requests are only recorded
    pipe.inbox = SimpleNamespace(put=sent.append)
    meter = SimpleNamespace(phase=lambda name: __import__("contextlib").nullcontext())
    for step in range(3):
        pipe.published = step  # as if the weights of this step were out
        pipe.ahead(step, None, prompts_for, meter)
    assert [m[1] for m in sent if m[0] == "generate"] == [0, 1, 2]  # rollouts of steps 0-2 only, not 3 and 4


def trainer_logprobs(model, roll, temperature=1.0):
    """The trainer's logprobs of a rollout's response tokens under `model` (dense, fp32)."""
    from rlrun import registry

    backbone, weight = models.split(model)
    out = []
    for mb in split_rollout(roll, torch.zeros(roll.input_ids.shape[0]), roll.input_ids.shape[0]):
        with torch.no_grad():
            lp = registry.get("head", "dense").logprobs(response_hidden(backbone, mb), weight, mb.targets, temperature,
                                                        None)
        out.append(torch.where(mb.mask, lp, 0.0))
    return torch.cat(out).view_as(roll.gen_logprobs)


def perturbed(model, seed):
    """A copy of `model` whose weights moved as after an optimizer step (a different version)."""
    m = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return m


def prompts_for(r):
    texts = [f"{r}+{i}=" for i in range(4)]
    return [{"prompt": t} for t in texts], texts, [1000 * r + i for i in range(4)]


def run_pipeline(cfg, model, steps, window=1, grad_accum=1, build=None, trainer_delay=0.0):
    """Drive a Pipeline as the GRPO loop does, with `steps` weight versions (model, perturbed copies); -> the
    rollouts in order and the versions' models."""
    versions = [model] + [perturbed(model, s) for s in range(1, steps)]
    kwargs = {"build": build} if build else {}
    pipe = pipeline.Pipeline(cfg, window=window, grad_accum=grad_accum, device=torch.device("cpu"), **kwargs)
    meter = SimpleNamespace(phase=lambda name: __import__("contextlib").nullcontext())
    got = []
    try:
        pipe.start(versions[0], 0)
        for step in range(steps):
            pipe.ahead(step, versions[step], prompts_for, meter)
            while len(got) * window < (step + 1) * grad_accum:
                got.append(pipe.take())
            time.sleep(trainer_delay)
    finally:
        pipe.close()
    return got, versions


@pytest.mark.slow  # ~8 s: a generator process of its own
def test_each_rollout_is_generated_by_the_weights_its_version_names():
    cfg = cfg_for("rollout.max_staleness=1", "rollout.max_new_tokens=5")
    model, _ = models.build(cfg.model, cfg.seed)
    got, versions = run_pipeline(cfg, model, steps=4)
    assert [g.version for g in got] == [0, 0, 1, 2]  # K=1: step s trains on rollouts of the weights of s - 1
    for g in got:
        lp = trainer_logprobs(versions[g.version], g.rollout)
        assert torch.allclose(lp, g.rollout.gen_logprobs, atol=1e-5), g.index  # the worker used that version
        other = versions[(g.version + 1) % len(versions)]
        assert not torch.allclose(trainer_logprobs(other, g.rollout), g.rollout.gen_logprobs, atol=1e-3)
    # the sampled tokens are those of hf's sampler on that version, in this process
    _, tok = models.build(cfg.model, cfg.seed)
    for g in got:
        _, texts, seeds = prompts_for(g.index)
        ref = hf.generate(versions[g.version], tok, texts, cfg.rollout, torch.device("cpu"), seeds)
        assert torch.equal(ref.input_ids, g.rollout.input_ids) and ref.completions == g.rollout.completions


def slow_build(cfg, state, device):
    """The worker's model and rollout engine, with a generator that takes 0.3 s per rollout."""
    from rlrun.pipeline import worker

    policy, tok, engine = worker.build(cfg, state, device)
    generate = engine.generate

    def slow(*args):
        time.sleep(0.3)
        return generate(*args)

    engine.generate = slow
    return policy, tok, engine


@pytest.mark.slow  # starts generator processes
@pytest.mark.parametrize("k", [1, 2])
def test_a_slow_generator_or_a_slow_trainer_changes_nothing_but_time(k):
    cfg = cfg_for(f"rollout.max_staleness={k}", "rollout.max_new_tokens=3")
    model, _ = models.build(cfg.model, cfg.seed)
    fast, _ = run_pipeline(cfg, model, steps=5, window=2, grad_accum=2)
    slow_gen, _ = run_pipeline(cfg, model, steps=5, window=2, grad_accum=2, build=slow_build)
    slow_trainer, _ = run_pipeline(cfg, model, steps=5, window=2, grad_accum=2, trainer_delay=0.3)
    for run in (slow_gen, slow_trainer):
        assert [(g.index, g.version) for g in run] == [(g.index, g.version) for g in fast]
        for a, b in zip(run, fast):
            assert torch.equal(a.rollout.input_ids, b.rollout.input_ids)
            assert torch.equal(a.rollout.gen_logprobs, b.rollout.gen_logprobs)
    assert all(g.index - g.version <= k for g in fast)  # window == grad_accum: rollout r is first trained at step r
    assert [g.version for g in fast][k:] == list(range(5 - k))
    assert sum(g.busy_s for g in slow_gen) >= 0.3 * 5  # the worker's own account of its time
    assert sum(g.idle_s for g in slow_trainer) > sum(g.idle_s for g in fast)  # waiting for the trainer's weights


def failing_build(cfg, state, device):
    raise RuntimeError("the generator could not build its model (test)")


@pytest.mark.slow  # starts generator processes
def test_a_failing_worker_is_an_error_naming_its_cause_and_stops_nothing_else():
    cfg = cfg_for()
    model, _ = models.build(cfg.model, cfg.seed)
    pipe = pipeline.Pipeline(cfg, window=1, grad_accum=1, device=torch.device("cpu"), build=failing_build)
    with pytest.raises(pipeline.PipelineError, match="could not build its model"):
        pipe.start(model, 0)
    pipe.close()
    assert pipe.proc is None


@pytest.mark.slow  # starts generator processes
def test_a_killed_worker_is_an_error_not_a_hang():
    cfg = cfg_for()
    model, _ = models.build(cfg.model, cfg.seed)
    pipe = pipeline.Pipeline(cfg, window=1, grad_accum=1, device=torch.device("cpu"))
    meter = SimpleNamespace(phase=lambda name: __import__("contextlib").nullcontext())
    try:
        pipe.start(model, 0)
        os.kill(pipe.proc.pid, signal.SIGKILL)
        pipe.proc.join(timeout=30)
        pipe.ahead(0, model, prompts_for, meter)
        with pytest.raises(pipeline.GeneratorLost, match=r"ended with no error message \(killed by SIGKILL\) \(SIGKILL "
                                                         "is how the kernel's OOM killer ends a process"):
            pipe.take()
    finally:
        pipe.close()


@pytest.mark.slow  # starts generator processes
def test_the_worker_leaves_when_the_trainer_is_killed(tmp_path):
    """kill -9 of the trainer: no signal, no message; the worker notices its parent is gone and exits."""
    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys, time, torch\n"
        f"sys.path[:0] = {TEST_PATH.split(os.pathsep)!r}\n"  # conftest's folder
        "from conftest import make_cfg\n"
        "from rlrun import models, pipeline\n"
        "from rlrun.config import validate\n"
        "if __name__ == '__main__':  # spawn imports this file again in the worker\n"
        "    cfg = validate(make_cfg('experiment=smoke', 'rollout.pipeline=async'))\n"
        "    model, _ = models.build(cfg.model, cfg.seed)\n"
        "    pipe = pipeline.Pipeline(cfg, window=1, grad_accum=1, device=torch.device('cpu'))\n"
        "    pipe.start(model, 0)\n"
        "    print(pipe.proc.pid, flush=True)\n"
        "    time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": TEST_PATH}
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    worker_pid = int(p.stdout.readline())
    p.kill()
    p.wait()
    deadline = time.time() + 30
    while alive(worker_pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive(worker_pid), "the generator outlived its trainer by 30 s"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


# -- rollout correction -----------------------------------------------------------------------------------------------
def test_token_level_truncate_and_mask_are_the_formulas():
    old = torch.tensor([0.0, -1.0, -2.0, -0.5, -3.0])
    gen = torch.tensor([-0.2, -0.2, -0.1, -0.5, -0.1])
    ratio = [torch.exp(torch.tensor(o - g)).item() for o, g in zip(old.tolist(), gen.tolist())]
    truncated = losses.tis_weight(old - gen, "truncate", 1.1, None)
    assert truncated.tolist() == pytest.approx([min(r, 1.1) for r in ratio])
    masked = losses.tis_weight(old - gen, "mask", 1.1, 0.5)
    assert masked.tolist() == pytest.approx([r if 0.5 <= r <= 1.1 else 0.0 for r in ratio])
    assert masked.tolist()[2] == 0.0 and masked.tolist()[4] == 0.0 and masked.tolist()[3] == 1.0


def test_sequence_level_weight_is_the_product_of_the_ratios_of_valid_tokens():
    old = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    gen = torch.tensor([[-1.2, -2.1, 0.0], [-0.4, -0.4, -0.4]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    seq = [(-1.0 + 1.2) + (-2.0 + 2.1), 3 * (-0.5 + 0.4)]  # the masked token (-9 vs 0) does not count
    w = losses.sequence_is_weights(old.flatten(), gen.flatten(), mask.flatten(), 2, "truncate", 1.2, None)
    expected = [min(torch.exp(torch.tensor(x)).item(), 1.2) for x in seq]
    assert w.view(2, 3).tolist() == [[pytest.approx(expected[0])] * 3, [pytest.approx(expected[1])] * 3]
    w = losses.sequence_is_weights(old.flatten(), gen.flatten(), mask.flatten(), 2, "mask", 1.2, 0.7)
    assert w.view(2, 3)[0].tolist() == [0.0] * 3  # exp(0.3) > 1.2: the whole sequence leaves the loss
    assert w.view(2, 3)[1].tolist() == [pytest.approx(torch.exp(torch.tensor(seq[1])).item())] * 3


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("level,mode", [("token", "truncate"), ("token", "mask"), ("sequence", "mask")])
def test_every_head_applies_the_correction_as_the_formula_says(head, level, mode):
    """Loss, gradients and metrics of each head equal a reference written from the formula (DAPO term times the
    weight; masked tokens leave the sum but keep their place in the token count)."""
    from rlrun import registry

    gen = torch.Generator().manual_seed(0)
    rows, R, H, V = 3, 5, 8, 11
    hidden = torch.randn(rows * R, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (rows * R,), generator=gen)
    mask = torch.rand(rows * R, generator=gen) > 0.2
    adv = torch.randn(rows, generator=gen)[:, None].expand(rows, R).reshape(-1)
    with torch.no_grad():
        cur = torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None]).squeeze(1)
    old = cur + 0.3 * torch.randn(rows * R, generator=gen)
    # a sequence's ratio multiplies its tokens': smaller per-token gaps there, so that some sequences stay in range
    behav = old + (0.4 if level == "token" else 0.1) * torch.randn(rows * R, generator=gen)
    is_w = losses.sequence_is_weights(old, behav, mask, rows, mode, 1.3, 0.7) if level == "sequence" else None
    f = losses.objective("dapo", adv, old, None, behav, clip_low=0.2, clip_high=0.28,
                         tis_cap=1.3 if level == "token" else None, tis_mode=mode, tis_low=0.7, is_weights=is_w)
    loss, stats = registry.get("head", head).loss(hidden, weight, targets, mask, f, int(mask.sum()), 1.0, 4)
    loss.backward()
    got = (loss.item(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None

    # the reference, from the formulas
    lp = torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None]).squeeze(1)
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    if level == "token":
        r = torch.exp(old - behav)
        w = r.clamp(max=1.3) if mode == "truncate" else torch.where((r >= 0.7) & (r <= 1.3), r, 0.0)
    else:
        seq = torch.where(mask, old - behav, 0.0).view(rows, R).sum(1).exp()
        w = torch.where((seq >= 0.7) & (seq <= 1.3), seq, 0.0)[:, None].expand(rows, R).reshape(-1)
    ref = torch.where(mask, pg * w, 0.0).sum() / mask.sum()
    ref.backward()
    assert got[0] == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(got[1], hidden.grad, rtol=1e-5, atol=1e-7)
    assert torch.allclose(got[2], weight.grad, rtol=1e-5, atol=1e-7)
    metrics = losses.summarize(stats, mask)
    assert metrics["is_weight_mean"] == pytest.approx(w[mask].mean().item(), rel=1e-5)
    if mode == "mask":
        assert metrics["mismatch/masked_frac"] == pytest.approx((w[mask] == 0).float().mean().item())
        assert 0 < metrics["mismatch/masked_frac"] < 1  # the case masks some tokens, not none or all


# -- validators ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,needle", [
    (["logprob_policy=skip"], "logprob_policy=skip assumes the weights that drew a rollout"),
    (["loss=dpo"], "loss=dpo generates nothing"),
    (["engine=deepspeed", "engine.zero_stage=3"], "ZeRO-3 partitions them"),
])
def test_what_async_refuses_is_one_clear_error(overrides, needle):
    from rlrun.config import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(make_cfg("experiment=smoke", "rollout.pipeline=async", *overrides))
    assert needle in str(e.value) and len(e.value.problems) == 1


def test_the_rules_ask_a_pipelines_fact_not_its_name():
    """An option registered from outside that generates ahead in a process of its own (`generator_process`) is
    refused what async is refused, by its own name; one that generates beside the trainer (sync's rollouts under
    another name) is not."""
    from rlrun import registry
    from rlrun.config import ConfigError
    from rlrun.recipes.sources import Async, Sync

    registry.register("pipeline", "test_ahead", type("Ahead", (Async,), {}))
    registry.register("pipeline", "test_beside", type("Beside", (Sync,), {"exactness": "bitwise"}))
    try:
        with pytest.raises(ConfigError) as e:
            validate(make_cfg("experiment=smoke", "rollout.pipeline=test_ahead", "logprob_policy=skip",
                              "engine=deepspeed", "engine.zero_stage=3"))
        assert [p.split(" trains on")[0].split(" publishes")[0] for p in e.value.problems] == [
            "rollout.pipeline=test_ahead"] * 2
        validate(make_cfg("experiment=smoke", "rollout.pipeline=test_beside", "logprob_policy=skip",
                          "engine=deepspeed", "engine.zero_stage=3"))
    finally:
        registry.unregister("pipeline", "test_ahead")
        registry.unregister("pipeline", "test_beside")


def test_sequence_correction_refuses_skip_and_an_empty_mask_range():
    from rlrun.config import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(make_cfg("experiment=smoke", "logprob_policy=skip", "loss.tis.enabled=true",
                          "loss.tis.level=sequence", "loss.tis.mode=mask", "loss.tis.low=3"))
    msg = str(e.value)
    assert "loss.tis.level=sequence" in msg and "logprob_policy=skip" in msg and "low=3.0 and cap=2.0" in msg


# -- runs -------------------------------------------------------------------------------------------------------------
DETERMINISTIC = ("loss", "reward_mean", "grad_norm", "clipfrac", "is_weight_mean")


def curves(tmp_path, *overrides):
    from test_runs import run_in

    _, client, r = run_in(tmp_path, "experiment=smoke", "train.steps=5", "train.lr=1e-2", "rollout.max_new_tokens=6",
                          "loss.tis.enabled=true", *overrides)
    assert r.info.status == "FINISHED"
    return {k: history(client, r.info.run_id, k) for k in (*DETERMINISTIC, "staleness_max", "pipeline/gen_busy_s")}


@pytest.mark.slow  # three short runs (~40 s)
def test_async_k0_is_sync_and_async_is_reproducible(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # trainer and generator alike (CPU reductions split by thread count change last bits)
    try:
        _k0_and_reproducible(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _k0_and_reproducible(tmp_path):
    sync = curves(tmp_path / "sync")
    k0 = curves(tmp_path / "k0", "rollout.pipeline=async", "rollout.max_staleness=0")
    for key in DETERMINISTIC:
        assert k0[key] == sync[key], key  # bit for bit: the same draws from the same weights
    assert sync["staleness_max"] == k0["staleness_max"] == [0.0] * 5
    assert len(k0["pipeline/gen_busy_s"]) == 5 and not sync["pipeline/gen_busy_s"]
    a = curves(tmp_path / "a", "rollout.pipeline=async", "rollout.max_staleness=1")
    b = curves(tmp_path / "b", "rollout.pipeline=async", "rollout.max_staleness=1")
    for key in DETERMINISTIC:
        assert a[key] == b[key], key  # a schedule, not a race
    assert a["staleness_max"] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert a["loss"] != sync["loss"]  # stale rollouts: another (valid) run


@pytest.mark.slow  # two short runs
def test_lora_adapters_are_what_the_generator_receives(tmp_path):
    """With LoRA only the adapters train, so only they are published: K=0 still draws what sync draws."""
    pytest.importorskip("peft")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lora = ("model.lora.enabled=true", "train.lr=5e-2")
        sync = curves(tmp_path / "sync", *lora)
        k0 = curves(tmp_path / "k0", *lora, "rollout.pipeline=async", "rollout.max_staleness=0")
    finally:
        torch.set_num_threads(threads)
    for key in DETERMINISTIC:
        assert k0[key] == sync[key], key


@pytest.mark.slow
def test_ctrl_c_stops_the_run_killed_and_leaves_no_process(tmp_path):
    """Ctrl-C in a terminal reaches the whole process group: the trainer finishes its step, checkpoints the
    rollout generated ahead, stops the generator and ends KILLED; nothing is left running."""
    from test_checkpoint import ENV, logged_steps

    from rlrun import checkpoint

    p = subprocess.Popen([sys.executable, "-m", "rlrun", "experiment=smoke", "rollout.pipeline=async",
                          "train.steps=400", f"checkpoint.dir={tmp_path}/ckpt", "progress=false",
                          f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"], cwd=tmp_path, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while p.poll() is None and logged_steps(tmp_path / "mlflow.db") < 3 and time.time() < deadline:
        time.sleep(0.05)
    helpers_ = [pid for pid in children(p.pid) if "multiprocessing" in cmdline(pid)]  # + spawn's resource tracker
    workers = [pid for pid in helpers_ if "spawn_main" in cmdline(pid)]
    assert p.poll() is None and len(workers) == 1, (helpers_, p.stderr.read()[-2000:] if p.poll() else "")
    os.killpg(p.pid, signal.SIGINT)
    assert p.wait(timeout=120) == 130, p.stderr.read()[-2000:]
    _, (r,) = runs(tmp_path / "mlflow.db")
    assert r.info.status == "KILLED"
    state, _ = checkpoint.load_latest(str(tmp_path / "ckpt"))
    pipe = state["pipeline"]
    assert pipe["ready"] and pipe["submitted"] == pipe["taken"] + len(pipe["ready"])  # generated ahead, kept
    deadline = time.time() + 10
    while any(map(alive, helpers_)) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(map(alive, helpers_)), "a process of the run outlived it"


def parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().split(")")[-1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return -1


def children(pid: int) -> list[int]:
    return [int(c) for c in os.listdir("/proc") if c.isdigit() and parent_of(int(c)) == pid]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except FileNotFoundError:
        return ""
