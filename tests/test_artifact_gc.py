"""Old model and semantic-ID versions are collected after activation; what serving needs stays."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import func, insert, select, update

from genrec.infra.database import make_engine
from genrec.infra.settings import Settings
from genrec.offline.artifact_gc import collect_old_versions
from genrec.schemas.tables import (
    model_versions,
    semantic_id_items,
    semantic_id_versions,
    serving_versions,
)


def _store(tmp_path, database_url: str | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    engine = make_engine(database_url or f"sqlite:///{tmp_path / 'gc.db'}")
    now = datetime.now(UTC)
    folders = {}
    with engine.begin() as connection:
        for version, active in ((1, False), (2, False), (3, True)):
            folders[f"s{version}"] = tmp_path / f"sid-v{version}"
            folders[f"s{version}"].mkdir()
            connection.execute(insert(semantic_id_versions).values(
                version=version, status="complete", active=active, kind="full",
                artifact_dir=str(folders[f"s{version}"])))  # fmt: skip
            connection.execute(insert(semantic_id_items), [
                {"version": version, "item_id": str(i), "row": i, "semantic_id": f"{i}-{version}"}
                for i in range(3)])  # fmt: skip
        # 1, 2 retired; 3 active; 4 failed; 5 complete and newer: a build about to be activated
        for version, status, sid in ((1, "retired", 1), (2, "retired", 2), (3, "active", 3),
                                     (4, "failed", 3), (5, "complete", 3)):  # fmt: skip
            folders[f"m{version}"] = tmp_path / f"model-v{version}"
            folders[f"m{version}"].mkdir()
            connection.execute(insert(model_versions).values(
                version=version, preset="tiny", status=status, semantic_id_version=str(sid),
                artifact_dir=str(folders[f"m{version}"]), created_at=now))  # fmt: skip
        for version in (1, 2, 3):
            connection.execute(insert(serving_versions).values(
                version=version, status="active" if version == 3 else "retired",
                active=version == 3, model_version=str(version), semantic_id_version=version,
                kv_version=version, created_at=now, activated_at=now))  # fmt: skip
    return engine, folders


def _statuses(engine, table) -> dict[int, str]:
    with engine.connect() as connection:
        return dict(connection.execute(select(table.c.version, table.c.status)).all())


def test_collects_only_what_no_kept_serving_version_needs(tmp_path) -> None:
    engine, folders = _store(tmp_path)
    counts = collect_old_versions(Settings(data_dir=tmp_path), engine, keep_serving=[3, 2])
    assert counts == {"model_versions_collected": 1, "semantic_id_versions_collected": 1}
    assert _statuses(engine, model_versions) == {
        1: "collected", 2: "retired", 3: "active", 4: "failed", 5: "complete"
    }  # fmt: skip
    assert not folders["m1"].exists() and not folders["s1"].exists()
    assert all(folders[k].exists() for k in ("m2", "m3", "m4", "m5", "s2", "s3"))
    with engine.connect() as connection:
        versions = connection.execute(
            select(semantic_id_items.c.version, func.count()).group_by(semantic_id_items.c.version)
        ).all()
    assert dict(versions) == {2: 3, 3: 3}
    assert collect_old_versions(Settings(data_dir=tmp_path), engine, keep_serving=[3, 2]) == {
        "model_versions_collected": 0, "semantic_id_versions_collected": 0
    }  # fmt: skip


def test_keeping_one_serving_version_collects_the_older_ones(tmp_path) -> None:
    engine, folders = _store(tmp_path)
    counts = collect_old_versions(Settings(data_dir=tmp_path), engine, keep_serving=[3])
    assert counts == {"model_versions_collected": 2, "semantic_id_versions_collected": 2}
    assert not folders["m2"].exists() and folders["m4"].exists()  # failed 4 is newer than 3


def test_nothing_is_collected_without_a_kept_serving_version(tmp_path) -> None:
    engine, folders = _store(tmp_path)
    assert collect_old_versions(Settings(data_dir=tmp_path), engine, keep_serving=[]) == {
        "model_versions_collected": 0, "semantic_id_versions_collected": 0
    }  # fmt: skip
    assert all(folder.exists() for folder in folders.values())


def test_relative_folders_are_collected_under_the_data_dir(tmp_path) -> None:
    engine, folders = _store(tmp_path)
    settings = Settings(data_dir=tmp_path)
    with engine.begin() as connection:
        for table, key in ((model_versions, "m"), (semantic_id_versions, "s")):
            for version in (1, 2):
                connection.execute(update(table).where(table.c.version == version).values(
                    artifact_dir=settings.stored_path(folders[f"{key}{version}"])))  # fmt: skip
    assert collect_old_versions(settings, engine, keep_serving=[3]) == {
        "model_versions_collected": 2, "semantic_id_versions_collected": 2
    }  # fmt: skip
    assert not any(folders[k].exists() for k in ("m1", "m2", "s1", "s2"))
    assert all(folders[k].exists() for k in ("m3", "m4", "m5", "s3"))


def test_a_copied_store_never_deletes_the_original_folders(tmp_path) -> None:
    """Old rows keep absolute paths; in a copy of the store they name the original's folders."""
    engine, folders = _store(tmp_path / "original")
    copy = tmp_path / "copy"
    copy.mkdir()
    counts = collect_old_versions(Settings(data_dir=copy), engine, keep_serving=[3])
    assert counts == {"model_versions_collected": 2, "semantic_id_versions_collected": 2}
    assert all(folder.exists() for folder in folders.values())
