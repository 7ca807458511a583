"""A Kafka cluster that cannot be reached (infra/kafka_clients.py): one line, exit code 2, no traceback.

No broker is needed: "unreachable" is a port that is bound but not listening (connections are
refused, and nothing else can take it meanwhile), "not Kafka" a port that accepts and stays
silent. Timeouts are kept short through ``kafka.connect_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from kafka.errors import KafkaTimeoutError

from genrec.infra import kafka_clients
from genrec.infra.errors import UserFacingError
from genrec.infra.kafka_clients import KafkaUnreachableError, open_client, wait_for_kafka
from genrec.infra.settings import KafkaSettings, Settings
from genrec.ingest.replay import replay_events

GENREC = Path(sys.executable).parent / "genrec"


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port nobody listens on: bound here, never listening, so connecting is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


class RecordingClient:
    """Stands in for a kafka-python client class."""

    calls: list[dict] = []
    error: BaseException | None = None

    def __init__(self, **config) -> None:
        RecordingClient.calls.append(config)
        if RecordingClient.error is not None:
            raise RecordingClient.error


@pytest.fixture(autouse=True)
def _fresh_recorder() -> None:
    RecordingClient.calls, RecordingClient.error = [], None


def test_nothing_listening_is_one_user_facing_error_and_no_client(closed_port) -> None:
    kafka = KafkaSettings(bootstrap=f"127.0.0.1:{closed_port}", connect_timeout_s=0.3)
    with pytest.raises(KafkaUnreachableError) as caught:
        open_client(RecordingClient, kafka)
    message = str(caught.value)
    assert f"cannot reach Kafka at 127.0.0.1:{closed_port}" in message
    assert "\n" not in message and "GENREC_KAFKA__BOOTSTRAP" in message
    assert isinstance(caught.value, UserFacingError) and isinstance(caught.value, TimeoutError)
    assert RecordingClient.calls == []  # never built: kafka-python would log every refusal


def test_a_long_wait_says_what_it_waits_for(closed_port, monkeypatch, caplog) -> None:
    monkeypatch.setattr(kafka_clients, "WAIT_LOG_S", 0.1)
    monkeypatch.setattr(kafka_clients, "PROBE_EVERY_S", 0.02)
    kafka = KafkaSettings(bootstrap=f"127.0.0.1:{closed_port}", connect_timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="genrec.kafka"):
        with pytest.raises(KafkaUnreachableError):
            open_client(RecordingClient, kafka)
    waits = [r.getMessage() for r in caplog.records if r.name == "genrec.kafka"]
    assert waits and all(
        m.startswith(f"waiting for Kafka at 127.0.0.1:{closed_port}") for m in waits
    )


def test_the_client_gets_the_settings_and_the_handshake_timeout(silent_port) -> None:
    kafka = KafkaSettings(bootstrap=f"127.0.0.1:{silent_port}", connect_timeout_s=1.5)
    client = open_client(RecordingClient, kafka, acks="all", client_id="mine")
    assert isinstance(client, RecordingClient)
    [config] = RecordingClient.calls
    assert config["bootstrap_servers"] == [f"127.0.0.1:{silent_port}"]
    assert config["bootstrap_timeout_ms"] == 1500 and config["acks"] == "all"
    assert config["client_id"] == "mine"  # the caller's options win


def test_a_silent_listener_is_named_and_other_errors_keep_their_traceback(silent_port) -> None:
    kafka = KafkaSettings(bootstrap=f"127.0.0.1:{silent_port}", connect_timeout_s=1.0)
    RecordingClient.error = KafkaTimeoutError("Unable to bootstrap from [...]")
    with pytest.raises(KafkaUnreachableError, match="accepts connections but did not answer"):
        open_client(RecordingClient, kafka)
    RecordingClient.error = TypeError("unexpected keyword argument 'ack'")  # a bug, not Kafka
    with pytest.raises(TypeError):
        open_client(RecordingClient, kafka)


def test_wait_for_kafka_is_one_line_too(closed_port, silent_port) -> None:
    with pytest.raises(KafkaUnreachableError, match="nothing accepted a connection within 0.5 s"):
        wait_for_kafka(KafkaSettings(bootstrap=f"127.0.0.1:{closed_port}"), timeout=0.5)
    with pytest.raises(KafkaUnreachableError, match="did not answer as a Kafka broker"):
        wait_for_kafka(KafkaSettings(bootstrap=f"127.0.0.1:{silent_port}"), timeout=1.0)


class FailingProducer:
    def __init__(self, send_error: BaseException | None = None) -> None:
        self.send_error = send_error

    def send(self, topic, key, value):
        if self.send_error is not None:
            raise self.send_error
        return self

    def add_errback(self, callback) -> None:  # every send fails once flushed
        callback(KafkaTimeoutError("Expiring 1 record(s): 120000 ms has passed"))

    def flush(self) -> None:
        pass


def test_replay_failures_name_the_topic_and_the_address(tmp_path) -> None:
    settings = Settings(home=tmp_path, kafka=KafkaSettings(bootstrap="kafka-1:9092"))
    frame = pd.DataFrame({"user_id": ["u1", "u2"], "item_id": ["i1", "i2"], "timestamp": [1, 2]})
    missing_topic = FailingProducer(KafkaTimeoutError("Failed to update metadata after 60.0 secs."))
    with pytest.raises(UserFacingError, match=r"cannot produce to genrec.user-events at kafka-1"):
        replay_events(settings, frame, producer=missing_topic, progress=False)
    with pytest.raises(
        UserFacingError, match=r"2 of 2 events were not acknowledged by Kafka at kafka-1"
    ):
        replay_events(settings, frame, producer=FailingProducer(), progress=False)


@pytest.mark.parametrize(
    "command",
    [
        ["replay", "--dataset", "ml-100k", "--no-items", "--limit", "10"],
        ["topics", "create", "--wait", "1"],
        ["ingest", "--exit-when-idle", "1"],
        ["serve", "--exit-when-idle", "1", "--no-metrics"],
    ],
    ids=lambda command: command[0],
)
def test_the_cli_says_so_in_one_line_and_exits_2(command, closed_port, tmp_path) -> None:
    bootstrap = f"127.0.0.1:{closed_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENREC_")}
    env |= {
        "GENREC_HOME": str(tmp_path),
        "GENREC_KAFKA__BOOTSTRAP": bootstrap,
        "GENREC_KAFKA__CONNECT_TIMEOUT_S": "1",
    }
    done = subprocess.run(
        [str(GENREC), *command], env=env, capture_output=True, text=True, timeout=120
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"ERROR genrec: cannot reach Kafka at {bootstrap}: " in lines[-1], done.stderr
    assert not [line for line in lines[:-1] if " ERROR " in line or " CRITICAL " in line]
    if command[0] != "serve":  # serve says first which serving version it found
        assert len(lines) == 1, done.stderr
