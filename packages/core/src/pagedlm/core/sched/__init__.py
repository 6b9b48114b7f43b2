from pagedlm.core.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from pagedlm.core.sched.scheduler import EngineCoreOutput, Scheduler

__all__ = [
    "CachedRequestData",
    "EngineCoreOutput",
    "ModelRunnerOutput",
    "NewRequestData",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
]
