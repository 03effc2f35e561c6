"""Fast checks of what the user reads: the end-of-run table, where the results are, progress lines in a log file,
and the MLflow tags and description every run carries (sqlite store, no training)."""

import io
import os
import re
import sys

from conftest import new_store
from omegaconf import OmegaConf

from rlrun import runner, sweep, tracking

GRPO = {"reward_first": 0.1, "reward_last": 0.45, "eval_accuracy_first": 0.05, "eval_accuracy_last": 0.3,
        "step_s": 0.123, "gen_tokens_per_s": 1234.0, "train_tokens_per_s": 5678.0, "loss_last": 0.01,
        "max_generate_peak_mib": 512.0, "max_train_peak_mib": 900.0, "max_train_growth_mib": 30.0,
        "passes_ref_run": 3.0, "load_1m": 9.26}
DPO = {"accuracy_first": 0.5, "accuracy_last": 0.9, "step_s": 0.2, "train_tokens_per_s": 100.0,
       "max_train_peak_mib": 700.0, "max_ref_logprobs_peak_mib": float("nan")}


def test_end_table_is_short_aligned_and_names_its_numbers():
    text = runner.end_table(GRPO, steps=12)
    lines = text.splitlines()
    assert lines[0] == "rlrun: run finished (12 steps)"
    assert "reward (mean of first / last 3 steps)" in text and "0.100 → 0.450" in text
    assert "eval accuracy (first / last evaluation)" in text and "0.050 → 0.300" in text
    assert "0.123 s" in text and "1234 generated, 5678 trained" in text
    assert "generate 512  train 900" in text and "growth" not in text
    assert "machine load (1-min average, mean)" in text and f"9.3 on {os.cpu_count()} cores" in text  # busy or not
    starts = {re.match(r"^  (.+?)\s{2,}\S", line).end() for line in lines[1:]}
    assert len(starts) == 1  # the values start in one column
    dpo = runner.end_table(DPO)
    assert "reward accuracy (mean of first / last 3 steps)" in dpo and "0.500 → 0.900" in dpo
    assert "nan" not in dpo and "ref_logprobs –" in dpo and "generated" not in dpo


