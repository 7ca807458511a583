"""Where the offline steps that fan out run (offline step: the executor).

Four steps do the same work on many independent pages: item text embedding (pages of
texts), the refresh's prefix-KV precompute (batches of user prompts), teacher data for
draft alignment (batches of training prompts) and the generative ranking of
``genrec eval`` (batches of test cases). Each hands its pages to an executor chosen by
``offline.executor`` (``make_executor``):

- ``LocalExecutor`` (``local``, the default): every page in this process, in order,
  exactly as the step always ran; needs no Ray.
- ``RayExecutor`` (``ray``, ``genrec.offline.ray_executor``): pages go to Ray actors.

Both offer the same two things, and both give results in page order:

- ``map(fn, pages)``: ``fn(page)`` for stateless work (Ray tasks);
- ``pool(name, build, *args)``: a pool of workers that each hold ``build(*args)`` (a
  model: built once per worker, not per page), and ``pool.map(fn, pages)`` runs
  ``fn(state, page)``. The local pool takes the step's state as it already has it
  (``local=``): nothing is loaded twice.

The pages are the same under both (the same batches in the same order), so a step
computes the same numbers either way; only where they are computed changes. ``fn``,
``build`` and its arguments must be module-level functions and plain data (Ray sends
them to other processes); results come back as tensors, arrays and lists, and the
step writes them itself (the prefix-KV store through its ``KVStore`` interface).

Example::

    >>> executor = LocalExecutor()
    >>> list(executor.map(abs, [-1, 2, -3], desc="abs"))
    [1, 2, 3]
    >>> with executor.pool("adder", int, "10") as pool:
    ...     list(pool.map(lambda ten, x: ten + x, [1, 2], desc="add"))
    [11, 12]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

from genrec.infra.progress import progress_bar

P = TypeVar("P")
R = TypeVar("R")
S = TypeVar("S")


class PagePool(Protocol):
    """Workers that each hold one state (a model); ``map`` runs ``fn(state, page)``."""

    def map(
        self,
        fn: Callable[[Any, P], R],
        pages: Iterable[P],
        *,
        desc: str,
        unit: str = "page",
        total: int | None = None,
        progress: bool = True,
    ) -> Iterator[R]: ...

    def worker_pids(self) -> list[int]: ...

    def close(self) -> None: ...

    def __enter__(self) -> PagePool: ...

    def __exit__(self, *exc_info: object) -> None: ...


class Executor(Protocol):
    """What a fan-out step asks of ``offline.executor``."""

    name: str
    remote: bool  # pages leave this process: results must travel (tensors on the CPU)

    def map(
        self,
        fn: Callable[[P], R],
        pages: Iterable[P],
        *,
        desc: str,
        unit: str = "page",
        total: int | None = None,
        progress: bool = True,
    ) -> Iterator[R]: ...

    def pool(
        self,
        name: str,
        build: Callable[..., Any],
        *args: Any,
        local: Any = None,
        threads: int | None = None,
        pages_hint: int | None = None,
    ) -> PagePool: ...


class LocalPool:
    """The local executor's pool: one state, this process, pages in order."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def map(
        self,
        fn: Callable[[Any, P], R],
        pages: Iterable[P],
        *,
        desc: str,
        unit: str = "page",
        total: int | None = None,
        progress: bool = True,
    ) -> Iterator[R]:
        for page in progress_bar(
            pages, desc=desc, unit=unit, total=total, leave=False, disable=not progress
        ):
            yield fn(self.state, page)

    def worker_pids(self) -> list[int]:
        import os

        return [os.getpid()]

    def close(self) -> None:
        self.state = None

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class LocalExecutor:
    """Every page in this process, in order (``offline.executor = "local"``)."""

    name = "local"
    remote = False

    def map(
        self,
        fn: Callable[[P], R],
        pages: Iterable[P],
        *,
        desc: str,
        unit: str = "page",
        total: int | None = None,
        progress: bool = True,
    ) -> Iterator[R]:
        for page in progress_bar(
            pages, desc=desc, unit=unit, total=total, leave=False, disable=not progress
        ):
            yield fn(page)

    def pool(
        self,
        name: str,
        build: Callable[..., Any],
        *args: Any,
        local: Any = None,
        threads: int | None = None,
        pages_hint: int | None = None,
    ) -> LocalPool:
        """A pool over ``local`` when the step already holds its state, else ``build(*args)``
        (``threads`` is the caller's own: this process keeps its torch threads)."""
        return LocalPool(local if local is not None else build(*args))


def make_executor(settings) -> Executor:
    """The executor ``settings.offline.executor`` names (``ray`` connects at its first page)."""
    return executor_for(settings.offline)


def executor_for(offline) -> Executor:
    """The executor of ``offline`` (``OfflineSettings``)."""
    if offline.executor == "local":
        return LocalExecutor()
    from genrec.offline.ray_executor import RayExecutor  # Ray only when configured

    return RayExecutor(offline)


def batches(items: list, size: int) -> list[list]:
    """``items`` in consecutive pages of ``size`` (the last one shorter)."""
    size = max(1, int(size))
    return [items[start : start + size] for start in range(0, len(items), size)]


# --- what a pool's workers hold: a model version's models -----------------------------


def model_artifact_dir(settings, engine, version: int | None) -> str | None:
    """The artifact folder of model ``version`` (None: unknown, or a version never saved).

    Ray actors load their models from here rather than receiving them from the driver:
    a local Ray shares this machine's disk; a multi-host cluster needs the folder
    reachable at the same path on every node (docs/offline-refresh.md).
    """
    if version is None:
        return None
    from sqlalchemy import select

    from genrec.schemas.tables import model_versions

    try:
        with engine.connect() as connection:
            row = connection.execute(
                select(model_versions.c.artifact_dir).where(
                    model_versions.c.version == int(version)
                )
            ).first()
    except (TypeError, ValueError):  # a version that is not a saved model's number
        return None
    if row is None or not row.artifact_dir:
        return None
    return str(settings.resolve_stored(row.artifact_dir))


def load_version_models(folder: str):
    """A worker's copy of a saved version (``GenerativeModels``), on its GPU when it has one."""
    from pathlib import Path

    from genrec.online.models.store import load_model_folder

    return load_model_folder(Path(folder))


def load_version_target(folder: str):
    """The target of a saved version, in eval mode, on the worker's GPU when it has one."""
    return load_version_models(folder).target.eval()


def placed_model(model):
    """A model the driver sent (one never saved, e.g. just trained), moved to the worker's
    device (its GPU when Ray gave it one)."""
    from genrec.online.models.presets import pick_device

    return model.to(pick_device()).eval()


def sendable_model(model):
    """``model`` as it can travel to a worker: itself on the CPU, else a CPU copy."""
    import copy

    import torch

    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    return model if on_cpu else copy.deepcopy(model).to(torch.device("cpu"))
