"""The local Apache Kafka broker behind ``genrec kafka up`` (infra step).

A real single-node Kafka 4.x broker in KRaft mode (broker and controller in one
JVM), assembled from Maven Central jars by ``app/kafka/pom.xml`` and cached
outside the repository in ``${XDG_CACHE_HOME:-~/.cache}/genrec/kafka/<version>/libs``.
It exists for one machine and for the tests; the rest of genrec only ever sees
``settings.kafka`` and works against any cluster.

Layout of ``data_dir`` (``settings.data_dir / "kafka"``): ``server.properties``,
``cluster.id`` (written once, before the storage is formatted), ``kraft-logs/``
(topics and metadata, kept across restarts), ``broker.log`` (the JVM's output),
``broker.pid``.

Example::

    >>> from pathlib import Path
    >>> broker = KafkaBroker(Path("/tmp/genrec-kafka"), bootstrap="127.0.0.1:19092")
    >>> broker.up()  # doctest: +SKIP
    '127.0.0.1:19092'
    >>> broker.status().running  # doctest: +SKIP
    True
    >>> broker.down()  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from genrec.infra.errors import UserFacingError

log = logging.getLogger(__name__)

KAFKA_VERSION = "4.3.1"
# log4j2 version that each Kafka release is built against (its gradle/dependencies.gradle).
LOG4J_VERSIONS = {"4.3.1": "2.25.4", "4.1.1": "2.24.3"}
CONFIG_DIR = Path(__file__).resolve().parent / "kafka"
READY_LINE = "Kafka Server started"
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies"


class KafkaBrokerError(UserFacingError):
    """The local broker could not be prepared, started or stopped; the message says why."""


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    pid: int | None
    bootstrap: str

    def __str__(self) -> str:
        if self.running:
            return f"running pid={self.pid} bootstrap={self.bootstrap}"
        return f"stopped bootstrap={self.bootstrap}"


# --- jars -----------------------------------------------------------------------------


def kafka_cache_dir(version: str = KAFKA_VERSION) -> Path:
    """Where the jars of one Kafka version live, shared by every checkout of genrec."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home).expanduser() / "genrec" / "kafka" / version


def ensure_kafka_jars(version: str = KAFKA_VERSION) -> Path:
    """The directory holding the broker's runtime classpath, resolved by Maven on first use."""
    if version not in LOG4J_VERSIONS:
        raise KafkaBrokerError(
            f"unsupported Kafka version {version!r}; known: {sorted(LOG4J_VERSIONS)}"
        )
    cache = kafka_cache_dir(version)
    libs = cache / "libs"
    if _has_jars(libs):
        return libs
    cache.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache / ".lock"):  # parallel test runs must not resolve twice
        if _has_jars(libs):
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise KafkaBrokerError(
                "Maven (mvn) is needed once to fetch the Kafka jars from Maven Central; "
                f"install it (apt-get install maven) or put the jars into {libs}"
            )
        partial = cache / f"libs.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        command = [
            mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(CONFIG_DIR / "pom.xml"),
            DEPENDENCY_PLUGIN, f"-DoutputDirectory={partial}", "-DincludeScope=runtime",
            f"-Dkafka.version={version}", f"-Dlog4j.version={LOG4J_VERSIONS[version]}",
        ]  # fmt: skip
        log.info(
            "resolving Kafka %s jars from Maven Central into %s (first time only)", version, libs
        )
        started = time.monotonic()
        result = subprocess.run(command, capture_output=True, text=True, cwd=cache)
        if result.returncode != 0 or not _has_jars(partial):
            shutil.rmtree(partial, ignore_errors=True)
            output = (result.stdout + result.stderr).strip()[-3000:]
            raise KafkaBrokerError(f"mvn could not resolve Kafka {version} jars:\n{output}")
        partial.rename(libs)  # atomic: libs/ exists only when complete
        log.info("Kafka jars ready in %.1fs", time.monotonic() - started)
    return libs


