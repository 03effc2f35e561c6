"""Shared fixtures. Every test runs isolated from the others (`_isolated`): in a fresh empty working directory
(nothing lands in the repository: MLflow's default ./mlruns artifact root, Hydra's outputs/, a default
sqlite:///mlflow.db), with the counting rewards of helpers.py reset, and with the process state rlrun can change
(environment, SIGINT/SIGTERM handlers, torch's default dtype and threads, an active MLflow run) put back after it.
Such a change is reported as a warning naming the test, so a leak is seen instead of silently making the next test
depend on the order. The warm-start cache is a folder of the session (pytest_configure), not ~/.cache.

`new_store(folder)` gives a test a new MLflow store in seconds less than creating one (a copy of an empty store).
"""

import os
import shutil
import signal
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parent.parent
CONF = str(ROOT / "conf")
# tests/ (helpers.py: reward functions used through task.reward) and each folder of test modules (unit/<package>,
# e2e, distributed: a test module's own rewards, `task.reward=test_tasks:NAME`, and the few a test imports from
# another), on this process's path and, as TEST_PATH, on the PYTHONPATH of the rlrun processes tests start
TEST_DIRS = [str(ROOT / "tests"), *sorted(str(p.parent) for p in (ROOT / "tests").glob("*/**/test_*.py"))]
TEST_DIRS = list(dict.fromkeys(TEST_DIRS))
TEST_PATH = os.pathsep.join(TEST_DIRS)
sys.path[:0] = [d for d in TEST_DIRS if d not in sys.path]

# An xdist worker's tests, and the rlrun processes they start, use cores / workers threads (set before torch is
# imported). torch's default, every core in each process, runs N workers' threads on N cores N times over, and its
# OpenMP threads spin waiting on one another: tests/e2e/test_runs.py + test_pipeline.py with -n 2 on 2 cores took 278 s
# that way and 119 s with one thread each (2026-11-26). An OMP_NUM_THREADS you set is kept.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                     // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# RLRUN_TOY_OPTIONS=1: a toy option of every axis registered for the session (tests/toys.py), before
# helpers.py lists the options its parametrized tests run; make_cfg composes with their YAMLs on the search path
TOY_CONF = None
if os.environ.get("RLRUN_TOY_OPTIONS"):
    import toys

    toys.register()
    TOY_CONF = toys.session_folder()

import helpers  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """The warm-start cache (rlrun/warmstart.py, default ~/.cache/rlrun) lives in a folder of this session, unless
    RLRUN_CACHE is set (the model cache, $RLRUN_MODEL_CACHE, stays where it is): results never depend on what
    earlier sessions (or other rlrun versions) left there. Set here, before test modules are imported, so that the
    environments they build for subprocesses carry it."""
    if not os.environ.get("RLRUN_CACHE"):
        # converted models are the exception: a conversion is checked by the digests of its source and of every
        # file it wrote (rlrun/pretrained.py), so it cannot differ between sessions; SmolLM2's takes a minute
        os.environ.setdefault("RLRUN_MODEL_CACHE", str(Path.home() / ".cache" / "rlrun" / "models"))
        config._rlrun_cache = tempfile.mkdtemp(prefix="rlrun-test-cache-")
        os.environ["RLRUN_CACHE"] = config._rlrun_cache


def pytest_unconfigure(config):
    folder = getattr(config, "_rlrun_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        if os.environ.get("RLRUN_CACHE") == folder:
            del os.environ["RLRUN_CACHE"]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    """Tiers (pyproject's markers): unmarked tests are quick unit tests, `slow` ones end-to-end runs, `distributed`
    ones run several processes. Under pytest-xdist (CI: -n 2 --dist loadgroup) the `distributed` tests share one
    worker and run one after another: two at once would put 4+ processes on 2 cores, and their deadlines and races
    would measure the machine, not rlrun."""
    for item in items:
        if item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.xdist_group("distributed"))
    # xdist hands out the groups in collection order: the long ones go first, or one would run alone at the end
    # (the `distributed` group is ~10 minutes of one worker); the order is otherwise unchanged (a stable sort)
    items.sort(key=lambda item: GROUP_ORDER.get(group_of(item), len(GROUP_ORDER) + (group_of(item) is None)))


GROUP_ORDER = {"distributed": 0, "smoke_sweep": 1, "mlflow_ui": 2}  # the rest of the groups after these, then the rest


