"""A thread that fills a step's grammar bitmask while the engine core goes on with the next step.

With async scheduling a step's bitmask rows can only be filled once the batch in flight is back
(its tokens advance the matchers first); filled on the engine core's thread they sit between that
batch's update and the step's sampling, on the step loop's critical path. Here the fill runs on
its own thread instead, while the engine core returns the outputs and schedules the next step;
sampling goes out when the core next talks to the executor (``EngineCore._launch_deferred_sample``).

NOTE: xgrammar's calls release the GIL (tvm-ffi does by default), so the fill itself runs beside
the engine core's Python. The thread still needs the GIL to start the call and to return from
it, and under CPython's default switch interval (5 ms) a thread that waits for the GIL gets it
only after that long: longer than the fill. While a fill is pending the interval is lowered to
:data:`SWITCH_INTERVAL_S`, and restored once it has been waited for. Measured on a 2-core CPU
(1.6 ms fill beside 2.3 ms of Python): 4.4 ms a step at 5 ms, 2.5 ms at 0.1 ms, 3.9 ms serially.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

#: the switch interval while a fill is pending (seconds); CPython's default is 5 ms
SWITCH_INTERVAL_S = 1e-4


class FillThread:
    """Runs one fill at a time on a daemon thread; :meth:`wait` returns its result."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pagedlm-grammar-fill", daemon=True)
        self._thread.start()
        self._saved_interval: float | None = None
        #: host seconds the engine core waited for fills still running
        self.wait_seconds = 0.0

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting engine core
                future.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> Future:
        if self._saved_interval is None:
            self._saved_interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def wait(self, future: Future) -> Any:
        """The fill's result (its exception raised here); restores the switch interval."""
        start, pending = time.perf_counter(), not future.done()
        try:
            return future.result()
        finally:
            if pending:
                self.wait_seconds += time.perf_counter() - start
            self._restore_switch_interval()

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self._restore_switch_interval()

    def _restore_switch_interval(self) -> None:
        if self._saved_interval is not None:
            sys.setswitchinterval(self._saved_interval)
            self._saved_interval = None
