"""train.workers: data-parallel training on a real local Ray (Ray Train, DDP over gloo).

The tiny preset is trained on the ML-100K sample with 1 worker (in process, no Ray) and
with 2 CPU workers at the same global batch and steps; the 2-worker version must learn
as well: held-out loss within 2% of 1 worker's, both well below the untrained model's.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from genrec.infra.errors import UserFacingError
from genrec.infra.settings import OfflineSettings, Settings
from genrec.offline.ray_cluster import connect_ray
from genrec.offline.splits import load_split
from genrec.offline.training import ray_train
from genrec.offline.training import run as training_run
from genrec.offline.training.parallel import DataShard
from genrec.offline.training.target import LevelLoss, validation_loss
from genrec.online.models.presets import PRESETS, build_target
from genrec.online.models.store import load_active_models
from genrec.online.prompts import ItemTokens
from tests.helpers import tiny_settings

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def local_ray():
    """A real local Ray of 2 CPUs for this module (one worker per core)."""
    ray = connect_ray(OfflineSettings(local_cpus=2))
    yield ray
    ray.shutdown()


def held_out_loss(model, item_tokens: ItemTokens, cases, history_items: int) -> float:
    device = next(model.parameters()).device
    return validation_loss(
        model, LevelLoss(item_tokens, device), cases, item_tokens, history_items, device
    )


def test_weighted_worker_means_average_to_the_whole_batch_mean():
    """What DDP's gradient average sees: sum over workers of weight x mean loss / workers."""
    rows = [[0.5, 1.5, 2.0], [4.0], [1.0, 1.0, 3.0, 0.5], [2.5], [0.1, 0.2, 0.3, 0.4, 0.5]]
    tokens = [token for row in rows for token in row]
    for world in (1, 2, 3):
        average = 0.0
        for rank in range(world):
            mine, weight = DataShard(rank, world).take_weighted(rows, len)
            assert mine == rows[rank::world]
            mine_tokens = [token for row in mine for token in row]
            average += weight * sum(mine_tokens) / len(mine_tokens) / world
        assert average == pytest.approx(sum(tokens) / len(tokens))
    # a worker left without rows of a short batch still steps, on one row with no weight
    assert DataShard(2, 3).take_weighted(rows[:2], len) == (rows[:1], 0.0)


@pytest.mark.slow  # a fresh interpreter importing torch: ~20 s, too long for test-fast
def test_one_worker_needs_no_ray():
    code = (
        "import sys; import genrec.offline.training.run, genrec.offline.training.cli; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cli_takes_the_number_of_workers():
    from genrec.app.cli import build_parser

    args = build_parser().parse_args(["offline", "train", "--workers", "4"])
    assert args.workers == 4 and callable(args.handler)
    assert build_parser().parse_args(["offline", "train"]).workers is None


def test_more_workers_without_ray_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(UserFacingError, match=r"pip install 'genrec\[ray\]'"):
        ray_train.train_parts_on_ray(Settings(train={"workers": 2}), inputs=None)


@pytest.mark.slow
@pytest.mark.integration
def test_two_cpu_workers_learn_as_well_as_one(
    local_ray, ml100k_sample_store, synthetic_semantic_ids, tmp_path, monkeypatch
):
    seen: dict[str, tuple[training_run.TrainedParts, float]] = {}

    def spy(name, real):
        def wrapped(*args, **kwargs):
            started = time.perf_counter()
            parts = real(*args, **kwargs)
            seen[name] = (parts, time.perf_counter() - started)
            return parts

        return wrapped

    monkeypatch.setattr(training_run, "train_parts", spy("one", training_run.train_parts))
    monkeypatch.setattr(ray_train, "train_parts_on_ray", spy("two", ray_train.train_parts_on_ray))
    one = tiny_settings(tmp_path / "one")
    two = Settings(home=tmp_path / "two", model=one.model, train={"workers": 2})
    overrides = {"epochs": 4, "draft_epochs": 2}
    for settings in (one, two):
        training_run.train_models(settings, ml100k_sample_store, overrides=overrides,
                                  semantic_ids=synthetic_semantic_ids, progress=False)  # fmt: skip

    (parts_one, seconds_one), (parts_two, seconds_two) = seen["one"], seen["two"]
    ids = synthetic_semantic_ids
    item_tokens = ItemTokens(ids.item_ids, ids.codes, ids.layout)
    cases = [c for c in load_split(ml100k_sample_store).test.values() if c.target in item_tokens]
    history = one.model.history_items
    torch.manual_seed(0)
    untrained = held_out_loss(build_target(PRESETS["tiny"], ids.layout), item_tokens, cases,
                              history)  # fmt: skip
    loss_one = held_out_loss(parts_one.target, item_tokens, cases, history)
    loss_two = held_out_loss(parts_two.target, item_tokens, cases, history)
    print(f"\nheld-out loss: untrained {untrained:.4f}, 1 worker {loss_one:.4f} "
          f"({seconds_one:.1f} s), 2 workers {loss_two:.4f} ({seconds_two:.1f} s, "
          f"Ray Train {parts_two.metrics['ray_train_seconds']:.1f} s)")  # fmt: skip
    assert loss_one < untrained - 0.02 and loss_two < untrained - 0.02
    assert loss_two == pytest.approx(loss_one, rel=0.02)
    # The same global batches: the per-epoch training losses agree (float sum order only).
    for plot in ("target_curves.png", "draft_curves.png"):
        for name, curve in parts_one.curves[plot].items():
            assert parts_two.curves[plot][name] == pytest.approx(curve, rel=1e-3), (plot, name)
    assert sorted(parts_two.drafts) == ["atspeed_r", "atspeed_s", "sft"]

    # Saved and served like any version: the stored target is the one trained on Ray.
    models = load_active_models(two, ml100k_sample_store)
    assert models.version == 2 and sorted(models.drafts) == ["atspeed_r", "atspeed_s", "sft"]
    assert models.metrics["train_workers"] == 2
    assert held_out_loss(models.target, item_tokens, cases, history) == pytest.approx(loss_two)
    assert not list((two.data_dir / "ray-train").iterdir())  # the run's checkpoints are gone
