"""Past one machine, for real: a one-node SLURM cluster (munged, slurmctld, slurmd), PostgreSQL and an MLflow server on
it, started and stopped by the project's own script (`python -m rlrun.cluster`, once for this module), and rlrun on
them: a sweep through `hydra/launcher=slurm` with one job requeued, faults (PostgreSQL restarted, the node killed,
the MLflow server stopped) during another, and DeepSpeed across two torchrun agents in one SLURM job.

Skipped, in one line, where Debian's packages are not installed (apt-get install -y slurm-wlm munge postgresql) or
not as root (slurmd starts jobs as their users); with RLRUN_REQUIRE_CLUSTER=1 (CI) that is a failure instead.
"""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import TEST_PATH

from rlrun import tracking

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "psql")


def missing() -> list[str]:
    gone = [p for p in PROGRAMS if shutil.which(p) is None and not os.path.exists(f"/usr/sbin/{p}")]
    gone += [] if glob.glob("/usr/lib/postgresql/*/bin/initdb") else ["postgresql (initdb)"]
    gone += [m for m in ("hydra_plugins.hydra_submitit_launcher", "psycopg") if importlib.util.find_spec(m) is None]
    return gone + ([] if os.geteuid() == 0 else ["root (slurmd and the daemons' own users need it)"])


REQUIRED = os.environ.get("RLRUN_REQUIRE_CLUSTER") == "1"
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.skipif(
    bool(missing()) and not REQUIRED,
    reason=f"no SLURM/PostgreSQL here ({', '.join(missing())}): apt-get install -y slurm-wlm munge postgresql, "
           "pip install -e '.[launchers]', as root")]

SMOKE = ["experiment=smoke", "progress=false", "checkpoint.every=1", "resume=auto"]


