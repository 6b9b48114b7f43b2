"""One writer, many readers: a message ring in shared memory.

The executor sends every worker the same message each step (the scheduler's output). It is
pickled once and copied once into a ring of fixed-size slots in shared memory; each reader copies
it out. Two semaphores per reader carry the synchronisation, so nobody spins: ``ready[i]`` counts
slots reader ``i`` may read, ``free[i]`` counts slots the writer may overwrite without losing
data reader ``i`` has not read yet. A message larger than a slot is split over consecutive slots
(the writer waits for free slots as the readers drain them), so there is no size limit.

Slot layout: ``[u64 total message bytes][u64 bytes in this slot][payload]``.

NOTE: the ring and semaphores reach child processes (spawn / forkserver) through ``Process(args=...)``
only; this is a one-host transport (the Ray executor uses Ray's own object transfer instead).
"""

from __future__ import annotations

import pickle
import struct
import time
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct("<QQ")


class ShmBroadcast:
    """The writer side; :meth:`reader` returns the handle to give reader ``i``'s process."""

    def __init__(self, ctx: Any, num_readers: int, *, num_slots: int = 8, slot_bytes: int = 256 * 1024) -> None:
        if num_readers < 1 or num_slots < 1 or slot_bytes <= _HEADER.size:
            raise ValueError("ShmBroadcast needs num_readers >= 1, num_slots >= 1 and room for the header")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        # NOTE: RawArray lives in an mmap the children inherit: no name to leak, no resource
        # tracker, freed with the last process holding it.
        self.buffer = ctx.RawArray("B", num_slots * slot_bytes)
        self.ready = [ctx.Semaphore(0) for _ in range(num_readers)]
        self.free = [ctx.Semaphore(num_slots) for _ in range(num_readers)]
        self._index = 0
        self._view = memoryview(self.buffer).cast("B")

    def reader(self, i: int) -> ShmReader:
        return ShmReader(self.buffer, self.ready[i], self.free[i], self.num_slots, self.slot_bytes)

    def enqueue(self, obj: Any, *, check: Callable[[], None] | None = None) -> None:
        """Publish ``obj`` to every reader. Blocks only while a reader lags ``num_slots`` slots
        behind; ``check`` is called twice a second meanwhile and may raise (a dead reader)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        payload = self.slot_bytes - _HEADER.size
        total = len(data)
        offset = 0
        while True:
            chunk = data[offset : offset + payload]
            for sem in self.free:
                while not sem.acquire(timeout=0.5):
                    if check is not None:
                        check()
            start = (self._index % self.num_slots) * self.slot_bytes
            _HEADER.pack_into(self._view, start, total, len(chunk))
            self._view[start + _HEADER.size : start + _HEADER.size + len(chunk)] = chunk
            self._index += 1
            for sem in self.ready:
                sem.release()
            offset += len(chunk)
            if offset >= total:
                return


class ShmReader:
    """Reader ``i``'s end of a :class:`ShmBroadcast` (pass it to the reader's process)."""

    def __init__(self, buffer: Any, ready: Any, free: Any, num_slots: int, slot_bytes: int) -> None:
        self.buffer = buffer
        self.ready = ready
        self.free = free
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._index = 0
        self._view: memoryview | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_view"] = None  # memoryviews do not pickle; rebuilt on first use
        return state

    def _read_slot(self) -> tuple[int, bytes]:
        if self._view is None:
            self._view = memoryview(self.buffer).cast("B")
        start = (self._index % self.num_slots) * self.slot_bytes
        total, size = _HEADER.unpack_from(self._view, start)
        chunk = bytes(self._view[start + _HEADER.size : start + _HEADER.size + size])
        self._index += 1
        self.free.release()
        return total, chunk

    def dequeue(self, timeout: float | None = None) -> tuple[bool, Any]:
        """``(True, message)``, or ``(False, None)`` if none arrived within ``timeout`` seconds."""
        if not self.ready.acquire(timeout=timeout):
            return False, None
        total, chunk = self._read_slot()
        if len(chunk) == total:
            return True, pickle.loads(chunk)
        parts = [chunk]
        got = len(chunk)
        deadline = time.monotonic() + 60.0
        while got < total:
            # The writer is in the middle of this message; its next slots come promptly.
            if not self.ready.acquire(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError("the writer stopped in the middle of a message")
                continue
            _, chunk = self._read_slot()
            parts.append(chunk)
            got += len(chunk)
        return True, pickle.loads(b"".join(parts))
