"""`python -m rlrun.bench gpu` on a machine without CUDA: its own logic (arguments, --only, rows and the one table
from made-up results, the docs it writes, the exit without a device) and the fp64 reference its heads part checks
against. What it measures on CUDA is in tests/e2e/test_gpu.py (marker gpu)."""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from rlrun import registry
from rlrun.tools import bench, bench_gpu, bench_heads, gpu_heads, gpu_runs

ENV = {"device": "NVIDIA Test (80 GiB)", "torch": "2.x", "cuda": "12.x", "date": "2026-01-01"}


def args(*argv):
    return bench.parser().parse_args(["gpu", *argv])


def history(**series):
    """A made-up run: {metric: [(step, value, seconds)]}, each metric given as a list of values from step 0."""
    return {k: [(i, v, float(i)) for i, v in enumerate(vs)] for k, vs in series.items()}


# --- arguments ---


def test_only_takes_parts_in_order_once_and_defaults_to_all():
    assert args().only == list(bench_gpu.PARTS)
    assert args("--only", "plan,heads,plan").only == ["plan", "heads"]
    assert args("--plan-points", "dense-keep,tiled-checkpoint-lora").plan_points == [
        ("dense", "keep", False), ("tiled", "checkpoint", True)]


@pytest.mark.parametrize("argv, named", [
    (["--only", "heads,gpus"], "each must be one of heads, plan, offload, runs, vllm"),
    (["--only", ","], "each must be one of"),
    (["--dtypes", "float16"], "each must be one of float32, bfloat16"),
    (["--variants", "always,sometimes"], "each must be one of always, window, skip"),
    (["--plan-points", "tiled-kept"], "plan point 'tiled-kept': write HEAD-ACTIVATIONS"),
    (["--plan-points", "tiled-keep-qlora"], "plan point 'tiled-keep-qlora'")])
