"""``genrec offline semantic-ids`` and ``genrec bench faiss`` (offline step: item tokenization).

Example::

    $ genrec offline semantic-ids              # refresh the active version (full build if none)
    $ genrec offline semantic-ids --full --json var/semantic_ids.json
    $ genrec bench faiss                       # FAISS vs NumPy top-100, plus ML-100K build time
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from genrec.infra.settings import get_settings

# Handlers import their step's modules when they run, so that `genrec --help` and
# every other command start without torch, transformers, pandas or a database.


def register(commands: argparse._SubParsersAction, groups) -> None:
    offline = groups.group("offline", "Offline jobs: semantic IDs, training, KV precompute")
    build = offline.add_parser(
        "semantic-ids",
        help="Build item semantic IDs (RQ-VAE) and the FAISS item index as a new active version",
    )
    build.add_argument("--full", action="store_true", help="retrain the RQ-VAE (new IDs for all)")
    build.add_argument("--json", type=Path, default=None, help="write the build summary here")
    build.add_argument("--no-progress", action="store_true", help="no progress bars")
    build.set_defaults(handler=run_build)

    bench = groups.group("bench", "Benchmarks that measure side by side and print ratios")
    faiss_bench = bench.add_parser(
        "faiss", help="FAISS vs NumPy brute-force top-k throughput; ML-100K semantic-ID build time"
    )
    faiss_bench.add_argument("--k", type=int, default=100)
    faiss_bench.add_argument("--queries", type=int, default=1000)
    faiss_bench.add_argument(
        "--synthetic-items",
        type=int,
        default=100_000,
        help="also a random catalog this big (0: skip)",
    )
    faiss_bench.add_argument("--repeats", type=int, default=3)
    faiss_bench.set_defaults(handler=run_bench)


def build_summary(report) -> dict:
    """What ``--json`` holds: the build's headline figures."""
    metrics = report.metrics
    return {
        "version": report.version,
        "kind": report.kind,
        "n_items": report.n_items,
        "n_unique_ids": report.n_unique_ids,
        "new_items": report.new_items,
        "collision_rate_before_dedup": metrics["collision_rate_before_dedup"],
        "largest_collision_group": metrics["largest_collision_group"],
        "codebook_usage": [
            {k: level[k] for k in ("level", "size", "used", "fraction", "perplexity")}
            for level in metrics["codebook_usage"]
        ],
        "reconstruction_mse": metrics["reconstruction_mse"],
        "prefix_similarity": metrics["prefix_similarity"],
        "embedding_sources": metrics["embedding_sources"],
        "moved_to_free_slot": metrics["moved_to_free_slot"],
        "rqvae_training": metrics.get("rqvae_training"),  # steps, epochs, k-means items
        "stability": report.stability,
        "timings": report.timings,
        "artifact_dir": report.artifact_dir,
        "codebook_usage_png": str(Path(report.artifact_dir) / "codebook_usage.png"),
    }


def run_build(args: argparse.Namespace) -> int:
    from genrec.infra.database import make_engine
    from genrec.offline.semantic_ids.build import build_semantic_ids

    settings = get_settings()
    engine = make_engine(settings.database_url)
    report = build_semantic_ids(settings, engine, full=args.full, progress=not args.no_progress)
    summary = build_summary(report)
    text = json.dumps(summary, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    import numpy as np

    build_seconds, vectors = _ml100k_build()
    print(f"ML-100K full semantic-ID build: {build_seconds:.1f} s ({len(vectors)} items)")
    rng = np.random.default_rng(0)
    catalogs = [("ml-100k item embeddings", vectors)]
    if args.synthetic_items > 0:
        # A bigger catalog shaped like the real one: item embeddings plus noise
        # (uniform random vectors have no neighborhoods, which no ANN index can use).
        base = vectors[rng.integers(0, len(vectors), args.synthetic_items)]
        noise = rng.standard_normal(base.shape).astype(np.float32) * (0.5 / np.sqrt(base.shape[1]))
        synthetic = base + noise
        synthetic /= np.linalg.norm(synthetic, axis=1, keepdims=True)
        catalogs.append((f"ML-100K embeddings + noise x{args.synthetic_items}", synthetic))
    for name, catalog in catalogs:
        queries = catalog[rng.integers(0, len(catalog), args.queries)]
        _compare(name, catalog, queries, args.k, args.repeats)
    return 0


def _ml100k_build() -> tuple[float, object]:
    """A cold full build (fresh embedding cache) on ML-100K in a throwaway store."""
    from genrec.infra.database import make_engine
    from genrec.infra.settings import Settings
    from genrec.ingest.movielens import store_ml100k
    from genrec.offline.semantic_ids.build import build_semantic_ids, load_item_embeddings

    with tempfile.TemporaryDirectory(prefix="genrec-bench-") as home:
        settings = Settings(home=home, database_url=None, data_dir=None)
        engine = make_engine(settings.database_url)
        store_ml100k(engine)
        started = time.perf_counter()
        report = build_semantic_ids(settings, engine, full=True, progress=True)
        seconds = time.perf_counter() - started
        print("  stages: " + ", ".join(f"{k} {v:.1f}" for k, v in report.timings.items()))
        _, vectors = load_item_embeddings(settings, engine)
        engine.dispose()
    return seconds, vectors


def _compare(name: str, catalog, queries, k: int, repeats: int) -> None:
    import numpy as np

    from genrec.offline.semantic_ids.faiss_index import brute_force_topk, build_item_index

    def best_of(search) -> tuple[float, object]:
        times, result = [], None
        for _ in range(repeats):
            started = time.perf_counter()
            result = search()
            times.append(time.perf_counter() - started)
        return min(times), result

    numpy_s, (_, exact) = best_of(lambda: brute_force_topk(catalog, queries, k))
    print(f"{name}: {len(catalog)} items, {len(queries)} queries, top-{k}")
    print(f"  numpy brute force: {len(queries) / numpy_s:10.0f} queries/s")
    for kind in ("flat", "ivf") if len(catalog) >= 39 * 4 else ("flat",):
        index = build_item_index(catalog, kind=kind)
        faiss_s, (_, found) = best_of(lambda index=index: index.search(queries, k))
        recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(found, exact, strict=True)])
        print(
            f"  faiss {kind:4s}:         {len(queries) / faiss_s:10.0f} queries/s  "
            f"ratio faiss/numpy {numpy_s / faiss_s:5.2f}x  recall@{k} {recall:.3f}"
        )
