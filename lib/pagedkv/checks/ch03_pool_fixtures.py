"""The small pools exercise 3's decision checks share, and how they read one.

``hashed_pool`` builds a pool a request holds some blocks of (some hashed,
some held twice); ``queue_ids``, ``pool_state`` and ``snapshot_pool`` read a
pool the way the checks compare two of them. The checks themselves are in
``ch03_pool_decisions`` (freeing, touching) and ``ch03_allocation`` (what
an allocation takes, what a lookup finds).
"""

from __future__ import annotations

from ..block_pool import BlockPool
from ..free_queue import KVCacheBlock

__all__ = ["hashed_pool", "queue_ids", "pool_state", "snapshot_pool"]


def hashed_pool(n_blocks: int = 10, held: int = 6, hashed=(2, 4),
                twice=(3,)) -> tuple[BlockPool, list[KVCacheBlock]]:
    """A pool whose first ``held`` blocks a request holds; some hashed, some held twice."""
    pool = BlockPool(n_blocks)
    blocks = pool.get_new_blocks(held)
    for i in hashed:
        pool.cache_full_blocks([blocks[i]], [1000 + i], 0, 1)
    pool.touch([blocks[i] for i in twice])
    return pool, blocks


def queue_ids(pool: BlockPool) -> list[int]:
    """The free queue's block ids, head first."""
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def pool_state(pool: BlockPool) -> dict:
    """Everything a decision may change, by name: queue, references, hashes, the cache map."""
    return {
        "free queue (head to tail)": queue_ids(pool),
        "ref_cnt": {b.block_id: b.ref_cnt for b in pool.blocks[1:]},
        "hashes": {b.block_id: b.block_hash for b in pool.blocks
                   if b.block_hash is not None},
        "cached_block_hash_to_block": {
            h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()},
    }


def snapshot_pool(pool: BlockPool):
    """The queue, every block's ``ref_cnt`` (the null block's too) and every hash."""
    return (queue_ids(pool), [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks])
