"""rlrun.bench at the smallest sizes: its measurements, tables and MLflow run (never timings)."""

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import pairs_bound

from rlrun import axes, registry
from rlrun.config import validate
from rlrun.tools import bench, bench_heads

TINY = ["--hidden", "8", "--vocab", "64", "--tile-size", "8"]


@pytest.mark.slow  # a fresh process importing torch
def test_help_lists_both_benchmarks():
    r = subprocess.run([sys.executable, "-m", "rlrun.bench", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and all(name in r.stdout for name in ("heads", "dpo", "trl"))


def test_heads_table_and_mlflow_run(tmp_path):
    """The heads path in this process (children are what `heads` spawns): metered results -> rows -> table ->
    one MLflow run holding the table, the arguments and each number of each row."""
    from conftest import new_store

    uri = new_store(tmp_path)
    a = bench.parser().parse_args(["heads", "--tokens", "16", "--seqs", "2", "--impls", "dense,chunked",
                                   "--device", "cpu", "--tracking-uri", uri, *TINY])
    results = {}
    for name in ("dense", "chunked"):
        bench_heads.child(name, a, tmp_path / f"{name}.pt")
        results[name] = torch.load(tmp_path / f"{name}.pt")
    rows = bench_heads.heads_rows(["dense", "chunked"], results)
    for name, row in zip(("dense", "chunked"), rows):  # the child's metered seconds and bytes, in s and MiB
        assert row["impl"] == name and row["time_s"] == results[name]["time"] > 0
        assert isinstance(results[name]["peak"], int) and row["peak_extra_mib"] == results[name]["peak"] / 2**20
    assert rows[1]["err_loss"] < 1e-5 and rows[1]["err_grad_w"] < 1e-4  # chunked agrees with dense
    table = bench_heads.format_table(rows, a)
    assert table.splitlines()[2].startswith("dense") and table.splitlines()[3].startswith("chunked")
    bench.log_mlflow(a, rows, table, "heads")

    from rlrun.tracking import open_client

    client = open_client(uri)
    [run] = client.search_runs([client.get_experiment_by_name(bench.BENCH_EXPERIMENT).experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.runName"] == "bench-heads"
    assert run.data.params["tokens"] == "16" and run.data.metrics["time_s/chunked"] == rows[1]["time_s"]
    assert run.data.metrics["peak_extra_mib/dense"] == rows[0]["peak_extra_mib"]
    assert run.data.metrics["err_grad_w/chunked"] == rows[1]["err_grad_w"]
    assert {"heads.txt", "config.yaml"} <= {f.path for f in client.list_artifacts(run.info.run_id)}


def test_dpo_table_names_the_longest_length_within_budget():
    a = bench.parser().parse_args(["dpo", "--pairs", "1", "--budget-mib", "10", *TINY])
    rows = [{"impl": "dense", "length": 8, "time_s": 0.1, "peak_extra_mib": 4.0},
            {"impl": "dense", "length": 16, "time_s": 0.2, "peak_extra_mib": 20.0},
            {"impl": "chunked", "length": 8, "error": "exit code -9"}]
    lines = bench.dpo_table(rows, ["dense", "chunked"], a).splitlines()
    assert lines[-2:] == ["longest response length within 10.0 MiB, dense: 8",
                          "longest response length within 10.0 MiB, chunked: none"]
    assert lines[4].split()[-1] == "-9"


@pytest.mark.slow
def test_dpo_child_meters_one_step(tmp_path):
    # dense at length 64, vocab 20000: each of the 2 x 64 response tokens' logits rows is 80 kB in fp32, so one
    # [tokens, vocab] tensor is 10 MB, and the step holds several (logits, log-softmax, their gradients)
    a = bench.parser().parse_args(["dpo", "--device", "cpu", "--hidden", "8", "--vocab", "20000", "--tile-size", "8"])
    bench.dpo_child("dense", 64, a, tmp_path / "r.pt")
    r = torch.load(tmp_path / "r.pt")
    assert r["time"] > 0 and r["loss"] == pytest.approx(0.6931, abs=0.05)  # -log sigmoid(~0)
    assert r["peak"] >= 2 * 64 * 20000 * 4, r["peak"]  # bytes: the peak saw at least one full logits tensor


@pytest.mark.slow
def test_heads_end_to_end_in_child_processes(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rlrun.bench", "heads", "--tokens", "16", "--seqs", "2",
                        "--impls", "dense,tiled", "--device", "cpu", "--tracking-uri", "none", *TINY],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [line.split()[0] for line in r.stdout.splitlines()[2:4]] == ["dense", "tiled"]


def trl_args(*extra):
    return bench.parser().parse_args(["trl", "--tracking-uri", "none", "--figure", "", *extra])


def fake_run(step_s, reward, length=2.0, rss=2**30, phases=None):
    return {"step_s": step_s, "reward": reward, "length": [length] * len(reward), "rss": rss, "phases": phases or {}}


def test_trl_table_from_measured_runs():
    """Rounds -> rows: each round's median step after the warm-up, medians over rounds, the mean reward over seeds
    of the last steps, and the speed ratio in the table."""
    from rlrun.tools import bench_trl

    a = trl_args("--rounds", "2", "--warmup", "1", "--last", "2")
    rounds = [{"rlrun": fake_run([9.0, 0.1, 0.1, 0.3], [0.1, 0.5, 0.7, 0.9], phases={"generate": [9, 0.03, 0.03]}),
               "trl": fake_run([9.0, 0.2, 0.2, 0.2], [0.1, 0.4, 0.8, 0.8])},
              {"rlrun": fake_run([9.0, 0.1, 0.1, 0.1], [0.2, 0.6, 0.6, 0.8]),
               "trl": fake_run([9.0, 0.25, 0.25, 0.25], [0.2, 0.5, 0.7, 0.9])}]
    rows = {r["impl"]: r for r in bench_trl.summarize(rounds, a.warmup, a.last)}
    assert rows["rlrun"]["rounds_steps_per_s"] == [10.0, 10.0]  # the slow first step is left out
    assert rows["trl"]["steps_per_s"] == (5.0 + 4.0) / 2
    assert rows["trl"]["reward_curve"] == pytest.approx([0.15, 0.45, 0.75, 0.85], abs=1e-12)
    assert rows["rlrun"]["reward_last"] == pytest.approx(((0.7 + 0.9) / 2 + (0.6 + 0.8) / 2) / 2, abs=1e-12)
    assert rows["trl"]["reward_mean"] == pytest.approx((0.15 + 0.45 + 0.75 + 0.85) / 4, abs=1e-12)
    assert rows["rlrun"]["tokens_per_s"] == 2.0 * 128 * 10.0 and rows["rlrun"]["peak_rss_mib"] == 1024
    text = bench_trl.table(list(rows.values()), a)
    assert "rlrun / trl steps/s: 2.22x" in text and "rlrun phases (median ms per step): generate 30" in text


@pytest.mark.slow
def test_rlrun_learns_like_trl_on_the_same_work():
    """Learning parity with TRL's GRPOTrainer (issue 17): 3 seeds x 50 steps of the same workload; the mean reward
    over the seeds and steps agrees within 0.02. Skipped without TRL (pip install -e '.[bench]'). Two runs at a
    time: only the rewards matter here, not the speed."""
    pytest.importorskip("trl", reason="TRL is not installed: pip install -e '.[bench]'")
    a = trl_args("--steps", "50", "--rounds", "3", "--jobs", "2")
    rows = {r["impl"]: r for r in a.func(a)}
    assert abs(rows["rlrun"]["reward_mean"] - rows["trl"]["reward_mean"]) <= 0.02, rows
    for r in rows.values():  # both learned: the curve rose from the warm start
        assert r["reward_last"] > r["reward_curve"][0] + 0.1


def test_plan_table_and_figure_from_measured_runs(tmp_path):
    from rlrun.tools import bench_plan

    grid = [dict(head="tiled", vocab=65536, tokens=512, lora=False), dict(head="dense", vocab=16384, tokens=2048,
                                                                          lora=True), dict(head="chunked", vocab=1024,
                                                                                           tokens=512, lora=False),
            dict(head="chunked", vocab=32000, hidden=256, layers=8, precision="bf16")]
    results = [{"train": (68.0, 78.0), "old_logprobs": (34.0, 36.0), "generate": (10.0, 300.0)},
               {"train": (400.0, 520.0)},  # 23% and 120 MiB under: missed
               {"error": "exit code 1"}, {"train": (300.0, 330.0)}]
    rows = bench_plan.rows_of(grid, results)
    text = bench_plan.table(rows)
    assert "tiled-v65536-n512" in text and "dense-v16384-n2048-lora" in text and "MISSED" in text
    assert "chunked-v1024-n512" in text and "failed: exit code 1" in text and "chunked-h256-L8-bf16" in text
    assert "(not a target)" in text  # generate is reported, not judged
    assert text.splitlines()[-1] == "3 of 4 train / logprob phases within 15% or 32 MiB"
    shape = bench_plan.overrides(grid[3], 3, "sqlite:///x.db")
    assert {"model.hidden_size=256", "model.layers=8", "train.precision=bf16", "train.micro_batch=32"} <= set(shape)
    autos = [{"impl": "auto-tiled-trained-head", "budget_mib": 24.0, "size": 80, "measured_mib": 22.8, "ok": True},
             {"impl": "auto-chunked-frozen-head", "budget_mib": 24.0, "size": 144, "measured_mib": 25.1, "ok": False}]
    auto = bench_plan.auto_table(autos)
    assert "auto-tiled-trained-head" in auto and "OVER" in auto and "22.8" in auto
    path = bench_plan.figure(rows, str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").stat().st_size > 10_000 and path.endswith("plan.png")


def test_plan_bench_checks_combinations_an_all_pairs_array_of_the_options_that_change_the_plan():
    from rlrun.tools import bench_plan

    points, axes = bench_plan.pair_points(), bench_plan.pair_axes()
    for a in axes:  # every pair of options of two axes is a point
        for b in axes:
            if a < b:
                assert {(p[a], p[b]) for p in points} == {(x, y) for x in axes[a] for y in axes[b]}, (a, b)
    labels = {bench_plan.label(p) for p in points}
    assert len(points) <= pairs_bound(map(len, axes.values())) and len(labels) == len(points)
    assert all(re.fullmatch(r"[\w\-. :/]+", label) for label in labels)  # MLflow metric names (its rows are logged)
    lora = next(p for p in points if p["lora"] and p["activations"] == "checkpoint")
    shape = bench_plan.overrides(lora, 3, "sqlite:///x.db")
    assert {"model.lora.enabled=true", "activations=checkpoint", f"train.micro_batch={lora['micro']}",
            f"batching={lora['batching']}", f"train.precision={lora['precision']}"} <= set(shape)
    results = [{"train": (100.0, 101.0)}, {"train": (100.0, 150.0)}]
    text = bench_plan.table(bench_plan.rows_of(points[:2], results))
    assert "combinations (all-pairs covering array): 1 of 2 phases within the target" in text


def test_pipeline_bench_rotates_the_order_and_compares_with_sync(tmp_path):
    """The pipeline bench's logic on made-up runs: every round runs every mode, no mode always first; steps/s is
    the median step of each round, then the median over rounds; accuracy per seed; the ratio to sync's."""
    from rlrun.tools import bench_pipeline

    a = bench.parser().parse_args(["pipeline", "--modes", "sync,async_k1", "--rounds", "3", "--steps", "4",
                                   "--tracking-uri", "none"])
    order = []

    def fake(mode, seed, args):
        order.append((seed, mode))
        step = 0.10 if mode == "sync" else 0.05 + 0.01 * seed
        return {"step_s": [step, step, 9.0], "accuracy": [0.0, 0.5 + 0.1 * seed], "wait_s": 0.001,
                "gen_busy_s": 0.04 if mode != "sync" else 0.0, "gen_idle_s": 0.0, "staleness": 1.0}

    rows = bench_pipeline.summarize(bench_pipeline.rounds(a, run=fake), a.modes)
    assert [m for s, m in order if s == 0][0] == "sync" and [m for s, m in order if s == 1][0] == "async_k1"
    sync, asyn = rows
    assert sync["steps_per_s"] == pytest.approx(10.0) and asyn["rounds_steps_per_s"] == pytest.approx([20, 1 / .06,
                                                                                                        1 / .07])
    assert asyn["speedup"] == pytest.approx((1 / 0.06) / 10.0)  # the median round's
    assert asyn["seeds_accuracy_end"] == pytest.approx([0.5, 0.6, 0.7]) and asyn["accuracy_vs_sync"] == 0.0
    text = bench_pipeline.table(rows, a)
    assert "async_k1" in text and "1.67x" in text


def test_skip_bench_pairs_each_seed_and_compares_the_loss_while_the_samples_agree():
    """The skip bench's logic on made-up runs: steps/s per round and over rounds, the ratio to `off`, the share of
    rows dropped, and the gradient norm's relative difference over the steps where both runs drew the same rewards
    and lengths (not after they part)."""
    from rlrun.tools import bench_skip

    a = bench.parser().parse_args(["skip", "--rounds", "2", "--steps", "4", "--tracking-uri", "none"])

    def fake(mode, seed, args):
        on = mode == "on"
        step = 0.09 if on else 0.1
        return {"step_s": [step, step, 9.0], "grad_norm": [1.0, 2.0 + 2e-7 * on, 3.0 + on, 4.0],
                "reward": [0.5, 0.6, 0.7 + 0.1 * on * (seed + 1), 0.8], "lengths": [3.0, 3.0, 3.0, 3.0 + on],
                "train_s": [0.05 if on else 0.08], "positions": [600.0 if on else 1000.0],
                "old_s": [], "skipped": [0.5, 0.7] if on else []}

    a.modes = list(bench_skip.MODES)
    off, on = bench_skip.summarize(bench_skip.rounds(a, run=fake))
    assert off["steps_per_s"] == pytest.approx(10.0)
    assert on["rounds_steps_per_s"] == pytest.approx([1 / .09] * 2)
    assert on["speedup"] == pytest.approx((1 / 0.09) / 10.0) and on["skipped_frac"] == pytest.approx(0.6)
    assert on["same_steps"] == 2 and on["grad_norm_diff_max"] == pytest.approx(1e-7)  # step 2's: after they part
    assert on["grad_norm_diff"] == pytest.approx(0.5e-7)  # the median of 0 and 1e-7
    text = bench_skip.table([off, on], a)
    assert "1.11x" in text and "(default run)" in text and "load average" in text and " 600 " in text


def test_batching_bench_agrees_with_padded_and_prints_the_ranks_loads(tmp_path):
    """`python -m rlrun.bench batching` at the smallest size, its children run here: packed and shared_prompt
    compute fewer positions than padded, and the same loss and gradients; the table and the ranks' load line."""
    from rlrun.tools import bench_batching

    a = bench.parser().parse_args(["batching", "--prompts", "4", "--group", "4", "--prompt-median", "8",
                                   "--response-median", "6", "--prompt-cap", "24", "--response-cap", "24",
                                   "--micro-batch", "4", "--hidden", "32", "--layers", "1", "--vocab", "64",
                                   "--repeat", "1", "--max-tokens", "128", "--tracking-uri", "none"])
    results = {}
    for option in bench_batching.OPTIONS:
        bench_batching.child(option, a, str(tmp_path / f"{option}.pt"))
        results[option] = torch.load(tmp_path / f"{option}.pt")
    rows = {r["impl"]: r for r in bench_batching.rows_of(results)}
    assert rows["padded"]["padding_frac"] > 0.3 and rows["padded"]["train_speedup"] == 1.0
    for option in ("packed", "shared_prompt"):
        assert rows[option]["positions"] < rows["padded"]["positions"]
        assert rows[option]["loss_rel_diff"] < 1e-5 and rows[option]["grad_max_rel_diff"] < 1e-4
    assert rows["shared_prompt"]["positions"] < rows["packed"]["positions"]
    text = bench_batching.table(list(rows.values()), a, bench_batching.describe(a))
    assert [line.split()[0] for line in text.splitlines()[-len(rows):]] == list(bench_batching.OPTIONS)
    assert bench_batching.rank_loads(a).startswith("ranks' token loads") and "2 ranks packed" in \
        bench_batching.rank_loads(a)


def test_generate_bench_draws_the_same_tokens_and_computes_fewer_rows(tmp_path, monkeypatch):
    """`bench generate` on small rollouts of the default work (its warm start is cached by other tests): the three
    modes draw the same tokens; with ended rows leaving the batch the model computes fewer rows, and with each
    prompt prefilled once the prompt pass has one row per prompt (counts, not times); the speculation rows draw the
    same tokens too, with their acceptance and tokens per verify pass (the compiled one is left out here: its
    compiles take a minute; tests/unit/rollout/test_speculate.py certifies that path)."""
    from rlrun.tools import bench_generate

    monkeypatch.setattr(bench_generate, "MODES", {m: kw for m, kw in bench_generate.MODES.items()
                                                  if not ("speculate" in kw and "decode" in kw)})

    a = argparse.Namespace(rollouts=2, seed=0, threads=1, tracking_uri=f"sqlite:///{tmp_path}/b.db",
                           rlrun_args=["train.rollout_batch=32", "train.group_size=8",
                                       "train.batch_size=32", "train.micro_batch=32"])
    logged = []
    from rlrun.tools.bench import log_mlflow

    def log(*args):  # kept, and logged as the command logs it (every row's name must be a valid metric name)
        logged.append(args[1:])
        log_mlflow(*args)

    rows = {r["impl"]: r for r in bench_generate.bench(a, log)}
    every, leave, once = rows["every row to the end"], rows["ended rows leave"], rows["and each prompt prefilled once"]
    compiled, bound = rows["rollout.decode compiled"], rows["GEMM bound: the matmuls alone"]
    for name in ("speculate prompt", "speculate history"):
        spec = rows[name]
        assert spec["same_tokens"] and 0 <= spec["logprob_diff"] < 1e-4 and spec["per_pass"] >= 1.0
        assert 0 <= spec["acceptance"] <= 1 and spec["x_plain"] > 0
    assert once["acceptance"] is None and "tokens / verify pass" in logged[0][1]
    assert every["same_tokens"] and leave["same_tokens"] and once["same_tokens"] and logged[0][2] == "generate"
    assert leave["length_mean"] == every["length_mean"] and leave["longest_mean"] == every["longest_mean"]
    # every row to the end: rows x (longest - 1) after the prompt pass; leaving: fewer, at least the tokens past 1
    assert every["rows_computed"] == 32 * (every["longest_mean"] - 1)
    assert 32 * (leave["length_mean"] - 1) <= leave["rows_computed"] < every["rows_computed"]
    assert once["rows_computed"] == leave["rows_computed"]
    # the prompt pass: every row, or each of the 4 prompts once (8 completions each)
    assert every["prefill_rows"] == leave["prefill_rows"] == 32 and once["prefill_rows"] == 4
    assert "ended rows leave" in logged[0][1] and "prefilled once" in logged[0][1] and "same tokens" in logged[0][1]
    # rollout.decode=compiled: the same tokens, its logprobs within fp32 tolerance of eager's; its compiles reported
    assert compiled["same_tokens"] and 0 <= compiled["logprob_diff"] < 1e-4 and compiled["rows_computed"] is None
    # the bound: timed at the forwards rlrun's eager decode ran (its ratios are times: printed, not asserted)
    assert bound["rows_computed"] == once["rows_computed"] and bound["of_bound"] == 1.0 and bound["tokens_per_s"] > 0
    assert "GEMM bound" in logged[0][1] and "x of the bound" in logged[0][1]


def test_trl_bench_varied_lengths_gives_both_the_same_work_and_rlrun_its_best_exact_settings():
    """--task varied_lengths: rlrun's run is the variable-length work (its experiment, 40 new tokens) with
    batching=shared_prompt; rlrun_async adds the async pipeline only; an unknown impl is refused by name."""
    from rlrun.tools import bench_trl

    args = bench_trl.rlrun_overrides("/m", 5, 0, "sqlite:///x.db", [], "varied_lengths", "rlrun")
    assert args[0] == "experiment=varied_lengths" and "rollout.max_new_tokens=40" in args
    assert "batching=shared_prompt" in args and not any("pipeline" in x for x in args)
    cfg = bench_trl.compose(args)
    assert cfg.task.max_terms == 12 and cfg.batching.name == "shared_prompt" and cfg.rollout.max_new_tokens == 40
    assert axes.trains_same("batching", registry.option_of(validate(cfg), "batching"))  # the baseline's numbers
    run_async = bench_trl.rlrun_overrides("/m", 5, 0, "sqlite:///x.db", [], "varied_lengths", "rlrun_async")
    assert set(run_async) - set(args) == {"rollout.pipeline=async", "rollout.max_staleness=1"}
    assert "rollout.max_new_tokens=4" in bench_trl.rlrun_overrides("/m", 5, 0, "sqlite:///x.db", [], "default", "rlrun")
    with pytest.raises(SystemExit, match="unknown --impls trl_fast; choose from rlrun,rlrun_async,trl,trl_cb"):
        bench_trl.bench(trl_args("--impls", "rlrun,trl_fast"), lambda *a, **k: None)


def test_replay_bench_compares_each_round_with_its_generating_sweep(tmp_path):
    """The replay bench's logic on made-up sweeps: the ratio is taken within a round (paired), its range shown,
    beside the round's ratio at best (the generating sweep less its later jobs' generation); the jobs that generated
    and the first and other jobs' seconds; each mode's command sweeps the same option, the paired one with
    report.replay=true, in a folder and store of its own."""
    from rlrun.tools import bench_replay

    a = bench.parser().parse_args(["replay", "--rounds", "2", "--tracking-uri", "none"])

    def fake(mode, seed, args):
        paired = mode == "paired"
        jobs = [{"seconds": 50.0, "generated": True, "generate_s": 30.0}] + [
            {"seconds": 15.0 if paired else 50.0, "generated": not paired, "generate_s": 0.0 if paired else 30.0}] * 2
        # round 0: 100 s of 200 (0.5x); round 1 slower throughout: 140 s of 200 (0.7x)
        return {"wall_s": (100.0 + 40.0 * seed if paired else 200.0) * (1 + seed), "jobs": jobs}

    generating, paired = bench_replay.bench(a, lambda *x: None, run=fake)
    # each round's ratio, then their median: not the ratio of the medians (220 / 300)
    assert (paired["ratio_min"], paired["ratio_max"], paired["ratio"]) == pytest.approx((0.5, 0.7, 0.6))
    assert paired["wall_s"] == pytest.approx(190.0) and generating["ratio"] == 1.0
    assert (paired["generated"], paired["jobs"], generating["generated"]) == (1.0, 3.0, 3.0)
    assert paired["first_job_s"] == 50.0 and paired["other_jobs_s"] == 15.0
    # at best: round 0 (200 - 2 x 30) / 200, round 1 (400 - 60) / 400
    assert (paired["at_best_min"], paired["at_best_max"], paired["at_best"]) == pytest.approx((0.7, 0.85, 0.775))
    assert generating["at_best"] == 1.0 and generating["generate_s"] == 30.0
    cores = os.cpu_count() or 1
    text = bench_replay.table([generating, paired], a, (cores * 2.0, 0.0))
    assert "0.60x [0.50, 0.70]" in text and "0.77x [0.70, 0.85]" in text and "1 of 3" in text and "LOADED" in text
    assert "LOADED" not in bench_replay.table([generating, paired], a, (0.0, cores * 2.0))  # the end's: its own
    args = bench_replay.arguments("paired", 1, a, str(tmp_path))
    assert args[:2] == ["-m", "head=dense,tiled,chunked"] and "report.replay=true" in args and "seed=1" in args
    assert f"hydra.sweep.dir={tmp_path}/sweep" in args and "report.replay=true" not in bench_replay.arguments(
        "generating", 1, a, str(tmp_path))


def test_replay_bench_reads_the_sweeps_jobs_from_its_store(tmp_path):
    """Jobs in the order they ran, the parent left out; a job generated when it logged a generate phase."""
    from rlrun.tools import bench_replay
    from rlrun.tracking import metric_key, open_client

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = open_client(uri)
    exp = client.create_experiment("rlrun")
    parent = client.create_run(exp, start_time=1000, tags={"rlrun.kind": "sweep"})
    for start, generated in ((2000, True), (5000, False)):
        run = client.create_run(exp, start_time=start)
        if generated:  # two steps' generate phases: the job's is their sum
            client.log_metric(run.info.run_id, metric_key("time/generate_s"), 0.5, step=0)
            client.log_metric(run.info.run_id, metric_key("time/generate_s"), 0.25, step=1)
        client.set_terminated(run.info.run_id, end_time=start + 1500)
    client.set_terminated(parent.info.run_id, end_time=9000)
    assert bench_replay.jobs_of(uri) == [{"seconds": 1.5, "generated": True, "generate_s": 0.75},
                                         {"seconds": 1.5, "generated": False, "generate_s": 0.0}]


def test_check_bench_covers_every_pair_and_names_what_failed():
    """`bench check`: the exact axes' covering array from the registry, its rows' overrides on the model's
    experiment, a table that names each failed probe and counts the configurations passing every probe."""
    from rlrun import pairs
    from rlrun.tools import bench_check

    configs = bench_check.configurations()
    assert configs == pairs.all_pairs(pairs.exact_axes()) and len(configs) >= 9
    ok = {"probes": {"vs baseline": (True, "1e-8"), "no full logits": (None, "-")}, "seconds": 3.0}
    bad = {"probes": {"vs baseline": (False, "1e-1"), "accumulation": (True, "0")}, "seconds": 4.0}
    text = bench_check.table(configs[:3], [ok, bad, {"error": "RuntimeError: boom"}])
    assert "1 of 1" in text and "1 of 2" in text and "vs baseline" in text and "error: RuntimeError: boom" in text
    assert text.endswith("1 of 3 configurations pass every probe")
    a = bench.parser().parse_args(["check", "--model", "smollm2", "--tracking-uri", "none"])
    assert bench_check.MODELS[a.model] == ["experiment=smollm2"]


def test_check_bench_logs_every_configuration_and_probe_to_mlflow(tmp_path, monkeypatch):
    """The covering array on SmolLM2 (33 minutes) ended in an MlflowException: its metrics were named by the
    configuration's overrides (`failed/head=dense ...`), and `=` is no character of an MLflow name, so nothing of
    the run was kept. Each configuration's failures and each probe's verdict are metrics, the table and what every
    probe measured the run's text; the run is FINISHED, and the command still exits 1 for a failed probe."""
    import mlflow

    from rlrun import render
    from rlrun.tools import bench_check

    configs = bench_check.configurations()[:2]
    results = iter([{"probes": {"vs baseline": (True, "loss 1e-8"), "no full logits": (None, "-")}, "seconds": 3.0},
                    {"probes": {"vs baseline": (False, "loss 1e-1"), "ranks": (True, "0")}, "seconds": 4.0}])
    monkeypatch.setattr(bench_check, "configurations", lambda: configs)
    monkeypatch.setattr(render, "in_child", lambda *a, **k: next(results))
    uri = f"sqlite:///{tmp_path}/m.db"
    a = bench.parser().parse_args(["check", "--tracking-uri", uri])
    with pytest.raises(SystemExit) as stop:
        a.func(a)
    assert stop.value.code == 1
    client = mlflow.tracking.MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name(bench.BENCH_EXPERIMENT).experiment_id])[0]
    assert run.info.status == "FINISHED"
    names = [" ".join(f"{k}:{v}" for k, v in c.items()) for c in configs]
    m = run.data.metrics
    assert m[f"failed/{names[0]}"] == 0.0 and m[f"failed/{names[1]}"] == 1.0
    assert m[f"pass/vs baseline/{names[0]}"] == 1.0 and m[f"pass/vs baseline/{names[1]}"] == 0.0
    assert f"pass/no full logits/{names[0]}" not in m  # n/a: no verdict
    text = open(client.download_artifacts(run.info.run_id, "check-tiny.txt", str(tmp_path))).read()
    assert "1 of 2 configurations pass every probe" in text and "FAIL  vs baseline: loss 1e-1" in text


@pytest.mark.slow  # one configuration's check in a child process (~10 s)
def test_check_bench_child_runs_rlrun_check_on_a_configuration():
    from rlrun import render
    from rlrun.tools import bench_check

    row = bench_check.configurations()[1]
    res = render.in_child(bench_check.child, ["experiment=smoke", *(f"{k}={v}" for k, v in row.items())], 1)
    bad = render.in_child(bench_check.child, ["experiment=smoke", "train.micro_batch=3"], 1)
    assert bad["error"].startswith("ConfigError: ") and "train.micro_batch=3" in bad["error"]
    assert "error" not in res, res
    assert res["probes"]["vs baseline"][0] is True and all(ok is not False for ok, _ in res["probes"].values())


def test_trl_bench_on_a_real_model_runs_its_experiment_for_both():
    """--model smollm2: rlrun runs experiment=smollm2 as it is; TRL gets the same sizes, sampling and LoRA, read
    from that config (one source for both)."""
    from rlrun.tools import bench_trl

    args = bench_trl.rlrun_overrides("/m", 5, 1, "sqlite:///x.db", [], "default", "rlrun_async", "smollm2")
    assert args[0] == "experiment=smollm2" and "seed=1" in args and "rollout.pipeline=async" in args
    assert not any(a.startswith(("model.path", "train.lr", "train.micro_batch")) for a in args)
    cfg = bench_trl.work("default", 0, "smollm2")
    size = bench_trl.sizes(cfg, "smollm2")
    t = cfg.train
    assert size == dict(prompts=t.rollout_batch // t.group_size, group=t.group_size, micro=t.micro_batch, lr=t.lr,
                        temperature=cfg.rollout.temperature, new_tokens=cfg.rollout.max_new_tokens,
                        lora=(cfg.model.lora.rank, cfg.model.lora.alpha))
    assert cfg.model.name == "smollm2" and cfg.task.name == "word_problems"
    lora = bench_trl.lora_config(cfg)
    assert lora.r == cfg.model.lora.rank and lora.target_modules == "all-linear"


@pytest.mark.slow  # a warm start of its own (2 query heads on 1 KV head) and the compiled decode's buckets
def test_generate_bench_reads_grouped_kv_heads_in_place_for_a_model_that_groups_them(tmp_path):
    """A model whose query heads share KV heads gets a row of its own: the same tokens as the rows before it (which
    copy each KV head per group, as transformers' attention does) at the same rows computed."""
    from rlrun.tools import bench_generate

    a = argparse.Namespace(rollouts=1, seed=0, threads=1, tracking_uri="none", vllm=False,
                           rlrun_args=["model.heads=2", "model.kv_heads=1", "train.rollout_batch=16",
                                       "train.group_size=4", "train.batch_size=16", "train.micro_batch=16"])
    rows = bench_generate.bench(a, lambda *args: None)
    by = {r["impl"]: r for r in rows}
    assert list(by) == [*bench_generate.MODES, "GEMM bound: the matmuls alone"]
    grouped, once = by[bench_generate.GROUPED], by["and each prompt prefilled once"]
    assert grouped["same_tokens"] and grouped["rows_computed"] == once["rows_computed"]
    assert by["rollout.decode compiled"]["same_tokens"]
