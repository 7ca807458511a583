"""A throwaway local PostgreSQL server for tests and local trials (never for production).

Production points ``GENREC_DATABASE_URL`` at its own server; this module only
starts a private cluster in a temporary directory on a free loopback port, as
the ``postgres`` OS user when run as root (PostgreSQL refuses to run as root).

Example::

    with LocalPostgres.start() as server:
        url = server.create_database("genrec_test")
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class PostgresUnavailable(RuntimeError):
    """PostgreSQL binaries are not installed (``make test`` installs them)."""


def find_postgres_bindir() -> Path:
    """Directory holding initdb/pg_ctl: $GENREC_PG_BINDIR, Debian's layout, or PATH."""
    explicit = os.environ.get("GENREC_PG_BINDIR")
    candidates = [Path(explicit)] if explicit else []
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    for folder in candidates:
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder
    raise PostgresUnavailable("PostgreSQL server binaries not found; install package 'postgresql'")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalPostgres:
    """A private PostgreSQL cluster: ``start()``, ``create_database(name)``, ``stop()``."""

    def __init__(self, root: Path, port: int, bindir: Path, run_as: str | None) -> None:
        self.root, self.port, self.bindir, self.run_as = root, port, bindir, run_as
        self.data_dir = root / "data"

    @classmethod
    def start(cls, timeout: float = 60.0, fsync: bool = False) -> LocalPostgres:
        """initdb + start on a free port; ``fsync`` off (tests) unless a benchmark asks."""
        bindir = find_postgres_bindir()
        run_as = "postgres" if os.geteuid() == 0 else None
        root = Path(tempfile.mkdtemp(prefix="genrec-pg-"))
        if run_as:
            user = pwd.getpwnam(run_as)
            os.chown(root, user.pw_uid, user.pw_gid)
        server = cls(root, free_port(), bindir, run_as)
        server._run(
            "initdb", "-D", str(server.data_dir), "-U", "postgres", "-A", "trust", "-E", "UTF8"
        )
        options = (
            f"-p {server.port} -k {root} -c listen_addresses=127.0.0.1 "
            f"-c fsync={'on' if fsync else 'off'}"
        )
        server._run(
            "pg_ctl", "-D", str(server.data_dir), "-l", str(root / "server.log"),
            "-o", options, "-w", "-t", str(int(timeout)), "start",
        )  # fmt: skip
        return server

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bindir / tool), *args]
        if self.run_as:
            command = ["runuser", "-u", self.run_as, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, cwd=self.root)
        if result.returncode != 0:
            raise RuntimeError(f"{tool} failed: {result.stderr.strip() or result.stdout.strip()}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create an empty database and return its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
        ) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop")
        finally:
            time.sleep(0.1)
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()
