"""Page functions that the Ray executor tests send to Ray workers (``test_ray_executor.py``).

A module of their own that imports nothing heavy at import time: a Ray worker imports
the module of every function it is sent, and a test module would pull torch and every
step in with it (seconds per worker on a busy machine).
"""

from __future__ import annotations

import time


def double(x: int) -> int:
    return 2 * x


def add_slowly(base: int, x: int) -> int:
    time.sleep(0.02)
    return base + x


def fail_at_three(_state, x: int) -> int:
    if x == 3:
        raise ValueError("page 3 is bad")
    return x


def slow_compute_prefix_kv(model, prompts, model_version):
    """The refresh's prefix-KV computation, slowed so that a kill lands while pages run."""
    from genrec.offline.refresh import compute_prefix_kv  # torch: only where it computes

    time.sleep(0.2)
    return compute_prefix_kv(model, prompts, model_version)
