"""``run_conformance``: every check for one device and attention backend, in one report."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pagedlm.core.platforms import Platform, resolve_platform
from pagedlm.core.testing.conformance import attention, ops
from pagedlm.core.testing.conformance.e2e import check_e2e
from pagedlm.core.testing.conformance.report import TOLERANCES, CheckResult, ConformanceReport

DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in TOLERANCES}


def parse_dtypes(dtypes: Sequence[str | torch.dtype] | str | None, platform: Platform) -> list[torch.dtype]:
    """``"float32,bfloat16"``, names or dtypes -> dtypes; None: the platform's supported ones."""
    if dtypes is None:
        return [d for d in platform.supported_dtypes if d in TOLERANCES]
    if isinstance(dtypes, str):
        dtypes = [d for d in dtypes.split(",") if d.strip()]
    out = []
    for d in dtypes:
        if isinstance(d, str):
            if d.strip() not in DTYPE_NAMES:
                raise ValueError(f"dtype {d!r} is not one of {', '.join(DTYPE_NAMES)}")
            d = DTYPE_NAMES[d.strip()]
        out.append(d)
    return out


def run_conformance(
    device: str,
    attention_backend: str | None = None,
    dtypes: Sequence[str | torch.dtype] | str | None = None,
    *,
    quick: bool = False,
    skip_e2e: bool = False,
    skip_ops: bool = False,
    llm_kwargs: dict[str, Any] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> ConformanceReport:
    """Check ``attention_backend`` (default: the platform's choice) and ``device``'s layer ops
    against the CPU references, then greedy parity with HF end to end (float32).

    ``quick`` runs a smaller grid; ``on_result`` sees each result as soon as it exists (the CLI
    prints it). Raises ``ValueError`` for an unknown device, backend or dtype.
    """
    from pagedlm.core.config import VllmConfig

    platform = resolve_platform(device)
    name = attention_backend or platform.get_attn_backend_name(VllmConfig())
    backend = attention.backend_class(name)
    wanted = parse_dtypes(dtypes, platform)
    report = ConformanceReport(device=device, attention_backend=name)

    def add(result: CheckResult) -> None:
        report.add(result)
        if on_result is not None:
            on_result(result)

    if backend.supported_devices is not None and platform.device_name not in backend.supported_devices:
        add(CheckResult("attention", name, "FAIL", detail=(
            f"declares supported_devices={list(backend.supported_devices)}, not {platform.device_name!r}")))
        return report
    torch_device = platform.set_device(0)
    for seed, case in enumerate(attention.attention_cases(wanted, quick=quick)):
        add(attention.check_attention_case(backend, torch_device, case, seed))
    if not skip_ops:
        _run_ops(platform, torch_device, wanted, quick, add)
    if not skip_e2e:
        for result in check_e2e(device, name, quick=quick, llm_kwargs=llm_kwargs):
            add(result)
    return report


def _run_ops(platform: Platform, device: torch.device, dtypes: list[torch.dtype], quick: bool,
             add: Callable[[CheckResult], None]) -> None:
    registered = ops._platform_ops(platform)
    if not registered:
        add(CheckResult("ops", f"platform {platform.device_name!r}", "SKIP",
                        detail="registers no layer ops: core's torch reference runs there"))
        return
    cases = ops.op_cases(quick=quick)
    covered = {c.op for c in cases} | {"gumbel_sample"}
    for op_name in sorted(set(registered) - covered):
        add(CheckResult("ops", op_name, "SKIP", detail="registered, but the kit has no check for it yet"))
    seed = 0
    for dtype in dtypes:
        for case in cases:
            if case.op in registered:
                seed += 1
                add(ops.check_op_case(registered[case.op], device, dtype, case, seed))
        if "gumbel_sample" in registered:
            for result in ops.check_gumbel_sample(registered["gumbel_sample"], device, dtype, seed):
                add(result)


def assert_conformance(device: str, attention_backend: str | None = None, **kwargs: Any) -> ConformanceReport:
    """:func:`run_conformance`, raising ``AssertionError`` with every failing line if any check
    fails: one call makes a third party's pytest test."""
    report = run_conformance(device, attention_backend, **kwargs)
    if not report.ok:
        lines = [r.line() for r in report.failures] or ["no check passed"]
        raise AssertionError(report.summary() + "\n" + "\n".join(lines))
    return report