def test_results_hint_gives_the_command_or_the_url(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create({"tracking": {"name": "mlflow", "uri": "sqlite:///mlflow.db"}})
    tracker = tracking.MLflow(OmegaConf.create({"uri": "sqlite:///mlflow.db", "experiment": "rlrun",
                                                "parent_run_id": None}), {}, "x")
    hint = runner.results_hint(cfg, tracker)
    assert f"mlflow ui --port 5000 --backend-store-uri sqlite:///{tmp_path}/mlflow.db" in hint
    assert "http://127.0.0.1:5000/#/experiments/" in hint
    other = OmegaConf.create({"tracking": {"name": "mlflow", "uri": "sqlite:///mlflow.db", "ui_port": 5055}})
    hint = runner.results_hint(other, tracker)  # tracking.ui_port: the command and the links on that port
    assert "mlflow ui --port 5055 --backend-store-uri" in hint and "http://127.0.0.1:5055/#/experiments/" in hint
    assert "127.0.0.1:5000" not in hint
    assert "mlflow ui --port 5055 " in sweep.links("sqlite:///mlflow.db", "1", "abc", 5055)
    assert f"/runs/{tracker.run_id}?workflowType=machine_learning" in hint  # opens on model training
    server = OmegaConf.create({"tracking": {"name": "mlflow", "uri": "http://127.0.0.1:5000"}})
    assert "http://127.0.0.1:5000/#/experiments/" in runner.results_hint(server, tracker)
    none = OmegaConf.create({"tracking": {"name": "none"}})
    assert "mlflow ui" not in runner.results_hint(none, tracking.Null())


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_not_on_a_terminal_progress_writes_a_line_every_n_steps(monkeypatch):
    out = io.StringIO()
    bar = runner.PlainProgress(0, 400, "rlrun grpo", out=out)
    for step in bar:
        bar.set_postfix(reward=f"{step / 400:.3f}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 40 and lines[-1].startswith("rlrun grpo: step 400/400") and "reward=0.998" in lines[-1]
    assert all(re.search(r"steps/s, ~\d+ s left\)", line) for line in lines[:-1]) and "left" not in lines[-1]
    out = io.StringIO()
    assert list(runner.PlainProgress(5, 8, "x", out=out)) == [5, 6, 7] and out.getvalue().count("\n") == 3
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file: plain lines
    assert isinstance(runner.progress(0, 3, "x", enabled=True), runner.PlainProgress)
    monkeypatch.setattr(sys, "stderr", Terminal())  # a terminal: tqdm's bar
    bar = runner.progress(0, 3, "x", enabled=True)
    assert not isinstance(bar, runner.PlainProgress) and list(bar) == [0, 1, 2] and "3/3" in sys.stderr.getvalue()


def test_a_run_starts_by_saying_what_runs_and_where_its_results_go(tmp_path, monkeypatch):
    """The header: the objective, model and task, the steps and device, the axes away from their baseline (the rest
    in three words), then the MLflow run and the output folder; a sweep job's: its first line only."""
    from conftest import make_cfg

    from rlrun.config import validate

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine: no load line (below)
    cfg = validate(make_cfg("head=chunked", "train.steps=7", tmp_path=tmp_path))
    tracker = tracking.MLflow(cfg.tracking, {}, "x")
    lines = runner.header(cfg, tracker).splitlines()
    assert lines[0] == ("rlrun: loss=dapo model=tiny task=arith, 7 steps on auto; head=chunked logprob_policy=window, "
                        "other axes at their baselines")
    assert lines[1].startswith("  logging: mlflow ui --port 5000") and f"/runs/{tracker.run_id}?" in lines[2]
    cfg.tracking.parent_run_id = "abc"  # a sweep job: one line, the sweep prints the links
    assert runner.header(cfg, tracker) == lines[0]


def test_the_header_names_a_busy_machine_and_says_nothing_on_an_idle_one(monkeypatch):
    from rlrun.runner import console

    monkeypatch.setattr(console.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(console.os, "getloadavg", lambda: (0.4, 0.4, 0.4))
    assert console.load_note() == ""
    monkeypatch.setattr(console.os, "getloadavg", lambda: (9.5, 9.0, 8.0))
    assert console.load_note() == ("\n  machine: load 9.5 on 2 cores as the run starts (other work): its steps run "
                                   "slower than on an idle machine, and its times say so at the end")


def test_runs_carry_source_tags_and_a_description(tmp_path):
    cfg = OmegaConf.create({"uri": new_store(tmp_path), "experiment": "rlrun", "parent_run_id": None})
    config = {"loss": {"name": "dpo"}, "head": {"name": "chunked"}, "logprob_policy": {"name": "window"},
              "offload": {"name": "on"}, "rollout": {"name": "hf"}, "engine": {"name": "single"},
              "model": {"name": "tiny"}, "task": {"name": "jsonl"}, "train": {"steps": 7}}
    tracker = tracking.MLflow(cfg, config, "loss=dpo")
    tracker.describe(tracking.headline(DPO))
    tracker.finish("FINISHED")
    client = tracking.open_client(cfg.uri)
    run = client.get_run(tracker.run_id)
    tags = run.data.tags
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.source.name"] and tags["rlrun.command"]
    assert tags["rlrun.version"] and tags["rlrun.host"] and tags["mlflow.user"]
    assert ("mlflow.source.git.commit" in tags) == (tracking.git_commit() is not None)
    note = tags["mlflow.note.content"]
    assert note.startswith("DPO with the chunked head, logprob policy window, optimizer offload on")
    assert "model tiny, task jsonl, 7 steps." in note
    assert "Accuracy 0.5 → 0.9" in note and "100 trained tokens/s" in note and "nan" not in note


def test_an_experiment_that_already_says_its_kind_keeps_it(tmp_path):
    client = tracking.open_client(new_store(tmp_path))
    exp = client.create_experiment("genai", tags={"mlflow.experimentKind": "genai_development"})
    tracking.mark_experiment_kind(client, exp)
    assert client.get_experiment(exp).tags["mlflow.experimentKind"] == "genai_development"
    other = client.create_experiment("plain")
    tracking.mark_experiment_kind(client, other)
    assert client.get_experiment(other).tags["mlflow.experimentKind"] == "custom_model_development"


def test_git_commit_is_none_outside_a_checkout(tmp_path):
    assert tracking.git_commit(str(tmp_path)) is None


def test_a_resumed_run_keeps_its_description_and_replaces_the_result(tmp_path):
    cfg = OmegaConf.create({"uri": new_store(tmp_path), "experiment": "rlrun", "parent_run_id": None})
    first = tracking.MLflow(cfg, {"loss": {"name": "dapo"}, "train": {"steps": 4}}, "x")
    first.describe(tracking.headline({"reward_first": 0.1, "reward_last": 0.2}))
    first.flush()  # writes go through a background sender; the first process ends before the resume starts
    again = tracking.MLflow(cfg, {}, None, resume_run_id=first.run_id)
    again.describe(tracking.headline({"reward_first": 0.1, "reward_last": 0.3}))
    again.flush()
    note = tracking.open_client(cfg.uri).get_run(first.run_id).data.tags["mlflow.note.content"]
    assert note.startswith("GRPO-family RL (dapo loss)") and note.count("Result:") == 1 and "0.1 → 0.3" in note
