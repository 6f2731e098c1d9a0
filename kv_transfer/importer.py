"""The decode side's import decision: which of a handle's blocks to pull.

Only blocks the receiver does not already hold move. A handle's full blocks
are matched by hash through the receiver's `lookup`; the last, partial block
of a prompt has no hash and always moves.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.handle import KVHandle


@dataclass(slots=True)
class ImportPlan:
    """Per block index of the handle: our cached block id, or None where it must be pulled."""
    cached: list[int | None]

    @property
    def missing(self) -> list[int]:
        """Block indices to pull, ascending."""
        return [i for i, block_id in enumerate(self.cached) if block_id is None]

    def block_table(self, pulled_block_ids: list[int]) -> list[int]:
        """The request's full block table once `missing` has been pulled into `pulled_block_ids`."""
        fill = iter(pulled_block_ids)
        return [next(fill) if block_id is None else block_id for block_id in self.cached]


def plan_import(handle: KVHandle, lookup: Callable[[int], int | None]) -> ImportPlan:
    """Match every full block by hash; `lookup(block_hash)` gives our block id holding it, or None."""
    hashes = list(handle.block_hashes) + [None] * (handle.num_blocks - len(handle.block_hashes))
    return ImportPlan([None if h is None else lookup(h) for h in hashes])
