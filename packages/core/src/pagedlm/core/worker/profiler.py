"""The torch profiler of one worker (``LLM.start_profile`` / ``stop_profile``, vLLM's semantics).

``start`` arms it (recording begins at once, or after ``delay_iterations`` engine steps); every
``execute_model`` calls ``step``, which also stops it after ``max_iterations`` recorded steps;
``stop`` ends the recording and writes the trace to ``torch_profiler_dir`` (a tensorboard trace
handler: ``<worker name>.<time>.pt.trace.json[.gz]``, readable by Perfetto and TensorBoard), plus
the table of the ops that took the most time (``profiler_out_<rank>.txt``).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from pagedlm.core.config import ProfilerConfig
from pagedlm.core.logger import init_logger

logger = init_logger(__name__)


class WorkerProfiler:
    def __init__(self, config: ProfilerConfig, *, rank: int, name_suffix: str, device_activity: str | None) -> None:
        self.config = config
        self.rank = rank
        self.name_suffix = name_suffix
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device_activity:
            self.activities.append(getattr(torch.profiler.ProfilerActivity, device_activity))
        self._device_activity = device_activity
        self._profile: Any | None = None
        self._active = False  # between start() and stop()
        self._steps = 0  # steps since start()
        self._recorded = 0  # steps recorded
        self._prefix: str | None = None

    @property
    def is_running(self) -> bool:
        return self._profile is not None

    def start(self, profile_prefix: str | None = None) -> None:
        if self._active:
            logger.debug("start_profile while the profiler runs: ignored")
            return
        self._active, self._steps, self._recorded, self._prefix = True, 0, 0, profile_prefix
        if self.config.delay_iterations == 0:
            self._start_recording()

    def _start_recording(self) -> None:
        cfg = self.config
        os.makedirs(cfg.torch_profiler_dir, exist_ok=True)
        base = self._prefix or f"{socket.gethostname()}_{os.getpid()}"
        self._profile = torch.profiler.profile(
            activities=self.activities,
            record_shapes=cfg.torch_profiler_record_shapes,
            profile_memory=cfg.torch_profiler_with_memory,
            with_stack=cfg.torch_profiler_with_stack,
            with_flops=cfg.torch_profiler_with_flops,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                cfg.torch_profiler_dir, worker_name=f"{base}_{self.name_suffix}", use_gzip=cfg.torch_profiler_use_gzip),
        )
        self._profile.start()
        if self.rank == 0:
            logger.info("torch profiler started; traces go to %s", cfg.torch_profiler_dir)

    def step(self) -> None:
        """One engine step ran on this worker."""
        if not self._active:
            return
        self._steps += 1
        if self._profile is None and self.config.delay_iterations and self._steps == self.config.delay_iterations:
            self._start_recording()
            return
        if self._profile is not None:
            self._recorded += 1
            if self.config.max_iterations and self._recorded >= self.config.max_iterations:
                self._stop_recording()

    def stop(self) -> None:
        if not self._active:
            logger.debug("stop_profile while the profiler is not running: ignored")
            return
        self._active = False
        self._stop_recording()

    def _stop_recording(self) -> None:
        profile, self._profile = self._profile, None
        if profile is None:
            return
        profile.stop()  # runs the trace handler: the trace file is written here
        cfg = self.config
        if cfg.torch_profiler_dump_cuda_time_total:
            sort_key = "self_device_time_total" if self._device_activity else "self_cpu_time_total"
            table = profile.key_averages().table(sort_by=sort_key, row_limit=50)
            path = os.path.join(cfg.torch_profiler_dir, f"profiler_out_{self.rank}.txt")
            with open(path, "w", encoding="utf-8") as f:
                f.write(table + "\n")
        if self.rank == 0:
            logger.info("torch profiler stopped; traces written to %s", cfg.torch_profiler_dir)

    def shutdown(self) -> None:
        if self._active:
            self.stop()