class Cluster:
    def __init__(self, folder: str, state: dict):
        self.folder, self.uri = folder, state["uri"]
        # a busy machine's server can take longer than rlrun's default 10 s to answer a request
        self.env = {**os.environ, "SLURM_CONF": f"{folder}/slurm/slurm.conf", "OMP_NUM_THREADS": "1",
                    "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false", "PYTHONPATH": TEST_PATH,
                    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}

    def script(self, *args: str) -> str:
        """`python -m rlrun.cluster ARGS FOLDER`, as a user runs it; its output (a failure fails the test)."""
        out = subprocess.run([sys.executable, "-m", "rlrun.cluster", args[0], self.folder, *args[1:]],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def slurm(self, *cmd: str) -> str:
        out = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def queue(self, array: str) -> dict[str, str]:
        """{job: state} of the array's jobs SLURM still holds."""
        lines = self.slurm("squeue", "-h", "-r", "-o", "%i %T").split("\n")
        return dict(x.split()[:2] for x in lines if x.startswith(f"{array}_"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if missing():
        pytest.fail(f"RLRUN_REQUIRE_CLUSTER=1 but the cluster cannot run here: {', '.join(missing())}")
    folder = tempfile.mkdtemp(prefix="rlrun-cluster-", dir="/tmp")  # the daemons' users must reach it
    os.chmod(folder, 0o755)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rlrun.cluster", "start", folder, "--grace-s", "20"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    print(f"cluster up in {time.monotonic() - started:.1f} s: {out.stdout.splitlines()[0]}")
    from rlrun.cluster import daemon

    c = Cluster(folder, daemon.load(folder))
    try:
        wait_for("the MLflow server's first answer", lambda: answers(c.uri), every=2)  # its slowest: not a test's
        yield c
    finally:
        stopped = subprocess.run([sys.executable, "-m", "rlrun.cluster", "stop", folder], capture_output=True,
                                 text=True, timeout=300)
        left = daemon.marked(folder)
        logs = tmp_path_factory.mktemp("cluster-logs")  # the daemons' logs outlive the cluster (pytest keeps them)
        for log in glob.glob(f"{folder}/*/*.log"):
            shutil.copy(log, logs)
        shutil.rmtree(folder, ignore_errors=True)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not left, f"still running after stop: {[daemon.describe(p) for p in left]}"


def answers(uri: str) -> bool:
    try:
        tracking.open_client(uri).search_experiments(max_results=1)
        return True
    except Exception:  # noqa: BLE001 - not yet
        return False


@pytest.fixture(autouse=True)
def whole(cluster, monkeypatch):
    """Each test finds the whole cluster up and its queue empty, whatever the test before it left: a part stopped
    by a fault, jobs still queued."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    cluster.script("start")
    yield
    subprocess.run(["scancel", "--user=root"], env=cluster.env, capture_output=True, timeout=60)
    wait_for("the queue to empty", lambda: not cluster.slurm("squeue", "-h").strip(), timeout=120, every=1)


def wait_for(what: str, ready, timeout: float = 600, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(every)
    return found


def steps_done(sweep_dir: Path, job: int) -> int:
    """The newest checkpoint's step of job `job` (checkpoint.every=1: the steps it has trained)."""
    names = glob.glob(str(sweep_dir / str(job) / "checkpoints" / "step_*.pt"))
    return max((int(re.search(r"step_(\d+)", n).group(1)) for n in names), default=0)


def submit(cluster: Cluster, tmp_path: Path, *overrides: str, env: dict | None = None) -> tuple[str, str]:
    """A sweep through rlrun's SLURM launcher, in its own experiment; -> (parent run id, SLURM array id), once the
    command has returned (it does not wait for its jobs)."""
    out = subprocess.run([sys.executable, "-m", "rlrun", "-m", "hydra/launcher=slurm", "hydra.launcher.timeout_min=20",
                          "hydra.launcher.cpus_per_task=1", f"hydra.sweep.dir={tmp_path}/sweep",
                          f"tracking.uri={cluster.uri}", f"tracking.experiment={tmp_path.name}", *overrides],
                         cwd=tmp_path, env={**cluster.env, **(env or {})}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    parent = re.search(r"collect ([0-9a-f]{32})", out.stdout).group(1)
    array = re.search(r"array (\d+)", out.stdout).group(1)
    return parent, array


def collected(cluster: Cluster, parent: str):
    """The sweep's parent and children once the collect job has ended it."""
    client = tracking.open_client(cluster.uri)
    wait_for("the collect job to end the sweep", lambda: client.get_run(parent).info.status != "RUNNING", every=2)
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent}'")
    return client, client.get_run(parent), {c.data.tags["rlrun.slurm.job"]: c for c in children}


def curves(client, run, keys=("train/loss", "train/reward_mean", "train/grad_norm", "eval/accuracy")) -> dict:
    """Each metric's (step, value) pairs in logging order (a step logged twice shows twice)."""
    return {k: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, k),
                                                  key=lambda m: (m.step, m.timestamp))] for k in keys}


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_4_job_sweep_on_slurm_with_a_job_requeued_ends_as_a_local_sweep_and_resumes_bit_for_bit(cluster, tmp_path):
    """4 jobs (dense and tiled, twice each) as SLURM jobs into the PostgreSQL-backed server; the submitting command
    returns at once. Job 0 is requeued (`scontrol requeue`: SIGTERM, the step finishes and is checkpointed, the run
    is KILLED, the job goes back to the queue, starts again and resumes the same MLflow run); the collect job draws
    the parent's verdict. Job 0's curves equal its twin's (job 2) bit for bit."""
    parent, array = submit(cluster, tmp_path, *SMOKE, "train.steps=30", "head=dense,tiled", "report.repeats=2")
    client = tracking.open_client(cluster.uri)
    assert client.get_run(parent).info.status == "RUNNING"  # returned before its jobs ended
    wait_for("job 0 at step 3", lambda: steps_done(tmp_path / "sweep", 0) >= 3)
    cluster.slurm("scontrol", "requeue", f"{array}_0")
    log = tmp_path / "sweep" / "0" / "cli.log"
    wait_for("job 0 to start again", lambda: "SLURM requeued this job (restart 1)" in log.read_text(), every=1)
    assert client.get_run(parent).info.status == "RUNNING"  # a job's SIGTERM is its own, not the sweep's end
    client, parent_run, jobs = collected(cluster, parent)

    assert parent_run.info.status == "FINISHED", parent_run.data.tags.get("error")
    assert sorted(jobs) == [f"{array}_{i}" for i in range(4)]
    assert all(j.info.status == "FINISHED" for j in jobs.values())
    note = parent_run.data.tags["mlflow.note.content"]
    assert note.startswith("Cost of") and "Same result: yes" in note, note[:500]
    assert parent_run.data.tags["rlrun.equivalence"] == "3 run(s) compared with their baseline"
    assert all(j.data.tags["rlrun.verdict"] and "probes pass" in j.data.tags["rlrun.check"] for j in jobs.values())
    requeued, twin = jobs[f"{array}_0"], jobs[f"{array}_2"]
    assert requeued.data.tags["rlrun.slurm.restarts"] == "1" and "rlrun.interrupted" in requeued.data.tags
    assert twin.data.tags["rlrun.slurm.restarts"] == "0"
    mine, theirs = curves(client, requeued), curves(client, twin)
    assert [s for s, _ in mine["train/loss"]] == list(range(30))  # every step once
    assert mine == theirs  # bit for bit
    assert "signal SIGTERM: stopping after this step" in log.read_text()  # SLURM's grace: the step checkpointed


