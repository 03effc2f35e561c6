"""No secret in a logged or printed string (rlrun/tracking/secrets.py; issue #73): a password in a URI, a
secret-named query parameter, an environment variable named like a secret, and the values a config reads from the
environment in either spelling OmegaConf accepts, scrubbed from the MLflow store, its artifacts and the console."""

import os
import subprocess
import sys

import pytest
from helpers import free_port, start_server, stop_server

from rlrun.tracking import secrets, store


def test_scrub_hides_passwords_query_secrets_and_secret_named_variables(monkeypatch):
    monkeypatch.setenv("MY_API_TOKEN", "tok-abcdef123456")
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to replace anywhere: it would mangle other text
    monkeypatch.setenv("RLRUN_PARENT_SECRET", "rlrun-own-value-1")  # rlrun's own: not a secret
    monkeypatch.setenv("DATA_DIR", "/data/some/long/path")  # not named like a secret
    monkeypatch.setenv("PWD", "/data/some/long/path")  # the shell's working folder, not a password
    cases = {
        "http://alice:hunter2pass@host:5000/x": "http://alice:***@host:5000/x",
        "postgresql://bob:pw@db:5432/mlflow": "postgresql://bob:***@db:5432/mlflow",
        "https://h/x?token=abc123&b=2": "https://h/x?token=***&b=2",
        "https://s3/x?X-Amz-Signature=deadbeef&y=1": "https://s3/x?X-Amz-Signature=***&y=1",
        "see tok-abcdef123456 here": "see ${oc.env:MY_API_TOKEN} here",
        "abc rlrun-own-value-1 /data/some/long/path": "abc rlrun-own-value-1 /data/some/long/path",
        "sqlite:///mlflow.db http://host:5000 user@host": "sqlite:///mlflow.db http://host:5000 user@host",
        # rlrun's own links: a parameter whose name ends in "Key" is no key (it broke every printed runs link)
        "http://h:5000/#/experiments/1/runs?workflowType=machine_learning&viewStateShareKey=rlrun":
            "http://h:5000/#/experiments/1/runs?workflowType=machine_learning&viewStateShareKey=rlrun",
        "u?access_token=a1&apikey=b2&monkey=c3": "u?access_token=***&apikey=***&monkey=c3",
    }
    for raw, want in cases.items():
        assert secrets.scrub(raw) == want, raw
    assert secrets.scrub_tree({"k": ["http://a:b@h"], "tok-abcdef123456": 1}) == {
        "k": ["http://a:***@h"], "${oc.env:MY_API_TOKEN}": 1}


def test_an_env_interpolation_with_spaces_is_found_as_one_without(monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.setenv("SPACED_VALUE", "spaced-secret-value")
    cfg = OmegaConf.create({"a": "${ oc.env:SPACED_VALUE }", "b": "x-${oc.env:SPACED_VALUE}"})
    assert secrets.references(cfg) == {"spaced-secret-value": "${oc.env:SPACED_VALUE}"}
    logged, _ = secrets.loggable(cfg)
    assert "spaced-secret-value" not in str(logged)
    assert secrets.scrub("now spaced-secret-value") == "now ${oc.env:SPACED_VALUE}"  # remembered from then on


def test_every_writer_s_client_scrubs_what_it_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("UPLOAD_TOKEN", "planted-upload-token")
    client = store.open_client(f"sqlite:///{tmp_path}/m.db")
    assert isinstance(client, store.Redacting)
    exp = client.create_experiment("e")
    run = client.create_run(exp, run_name="x planted-upload-token", tags={"t": "http://u:pw12345@h"})
    client.set_tag(run.info.run_id, "cmd", "rlrun tracking.uri=http://u:pw12345@h")
    client.log_param(run.info.run_id, "p", "planted-upload-token")
    client.log_dict(run.info.run_id, {"uri": "http://u:pw12345@h"}, "c.yaml")
    got = client.get_run(run.info.run_id)
    seen = str(got.data.tags) + str(got.data.params) + got.info.run_name
    assert "pw12345" not in seen and "planted-upload-token" not in seen and "${oc.env:UPLOAD_TOKEN}" in seen
    client.download_artifacts(run.info.run_id, "c.yaml", str(tmp_path))
    assert "pw12345" not in (tmp_path / "c.yaml").read_text() and "http://u:***@h" in (tmp_path / "c.yaml").read_text()


PLANTED = {"password": "PlantedPass9173", "env": "planted-env-secret-5521", "hf": "planted-hf-token-8834"}


@pytest.mark.slow  # a real mlflow server and a run through the command
def test_no_planted_secret_reaches_the_store_its_artifacts_or_the_console(tmp_path):
    server_dir, work = tmp_path / "server", tmp_path / "work"
    server_dir.mkdir()
    work.mkdir()
    env = {**os.environ, "MY_SECRET_TOKEN": PLANTED["env"], "HF_TOKEN": PLANTED["hf"], "RLRUN_TOY_OPTIONS": "1"}
    proc, url = start_server(server_dir, free_port(), env)
    try:
        uri = url.replace("http://", f"http://alice:{PLANTED['password']}@")
        r = subprocess.run(
            [sys.executable, "-m", "rlrun", "experiment=smoke", "train.steps=1", f"tracking.uri={uri}",
             "run_name=${ oc.env:MY_SECRET_TOKEN }",  # the spelling with spaces
             f"report.name=hf-{PLANTED['hf']}"],  # as the shell expands $HF_TOKEN into a command line
            cwd=work, env=env, capture_output=True, text=True, timeout=600)
    finally:
        stop_server(proc)
    assert r.returncode == 0, r.stderr[-3000:]
    console = r.stdout + r.stderr
    places = {"console": console}
    for folder in (server_dir, work):
        for path in folder.rglob("*"):
            if path.is_file() and ".hydra" not in path.parts:  # .hydra/: Hydra's own record of the command line
                places[str(path)] = path.read_bytes().decode("utf-8", "replace")
    assert any("cli.log" in p for p in places) and any(p.endswith("mlflow.db") for p in places)
    leaks = [(name, where) for where, text in places.items() for name, value in PLANTED.items() if value in text]
    assert not leaks, leaks
    assert "alice:***@" in console  # the links printed, scrubbed


def test_the_redacting_client_pickles_as_the_sweep_s_launchers_need(tmp_path):
    """joblib and submitit pickle the sweep's callback with its client: unpickling looked `_client` up through
    __getattr__ before it was set, and recursed until the job failed to start."""
    import pickle

    client = store.open_client(f"sqlite:///{tmp_path}/m.db")
    again = pickle.loads(pickle.dumps(client))
    assert isinstance(again, store.Redacting) and again.search_experiments() is not None
