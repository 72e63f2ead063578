"""Who holds which block: names for the pool's blocks, which the pool itself does not know.

``owners`` arguments across the views accept a ``BlockOwners``, a mapping
``{name: [blocks or block ids]}`` (for instance ``KVCacheManager.req_to_blocks``)
or a function returning one; ``owner_labels`` turns any of them into
``{block_id: [names]}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager

from ..block_pool import BlockPool
from ..free_queue import KVCacheBlock
from ..pool_events import PoolEvent

__all__ = ["BlockOwners", "Owners", "owner_labels"]


class BlockOwners:
    """Which request holds which block, learned from the pool's events.

    The pool does not know its requests; its caller does. Wrap each call in
    ``acting_for(name)`` and this object records ``name`` on the blocks it
    allocated or touched, and removes it from the blocks it freed. Create it
    before any view or recorder that uses it, so it hears each event first.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._labels: dict[int, list[str]] = {}
        self._actor: str | None = None
        self._unsubscribe = pool.subscribe(self._on_event)

    @property
    def actor(self) -> str | None:
        """The name the current ``acting_for`` block attributes calls to (None outside one)."""
        return self._actor

    @contextmanager
    def acting_for(self, name: str):
        """Attribute the pool calls made inside the ``with`` block to ``name``."""
        previous, self._actor = self._actor, str(name)
        try:
            yield self
        finally:
            self._actor = previous

    def _on_event(self, pool: BlockPool, event: PoolEvent) -> None:
        actor, labels = self._actor, self._labels
        if event.kind == "allocate":
            for b in event.block_ids:
                labels[b] = [actor] if actor else []
        elif event.kind == "touch":
            for b in event.block_ids:
                if actor:
                    labels.setdefault(b, []).append(actor)
        elif event.kind == "free":
            for b in event.block_ids:
                if actor and actor in labels.get(b, ()):
                    labels[b].remove(actor)
            for b in event.block_ids:
                if pool.blocks[b].ref_cnt == 0:
                    labels.pop(b, None)

    def labels(self) -> dict[int, list[str]]:
        """``{block_id: [owner, ...]}`` for the blocks in use."""
        return {b: list(names) for b, names in self._labels.items() if names}

    def close(self) -> None:
        """Stop listening to the pool."""
        self._unsubscribe()


Owners = BlockOwners | Mapping[str, Sequence] | Callable[[], Mapping[str, Sequence]] | None


def owner_labels(owners: Owners) -> dict[int, list[str]]:
    """Normalise any accepted ``owners`` to ``{block_id: [names]}``."""
    if owners is None:
        return {}
    if isinstance(owners, BlockOwners):
        return owners.labels()
    if callable(owners):
        owners = owners()
    labels: dict[int, list[str]] = {}
    for name, blocks in owners.items():
        for block in blocks:
            block_id = block.block_id if isinstance(block, KVCacheBlock) else int(block)
            labels.setdefault(block_id, []).append(str(name))
    return labels
