"""The Ray executor (offline step: ``offline.executor = "ray"``): pages on Ray actors.

``RayExecutor`` connects through ``connect_ray`` (``offline.ray_address``, or a local
Ray started in this process) and runs a step's pages there:

- ``map(fn, pages)``: one Ray task per page (``offline.max_retries`` retries when the
  worker process running it dies);
- ``pool(name, build, *args)``: ``offline.actors`` actors (default: one per GPU of
  the cluster, else its CPUs / ``offline.cpus_per_actor``; never more than the pages),
  each holding ``build(*args)``, e.g. a model loaded from its version's artifact
  folder. Each asks for ``cpus_per_actor`` CPUs and ``gpus_per_actor`` GPUs (default: 1
  where the cluster has GPUs, else none), so Ray places them on GPUs when there are
  some; the step's model code moves to the GPU it is given. Actors are named
  ``genrec-<name>-<n>`` (``ray list actors``) and killed when the pool closes.

Results come back in page order, with at most ``offline.max_in_flight`` pages
submitted and not yet collected (default 2 x actors): the driver's memory is
O(pages in flight), whatever the number of pages. Pages go to the actors in turn.

Faults: an actor whose process dies (kill -9, a lost node) is restarted up to
``offline.max_retries`` times (it builds its state again) and its unfinished pages are
retried on it; pages are pure functions of their input, so a retried page gives the
same result. Past that, collecting the page raises ``RayActorError``/``WorkerCrashedError``
and the step fails: the refresh then fails cleanly, as it does on any error, and the
previous serving version keeps serving.

Ray's object transport carries pages and results between Ray's processes; nothing
here is written to disk, and nothing genrec stores is a pickle.

Example::

    >>> from genrec.infra.settings import OfflineSettings
    >>> executor = RayExecutor(OfflineSettings(executor="ray", local_cpus=2))  # doctest: +SKIP
    >>> list(executor.map(abs, [-1, 2, -3], desc="abs"))  # doctest: +SKIP
    [1, 2, 3]
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from genrec.infra.progress import progress_bar
from genrec.offline.ray_cluster import connect_ray

log = logging.getLogger(__name__)

ACTOR_PREFIX = "genrec-"
_pool_numbers = itertools.count(1)


class _PageActor:
    """A Ray actor holding one state; pages run on it one at a time."""

    def __init__(self, build: Callable[..., Any], args: tuple, threads: int | None) -> None:
        if threads is not None:
            import torch  # the states are models: their threads, as the local run's

            torch.set_num_threads(threads)
        self.state = build(*args)

    def ready(self) -> bool:
        return True

    def pid(self) -> int:
        return os.getpid()

    def run(self, fn: Callable[[Any, Any], Any], page: Any) -> Any:
        return fn(self.state, page)


def _run_page(fn: Callable[[Any], Any], page: Any) -> Any:
    return fn(page)


class RayExecutor:
    """Pages as Ray tasks or on Ray actors (``offline.executor = "ray"``)."""

    name = "ray"
    remote = True

    def __init__(self, offline) -> None:
        self.config = offline
        self._ray = None

    @property
    def ray(self):
        """The ``ray`` module, connected at first use (a step with nothing to do needs none)."""
        if self._ray is None:
            self._ray = connect_ray(self.config)
        return self._ray

    def map(
        self,
        fn: Callable[[Any], Any],
        pages: Iterable[Any],
        *,
        desc: str,
        unit: str = "page",
        total: int | None = None,
        progress: bool = True,
    ) -> Iterator[Any]:
        """``fn(page)`` for each page as a Ray task, results in page order."""
        task = self.ray.remote(_run_page).options(
            num_cpus=self.config.cpus_per_actor, max_retries=self.config.max_retries
        )
        window = self.config.max_in_flight or 2 * self._cpu_slots()
        submit = lambda page: task.remote(fn, page)  # noqa: E731
        yield from _in_order(self.ray, submit, pages, window, (desc, unit, total, progress))

    def pool(
        self,
        name: str,
        build: Callable[..., Any],
        *args: Any,
        local: Any = None,
        threads: int | None = None,
        pages_hint: int | None = None,
    ) -> RayPool:
        """Actors that each hold ``build(*args)``; ``local`` (the driver's copy) is unused."""
        gpus = self._gpus_per_actor()
        count = self.config.actors or self._default_actors(gpus)
        if pages_hint is not None:
            count = max(1, min(count, pages_hint))
        return RayPool(self, name, build, args, count, gpus,
                       self.config.actor_torch_threads or threads)  # fmt: skip

    def _gpus_per_actor(self) -> float:
        if self.config.gpus_per_actor is not None:
            return self.config.gpus_per_actor
        return 1.0 if self.ray.cluster_resources().get("GPU", 0) >= 1 else 0.0

    def _default_actors(self, gpus_per_actor: float) -> int:
        if gpus_per_actor > 0:
            return max(1, int(self.ray.cluster_resources().get("GPU", 0) // gpus_per_actor))
        return self._cpu_slots()

    def _cpu_slots(self) -> int:
        cpus = self.ray.cluster_resources().get("CPU", 1)
        return max(1, int(cpus // self.config.cpus_per_actor))


class RayPool:
    """``count`` named actors holding ``build(*args)``; started at once, killed on close."""

    def __init__(self, executor: RayExecutor, name: str, build, args: tuple, count: int,
                 gpus: float, threads: int | None) -> None:  # fmt: skip
        self.ray, config = executor.ray, executor.config
        self.window = config.max_in_flight or 2 * count
        # pid() answers from a thread of its own, also while a page runs (tests kill one)
        actor = self.ray.remote(concurrency_groups={"control": 1})(_PageActor)
        options = dict(num_cpus=config.cpus_per_actor, num_gpus=gpus,
                       max_restarts=config.max_retries, max_task_retries=config.max_retries)  # fmt: skip
        prefix = f"{ACTOR_PREFIX}{name}-{os.getpid()}-{next(_pool_numbers)}"
        # The state's inputs (a model, maybe) go into the object store once for all actors,
        # and this reference keeps them there: a restarted actor builds from them again.
        self._inputs = self.ray.put(args)
        self.actors = [
            actor.options(name=f"{prefix}-{n}", **options).remote(build, self._inputs, threads)
            for n in range(count)
        ]
        self._turn = itertools.cycle(self.actors)
        try:
            self.ray.get([a.ready.remote() for a in self.actors])  # a build error surfaces here
        except BaseException:
            self.close()
            raise
        log.info("ray: %d %s actor(s) ready (%s GPU each)", count, name, gpus)

    def map(
        self,
        fn: Callable[[Any, Any], Any],
        pages: Iterable[Any],
        *,
        desc: str,
        unit: str = "page",
        total: int | None = None,
        progress: bool = True,
    ) -> Iterator[Any]:
        """``fn(state, page)`` on the actors in turn, results in page order."""
        submit = lambda page: next(self._turn).run.remote(fn, page)  # noqa: E731
        yield from _in_order(self.ray, submit, pages, self.window, (desc, unit, total, progress))

    def worker_pids(self) -> list[int]:
        """The process id of each actor (tests kill one)."""
        return self.ray.get([_pid_of(a) for a in self.actors])

    def close(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # already dead: nothing to stop
                log.debug("ray: actor already gone", exc_info=True)
        self.actors = []
        self._inputs = None

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _in_order(ray, submit, pages: Iterable[Any], window: int, shown: tuple) -> Iterator[Any]:
    """Submit pages while fewer than ``window`` are out; yield results in page order.
    ``shown``: the progress bar's (desc, unit, total, progress)."""
    desc, unit, total, progress = shown
    in_flight: deque = deque()
    bar = progress_bar(total=total, desc=desc, unit=unit, leave=False, disable=not progress)
    try:
        for page in pages:
            if len(in_flight) >= window:
                yield ray.get(in_flight.popleft())
                bar.update(1)
            in_flight.append(submit(page))
        while in_flight:
            yield ray.get(in_flight.popleft())
            bar.update(1)
    finally:
        bar.close()
        for ref in in_flight:  # the caller stopped early or a page failed
            try:
                ray.cancel(ref)
            except Exception:  # finished meanwhile, or an actor task Ray cannot cancel
                log.debug("ray: could not cancel a page", exc_info=True)


def _pid_of(actor):
    return actor.pid.options(concurrency_group="control").remote()


def named_actor_pids(name: str) -> dict[str, int]:
    """Process ids of this namespace's live genrec actors of pools called ``name``,
    answered while the actors work (how a test finds the process it kills)."""
    import ray

    prefix = f"{ACTOR_PREFIX}{name}-"
    names = [n for n in ray.util.list_named_actors() if n.startswith(prefix)]
    pids = {}
    for actor_name in names:
        try:
            pids[actor_name] = ray.get(_pid_of(ray.get_actor(actor_name)), timeout=30)
        except Exception:  # killed meanwhile
            continue
    return pids
