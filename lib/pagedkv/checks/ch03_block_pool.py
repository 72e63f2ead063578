"""Checks for exercises/03_block_pool.ipynb.

The learner writes the four list operations of ``FreeKVCacheBlockQueue``:

* ``popleft_n(n)``: unlink and return the first ``n`` blocks (a list, head
  first); ``ValueError`` when fewer than ``n`` are free, with nothing changed;
* ``remove(block)``: unlink one block from anywhere, in O(1);
* ``append_n(blocks)``: link blocks in at the tail, in order;
* ``prepend_n(blocks)``: link blocks in at the head so that ``blocks[0]`` is
  the new head.

The class is built as ``queue_cls(blocks)`` from ``pagedkv.block_pool.KVCacheBlock``
objects and must keep the sentinels ``fake_free_list_head`` and
``fake_free_list_tail`` and the counter ``num_free_blocks``. After every
operation the checker walks every link both ways and compares the queue with a
plain Python list (the oracle) and with the library's queue.
"""

from __future__ import annotations

import random

from ..free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from ._harness import Checker, CheckReport, Mistake, WrongAnswer, catalogue

__all__ = ["check_free_block_queue"]

_NEXT = KVCacheBlock.__dict__["next_free_block"]  # the slot descriptors, read through the spy below
_PREV = KVCacheBlock.__dict__["prev_free_block"]


class _CountingBlock(KVCacheBlock):
    """A block that counts how often its links are read: an O(1) operation reads only a few."""

    __slots__ = ()
    reads = 0

    @property
    def next_free_block(self):
        _CountingBlock.reads += 1
        return _NEXT.__get__(self)

    @next_free_block.setter
    def next_free_block(self, value):
        _NEXT.__set__(self, value)

    @property
    def prev_free_block(self):
        _CountingBlock.reads += 1
        return _PREV.__get__(self)

    @prev_free_block.setter
    def prev_free_block(self, value):
        _PREV.__set__(self, value)


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


QUEUE_MISTAKES = [
    Mistake("reversed batch", "the batch came out in reverse order: linking "
            "one block at a time right after the head sentinel turns it "
            "around, and blocks[0] must end up first"),
    Mistake("linked at the wrong end", "the batch sits at the other end of "
            "the queue: append_n links in at the tail (next to "
            "fake_free_list_tail), prepend_n at the head"),
    Mistake("popped from the wrong end", "the blocks came from the tail: "
            "popleft_n takes the head of the queue, the next ones to reuse"),
    Mistake("num_free_blocks not kept", "num_free_blocks must count the "
            "queued blocks after every operation, links in and links out"),
    Mistake("an unlinked block keeps its links", "a block out of the queue "
            "still points into it: both its links must be None, or a later "
            "operation follows them into the queue"),
    Mistake("a back link forgotten", "the list reads differently from the "
            "tail than from the head: every next_free_block has its mirror "
            "prev_free_block, so each change of one needs the other"),
    Mistake("a walk", "the operation read links far from where it works: "
            "remove and the batch operations follow a few links, whatever "
            "the queue's length"),
]


def _order_mistake(forward: list[int], expected: list[int], batch, op) -> str | None:
    """Name the mistake when ``forward`` is ``expected`` with the batch reversed or misplaced."""
    if not batch or op not in ("append_n", "prepend_n"):
        return None
    rest = [i for i in expected if i not in batch]
    if op == "prepend_n":
        reversed_batch, wrong_end = batch[::-1] + rest, rest + batch
    else:
        reversed_batch, wrong_end = rest + batch[::-1], batch + rest
    if len(batch) > 1 and forward == reversed_batch:
        return QUEUE_MISTAKES[0].diagnosis()
    if forward == wrong_end:
        return QUEUE_MISTAKES[1].diagnosis()
    return None


