"""Stages of ``genrec bench scale`` that no ``genrec`` command runs alone (app layer).

Each runs in a process of its own against the store of ``GENREC_DATABASE_URL`` (the scale
bench's fresh store of one size), so that its wall time and peak RSS are its own, and
writes its figures as JSON:

- ``faiss``: the FAISS item index over the active semantic-ID version's item embeddings,
  built as the semantic-ID build builds it (``semantic_ids.index_*`` settings); O(items)
  for a flat index, O(items x training) for IVF.
- ``trie``: the valid-ID trie (``ItemTrie``) and the engine's flat tables (``TrieTables``)
  of the active semantic IDs, their build time and the bytes of their tensors; O(items).
- ``serve``: one serving batch, as a worker serves it: the active serving version loaded,
  then ``Recommender.recommend`` for ``--batch`` of the most recently active users (their
  newest stored event as the request), one warm-up batch and ``--batches`` timed ones of
  other users (so each batch reads its prefix KVs from the store, as a cold worker does).

Example::

    $ python -m genrec.app.bench.scale_stages trie --json var/trie.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from genrec.infra.database import make_engine
from genrec.infra.logs import configure_logging
from genrec.infra.settings import get_settings


def tensor_bytes(obj: Any, skip: tuple[type, ...] = ()) -> int:
    """Bytes of the tensors an object holds in its attributes (lists of tensors too)."""
    import torch

    total = 0
    for value in vars(obj).values():
        if isinstance(value, skip):
            continue
        values = value if isinstance(value, list | tuple) else [value]
        total += sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))
    return total


def faiss_stage() -> dict[str, Any]:
    """The active version's item index built again; its size as ``save_index`` writes it (to a
    file, as the build does: ``serialize_index`` would copy the index, 1.7 GiB at 1M x 448)."""
    import tempfile

    from genrec.offline.semantic_ids.build import load_item_embeddings
    from genrec.offline.semantic_ids.faiss_index import build_item_index, save_index

    settings = get_settings()
    engine = make_engine(settings.database_url)
    item_ids, vectors = load_item_embeddings(settings, engine)
    config = settings.semantic_ids
    started = time.perf_counter()
    index = build_item_index(vectors, exact_max_items=config.index_exact_max_items,
                             nprobe=config.index_nprobe)  # fmt: skip
    seconds = time.perf_counter() - started
    with tempfile.TemporaryDirectory(dir=settings.path("artifacts")) as folder:
        save_index(index, Path(folder) / "items.faiss")
        index_bytes = (Path(folder) / "items.faiss").stat().st_size
    return {
        "items": len(item_ids), "dim": int(vectors.shape[1]), "kind": type(index).__name__,
        "build_s": round(seconds, 3), "index_bytes": index_bytes,
    }  # fmt: skip


def trie_stage() -> dict[str, Any]:
    from genrec.offline.semantic_ids.build import load_active_semantic_ids
    from genrec.online.decoding.trie import ItemTrie
    from genrec.online.decoding.trie_tables import TrieTables
    from genrec.online.prompts import ItemTokens

    engine = make_engine(get_settings().database_url)
    item_tokens = ItemTokens.from_semantic_ids(load_active_semantic_ids(engine))
    started = time.perf_counter()
    trie = ItemTrie.from_item_tokens(item_tokens)
    trie_s = time.perf_counter() - started
    started = time.perf_counter()
    tables = TrieTables.of(trie)
    tables_s = time.perf_counter() - started
    return {
        "items": trie.n_items, "trie_build_s": round(trie_s, 3),
        "tables_build_s": round(tables_s, 3), "trie_bytes": tensor_bytes(trie),
        "tables_bytes": tensor_bytes(tables, skip=(ItemTrie,)),
    }  # fmt: skip


def serve_stage(batch: int, batches: int) -> dict[str, Any]:
    from sqlalchemy import select

    from genrec.online.live_version import active_serving_key, load_serving_bundle
    from genrec.online.recommender import Recommender
    from genrec.schemas.tables import users

    settings = get_settings()
    engine = make_engine(settings.database_url)
    key = active_serving_key(engine)
    if key is None:
        raise SystemExit("no active serving version: run the refresh first")
    started = time.perf_counter()
    bundle = load_serving_bundle(settings, engine, key)
    load_s = time.perf_counter() - started
    with engine.connect() as connection:
        user_ids = connection.execute(
            select(users.c.user_id).order_by(users.c.last_ts_ms.desc(), users.c.user_id)
            .limit(batch * (batches + 1))
        ).scalars().all()  # fmt: skip
    requests = _requests(engine, list(user_ids))
    recommender = Recommender(settings, engine)
    recommender.recommend(requests[:batch], bundle)  # warm-up: first calls, allocations
    timed = []
    for start in range(batch, len(requests), batch):
        chunk = requests[start : start + batch]
        began = time.perf_counter()
        recommender.recommend(chunk, bundle)
        timed.append((time.perf_counter() - began, len(chunk)))
    if not timed:
        raise SystemExit(f"the store has too few users for a timed batch of {batch}")
    per_batch = statistics.median(seconds for seconds, _ in timed)
    return {
        "batch_users": batch, "batches": len(timed), "bundle_load_s": round(load_s, 3),
        "ms_per_batch": round(per_batch * 1000, 2),
        "ms_per_request": round(1000 * sum(s for s, _ in timed) / sum(n for _, n in timed), 3),
        "generative": bundle.decoder is not None, "branches": sorted(bundle.branches),
    }  # fmt: skip


def _requests(engine, user_ids: Sequence[str]) -> list:
    """Each user's newest stored event as the request that asks for their list."""
    from sqlalchemy import func, select

    from genrec.online.recommender import Request
    from genrec.schemas.events import UserEvent
    from genrec.schemas.tables import events

    newest = (select(func.max(events.c.id)).where(events.c.user_id.in_(user_ids))
              .group_by(events.c.user_id))  # fmt: skip
    with engine.connect() as connection:
        rows = connection.execute(select(events).where(events.c.id.in_(newest))).all()
    by_user = {row.user_id: row for row in rows}
    return [
        Request.of([UserEvent(event_id=row.event_id, user_id=row.user_id, item_id=row.item_id,
                              event_type=row.event_type, ts=row.ts_ms, value=row.value)])
        for row in (by_user[u] for u in user_ids if u in by_user)
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m genrec.app.bench.scale_stages")
    parser.add_argument("stage", choices=["faiss", "trie", "serve"])
    parser.add_argument("--json", type=Path, required=True, help="write the figures here")
    parser.add_argument("--batch", type=int, default=32, help="serve: users per batch")
    parser.add_argument("--batches", type=int, default=3, help="serve: timed batches")
    args = parser.parse_args(argv)
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_format, settings.log_levels)
    if args.stage == "faiss":
        figures = faiss_stage()
    elif args.stage == "trie":
        figures = trie_stage()
    else:
        figures = serve_stage(args.batch, args.batches)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
