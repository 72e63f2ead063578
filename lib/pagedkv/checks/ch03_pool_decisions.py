"""Checks for the decisions of exercises/03_block_pool.ipynb.

The learner writes three of ``BlockPool``'s decisions, as functions of the pool:

* ``free_blocks(pool, ordered_blocks)``: release one reference to each block;
  of those reaching zero, unhashed ones go to the *head* of the free queue in
  the given order, hashed ones to the *tail* in the given order; the null
  block is never queued (skipped, as vLLM does, or refused with
  ``ValueError``, as the library does);
* ``free_request(pool, req_blocks)``: what ``KVCacheManager.free`` asks of
  the pool for a finished request: its blocks in table order, freed tail
  first (``reversed``);
* ``touch(pool, blocks)``: a prefix hit; a block nobody holds leaves the free
  queue, and every block's ``ref_cnt`` rises by one;
* ``get_new_blocks(pool, n)``: pop ``n`` blocks from the head of the free
  queue, each with ``ref_cnt`` 1; a popped block that still carries a hash
  leaves the prefix cache (its hash and its entry in
  ``cached_block_hash_to_block``); with fewer than ``n`` free, refuse with
  vLLM 0.33.0's ``ValueError("Cannot get n free blocks from the pool")``
  before changing anything;
* ``find_longest_cache_hit(pool, block_hashes, num_tokens, block_size)``: the
  cached blocks of the longest prefix, walking the hashes until the first
  miss, in whole blocks of at most ``num_tokens - 1`` tokens; it only looks.

Each checker builds one real ``KVCacheManager`` that runs the learner's
function through the library's extension points (a ``BlockPool`` subclass as
the manager's ``block_pool_class``; ``release_blocks`` for ``free_request``;
a ``KVCacheManager`` subclass overriding ``get_computed_blocks`` for
``find_longest_cache_hit``)
and runs seeded random operation sequences -- admissions with prefix hits, prefill chunks, decode steps,
preemptions, finished requests, copy-on-write -- beside an untouched manager,
comparing after every operation the block tables, every ``ref_cnt``, the
free queue in order and the cached hashes, with ``check()`` on both. A
difference is diagnosed by running the learner's function on small fixed
cases whose answer tells the common mistakes apart.
"""

from __future__ import annotations

from ..block_pool import BlockPool
from ..free_queue import KVCacheBlock
from ..kv_cache_manager import KVCacheManager
from ..request import Request
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue
from .manager_trial import manager_trial

__all__ = ["check_free_blocks", "check_touch", "check_get_new_blocks",
           "check_find_longest_cache_hit"]


# --------------------------------------------------------------- free_blocks
def _hashed_pool(n_blocks: int = 10, held: int = 6, hashed=(2, 4),
                 twice=(3,)) -> tuple[BlockPool, list[KVCacheBlock]]:
    """A pool whose first ``held`` blocks a request holds; some hashed, some held twice."""
    pool = BlockPool(n_blocks)
    blocks = pool.get_new_blocks(held)
    for i in hashed:
        pool.cache_full_blocks([blocks[i]], [1000 + i], 0, 1)
    pool.touch([blocks[i] for i in twice])
    return pool, blocks


def _queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def _free_model(before: list[int], batch: list[KVCacheBlock], *,
                unhashed_tail=False, hashed_head=False, reverse_head=False,
                reverse_tail=False, ignore_refs=False) -> list[int]:
    """The free queue after freeing ``batch``, with one decision swapped."""
    head, tail = [], []
    for b in batch:
        if b.ref_cnt - 1 > 0 and not ignore_refs:
            continue
        (tail if b.block_hash is not None else head).append(b.block_id)
    if reverse_head:
        head = head[::-1]
    if reverse_tail:
        tail = tail[::-1]
    if unhashed_tail:
        return before + head + tail
    if hashed_head:
        return tail + head + before
    return head + before + tail


