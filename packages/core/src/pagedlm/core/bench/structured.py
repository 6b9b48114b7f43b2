"""``pagedlm bench throughput --structured-output-schema NAME``: a JSON schema on every request, and
what its grammar bitmasks cost per step.

``int-array`` is an array of exactly ``output_len // 2 + 1`` integers in [0, 999] (no free
whitespace): every item takes at least two tokens (a digit and a comma), so no output completes
before max_tokens and the output lengths stay those of the workload, as without the schema.

A grammar needs the tokenizer's vocabulary. ``--model-config`` runs have none (dummy weights,
token-id prompts): they get a byte-level BPE tokenizer of the model's vocabulary size
(``pagedlm.core.testing.tokenizer``, reserved filler tokens beyond its learned merges). Outputs
are not detokenized in either run, so the two runs differ by the grammar only.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

SCHEMAS = ("int-array",)


def add_structured_output_options(parser: Any) -> None:
    parser.add_argument("--structured-output-schema", choices=SCHEMAS, default=None,
                        help="constrain every request with this JSON schema (xgrammar bitmasks each step) and "
                             "report the bitmask cost per step; int-array: a bounded array of integers")


def prepare_engine(kwargs: dict[str, Any], vocab_size: int) -> None:
    """Give an engine without a tokenizer (``--model-config``) a synthetic one of its vocabulary size."""
    if not kwargs.get("skip_tokenizer_init"):
        return
    from pagedlm.core.testing.tokenizer import build_bpe_tokenizer

    out = tempfile.mkdtemp(prefix="pagedlm-bench-tokenizer-")
    atexit.register(shutil.rmtree, out, True)
    build_bpe_tokenizer(out, vocab_size=vocab_size, style="qwen2")
    kwargs.update(tokenizer=out, skip_tokenizer_init=False)


def warm_up(llm: Any, params: list[Any], prompt_token_ids: list[int]) -> None:
    """Build the grammar backend and compile the schema before the clock starts."""
    from pagedlm.core import SamplingParams

    llm.generate([{"prompt_token_ids": prompt_token_ids[:8]}],
                 SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False,
                                structured_outputs=params[0].structured_outputs), use_tqdm=False)
    som = llm.llm_engine.core.scheduler.structured_output_manager
    som.fill_seconds, som.num_fill_steps = 0.0, 0


def apply_schema(name: str, params: list[Any]) -> None:
    """Put the schema ``name`` on every request's params (in place)."""
    from pagedlm.core.sampling_params import StructuredOutputsParams

    assert name == "int-array"
    for p in params:
        items = p.max_tokens // 2 + 1
        schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                  "minItems": items, "maxItems": items}
        p.structured_outputs = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        p.detokenize = False


class BitmaskCost:
    """Times the bitmask application of the in-process model runner (host time per call; on a
    GPU also its device time, from events read once the run is over)."""

    def __init__(self) -> None:
        self.host_s = 0.0
        self.calls = 0
        self._events: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        from pagedlm.core.worker import model_runner

        original = model_runner.apply_grammar_bitmask

        def timed(logits, *args, **kwargs):
            start = time.perf_counter()
            from pagedlm.core.platforms import current_platform

            first = current_platform.record_event(timing=True)
            original(logits, *args, **kwargs)
            if first is not None:
                self._events.append((first, current_platform.record_event(timing=True)))
            self.host_s += time.perf_counter() - start
            self.calls += 1

        model_runner.apply_grammar_bitmask = timed
        try:
            yield
        finally:
            model_runner.apply_grammar_bitmask = original

    def summary(self, llm: Any) -> dict[str, Any]:
        som = llm.llm_engine.core.scheduler.structured_output_manager
        device_ms = None
        if self._events:
            self._events[-1][1].synchronize()
            device_ms = sum(a.elapsed_time(b) for a, b in self._events) / len(self._events)
        steps = som.num_fill_steps
        return {"bitmask_steps": steps,
                "fill_ms_per_step": 1e3 * som.fill_seconds / steps if steps else None,
                "fill_wait_ms_per_step": 1e3 * som.fill_wait_seconds / steps if steps else None,
                "apply_host_ms_per_step": 1e3 * self.host_s / self.calls if self.calls else None,
                "apply_device_ms_per_step": device_ms}


def describe(name: str, cost: dict[str, Any]) -> list[tuple[str, Any]]:
    """Rows of the throughput table."""
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f} ms"

    return [("structured outputs", f"{name} JSON schema on every request ({cost['bitmask_steps']} steps with masks)"),
            ("  bitmask fill / step", f"{ms(cost['fill_ms_per_step'])} host (fill thread: the engine core waited "
                                      f"{ms(cost['fill_wait_ms_per_step'])} of it)"),
            ("  bitmask apply / step", f"{ms(cost['apply_host_ms_per_step'])} host, "
                                       f"{ms(cost['apply_device_ms_per_step'])} device")]
