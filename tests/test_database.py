from sqlalchemy import insert, inspect, select

from genrec.infra.database import make_engine
from genrec.infra.settings import Settings, redact_url
from genrec.schemas.tables import events


def test_store_tables_are_created_and_writable(database_url):
    engine = make_engine(database_url)
    assert {"items", "users", "events"} <= set(inspect(engine).get_table_names())
    row = {"event_id": "e1", "user_id": "u", "item_id": "i", "event_type": "view", "ts_ms": 1}
    with engine.begin() as connection:
        connection.execute(insert(events), [row])
    with engine.connect() as connection:
        assert connection.execute(select(events.c.event_id)).scalars().all() == ["e1"]
    engine.dispose()


def test_settings_honour_home_and_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GENREC_HOME", str(tmp_path))
    monkeypatch.setenv("GENREC_KAFKA__BOOTSTRAP", "127.0.0.1:19092")
    settings = Settings()
    assert settings.data_dir == tmp_path / "var"
    assert settings.database_url == f"sqlite:///{tmp_path / 'var' / 'genrec.db'}"
    assert settings.kafka.client_config()["bootstrap_servers"] == ["127.0.0.1:19092"]


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
