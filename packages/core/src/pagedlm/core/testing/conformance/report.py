"""Results of the conformance kit: one :class:`CheckResult` per check, gathered in a report.

Each check compares a backend's output with a reference and records the largest absolute error
and the tolerance it was held to, so a failure says by how much, not only that it failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

Status = Literal["PASS", "FAIL", "SKIP"]


@dataclass(frozen=True)
class Tolerance:
    """``|out - ref| <= atol + rtol * |ref|`` elementwise (``torch.testing.assert_close``'s rule)."""

    atol: float
    rtol: float

    def describe(self) -> str:
        return f"atol={self.atol:g} rtol={self.rtol:g}"


#: per compute dtype; what the Triton kernels meet against the float32 reference (the same
#: figures as tests/cuda/test_triton_kernels.py). A backend a few percent off exceeds them.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(2e-5, 2e-5),
    torch.bfloat16: Tolerance(2e-2, 2e-2),
    torch.float16: Tolerance(4e-3, 4e-3),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    if dtype not in TOLERANCES:
        raise ValueError(f"no conformance tolerance for dtype={dtype}; known: {[str(d) for d in TOLERANCES]}")
    return TOLERANCES[dtype]


@dataclass(frozen=True)
class CheckResult:
    """One check. ``error`` is ``None`` where no number applies (a skip, a crash); ``metric``
    names it (the largest absolute error unless a check counts something else)."""

    section: str  # "attention", "ops" or "e2e"
    name: str  # the case, e.g. "mixed h8/kv2 d64 bs16 bfloat16"
    status: Status
    error: float | None = None
    tolerance: str = ""
    detail: str = ""
    metric: str = "max_abs_err"

    @property
    def passed(self) -> bool:
        return self.status != "FAIL"

    def line(self) -> str:
        parts = [f"{self.status} {self.section}: {self.name}"]
        if self.error is not None:
            parts.append(f"{self.metric}={self.error:.3g}")
        if self.tolerance:
            parts.append(f"({self.tolerance})")
        if self.detail:
            parts.append(f"- {self.detail}")
        return " ".join(parts)


@dataclass
class ConformanceReport:
    """Every check run for one device / attention backend, in order."""

    device: str
    attention_backend: str
    results: list[CheckResult] = field(default_factory=list)

    def add(self, result: CheckResult) -> CheckResult:
        self.results.append(result)
        return result

    def __iter__(self) -> Iterator[CheckResult]:
        return iter(self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "FAIL"]

    @property
    def ok(self) -> bool:
        """True when nothing failed (and something ran: an empty report proves nothing)."""
        return not self.failures and any(r.status == "PASS" for r in self.results)

    def summary(self) -> str:
        counts = {s: sum(r.status == s for r in self.results) for s in ("PASS", "FAIL", "SKIP")}
        verdict = "CONFORMS" if self.ok else "DOES NOT CONFORM"
        return (
            f"{verdict}: device={self.device} attention_backend={self.attention_backend}: "
            f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
        )

    def text(self) -> str:
        return "\n".join([*(r.line() for r in self.results), self.summary()])


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[bool, float, str]:
    """``(within tolerance, max |out - ref|, why not)`` for same-shaped tensors.

    Non-finite values where the reference is finite fail outright: they mean the backend read
    memory it should not have (the kit fills every unowned cache slot with NaN).
    """
    if out.shape != ref.shape:
        return False, float("inf"), f"shape {tuple(out.shape)} != expected {tuple(ref.shape)}"
    out, ref = out.double(), ref.double()
    bad_nan = ~torch.isfinite(out) & torch.isfinite(ref)
    if bool(bad_nan.any()):
        return False, float("inf"), f"{int(bad_nan.sum())} non-finite values (read outside the context?)"
    if out.numel() == 0:
        return True, 0.0, ""
    err = (out - ref).abs()
    max_err = float(err.max())
    excess = err - (tol.atol + tol.rtol * ref.abs())
    if bool((excess > 0).any()):
        return False, max_err, f"{int((excess > 0).sum())} of {out.numel()} elements outside tolerance"
    return True, max_err, ""