def test_faults_postgres_restarted_node_killed_mlflow_server_stopped_lose_nothing(cluster, tmp_path):
    """During a sweep of one job twice, each recording its rollouts: PostgreSQL stopped and started again (the jobs
    keep what the server cannot store, and send it when it answers again); the node killed (slurmd, its job steps
    and the jobs: SIGKILL) and started again (SLURM requeues both jobs, which resume from their checkpoints in their
    MLflow runs and record on); then the MLflow server stopped until both jobs ended (each keeps its last records in
    its folder) and started again (the collect job, waiting for it, sends them before it draws). Every step of both
    runs is in MLflow exactly once, and the two jobs, stopped at different steps, trained and recorded the same."""
    steps, sweep_dir, records = 80, tmp_path / "sweep", tmp_path / "records"
    parent, array = submit(cluster, tmp_path, *SMOKE, f"train.steps={steps}", "report.repeats=2",
                           f"rollout.record={records}/${{report.repeat}}",
                           env={"RLRUN_TRACKING_RETRY_S": "2", "RLRUN_TRACKING_END_WAIT_S": "2"})

    def both_past(n):
        return lambda: min(steps_done(sweep_dir, 0), steps_done(sweep_dir, 1)) >= n

    wait_for("both jobs at step 2", both_past(2))
    cluster.script("stop", "--only", "postgres")
    at = max(steps_done(sweep_dir, 0), steps_done(sweep_dir, 1))
    wait_for("both jobs training while PostgreSQL is down", both_past(at + 3))
    cluster.script("start", "--only", "postgres")
    wait_for("both jobs to send what they kept", lambda: not glob.glob(str(sweep_dir / "*" / "mlflow_spill.jsonl")))

    cluster.script("kill-node")
    wait_for("SLURM to requeue both jobs", lambda: set(cluster.queue(array).values()) == {"PENDING"}, every=1)
    cluster.script("start")  # the node comes back
    at = max(steps_done(sweep_dir, 0), steps_done(sweep_dir, 1))
    wait_for("both jobs resumed", both_past(at + 2))

    cluster.script("stop", "--only", "mlflow")
    wait_for("both jobs to end while the server is down", lambda: not cluster.queue(array), every=1)
    cluster.script("start", "--only", "mlflow")
    client, parent_run, jobs = collected(cluster, parent)

    assert parent_run.info.status == "FINISHED", parent_run.data.tags.get("error")
    first, second = (curves(client, job) for job in jobs.values())
    for job in jobs.values():
        assert job.info.status == "FINISHED" and job.data.tags["rlrun.slurm.restarts"] == "1"
    assert [s for s, _ in first["train/loss"]] == list(range(steps))  # every step, once
    assert first == second  # bit for bit
    assert files(records / "0") == files(records / "1") != {}
    kept = glob.glob(str(sweep_dir / "*" / "mlflow_spill.jsonl")) + glob.glob(str(sweep_dir / "*" / "*.rejected.*"))
    assert not kept  # nothing left unsent, nothing set aside
    logs = [(sweep_dir / str(i) / "cli.log").read_text() for i in (0, 1)]
    assert all("does not answer" in x and "answers again" in x for x in logs)  # PostgreSQL's outage, once each
    assert all("SLURM requeued this job (restart 1); continuing" in x for x in logs)
    assert all(x.count("is still unreachable") == 1 for x in logs)  # the server's, at each job's end
    assert "records a job had kept" in (sweep_dir / "collect.log").read_text()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_deepspeed_on_two_nodes_equals_one_node_with_two_ranks(cluster, tmp_path):
    """scripts/slurm/multinode.sbatch as one SLURM job of 2 tasks (the 2 nodes a real cluster gives it, here on the
    one node): two torchrun agents of one rank each meet at a c10d rendezvous; its curves equal, bit for bit, those
    of one torchrun with 2 ranks on one machine."""
    from helpers import free_port

    run = ["engine=deepspeed", "engine.zero_stage=3", "experiment=smoke", "train.steps=4", "train.micro_batch=2",
           "train.num_iterations=2", "loss.kl_coef=0.05", "rollout.max_new_tokens=6", "progress=false",
           f"tracking.uri={cluster.uri}", f"tracking.experiment={tmp_path.name}"]
    env = {**cluster.env, "PYTHON": sys.executable, "RDZV_PORT": str(free_port())}
    job = subprocess.run(["sbatch", "--parsable", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1",
                          f"--output={tmp_path}/two-nodes.log", str(ROOT / "scripts/slurm/multinode.sbatch"), *run,
                          "run_name=two-nodes"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    wait_for("the two-node job", lambda: not cluster.slurm("squeue", "-h", "-j", job.stdout.strip()).strip(),
             every=1)
    one = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={free_port()}", "-m", "rlrun", *run, "run_name=one-node",
                          f"hydra.run.dir={tmp_path}/one-node"], cwd=tmp_path, env=cluster.env, capture_output=True,
                         text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    client = tracking.open_client(cluster.uri)
    exp = client.get_experiment_by_name(tmp_path.name).experiment_id
    runs = {r.data.tags["mlflow.runName"]: r for r in client.search_runs([exp])}
    assert runs.keys() == {"one-node", "two-nodes"}, (tmp_path / "two-nodes.log").read_text()[-3000:]
    assert all(r.info.status == "FINISHED" and r.data.tags["rlrun.world_size"] == "2" for r in runs.values())
    keys = ("train/loss", "train/grad_norm", "train/reward_mean", "train/clipfrac",
            "system/mismatch/gen_vs_train_abs")
    two, one_node = curves(client, runs["two-nodes"], keys), curves(client, runs["one-node"], keys)
    assert len(two["train/loss"]) == 4 and two == one_node
    assert runs["two-nodes"].data.tags["rlrun.slurm.job"] == job.stdout.strip()  # it ran as that SLURM job
