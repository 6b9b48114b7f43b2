"""The xgrammar backend (the library vLLM uses by default)."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import numpy as np

from pagedlm.core.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from pagedlm.core.structured_output.params import StructuredOutputsParams
from pagedlm.core.utils.cores import usable_cores

#: host seconds of fill work worth one more of xgrammar's threads. NOTE: measured on an H200's
#: host (2026-12-01), 256 rows of an int-array grammar (~4.9 us a
#: row on one thread) fill in 1.25 ms on 1 thread, 0.92 on 2, 0.72 on 4, 1.04 on 8 and 1.75 on
#: 16: past ~0.3 ms of work a thread, the threads' start-up outweighs what they share.
_FILL_SECONDS_PER_THREAD = 0.3e-3
#: every this many fills on several threads, one runs on a single thread to measure the rows again
_FILL_REMEASURE_EVERY = 64
#: fills of fewer rows say little of a row's cost (the call's own overhead dominates them)
_FILL_MEASURE_MIN_ROWS = 32
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; users need only the reason.
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


def _reason(error: Exception) -> str:
    return _CPP_PREFIX.sub("", str(error)).strip()


def _choice_ebnf(choices: list[str]) -> str:
    # NOTE: JSON string escapes are also EBNF string escapes in xgrammar's dialect.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


#: JSON Schema keywords xgrammar accepts but does not enforce: refused rather than ignored
_UNENFORCED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
                        "dependentRequired", "dependentSchemas")
#: keywords whose values are data, not subschemas
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def _unenforced(schema: Any, path: str = "#") -> str | None:
    """The first keyword (with its location) of ``schema`` that xgrammar would silently ignore."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            if (found := _unenforced(item, f"{path}/{i}")) is not None:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key in _UNENFORCED_KEYWORDS:
        if key in schema and schema[key] is not False:
            return f"{key!r} at {path}"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return f"'pattern' together with 'minLength'/'maxLength' at {path}"
    if "multipleOf" in schema and schema.get("type") == "number":
        return f"'multipleOf' on a number at {path}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' with several schemas at {path}"
    for key, value in schema.items():
        if key not in _DATA_KEYWORDS and (found := _unenforced(value, f"{path}/{key}")) is not None:
            return found
    return None


#: one character of a JSON string written without escapes: no quote, backslash, control character
#: or UTF-16 surrogate (which xgrammar's own string rules let through as three bytes that no
#: UTF-8 decoder accepts); written with the characters themselves, which xgrammar's regexes read
_PLAIN_CHARACTER = "[ !#-\\[\\]-\x7f\x80-\ud7ff\ue000-\U0010ffff]"


def _bounded_strings_as_patterns(schema: Any) -> Any:
    """``schema`` with every ``minLength``/``maxLength`` string turned into the same bound on a
    ``pattern`` of plain characters (:data:`_PLAIN_CHARACTER`).

    NOTE: xgrammar 0.2 compiles a length-bounded string to characters that exclude only ``"``,
    ``\\``, CR and LF: raw control characters (invalid in JSON) slip through. A pattern of plain
    characters means the same text raw or decoded, so its character count is the string's length;
    such a string cannot hold a quote, a backslash or a control character.
    """
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYWORDS else _bounded_strings_as_patterns(value)
           for key, value in schema.items()}
    if ("minLength" in out or "maxLength" in out) and "pattern" not in out and "format" not in out \
            and out.get("type", "string") == "string":
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^{_PLAIN_CHARACTER}{{{low},{'' if high is None else int(high)}}}$"
    return out


def _json_schema_text(params: StructuredOutputsParams) -> str:
    schema = json.loads(params.json) if isinstance(params.json, str) else params.json
    return json.dumps(_bounded_strings_as_patterns(schema))


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None) -> Any:
    """xgrammar's view of the vocabulary, with the special tokens as specials.

    NOTE: xgrammar reads a special token such as ``<unk>`` as its literal text, so a grammar would
    let ``<unk>`` stand for five characters of a JSON string, and detokenization (which skips
    special tokens) would then drop them from the output. A special token's text is emptied here:
    xgrammar never allows an empty token, except as a stop token.
    """
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            encoded[token_id] = token
    special = set(tokenizer.all_special_ids)
    special.update(i for i, added in tokenizer.added_tokens_decoder.items() if added.special)
    for token_id in special:
        if token_id < vocab_size:
            encoded[token_id] = ""
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(detected.stop_token_ids), add_prefix_space=detected.add_prefix_space)