def _has_jars(libs: Path) -> bool:
    return any(libs.glob("kafka_2.13-*.jar"))


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    candidate = Path(java_home) / "bin" / "java" if java_home else None
    if candidate is not None and candidate.exists():
        return str(candidate)
    found = shutil.which("java")
    if found is None:
        raise KafkaBrokerError(
            "Kafka 4 needs Java 17 or newer: install a JDK (apt-get install "
            "openjdk-17-jre-headless) or set JAVA_HOME"
        )
    return found


# --- configuration --------------------------------------------------------------------


def new_cluster_id() -> str:
    """A KRaft cluster id as Kafka makes it: base64url of 16 random bytes, no padding."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):  # Kafka's command-line tools would read it as a flag
            return cluster_id


def parse_bootstrap(bootstrap: str) -> tuple[str, int]:
    """``"127.0.0.1:9092"`` -> ``("127.0.0.1", 9092)``; the local broker has exactly one address."""
    text = bootstrap.strip()
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or "," in text or not port.isdigit() or not 0 < int(port) < 65536:
        raise KafkaBrokerError(
            f"the local broker needs one HOST:PORT to listen on, got bootstrap={bootstrap!r}"
        )
    if host in ("0.0.0.0", "::"):
        raise KafkaBrokerError(
            "the local broker advertises its listen address to clients, so it cannot be "
            f"a wildcard ({host}); use 127.0.0.1 or this machine's address"
        )
    return host, int(port)


def server_properties(
    host: str,
    port: int,
    controller_port: int,
    log_dirs: Path,
    num_partitions: int,
    node_id: int = 1,
    voters: str | None = None,
    replicas: int = 1,
) -> str:
    """``server.properties`` of a combined broker + controller node: alone (replication 1),
    or node ``node_id`` of a cluster whose controller quorum is ``voters`` and whose topics
    keep ``replicas`` copies (2 in sync where there are 3)."""
    address, controller = _address(host, port), _address(host, controller_port)
    in_sync = "2" if replicas >= 3 else "1"
    properties = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        # A static voter set (not --standalone's dynamic quorum): the voters come from
        # this file on every start, so a restart on other ports keeps working.
        "controller.quorum.voters": voters or f"{node_id}@{controller}",
        "listeners": f"PLAINTEXT://{address},CONTROLLER://{controller}",
        "advertised.listeners": f"PLAINTEXT://{address},CONTROLLER://{controller}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(log_dirs),
        "num.partitions": str(num_partitions),
        "default.replication.factor": str(replicas),
        "min.insync.replicas": in_sync,
        # Topics come from `genrec topics create`, as on a production cluster: a typo in a
        # topic name then fails loudly instead of creating a stray topic.
        "auto.create.topics.enable": "false",
        # Internal topics with 1 partition start in milliseconds instead of seconds.
        "offsets.topic.replication.factor": str(replicas),
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": in_sync,
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": str(replicas),
        "share.coordinator.state.topic.min.isr": in_sync,
        "share.coordinator.state.topic.num.partitions": "1",
        # The default 3 s wait before the first rebalance would slow every consumer start.
        "group.initial.rebalance.delay.ms": "0",
    }
    lines = ["# Written by genrec.app.kafka_broker on every start; edits are overwritten."]
    lines += [f"{key}={value}" for key, value in properties.items()]
    return "\n".join(lines) + "\n"


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def pick_free_ports(count: int = 1, host: str = "127.0.0.1") -> list[int]:
    """Ports nobody listens on right now (held open together, so they are distinct)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
        return True
    return False


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


# --- the broker process -----------------------------------------------------------------


