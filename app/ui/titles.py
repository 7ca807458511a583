"""Item titles for the explorer's pages: one bounded query for the items a page shows."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Engine, select

from genrec.schemas.tables import items


def item_titles(engine: Engine, item_ids: Iterable[str]) -> dict[str, str | None]:
    """Title of each of ``item_ids`` that the catalog has (a page shows a few hundred)."""
    wanted = sorted(set(item_ids))
    if not wanted:
        return {}
    query = select(items.c.item_id, items.c.title).where(items.c.item_id.in_(wanted))
    with engine.connect() as connection:
        return {row.item_id: row.title for row in connection.execute(query)}
