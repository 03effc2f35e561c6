"""The tracking helpers that the loop's tracker, the sweep callback, bench and report share."""

import contextlib
import os

import pytest

from rlrun import tracking


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from conftest import new_store

    uri = new_store(tmp_path_factory.mktemp("store"))
    return uri, tracking.open_client(uri)


def test_experiment_id_creates_once_then_returns_the_same_id(store):
    uri, client = store
    first = tracking.experiment_id(client, "idem")
    assert tracking.experiment_id(client, "idem") == first
    assert tracking.experiment_id(tracking.open_client(uri), "idem") == first  # another client, same store
    assert [e.experiment_id for e in client.search_experiments() if e.name == "idem"] == [first]


def test_experiment_id_reads_the_experiment_another_process_created_first(store):
    _, client = store

    class LateReader:
        """A client that does not see the experiment on its first read, as when another process creates it
        between our read and our create."""

        def __init__(self):
            self.reads = 0

        def get_experiment_by_name(self, name):
            self.reads += 1
            return None if self.reads == 1 else client.get_experiment_by_name(name)

        def create_experiment(self, name):
            return client.create_experiment(name)

    theirs = client.create_experiment("race")
    assert tracking.experiment_id(LateReader(), "race") == theirs


def test_connect_names_the_fix_for_an_unusable_store(tmp_path):
    with pytest.raises(tracking.TrackingError, match="file store"):
        tracking.connect(f"file://{tmp_path}/mlruns", "x")


def test_a_file_that_is_not_an_mlflow_database_is_named_with_the_fix(tmp_path):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not a database " * 100)
    with pytest.raises(tracking.TrackingError, match=rf"{db} cannot be used as an MLflow store \(DatabaseError: .*"
                                                     r"file is not a database\). .*move it aside"):
        tracking.connect(f"sqlite:///{db}", "x")


def test_a_database_of_the_user_s_own_is_refused_and_left_as_it_was(tmp_path):
    """tracking.uri=sqlite:///app.db on an application's database: MLflow created its 65 tables inside it (and 4 of
    them before refusing one whose table names clash)."""
    import sqlite3

    db = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(db)) as c:
        c.execute("CREATE TABLE users (id INTEGER)")
        c.commit()
    before = db.read_bytes()
    with pytest.raises(tracking.TrackingError, match=r"app.db is a database of its own \(1 tables: users\), not an "
                                                     r"MLflow store.*Nothing was written to it; point tracking.uri at "
                                                     r"another file"):
        tracking.connect(f"sqlite:///{db}", "x")
    assert db.read_bytes() == before
    tracking.connect(f"sqlite:///{tmp_path}/mlflow.db", "x")  # an MLflow store is opened again as before
    tracking.connect(f"sqlite:///{tmp_path}/mlflow.db", "x")


def test_params_and_metrics_are_batched_and_cut_to_mlflow_limits(store):
    _, client = store
    run_id = client.create_run(tracking.experiment_id(client, "batch")).info.run_id
    tracking.log_params(client, run_id, {f"p{i}": i for i in range(250)} | {"long": "x" * 7000})
    tracking.log_metrics(client, run_id, {f"m{i}": i for i in range(1200)}, step=3)
    data = client.get_run(run_id).data
    assert len(data.params) == 251 and data.params["p7"] == "7" and len(data.params["long"]) == 6000
    assert len(data.metrics) == 1200 and client.get_metric_history(run_id, "m5")[0].step == 3


