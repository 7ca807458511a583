"""OutagePoll (infra/consumer_loop.py): retriable poll errors become empty polls, logged sparingly."""

from __future__ import annotations

import logging
import threading

import pytest
from kafka.errors import AuthorizationError, KafkaConnectionError, KafkaTimeoutError

from genrec.infra.consumer_loop import OutagePoll


class ScriptedConsumer:
    def __init__(self, script):
        self.script = list(script)

    def poll(self, **kwargs):
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step


def test_retriable_errors_become_empty_polls_with_a_growing_back_off(caplog):
    stop = threading.Event()
    waits = []
    stop.wait = lambda timeout=None: waits.append(timeout) or False
    guard = OutagePoll("ingest", stop=stop, first_backoff_s=0.5, max_backoff_s=1.5, log_every_s=1e9)
    errors = [KafkaConnectionError("refused"), KafkaTimeoutError(), KafkaConnectionError("x")]
    consumer = ScriptedConsumer([*errors, {"tp": [1]}, {}])
    with caplog.at_level(logging.INFO, logger="genrec.kafka"):
        assert [guard.poll(consumer, timeout_ms=10) for _ in errors] == [{}, {}, {}]
        assert guard.outage_s() > 0 and guard.errors == 3
        assert guard.poll(consumer, timeout_ms=10) == {"tp": [1]}
    assert waits == [0.5, 1.0, 1.5]
    assert guard.outage_s() == 0.0
    messages = [r.getMessage() for r in caplog.records]
    # one line when it starts, one when it ends: not one per failed poll
    assert len(messages) == 2 and "retrying" in messages[0] and "again after" in messages[1]
    # the next outage starts from the first back-off again
    guard.poll(ScriptedConsumer([KafkaConnectionError("again")]))
    assert waits[-1] == 0.5


def test_a_long_outage_is_logged_every_log_every_s(caplog):
    stop = threading.Event()
    stop.wait = lambda timeout=None: False
    guard = OutagePoll("online", stop=stop, log_every_s=0.0)
    with caplog.at_level(logging.WARNING, logger="genrec.kafka"):
        for _ in range(3):
            guard.poll(ScriptedConsumer([KafkaConnectionError("refused")]))
    assert len(caplog.records) == 3 and "unreachable for" in caplog.records[-1].getMessage()


def test_errors_that_retrying_cannot_fix_are_raised():
    guard = OutagePoll("ingest")
    with pytest.raises(AuthorizationError):
        guard.poll(ScriptedConsumer([AuthorizationError("denied")]))
    assert guard.errors == 0 and guard.outage_s() == 0.0


def test_a_stop_request_ends_the_back_off_at_once():
    stop = threading.Event()
    stop.set()
    guard = OutagePoll("ingest", stop=stop, first_backoff_s=60.0)
    assert guard.poll(ScriptedConsumer([KafkaConnectionError("refused")])) == {}  # not after 60 s
