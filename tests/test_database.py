import logging
import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import insert, inspect, select, update
from sqlalchemy.exc import IntegrityError

from genrec.app.cli import main
from genrec.infra.database import (
    create_indexes,
    drop_replaced_indexes,
    make_engine,
    missing_indexes,
    replaced_indexes,
)
from genrec.infra.settings import Settings, get_settings, redact_url
from genrec.schemas.tables import events, model_versions, semantic_id_versions, serving_versions


def test_store_tables_are_created_and_writable(database_url):
    engine = make_engine(database_url)
    assert {"items", "users", "events"} <= set(inspect(engine).get_table_names())
    row = {"event_id": "e1", "user_id": "u", "item_id": "i", "event_type": "view", "ts_ms": 1}
    with engine.begin() as connection:
        connection.execute(insert(events), [row])
    with engine.connect() as connection:
        assert connection.execute(select(events.c.event_id)).scalars().all() == ["e1"]
    engine.dispose()


def test_a_store_older_than_an_index_is_told_and_gets_it_built(
    database_url, monkeypatch, caplog, capsys
):
    """create_all builds indexes only with their tables: one dropped from an existing store
    (as if made before it existed) is named at connect, listed, and built, with rows in."""
    engine = make_engine(database_url)
    assert missing_indexes(engine) == []
    row = {"event_id": "e1", "user_id": "u", "item_id": "i", "event_type": "view", "ts_ms": 1}
    with engine.begin() as connection:
        connection.execute(insert(events), [row])
        connection.exec_driver_sql("DROP INDEX ix_events_user_history")
    engine.dispose()
    with caplog.at_level(logging.WARNING, logger="genrec.database"):
        engine = make_engine(database_url)
    assert "ix_events_user_history on events" in caplog.text
    assert "genrec store indexes --create" in caplog.text
    assert [i.name for i in missing_indexes(engine)] == ["ix_events_user_history"]

    monkeypatch.setenv("GENREC_DATABASE_URL", database_url)
    get_settings.cache_clear()
    try:
        assert main(["store", "indexes"]) == 1  # listed, not built
        assert "missing ix_events_user_history on events" in capsys.readouterr().out
        assert main(["store", "indexes", "--create"]) == 0
        assert "built ix_events_user_history" in capsys.readouterr().out
        assert missing_indexes(engine) == []
        names = {i["name"] for i in inspect(engine).get_indexes("events")}
        assert "ix_events_user_history" in names
        assert main(["store", "indexes"]) == 0
    finally:
        get_settings.cache_clear()  # the next test reads its own environment
    create_indexes(engine, [])  # nothing to build: nothing happens
    engine.dispose()


def test_settings_honour_home_and_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GENREC_HOME", str(tmp_path))
    monkeypatch.setenv("GENREC_KAFKA__BOOTSTRAP", "127.0.0.1:19092")
    settings = Settings()
    assert settings.data_dir == tmp_path / "var"
    assert settings.database_url == f"sqlite:///{tmp_path / 'var' / 'genrec.db'}"
    assert settings.kafka.client_config()["bootstrap_servers"] == ["127.0.0.1:19092"]


