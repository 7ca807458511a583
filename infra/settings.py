"""Typed settings for every genrec command: the one place configuration lives.

Values come, highest priority first, from keyword arguments, ``GENREC_*``
environment variables (nested sections use ``__``, e.g.
``GENREC_DECODE__BEAM_WIDTH=20``), an optional TOML file (``GENREC_CONFIG``, or
``genrec.toml`` in ``GENREC_HOME``), and the defaults below, which work on one
machine with nothing configured.

Example::

    >>> from genrec.infra.settings import Settings
    >>> s = Settings(home="/tmp/genrec-a")
    >>> s.database_url
    'sqlite:////tmp/genrec-a/var/genrec.db'
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)


def _default_home() -> Path:
    """The repository root when running from a checkout, else the working directory."""
    repo_root = Path(__file__).resolve().parent.parent
    if (repo_root / "pyproject.toml").exists():
        return repo_root
    return Path.cwd()


class KafkaSettings(BaseModel):
    """Where the Kafka cluster is and how to reach it; security options pass through."""

    bootstrap: str = "127.0.0.1:9092"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: SecretStr | None = None
    ssl_check_hostname: bool = True
    client_id: str = "genrec"
    topic_events: str = "genrec.user-events"
    topic_recommendations: str = "genrec.recommendations"
    topic_dlq: str = "genrec.user-events.dlq"
    events_partitions: int = 6
    recommendations_partitions: int = 6
    replication_factor: int = 1

    def client_config(self) -> dict[str, Any]:
        """Keyword arguments common to every kafka-python client (producer, consumer, admin)."""
        config: dict[str, Any] = {
            "bootstrap_servers": [s.strip() for s in self.bootstrap.split(",") if s.strip()],
            "security_protocol": self.security_protocol,
            "client_id": self.client_id,
        }
        optional = {
            "sasl_mechanism": self.sasl_mechanism,
            "sasl_plain_username": self.sasl_plain_username,
            "sasl_plain_password": _reveal(self.sasl_plain_password),
            "ssl_cafile": self.ssl_cafile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_password": _reveal(self.ssl_password),
        }
        config.update({k: v for k, v in optional.items() if v is not None})
        if self.security_protocol in ("SSL", "SASL_SSL"):
            config["ssl_check_hostname"] = self.ssl_check_hostname
        return config


class IngestSettings(BaseModel):
    """The ingest consumer: batching, limits and its consumer group."""

    group_id: str = "genrec-ingest"
    batch_size: int = 5000
    batch_timeout_ms: int = 500
    max_message_bytes: int = 64 * 1024
    metrics_port: int | None = None


def _reveal(secret: SecretStr | None) -> str | None:
    return secret.get_secret_value() if secret is not None else None


class Settings(BaseSettings):
    """All genrec settings. ``GENREC_HOME`` roots every default path."""

    model_config = SettingsConfigDict(
        env_prefix="GENREC_",
        env_nested_delimiter="__",
        extra="ignore",
    )

    home: Path = Field(default_factory=_default_home)
    data_dir: Path | None = None
    database_url: str | None = None
    log_level: str = "INFO"
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    ingest: IngestSettings = Field(default_factory=IngestSettings)

    @model_validator(mode="after")
    def _fill_paths(self) -> Settings:
        self.home = Path(self.home).expanduser().resolve()
        if self.data_dir is None:
            self.data_dir = self.home / "var"
        self.data_dir = Path(self.data_dir).expanduser().resolve()
        if self.database_url is None:
            self.database_url = f"sqlite:///{self.data_dir / 'genrec.db'}"
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_path = _config_file()
        if toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)

    def path(self, *parts: str) -> Path:
        """A path under the data directory, its parent created."""
        assert self.data_dir is not None
        target = self.data_dir.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def redacted(self) -> dict[str, Any]:
        """Settings as a dict safe to log: secrets stay masked, URL passwords removed."""
        dumped = self.model_dump(mode="json")
        dumped["database_url"] = redact_url(str(self.database_url))
        return dumped


def redact_url(url: str) -> str:
    """``postgresql://user:secret@host/db`` -> ``postgresql://user:***@host/db``."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    credentials, _, location = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{location}"


def _config_file() -> Path | None:
    explicit = os.environ.get("GENREC_CONFIG")
    if explicit:
        path = Path(explicit).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"GENREC_CONFIG points to a missing file: {path}")
        return path
    home = os.environ.get("GENREC_HOME")
    candidate = (Path(home).expanduser() if home else _default_home()) / "genrec.toml"
    return candidate if candidate.exists() else None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
