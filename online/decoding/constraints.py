"""Which codes a decode may pick next: the trie, then seen-item exclusion (online decoding step).

A constraint is applied to the scores of the next level's codes after each
beam's prefix, in two stages, like a chain of transformers logits processors:

1. The ``ItemTrie``: codes that keep the prefix a valid item ID. The
   ``"allowed"`` score mode renormalizes the model's distribution over them.
2. Exclusions, e.g. ``SeenItems``: codes that lead only into items a user must
   not get. They are masked AFTER normalizing, so every other item keeps the
   score it has without them, and a beam never spends itself on a dead subtree,
   so K beams still give K items.

``ItemConstraint`` composes a trie with any number of exclusions. The batched
engine (``engine.py``: one set of dead nodes per batch, ``dead_nodes``) and
``TrieLogitsProcessor`` (transformers' ``generate``, the reference our search is
checked against: per-level masks, ``masks``) both read it, and ``SeenItems``
answers both from one sparse set (``TrieTables.dead_nodes``: sorted keys, sized by
the excluded items, not the catalog), so the two paths cannot drift apart.

Example::

    >>> import torch
    >>> from genrec.schemas.token_layout import TokenLayout
    >>> layout = TokenLayout.for_scratch_model((4, 4, 2))
    >>> trie = ItemTrie(torch.tensor(layout.encode([[0, 1, 0], [0, 2, 0], [3, 1, 1]])), layout)
    >>> constraint = ItemConstraint(trie).excluding(SeenItems(trie, [[0]]))
    >>> allowed, blocked = constraint.masks(torch.tensor([[4]]), user=0)  # after <a_0>
    >>> allowed.int().tolist(), blocked.int().tolist()  # <b_1> leads only to the seen item 0
    ([[0, 1, 1, 0]], [[0, 1, 0, 0]])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from genrec.online.decoding.trie import ItemTrie
from genrec.online.decoding.trie_tables import DeadNodes, TrieTables


class Exclusion(Protocol):
    """Codes a user must not pick, masked after the scores are normalized over the trie."""

    def applies(self, level: int, user: int) -> bool:
        """Whether anything is excluded at ``level`` for ``user`` (saves the node lookup if not)."""
        ...

    def blocked(self, children: torch.Tensor, level: int, user: int) -> torch.Tensor:
        """BoolTensor like ``children`` (``ItemTrie.child_nodes`` of length-``level`` prefixes)."""
        ...

    def dead_nodes(self) -> DeadNodes | None:
        """``DeadNodes`` over ``TrieTables``' global node ids: the nodes user b must not
        reach (None: nothing excluded), what ``blocked`` answers for one level."""
        ...


class SeenItems:
    """Per user, the catalog rows it must not get, as the trie nodes with only those items below.

    ``exclude[b]``: catalog rows of user ``b`` (empty: nothing excluded). One
    sparse set (``TrieTables.dead_nodes``) serves the batched engine whole and
    ``generate``'s processor a level at a time.
    """

    def __init__(self, trie: ItemTrie, exclude: Sequence[Sequence[int]]) -> None:
        tables = TrieTables.of(trie)
        self.n_users = len(exclude)
        self.dead = tables.dead_nodes(exclude)
        # global ids of level d's nodes: first[d] .. first[d + 1] (level depth: the items)
        self.first = [*tables.offsets, tables.sink]

    def __len__(self) -> int:
        return self.n_users

    def applies(self, level: int, user: int) -> bool:
        if self.dead is None:
            return False
        return self.dead.any_between(user, self.first[level + 1], self.first[level + 2])

    def blocked(self, children: torch.Tensor, level: int, user: int) -> torch.Tensor:
        if self.dead is None:
            return torch.zeros_like(children, dtype=torch.bool)
        nodes = self.first[level + 1] + children.clamp(min=0)
        return self.dead.contains(nodes, user=user) & (children >= 0)

    def dead_nodes(self) -> DeadNodes | None:
        return self.dead


@dataclass(frozen=True)
class ItemConstraint:
    """The trie's valid codes, minus what the ``exclusions`` block."""

    trie: ItemTrie
    exclusions: tuple[Exclusion, ...] = ()

    @classmethod
    def for_users(
        cls, trie: ItemTrie, exclude: Sequence[Sequence[int]] | None, n_users: int
    ) -> ItemConstraint:
        """The trie, excluding catalog rows ``exclude[b]`` for user ``b`` (None: nothing)."""
        constraint = cls(trie)
        if exclude is None:
            return constraint
        if len(exclude) != n_users:
            raise ValueError(f"exclude has {len(exclude)} entries for {n_users} users")
        return constraint.excluding(SeenItems(trie, exclude))

    def excluding(self, exclusion: Exclusion) -> ItemConstraint:
        """This constraint with one more exclusion."""
        return replace(self, exclusions=(*self.exclusions, exclusion))

    def masks(self, prefixes: torch.Tensor, user: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(allowed, blocked), both BoolTensor[W, C_d] over the next level's codes.

        ``allowed``: the trie's valid codes (the set ``"allowed"`` scores
        normalize over); ``blocked``: those the exclusions mask after
        normalizing, None when none applies to ``user`` at this level.
        """
        level = prefixes.shape[1]
        live = [e for e in self.exclusions if e.applies(level, user)]
        if not live:
            return self.trie.allowed_mask(prefixes), None
        children = self.trie.child_nodes(prefixes)
        blocked = live[0].blocked(children, level, user)
        for exclusion in live[1:]:
            blocked = blocked | exclusion.blocked(children, level, user)
        return children >= 0, blocked  # a child node exists exactly where the trie allows

    def dead_nodes(self) -> DeadNodes | None:
        """The nodes each user must not reach, of every exclusion (their union; None: nothing
        excluded); what the batched engine masks after normalizing."""
        sets = [s for s in (e.dead_nodes() for e in self.exclusions) if s is not None]
        if not sets:
            return None
        dead = sets[0]
        for other in sets[1:]:
            dead = dead | other
        return dead


def mask_blocked(scores: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
    """``scores`` with the ``blocked`` codes at -inf (unchanged for None)."""
    return scores if blocked is None else scores.masked_fill(blocked, -math.inf)


class TrieLogitsProcessor:
    """The same constraint for transformers' ``generate`` (a ``LogitsProcessor``).

    ``prompt_width`` is the (left-padded) prompt length; ``renormalize=True``
    gives ``score_mode="allowed"``, False gives ``"full"``. ``exclude[b]``:
    catalog rows prompt ``b`` must not get, masked after normalizing as the
    batched engine does; rows are grouped ``num_beams`` per prompt. Used to
    check our decoder against ``generate`` and for offline runs that call
    ``generate``.
    """

    def __init__(
        self,
        trie: ItemTrie,
        prompt_width: int,
        renormalize: bool = True,
        exclude: Sequence[Sequence[int]] | None = None,
        num_beams: int = 1,
    ) -> None:
        n_users = len(exclude) if exclude is not None else 0
        self.constraint = ItemConstraint.for_users(trie, exclude, n_users)
        self.prompt_width, self.renormalize, self.num_beams = prompt_width, renormalize, num_beams

    @classmethod
    def for_constraint(
        cls,
        constraint: ItemConstraint,
        prompt_width: int,
        renormalize: bool = True,
        num_beams: int = 1,
    ) -> TrieLogitsProcessor:
        """The processor of any ``ItemConstraint`` (user b = rows ``b * num_beams`` onwards)."""
        processor = cls(constraint.trie, prompt_width, renormalize, num_beams=num_beams)
        processor.constraint = constraint
        return processor

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        layout = self.constraint.trie.layout
        generated = input_ids[:, self.prompt_width :]
        level = generated.shape[1]
        allowed = torch.zeros_like(scores, dtype=torch.bool)
        if level >= layout.depth:
            allowed[:, layout.eos_token_id] = True
            masked = scores.masked_fill(~allowed, -math.inf)
            return torch.log_softmax(masked, -1) if self.renormalize else masked
        codes = slice(layout.level_range(level).start, layout.level_range(level).stop)
        blocked = []
        for rows, user in self._users(len(scores)):
            allowed[rows, codes], mask = self.constraint.masks(generated[rows], user)
            blocked.append((rows, mask))
        masked = scores.masked_fill(~allowed, -math.inf)
        out = torch.log_softmax(masked, -1) if self.renormalize else masked
        for rows, mask in blocked:
            if mask is not None:
                out[rows, codes] = mask_blocked(out[rows, codes], mask)
        return out

    def _users(self, n_rows: int) -> list[tuple[slice, int]]:
        """(rows, user) groups; one group for every row when nothing is excluded."""
        if not self.constraint.exclusions:
            return [(slice(None), 0)]  # the user index is only read by exclusions
        width = self.num_beams
        return [(slice(b * width, (b + 1) * width), b) for b in range(n_rows // width)]
