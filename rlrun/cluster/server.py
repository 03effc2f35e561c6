"""MLflow's own tracking server in front of the PostgreSQL store, with proxied artifacts: runs log to
http://127.0.0.1:<port>, and the server writes their artifacts under <folder>/mlflow/artifacts (nodes need no shared
disk for them). Started from this Python's mlflow (the launchers extra brings psycopg, its PostgreSQL driver).
"""

from __future__ import annotations

import os
import sys
import urllib.request

from . import daemon, postgres


def paths(folder: str) -> dict[str, str]:
    d = os.path.join(folder, "mlflow")
    return {"dir": d, "artifacts": os.path.join(d, "artifacts"), "log": os.path.join(d, "server.log"),
            "pid": os.path.join(d, "server.pid")}


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"{url(port)}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start(folder: str, port: int, pg_port: int, timeout: float = 180) -> None:
    p = paths(folder)
    os.makedirs(p["artifacts"], exist_ok=True)
    if healthy(port) and daemon.alive(daemon.read_pid(p["pid"])):  # ours, running already
        return
    if daemon.listening(port):
        daemon.fail("mlflow server", f"port {port} is taken by another program; stop it, or start the cluster in a "
                    "new folder (it picks free ports)")
    try:
        import psycopg  # noqa: F401 - the server's PostgreSQL driver (SQLAlchemy 2.1's default for postgresql://)
    except ImportError:
        daemon.fail("mlflow server", "psycopg (the PostgreSQL driver) is not installed: pip install -e "
                    "'.[launchers]'")
    mlflow = os.path.join(os.path.dirname(sys.executable), "mlflow")
    cmd = [mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", postgres.uri(folder, pg_port), "--artifacts-destination", p["artifacts"]]
    env = daemon.environment(folder, PGPASSFILE=postgres.paths(folder)["pgpass"],
                             MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING="false")
    proc = daemon.spawn(cmd, p["log"], env)
    with open(p["pid"], "w") as f:
        f.write(f"{proc.pid}\n")
    daemon.wait_for(f"mlflow server on port {port} (GET /health)", lambda: healthy(port), timeout, p["log"],
                    alive=lambda: proc.poll() is None)


def stop(folder: str) -> list[str]:
    """SIGTERM to the server's process group (uvicorn and its workers), SIGKILL after 10 s (it takes ~16 s to end
    gracefully here; what it stores is PostgreSQL's to keep, and a client retries what it did not answer)."""
    return ["mlflow server"] if daemon.stop_pid(daemon.read_pid(paths(folder)["pid"]), group=True, wait_s=10) else []