FREE_MISTAKES = [
    Mistake("unhashed blocks appended", "a block without a hash can never "
            "match the prefix cache: prepend it, so it is reused first "
            "(prepend_n, not append_n)"),
    Mistake("hashed blocks prepended", "a block with a hash stays matchable "
            "while it waits: append it at the tail, so it is evicted last"),
    Mistake("reversed batch", "prepending one block at a time reverses "
            "them: collect the blocks, then one prepend_n keeps their order"),
    Mistake("hashed batch reversed", "append the hashed blocks in the given "
            "order: the first one listed is evicted first"),
    Mistake("ref_cnt not decremented, or queued while held", "take one "
            "reference off each block; only a block reaching 0 is free"),
    Mistake("the null block queued", "block 0 is never allocated or freed: "
            "skip it (vLLM) or refuse it (the library)"),
    Mistake("forgot reversed", "free_request frees a request's blocks tail "
            "first: free_blocks(pool, reversed(req_blocks)), so its tail, "
            "the least shareable part, is evicted first"),
]


def _diagnose_free(free_blocks, free_request) -> str | None:
    """Run the learner's functions on fixed pools; name the first mistake seen."""
    try:
        pool, blocks = _hashed_pool()
        before = _queue_ids(pool)
        free_blocks(pool, list(blocks))
        got = _queue_ids(pool)
        models = [
            (0, dict(unhashed_tail=True)), (1, dict(hashed_head=True)),
            (2, dict(reverse_head=True)), (3, dict(reverse_tail=True)),
            (4, dict(ignore_refs=True)),
        ]
        pool2, blocks2 = _hashed_pool()
        for i, kw in models:
            if got == _free_model(before, blocks2, **kw):
                return FREE_MISTAKES[i].diagnosis()
        if got != _free_model(before, blocks2):
            return None
        pool, blocks = _hashed_pool(hashed=(), twice=())
        before = _queue_ids(pool)
        free_request(pool, list(blocks))
        if _queue_ids(pool) == [b.block_id for b in blocks] + before:
            return FREE_MISTAKES[6].diagnosis()
    except Exception:  # noqa: BLE001 -- the trial's message says what happened
        return None
    return None


def _free_manager(learner_free_blocks, learner_free_request=None):
    """A ``KVCacheManager`` class whose pool frees with the learner's ``free_blocks``.

    Built through the library's extension points: the pool is a ``BlockPool``
    subclass (``block_pool_class``); with ``learner_free_request``, the step of
    ``free`` that returns a table to the pool (``release_blocks``) is the
    learner's too. Without it, the library's ``release_blocks`` calls the
    pool's (the learner's) ``free_blocks`` on the reversed table.
    """
    class LearnerPool(BlockPool):
        def free_blocks(self, ordered_blocks):
            learner_free_blocks(self, ordered_blocks)

    class LearnerManager(KVCacheManager):
        block_pool_class = LearnerPool

        if learner_free_request is not None:
            def release_blocks(self, req_blocks):
                learner_free_request(self.block_pool, req_blocks)

    return LearnerManager


