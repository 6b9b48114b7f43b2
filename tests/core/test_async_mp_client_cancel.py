"""The core-process client's output wait must end when its task is cancelled, even when an
output arrives in the same loop turn (asyncio.run cancels leftover tasks and waits for them)."""

import asyncio
import queue

from pagedlm.core.engine.async_client import AsyncMPClient


class _LiveProcess:
    def is_alive(self) -> bool:
        return True


def _idle_client() -> AsyncMPClient:
    # Only the state get_output_async reads: no core process, no sockets, no reader thread.
    client = AsyncMPClient.__new__(AsyncMPClient)
    client._frames = queue.SimpleQueue()
    client._loop = None
    client._wakeup = None
    client._reader = object()  # "already started"
    client.dead_error = None
    client._closed = False
    client.proc = _LiveProcess()
    return client


def test_cancel_in_the_same_turn_as_a_wakeup_ends_the_wait():
    async def main():
        client = _idle_client()
        task = asyncio.create_task(client.get_output_async())
        await asyncio.sleep(0.01)  # the task now waits on the wake-up event
        client._wakeup.set()  # an output arrives ...
        task.cancel()  # ... and the loop shuts down in the same turn
        done, _ = await asyncio.wait([task], timeout=2.0)
        assert done, "get_output_async kept running after it was cancelled"
        assert task.cancelled()

    asyncio.run(main())


def test_the_wait_still_ticks_to_check_liveness():
    async def main():
        client = _idle_client()
        task = asyncio.create_task(client.get_output_async())
        await asyncio.sleep(0.01)
        client.dead_error = RuntimeError("the core died")  # what _check() raises on its next tick
        done, _ = await asyncio.wait([task], timeout=2.0)
        assert done, "the wait never woke to check liveness"
        assert str(task.exception()) == "the core died"

    asyncio.run(main())