def _structural_tag_args(xgr: Any, spec: str) -> tuple[Any, ...]:
    """xgrammar's arguments for a structural tag: the tag itself (its ``format`` form), or vLLM's
    older ``{"structures": [{"begin", "schema", "end"}], "triggers"}`` form as tags and triggers."""
    try:
        tag = json.loads(spec)
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return items, list(tag.get("triggers", []))
    return (spec,)


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self._terminated = matcher.is_terminated()

    def accept_tokens(self, token_ids: list[int]) -> bool:
        matcher = self.matcher
        if len(token_ids) == 1:  # a decode step's token: no generator per request
            accepted = matcher.accept_token(token_ids[0])
        else:
            accepted = all(matcher.accept_token(token_id) for token_id in token_ids)
        self._terminated = matcher.is_terminated()
        return accepted

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._terminated  # NOTE: only accept_tokens moves the matcher


class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, *, vllm_config: Any, tokenizer: Any, vocab_size: int) -> None:
        super().__init__(vllm_config=vllm_config, tokenizer=tokenizer, vocab_size=vocab_size)
        import xgrammar as xgr

        self._xgr = xgr
        eos = sorted(vllm_config.model_config.eos_token_ids) if vllm_config.model_config.hf_config else None
        info = _tokenizer_info(xgr, tokenizer, vocab_size, eos or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        #: thread count -> xgrammar's BatchGrammarMatcher with that many threads
        self._batch_matchers: dict[int, Any] = {}
        #: the host seconds a bitmask row takes on one thread (a moving average of such fills)
        self._fill_seconds_per_row = 0.0
        self._num_threaded_fills = 0
        self._max_fill_threads = usable_cores()
        soc = vllm_config.structured_outputs_config
        self._any_whitespace_default = not soc.disable_any_whitespace

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        kind = params.kind
        if kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            if (found := _unenforced(schema)) is not None:
                raise ValueError(f"structured_outputs.json uses {found}, which the xgrammar backend cannot enforce; "
                                 "drop it from the schema")
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(_json_schema_text(params))
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))  # type: ignore[arg-type]
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(params.grammar)
            elif kind == "structural_tag":
                xgr.Grammar.from_structural_tag(*_structural_tag_args(xgr, params.structural_tag))
        except Exception as e:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError/ValueError
            raise ValueError(f"structured_outputs.{kind} is invalid: {_reason(e)}") from None

    def compile(self, params: StructuredOutputsParams) -> Any:
        kind, c = params.kind, self.compiler
        any_whitespace = self._any_whitespace_default and not params.disable_any_whitespace
        if kind == "json":
            return c.compile_json_schema(_json_schema_text(params), any_whitespace=any_whitespace,
                                         strict_mode=True)
        if kind == "json_object":  # any JSON object (the builtin JSON grammar also takes arrays)
            return c.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return c.compile_regex(params.regex)
        if kind == "choice":
            return c.compile_grammar(_choice_ebnf(params.choice))  # type: ignore[arg-type]
        if kind == "grammar":
            return c.compile_grammar(params.grammar)
        return c.compile_structural_tag(*_structural_tag_args(self._xgr, params.structural_tag))

    def new_grammar(self, compiled: Any, stop_token_ids: list[int]) -> StructuredOutputGrammar:
        xgr = self._xgr
        if stop_token_ids:
            return XgrammarGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids))
        return XgrammarGrammar(xgr.GrammarMatcher(compiled, terminate_without_stop_token=True))

    def fill_seconds_estimate(self, num_rows: int) -> float:
        # NOTE: xgrammar's calls release the GIL (tvm-ffi's default); the rows' cost on one thread
        return num_rows * self._fill_seconds_per_row

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: np.ndarray) -> None:
        """One batched call (no Python per row), on as many threads as the rows' cost on one
        thread justifies; that cost is measured by the single-thread fills."""
        rows = len(grammars)
        threads = max(1, min(self._max_fill_threads, int(rows * self._fill_seconds_per_row / _FILL_SECONDS_PER_THREAD)))
        if threads > 1:
            self._num_threaded_fills += 1
            if self._num_threaded_fills % _FILL_REMEASURE_EVERY == 0:
                threads = 1
        matcher = self._batch_matchers.get(threads)
        if matcher is None:
            matcher = self._batch_matchers[threads] = self._xgr.BatchGrammarMatcher(max_threads=threads)
        start = time.perf_counter()
        matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)  # type: ignore[attr-defined]
        if threads == 1 and rows >= _FILL_MEASURE_MIN_ROWS:
            per_row = (time.perf_counter() - start) / rows
            self._fill_seconds_per_row = per_row if not self._fill_seconds_per_row else \
                0.8 * self._fill_seconds_per_row + 0.2 * per_row
