"""The refresh's torch threads (offline refresh): never every CPU, and a model's item-vector
input keeps one trie across calls (no per-call work over the catalog)."""

from __future__ import annotations

import torch

from genrec.offline.refresh import step_threads
from genrec.online.decoding.prefix_kv import compute_prefix_kv
from genrec.online.decoding.trie import ItemTrie
from genrec.online.models.item_vectors import attach_item_vectors
from genrec.online.models.presets import PRESETS, build_target
from genrec.online.prompts import history_prompt
from tests.helpers import random_items


def test_step_threads_leaves_one_cpu_free():
    assert step_threads(2, cpus=2) == 1
    assert step_threads(2, cpus=1) == 1
    assert step_threads(2, cpus=16) == 2
    assert step_threads(8, cpus=4) == 3
    assert step_threads(1) == 1  # this host's affinity set


def test_prefix_kv_calls_reuse_the_models_trie():
    torch.manual_seed(0)
    items = random_items(40, (6, 5, 4))
    trie = ItemTrie.from_item_tokens(items)
    target = build_target(PRESETS["tiny"], items.layout).eval()
    embedding = attach_item_vectors(target, trie, torch.ones(40, 8))
    prompts = [history_prompt([f"i{k}" for k in range(n)], items, 50) for n in (1, 3, 7)]
    for _ in range(3):
        compute_prefix_kv(target, prompts, "v1")
    assert embedding.trie is trie  # on its device already: no copy of the catalog per call
