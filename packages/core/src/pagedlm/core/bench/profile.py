"""``--profile DIR`` of ``pagedlm bench throughput``: torch.profiler around the timed run.

What it answers: is a step bound by the device or by the host? The summary compares the time
the device spent in kernels with the wall time of the run, and lists the kernels that took the
most device time. Profiling slows the host down, so the run's own throughput is not comparable
with an unprofiled one; the device times are.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def profiled(directory: str | None, device: str) -> Iterator[dict[str, Any]]:
    """Profile the body when ``directory`` is set; fills the yielded dict with the summary."""
    summary: dict[str, Any] = {}
    if directory is None:
        yield summary
        return
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pagedlm.core.platforms import resolve_platform

    on_device = resolve_platform(device).profiler_activity
    activities = [ProfilerActivity.CPU] + ([getattr(ProfilerActivity, on_device)] if on_device else [])
    with profile(activities=activities) as prof:
        yield summary
    os.makedirs(directory, exist_ok=True)
    events = prof.key_averages()
    sort_key = "self_device_time_total" if on_device else "self_cpu_time_total"
    table = events.table(sort_by=sort_key, row_limit=40)
    with open(os.path.join(directory, "profile-top.txt"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    # NOTE: only device-side events (kernels, copies): an aten op's row repeats its kernels' time.
    kernels = sorted(
        ((e.key, e.self_device_time_total / 1e6, e.count) for e in events
         if e.self_device_time_total > 0 and e.device_type != DeviceType.CPU),
        key=lambda k: -k[1],
    )
    summary.update({
        "directory": directory,
        "device": device,
        # None on the CPU: there the ops run on the host, in the table's CPU columns
        "device_time_s": sum(t for _, t, _ in kernels) if on_device else None,
        "top_device_ops": [{"name": n, "device_time_s": t, "calls": c} for n, t, c in kernels[:15]],
        # the batched LoRA kernels' part of the device time (bench throughput --num-loras)
        "lora_device_time_s": sum(t for n, t, _ in kernels if "lora" in n.lower()) if on_device else None,
        "torch_version": torch.__version__,
    })
    with open(os.path.join(directory, "profile-summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