def _check_links(queue, blocks: list[KVCacheBlock], expected: list[int], after: str,
                 batch=None, op=None) -> None:
    """Walk the learner's queue both ways; compare with ``expected`` (ids, head first).

    ``batch`` and ``op``: the ids the last append_n/prepend_n linked, so a
    reversed or misplaced batch is named.
    """
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    limit = len(blocks) + 2
    forward, node = [], head.next_free_block
    while node is not tail:
        if node is None:
            raise AssertionError(f"after {after}: walking forward from the head, the list breaks after "
                                 f"{forward} (a next_free_block is None before the tail sentinel)")
        forward.append(node.block_id)
        if len(forward) > limit:
            raise AssertionError(f"after {after}: walking forward never reaches the tail sentinel (a cycle?)")
        node = node.next_free_block
    if forward != expected:
        raise WrongAnswer(f"after {after}: head to tail the queue is {forward}, expected {expected}",
                          _order_mistake(forward, expected, batch, op))
    backward, node = [], tail.prev_free_block
    while node is not head:
        if node is None or len(backward) > limit:
            raise WrongAnswer(f"after {after}: walking backward from the tail does not reach the head "
                              f"sentinel (got {backward} so far): a prev_free_block link is wrong",
                              QUEUE_MISTAKES[5].diagnosis())
        backward.append(node.block_id)
        node = node.prev_free_block
    if backward != expected[::-1]:
        raise WrongAnswer(f"after {after}: tail to head the queue is {backward}, expected {expected[::-1]} "
                          "(a prev_free_block link is wrong)", QUEUE_MISTAKES[5].diagnosis())
    if queue.num_free_blocks != len(expected):
        raise WrongAnswer(f"after {after}: num_free_blocks is {queue.num_free_blocks!r}, "
                          f"expected {len(expected)}", QUEUE_MISTAKES[3].diagnosis())
    queued = set(expected)
    for block in blocks:
        if block.block_id not in queued and (block.prev_free_block is not None or block.next_free_block is not None):
            raise WrongAnswer(f"after {after}: block {block.block_id} is out of the queue but still has a "
                              "link", QUEUE_MISTAKES[4].diagnosis())


def _popleft_n(queue, n: int, after: str) -> list[KVCacheBlock]:
    got = queue.popleft_n(n)
    if not isinstance(got, list):
        raise AssertionError(f"{after}: popleft_n should return a list, got {type(got).__name__}")
    return got


def _setup(queue, blocks, expected: list[int], what: str) -> None:
    """Check the queue after a step that sets up another operation's property.

    A broken setup (a ``popleft_n`` bug, say) is named as such, not reported
    under the operation the property checks.
    """
    try:
        _check_links(queue, blocks, expected, what)
    except AssertionError as exc:
        raise WrongAnswer(f"{exc}. {what.split(' ')[0]} set up this "
                          f"property: the bug is in {what.split('(')[0]}, "
                          "not in the operation this line checks",
                          getattr(exc, "mistake", None)) from None


def _fresh(queue_cls, n: int, block_type=KVCacheBlock):
    blocks = [block_type(i) for i in range(n)]
    return blocks, queue_cls(blocks)


