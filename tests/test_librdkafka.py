"""The librdkafka producer (infra/librdkafka.py): futures, settings pass-through, and
delivery through the real broker (every message acknowledged once, in order per key)."""

from __future__ import annotations

import threading

import pytest
from kafka import KafkaConsumer

from genrec.infra.kafka_clients import KafkaUnreachableError
from genrec.infra.librdkafka import Delivery, LibrdkafkaProducer, ProduceFailed
from genrec.infra.settings import KafkaSettings


def test_callbacks_run_once_whether_added_before_or_after_the_report() -> None:
    early, late, errors = [], [], []
    delivery = Delivery().add_callback(early.append).add_errback(errors.append)
    delivery.report(None, "metadata")
    delivery.add_callback(late.append).add_errback(errors.append)
    assert early == ["metadata"] and late == ["metadata"] and errors == []

    failed, ok = [], []
    lost = Delivery().add_callback(ok.append)
    lost.report("Broker: Message timed out", None)
    lost.add_errback(failed.append)
    assert ok == [] and isinstance(failed[0], ProduceFailed)
    assert "timed out" in str(failed[0])


def test_a_failing_callback_does_not_stop_the_others(caplog) -> None:
    seen = []
    delivery = Delivery().add_callback(lambda _m: 1 / 0).add_callback(seen.append)
    delivery.report(None, "m")
    assert seen == ["m"] and "a delivery callback failed" in caplog.text


def test_security_settings_pass_through_under_librdkafka_names() -> None:
    kafka = KafkaSettings(
        bootstrap="b1:9093, b2:9093", security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
        sasl_plain_username="svc", sasl_plain_password="s3cret", ssl_cafile="/ca.pem",
        ssl_check_hostname=False, client_id="genrec-x",
    )  # fmt: skip
    config = kafka.librdkafka_config()
    assert config == {
        "bootstrap.servers": "b1:9093,b2:9093",
        "security.protocol": "SASL_SSL",
        "client.id": "genrec-x",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "svc",
        "sasl.password": "s3cret",
        "ssl.ca.location": "/ca.pem",
        "ssl.endpoint.identification.algorithm": "none",
    }
    assert "s3cret" not in repr(kafka)  # a SecretStr: revealed only in the client config
    plain = KafkaSettings().librdkafka_config()
    assert "ssl.endpoint.identification.algorithm" not in plain


def test_nothing_listening_is_the_usual_one_line_error() -> None:
    kafka = KafkaSettings(bootstrap="127.0.0.1:1", connect_timeout_s=0.3)
    with pytest.raises(KafkaUnreachableError, match="127.0.0.1:1"):
        LibrdkafkaProducer(kafka)


def test_every_message_reaches_the_topic_once_and_is_acknowledged(kafka_settings) -> None:
    producer = LibrdkafkaProducer(kafka_settings)
    topic = kafka_settings.topic_recommendations
    acked, failed, done = [], [], threading.Event()
    n = 200
    for i in range(n):
        future = producer.send(topic, key=f"u{i % 7}".encode(), value=f"{i}".encode())
        future.add_callback(lambda _m: (acked.append(1), len(acked) == n and done.set()))
        future.add_errback(failed.append)
    assert done.wait(30) and not failed
    producer.close(timeout=10)

    consumer = KafkaConsumer(
        topic, bootstrap_servers=kafka_settings.bootstrap, auto_offset_reset="earliest",
        consumer_timeout_ms=5000, group_id=None,
    )  # fmt: skip
    by_key: dict[bytes, list[int]] = {}
    for record in consumer:
        by_key.setdefault(record.key, []).append(int(record.value))
    consumer.close()
    assert sum(len(v) for v in by_key.values()) == n
    assert all(values == sorted(values) for values in by_key.values())  # a key's order holds
