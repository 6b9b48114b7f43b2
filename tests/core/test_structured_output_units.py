"""Structured-output pieces without a model: the bitmask applied to logits (against xgrammar's own
kernel), the params' checks and their wire form, the bounded-string rewrite."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from pagedlm.core.engine import serial
from pagedlm.core.request import EngineCoreRequest
from pagedlm.core.sampling_params import SamplingParams, StructuredOutputsParams
from pagedlm.core.structured_output.bitmask import apply_grammar_bitmask


@pytest.mark.parametrize("vocab", [64, 1000, 1001])
def test_bitmask_matches_xgrammars_kernel(vocab):
    xgr = pytest.importorskip("xgrammar")
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(5, words), dtype=np.int64).astype(np.int32)
    logits = torch.randn(5, vocab)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, torch.from_numpy(bitmask))
    got = logits.clone()
    apply_grammar_bitmask(got, list("abcde"), {r: i for i, r in enumerate("abcde")}, bitmask)
    assert torch.equal(got, expected)
    # some rows only, in another order: rows without a grammar are untouched
    got = logits.clone()
    apply_grammar_bitmask(got, list("abcde"), {"b": 2, "d": 0}, bitmask[[0, 1, 2]])
    assert torch.equal(got[[0, 2, 4]], logits[[0, 2, 4]])
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, torch.from_numpy(bitmask[[2, 2, 2, 0, 0]]), indices=[1, 3])
    assert torch.equal(got, ref)


def test_params_checks_kind_spec_and_aliases():
    p = StructuredOutputsParams(json='{"type": "object"}')
    assert p.kind == "json" and "object" in p.spec()
    same = StructuredOutputsParams(json={"a": 2, "b": 1}).spec()
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).spec() == same
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]
    assert StructuredOutputsParams(json_object=False, regex="a").kind == "regex"
    assert StructuredOutputsParams.from_guided() is None
    assert StructuredOutputsParams.from_guided(guided_choice=["a"]).choice == ["a"]
    for bad, match in [({"choice": ["a", ""]}, "every choice must be a non-empty string"),
                       ({"regex": ""}, "must be a non-empty string"),
                       ({"json": "[1]"}, "must be a JSON Schema object"),
                       ({"json": int}, "pydantic model class")]:
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**bad)
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=p, guided_decoding=p)
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"


def test_params_cross_the_wire():
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"enum": [1, 2]}}},
                                 disable_any_whitespace=True)
    request = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=so))
    kind, payload = serial.decode(serial.encode_add(request))
    back = serial.request_from_wire(payload).sampling_params.structured_outputs
    assert isinstance(back, StructuredOutputsParams) and back.json == so.json and back.disable_any_whitespace
    assert back.spec() == so.spec()
    plain = serial.request_from_wire(serial.decode(serial.encode_add(EngineCoreRequest("p", [1], SamplingParams())))[1])
    assert plain.sampling_params.structured_outputs is None


def test_bounded_strings_become_plain_character_patterns():
    from pagedlm.core.structured_output.xgrammar_backend import _bounded_strings_as_patterns

    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4},
                                               "e": {"enum": [{"minLength": 1}]}}}
    out = _bounded_strings_as_patterns(schema)
    pattern = out["properties"]["s"]["pattern"]
    assert "minLength" not in out["properties"]["s"] and out["properties"]["e"] == schema["properties"]["e"]
    for text, ok in [("ab", True), ("a\U0001f642cd", True), ("a", False), ("abcde", False), ('a"b', False),
                     ("a\\b", False), ("a\x16", False), ("a\ud800", False)]:
        assert bool(re.fullmatch(pattern, text)) is ok, text


def test_xgrammar_fill_uses_threads_only_for_costly_rows(tmp_path):
    """The batched fill gives each row the matcher's own mask; cheap rows stay on one thread, rows
    measured as costly spread over threads, and a threaded run re-measures on one thread now and
    then."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from pagedlm.core.structured_output import xgrammar_backend as xb
    from pagedlm.core.testing.tokenizer import build_bpe_tokenizer

    build_bpe_tokenizer(tmp_path, vocab_size=400)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    config = SimpleNamespace(model_config=SimpleNamespace(eos_token_ids=[2], hf_config=object()),
                             structured_outputs_config=SimpleNamespace(disable_any_whitespace=False))
    backend = xb.XgrammarBackend(vllm_config=config, tokenizer=tokenizer, vocab_size=400)
    compiled = backend.compile(StructuredOutputsParams(regex="[0-9]{2}(ab|cd)"))
    grammars = [backend.new_grammar(compiled, [2]) for _ in range(40)]
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    for i, g in enumerate(grammars[:20]):  # half of them one digit further
        assert g.accept_tokens([digits[i % 10]])
    expected = backend.allocate_bitmask(40)
    for row, g in enumerate(grammars):
        g.matcher.fill_next_token_bitmask(expected, row)
    assert not np.array_equal(expected[0], expected[39])

    got = np.zeros_like(expected)
    backend.fill_bitmasks(grammars, got)
    assert np.array_equal(got, expected)
    assert set(backend._batch_matchers) == {1} and backend._fill_seconds_per_row > 0

    backend._max_fill_threads = 4
    backend._fill_seconds_per_row = 1.0  # as if every row took a second on one thread
    got[:] = 0
    backend.fill_bitmasks(grammars, got)
    assert np.array_equal(got, expected) and set(backend._batch_matchers) == {1, 4}
    for _ in range(xb._FILL_REMEASURE_EVERY - 1):
        backend.fill_bitmasks(grammars, got)
    # the 64th threaded fill ran on one thread: the cost is measured again (and is small)
    assert backend._fill_seconds_per_row < 1.0


def test_bitmask_rows_come_from_three_buffers_in_turn():
    """Each step's rows are a view of the next of three persistent buffers (a buffer is refilled
    only three steps later); more rows than max_num_seqs get a buffer of their own."""
    from types import SimpleNamespace

    from pagedlm.core.structured_output.manager import StructuredOutputManager

    config = SimpleNamespace(structured_outputs_config=SimpleNamespace(),
                             scheduler_config=SimpleNamespace(max_num_seqs=8))
    manager = StructuredOutputManager(config)  # type: ignore[arg-type]
    manager._backend = SimpleNamespace(allocate_bitmask=lambda n: np.full((n, 3), -1, dtype=np.int32))
    views = [manager._bitmask_rows(5) for _ in range(4)]
    assert all(v.shape == (5, 3) for v in views)
    assert np.shares_memory(views[0], views[3])
    assert not any(np.shares_memory(views[i], views[j]) for i, j in ((0, 1), (0, 2), (1, 2)))
    big = manager._bitmask_rows(9)
    assert big.shape == (9, 3) and not any(np.shares_memory(big, v) for v in views)
