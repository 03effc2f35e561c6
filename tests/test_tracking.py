"""The tracking helpers that the loop's tracker, the sweep callback, bench and report share."""

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


def test_params_and_metrics_are_batched_and_cut_to_mlflow_limits(store):
    _, client = store
    run_id = client.create_run(tracking.experiment_id(client, "batch")).info.run_id
    tracking.log_params(client, run_id, {f"p{i}": i for i in range(250)} | {"long": "x" * 7000})
    tracking.log_metrics(client, run_id, {f"m{i}": i for i in range(1200)}, step=3)
    data = client.get_run(run_id).data
    assert len(data.params) == 251 and data.params["p7"] == "7" and len(data.params["long"]) == 6000
    assert len(data.metrics) == 1200 and client.get_metric_history(run_id, "m5")[0].step == 3


def test_every_registered_tracker_satisfies_the_protocol():
    """Each tracking option's class has every method of `Tracker` with its parameters, and a `run_id`."""
    import inspect

    from rlrun import registry

    wanted = {n: inspect.signature(f) for n, f in vars(tracking.Tracker).items()
              if inspect.isfunction(f) and not n.startswith("_")}
    assert {"log", "tags", "summary", "text", "table", "artifacts", "describe", "flush", "finish"} <= set(wanted)
    for name in registry.REGISTRY["tracking"]:
        cls = registry.get("tracking", name)
        for method, sig in wanted.items():
            assert list(inspect.signature(getattr(cls, method)).parameters) == list(sig.parameters), (name, method)
        assert "run_id" in dir(cls) or "run_id" in inspect.getsource(cls.__init__), name
    assert isinstance(tracking.Null(), tracking.Tracker)
