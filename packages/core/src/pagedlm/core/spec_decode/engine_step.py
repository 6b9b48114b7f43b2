"""Speculative decoding with async scheduling: the engine core's synchronous steps.

Drafts are proposed from a step's verified tokens, so a step that may carry drafts is scheduled
only once every step before it is back: the engine core takes the batches in flight, schedules
without output placeholders and waits for the step's result (what it does for every step with
async scheduling off). Steps that get no drafts (``disable_by_batch_size``: at least that many
running requests) are scheduled asynchronously as without speculation; the scheduler never gives
drafts to a step it schedules ahead of its predecessor's tokens, and the runner proposes nothing
then (``SpecDecodeRunner.proposes``). Only methods whose proposer need not see every step (n-gram)
run this way; a draft model follows every step, and its engine schedules synchronously throughout
(``check_speculative_config``).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

from pagedlm.core.sched.output import SchedulerOutput


def synchronous_step(core: Any, queue: deque[tuple[Future, SchedulerOutput]]) -> list[Any]:
    """One step of ``core`` (an ``EngineCore`` with a batch queue) after the batches in flight:
    their outputs, then this step's. NOTE: the scheduler is switched to synchronous scheduling for
    this one ``schedule()`` call; no placeholder is outstanding then, since every batch is back."""
    outputs: list[Any] = []
    while queue:
        future, in_flight = queue.popleft()
        outputs.extend(core._update(in_flight, future.result()))
    scheduler = core.scheduler
    if not scheduler.has_unfinished_requests():
        return outputs
    scheduler.async_scheduling = False
    try:
        scheduler_output = scheduler.schedule()
    finally:
        scheduler.async_scheduling = True
    outputs.extend(core._update(scheduler_output, core.executor.execute_model(scheduler_output)))
    return outputs
