"""The scheduler's waiting queue, one class per scheduling policy (vLLM's ``--scheduling-policy``).

Both queues offer the few deque operations the scheduler uses: ``append`` (a new request),
``appendleft`` (a preempted request going back), ``popleft`` / ``[0]`` (the next request to admit),
``remove``, ``in``, ``len`` and iteration.

- ``fcfs``: a deque; new requests queue at the back, preempted ones go back to the front.
- ``priority``: a heap ordered by ``(priority, arrival_time)`` (lower priority values first, ties
  by arrival); a preempted request goes back to its place in that order.

Under ``priority`` the scheduler also keeps its running list in this order (:func:`priority_order`):
running requests get the step's token budget in priority order, and the request it preempts under
KV pressure, the last of the list, is the one with the largest priority value (then the latest
arrival) instead of the newest one.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from pagedlm.core.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


class FCFSRequestQueue(deque):
    """First come, first served: a plain deque of requests."""


class PriorityRequestQueue:
    """Waiting requests ordered by ``(priority, arrival_time)``; lower values are admitted first."""

    def __init__(self) -> None:
        # entries (priority, arrival_time, insertion number, request); the insertion number breaks
        # exact ties so that requests themselves are never compared
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def append(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    #: a preempted request returns to its place in the order, like a new one
    appendleft = append

    def popleft(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty PriorityRequestQueue")
        return heapq.heappop(self._heap)[-1]

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("a PriorityRequestQueue only shows its first request ([0])")
        if not self._heap:
            raise IndexError("PriorityRequestQueue is empty")
        return self._heap[0][-1]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[-1] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{request!r} is not in the waiting queue")

    def __contains__(self, request: object) -> bool:
        return any(entry[-1] is request for entry in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        return iter([entry[-1] for entry in sorted(self._heap, key=lambda e: e[:3])])


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling policy {policy!r} is not one of {', '.join(SCHEDULING_POLICIES)}")


def priority_order(request: Request) -> tuple[int, float]:
    """The ``priority`` policy's order: lower priority values first, ties by arrival."""
    return request.priority, request.arrival_time
