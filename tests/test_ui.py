"""``genrec ui``: the read-only explorer's figures, its pages over a real serving version,
and the pages in a real headless browser (Debian's Chromium and ChromeDriver)."""

from __future__ import annotations

import hashlib
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from kafka import KafkaProducer
from kafka.partitioner.default import DefaultPartitioner

from genrec.app.ui import status_page
from genrec.app.ui.charts import bar_chart
from genrec.app.ui.last_message import partition_of
from genrec.app.ui.server import create_app
from genrec.infra import metrics
from genrec.infra.database import make_engine
from genrec.infra.settings import Settings
from genrec.schemas.recommendations import RecommendationMessage, ScoredItem
from tests.helpers import wait_for

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
PROMETHEUS_TEXT = """\
# TYPE genrec_request_latency_seconds histogram
genrec_request_latency_seconds_bucket{le="0.01"} 10.0
genrec_request_latency_seconds_bucket{le="0.05"} 90.0
genrec_request_latency_seconds_bucket{le="0.1"} 100.0
genrec_request_latency_seconds_bucket{le="+Inf"} 100.0
genrec_request_latency_seconds_sum 2.5
genrec_request_latency_seconds_count 100.0
# TYPE genrec_requests_total counter
genrec_requests_total{path="prefix_kv"} 80.0
genrec_requests_total{path="full_prompt"} 20.0
# TYPE genrec_decode_batches_total counter
genrec_decode_batches_total{mode="target"} 7.0
genrec_decode_batches_total{mode="strict"} 3.0
"""


# --- figures (no server) -------------------------------------------------------------------


def _samples(text: str) -> status_page.Samples:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_status_figures_from_prometheus_text() -> None:
    figures = status_page.summarise(_samples(PROMETHEUS_TEXT), seconds=10.0)
    assert figures["requests"] == 100 and figures["requests_per_s"] == 10.0
    assert figures["requests_by_path"] == {"prefix_kv": 80.0, "full_prompt": 20.0}
    # 50th of 100: inside the (0.01, 0.05] bucket, 40 of its 80 -> halfway
    assert figures["p50_ms"] == pytest.approx(30.0)
    assert figures["p99_ms"] == pytest.approx(95.0)
    assert figures["serving_mode"] == "target"


def test_every_metric_the_status_page_reads_is_exported() -> None:
    exported = {m.name for m in metrics.REGISTRY.collect()}
    read = {
        "genrec_requests", "genrec_request_latency_seconds", "genrec_target_calls_per_request",
        "genrec_draft_acceptance_rate", "genrec_fallbacks", "genrec_decode_batches",
        "genrec_prefix_kv_lookups", "genrec_events", "genrec_serving_version_info",
    }  # fmt: skip
    assert read <= exported
    source = Path(status_page.__file__).read_text()
    assert all(name in source for name in read)


def test_user_partition_is_the_producers() -> None:
    class Cluster:  # what DefaultPartitioner asks of the producer's metadata
        def topics(self):
            return {"t"}

        def partitions_for_topic(self, _topic):
            return set(range(6))

        available_partitions_for_topic = partitions_for_topic

    partitioner = DefaultPartitioner()
    for user in ("1", "42", "user-ß", "x" * 128):
        key = user.encode()
        assert partition_of(user, 6) == partitioner.partition("t", key, key, None, None, Cluster())


def test_bar_chart_escapes_labels() -> None:
    svg = bar_chart([("<b>", 1.0), ("a", 0.0)], title="t & u")
    assert "<b>" not in svg and "&lt;b&gt;" in svg and "t &amp; u" in svg


# --- pages over a real serving version -----------------------------------------------------


def _store_digest(home: Path) -> str:
    """A digest of every file under the store's data directory (the read-only check)."""
    digest = hashlib.sha256()
    for path in sorted((home / "var").rglob("*")):
        if path.is_file() and not path.name.endswith(("-wal", "-shm")):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def explorer(serving_home, tmp_path_factory):
    """The explorer's app over a copy of the serving version, its metrics endpoint up."""
    from fastapi.testclient import TestClient

    home = tmp_path_factory.mktemp("ui-home")
    shutil.copytree(serving_home, home, dirs_exist_ok=True)
    server = metrics.start_metrics_server(0, host="127.0.0.1")
    settings = Settings(
        home=home, kafka={"bootstrap": "127.0.0.1:1"},
        ui={"metrics_urls": (f"{server.url}/metrics", "http://127.0.0.1:1/metrics")},
    )  # fmt: skip
    engine = make_engine(settings.database_url, create_tables=False)
    before = _store_digest(home)
    with TestClient(create_app(settings, engine)) as client:
        yield client, home, settings
    engine.dispose()
    server.stop()
    assert _store_digest(home) == before, "the explorer wrote to the store"


def test_user_page_shows_every_list_and_the_prompt_parts(explorer) -> None:
    client, _home, _settings = explorer
    page = client.get("/users/7")
    assert page.status_code == 200
    for name in ("generative", "popularity", "itemcf", "merged"):
        assert f'id="list-{name}"' in page.text
    assert 'class="sid"' in page.text  # generative items carry their semantic ID
    assert "prefix KV" in page.text or "live suffix" in page.text
    assert "Kafka at 127.0.0.1:1 is not reachable" in page.text  # a line, not an error