class KafkaBroker:
    """One local broker: a background JVM with its pid file, log and data in ``data_dir``."""

    def __init__(
        self,
        data_dir: Path,
        bootstrap: str = "127.0.0.1:9092",
        controller_port: int | None = None,
        num_partitions: int = 6,
        heap: str = "512m",
        node_id: int = 1,
        voters: str | None = None,
        replicas: int = 1,
        cluster_id: str | None = None,
    ) -> None:
        """One node; ``node_id``, ``voters``, ``replicas`` and a shared ``cluster_id`` make it
        a member of a ``KafkaCluster``."""
        self.node_id, self.voters, self.replicas, self.cluster_id = (
            node_id, voters, replicas, cluster_id,
        )  # fmt: skip
        self.host, self.port = parse_bootstrap(bootstrap)
        self.controller_port = controller_port if controller_port is not None else self.port + 1
        if self.controller_port == self.port or not 0 < self.controller_port < 65536:
            raise KafkaBrokerError(f"bad controller port {self.controller_port} for {bootstrap}")
        if not re.fullmatch(r"\d+[kKmMgG]?", heap):
            raise KafkaBrokerError(f"heap must look like 512m or 2g, got {heap!r}")
        if num_partitions < 1:
            raise KafkaBrokerError(f"num_partitions must be >= 1, got {num_partitions}")
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.bootstrap = _address(self.host, self.port)
        self.num_partitions = num_partitions
        self.heap = heap
        self.properties_file = self.data_dir / "server.properties"
        self.cluster_id_file = self.data_dir / "cluster.id"
        self.kraft_logs = self.data_dir / "kraft-logs"
        self.log_file = self.data_dir / "broker.log"
        self.pid_file = self.data_dir / "broker.pid"
        self._process: subprocess.Popen[bytes] | None = None  # set when this object started it

    @classmethod
    def from_settings(cls, settings) -> KafkaBroker:
        """The broker that ``genrec kafka`` manages for a :class:`~genrec.infra.settings.Settings`."""
        broker = settings.kafka_broker
        return cls(
            settings.data_dir / "kafka",
            bootstrap=settings.kafka.bootstrap,
            controller_port=broker.controller_port,
            num_partitions=broker.num_partitions,
            heap=broker.heap,
        )

    def up(self, timeout: float = 90.0) -> str:
        """Start the broker unless it runs already; wait until clients can connect."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with _file_lock(self.data_dir / ".lock"):
            current = self.status()
            if current.running:
                if current.bootstrap != self.bootstrap:
                    log.warning(
                        "a broker on %s already runs from %s; `genrec kafka down` first to move it to %s",
                        current.bootstrap,
                        self.data_dir,
                        self.bootstrap,
                    )
                return current.bootstrap
            log_offset = self.launch()
            self.wait_ready(log_offset, timeout)
        log.info("Kafka broker ready at %s (pid %s)", self.bootstrap, self._read_pid())
        return self.bootstrap

    def launch(self) -> int:
        """Write the properties, format the storage once and start the JVM (not waiting for
        it: a cluster's nodes are ready only once a quorum of them runs). Returns the log's
        size before the start, for ``wait_ready``."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.pid_file.unlink(missing_ok=True)  # stale: the broker died without `down`
        libs = ensure_kafka_jars()
        for port in (self.port, self.controller_port):
            if not _port_free(self.host, port):
                raise KafkaBrokerError(
                    f"{self.host}:{port} is in use by another process; stop it or pick "
                    "other ports (GENREC_KAFKA__BOOTSTRAP, GENREC_KAFKA_BROKER__CONTROLLER_PORT)"
                )
        self.properties_file.write_text(
            server_properties(
                self.host,
                self.port,
                self.controller_port,
                self.kraft_logs,
                self.num_partitions,
                self.node_id,
                self.voters,
                self.replicas,
            )  # fmt: skip
        )
        self._format_once(libs)
        log_offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        self._launch(libs)
        return log_offset

    def down(self, timeout: float = 30.0) -> None:
        """Stop the broker: SIGTERM (a clean shutdown), SIGKILL if it is still there after ``timeout``."""
        pid = self.terminate()
        if pid is not None and not self._wait_exit(pid, timeout):
            log.warning("Kafka broker pid %d ignored SIGTERM for %.0fs; killing it", pid, timeout)
            _signal(pid, signal.SIGKILL)
            self._wait_exit(pid, 10.0)
        self.pid_file.unlink(missing_ok=True)
        self._process = None

    def terminate(self) -> int | None:
        """SIGTERM the broker (a clean shutdown) without waiting for it; ``down`` waits.
        Returns the pid signalled, None when no broker was running."""
        pid = self._read_pid()
        if pid is None or not self._alive(pid):
            return None
        _signal(pid, signal.SIGTERM)
        return pid

    def kill(self) -> None:
        """SIGKILL the broker and leave its pid file behind, as a crash would (for tests)."""
        pid = self._read_pid()
        if pid is not None and self._alive(pid):
            _signal(pid, signal.SIGKILL)
            self._wait_exit(pid, 10.0)

    def status(self) -> BrokerStatus:
        pid = self._read_pid()
        if pid is not None and self._alive(pid):
            return BrokerStatus(True, pid, self._running_bootstrap())
        return BrokerStatus(False, None, self.bootstrap)

    def log_tail(self, lines: int = 30, since: int = 0) -> str:
        """The last lines of ``broker.log`` (from byte ``since``), for error messages."""
        if not self.log_file.exists():
            return "(no broker.log yet)"
        with open(self.log_file, "rb") as handle:
            handle.seek(since)
            text = handle.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _format_once(self, libs: Path) -> None:
        """Format the storage before the very first start only; later starts keep the data."""
        if (self.kraft_logs / "meta.properties").exists():
            return
        if not self.cluster_id_file.exists():
            self.cluster_id_file.write_text((self.cluster_id or new_cluster_id()) + "\n")
        cluster_id = self.cluster_id_file.read_text().strip()
        command = [
            _java(), "-Xmx256m", f"-Dlog4j2.configurationFile={CONFIG_DIR / 'tools-log4j2.yaml'}",
            "-cp", f"{libs}/*", "kafka.tools.StorageTool", "format", "--ignore-formatted",
            "-t", cluster_id, "-c", str(self.properties_file),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=180)
        if result.returncode != 0:
            output = (result.stdout + result.stderr).strip()[-3000:]
            raise KafkaBrokerError(
                f"formatting Kafka storage in {self.kraft_logs} failed:\n{output}"
            )

    def _launch(self, libs: Path) -> None:
        command = [
            _java(), f"-Xmx{self.heap}", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
            "-XX:InitiatingHeapOccupancyPercent=35", "-XX:+ExplicitGCInvokesConcurrent",
            "-Djava.awt.headless=true", f"-Dkafka.logs.dir={self.data_dir / 'logs'}",
            f"-Dlog4j2.configurationFile={CONFIG_DIR / 'log4j2.yaml'}",
            "-cp", f"{libs}/*", "kafka.Kafka", str(self.properties_file),
        ]  # fmt: skip
        with open(self.log_file, "ab") as log_handle:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log_handle.write(f"--- genrec: starting Kafka broker at {stamp} ---\n".encode())
            log_handle.flush()
            # A new session: the broker outlives `genrec kafka up` and ignores its Ctrl-C.
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_handle,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,
            )
        self.pid_file.write_text(f"{self._process.pid}\n")

    def wait_ready(self, log_offset: int, timeout: float) -> None:
        pid = self._read_pid()
        assert pid is not None
        deadline = time.monotonic() + timeout
        while True:
            if not self._alive(pid):
                code = self._process.poll() if self._process is not None else None
                self.pid_file.unlink(missing_ok=True)
                raise KafkaBrokerError(
                    f"Kafka broker exited during start-up (exit code {code}); "
                    f"{self.log_file} ends with:\n{self.log_tail(since=log_offset)}"
                )
            if READY_LINE in self.log_tail(lines=1000, since=log_offset) and _port_open(
                self.host, self.port
            ):
                return
            if time.monotonic() > deadline:
                self.down(timeout=10.0)
                raise KafkaBrokerError(
                    f"Kafka broker not ready after {timeout:.0f}s (stopped it); "
                    f"{self.log_file} ends with:\n{self.log_tail(since=log_offset)}"
                )
            time.sleep(0.2)

    def _read_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().split()[0])
        except (FileNotFoundError, IndexError, ValueError):
            return None

    def _alive(self, pid: int) -> bool:
        """Whether ``pid`` is this data dir's broker (not a dead one, a zombie, or a reused pid)."""
        if self._process is not None and self._process.pid == pid:
            # Our own child: poll() also reaps it. /proc may still show the pre-exec
            # command line for a moment after Popen returns.
            return self._process.poll() is None
        if Path("/proc/self").exists():  # Linux: check what the pid runs, not just that it exists
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
                arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError):
                return False
            if state in ("Z", "X"):
                return False
            if arguments == [b""]:  # mid-exec: no command line to judge by yet
                return True
            return b"kafka.Kafka" in arguments and str(self.properties_file).encode() in arguments
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._alive(pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def _running_bootstrap(self) -> str:
        """The address the running broker was started with (it may differ from ours)."""
        with contextlib.suppress(OSError):
            for line in self.properties_file.read_text().splitlines():
                if line.startswith("advertised.listeners="):
                    for listener in line.split("=", 1)[1].split(","):
                        name, _, address = listener.partition("://")
                        if name == "PLAINTEXT":
                            return address
        return self.bootstrap


def _signal(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


class KafkaCluster:
    """A local cluster of ``len(ports)`` combined broker + controller nodes (KRaft, one
    controller quorum of all of them), from the same jars as ``KafkaBroker``.

    Node i (from 1) lives in ``data_dir/node-i`` and listens on ``ports[i - 1]`` =
    (client port, controller port). Topics default to min(3, nodes) replicas with 2 in
    sync where there are 3, internal topics included, so one node may die without a
    client noticing more than a leader change.

    Example::

        >>> cluster = KafkaCluster(Path("/tmp/genrec-kafka3"), [(19092, 19093), (19094, 19095), (19096, 19097)])
        >>> cluster.up()  # doctest: +SKIP
        '127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096'
        >>> cluster.nodes[0].kill()  # doctest: +SKIP
    """

    def __init__(
        self,
        data_dir: Path,
        ports: list[tuple[int, int]],
        host: str = "127.0.0.1",
        num_partitions: int = 6,
        heap: str = "512m",
    ) -> None:
        if len(ports) < 2:
            raise KafkaBrokerError("a cluster has at least 2 nodes; one node is KafkaBroker")
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        id_file = self.data_dir / "cluster.id"
        if not id_file.exists():
            id_file.write_text(new_cluster_id() + "\n")
        cluster_id = id_file.read_text().strip()
        voters = ",".join(
            f"{i}@{_address(host, controller)}" for i, (_port, controller) in enumerate(ports, 1)
        )
        self.nodes = [
            KafkaBroker(
                self.data_dir / f"node-{i}",
                _address(host, port),
                controller,
                num_partitions,
                heap,
                node_id=i,
                voters=voters,
                replicas=min(3, len(ports)),
                cluster_id=cluster_id,
            )  # fmt: skip
            for i, (port, controller) in enumerate(ports, 1)
        ]
        self.bootstrap = ",".join(node.bootstrap for node in self.nodes)

    @classmethod
    def from_settings(cls, settings, brokers: int) -> KafkaCluster:
        """``brokers`` nodes on consecutive port pairs from ``kafka.bootstrap``'s first port
        (9092: clients on 9092, 9094, 9096; controllers on 9093, 9095, 9097)."""
        host, port = parse_bootstrap(settings.kafka.bootstrap.split(",")[0])
        ports = [(port + 2 * i, port + 2 * i + 1) for i in range(brokers)]
        broker = settings.kafka_broker
        return cls(
            settings.data_dir / "kafka-cluster", ports, host, broker.num_partitions, broker.heap
        )

    def up(self, timeout: float = 120.0) -> str:
        """Start every node that is not running (all at once: a quorum must form), wait."""
        with _file_lock(self.data_dir / ".lock"):
            starting = [(node, node.launch()) for node in self.nodes if not node.status().running]
            deadline = time.monotonic() + timeout
            for node, log_offset in starting:
                node.wait_ready(log_offset, max(1.0, deadline - time.monotonic()))
        log.info("Kafka cluster of %d nodes ready at %s", len(self.nodes), self.bootstrap)
        return self.bootstrap

    def down(self, timeout: float = 30.0) -> None:
        """Stop every node: SIGTERM to all at once, then each is waited for (SIGKILL after
        ``timeout``). One by one, the last node's controlled shutdown waited for a
        controller quorum that had already gone and was killed after ``timeout`` (3 nodes:
        32 s, against 6 s at once)."""
        for node in self.nodes:
            node.terminate()
        for node in self.nodes:
            node.down(timeout)

    def status(self) -> list[BrokerStatus]:
        return [node.status() for node in self.nodes]