def test_bad_arguments_are_one_error_naming_the_choices(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        args(*argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_without_cuda_it_exits_2_with_one_line_and_writes_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    docs = tmp_path / "benchmarks-gpu.md"
    with pytest.raises(SystemExit) as e:
        bench.main(["gpu", "--docs", str(docs), "--tracking-uri", "none"])
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out == ""
    assert out.err.count("\n") == 1 and out.err.startswith("python -m rlrun.bench gpu: error: no CUDA device")
    assert not docs.exists()


@pytest.mark.slow  # a fresh process importing torch
def test_the_command_without_a_device_is_one_line_and_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rlrun.bench", "gpu"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if "no CUDA device" in line] == r.stderr.splitlines()[-1:]


# --- rows from made-up results ---


def test_heads_rows_judge_each_error_against_its_dtypes_tolerance():
    ref = {"loss": torch.tensor(2.0, dtype=torch.float64), "grad_h": torch.ones(3, dtype=torch.float64),
           "grad_w": torch.full((2, 2), 4.0, dtype=torch.float64), "time": 0.5, "peak": 3 * 2**20}
    near = {**ref, "loss": ref["loss"] * (1 + 5e-6), "time": 0.1, "peak": 2**20}
    off_w = {**near, "grad_w": ref["grad_w"] + torch.tensor([[0.0, 1e-3], [0.0, 0.0]], dtype=torch.float64)}
    ok = gpu_heads.row_of("tiled", "float32", near, ref)
    assert ok["ok"] and ok["err_loss"] == pytest.approx(5e-6) and ok["growth_mib"] == 1.0 and ok["time_s"] == 0.1
    bad = gpu_heads.row_of("tiled", "float32", off_w, ref)
    assert not bad["ok"] and bad["err_grad_w"] == pytest.approx(2.5e-4)  # 1e-3 / max |ref| (4)
    assert gpu_heads.row_of("tiled", "bfloat16", off_w, ref)["ok"]  # within bf16's 2e-2
    assert gpu_heads.row_of("chunked", "float32", near, {"error": "exit code 1"})["ok"] is False
    assert gpu_heads.row_of("dense", "float32", {"error": "exit code -9"}, ref)["error"] == "exit code -9"
    assert gpu_heads.row_of(gpu_heads.REFERENCE, "bfloat16", ref, None)["ok"] is None


def test_runs_rows_steps_per_s_after_warmup_and_the_step0_grad_norm():
    base = history(loss=[0.0] * 5, grad_norm=[2.0, 1.0, 1.0, 1.0, 1.0], **{"mem/train_peak_mib": [10.0, 30, 20]})
    base["loss"] = [(i, 0.0, t) for i, t in enumerate([0.0, 5.0, 6.0, 7.0, 8.0])]  # step 0 -> 1 slow: warm-up
    fast = {**history(grad_norm=[2.0 * (1 + 1e-7)]), "loss": [(i, 0.0, t) for i, t in enumerate([0, 1, 1.5, 2])]}
    diverged = history(loss=[0.0] * 3, grad_norm=[2.1])
    rows = gpu_runs.runs_rows({"always": base, "skip": fast, "packed": diverged, "async": {"error": "boom"}}, skip=1)
    by = {r["case"]: r for r in rows}
    assert by["always"]["speed"] == 1.0 and by["always"]["mem_mib"] == 30.0 and by["always"]["ok"] is None
    assert by["skip"]["speed"] == 2.0 and by["skip"]["speedup"] == 2.0 and by["skip"]["ok"]
    assert not by["packed"]["ok"] and by["packed"]["grad_norm0_rel_diff"] == pytest.approx(0.05)
    assert by["async"]["error"] == "boom"


def test_offload_rows_need_the_state_back_on_the_device_and_the_same_grad_norms():
    state = 8 * 2**20  # bytes
    steps = dict(loss=[0.0] * 3, grad_norm=[1.0, 2.0, 3.0])
    off = history(**steps, **{"time/old_logprobs_s": [9.0, 1.0, 1.0], "time/ref_logprobs_s": [9.0, 0.5, 0.5],
                              "mem/old_logprobs_peak_mib": [100.0, 100, 100]})
    on = history(**steps, **{"time/old_logprobs_s": [9.0, 1.0, 1.0], "time/ref_logprobs_s": [9.0, 0.5, 0.5],
                             "time/offload_s": [0.0, 0.2, 0.2], "time/onload_s": [0.0, 0.3, 0.3],
                             "mem/onload_growth_mib": [0.0, 8.1, 8.1], "mem/old_logprobs_peak_mib": [100.0, 92, 92]})
    rows = {r["case"]: r for r in gpu_runs.offload_rows(on, off, state, skip=1)}
    assert rows["offload=off"]["speed"] == 1.5 and rows["offload=off"]["ok"] is None
    assert rows["offload=on"]["speed"] == pytest.approx(2.0) and rows["offload=on"]["mem_mib"] == 92
    assert rows["offload=on"]["moved_mib"] == 8.1 and rows["offload=on"]["ok"]
    nothing = {**on, **history(**{"mem/onload_growth_mib": [0.0, 0.0, 0.0]})}
    assert not {r["case"]: r for r in gpu_runs.offload_rows(nothing, off, state, 1)}["offload=on"]["ok"]
    parted = {**on, **history(grad_norm=[1.0, 2.0, 3.1])}
    assert not {r["case"]: r for r in gpu_runs.offload_rows(parted, off, state, 1)}["offload=on"]["ok"]


def test_vllm_rows_need_a_sync_per_step_and_a_small_mismatch():
    hf = history(**{"throughput/gen_tokens_per_s": [1.0, 100.0, 100.0], "mismatch/gen_vs_train_abs": [1e-7] * 3})
    synced = history(**{"throughput/gen_tokens_per_s": [1.0, 300.0, 300.0], "mismatch/gen_vs_train_abs": [2e-5] * 3,
                        "time/sync_s": [0.0, 0.1, 0.1]})
    rows = gpu_runs.vllm_rows(hf, synced, steps=3, skip=1)
    assert [r["ok"] for r in rows] == [True, True] and rows[1]["speed"] == 300.0 and "x3.00 hf's" in rows[1]["check"]
    stale = {**synced, "time/sync_s": [(1, 0.1, 1.0)]}
    assert not gpu_runs.vllm_rows(hf, stale, steps=3, skip=1)[1]["ok"]
    far = {**synced, **history(**{"mismatch/gen_vs_train_abs": [2e-5, 5e-3, 2e-5]})}
    assert not gpu_runs.vllm_rows(hf, far, steps=3, skip=1)[1]["ok"]


def test_without_vllm_the_part_is_one_skipped_row(monkeypatch):
    monkeypatch.setattr(gpu_runs, "vllm_available", lambda: False)
    [row] = gpu_runs.vllm_part(args(), [])
    assert row["skipped"].startswith("vLLM is not installed") and bench_gpu.verdict(row) == "skipped"


def test_decode_rows_judge_rlruns_decodes_by_eagers_tokens_and_carry_the_bound():
    def g(impl, tps, same, diff, compile_s=0.0):
        return {"impl": impl, "tokens_per_s": tps, "speedup": tps / 100, "of_bound": 400 / tps, "compile_s": compile_s,
                "same_tokens": same, "logprob_diff": diff}

    rows = gpu_runs.decode_rows({"rows": [g("and each prompt prefilled once", 100.0, True, 0.0),
                                          g("rollout.decode compiled", 250.0, True, 2e-5, 3.0),
                                          g("rollout vllm", 300.0, None, None), g("GEMM bound", 400.0, None, None)]})
    assert [r["ok"] for r in rows] == [True, True, None, None] and [r["speed"] for r in rows] == [100, 250, 300, 400]
    assert "x1.60 of the GEMM bound" in rows[1]["check"] and "compiles 3.0 s" in rows[1]["check"]
    other = gpu_runs.decode_rows({"rows": [g("rollout.decode compiled", 250.0, False, float("inf"))]})
    assert other[0]["ok"] is False and bench_gpu.verdict(other[0]) == "FAIL"
    [failed] = gpu_runs.decode_rows({"error": "exit code 1 (log: x)"})
    assert bench_gpu.verdict(failed) == "failed" and "log: x" in failed["error"]


def test_plan_rows_compare_peak_and_growth_per_phase():
    h = history(**{"plan/train_peak_mib": [1000.0] * 3, "mem/train_peak_mib": [990.0, 1010, 1300],
                   "plan/train_growth_mib": [400.0] * 3, "mem/train_growth_mib": [390.0, 410, 700],
                   "plan/old_logprobs_peak_mib": [500.0] * 3, "mem/old_logprobs_peak_mib": [900.0] * 3,
                   "plan/old_logprobs_growth_mib": [100.0] * 3, "mem/old_logprobs_growth_mib": [100.0] * 3,
                   "plan/generate_peak_mib": [1.0] * 3, "mem/generate_peak_mib": [50.0] * 3,
                   "plan/generate_growth_mib": [1.0] * 3, "mem/generate_growth_mib": [50.0] * 3})
    rows = {r["case"]: r for r in gpu_runs.plan_rows("tiled-keep", h)}
    assert set(rows) == {"tiled-keep / generate", "tiled-keep / old_logprobs", "tiled-keep / train"}
    assert rows["tiled-keep / train"]["peak_mib"] == 1010 and rows["tiled-keep / train"]["ok"]  # medians
    assert rows["tiled-keep / old_logprobs"]["ok"] is False  # peak off by 44%
    assert rows["tiled-keep / generate"]["ok"] is None  # not a target, as in `bench plan`


def test_merged_overrides_keep_one_value_per_key_the_last():
    assert gpu_runs.merged(["a=1", "b=2"], ["a=3"]) == ["a=3", "b=2"]
    assert gpu_runs.runs_overrides(args(), [], "skip").count("logprob_policy=skip") == 1


# --- the table, MLflow and the docs ---


def made_up_rows():
    return [{"part": "heads", "case": "tiled fp32", "time_s": 0.25, "growth_mib": 700.0, "err_loss": 1e-7,
             "check": "vs fp64: ...", "ok": True},
            {"part": "plan", "case": "dense-keep / train", "mem_mib": 9000.0, "mem_what": "peak",
             "check": "plan peak 9100 (+1.1%)", "ok": False},
            {"part": "runs", "case": "always", "speed": 2.5, "speed_unit": "steps/s", "mem_mib": 12000.0,
             "mem_what": "peak", "check": "baseline", "ok": None},
            {"part": "offload", "case": "offload=on", "error": "RuntimeError: CUDA out of memory"},
            {"part": "vllm", "case": "rollout=vllm", "skipped": "vLLM is not installed"}]


def test_one_table_with_a_row_per_case_and_the_verdicts():
    lines = bench_gpu.table(made_up_rows(), ENV, ["heads: liger not installed, left out"]).splitlines()
    assert lines[0] == "rlrun on NVIDIA Test (80 GiB), torch 2.x, CUDA 12.x, 2026-01-01"
    assert lines[1].split() == ["part", "case", "speed", "memory", "check", "verdict"]
    assert lines[2].split()[:6] == ["heads", "tiled", "fp32", "0.250", "s", "700"] and lines[2].endswith("ok")
    assert lines[3].endswith("FAIL") and "2.5 steps/s" in lines[4] and lines[4].endswith("–")
    assert "failed: RuntimeError: CUDA out of memory" in lines[5] and lines[5].endswith("failed")
    assert "skipped: vLLM is not installed" in lines[6]
    assert lines[7] == ("1 of 2 checks ok; failed: plan dense-keep / train, offload offload=on; "
                        "not run: vllm rollout=vllm")
    assert lines[8] == "heads: liger not installed, left out"


def test_bench_prints_logs_writes_and_exits_1_on_a_failed_check(monkeypatch, tmp_path, capsys):
    from conftest import new_store

    from rlrun.tracking import open_client

    rows = made_up_rows()
    monkeypatch.setattr(bench_gpu, "require_cuda", lambda: None)
    monkeypatch.setattr(bench_gpu, "environment", lambda: ENV)
    monkeypatch.setattr(bench_gpu, "run_part", lambda part, a: ([r for r in rows if r["part"] == part], []))
    uri, docs = new_store(tmp_path), tmp_path / "benchmarks-gpu.md"
    a = args("--only", "heads,plan,runs", "--docs", str(docs), "--tracking-uri", uri)
    with pytest.raises(SystemExit) as e:
        a.func(a)
    assert e.value.code == 1 and "1 of 2 checks ok" in capsys.readouterr().out
    client = open_client(uri)
    [run] = client.search_runs([client.get_experiment_by_name(bench.BENCH_EXPERIMENT).experiment_id])
    m = run.data.metrics
    assert m["ok/heads/tiled_fp32"] == 1.0 and m["ok/plan/dense-keep/train"] == 0.0 and "ok/runs/always" not in m
    assert m["speed/runs/always"] == 2.5 and run.data.params["env_device"] == ENV["device"]
    assert set(json.loads(docs.with_suffix(".json").read_text())["parts"]) == {"heads", "plan", "runs"}
    monkeypatch.setattr(bench_gpu, "run_part", lambda part, a: ([rows[0]], []))
    assert bench_gpu.bench(args("--only", "heads", "--docs", "", "--tracking-uri", "none"),
                           bench.log_mlflow) == [rows[0]]


def test_docs_keep_the_parts_not_rerun_and_show_one_table(tmp_path):
    md = tmp_path / "benchmarks-gpu.md"
    rows = made_up_rows()
    part = lambda name, env=ENV: {"env": env, "command": f"python -m rlrun.bench gpu --only {name}",  # noqa: E731
                                  "rows": [r for r in rows if r["part"] == name], "notes": []}
    bench_gpu.write_docs(md, {"runs": part("runs"), "heads": part("heads")})
    later = {**ENV, "date": "2026-02-02"}
    bench_gpu.write_docs(md, {"heads": {**part("heads", later), "rows": [{**rows[0], "case": "dense fp32"}]}})
    text = md.read_text()
    assert text.count("| part | case |") == 1  # one table
    assert "`heads`: NVIDIA Test (80 GiB), torch 2.x, CUDA 12.x, 2026-02-02" in text and "2026-01-01" in text
    assert "dense fp32" in text and "tiled fp32" not in text  # heads replaced, runs kept
    assert text.index("| heads | dense fp32") < text.index("| runs | always")  # parts in PARTS order


def test_the_committed_page_is_the_one_the_writer_makes():
    md = bench_gpu.DOCS
    assert md.read_text() == bench_gpu.markdown(bench_gpu.load_results(md.with_suffix(".json")))


# --- a command with a time limit: --budget, and a SIGTERM from `timeout` or a scheduler ---


def test_over_budget_no_run_starts_and_its_row_says_not_run_without_failing(monkeypatch, tmp_path):
    import time

    a = args("--budget", "60", "--log-dir", str(tmp_path))
    a.deadline = time.monotonic() - 1  # as bench() sets it, 60 s ago
    monkeypatch.setattr(gpu_runs.render, "in_child", lambda *args: pytest.fail("a run started over the budget"))
    r = gpu_runs.launch(a, "runs-skip", [])
    assert r == {"skipped": "not started: over --budget 60 s"}
    rows = gpu_runs.runs_rows({"always": history(loss=[0.0, 0.0, 0.0], grad_norm=[1.0] * 3), "skip": r}, skip=1)
    assert rows[1] == {"part": "runs", "case": "skip", "skipped": "not started: over --budget 60 s"}
    assert bench_gpu.verdict(rows[1]) == "skipped" and bench_gpu.summary(rows) == "0 of 0 checks ok; not run: runs skip"
    off = {"part": "offload", "case": "offload=on"}
    assert gpu_runs.offload_rows(r, r, 8, 1) == [{**off, "case": "offload=off", **r}, {**off, **r}]
    assert gpu_heads.row_of("tiled", "float32", r, None) == {"part": "heads", "case": "tiled fp32", **r}


def test_a_sigterm_cuts_the_child_in_flight_short_and_starts_no_other(tmp_path):
    """What `timeout 300 python -m rlrun.bench gpu` does at 300 s: the run in flight becomes an error row, the rest
    are not started, and the command goes on to print and write the rows of the runs that finished."""
    import os
    import signal
    import threading

    import helpers

    a, before = args(), signal.getsignal(signal.SIGTERM)
    with bench_gpu.stopped_by_sigterm():
        done = gpu_runs.child(a, helpers.sleep_then_save, 0.0)
        threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        cut = gpu_runs.child(a, helpers.sleep_then_save, 600.0)  # had it finished, it would say {"slept": 600.0}
        later = gpu_runs.child(a, helpers.sleep_then_save, 0.0)
    assert done == {"slept": 0.0} and cut == {"error": "cut short: the command got SIGTERM"}
    assert later == {"skipped": "not started: the command got SIGTERM"}
    assert gpu_runs.STOP == {"why": None, "waiting": False}  # the handler and its state are gone after the command
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_part_that_raises_is_one_failed_row_and_the_others_run(monkeypatch):
    def boom(a, model):
        raise RuntimeError("no")

    monkeypatch.setattr(gpu_runs, "plan_part", boom)
    [row] = bench_gpu.run_part("plan", args())[0]
    assert row == {"part": "plan", "case": "(all)", "error": "RuntimeError: no"}


# --- each run's config is valid (a broken rule would otherwise first show on a GPU) ---


def test_every_run_of_the_check_composes_and_validates():
    from rlrun.config import ConfigError, validate
    from rlrun.tools.bench_trl import compose

    a = args()
    small, large = gpu_runs.model_overrides("0.5b"), gpu_runs.model_overrides("1.5b")
    runs = [*(gpu_runs.plan_overrides(a, small, *p) for p in a.plan_points),
            *(gpu_runs.offload_overrides(a, large, m) for m in ("on", "off")),
            *(gpu_runs.runs_overrides(a, small, v) for v in gpu_runs.VARIANTS),
            gpu_runs.vllm_overrides(a, small, "hf")]
    for overrides in runs:
        cfg = validate(compose([*overrides, "tracking=none"]))
        assert cfg.engine.device == "cuda" and cfg.model.vocab_size == 151936
    vllm = compose([*gpu_runs.vllm_overrides(a, small, "vllm"), "tracking=none"])
    if gpu_runs.vllm_available():
        validate(vllm)
    else:  # the part skips itself then; the rule that refuses it is the only problem
        with pytest.raises(ConfigError) as e:
            validate(vllm)
        assert len(e.value.problems) == 1 and "rollout=vllm needs vLLM" in e.value.problems[0]


def test_the_shapes_are_qwen2_05b_and_15b():
    # AdamW state = 8 bytes per parameter; Qwen2-0.5B has 494,032,768 parameters and Qwen2-1.5B 1,543,714,304
    assert gpu_runs.state_bytes(gpu_runs.model_overrides("0.5b")) == 8 * 494_032_768
    assert gpu_runs.state_bytes(gpu_runs.model_overrides("1.5b")) == 8 * 1_543_714_304


# --- the fp64 reference the heads are checked against ---


def test_the_reference_is_dense_dapo_in_float64():
    from rlrun.losses import masked_total, objective

    a = argparse.Namespace(tokens=48, seqs=4, hidden=16, vocab=97, tile_size=16, dtype="float32", seed=3)
    hidden, weight, targets, mask, adv, _, old = bench_heads.make_inputs(a, torch.device("cpu"))
    loss, grad_h, grad_w = gpu_heads.reference(hidden, weight, targets, mask, adv, old, rows=20)  # uneven blocks
    h, w = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    lp = torch.log_softmax(h @ w.T, -1).gather(-1, targets[:, None]).squeeze(-1)
    plain = masked_total(objective("dapo", adv.double(), old.double(), **bench_heads.CLIP)(lp)[0], mask, 48)
    plain.backward()
    assert loss.dtype == grad_w.dtype == torch.float64
    assert torch.allclose(loss, plain, rtol=1e-12, atol=0) and torch.allclose(grad_h, h.grad, rtol=1e-10, atol=1e-16)
    assert torch.allclose(grad_w, w.grad, rtol=1e-10, atol=1e-16)


def test_inputs_keep_every_log_ratio_off_the_clip_bounds_and_both_sides_of_them():
    current = torch.linspace(-1, 1, 2001, dtype=torch.float64)
    old = gpu_heads.keep_off_the_clip(current, torch.zeros_like(current))
    r = current - old
    for bound in (math.log(0.8), math.log(1.28)):
        assert (r - bound).abs().min() >= gpu_heads.MARGIN - 1e-12
    far = ((current - math.log(0.8)).abs() >= 0.05) & ((current - math.log(1.28)).abs() >= 0.05)
    assert torch.equal(old[far], torch.zeros(int(far.sum()), dtype=torch.float64))  # the rest untouched
    assert (r < math.log(0.8)).any() and (r > math.log(1.28)).any() and (r.abs() < 0.1).any()


@pytest.mark.parametrize("dtype", gpu_heads.DTYPES)
@pytest.mark.parametrize("impl", list(registry.REGISTRY["head"]))
def test_the_gpu_tests_heads_check_runs_on_cpu_as_written(impl, dtype):
    """tests/e2e/test_gpu.py's heads check, on CPU at a small size: the code it runs on CUDA is run in every CI. (Its
    namespace once lacked `objective`, which only the first CUDA run found: 6 failures on an H200, 2026-11-26.)"""
    g = args("--tokens", "128", "--hidden", "32", "--vocab", "1024", "--tile-size", "32")
    g.device = "cpu"
    errs = gpu_heads.errors(impl, gpu_heads.bench_args(g, dtype))
    assert set(errs) == {"loss", "grad_h", "grad_w"} and max(errs.values()) <= gpu_heads.TOLERANCE[dtype], errs


def test_rlrun_heads_in_fp32_pass_and_a_wrong_gradient_fails(tmp_path):
    """The part's children in this process on CPU: rlrun's chunked head is within fp32's tolerance of the reference,
    and the same result with its dW scaled by 1.001 is not."""
    g = args("--tokens", "64", "--seqs", "4", "--hidden", "16", "--vocab", "512", "--tile-size", "16", "--repeat", "1")
    g.device = "cpu"
    a = gpu_heads.bench_args(g, "float32")
    gpu_heads.child("chunked", a, tmp_path / "head.pt")
    gpu_heads.reference_child(a, tmp_path / "ref.pt")
    head, ref = torch.load(tmp_path / "head.pt"), torch.load(tmp_path / "ref.pt")
    row = gpu_heads.row_of("chunked", "float32", head, ref)
    assert row["ok"] and row["err_grad_w"] < 1e-6 and ref["time"] > 0
    assert not gpu_heads.row_of("chunked", "float32", {**head, "grad_w": head["grad_w"] * 1.001}, ref)["ok"]


# --- `pytest -m gpu` without a device ---


def test_gpu_tests_skip_without_cuda_for_one_reason_and_run_with_it(monkeypatch):
    import conftest

    gpu, plain = (type("Item", (), {"get_closest_marker": lambda self, name, m=m: m if name == "gpu" else None})()
                  for m in (object(), None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="gpu: no CUDA device"):
        conftest.pytest_runtest_setup(gpu)
    conftest.pytest_runtest_setup(plain)  # not a gpu test: runs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    conftest.pytest_runtest_setup(gpu)  # a device: runs


@pytest.mark.slow  # pytest in a subprocess
def test_pytest_m_gpu_reports_the_skip_in_one_line(tmp_path):
    from conftest import ROOT

    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q",
                        "tests/e2e/test_gpu.py"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    skipped = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert r.returncode == 0 and len(skipped) == 1 and "no CUDA device" in skipped[0], r.stdout[-2000:]


# --- the parts end to end on CPU, at toy sizes: the machinery, not the numbers ---

TOY = ["model=tiny", "model.arch=qwen2", "model.hidden_size=64", "model.intermediate_size=128", "model.layers=2",
       "model.heads=2", "model.kv_heads=1", "model.vocab_size=4096", "model.tie_embeddings=true"]


def toy_args(tmp_path, *argv):
    a = args("--rollout-batch", "16", "--group", "4", "--micro-batch", "8", "--new-tokens", "6", "--plan-steps", "2",
             "--run-steps", "3", "--warmup", "1", "--log-dir", str(tmp_path / "logs"), *argv)
    a.device = "cpu"
    return a


@pytest.mark.slow  # rlrun runs in child processes
def test_runs_and_plan_parts_run_rlrun_and_read_its_metrics_back(tmp_path):
    a = toy_args(tmp_path, "--variants", "packed", "--plan-points", "tiled-keep-lora")
    runs = {r["case"]: r for r in gpu_runs.runs_part(a, TOY)}
    assert list(runs) == ["always", "packed"] and not any("error" in r for r in runs.values())
    assert all(r["speed"] > 0 and r["mem_mib"] > 0 for r in runs.values())
    assert all(r["ok"] and r["grad_norm0_rel_diff"] <= gpu_runs.EXACT for c, r in runs.items() if c != "always")
    plan = gpu_runs.plan_part(a, TOY)
    assert [r["case"] for r in plan] == [f"tiled-keep-lora / {p}" for p in gpu_runs.PLAN_PHASES]
    assert all(r["plan_growth_mib"] > 0 and r["growth_mib"] >= 0 for r in plan)


@pytest.mark.slow  # bench generate in a child process, compiling the decode step's buckets
def test_decode_part_times_eager_compiled_and_the_bound_on_the_same_rollouts(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_runs, "vllm_available", lambda: False)
    a = toy_args(tmp_path, "--rollout-batch", "8", "--group", "4", "--new-tokens", "4", "--decode-rollouts", "1")
    rows = {r["case"]: r for r in gpu_runs.decode_part(a, TOY)}
    assert not any("error" in r for r in rows.values()), rows
    assert {"and each prompt prefilled once", "rollout.decode compiled", "GEMM bound: the matmuls alone"} <= set(rows)
    assert rows["rollout.decode compiled"]["ok"] and rows["and each prompt prefilled once"]["ok"]
    assert all(r["speed"] > 0 for r in rows.values())
    assert (tmp_path / "logs" / "decode.log").exists()


@pytest.mark.slow  # children
def test_a_failed_run_is_a_row_naming_its_log(tmp_path):
    a = toy_args(tmp_path)
    [row] = gpu_runs.runs_rows({"always": gpu_runs.launch(a, "runs-broken", [*TOY, "head=sparse"])}, 1)
    assert row["error"].startswith("exit code") or "head" in row["error"]
    assert str(tmp_path / "logs" / "runs-broken.log") in row["error"]
    assert (tmp_path / "logs" / "runs-broken.log").read_text()


@pytest.mark.slow  # children
def test_heads_part_runs_each_implementation_against_its_dtypes_reference(tmp_path):
    a = args("--tokens", "64", "--seqs", "4", "--hidden", "16", "--vocab", "512", "--tile-size", "16",
             "--impls", "dense,tiled", "--repeat", "1")
    a.device = "cpu"
    rows, _ = gpu_heads.run(a)
    assert [r["case"] for r in rows] == ["fp64 reference fp32", "dense fp32", "tiled fp32",
                                         "fp64 reference bf16", "dense bf16", "tiled bf16"]
    assert all(r["ok"] for r in rows if not r["case"].startswith("fp64")), rows
