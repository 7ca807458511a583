"""Data-parallel training on Ray Train (offline step, models): ``train.workers > 1``.

``train_parts_on_ray`` runs the training of one model version (``run.train_parts``:
target, SFT draft, teacher beams, AtSpeed-S and AtSpeed-R) in ``train.workers``
processes of a Ray Train ``TorchTrainer``: DDP over gloo on CPU workers, NCCL when each
worker has a GPU (``train.use_gpu``; by default when the cluster has one per worker).
Every worker runs the very same loops on its share of each global batch
(``genrec.offline.training.parallel``), so the global batch stays the preset's
``batch_size`` and N workers take the same steps as one; validation cases and the
teacher's prompts are split between them too. It is one Ray Train run for all four
models, because each run costs a worker-group start (tens of seconds on a loaded host).

The inputs (split, item tokens, preset, the base or active target) travel to the
workers through Ray's object store. The trained models come back through a Ray Train
checkpoint directory under ``train.storage_dir`` written by rank 0 exactly as a model
version stores them (``save_pretrained`` safetensors plus ``item_vectors.safetensors``,
figures as JSON; no pickle), and are loaded like a stored version, so everything after
training (test figures, draft agreement, ``save_model_version``) is unchanged. The run's
folder is removed once they are loaded.

Ray is imported only here, only when called (``genrec.offline.ray_cluster``); with
``train.workers = 1`` none of this runs.

Example::

    >>> settings = Settings(train={"workers": 2})  # doctest: +SKIP
    >>> parts = train_parts_on_ray(settings, inputs)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from genrec.offline.ray_cluster import connect_ray
from genrec.offline.training.parallel import DataShard
from genrec.offline.training.run import TrainedParts, TrainingInputs, train_parts
from genrec.online.decoding.trie import ItemTrie
from genrec.online.models.item_vectors import load_item_vectors, save_pretrained_with_item_vectors
from genrec.online.models.presets import pick_device

log = logging.getLogger("genrec.models")

PARTS_FILE = "parts.json"  # metrics and loss curves of the run (rank 0's)


def train_parts_on_ray(settings, inputs: TrainingInputs, progress: bool = True) -> TrainedParts:
    """``train_parts(inputs)`` in ``settings.train.workers`` data-parallel Ray Train workers."""
    ray = connect_ray(settings.offline)
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    train = settings.train
    use_gpu = _use_gpu(ray, train.workers, train.use_gpu)
    resources = {"CPU": train.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    storage = Path(train.storage_dir or settings.path("ray-train", "runs").parent)
    storage.mkdir(parents=True, exist_ok=True)
    name = f"genrec-train-{uuid.uuid4().hex[:12]}"
    inputs_ref = ray.put(inputs)  # once into the object store, read by every worker
    config = {
        "inputs": inputs_ref, "progress": progress, "torch_threads": settings.model.torch_threads,
        "log": (settings.log_level, settings.log_format, settings.log_levels),
    }  # fmt: skip
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config=config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=train.workers, use_gpu=use_gpu, resources_per_worker=resources
        ),
        run_config=RunConfig(storage_path=str(storage), name=name),
    )
    log.info("training on %d Ray Train workers (%s)", train.workers, "GPU" if use_gpu else "CPU")
    started = time.perf_counter()
    result = trainer.fit()
    try:
        with result.checkpoint.as_directory() as folder:
            parts = read_parts(Path(folder), inputs)
    finally:
        shutil.rmtree(storage / name, ignore_errors=True)
    parts.metrics["ray_train_seconds"] = time.perf_counter() - started
    return parts


def _use_gpu(ray, workers: int, wanted: bool | None) -> bool:
    """``train.use_gpu``, or (None) whether the cluster has a GPU for every worker."""
    if wanted is not None:
        return wanted
    return ray.cluster_resources().get("GPU", 0) >= workers


def _worker_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: its shard of ``train_parts``; rank 0 reports the models."""
    # Imported in the Ray worker's own process, where this function runs.
    import ray
    import ray.train
    from ray.train import Checkpoint

    from genrec.infra.logs import configure_logging

    configure_logging(*config["log"])
    torch.set_num_threads(config["torch_threads"])
    context = ray.train.get_context()
    device = "cpu"
    if torch.cuda.is_available():
        # Ray Train may show a node's workers all its GPUs: "cuda" (pick_device) must
        # mean this worker's own.
        own = ray.train.torch.get_device()
        torch.cuda.set_device(own)
        device = str(own)
    shard = DataShard(context.get_world_rank(), context.get_world_size(), device)
    inputs = ray.get(config["inputs"])
    parts = train_parts(inputs, shard, progress=config["progress"] and shard.rank == 0)
    with tempfile.TemporaryDirectory(prefix="genrec-train-parts-") as folder:
        checkpoint = None
        if shard.rank == 0:
            write_parts(parts, Path(folder), with_target=inputs.target is None)
            checkpoint = Checkpoint.from_directory(folder)
        # every worker reports (Ray Train waits for all); only rank 0 has the models
        ray.train.report({"rank": shard.rank}, checkpoint=checkpoint)


def write_parts(parts: TrainedParts, folder: Path, with_target: bool = True) -> None:
    """The models as a model version stores them (safetensors), figures and curves as JSON."""
    models = {f"drafts/{variant}": model for variant, model in parts.drafts.items()}
    if with_target:
        models["target"] = parts.target
    for name, model in models.items():
        save_pretrained_with_item_vectors(model, folder / name)
    summary = {"metrics": parts.metrics, "curves": parts.curves, "drafts": list(parts.drafts),
               "target": with_target}  # fmt: skip
    (folder / PARTS_FILE).write_text(json.dumps(summary))


def read_parts(folder: Path, inputs: TrainingInputs) -> TrainedParts:
    """What ``write_parts`` wrote, the models on this process's device, ready to decode."""
    from transformers import AutoModelForCausalLM

    summary = json.loads((folder / PARTS_FILE).read_text())
    device = pick_device()
    tree = ItemTrie.from_item_tokens(inputs.item_tokens, device)

    def load(path: Path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        load_item_vectors(model, path, tree)
        return model.eval()

    target = load(folder / "target") if summary["target"] else inputs.target
    drafts = {variant: load(folder / "drafts" / variant) for variant in summary["drafts"]}
    return TrainedParts(target, drafts, summary["metrics"], summary["curves"])
