"""Teacher beams on small catalogs (offline training): fewer items than the preset's
``teacher_beams`` give fewer beams; a prompt that loses its beams in a batch is decoded
again alone, and one that loses them even alone is a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genrec.offline.training.draft import _complete_beams, make_teacher_data, teacher_width
from genrec.online.decoding.trie import ItemTrie
from genrec.online.models.presets import PRESETS, build_target
from genrec.online.prompts import history_prompt
from tests.helpers import random_items


def test_teacher_width_is_the_catalog_when_smaller():
    assert teacher_width(5, 500) == 5
    assert teacher_width(5, 3) == 3
    assert teacher_width(10, 1) == 1


def test_make_teacher_data_on_a_catalog_smaller_than_k():
    torch.manual_seed(0)
    items = random_items(3, (2, 2, 2))
    tree = ItemTrie.from_item_tokens(items)
    target = build_target(PRESETS["tiny"], items.layout).eval()
    rng = np.random.default_rng(0)
    prompts = [history_prompt([f"i{j}" for j in rng.integers(0, 3, n)], items, 50)
               for n in (1, 2, 5, 3)]  # fmt: skip
    teacher = make_teacher_data(target, items, tree, prompts, ["i0"] * 4, k=5, progress=False)
    assert teacher.beams.shape == (4, 3, 3)
    # every beam is a real item, each item once per prompt
    for row in teacher.beams.tolist():
        assert sorted(tree.item_index(torch.tensor(row)).tolist()) == [0, 1, 2]


class _CannedPool:
    """A pool whose ``map`` answers each page from ``answer(prompts)`` (no model)."""

    def __init__(self, answer) -> None:
        self.answer, self.pages = answer, []

    def map(self, fn, pages, **_shown):
        for prompts, k in pages:
            self.pages.append(prompts)
            yield self.answer(prompts, k)


def _found(index_rows: list[list[int]], depth: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    index = torch.tensor(index_rows)
    tokens = (index[..., None] * 10 + torch.arange(depth)).clamp(min=-1)
    return index, tokens


def test_prompts_that_lost_beams_in_a_batch_are_decoded_alone():
    prompts = [[1, 5], [1, 6], [1, 7]]
    batch = _found([[0, 1], [-1, -1], [2, 0]])  # the second prompt lost its beams
    pool = _CannedPool(lambda ps, k: _found([[3, 4]]))
    beams = _complete_beams(pool, prompts, [batch], 2, {"progress": False, "unit": "batch"})
    assert pool.pages == [[[1, 6]]]  # only the prompt that lost its beams, alone
    assert beams[1].tolist() == _found([[3, 4]])[1][0].tolist()
    assert beams[0].tolist() == batch[1][0].tolist() and beams[2].tolist() == batch[1][2].tolist()


def test_a_prompt_without_beams_even_alone_is_a_clear_error():
    pool = _CannedPool(lambda ps, k: _found([[-1, -1]]))
    with pytest.raises(ValueError, match="teacher_beams"):
        _complete_beams(pool, [[1, 5]], [_found([[-1, 2]])], 2, {"progress": False})
