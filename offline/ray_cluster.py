"""Reaching Ray for the offline steps (offline step: the executor's cluster connection).

Every offline piece that runs on Ray (``offline.executor = "ray"``, Ray Train) calls
``connect_ray`` first: it returns the ``ray`` module, initialized once per process,

- connected to ``offline.ray_address`` when set (``"auto"``: the cluster this host joined
  with ``ray start``; ``"ray://head:10001"``: a remote cluster through Ray Client), or
- with no address, a local Ray started inside this process (``offline.local_cpus``,
  ``offline.local_object_store_mb``; no dashboard), for tests and laptops; it stops
  with the process.

A process whose Ray is already initialized (a test fixture, a Ray job's driver) keeps
that connection. Ray itself is imported only here and only when called: ``local``
needs no Ray, and ``genrec`` starts without it. Without Ray installed the call ends
the command with one line naming ``pip install genrec[ray]``.

Example::

    >>> from genrec.infra.settings import OfflineSettings
    >>> ray = connect_ray(OfflineSettings(local_cpus=2))  # doctest: +SKIP
    >>> ray.cluster_resources()["CPU"]  # doctest: +SKIP
    2.0
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

from genrec.infra.errors import UserFacingError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'genrec[ray]'"


def import_ray() -> ModuleType:
    """The ``ray`` module, or a ``UserFacingError`` that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise UserFacingError(
            f"offline.executor = ray (or train.workers > 1) needs Ray: {INSTALL_HINT} ({exc})"
        ) from exc
    return ray


def connect_ray(offline) -> ModuleType:
    """``ray``, initialized per ``offline`` (``OfflineSettings``) unless it already is."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    # Workers started for this driver inherit its environment: no downloads from a worker.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    options = {"namespace": offline.ray_namespace, "logging_level": logging.WARNING}
    if offline.ray_address:
        log.info("ray: connecting to %s", offline.ray_address)
        ray.init(address=offline.ray_address, **options)
    else:
        store = offline.local_object_store_mb
        ray.init(
            num_cpus=offline.local_cpus,
            object_store_memory=None if store is None else store * 2**20,
            include_dashboard=False,
            **options,
        )
    resources = ray.cluster_resources()
    log.info("ray: %s CPUs, %s GPUs in the cluster", resources.get("CPU", 0),
             resources.get("GPU", 0))  # fmt: skip
    return ray


def shutdown_ray() -> None:
    """Disconnect (and stop a local Ray this process started); nothing when not connected."""
    try:
        import ray
    except ImportError:
        return
    if ray.is_initialized():
        ray.shutdown()
