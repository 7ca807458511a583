"""online.mode = auto: the worker times strict against target on its own batches and keeps the faster."""

from __future__ import annotations

import pytest

from genrec.online.auto_mode import AutoMode


def time_batches(chooser: AutoMode, ms_per_request: dict[str, float], batches: int) -> list[str]:
    modes = []
    for _ in range(batches):
        mode = chooser.next_mode()
        modes.append(mode)
        chooser.record(mode, ms_per_request[mode] * 4 / 1000.0, requests=4)
    return modes


def test_alternates_until_each_mode_has_its_batches_then_keeps_the_faster() -> None:
    chooser = AutoMode(batches=3, recheck_every=100)
    modes = time_batches(chooser, {"strict": 9.0, "target": 6.0}, 6)
    assert modes == ["strict", "target"] * 3
    assert chooser.settled and chooser.choice == "target"
    assert chooser.summary() == {"strict": 9.0, "target": 6.0}
    assert set(time_batches(chooser, {"strict": 9.0, "target": 6.0}, 20)) == {"target"}


def test_strict_wins_where_the_draft_pays() -> None:
    chooser = AutoMode(batches=2, recheck_every=100)
    time_batches(chooser, {"strict": 20.0, "target": 31.0}, 4)
    assert chooser.choice == "strict"


def test_times_both_again_after_recheck_every_batches() -> None:
    chooser = AutoMode(batches=2, recheck_every=5)
    time_batches(chooser, {"strict": 9.0, "target": 6.0}, 4)
    assert chooser.choice == "target"
    assert time_batches(chooser, {"strict": 9.0, "target": 6.0}, 5) == ["target"] * 5
    # the machine got a GPU's worth faster at speculation: the next measurement says so
    modes = time_batches(chooser, {"strict": 3.0, "target": 6.0}, 4)
    assert modes == ["strict", "target", "strict", "target"]
    assert chooser.choice == "strict"


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        AutoMode(batches=0)
