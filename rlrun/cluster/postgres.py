"""PostgreSQL for MLflow's store: a database cluster of its own (initdb, as the postgres user: PostgreSQL refuses to run
as root), listening on 127.0.0.1 at its own port with its socket in its own folder, a role `mlflow` with a password
(scram-sha-256 over TCP) and a database `mlflow` it owns. The password is in <folder>/postgres/pgpass, which libpq
reads through PGPASSFILE: it is never on a command line.
"""

from __future__ import annotations

import glob
import os
import secrets

from . import daemon
from .daemon import fail, run

USER = "postgres"
DATABASE = ROLE = "mlflow"


def paths(folder: str) -> dict[str, str]:
    d = os.path.join(folder, "postgres")
    return {"dir": d, "data": os.path.join(d, "data"), "log": os.path.join(d, "postgres.log"),
            "pgpass": os.path.join(d, "pgpass")}


def binary(name: str) -> str:
    """A PostgreSQL server program: Debian keeps them in /usr/lib/postgresql/<version>/bin, off the PATH."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    if found:
        return found[-1]
    fail(f"postgres: {name}", f"{name} is not installed (Debian: apt-get install -y postgresql)")
    return name


def uri(folder: str, port: int) -> str:
    return f"postgresql://{ROLE}@127.0.0.1:{port}/{DATABASE}"


def start(folder: str, port: int) -> None:
    """initdb (once), the server (unless it runs), then the role and the database (once)."""
    p = paths(folder)
    daemon.reachable(p["dir"], USER)
    daemon.owner(p["dir"], USER, 0o755)
    env = daemon.environment(folder)
    fresh = not os.path.exists(os.path.join(p["data"], "PG_VERSION"))
    if fresh:
        run("postgres: initdb", [binary("initdb"), "-D", p["data"], "-U", USER, "--auth-local=trust",
                                 "--auth-host=scram-sha-256", "-E", "UTF8"], USER, env, timeout=300)
    if not running(folder):
        server(folder, port, "start")
    if fresh:
        password = secrets.token_hex(16)
        sql = f"CREATE ROLE {ROLE} LOGIN PASSWORD '{password}';\nCREATE DATABASE {DATABASE} OWNER {ROLE};\n"
        run("postgres: the role and database for MLflow (psql)",  # on stdin: no password on a command line
            ["psql", "-h", p["dir"], "-p", str(port), "-U", USER, "-d", "postgres", "-v", "ON_ERROR_STOP=1"],
            USER, env, log=p["log"], stdin=sql)
        fd = os.open(p["pgpass"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"127.0.0.1:{port}:{DATABASE}:{ROLE}:{password}\n")
    check(folder, port)


def server(folder: str, port: int, action: str) -> None:
    """pg_ctl start | stop | restart, waiting until it is done (stop and restart: fast, open sessions ended)."""
    p = paths(folder)
    cmd = [binary("pg_ctl"), "-D", p["data"], "-l", p["log"], "-w", "-t", "120"]
    if action in ("start", "restart"):
        cmd += ["-o", f"-p {port} -k {p['dir']} -c listen_addresses=127.0.0.1"]
    if action in ("stop", "restart"):
        cmd += ["-m", "fast"]
    run(f"postgres: pg_ctl {action}", [*cmd, action], USER, daemon.environment(folder), log=p["log"], timeout=180)


def check(folder: str, port: int) -> None:
    """A query as the mlflow role over TCP, with the password from pgpass: what the MLflow server will do."""
    p = paths(folder)
    run("postgres: a query as the mlflow role (psql over TCP)",
        ["psql", "-h", "127.0.0.1", "-p", str(port), "-U", ROLE, "-d", DATABASE, "-w", "-tAc", "SELECT 1"],
        env=daemon.environment(folder, PGPASSFILE=p["pgpass"]), log=p["log"])


def running(folder: str) -> bool:
    return daemon.alive(daemon.read_pid(os.path.join(paths(folder)["data"], "postmaster.pid")))


def stop(folder: str, port: int) -> list[str]:
    if not running(folder):
        return []
    server(folder, port, "stop")
    return ["postgres"]
