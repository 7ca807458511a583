"""genrec commands as child processes of the demo and the benchmarks (app layer).

``start_service`` runs a ``genrec`` subcommand configured like this process
(data folder, database, bootstrap), ``stop_service`` stops it the way an
operator would (SIGTERM, then SIGKILL after a timeout), and
``skip_group_to_end`` commits a consumer group at the end of a topic so that a
service started next serves only what comes after.

Example::

    >>> process = start_service(settings, ["serve", "--metrics-port", "0"], Path("serve.log"))  # doctest: +SKIP
    >>> stop_service(process)  # doctest: +SKIP
    0
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndMetadata

from genrec.infra.kafka_clients import open_client
from genrec.infra.settings import Settings


def skip_group_to_end(settings: Settings, group_id: str, topic: str) -> None:
    """Commit ``group_id``'s offsets at the end of ``topic``: it serves only what comes next."""
    consumer = open_client(
        KafkaConsumer, settings.kafka, group_id=group_id, enable_auto_commit=False
    )
    partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
    ends = consumer.end_offsets(partitions)
    consumer.commit({tp: OffsetAndMetadata(offset, "", -1) for tp, offset in ends.items()})
    consumer.close()


def start_service(settings: Settings, args: list[str], log_path: Path) -> subprocess.Popen:
    """A ``genrec`` subcommand as its own process, configured like this one."""
    env = {
        **os.environ,
        "GENREC_DATA_DIR": str(settings.data_dir),
        "GENREC_DATABASE_URL": str(settings.database_url),
        "GENREC_KAFKA__BOOTSTRAP": settings.kafka.bootstrap,
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, "-m", "genrec.app.cli", *args]
    handle = log_path.open("ab")
    return subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)


def stop_service(process: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM, wait up to ``timeout`` s, then SIGKILL; returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
