"""The conformance kit: checks a third-party (or built-in) backend against pagedlm's references.

- attention: the backend against ``cpu_paged`` on mixed paged batches (prefill chunks, decodes,
  prefix-cached prompts, padding, GQA, block sizes, windows, soft cap, Gemma 3's head 256 and
  scale) and the K/V it writes;
- ops: every layer op the platform registers against core's torch reference;
- e2e: greedy tokens identical to HF transformers on the tiny checkpoints of every architecture.

From the shell: ``python -m pagedlm.core.testing.conformance --device NAME``; from Python or a
test: :func:`run_conformance` / :func:`assert_conformance`. See docs/conformance.md.
"""

from pagedlm.core.testing.conformance.report import (
    TOLERANCES,
    CheckResult,
    ConformanceReport,
    Tolerance,
)
from pagedlm.core.testing.conformance.runner import assert_conformance, run_conformance

__all__ = [
    "TOLERANCES",
    "CheckResult",
    "ConformanceReport",
    "Tolerance",
    "assert_conformance",
    "run_conformance",
]
