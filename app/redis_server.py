"""A throwaway local ``redis-server`` for tests, benches and local trials (never for production).

Production points ``redis.host``/``redis.port`` at its own server (with AUTH and TLS
from settings); this module only starts Debian's ``redis-server`` (``make redis``
installs it) on a free loopback port with its own temporary directory, no persistence,
and can stop and start it again on the same port (outage tests).

Example::

    with LocalRedis.start() as server:
        settings = Settings(online={"kv_store": "redis"}, redis=server.settings())
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


class RedisUnavailable(RuntimeError):
    """``redis-server`` is not installed (``make redis`` installs it)."""


# Redis Cluster talks to its peers on the port 10,000 above the client port, and refuses a
# client port above 55,535; the kernel's ephemeral ports reach 60,999.
CLUSTER_BUS_OFFSET = 10_000
CLUSTER_MAX_PORT = 65_535 - CLUSTER_BUS_OFFSET


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node one at most 55,535 whose bus port is free."""
    if not cluster:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    for port in random.sample(range(20_000, CLUSTER_MAX_PORT + 1), 200):
        if _bindable(port) and _bindable(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node (port and port + 10,000)")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class LocalRedis:
    """A private redis-server: ``start()``, ``stop()``, ``restart()``, ``settings()``.

    ``cluster=True`` starts it as a one-node Redis Cluster holding every slot: it
    refuses multi-key commands across slots, as a real cluster does. ``tls=True``: TLS
    only, with a self-signed certificate for 127.0.0.1 made by ``openssl`` (``ca_file``).
    """

    def __init__(
        self, root: Path, port: int, password: str | None, cluster: bool, tls: bool = False
    ) -> None:
        self.root, self.port, self.password, self.cluster = root, port, password, cluster
        self.tls = tls
        self.ca_file, self.key_file = root / "server.crt", root / "server.key"
        self.process: subprocess.Popen | None = None

    @classmethod
    def start(
        cls,
        *,
        password: str | None = None,
        cluster: bool = False,
        tls: bool = False,
        timeout: float = 10.0,
    ) -> LocalRedis:
        if shutil.which("redis-server") is None:
            raise RedisUnavailable("redis-server not found; run `make redis`")
        root = Path(tempfile.mkdtemp(prefix="genrec-redis-"))
        server = cls(root, free_port(cluster), password, cluster, tls)
        if tls:
            server._make_certificate()
        server.resume(timeout)
        return server

    def _make_certificate(self) -> None:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-keyout", str(self.key_file), "-out", str(self.ca_file), "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True,
        )  # fmt: skip

    def _config(self) -> str:
        lines = [
            f"port {0 if self.tls else self.port}", "bind 127.0.0.1", f"dir {self.root}", 'save ""',
            "appendonly no", "maxmemory-policy noeviction", "daemonize no",
            f"logfile {self.root / 'redis.log'}",
        ]  # fmt: skip
        if self.password:
            lines.append(f"requirepass {self.password}")
        if self.tls:
            lines += [f"tls-port {self.port}", f"tls-cert-file {self.ca_file}",
                      f"tls-key-file {self.key_file}", f"tls-ca-cert-file {self.ca_file}",
                      "tls-auth-clients no"]  # fmt: skip
        if self.cluster:
            lines += ["cluster-enabled yes", f"cluster-config-file {self.root / 'nodes.conf'}"]
        return "\n".join(lines) + "\n"

    def resume(self, timeout: float = 10.0) -> None:
        """Start the server (again) on its port; returns once it answers PING."""
        config = self.root / "redis.conf"
        config.write_text(self._config())
        config.chmod(0o600)  # it holds the password
        self.process = subprocess.Popen(
            ["redis-server", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.halt()
                raise RuntimeError(f"redis-server did not start; see {self.root / 'redis.log'}")
            time.sleep(0.02)
        if self.cluster:
            self.client().execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
            while self.client().execute_command("CLUSTER", "INFO").find(b"cluster_state:ok") < 0:
                time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            return bool(self.client(socket_timeout=0.5).ping())
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def client(self, **options: Any):
        """A plain redis-py client of this server (also for a one-node cluster: one node)."""
        import redis

        if self.tls:
            options = {"ssl": True, "ssl_ca_certs": str(self.ca_file), **options}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **options)

    def settings(self, **overrides: Any) -> dict[str, Any]:
        """The ``redis`` settings section that reaches this server."""
        tls = {"tls": True, "tls_ca_file": str(self.ca_file)} if self.tls else {}
        return {"host": "127.0.0.1", "port": self.port, "password": self.password,
                "cluster": self.cluster, **tls, **overrides}  # fmt: skip

    def halt(self, save: bool = False) -> None:
        """Stop the server, keep its directory: ``resume`` starts it again, empty, or with
        the data it had when ``save`` (SHUTDOWN SAVE writes a snapshot it reloads)."""
        if save and self.process is not None and self.process.poll() is None:
            self.client().shutdown(save=True)
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        (self.root / "nodes.conf").unlink(missing_ok=True)

    def restart(self) -> None:
        self.halt()
        self.resume()

    def stop(self) -> None:
        try:
            self.halt()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()