def test_artifact_paths_are_stored_relative_to_the_data_dir(tmp_path):
    settings = Settings(data_dir=tmp_path / "var")
    inside = settings.path("artifacts", "models", "v3")
    assert settings.stored_path(inside) == "artifacts/models/v3"
    assert settings.resolve_stored("artifacts/models/v3") == inside
    moved = Settings(data_dir=tmp_path / "restored")
    assert moved.resolve_stored("artifacts/models/v3") == tmp_path / "restored/artifacts/models/v3"
    # Outside the data directory, and rows written before: absolute, read as they are.
    assert settings.stored_path(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")
    assert moved.resolve_stored(str(inside)) == inside


def test_settings_read_toml_and_keep_secrets_out_of_dumps(monkeypatch, tmp_path):
    config = tmp_path / "genrec.toml"
    config.write_text(
        'database_url = "postgresql://genrec:hunter2@db:5432/genrec"\n'
        "[kafka]\n"
        'security_protocol = "SASL_SSL"\nsasl_mechanism = "PLAIN"\n'
        'sasl_plain_username = "svc"\nsasl_plain_password = "s3cret"\n'
    )
    monkeypatch.setenv("GENREC_CONFIG", str(config))
    settings = Settings()
    client = settings.kafka.client_config()
    assert client["sasl_plain_password"] == "s3cret" and client["security_protocol"] == "SASL_SSL"
    dumped = str(settings.redacted())
    assert "s3cret" not in dumped and "hunter2" not in dumped
    assert redact_url("postgresql://u:p@h/d") == "postgresql://u:***@h/d"


def test_bad_settings_are_a_clear_error_that_never_echoes_values(monkeypatch, capsys):
    from genrec.app.cli import main
    from genrec.infra.settings import get_settings

    get_settings.cache_clear()  # a cached good config would hide the bad one
    monkeypatch.setenv("GENREC_LOG_FORMAT", "xml")
    monkeypatch.setenv("GENREC_INGEST__BATCH_SIZE", "s3cret-not-a-number")
    assert main(["kafka", "status"]) == 2
    err = capsys.readouterr().err
    assert "GENREC_LOG_FORMAT: Input should be 'text' or 'json'" in err
    assert "GENREC_INGEST__BATCH_SIZE" in err and "s3cret" not in err


def test_unknown_genrec_variables_stop_the_command_with_the_closest_name(monkeypatch, capsys):
    """pydantic-settings ignores names it does not know: a typo would pass in silence."""
    from genrec.app.cli import main
    from genrec.infra.settings import get_settings, setting_names, unknown_variables

    get_settings.cache_clear()
    monkeypatch.setenv("GENREC_ONLINE__MODEE", "target")
    monkeypatch.setenv("GENREC_KAFKA__SASL_PLAIN_PASWORD", "s3cret")
    monkeypatch.setenv("GENREC_SOMETHING_ELSE", "1")
    monkeypatch.setenv("GENREC_TEST_SKIP_POSTGRES", "1")  # read outside Settings: allowed
    assert main(["kafka", "status"]) == 2
    err = capsys.readouterr().err
    assert "GENREC_ONLINE__MODEE: not a genrec setting (did you mean GENREC_ONLINE__MODE?)" in err
    assert "did you mean GENREC_KAFKA__SASL_PLAIN_PASSWORD?" in err and "s3cret" not in err
    assert "GENREC_SOMETHING_ELSE: not a genrec setting\n" in err + "\n"
    assert "GENREC_TEST_SKIP_POSTGRES" not in err
    assert unknown_variables({"GENREC_ONLINE__MODE": "auto", "GENREC_KAFKA": "{}"}) == {}
    names = setting_names()
    assert {"GENREC_HOME", "GENREC_ONLINE__AUTO_MODE_BATCHES", "GENREC_KAFKA__BOOTSTRAP"} <= names
    get_settings.cache_clear()


def test_an_index_the_schema_replaced_is_dropped_once_its_replacement_is_built(
    database_url, monkeypatch, caplog, capsys
):
    """A store made before the history index has ix_events_user_ts and lacks the new one:
    --create builds the new one first, then drops the old one."""
    engine = make_engine(database_url)
    with engine.begin() as connection:
        connection.exec_driver_sql("DROP INDEX ix_events_user_history")
        connection.exec_driver_sql("CREATE INDEX ix_events_user_ts ON events (user_id, ts_ms, id)")
    engine.dispose()
    with caplog.at_level(logging.WARNING, logger="genrec.database"):
        engine = make_engine(database_url)
    assert "keeps index ix_events_user_ts on events, which the schema replaced" in caplog.text
    assert replaced_indexes(engine) == [("events", "ix_events_user_ts")]
    assert drop_replaced_indexes(engine) == []  # its replacement is not there yet
    monkeypatch.setenv("GENREC_DATABASE_URL", database_url)
    get_settings.cache_clear()
    try:
        assert main(["store", "indexes"]) == 1
        out = capsys.readouterr().out
        assert "missing ix_events_user_history" in out and "replaced ix_events_user_ts" in out
        assert main(["store", "indexes", "--create"]) == 0
        out = capsys.readouterr().out
        assert "built ix_events_user_history" in out and "dropped ix_events_user_ts" in out
        names = {i["name"] for i in inspect(engine).get_indexes("events")}
        assert "ix_events_user_history" in names and "ix_events_user_ts" not in names
        assert main(["store", "indexes"]) == 0
    finally:
        get_settings.cache_clear()
    engine.dispose()


def test_absolute_artifact_paths_of_older_rows_are_rewritten_relative(
    database_url, monkeypatch, capsys, tmp_path
):
    engine = make_engine(database_url)
    data_dir = tmp_path / "var"
    now = datetime.now(UTC)
    with engine.begin() as connection:
        connection.execute(insert(model_versions), [
            {"version": 1, "preset": "tiny", "status": "retired", "created_at": now,
             "artifact_dir": str(data_dir / "artifacts/models/v1")},
            {"version": 2, "preset": "tiny", "status": "active", "created_at": now,
             "artifact_dir": "artifacts/models/v2"},
        ])  # fmt: skip
        connection.execute(insert(semantic_id_versions), [
            {"version": 1, "status": "complete", "active": True, "kind": "full",
             "artifact_dir": "/elsewhere/semantic_ids/v1"},
        ])  # fmt: skip
    monkeypatch.setenv("GENREC_DATABASE_URL", database_url)
    monkeypatch.setenv("GENREC_DATA_DIR", str(data_dir))
    get_settings.cache_clear()
    try:
        assert main(["store", "artifact-paths"]) == 1  # listed, nothing changed
        out = capsys.readouterr().out
        assert "model_versions v1: " in out and "-> artifacts/models/v1 (absolute)" in out
        assert "semantic_id_versions v1: /elsewhere/semantic_ids/v1 (outside" in out
        assert main(["store", "artifact-paths", "--rewrite"]) == 1  # /elsewhere stays
        assert "(rewritten)" in capsys.readouterr().out
    finally:
        get_settings.cache_clear()
    with engine.connect() as connection:
        stored = connection.execute(
            select(model_versions.c.artifact_dir).order_by(model_versions.c.version)
        ).scalars().all()  # fmt: skip
        sid = connection.execute(select(semantic_id_versions.c.artifact_dir)).scalar()
    assert stored == ["artifacts/models/v1", "artifacts/models/v2"]
    assert sid == "/elsewhere/semantic_ids/v1"
    engine.dispose()


@pytest.mark.integration
def test_an_index_a_failed_concurrent_build_left_invalid_is_built_again(postgres_server):
    """PostgreSQL keeps an INVALID index behind when CREATE INDEX CONCURRENTLY fails (here:
    two active serving versions break the unique one); it counts as missing until rebuilt."""
    if postgres_server is None:
        pytest.skip("GENREC_TEST_SKIP_POSTGRES=1")
    engine = make_engine(postgres_server.create_database(f"genrec_{uuid.uuid4().hex[:12]}"))
    now = datetime.now(UTC)
    with engine.begin() as connection:
        connection.exec_driver_sql("DROP INDEX uq_serving_versions_one_active")
        connection.execute(insert(serving_versions), [
            {"status": "active", "active": True, "created_at": now} for _ in range(2)
        ])  # fmt: skip
    (unique,) = missing_indexes(engine)
    with pytest.raises(IntegrityError):
        create_indexes(engine, [unique])
    assert [i.name for i in missing_indexes(engine)] == ["uq_serving_versions_one_active"]
    with engine.begin() as connection:
        connection.execute(
            update(serving_versions)
            .where(serving_versions.c.version == 1)
            .values(active=False, status="retired")
        )
    create_indexes(engine, missing_indexes(engine))  # drops the invalid one, builds it again
    assert missing_indexes(engine) == []
    with pytest.raises(IntegrityError), engine.begin() as connection:
        connection.execute(insert(serving_versions), [
            {"status": "active", "active": True, "created_at": now}
        ])  # fmt: skip
    engine.dispose()
