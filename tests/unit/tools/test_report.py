"""rlrun-report: what it cannot find ends in one line on stderr and exit 2, never a traceback."""

import subprocess

import pytest

from rlrun import tracking
from rlrun.tools import report


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store with experiment `rlrun` holding one run that is no sweep's parent."""
    from conftest import new_store

    uri = new_store(tmp_path_factory.mktemp("report"))
    client, exp_id = tracking.connect(uri, "rlrun")
    return uri, client.create_run(exp_id, run_name="lonely").info.run_id


def refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        report.main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("rlrun-report: ") and err.count("\n") == 1, err
    return err


def test_unknown_run_id(store, capsys):
    uri, _ = store
    assert "no run 'deadbeef'" in refused(capsys, "deadbeef", "--uri", uri)


def test_unknown_experiment(store, capsys):
    uri, _ = store
    assert "no experiment 'nope'" in refused(capsys, "--experiment", "nope", "--uri", uri)


def test_run_without_children_and_filter_without_match(store, capsys):
    uri, lonely = store
    assert "has no child runs" in refused(capsys, lonely, "--uri", uri)
    assert "matched the filter" in refused(capsys, "--experiment", "rlrun", "--filter", "params.x = 'y'", "--uri", uri)
    bad = refused(capsys, "--experiment", "rlrun", "--filter", "no such syntax", "--uri", uri)
    assert uri in bad and "matched the filter" not in bad  # MLflow's parse error, not "no run matched"


@pytest.mark.slow  # a fresh process importing mlflow
def test_missing_database_is_named_and_not_created(tmp_path):
    r = subprocess.run(["rlrun-report", "deadbeef"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no MLflow database at 'mlflow.db'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "mlflow.db").exists()
