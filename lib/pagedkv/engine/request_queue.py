"""The waiting queues: vLLM's ``FCFSRequestQueue`` and ``PriorityRequestQueue``.

Under the default policy, ``fcfs``, the waiting queue is a deque
(``WaitingQueue``): new requests join the back, a preempted one
goes back to the front. Under ``priority`` it is a heap ordered by
``(priority, arrival, request_id)``: a *smaller* priority value is served
first, arrival order breaks ties. There is no front to put a preempted
request back at: it rejoins the heap by the same key, so it resumes before
everything of lower priority (a larger value) and after everything of
higher. ``PriorityWaitingQueue`` offers the deque's methods the scheduler
calls (``append``, ``appendleft``, ``popleft``, ``[0]``), so the scheduler
reads the same either way.

Invariant: ``self._heap`` is a binary heap of ``(key, request)`` pairs, one
per waiting request, keys unique (the request id is in the key).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator

from .request import EngineRequest

__all__ = ["WaitingQueue", "PriorityWaitingQueue", "priority_key", "SCHEDULING_POLICIES"]

#: vLLM 0.33.0's ``SchedulerPolicy`` values (``config/scheduler.py``).
SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_key(request: EngineRequest) -> tuple:
    """The order vLLM's ``Request.__lt__`` defines: priority, then arrival, then request id."""
    return (request.priority, request.arrival, request.request_id)


class WaitingQueue(deque):
    """The waiting queue, first come first served: vLLM's ``FCFSRequestQueue``, a ``deque``.

    The deque's own methods do the scheduling: ``append`` queues a new
    request, ``appendleft`` puts a preempted one back at the front,
    ``self[0]`` is the next to admit and ``popleft`` admits it. What a deque
    lacks is added by request id: ``remove(request_id)`` takes a request out
    wherever it is (abort; a scan, as vLLM's ``remove_request``), and
    ``request_id in queue`` asks whether one waits.
    """

    def remove(self, request_id: str) -> EngineRequest:
        """Take out the request with this id (``KeyError`` if none waits) and return it."""
        for request in self:
            if request.request_id == request_id:
                super().remove(request)
                return request
        raise KeyError(f"request {request_id!r} is not waiting")

    def __contains__(self, request_id: object) -> bool:
        return any(r.request_id == request_id for r in self)

    def __repr__(self) -> str:
        return f"WaitingQueue({[r.request_id for r in self]})"


class PriorityWaitingQueue:
    """A heap of waiting requests, smallest ``priority_key`` first, with a deque's interface."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, EngineRequest]] = []

    def append(self, request: EngineRequest) -> None:
        """Queue a request by its key (a new one, or a preempted one: there is no front)."""
        heapq.heappush(self._heap, (priority_key(request), request))

    appendleft = append  # vLLM's prepend_request: "no concept of prepending to the front"

    def popleft(self) -> EngineRequest:
        """Take out the request with the smallest key (the next to admit)."""
        if not self._heap:
            raise IndexError("pop from an empty waiting queue")
        return heapq.heappop(self._heap)[1]

    def __getitem__(self, index: int) -> EngineRequest:
        """Only ``[0]``, the next to admit, as the scheduler peeks at it."""
        if index != 0:
            raise IndexError(f"a priority queue can only peek at [0], got [{index}]")
        if not self._heap:
            raise IndexError("peek at an empty waiting queue")
        return self._heap[0][1]

    def remove(self, request_id: str) -> EngineRequest:
        """Take out the request with this id (``KeyError`` if none waits) and return it."""
        for i, (_, request) in enumerate(self._heap):
            if request.request_id == request_id:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return request
        raise KeyError(f"request {request_id!r} is not waiting")

    def __contains__(self, request_id: object) -> bool:
        return any(r.request_id == request_id for _, r in self._heap)

    def __iter__(self) -> Iterator[EngineRequest]:
        """In admission order (smallest key first), as vLLM's ``__iter__`` pops a copy."""
        return iter([r for _, r in sorted(self._heap, key=lambda pair: pair[0])])

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __repr__(self) -> str:
        return f"PriorityWaitingQueue({[r.request_id for r in self]})"
