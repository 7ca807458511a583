"""The catalog page's content: items grouped by semantic-ID prefix, and the quality report.

The grouping is the serving version's own item -> semantic ID mapping (what the
beam search walks), one level at a time: the root shows the first-level codes
with their item counts and a few examples, a prefix ``12`` the second-level
codes under it, and so on; a prefix also lists up to ``ui.catalog_page_items`` of
its items. The report (codebook usage per level, collisions before dedup,
shared-prefix similarity), on the root page, is the one the semantic-ID build
stored with its version, drawn as charts.

Memory: one int64 code table per loaded version (items x depth x 8 bytes: 32 MB at
1M items of depth 4); each page is a vectorised pass over it and one bounded
title query.

Example::

    >>> view = catalog_view(live, settings, (12,))           # doctest: +SKIP
    >>> [(g.code, g.items) for g in view.groups][:3]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import Engine, select

from genrec.app.ui.charts import bar_chart
from genrec.app.ui.serving import LiveVersion
from genrec.app.ui.titles import item_titles
from genrec.infra.settings import Settings
from genrec.schemas.tables import semantic_id_versions

EXAMPLES = 3  # items named per group


@dataclass
class Group:
    code: int
    items: int
    examples: list[tuple[str, str | None]]  # (item id, title)


@dataclass
class CatalogView:
    version: str | None
    semantic_id_version: str | None
    prefix: tuple[int, ...]
    depth: int
    total: int  # items under the prefix
    groups: list[Group] = field(default_factory=list)  # the next level's codes under it
    listed: list[tuple[str, str | None, str]] = field(default_factory=list)  # id, title, SID
    charts: list[str] = field(default_factory=list)  # SVG
    report: dict[str, Any] = field(default_factory=dict)  # scalar figures of the report
    note: str | None = None


class CodeTables:
    """Each loaded version's code table [items, depth], computed once per version."""

    def __init__(self) -> None:
        self._key: str | None = None
        self._codes: np.ndarray | None = None

    def of(self, bundle) -> np.ndarray:
        if self._key != bundle.key:
            item_tokens = bundle.decoder.item_tokens
            layout = item_tokens.layout
            offsets = np.array([layout.level_start(level) for level in range(layout.depth)])
            self._codes, self._key = item_tokens.table - offsets, bundle.key
        return self._codes


def catalog_view(
    live: LiveVersion, settings: Settings, prefix: tuple[int, ...], tables: CodeTables
) -> CatalogView:
    """The catalog under ``prefix`` (() for the root) in the active serving version."""
    bundle = live.bundle()
    if bundle is None or bundle.decoder is None:
        note = live.error or "the serving version has no generative model (no semantic IDs)"
        return CatalogView(bundle.key if bundle else None, None, prefix, 0, 0, note=note)
    codes = tables.of(bundle)
    item_ids = bundle.decoder.item_tokens.item_ids
    depth = codes.shape[1]
    view = CatalogView(bundle.key, str(bundle.semantic_id_version), prefix[:depth], depth, 0)
    rows = np.flatnonzero((codes[:, : len(view.prefix)] == np.asarray(view.prefix)).all(1))
    view.total = len(rows)
    limit = settings.ui.catalog_page_items
    if len(view.prefix) < depth:
        view.groups = _groups(codes[rows, len(view.prefix)], rows)
    if view.prefix and (len(view.prefix) >= 2 or view.total <= limit):
        chosen = rows[:limit]
        view.listed = [(item_ids[r], None, "-".join(map(str, codes[r]))) for r in chosen]
    names = {item_ids[r] for g in view.groups for r in g.examples} | {i for i, *_ in view.listed}
    titles = item_titles(live.engine, names)
    for group in view.groups:
        group.examples = [(item_ids[r], titles.get(item_ids[r])) for r in group.examples]
    view.listed = [(i, titles.get(i), sid) for i, _, sid in view.listed]
    if not view.prefix:  # the report is the root page's
        _report(live.engine, bundle.semantic_id_version, view)
    return view


def _groups(next_codes: np.ndarray, rows: np.ndarray) -> list[Group]:
    """One group per next-level code, largest first, with its first few catalog rows."""
    if not len(rows):
        return []
    order = np.argsort(next_codes, kind="stable")
    codes, starts, counts = np.unique(next_codes[order], return_index=True, return_counts=True)
    groups = [
        Group(int(code), int(count), rows[order[start : start + EXAMPLES]].tolist())
        for code, start, count in zip(codes, starts, counts, strict=True)
    ]
    return sorted(groups, key=lambda g: (-g.items, g.code))


def _report(engine: Engine, semantic_id_version, view: CatalogView) -> None:
    """The stored quality report of ``semantic_id_version``: charts and scalar figures."""
    query = select(semantic_id_versions.c.metrics).where(
        semantic_id_versions.c.version == int(semantic_id_version)
    )
    with engine.connect() as connection:
        metrics = connection.execute(query).scalar()
    if not metrics:
        view.note = f"semantic-ID version {semantic_id_version} has no quality report"
        return
    for usage in metrics.get("codebook_usage", []):
        counts = usage.get("counts", [])
        title = (
            f"level {usage['level'] + 1}: items per code ({usage['used']} of {usage['size']} "
            f"used, perplexity {usage['perplexity']:.1f})"
        )
        view.charts.append(bar_chart([(str(c), float(n)) for c, n in enumerate(counts)], title))
    similarity = metrics.get("prefix_similarity", {})
    view.charts.append(
        bar_chart(
            [(name.replace("_", " "), value or 0.0) for name, value in similarity.items()],
            "mean cosine of item pairs: random vs sharing a prefix", "{:.3f}",
        )
    )  # fmt: skip
    view.report = {
        name: metrics[name]
        for name in (
            "n_items", "embedding_mode", "reconstruction_mse", "collision_rate_before_dedup",
            "items_in_collisions", "largest_collision_group",
        )
        if name in metrics
    }  # fmt: skip