def check_free_blocks(free_blocks, free_request, seeds: int = 12,
                      timeout: float = 30.0) -> CheckReport:
    """Check ``free_blocks(pool, ordered_blocks)`` and ``free_request(pool, req_blocks)``."""
    with Checker("free_blocks", timeout=timeout) as c:
        def probe():
            pool, blocks = _hashed_pool()
            free_blocks(pool, blocks)

        c.probe(probe)

        def order():
            pool, blocks = _hashed_pool()
            before = _queue_ids(pool)
            free_blocks(pool, list(blocks))
            got = _queue_ids(pool)
            ref, ref_blocks = _hashed_pool()
            ref.free_blocks(list(ref_blocks))
            want = _queue_ids(ref)
            if got != want:
                raise WrongAnswer(
                    f"freeing blocks {[b.block_id for b in blocks]} (2 and 4 "
                    f"hashed, 3 held twice) into a queue {before}: the queue "
                    f"is {got}, expected {want}",
                    _diagnose_free(free_blocks, free_request))
            refs = [b.ref_cnt for b in blocks]
            if refs != [b.ref_cnt for b in ref_blocks]:
                raise WrongAnswer(f"ref_cnt afterwards {refs}, expected "
                                  f"{[b.ref_cnt for b in ref_blocks]}",
                                  FREE_MISTAKES[4].diagnosis())

        c.prop("at 0, unhashed blocks go to the head, hashed ones to the tail, "
               "in order", order,
               "split the blocks that reach 0 by block_hash, then one "
               "prepend_n and one append_n")

        def null_block():
            pool, blocks = _hashed_pool()
            before = _snapshot_pool(pool)
            try:
                free_blocks(pool, [pool.null_block])
            except ValueError:
                pass
            if _snapshot_pool(pool) != before or (
                    pool.null_block.prev_free_block is not None):
                raise WrongAnswer("freeing the null block changed the pool",
                                  FREE_MISTAKES[5].diagnosis())

        c.prop("the null block is never queued", null_block,
               "if block.is_null: skip it")

        def tail_first():
            pool, blocks = _hashed_pool(hashed=(), twice=())
            before = _queue_ids(pool)
            free_request(pool, list(blocks))
            want = [b.block_id for b in reversed(blocks)] + before
            if _queue_ids(pool) != want:
                raise WrongAnswer(
                    f"free_request of table {[b.block_id for b in blocks]}: "
                    f"the queue is {_queue_ids(pool)}, expected {want}",
                    _diagnose_free(free_blocks, free_request))

        c.prop("free_request frees a request's blocks tail first", tail_first,
               "free_blocks(pool, reversed(req_blocks))")

        def trials():
            # Even seeds: the learner's free_blocks under the library's free;
            # odd seeds: the learner's free_request as well.
            for seed in range(seeds):
                manager = _free_manager(free_blocks,
                                        free_request if seed % 2 else None)
                manager_trial(manager, seed, diagnose=lambda: _diagnose_free(
                    free_blocks, free_request))

        c.prop(f"{seeds} random scheduler runs in KVCacheManager match the "
               "library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_free(free_blocks, free_request))
    return c.report


def _snapshot_pool(pool: BlockPool):
    return (_queue_ids(pool), [b.ref_cnt for b in pool.blocks[1:]],
            [b.block_hash for b in pool.blocks])


catalogue(check_free_blocks, FREE_MISTAKES)


# --------------------------------------------------------------------- touch
TOUCH_MISTAKES = [
    Mistake("forgot the touch", "a block nobody held is still in the free "
            "queue: take it out (queue.remove) or the next allocation can "
            "hand it to another request while this one reads it"),
    Mistake("only free blocks counted", "every hit block gains a reference, "
            "also one other requests already hold"),
    Mistake("removed a block that is not queued", "only a block with "
            "ref_cnt == 0 sits in the free queue; test before removing"),
    Mistake("ref_cnt set, not raised", "add one: other requests may hold "
            "the block too"),
]


def _touch_case():
    """A free cached block (ref 0, in the queue) and a block two requests hold."""
    pool, blocks = _hashed_pool(held=4, hashed=(1,), twice=(2,))
    pool.free_blocks([blocks[1]])  # ref 0, hashed: queued at the tail
    return pool, blocks[1], blocks[2]


def _diagnose_touch(touch) -> str | None:
    pool, free, held = _touch_case()
    try:
        touch(pool, [free, held])
    except ValueError:
        return TOUCH_MISTAKES[2].diagnosis()
    except Exception:  # noqa: BLE001 -- the property's message says what
        return None
    if free.prev_free_block is not None or free.block_id in _queue_ids(pool):
        return TOUCH_MISTAKES[0].diagnosis()
    if held.ref_cnt == 2:
        return TOUCH_MISTAKES[1].diagnosis()
    if held.ref_cnt == 1 or free.ref_cnt != 1:
        return TOUCH_MISTAKES[3].diagnosis()
    return None


def _touch_manager(learner_touch):
    """A ``KVCacheManager`` class whose pool (``block_pool_class``) touches with the learner's ``touch``."""
    class LearnerPool(BlockPool):
        def touch(self, blocks):
            learner_touch(self, blocks)

    class LearnerManager(KVCacheManager):
        block_pool_class = LearnerPool

    return LearnerManager


def check_touch(touch, seeds: int = 12, timeout: float = 30.0) -> CheckReport:
    """Check ``touch(pool, blocks)``, a prefix hit on the pool."""
    with Checker("touch", timeout=timeout) as c:
        c.probe(lambda: touch(_touch_case()[0], []))

        def fixed():
            pool, free, held = _touch_case()
            touch(pool, [free, held])
            problems = []
            if free.block_id in _queue_ids(pool) or free.prev_free_block:
                problems.append(f"block {free.block_id} (free, cached) is "
                                "still in the free queue")
            if (free.ref_cnt, held.ref_cnt) != (1, 3):
                problems.append(f"ref_cnt of the free block {free.ref_cnt}, of "
                                f"the held one {held.ref_cnt}; expected 1 and 3")
            try:
                pool.check()
            except AssertionError as exc:
                problems.append(f"check() fails: {exc}")
            if problems:
                raise WrongAnswer("; ".join(problems), _diagnose_touch(touch))

        c.prop("a free cached block leaves the queue; every ref_cnt rises by "
               "one", fixed,
               "if block.ref_cnt == 0: pool.free_block_queue.remove(block); "
               "then block.ref_cnt += 1 for every block",
               lambda: _diagnose_touch(touch))

        def trials():
            for seed in range(seeds):
                manager_trial(_touch_manager(touch), seed,
                              diagnose=lambda: _diagnose_touch(touch))

        c.prop(f"{seeds} random scheduler runs with prefix hits match the "
               "library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_touch(touch))
    return c.report


catalogue(check_touch, TOUCH_MISTAKES)


# ------------------------------------------------------------ get_new_blocks
GET_MISTAKES = [
    Mistake("popped from the tail", "the head of the free queue is reused "
            "first: pool.free_block_queue.popleft_n(n)"),
    Mistake("hash kept", "a popped block gets new content: evict its old "
            "hash, from the block (reset_hash) and from "
            "cached_block_hash_to_block, or a later prefix hit reads the new "
            "tenant's KV"),
    Mistake("cache entry kept", "reset_hash() clears the block, not the map: "
            "delete its entry in cached_block_hash_to_block[hash] too"),
    Mistake("hash not reset", "the map entry is gone but the block still "
            "carries its hash: call block.reset_hash()"),
    Mistake("every block under the hash dropped", "several blocks may hold "
            "one hash: delete only this block's entry, "
            "cached_block_hash_to_block[h][block.block_id], and the hash's "
            "dict once it is empty"),
    Mistake("ref_cnt not set", "a popped block belongs to one request: "
            "ref_cnt 1 (it was 0 in the queue)"),
    Mistake("refused after changing the pool", "test num_free_blocks "
            "before popping anything: a refusal leaves every structure as "
            "it was"),
    Mistake("not refused in vLLM's words", "with fewer than n free, raise "
            "ValueError(f\"Cannot get {n} free blocks from the pool\")"),
]


def _get_case() -> tuple[BlockPool, dict[int, KVCacheBlock]]:
    """A pool of 8 whose free queue is [1, 5, 2, 4] (head first).

    Blocks 2 and 4 are cached (free, hashed, at the tail); block 3, which a
    request still holds, is cached under block 2's hash 1000 too.
    """
    pool = BlockPool(8)
    b = {blk.block_id: blk for blk in pool.get_new_blocks(7)}
    for i, h in ((2, 1000), (3, 1000), (4, 1004)):
        pool.cache_full_blocks([b[i]], [h], 0, 1)
    pool.free_blocks([b[1], b[5], b[2], b[4]])
    return pool, b


def _pool_state(pool: BlockPool) -> dict:
    return {
        "free queue (head to tail)": _queue_ids(pool),
        "ref_cnt": {b.block_id: b.ref_cnt for b in pool.blocks[1:]},
        "hashes": {b.block_id: b.block_hash for b in pool.blocks
                   if b.block_hash is not None},
        "cached_block_hash_to_block": {
            h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()},
    }


def _run_get(fn, n: int):
    """(pool, returned block ids or the exception, the state afterwards)."""
    pool, _ = _get_case()
    try:
        got = [b.block_id for b in fn(pool, n)]
    except Exception as exc:  # noqa: BLE001 -- the caller judges it
        got = exc
    return pool, got, _pool_state(pool)


def _diagnose_get(fn) -> str | None:
    try:
        pool, got, state = _run_get(fn, 3)
        if isinstance(got, Exception):
            return None
        if got in ([4, 2, 5], [5, 2, 4]):
            return GET_MISTAKES[0].diagnosis()
        hashed, mapped = 2 in state["hashes"], 2 in state[
            "cached_block_hash_to_block"].get(1000, [])
        if hashed and mapped:
            return GET_MISTAKES[1].diagnosis()
        if mapped:
            return GET_MISTAKES[2].diagnosis()
        if hashed:
            return GET_MISTAKES[3].diagnosis()
        if 1000 not in state["cached_block_hash_to_block"]:
            return GET_MISTAKES[4].diagnosis()
        if any(state["ref_cnt"][i] != 1 for i in got):
            return GET_MISTAKES[5].diagnosis()
        pool, got, state = _run_get(fn, 5)
        if state != _pool_state(_get_case()[0]):
            return GET_MISTAKES[6].diagnosis()
        if not (isinstance(got, ValueError)
                and str(got) == "Cannot get 5 free blocks from the pool"):
            return GET_MISTAKES[7].diagnosis()
    except Exception:  # noqa: BLE001 -- the property's message says what
        return None
    return None


def _get_manager(learner_get_new_blocks):
    """A ``KVCacheManager`` class whose pool allocates with the learner's
    ``get_new_blocks`` (a ``BlockPool`` subclass as ``block_pool_class``)."""
    class LearnerPool(BlockPool):
        def get_new_blocks(self, num_blocks):
            return learner_get_new_blocks(self, num_blocks)

    class LearnerManager(KVCacheManager):
        block_pool_class = LearnerPool

    return LearnerManager


def check_get_new_blocks(get_new_blocks, seeds: int = 12,
                         timeout: float = 30.0) -> CheckReport:
    """Check ``get_new_blocks(pool, n) -> list of blocks``, vLLM 0.33.0's
    ``BlockPool.get_new_blocks`` as a function of the pool."""
    fn = get_new_blocks
    with Checker("get_new_blocks", timeout=timeout) as c:
        c.probe(lambda: fn(_get_case()[0], 1))

        def compare(n, what):
            pool, got, state = _run_get(fn, n)
            ref, _ = _get_case()
            want = [b.block_id for b in ref.get_new_blocks(n)]
            if isinstance(got, Exception):
                raise got
            if got != want:
                raise WrongAnswer(f"{what}: got blocks {got}, expected "
                                  f"{want}", _diagnose_get(fn))
            for key, value in _pool_state(ref).items():
                if state[key] != value:
                    raise WrongAnswer(f"{what}: {key} is {state[key]}, "
                                      f"expected {value}", _diagnose_get(fn))
            pool.check()

        def head():
            compare(2, "queue [1, 5, 2, 4], get_new_blocks(2)")

        c.prop("pops n blocks from the head of the free queue, each with "
               "ref_cnt 1", head,
               "pool.free_block_queue.popleft_n(n); then ref_cnt = 1 for "
               "each", lambda: _diagnose_get(fn))

        def evicts():
            compare(3, "queue [1, 5, 2, 4] (2 and 4 cached, held block 3 "
                    "shares 2's hash), get_new_blocks(3)")

        c.prop("a popped cached block leaves the prefix cache, and only it",
               evicts, "if block.block_hash is not None: drop "
               "pool.cached_block_hash_to_block[h][block.block_id], then "
               "block.reset_hash()", lambda: _diagnose_get(fn))

        def refuses():
            pool, got, state = _run_get(fn, 5)
            if state != _pool_state(_get_case()[0]):
                raise WrongAnswer("get_new_blocks(5) with 4 free changed the "
                                  "pool", GET_MISTAKES[6].diagnosis())
            words = "Cannot get 5 free blocks from the pool"
            if not (isinstance(got, ValueError) and str(got) == words):
                said = (f"{type(got).__name__}({str(got)!r})"
                        if isinstance(got, Exception) else f"blocks {got}")
                raise WrongAnswer(f"get_new_blocks(5) with 4 free: got "
                                  f"{said}, expected ValueError({words!r})",
                                  GET_MISTAKES[7].diagnosis())

        c.prop("too few free: ValueError('Cannot get 5 free blocks from the "
               "pool'), no change", refuses,
               "compare n with pool.free_block_queue.num_free_blocks first")

        def trials():
            for seed in range(seeds):
                manager_trial(_get_manager(fn), seed,
                              diagnose=lambda: _diagnose_get(fn))

        c.prop(f"{seeds} random scheduler runs in KVCacheManager match "
               "the library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_get(fn))
    return c.report


catalogue(check_get_new_blocks, GET_MISTAKES)


# ---------------------------------------------------- find_longest_cache_hit
HIT_MISTAKES = [
    Mistake("no -1 cap", "a fully cached prompt must still compute its last "
            "token (its logits pick the next one): at most num_tokens - 1 "
            "tokens, (num_tokens - 1) // block_size blocks"),
    Mistake("one block too few", "the cap is num_tokens - 1 tokens, not a "
            "block less: a prompt one token past a cached block boundary "
            "hits every cached block"),
    Mistake("did not stop at the first miss", "the hashes are chained: a "
            "prefix with a hole in it is not a prefix, stop at the first "
            "miss"),
    Mistake("the lookup touched the blocks", "find_longest_cache_hit only "
            "looks; allocate_slots touches the hit when it admits the "
            "request"),
    Mistake("returned (blocks, num_tokens)", "return the list of blocks; "
            "the caller counts len(blocks) x block_size tokens"),
]


def _hit_model(pool, hashes, num_tokens, B, *, cap=-1, skip_misses=False):
    blocks = []
    for i, block_hash in enumerate(hashes):
        if (i + 1) * B > num_tokens + cap:
            break
        block = pool.get_cached_block(block_hash)
        if block is None:
            if skip_misses:
                continue
            break
        blocks.append(block.block_id)
    return blocks


def _hit_cases():
    """(pool, block_hashes, num_tokens, block_size, what) whose answers
    tell the mistakes apart: a prompt of 3 cached blocks of 4 tokens."""
    prompt = list(range(1, 13))
    cases = []
    for extra, hole, what in (
            ([], False, "a prompt of 12 tokens, its 3 blocks cached"),
            ([7], False, "the same 12 tokens and one more"),
            ([7], True, "13 tokens, cached block 1 evicted")):
        pool = BlockPool(16)
        hashes = Request("x", prompt + extra, hash_block_size=4).block_hashes
        blocks = pool.get_new_blocks(3)
        pool.cache_full_blocks(blocks, hashes, 0, 3)
        pool.free_blocks(list(reversed(blocks)))
        if hole:
            pool.evict_blocks([blocks[1].block_id])
        cases.append((pool, list(hashes), len(prompt + extra), 4, what))
    return cases


def _as_blocks(result) -> list[int]:
    if (isinstance(result, tuple) and len(result) == 2
            and isinstance(result[0], list)):
        raise WrongAnswer(f"returned a pair ({len(result[0])} blocks, "
                          f"{result[1]!r})",
                          HIT_MISTAKES[4].diagnosis())
    if not isinstance(result, (list, tuple)) or not all(
            isinstance(b, KVCacheBlock) for b in result):
        raise AssertionError(f"expected a list of KVCacheBlock, got "
                             f"{type(result).__name__} {result!r:.60}")
    return [b.block_id for b in result]


def _diagnose_hit(fn) -> str | None:
    for pool, hashes, n, B, _ in _hit_cases():
        before = _pool_state(pool)
        try:
            got = _as_blocks(fn(pool, hashes, n, B))
        except WrongAnswer as exc:
            return exc.mistake
        except Exception:  # noqa: BLE001
            return None
        if _pool_state(pool) != before:
            return HIT_MISTAKES[3].diagnosis()
        if got != _hit_model(pool, hashes, n, B):
            for mistake, kw in zip(HIT_MISTAKES, (
                    dict(cap=0), dict(cap=-B), dict(skip_misses=True))):
                if got == _hit_model(pool, hashes, n, B, **kw):
                    return mistake.diagnosis()
            return None
    return None


def _hit_manager(learner_find):
    """A ``KVCacheManager`` subclass whose ``get_computed_blocks`` answers
    with the learner's ``find_longest_cache_hit``."""
    class LearnerManager(KVCacheManager):
        def get_computed_blocks(self, request):
            super().get_computed_blocks(request)  # binds it, counts a lookup
            blocks = list(learner_find(self.block_pool, request.block_hashes,
                                       request.num_tokens, self.block_size))
            return blocks, len(blocks) * self.block_size

    return LearnerManager


def check_find_longest_cache_hit(find_longest_cache_hit, seeds: int = 12,
                                 timeout: float = 30.0) -> CheckReport:
    """Check ``find_longest_cache_hit(pool, block_hashes, num_tokens,
    block_size) -> list of blocks``."""
    fn = find_longest_cache_hit
    with Checker("find_longest_cache_hit", timeout=timeout) as c:
        c.probe(lambda: fn(*_hit_cases()[0][:4]))

        def fixed():
            for pool, hashes, n, B, what in _hit_cases():
                want = _hit_model(pool, hashes, n, B)
                got = _as_blocks(fn(pool, hashes, n, B))
                if got != want:
                    raise WrongAnswer(f"{what}: expected blocks {want}, got "
                                      f"{got}", _diagnose_hit(fn))

        c.prop("cached blocks of the longest prefix, to the first miss, "
               "< num_tokens tokens", fixed,
               "for i, h in enumerate(block_hashes) while (i + 1) * "
               "block_size <= num_tokens - 1: pool.get_cached_block(h)",
               lambda: _diagnose_hit(fn))

        def looks_only():
            pool, hashes, n, B, _ = _hit_cases()[1]
            before = _pool_state(pool)
            fn(pool, hashes, n, B)
            if _pool_state(pool) != before:
                raise WrongAnswer("the lookup changed the pool",
                                  HIT_MISTAKES[3].diagnosis())

        c.prop("looks without changing anything", looks_only,
               "do not touch: allocate_slots does that")

        def trials():
            for seed in range(seeds):
                manager_trial(_hit_manager(fn), seed, aligned=True,
                              diagnose=lambda: _diagnose_hit(fn))

        c.prop(f"{seeds} random scheduler runs in KVCacheManager match "
               "the library at every step", trials,
               "the message names the operation and the first difference",
               lambda: _diagnose_hit(fn))
    return c.report


catalogue(check_find_longest_cache_hit, HIT_MISTAKES)