def group_of(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return None if mark is None else (mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist installed it is never called
def pytest_xdist_node_collection_finished(node, ids):
    """Under `--dist loadgroup` every grouped test's id carries its group (`@name`), or xdist spreads the group over
    the workers (each rebuilds its shared fixture, two `distributed` tests run at once): that happened silently
    with pytest 9.2 (pytest-dev/pytest-xdist#1386). The modules below are grouped whole."""
    if node.config.getoption("dist") != "loadgroup":
        return
    whole = ("tests/distributed/test_distributed.py::", "tests/e2e/test_mlflow_ui.py::")
    lost = [i for i in ids if i.startswith(whole) and "@" not in i]
    if lost:
        raise pytest.UsageError(f"pytest-xdist --dist loadgroup is not grouping under pytest {pytest.__version__} "
                                f"(e.g. {lost[0]}); install the pinned one: pip install -e '.[dev]' (pytest<9.2)")


NO_CUDA = "gpu: no CUDA device (torch.cuda.is_available() is False); run `pytest -m gpu` on a machine with one"


def pytest_runtest_setup(item):
    """`gpu` tests are skipped without a CUDA device, all from this one place for the one reason above, so that -ra
    reports them in one line. torch is imported only when such a test runs."""
    if item.get_closest_marker("gpu"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip(NO_CUDA)


# The environment rlrun, its launchers and its tests read (others, e.g. KMP_* that libraries set once when first
# imported, are left alone). Such a variable that a test changes is put back, and reported unless EXPECTED.
WATCHED_ENV_PREFIXES = ("RLRUN_", "MLFLOW_", "HF_", "TRANSFORMERS_", "VLLM_", "DS_", "CUDA_", "TORCH_")
WATCHED_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH",
               "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "GIT_PYTHON_REFRESH"}
EXPECTED_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT",
                "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR",
                "DS_ACCELERATOR"}  # rlrun's setdefault, harmless
SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What a test may leave in the repository root (all ignored by git, so a leak would go unnoticed).
ROOT_LITTER = ("mlruns", "mlflow.db", "outputs", "multirun", "mlartifacts")


def make_cfg(*overrides: str, tmp_path=None):
    """Compose the real config with `overrides`; quiet, and tracking into `tmp_path` when given."""
    extra = ["progress=false"]
    if tmp_path is not None:
        extra.append(f"tracking.uri=sqlite:///{tmp_path}/mlflow.db")
    else:
        extra.append("tracking=none")
    if TOY_CONF is not None:
        extra.append(f"hydra.searchpath=[file://{TOY_CONF}]")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=[*extra, *overrides])


@pytest.fixture
def cfg_factory():
    return make_cfg


STORE_TEMPLATE: list[Path] = []  # set once per session (_store_template): where new_store's template lives


def new_store(folder) -> str:
    """A new, empty sqlite MLflow store at `folder`/mlflow.db; its URI. A copy of one empty store created once per
    session: creating a store runs MLflow's schema migrations, seconds each time. For tests that read what a run
    records; the tests of the entry point (`rlrun` in a subprocess) still have rlrun create its own store."""
    template = STORE_TEMPLATE[0]
    if not template.exists():
        from rlrun.tracking import open_client

        template.parent.mkdir(parents=True, exist_ok=True)
        open_client(f"sqlite:///{template}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    assert not (folder / "mlflow.db").exists(), f"{folder}/mlflow.db exists already"
    shutil.copyfile(template, folder / "mlflow.db")
    return f"sqlite:///{folder}/mlflow.db"


@pytest.fixture(autouse=True, scope="session")
def _store_template(tmp_path_factory):
    STORE_TEMPLATE[:] = [tmp_path_factory.getbasetemp() / "store-template" / "mlflow.db"]


def _torch_state():
    torch = sys.modules.get("torch")  # never import torch here: tests that do not need it stay light
    if torch is None:
        return None
    return {"default dtype": torch.get_default_dtype(), "threads": torch.get_num_threads()}


def _restore_torch(state) -> None:
    torch = sys.modules["torch"]
    torch.set_default_dtype(state["default dtype"])
    torch.set_num_threads(state["threads"])


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory, request):
    # its own MonkeyPatch, not the `monkeypatch` fixture: a test's monkeypatch is undone before the checks below
    with pytest.MonkeyPatch.context() as mp:
        helpers.reset()
        mp.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
        mp.setenv("GIT_PYTHON_REFRESH", "quiet")
        mp.delenv("RLRUN_PARENT_RUN_ID", raising=False)  # a sweep's parent run must not leak into a run
        mp.chdir(tmp_path_factory.mktemp("cwd"))
        env = dict(os.environ)
        handlers = {s: signal.getsignal(s) for s in SIGNALS}
        torch_state = _torch_state()
        yield
        _check_and_restore(request.node.nodeid, env, handlers, torch_state)


def _check_and_restore(nodeid: str, env: dict, handlers: dict, torch_state) -> None:
    leaks = []
    changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)
                     and (k in WATCHED_ENV or k.startswith(WATCHED_ENV_PREFIXES)))
    leaks += [f"env {k}={os.environ.get(k)!r}" for k in changed if k not in EXPECTED_ENV]
    for k in changed:
        if k in env:
            os.environ[k] = env[k]
        else:
            del os.environ[k]
    for s, h in handlers.items():
        if signal.getsignal(s) is not h:
            leaks.append(f"{signal.Signals(s).name} handler {signal.getsignal(s)!r}")
            signal.signal(s, h)
    after = _torch_state()
    if torch_state is not None and after != torch_state:
        leaks.append(f"torch {after} (was {torch_state})")
        _restore_torch(torch_state)
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        leaks.append(f"active MLflow run {mlflow.active_run().info.run_id}")
        mlflow.end_run()
    if leaks:
        warnings.warn(f"{nodeid} leaked (restored): {'; '.join(leaks)}", stacklevel=1)


@pytest.fixture(autouse=True, scope="session")
def _repository_root_stays_clean():
    """Fail the session if a test wrote MLflow or Hydra output into the repository root."""
    before = {name: _listing(ROOT / name) for name in ROOT_LITTER}
    yield
    grown = [name for name in ROOT_LITTER if _listing(ROOT / name) - before[name]]
    assert not grown, (f"tests wrote into the repository root: {grown}; a test must write under tmp_path "
                       "(every test already runs in a fresh working directory: pass absolute paths or none)")


def _listing(path: Path) -> set[str]:
    if not path.exists():
        return set()
    if path.is_file():
        return {str(path)}
    return {str(p) for p in path.rglob("*")}