def check_free_block_queue(queue_cls, cases: int = 40, seed: int = 0, timeout: float = 20.0) -> CheckReport:
    """Check a ``FreeKVCacheBlockQueue`` class: ``queue_cls(blocks)`` with the four list operations."""
    with Checker("FreeKVCacheBlockQueue", timeout=timeout) as c:

        def probe():  # the stub: all four operations still raise NotImplementedError
            stubs = 0
            for op in ("popleft_n", "remove", "append_n", "prepend_n"):
                blocks, q = _fresh(queue_cls, 3)
                args = {"popleft_n": 1, "remove": blocks[1], "append_n": [],
                        "prepend_n": []}[op]
                try:
                    getattr(q, op)(args)
                except NotImplementedError:
                    stubs += 1
                except Exception:  # noqa: BLE001 -- the properties report it
                    pass
            if stubs == 4:
                raise NotImplementedError

        c.probe(probe)

        try:
            blocks, q = _fresh(queue_cls, 4)
        except Exception:  # noqa: BLE001 -- construction's own line says what
            blocks = q = None

        def delegation():
            q.popleft_n(1)
            q.remove(blocks[2])
            q.append_n([blocks[0]])
            q.prepend_n([blocks[2]])

        c.written_here("FreeKVCacheBlockQueue", delegation, {
            f"FreeKVCacheBlockQueue.{name}": fn
            for name, fn in vars(FreeKVCacheBlockQueue).items()
            if callable(fn) and name not in ("__init__", "__len__", "get_all_free_blocks", "check")})

        def construction():
            blocks, q = _fresh(queue_cls, 5)
            _check_links(q, blocks, [0, 1, 2, 3, 4], "construction")

        c.prop("construction links the blocks in order between two sentinels", construction,
               "keep the given __init__: head sentinel <-> blocks[0] <-> ... <-> blocks[-1] <-> tail sentinel")

        def popleft_n():
            blocks, q = _fresh(queue_cls, 8)
            got = _popleft_n(q, 3, "popleft_n(3)")
            if _ids(got) != [0, 1, 2] or any(g is not b for g, b in zip(got, blocks)):
                raise WrongAnswer(f"popleft_n(3) on a fresh queue of 8 returned {_ids(got)}, expected [0, 1, 2]",
                                  QUEUE_MISTAKES[2].diagnosis() if _ids(got) in ([7, 6, 5], [5, 6, 7])
                                  else None)
            _check_links(q, blocks, [3, 4, 5, 6, 7], "popleft_n(3)")
            if _popleft_n(q, 0, "popleft_n(0)") != []:
                raise AssertionError("popleft_n(0) should return []")
            _check_links(q, blocks, [3, 4, 5, 6, 7], "popleft_n(0)")
            got = _popleft_n(q, 5, "popleft_n(5)")
            if _ids(got) != [3, 4, 5, 6, 7]:
                raise AssertionError(f"popleft_n(5) returned {_ids(got)}, expected [3, 4, 5, 6, 7]")
            _check_links(q, blocks, [], "popping every block")
            for size in range(1, 8):  # every n on queues of 1 to 7 blocks
                for n in range(size + 1):
                    blocks, q = _fresh(queue_cls, size)
                    got = _popleft_n(q, n, f"popleft_n({n})")
                    if _ids(got) != list(range(n)):
                        raise AssertionError(
                            f"popleft_n({n}) on a fresh queue of {size} "
                            f"returned {_ids(got)}, expected "
                            f"{list(range(n))}")
                    _check_links(q, blocks, list(range(n, size)),
                                 f"popleft_n({n}) on a fresh queue of {size}")

        c.prop("popleft_n(n) returns the first n blocks, head first, and unlinks them", popleft_n,
               "n blocks leave from the head: which links still point at them, and what is "
               "the head sentinel's neighbour afterwards?")

        def popleft_n_too_many():
            blocks, q = _fresh(queue_cls, 4)
            _popleft_n(q, 1, "popleft_n(1)")
            try:
                q.popleft_n(4)
            except ValueError:
                pass
            else:
                raise AssertionError("popleft_n(4) with 3 free blocks should raise ValueError")
            _check_links(q, blocks, [1, 2, 3], "a refused popleft_n(4)")

        c.prop("popleft_n beyond num_free_blocks raises ValueError and changes nothing", popleft_n_too_many,
               "a refused call must leave every link as it was: when can you know it refuses?")

        def remove():
            blocks, q = _fresh(queue_cls, 6)
            expected = [0, 1, 2, 3, 4, 5]
            for victim, where in ((3, "the middle"), (0, "the head"), (5, "the tail"), (2, "the middle")):
                q.remove(blocks[victim])
                expected.remove(victim)
                _check_links(q, blocks, expected, f"remove(block {victim}) from {where}")
            for victim in list(expected):
                q.remove(blocks[victim])
                expected.remove(victim)
            _check_links(q, blocks, [], "removing every block")

        c.prop("remove(block) unlinks a block from the head, the middle or the tail", remove,
               "the block's two neighbours must end up linked to each other; the sentinels mean "
               "neither neighbour is ever None")

        def append_n():
            blocks, q = _fresh(queue_cls, 7)
            taken = _popleft_n(q, 4, "popleft_n(4)")
            _setup(q, blocks, [4, 5, 6], "popleft_n(4) on a fresh queue of 7")
            q.append_n([taken[2], taken[0]])
            _check_links(q, blocks, [4, 5, 6, 2, 0], "append_n([block 2, block 0])", [2, 0], "append_n")
            q.append_n([])
            _check_links(q, blocks, [4, 5, 6, 2, 0], "append_n([])")
            _popleft_n(q, 5, "popleft_n(5)")
            _setup(q, blocks, [], "popleft_n(5) of the queue [4, 5, 6, 2, 0]")
            q.append_n([taken[1], taken[3]])
            _check_links(q, blocks, [1, 3], "append_n into an empty queue", [1, 3], "append_n")

        c.prop("append_n(blocks) links blocks in at the tail, in order", append_n,
               "which block is the tail sentinel's neighbour before, and which after? Draw the links")

        def prepend_n():
            blocks, q = _fresh(queue_cls, 7)
            taken = _popleft_n(q, 4, "popleft_n(4)")
            _setup(q, blocks, [4, 5, 6], "popleft_n(4) on a fresh queue of 7")
            q.prepend_n([taken[2], taken[0]])
            _check_links(q, blocks, [2, 0, 4, 5, 6], "prepend_n([block 2, block 0])", [2, 0], "prepend_n")
            q.prepend_n([])
            _check_links(q, blocks, [2, 0, 4, 5, 6], "prepend_n([])")
            _popleft_n(q, 5, "popleft_n(5)")
            _setup(q, blocks, [], "popleft_n(5) of the queue [2, 0, 4, 5, 6]")
            q.prepend_n([taken[3], taken[1]])
            _check_links(q, blocks, [3, 1], "prepend_n into an empty queue", [3, 1], "prepend_n")

        c.prop("prepend_n(blocks) makes blocks[0] the head, keeping their order", prepend_n,
               "blocks[0] ends up first and the old first block follows the batch: draw the links "
               "before you write them")

        def constant_time():
            blocks, q = _fresh(queue_cls, 2_000, _CountingBlock)
            for what, op in (
                ("remove(block 1000)", lambda: q.remove(blocks[1000])),
                ("append_n of 1 block", lambda: q.append_n([blocks[1000]])),
                ("popleft_n(2)", lambda: q.popleft_n(2)),
                ("prepend_n of 2 blocks", lambda: q.prepend_n([blocks[1], blocks[0]])),
                ("remove(block 1500)", lambda: q.remove(blocks[1500])),
            ):
                _CountingBlock.reads = 0
                op()
                if _CountingBlock.reads > 12:
                    raise WrongAnswer(f"{what} on a queue of 2,000 blocks read {_CountingBlock.reads} links: "
                                      "it walks the queue instead of following a few links",
                                      QUEUE_MISTAKES[6].diagnosis())

        c.prop("remove, append_n, prepend_n and popleft_n do not walk the queue", constant_time,
               "each operation needs only the links next to where it works; never search for a block")

        def random_sequences():
            rng = random.Random(seed)
            for case in range(cases):
                n = rng.randint(1, 12)
                blocks, q = _fresh(queue_cls, n)
                ref_blocks, ref = _fresh(FreeKVCacheBlockQueue, n)
                oracle = list(range(n))
                history: list[str] = []
                for _ in range(30):
                    batch = None
                    out = [i for i in range(n) if i not in oracle]
                    choices = ["popleft_n"] + (["remove"] if oracle else []) + (["append_n", "prepend_n"] if out else [])
                    op = rng.choice(choices)
                    if op == "popleft_n":
                        k = rng.randint(0, len(oracle))
                        history.append(f"popleft_n({k})")
                        got = _popleft_n(q, k, f"case {case}: " + ", ".join(history))
                        want, oracle = oracle[:k], oracle[k:]
                        if _ids(got) != want:
                            raise AssertionError(f"case {case}: {', '.join(history)} returned {_ids(got)}, "
                                                 f"expected {want}")
                        ref.popleft_n(k)
                    elif op == "remove":
                        v = rng.choice(oracle)
                        history.append(f"remove({v})")
                        q.remove(blocks[v])
                        ref.remove(ref_blocks[v])
                        oracle.remove(v)
                    else:
                        batch = rng.sample(out, rng.randint(1, len(out)))
                        history.append(f"{op}({batch})")
                        getattr(q, op)([blocks[i] for i in batch])
                        getattr(ref, op)([ref_blocks[i] for i in batch])
                        oracle = batch + oracle if op == "prepend_n" else oracle + batch
                    if _ids(ref.get_all_free_blocks()) != oracle:
                        raise RuntimeError("the library's queue disagrees with the oracle (a bug in pagedkv)")
                    _check_links(q, blocks, oracle, f"case {case}: " + ", ".join(history), batch, op)

        c.prop(f"{cases} random sequences of 30 operations match a plain list, every link checked", random_sequences,
               "the message lists the operations that led to the first difference: replay them by hand")
    return c.report


catalogue(check_free_block_queue, QUEUE_MISTAKES)