def test_as_of_an_earlier_event_marks_what_came_later(explorer) -> None:
    client, _home, _settings = explorer
    page = client.get("/users/7?at=5")
    assert page.status_code == 200
    assert "as of event 5" in page.text
    assert 'class="part later"' in page.text
    # the cached prefix may cover later events: the as-of view decodes the whole prompt
    assert "<th>path</th><td>full_prompt</td>" in page.text


def test_bad_requests_are_refused_and_nothing_is_written(explorer) -> None:
    client, _home, _settings = explorer
    assert client.get("/users/%20padded").status_code == 400
    assert client.get("/users/a%0Ab").status_code == 400
    assert client.get("/users/" + "x" * 129).status_code == 400
    assert client.get("/users/7?at=0").status_code == 422
    assert client.get("/users/no-such-user").status_code == 404
    assert client.get("/catalog?prefix=1;drop").status_code == 400
    assert client.post("/users/7").status_code == 405
    search = client.get("/users?user_id=7", follow_redirects=False)
    assert search.status_code == 303 and search.headers["location"] == "/users/7"


def test_catalog_groups_by_semantic_id_prefix(explorer) -> None:
    client, _home, _settings = explorer
    root = client.get("/catalog")
    assert root.status_code == 200 and root.text.count("<svg") >= 2  # usage charts
    first = root.text.split('href="/catalog?prefix=')[1].split('"')[0]
    level_two = client.get(f"/catalog?prefix={first}")
    assert "Level 2 codes under" in level_two.text
    second = level_two.text.split(f'href="/catalog?prefix={first}-')[1].split('"')[0]
    items = client.get(f"/catalog?prefix={first}-{second}")
    assert 'id="items"' in items.text and f"{first}-{second}-" in items.text


def test_status_page_reads_the_metrics_endpoints(explorer) -> None:
    client, _home, settings = explorer
    page = client.get("/status")
    assert page.status_code == 200
    reached, unreachable = settings.ui.metrics_urls
    assert f"reached: {reached}" in page.text and "not answering: http://127.0.0.1:1" in page.text
    again = client.get("/status")
    assert "Since the previous load of this page" in again.text


# --- in a real browser ---------------------------------------------------------------------


class LiveServer:
    """uvicorn serving ``app`` on a free local port in a thread."""

    def __init__(self, app) -> None:
        import uvicorn

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 30, "the explorer to listen")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _chromium(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail("Chromium and ChromeDriver are missing: `make test` installs them")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-quic", f"--user-data-dir={profile}",
        "--window-size=1400,1000",
    ):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def screenshot(driver, path: Path) -> Path:
    """The whole page (the window grown to its height) as a PNG."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(max(int(height), 600), 6000))
    driver.save_screenshot(str(path))
    return path


def _publish_last_message(settings: Settings, user_id: str) -> None:
    """A message on the recommendation topic, as a worker publishes it."""
    message = RecommendationMessage(
        user_id=user_id, event_id="e-ui", request_id="e-ui", latency_ms=12.5,
        items=[ScoredItem(item_id="50", score=1.0, rank=0)], decoding={"target_calls": 3},
    )  # fmt: skip
    producer = KafkaProducer(**settings.kafka.client_config())
    producer.send(
        settings.kafka.topic_recommendations, key=message.kafka_key(),
        value=message.to_json_bytes(),
    ).get(timeout=30)  # fmt: skip
    producer.close()


def test_pages_in_headless_chromium(serving_home, kafka_settings, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    settings = Settings(home=serving_home, kafka=kafka_settings, ui={"metrics_urls": ()})
    _publish_last_message(settings, "7")
    engine = make_engine(settings.database_url, create_tables=False)
    server, driver = LiveServer(create_app(settings, engine)), _chromium(tmp_path / "profile")
    try:
        driver.get(server.url + "/")
        driver.find_element(By.ID, "user-id").send_keys("7")
        driver.find_element(By.ID, "search-button").click()
        wait_for(lambda: driver.find_elements(By.ID, "user-heading"), 60, "the user page")
        assert driver.find_element(By.ID, "user-heading").text == "User 7"
        assert driver.find_elements(By.CSS_SELECTOR, "#list-generative tr")[1:]
        assert driver.find_element(By.ID, "last-message").text.count("target_calls") == 1
        shots = [screenshot(driver, tmp_path / "user.png")]
        driver.get(server.url + "/catalog")
        driver.find_element(By.CSS_SELECTOR, "#groups a").click()
        wait_for(
            lambda: "under" in driver.find_element(By.ID, "catalog-heading").text, 30, "a prefix"
        )
        shots.append(screenshot(driver, tmp_path / "catalog.png"))
        driver.get(server.url + "/status")
        assert driver.find_element(By.ID, "status-heading").text == "Serving status"
        shots.append(screenshot(driver, tmp_path / "status.png"))
    finally:
        driver.quit()
        server.stop()
        engine.dispose()
    for shot in shots:
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_explorer_stops_on_sigterm(serving_home, tmp_path) -> None:
    """``genrec ui`` as users run it: it answers, then exits cleanly on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "GENREC_HOME": str(serving_home), "GENREC_KAFKA__BOOTSTRAP": "127.0.0.1:1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "genrec.app.cli", "ui", "--port", str(port)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:

        def answers() -> bool:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").read() == b"ok"
            except OSError:
                return False

        wait_for(answers, 60, "genrec ui to answer")
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert process.wait(timeout=20) == 0
        assert time.monotonic() - started < 20
    finally:
        process.kill()