# -- a store that cannot be used: one message at once, naming the cause (reliability round 5) -------------------------
def _fifo(path):
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("make, says", [
    (lambda p: os.symlink(p.parent / "nowhere" / "x.db", p), "is a symbolic link to nothing"),
    (_fifo, "is a FIFO, not a database file"),
    (lambda p: p.mkdir(), "is a folder, not a database file"),
], ids=["dangling link", "fifo", "folder"])
def test_a_store_path_that_is_no_database_file_is_refused_before_mlflow_opens_it(tmp_path, make, says):
    """A dangling mlflow.db link made MLflow create the database where it pointed; a FIFO gave minutes of
    retries before any message."""
    make(tmp_path / "mlflow.db")
    with pytest.raises(tracking.TrackingError, match=says):
        tracking.connect(f"sqlite:///{tmp_path}/mlflow.db", "rlrun")
    assert not (tmp_path / "nowhere").exists()  # nothing created through the link


@pytest.mark.parametrize("path", ["/proc/mlflow.db", "/proc/self/fd/mlflow.db"])
def test_a_store_under_proc_is_refused(path):
    """Folders of /proc that a root process may write to (os.access says so): sqlite retried there for minutes."""
    with pytest.raises(tracking.TrackingError, match=f"{path} is under /proc, the kernel's files"):
        tracking.check_uri(f"sqlite:///{path}")


def test_a_locked_store_says_so_and_never_advises_moving_it_aside(tmp_path):
    """Another process holding the database (a long write): the message said to move a healthy database aside."""
    import sqlite3

    from conftest import new_store

    uri = new_store(tmp_path)
    holder = sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # what a process in the middle of a write holds
    try:
        with pytest.raises(tracking.TrackingError) as e:
            tracking.connect(uri, "rlrun")
    finally:
        holder.close()
    assert "is locked by another process" in str(e.value) and "do not move it aside" in str(e.value), str(e.value)


# -- ${oc.env:...} values stay out of what a run logs ------------------------------------------------------------------
def started(monkeypatch, *overrides, run_name="r"):
    """What tracking.start hands the tracker for a config composed with `overrides`: (config, run name)."""
    from conftest import make_cfg

    from rlrun import registry

    seen = {}
    monkeypatch.setattr(registry, "get", lambda group, name: lambda cfg, config, name_, *a: seen.update(
        config=config, name=name_))
    cfg = make_cfg("experiment=smoke", "tracking=mlflow", *overrides)
    tracking.start(cfg.tracking, cfg, run_name=run_name)
    return seen["config"], seen["name"]


def test_a_secret_read_from_the_environment_stays_out_of_the_run_name_params_and_config(monkeypatch):
    """`run_name=${oc.env:SECRET_TOKEN}` copied the token into the run name, every param and the config artifact
    (a tracking server may be shared)."""
    monkeypatch.setenv("SECRET_TOKEN", "tok-0123456789abcdef")
    monkeypatch.setenv("SHORT", "7")
    config, name = started(monkeypatch, "run_name=${oc.env:SECRET_TOKEN}", "+extra.url=https://x/${oc.env:SECRET_TOKEN}",
                           "+extra.copied=${run_name}", "+extra.short=${oc.env:SHORT}", "seed=7",
                           run_name="tok-0123456789abcdef")
    flat = tracking.flatten(config)
    assert "tok-0123456789abcdef" not in str(config) and "tok-0123456789abcdef" not in name
    assert name == "${oc.env:SECRET_TOKEN}" and flat["run_name"] == "${oc.env:SECRET_TOKEN}"
    assert flat["extra.url"] == "https://x/${oc.env:SECRET_TOKEN}"
    assert flat["extra.copied"] == "${oc.env:SECRET_TOKEN}"  # reached through another interpolation
    assert flat["extra.short"] == "${oc.env:SHORT}" and flat["seed"] == "7"  # a short value: only where it is read
    assert flat["tracking.parent_run_id"] == "None"  # rlrun's own variable is resolved as before


def test_log_env_logs_the_values_when_asked(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "tok-0123456789abcdef")
    config, name = started(monkeypatch, "run_name=${oc.env:SECRET_TOKEN}", "tracking.log_env=true",
                           run_name="tok-0123456789abcdef")
    assert config["run_name"] == name == "tok-0123456789abcdef"
