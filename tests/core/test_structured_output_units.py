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
