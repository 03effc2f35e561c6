"""A tracking store that goes away never ends or loses a run: writes are retried, then kept in the run's output
folder and sent when the store is back (during the run, at its end, or with `rlrun-report --sync FILE`).

The quick tests use a fake client that fails on demand; the slow ones kill a real `mlflow server` mid-run."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import new_store
from helpers import free_port, start_server, stop_server

from rlrun import tracking
from rlrun.tools import report
from rlrun.tracking import spill


class Refused(Exception):
    error_code = "INVALID_PARAMETER_VALUE"  # what MLflow answers for, e.g., a metric name it does not allow


class FlakyClient:
    """Records what it was sent; raises ConnectionError while `down`; refuses metrics named `bad`."""

    def __init__(self):
        self.down = False
        self.metrics: list[tuple] = []
        self.status = None
        self.tags: dict = {}

    def log_batch(self, run_id, metrics):
        if self.down:
            raise ConnectionError("connection refused (test)")
        if any(m.key == "bad" for m in metrics):
            raise Refused("Invalid metric name: 'bad'")
        self.metrics += [(m.key, m.step, m.value, m.timestamp) for m in metrics]

    def set_tag(self, run_id, key, value):
        self.tags[key] = value

    def set_terminated(self, run_id, status):
        if self.down:
            raise ConnectionError("connection refused (test)")
        self.status = status


def metrics(step):
    return {"op": "metrics", "run_id": "r", "uri": "http://x", "args": [["train/loss", float(step), 1000 + step, step]]}


@pytest.fixture
def no_waits(monkeypatch):
    monkeypatch.setattr(spill, "DELAYS", (0.0,))
    monkeypatch.setattr(spill, "RETRY_S", 0.0)
    monkeypatch.setattr(spill, "END_WAIT_S", 0.0)


def test_writes_are_kept_while_the_store_is_down_and_sent_in_order_once_it_is_back(tmp_path, no_waits, caplog):
    client, path = FlakyClient(), str(tmp_path / "spill.jsonl")
    s = spill.Spill(client, path, "http://x")
    s.write(metrics(0))
    s.flush()
    client.down = True
    for step in (1, 2, 3):
        s.write(metrics(step))
    s.flush()  # the writes returned at once; the background sender has kept them by now (steps may share a record)
    kept = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert s.pending == len(kept) and [row[3] for r in kept for row in r["args"]] == [1, 2, 3]
    assert sum("does not answer" in r.message for r in caplog.records) == 1  # said once, not per write
    client.down = False
    s.write(metrics(4))  # the kept records go first, then this one
    s.flush()
    assert [m[1] for m in client.metrics] == [0, 1, 2, 3, 4]
    assert not os.path.exists(path) and s.pending == 0


def test_a_record_the_store_refuses_is_set_aside_and_the_rest_goes_on(tmp_path, no_waits, caplog):
    client, path = FlakyClient(), str(tmp_path / "spill.jsonl")
    s = spill.Spill(client, path, "http://x")
    bad = {**metrics(1), "args": [["bad", 1.0, 1001, 1]]}
    for record in (metrics(0), bad, metrics(2)):
        s.write(record)
    s.flush()
    assert [m[1] for m in client.metrics] == [0, 2] and s.pending == 0  # not mistaken for an outage
    assert json.loads((tmp_path / "spill.rejected.jsonl").read_text()) == bad
    assert "MLflow refused a record" in caplog.text
    # the same inside a replay: a refused record or a torn line never blocks what follows
    Path(path).write_text(json.dumps(metrics(3)) + "\n" + json.dumps(bad) + "\n" + '{"op": "metr' + "\n" +
                          json.dumps(metrics(4)) + "\n")
    assert spill.replay(client, path) == (4, 0)
    assert [m[1] for m in client.metrics] == [0, 2, 3, 4]


def test_metrics_of_consecutive_steps_go_in_one_request_and_flush_does_not_wait_for_more(tmp_path, no_waits,
                                                                                          monkeypatch):
    monkeypatch.setattr(spill, "BATCH_S", 3600.0)  # a batch window flush() must not wait out
    client, requests = FlakyClient(), []
    real = client.log_batch
    client.log_batch = lambda run_id, metrics: requests.append(len(metrics)) or real(run_id, metrics)
    s = spill.Spill(client, str(tmp_path / "spill.jsonl"), "http://x")
    for step in range(10):
        s.write(metrics(step))
    s.write({"op": "tags", "run_id": "r", "uri": "http://x", "args": {"k": "v"}})  # ends the batch: order is kept
    for step in range(10, 610):
        s.write(metrics(step))
    flushing = threading.Thread(target=s.flush)  # sends what was gathered at once, not after BATCH_S
    flushing.start()
    flushing.join(timeout=300)  # a watchdog only: had flush waited for the window, it would still be waiting
    assert not flushing.is_alive()
    assert requests == [10, spill.BATCH_METRICS, 600 - spill.BATCH_METRICS] and client.tags == {"k": "v"}
    assert [m[1] for m in client.metrics] == list(range(610))


def test_a_file_left_in_the_folder_is_sent_first(tmp_path, no_waits):
    client, path = FlakyClient(), str(tmp_path / "spill.jsonl")
    Path(path).write_text(json.dumps(metrics(0)) + "\n")  # an earlier process in this output folder kept it
    s = spill.Spill(client, path, "http://x")
    assert s.pending == 1
    s.write(metrics(1))
    s.flush()
    assert [m[1] for m in client.metrics] == [0, 1] and not os.path.exists(path)


def test_a_run_being_stopped_does_not_wait_for_the_store(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "DELAYS", (5.0, 5.0))
    monkeypatch.setattr(spill, "END_WAIT_S", 60.0)
    client, path = FlakyClient(), str(tmp_path / "spill.jsonl")
    client.down = True
    s = spill.Spill(client, path, "http://x")
    s.write(metrics(0))
    s.write({"op": "status", "run_id": "r", "uri": "http://x", "args": "KILLED"})
    waits = []
    monkeypatch.setattr(time, "sleep", lambda seconds: waits.append(seconds))
    monkeypatch.setattr(s.stopping, "wait", lambda seconds=None: waits.append(seconds) or True)
    s.close(wait=False)  # a signal stopped the run: one attempt per record, straight to the file
    assert s.pending == 2 and not [w for w in waits if w]  # kept, and no retry delay or end wait was slept


def test_a_store_that_never_comes_back_keeps_everything_for_sync(tmp_path, no_waits, caplog, monkeypatch):
    client, path = FlakyClient(), str(tmp_path / "spill.jsonl")
    s = spill.Spill(client, path, "http://x")
    client.down = True
    s.write(metrics(0))
    s.write({"op": "status", "run_id": "r", "uri": "http://x", "args": "FINISHED"})
    s.close()
    assert "rlrun-report --sync " + path in caplog.text
    assert [json.loads(x)["op"] for x in Path(path).read_text().splitlines()] == ["metrics", "status"]
    client.down = False
    monkeypatch.setattr(report, "open_client", lambda uri: client)
    assert report.sync(path) == 0
    assert client.metrics == [("train/loss", 0, 0.0, 1000)] and client.status == "FINISHED"
    assert not os.path.exists(path)


def test_writes_never_wait_for_a_slow_store(tmp_path, no_waits):
    """The step returns while the store still works on what it was sent; flush waits for it."""
    import threading

    client, release = FlakyClient(), threading.Event()
    real = client.log_batch

    def slow(run_id, metrics):
        release.wait(10)
        real(run_id, metrics)

    client.log_batch = slow
    s = spill.Spill(client, str(tmp_path / "spill.jsonl"), "http://x")
    for step in range(5):
        s.write(metrics(step))
    assert client.metrics == []  # the store still holds the first batch (until release): the writes did not wait
    release.set()
    s.flush()
    assert [m[1] for m in client.metrics] == [0, 1, 2, 3, 4]


def test_a_replay_cut_short_keeps_the_rest_and_sends_nothing_twice(tmp_path, no_waits):
    client, path = FlakyClient(), str(tmp_path / "spill.jsonl")
    Path(path).write_text("".join(json.dumps(metrics(i)) + "\n" for i in range(4)))
    calls = {"n": 0}
    real = client.log_batch

    def fails_third(run_id, metrics):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ConnectionError("gone again")
        real(run_id, metrics)

    client.log_batch = fails_third
    assert spill.replay(client, path) == (2, 2)
    assert spill.replay(client, path) == (2, 0)
    assert [m[1] for m in client.metrics] == [0, 1, 2, 3]


def test_sync_of_a_missing_file_says_so(tmp_path, capsys):
    assert report.sync(str(tmp_path / "nope.jsonl")) == 2
    assert "does not exist" in capsys.readouterr().out


# --- a real server, killed mid-run ---

ENV = {**os.environ, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false", "RLRUN_TRACKING_RETRY_S": "1"}


def steps_logged(client, run_id):
    return sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))


def run_with_an_outage(tmp_path, down_s, end_wait_s, restart: bool):
    """A 20-step run against a server that is killed once 3 steps are in: restarted after `down_s` seconds (if
    `restart`), or left down. -> (server folder, port, the run's process result, the run's output folder)."""
    store, out, port = tmp_path / "store", tmp_path / "out", free_port()
    store.mkdir()
    server, url = start_server(store, port, ENV)
    env = {**ENV, "RLRUN_TRACKING_END_WAIT_S": str(end_wait_s)}
    p = subprocess.Popen([sys.executable, "-m", "rlrun", "experiment=smoke", "train.steps=20", "progress=false",
                          f"tracking.uri={url}", f"hydra.run.dir={out}"], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = tracking.open_client(url)
        deadline = time.time() + 300
        run_id = None
        while time.time() < deadline and p.poll() is None:
            runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
            if runs and len(steps_logged(client, runs[0].info.run_id)) >= 3:
                run_id = runs[0].info.run_id
                break
            time.sleep(0.2)
        assert run_id, "the run logged no 3 steps: " + (p.stdout.read() if p.poll() is not None else "")
        stop_server(server)
        if restart:
            time.sleep(down_s)
            server, _ = start_server(store, port, ENV)
        output = p.communicate(timeout=600)[0]
    finally:
        if p.poll() is None:
            p.kill()
        stop_server(server)
    return store, port, p.returncode, output, out, run_id


@pytest.mark.slow
def test_server_killed_mid_run_and_restarted_the_run_has_every_step_once(tmp_path):
    store, port, rc, output, out, run_id = run_with_an_outage(tmp_path, down_s=10, end_wait_s=60, restart=True)
    assert rc == 0, output[-3000:]
    assert "does not answer" in output and "answers again" in output
    server, url = start_server(store, port, ENV)
    try:
        client = tracking.open_client(url)
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert steps_logged(client, run_id) == list(range(20))  # every step, exactly once
        assert "system/summary/step_s" in run.data.metrics
        assert not (out / spill.FILE_NAME).exists()
    finally:
        stop_server(server)


@pytest.mark.slow
def test_server_killed_for_good_the_spill_holds_the_rest_and_sync_fills_the_run(tmp_path):
    store, port, rc, output, out, run_id = run_with_an_outage(tmp_path, down_s=0, end_wait_s=1, restart=False)
    assert rc == 0, output[-3000:]  # training finished although nothing could be logged after step 3
    kept = out / spill.FILE_NAME
    assert kept.exists() and f"rlrun-report --sync {kept}" in output
    server, url = start_server(store, port, ENV)
    try:
        client = tracking.open_client(url)
        assert client.get_run(run_id).info.status == "RUNNING"  # its final status is in the file
        r = subprocess.run(["rlrun-report", "--sync", str(kept)], capture_output=True, text=True, env=ENV)
        assert r.returncode == 0, r.stdout + r.stderr
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert steps_logged(client, run_id) == list(range(20))
        assert not kept.exists()
    finally:
        stop_server(server)


def test_a_resume_sends_what_the_interrupted_process_kept_first(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"uri": new_store(tmp_path), "experiment": "rlrun", "parent_run_id": None})
    first = tracking.MLflow(cfg, {"train": {"steps": 4}}, "x")
    first.log(0, {"loss": 0.5})
    first.finish("KILLED")
    kept = tmp_path / "kept.jsonl"  # what that process could not send: step 1, then its final status
    kept.write_text(json.dumps({"op": "metrics", "run_id": first.run_id, "uri": cfg.uri,
                                "args": [["train/loss", 0.25, 1000, 1]]}) + "\n")
    monkeypatch.setattr(spill, "apply", lambda client, record: (_ for _ in ()).throw(ConnectionError("down")))
    with pytest.raises(tracking.TrackingError, match=f"still kept in {kept} .* rlrun-report --sync {kept}"):
        tracking.MLflow(cfg, {}, None, resume_run_id=first.run_id, previous_spill=str(kept))
    monkeypatch.undo()
    again = tracking.MLflow(cfg, {}, None, resume_run_id=first.run_id, previous_spill=str(kept))
    assert again.first_step == 2 and not kept.exists()  # step 1 counts as logged: the resume starts after it
    again.finish("FINISHED")
    client = tracking.open_client(cfg.uri)
    assert steps_logged(client, first.run_id) == [0, 1] and client.get_run(first.run_id).info.status == "FINISHED"


def test_sync_says_which_artifacts_were_lost_and_sends_the_rest(tmp_path, capsys, caplog):
    """An export folder removed before `--sync` used to be 'sent' (an empty model/ artifact, no word of it)."""
    from conftest import new_store

    from rlrun.tracking import open_client

    new_store(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = open_client(uri)
    run_id = client.create_run(client.get_experiment_by_name("Default").experiment_id).info.run_id
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "config.json").write_text("{}")
    records = [{"op": "artifacts", "run_id": run_id, "uri": uri, "args": {"folder": str(tmp_path / "gone"),
                                                                         "name": "model"}},
               {"op": "artifacts", "run_id": run_id, "uri": uri, "args": {"folder": str(kept), "name": "plan"}},
               {"op": "status", "run_id": run_id, "uri": uri, "args": "FINISHED"}]
    path = tmp_path / "mlflow_spill.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.sync(str(path)) == 1
    out = capsys.readouterr().out
    assert "sent 2 records" in out and "1 could not be" in out and not path.exists()
    assert f"artifact 'model': {tmp_path / 'gone'} is gone or empty" in caplog.text
    assert [a.path for a in client.list_artifacts(run_id)] == ["plan"]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_kept_dataset_record_is_sent_as_the_runs_dataset_input(tmp_path):
    """A record's dataset input (rollout.record / rollout=replay) kept while the store was down reaches the run
    when the spill is sent: name, the 16-digit digest MLflow can hold, its context, the full sha256 in the profile."""
    client = tracking.open_client(new_store(tmp_path))
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    digest = "ab" * 32
    spill.apply(client, {"op": "dataset", "run_id": run_id, "uri": "x",
                         "args": {"name": "rollouts rec", "digest": digest, "source": "/data/rec", "context": "replay",
                                  "profile": {"rollouts": 3, "format": 1}}})
    (given,) = client.get_run(run_id).inputs.dataset_inputs
    assert (given.dataset.name, given.dataset.digest) == ("rollouts rec", digest[:16])
    assert json.loads(given.dataset.profile) == {"sha256": digest, "rollouts": 3, "format": 1}
    assert json.loads(given.dataset.source) == {"uri": "/data/rec"} and given.tags[0].value == "replay"


def test_an_evaluation_logged_before_its_step_trained_is_not_logged_again_on_resume(tmp_path):
    """The held-out evaluation at step N is logged before step N trains. A kill between the two leaves it in the
    store past the learning curve's last step; the resumed run evaluates at N again and must not log it twice (a
    node killed in the cluster test hit this: eval/accuracy at step 25 twice)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"uri": new_store(tmp_path), "experiment": "rlrun", "parent_run_id": None})
    first = tracking.MLflow(cfg, {"train": {"steps": 4}}, "x")
    first.log(0, {"eval/accuracy": 0.1})
    first.log(0, {"loss": 0.5})
    first.log(1, {"loss": 0.4})
    first.log(2, {"eval/accuracy": 0.2})  # then the kill, before step 2's loss
    first.finish("KILLED")
    again = tracking.MLflow(cfg, {}, None, resume_run_id=first.run_id)
    assert again.first_step == 2
    again.log(2, {"eval/accuracy": 0.2})  # the resume's evaluation at step 2: already in the store
    again.log(2, {"loss": 0.3})
    again.log(3, {"loss": 0.2})
    again.log(4, {"eval/accuracy": 0.3})
    again.finish("FINISHED")
    client = tracking.open_client(cfg.uri)
    history = {k: sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, k))
               for k in ("eval/accuracy", "train/loss")}
    assert [s for s, _ in history["eval/accuracy"]] == [0, 2, 4]  # each once
    assert [s for s, _ in history["train/loss"]] == [0, 1, 2, 3]
