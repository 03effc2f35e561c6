"""What a run leaves behind: held-out eval metrics, samples tables and the exported model in MLflow; an export
that trains on through `model=hf`; `resume=<MLflow run id>`."""

from __future__ import annotations

import pytest
from helpers import history, runs

from rlrun.cli import run

pytestmark = pytest.mark.slow


def test_eval_samples_and_export_land_in_mlflow_and_the_export_trains_on(tmp_path, cfg_factory):
    export = tmp_path / "model"
    cfg = cfg_factory("experiment=smoke", "train.steps=4", "eval.every=2", "task.eval_size=3", "log.samples_every=2",
                      "log.samples=3", f"export.dir={export}", tmp_path=tmp_path)
    summary = run(cfg, "outputs")
    client, (r,) = runs(tmp_path / "mlflow.db")
    steps = {k: [m.step for m in client.get_metric_history(r.info.run_id, k)] for k in ("eval/accuracy", "train/loss")}
    assert steps == {"eval/accuracy": [0, 2, 4], "train/loss": [0, 1, 2, 3]}  # before steps 0 and 2, after the last
    assert {"eval/reward_mean", "eval/response_len_mean", "system/time/eval_s"} <= set(r.data.metrics)
    assert "eval_accuracy_last" in summary and "system/summary/step_s" in r.data.metrics
    tables = [a.path for a in client.list_artifacts(r.info.run_id, "samples")]
    assert tables == ["samples/eval_step_000000.json", "samples/eval_step_000002.json",
                      "samples/eval_step_000004.json", "samples/train_step_000000.json",
                      "samples/train_step_000002.json"]
    import json

    rows = json.loads(open(client.download_artifacts(r.info.run_id, tables[-1], str(tmp_path))).read())
    assert rows["columns"] == ["prompt", "completion", "answer", "reward"] and len(rows["data"]) == 3
    assert "model/config.json" in [a.path for a in client.list_artifacts(r.info.run_id, "model")]
    assert (export / "config.json").exists() and (export / "tokenizer.json").exists()

    # the export is a model rlrun trains on: model=hf, its own tokenizer
    cfg = cfg_factory("experiment=smoke", "train.steps=1", "model=hf", f"model.path={export}", "export.enabled=false",
                      tmp_path=tmp_path)
    run(cfg, "continued")
    client, (cont, _) = runs(tmp_path / "mlflow.db")
    assert cont.info.status == "FINISHED" and cont.data.params["model.path"] == str(export)


def test_eval_without_held_out_rows_warns_and_runs_without_it(tmp_path, cfg_factory):
    run(cfg_factory("experiment=smoke", "eval.every=2", "task.eval_size=0", "export.enabled=false",
                    tmp_path=tmp_path))
    _, (r,) = runs(tmp_path / "mlflow.db")
    assert r.info.status == "FINISHED" and "eval/accuracy" not in r.data.metrics
    assert "eval.every=2 evaluates on held-out rows" in r.data.tags["rlrun.warnings"]
    assert "task.eval_size=N" in r.data.tags["rlrun.warnings"]


def test_dpo_evaluates_held_out_pairs(tmp_path, cfg_factory):
    cfg = cfg_factory("experiment=smoke", "loss=dpo", "head=chunked", "train.steps=2", "eval.every=1",
                      "task.eval_size=5", "export.enabled=false", tmp_path=tmp_path)
    run(cfg)
    client, (r,) = runs(tmp_path / "mlflow.db")
    assert len(history(client, r.info.run_id, "eval/accuracy")) == 3  # steps 0, 1 and after the last
    assert "eval/margin" in r.data.metrics


def test_resume_by_mlflow_run_id(tmp_path, cfg_factory):
    ckpt = tmp_path / "ckpt"
    first = cfg_factory("experiment=smoke", "train.steps=2", f"checkpoint.dir={ckpt}", "export.enabled=false",
                        tmp_path=tmp_path)
    run(first)
    client, (r,) = runs(tmp_path / "mlflow.db")
    # resumed by run id alone (no checkpoint.dir given): the folder comes from the run's params
    again = cfg_factory("experiment=smoke", "train.steps=4", f"resume={r.info.run_id}", "export.enabled=false",
                        tmp_path=tmp_path)
    run(again)
    client, found = runs(tmp_path / "mlflow.db")
    assert [x.info.run_id for x in found] == [r.info.run_id]  # the same run continued
    assert [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")] == [0, 1, 2, 3]

    from rlrun.errors import TrackingError

    with pytest.raises(TrackingError, match="no such MLflow run"):
        run(cfg_factory("experiment=smoke", f"resume={'0' * 32}", tmp_path=tmp_path))


def test_resume_into_another_store_continues_as_a_new_run_linked_to_the_old_one(tmp_path, cfg_factory, caplog):
    """The checkpoint names a run the new tracking.uri does not hold (the store moved, or another working folder
    with the default relative sqlite:///mlflow.db): a new run there, tagged with the old run's id."""
    ckpt = tmp_path / "ckpt"
    run(cfg_factory("experiment=smoke", "train.steps=2", f"checkpoint.dir={ckpt}", "export.enabled=false",
                    tmp_path=tmp_path))
    _, (old,) = runs(tmp_path / "mlflow.db")
    (tmp_path / "moved").mkdir()
    run(cfg_factory("experiment=smoke", "train.steps=4", f"checkpoint.dir={ckpt}", "resume=true",
                    "export.enabled=false", tmp_path=tmp_path / "moved"))
    client, (new,) = runs(tmp_path / "moved" / "mlflow.db")
    assert new.info.status == "FINISHED" and new.info.run_id != old.info.run_id
    assert new.data.tags["rlrun.resumed_from"] == old.info.run_id
    assert [m.step for m in client.get_metric_history(new.info.run_id, "train/loss")] == [2, 3]
    assert f"run {old.info.run_id} is not in tracking.uri=" in caplog.text


def test_sampled_evaluation_logs_pass_at_k_under_a_name_mlflow_takes(tmp_path, cfg_factory):
    run(cfg_factory("experiment=smoke", "train.steps=1", "eval.every=1", "eval.samples=2", "eval.greedy=false",
                    "export.enabled=false", tmp_path=tmp_path))
    client, (r,) = runs(tmp_path / "mlflow.db")
    assert r.info.status == "FINISHED" and "eval/pass_at_2" in r.data.metrics
    assert [m.step for m in client.get_metric_history(r.info.run_id, "eval/pass_at_2")] == [0, 1]
