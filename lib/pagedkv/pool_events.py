"""What a block pool tells its listeners: ``PoolEvent``, and the subscribe/notify machinery.

Views (``pagedkv.views``) draw a pool as it changes, without the pool knowing
anything about drawing: the pool reports each mutation as a ``PoolEvent`` to
whoever subscribed. ``EventSource`` is that half of ``BlockPool``, kept apart
so that the allocator reads as an allocator.

- ``subscribe(listener)`` / ``unsubscribe(listener)``: after each mutation the
  pool calls ``listener(pool, event)``. With no listener the only cost is one
  truth test per call.
- ``deferred_events()``: a context manager that holds the notifications of the
  mutations made inside it and delivers them, in order, when it exits, so that
  a caller making several pool calls as one operation (the manager's
  ``allocate_slots``) is observed only once it is consistent.

Listeners cannot corrupt the pool. They run only after a mutation is complete,
and an exception raised by a listener is contained: every other listener still
runs, the operation returns normally, and the failure is reported as a
``ListenerWarning`` (a ``RuntimeWarning``) naming the listener, the event and
the exception. A view that breaks must not break the allocator it watches.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

__all__ = ["PoolEvent", "ListenerWarning", "Listener", "EventSource"]


class ListenerWarning(RuntimeWarning):
    """A pool listener raised; the pool contained the exception and stayed consistent."""


class PoolEvent(NamedTuple):
    """One mutation of a pool, reported to its listeners after it happened.

    ``kind`` is one of:

    - ``"evict"``: ``block_ids`` lost their hash because they are being reused
      (reported just before the ``"allocate"`` that reuses them);
    - ``"allocate"``: ``block_ids`` were popped from the head, in order;
    - ``"free"``: ``block_ids`` were released, in the order given; of those that
      reached ``ref_cnt == 0``, ``head`` went to the head and ``tail`` (hashed) to
      the tail of the free queue;
    - ``"touch"``: ``block_ids`` gained a reference (a prefix hit);
    - ``"cache"``: ``block_ids`` received a hash and entered the prefix cache;
    - ``"reset"``: ``reset_prefix_cache`` cleared the hashes of ``block_ids``;
    - ``"uncache"``: ``evict_blocks`` took ``block_ids`` (free blocks) out of
      the prefix cache; they stayed where they were in the free queue.
    """

    kind: str
    block_ids: tuple[int, ...]
    head: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()


#: ``listener(pool, event)``, called after each mutation of ``pool``.
Listener = Callable[[Any, PoolEvent], None]


class EventSource:
    """The observer half of a pool: listeners, and events delivered now or held back.

    A subclass calls ``_emit(event)`` after each completed mutation, guarded by
    ``if self._listeners:`` so that an unobserved pool builds no event at all.
    """

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        # Events held back by deferred_events(), or None when delivered at once.
        self._held_events: list[PoolEvent] | None = None

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(pool, event)`` after every mutation; returns an unsubscribe function."""
        if not callable(listener):
            raise TypeError(f"listener must be callable, got {listener!r}")
        self._listeners.append(listener)
        return lambda: self.unsubscribe(listener)

    def unsubscribe(self, listener: Listener) -> None:
        """Stop calling ``listener`` (no error if it was not subscribed)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _emit(self, event: PoolEvent, stacklevel: int = 3) -> None:
        # Called only after a mutation is complete, so the pool is consistent
        # whatever a listener does; a listener's exception is contained here.
        if self._held_events is not None:
            self._held_events.append(event)
            return
        for listener in list(self._listeners):
            try:
                listener(self, event)
            except Exception as exc:  # noqa: BLE001 -- a broken view must not break the allocator
                warnings.warn(
                    f"pool listener {listener!r} raised {type(exc).__name__}: {exc} on a "
                    f"{event.kind!r} event; the pool is unaffected and the other listeners ran",
                    ListenerWarning,
                    stacklevel=stacklevel,  # the pool method's caller
                )

    @contextmanager
    def deferred_events(self) -> Iterator[None]:
        """Hold listener notifications until the ``with`` block ends, then deliver them in order.

        For callers that make several pool calls as one operation: listeners
        then see the operation only once the caller's own structures agree with
        the pool. Nested uses deliver at the outermost exit. Events are
        delivered even if the block raises (they describe mutations that did
        happen).
        """
        if self._held_events is not None:  # nested: the outer block delivers
            yield
            return
        self._held_events = held = []
        try:
            yield
        finally:
            self._held_events = None
            if self._listeners:
                for event in held:
                    # The caller of the method that opened the ``with`` (past contextlib).
                    self._emit(event, stacklevel=5)
