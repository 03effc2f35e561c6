"""A one-node SLURM cluster on localhost: munged (as the munge user, its own socket and key), slurmctld and slurmd
with a slurm.conf written here (ports, state, spool and log folders of its own; no cgroups: proctrack/linuxproc,
task/none; select/cons_tres over one node of `cpus` CPUs). Clients find it through SLURM_CONF=<folder>/slurm/slurm.conf.

One partition, `debug`. A job that is requeued (`scontrol requeue`, the node failed) or cancelled gets SIGTERM and
`grace_s` seconds (KillWait) to end before SIGKILL, as a preempted job gets GraceTime on a cluster that preempts;
a requeued job waits `requeue_s` (AuthInfo's cred_expire; 120 s by default) before it may start again, and the node
is declared down `node_timeout_s` after slurmd stops answering (SlurmdTimeout; 300 s by default), its jobs requeued.
`start` starts what is not running, so after `kill_node` it brings the node back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

from . import daemon
from .daemon import fail, run

NODE = "node1"
MUNGE_USER = "munge"


def paths(folder: str) -> dict[str, str]:
    s, m = os.path.join(folder, "slurm"), os.path.join(folder, "munge")
    return {"dir": s, "conf": os.path.join(s, "slurm.conf"), "munge": m, "key": os.path.join(m, "private", "munge.key"),
            "socket": os.path.join(m, "munge.socket"), "munged_pid": os.path.join(m, "munged.pid"),
            "munged_log": os.path.join(m, "munged.log"), "ctld_pid": os.path.join(s, "slurmctld.pid"),
            "slurmd_pid": os.path.join(s, "slurmd.pid"), "ctld_log": os.path.join(s, "slurmctld.log"),
            "slurmd_log": os.path.join(s, "slurmd.log")}


def memory_mib() -> int:
    with open("/proc/meminfo") as f:
        kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return max(1, kib // 1024 - 512)  # slurmd's own share left out


def config(folder: str, s: dict) -> str:
    """slurm.conf for the settings `s` (ports, cpus, grace_s, requeue_s, node_timeout_s)."""
    p, host = paths(folder), socket.gethostname()
    return "\n".join([
        "# written by python -m rlrun.cluster (rlrun/cluster/slurm.py): a one-node cluster on localhost",
        "ClusterName=rlrun", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root",
        f"SlurmctldPort={s['ctld_port']}", f"SlurmdPort={s['slurmd_port']}",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={p['socket']},cred_expire={s['requeue_s']}",
        f"StateSaveLocation={p['dir']}/state", f"SlurmdSpoolDir={p['dir']}/spool",
        f"SlurmctldPidFile={p['ctld_pid']}", f"SlurmdPidFile={p['slurmd_pid']}",
        f"SlurmctldLogFile={p['ctld_log']}", f"SlurmdLogFile={p['slurmd_log']}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none", "ReturnToService=2", "JobRequeue=1", "SlurmdParameters=config_overrides",
        "SchedulerType=sched/builtin", "SchedulerParameters=sched_interval=2",
        f"KillWait={s['grace_s']}", f"SlurmdTimeout={s['node_timeout_s']}",
        f"NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={s['cpus']} RealMemory={memory_mib()} "
        "State=UNKNOWN",
        f"PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP", ""])


def depth(pid: int, tree: dict[int, int]) -> int:
    n = 0
    while pid in tree and n < 64:
        pid, n = tree[pid], n + 1
    return n


def start_munge(folder: str, env: dict) -> None:
    p = paths(folder)
    if daemon.alive(daemon.read_pid(p["munged_pid"])):
        return
    daemon.reachable(p["munge"], MUNGE_USER)
    daemon.owner(p["munge"], MUNGE_USER, 0o755)  # the socket's folder: everyone may connect
    daemon.owner(os.path.dirname(p["key"]), MUNGE_USER, 0o700)
    if not os.path.exists(p["key"]):
        run("munge: a key (mungekey)", ["mungekey", "--create", "--keyfile", p["key"]], MUNGE_USER, env)
    run("munge: munged", ["munged", f"--socket={p['socket']}", f"--key-file={p['key']}",
                          f"--pid-file={p['munged_pid']}", f"--log-file={p['munged_log']}",
                          f"--seed-file={os.path.dirname(p['key'])}/munged.seed"], MUNGE_USER, env,
        log=p["munged_log"])
    done = run("munge: a credential", ["sh", "-c", f"munge -n -S {p['socket']} | unmunge -S {p['socket']}"],
               env=env, log=p["munged_log"], check=False)
    if "Success" not in done.stdout:
        fail("munge: a credential", f"munge | unmunge did not decode one ({done.stderr.strip()[-500:]})",
             p["munged_log"])


def start_slurmd(folder: str, env: dict, timeout: float = 60) -> None:
    p = paths(folder)
    run("slurm: slurmd", ["slurmd", "-f", p["conf"], "-N", NODE], env=env, log=p["slurmd_log"])
    daemon.wait_for("slurm: the node to be idle (sinfo)", lambda: node_state(env) in ("idle", "mixed", "allocated"),
                    timeout, p["slurmd_log"])


def node_state(env: dict) -> str:
    done = run("slurm: sinfo", ["sinfo", "-h", "-n", NODE, "-o", "%T"], env=env, check=False, timeout=30)
    return done.stdout.strip().rstrip("*~#!%$@^-")


def start(folder: str, s: dict) -> None:
    """munged, slurmctld, slurmd, each unless it runs; then the node up, and on a new controller a one-line job run
    through srun."""
    p = paths(folder)
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(p["dir"], sub), exist_ok=True)
    env = daemon.environment(folder, SLURM_CONF=p["conf"])
    start_munge(folder, env)
    new = not daemon.alive(daemon.read_pid(p["ctld_pid"]))
    if new:
        with open(p["conf"], "w") as f:
            f.write(config(folder, s))
        run("slurm: slurmctld", ["slurmctld", "-f", p["conf"], "-i"], env=env, log=p["ctld_log"])
        daemon.wait_for("slurm: slurmctld to answer (scontrol ping)",
                        lambda: "UP" in run("slurm: scontrol ping", ["scontrol", "ping"], env=env,
                                            check=False).stdout, 60, p["ctld_log"])
    if not daemon.alive(daemon.read_pid(p["slurmd_pid"])):
        start_slurmd(folder, env)
    if new:
        run("slurm: a test job (srun true)", ["srun", "--time=1", "true"], env=env, log=p["slurmd_log"], timeout=60)


def jobs(env: dict) -> list[str]:
    done = run("slurm: squeue", ["squeue", "-h", "-o", "%i"], env=env, check=False, timeout=30)
    return done.stdout.split() if done.returncode == 0 else []


def stop(folder: str, grace_s: float) -> list[str]:
    """Cancel every job (each gets SIGTERM and `grace_s` to end), then slurmd, slurmctld and munged; -> what was
    stopped."""
    p = paths(folder)
    env = daemon.environment(folder, SLURM_CONF=p["conf"])
    stopped = []
    if daemon.alive(daemon.read_pid(p["ctld_pid"])) and daemon.alive(daemon.read_pid(p["slurmd_pid"])):
        queued = jobs(env)
        if queued:
            run("slurm: scancel", ["scancel", *queued], env=env, check=False)
            deadline = time.monotonic() + grace_s + 15
            while jobs(env) and time.monotonic() < deadline:
                time.sleep(0.5)
            stopped.append(f"{len(queued)} job(s) cancelled")
    for name in ("slurmd", "ctld", "munged"):
        if daemon.stop_pid(daemon.read_pid(p[f"{name}_pid"])):
            stopped.append({"ctld": "slurmctld"}.get(name, name))
    return stopped


def kill_node(folder: str) -> list[int]:
    """The node dies: slurmd, every slurmstepd of this cluster and everything they run (its jobs) stop at once
    (SIGSTOP), then get SIGKILL, the deepest first. None may see another die and report it: an srun that did asked
    slurmctld to cancel its step, and that request, queued for the dead node, cancelled the requeued job's step of
    the same id once the node was back. (Parents first, an srun whose batch script died was continued by the kernel,
    its process group orphaned, and did just that.)"""
    tree = daemon.parents()
    node = {pid for pid in tree if daemon.command(pid) in ("slurmd", "slurmstepd") and daemon.ours(pid, folder)}
    victims = sorted(daemon.descendants(node, tree), key=lambda pid: -depth(pid, tree))
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5  # a signal takes effect when its process is next scheduled
    while any(daemon.state(pid) not in ("T", "Z", "") for pid in victims) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return victims
