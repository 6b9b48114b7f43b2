"""Structured outputs offline: a tiny random model whose outputs are valid only because of the grammar.

Every finished output must parse and validate; an output cut by max_tokens says "length". The
grammar's state survives preemption (recompute) and async scheduling: the same tokens either way.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.plugins import get_plugins, hookimpl
from pagedlm.core.sampling_params import StructuredOutputsParams
from pagedlm.core.structured_output.xgrammar_backend import XgrammarBackend

PROMPTS = ["hello", "the quick brown fox", "Once upon a time", "1, 2, 3,"]

SCHEMAS = {
    "enums_and_bounds": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 20},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "flag": {"type": "boolean"},
        },
        "required": ["colour", "count", "ratio", "flag"],
        "additionalProperties": False,
    },
    "bounded_strings_and_arrays": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": 6},
            "code": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
            "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                     "minItems": 1, "maxItems": 3},
        },
        "required": ["name", "code", "tags"],
        "additionalProperties": False,
    },
    "nested_with_ref": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                                             "y": {"type": "integer", "minimum": -5, "maximum": 5}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"},
                       "end": {"$ref": "#/$defs/point"},
                       "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                "additionalProperties": False}},
        "required": ["start", "end", "meta"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama, dtype="float32", device="cpu", max_model_len=512)


def _params(seed: int = 0, max_tokens: int = 150, **so) -> SamplingParams:
    # NOTE: a random model loves whitespace, which JSON allows anywhere between tokens; without
    # disable_any_whitespace most of its outputs would only end by length
    so.setdefault("disable_any_whitespace", "json" in so or "json_object" in so)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**so))


def _finished(outputs) -> list[str]:
    texts = []
    for out in outputs:
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length"), (c.finish_reason, out.error)
        if c.finish_reason == "stop":
            texts.append(c.text)
    return texts


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(llm, name):
    schema = SCHEMAS[name]
    params = [_params(seed=i, json=schema) for i in range(len(PROMPTS))]
    texts = _finished(llm.generate(PROMPTS, params, use_tqdm=False))
    assert len(texts) >= len(PROMPTS) // 2, "most outputs should finish within max_tokens"
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_json_with_any_whitespace_validates_when_it_finishes(llm):
    schema = SCHEMAS["enums_and_bounds"]
    params = [_params(seed=i, max_tokens=120, json=schema, disable_any_whitespace=False) for i in range(2)]
    for text in _finished(llm.generate(PROMPTS[:2], params, use_tqdm=False)):
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_choice_and_grammar(llm):
    outs = llm.generate(PROMPTS, [_params(seed=i, max_tokens=60, json_object=True) for i in range(4)], use_tqdm=False)
    for text in _finished(outs):
        assert isinstance(json.loads(text), dict)
    pattern = r"[a-c]{2,4}-\d{3}"
    for text in _finished(llm.generate(PROMPTS, [_params(seed=i, regex=pattern) for i in range(4)], use_tqdm=False)):
        assert re.fullmatch(pattern, text), text
    choices = ["apple", "banana split", "cherry \"pie\""]
    texts = _finished(llm.generate(PROMPTS, [_params(seed=i, choice=choices) for i in range(4)], use_tqdm=False))
    assert len(texts) == 4 and all(t in choices for t in texts)
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    for text in _finished(llm.generate(PROMPTS, [_params(seed=i, max_tokens=40, grammar=grammar) for i in range(4)],
                                       use_tqdm=False)):
        assert re.fullmatch(r"\(\d(\+\d)*\)", text), text


def test_structural_tag(llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    tag = json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<out>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</out>"}})
    for text in _finished(llm.generate(PROMPTS[:2], [_params(seed=i, structural_tag=tag) for i in range(2)],
                                       use_tqdm=False)):
        m = re.fullmatch(r"<out>(.*)</out>", text, re.S)
        assert m, text
        jsonschema.validate(json.loads(m.group(1)), schema)


def test_unconstrained_rows_are_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[:2], [plain, plain, _params(regex="[xyz]+!"), _params(choice=["a"])],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert re.fullmatch("[xyz]+!", mixed[2].outputs[0].text) and mixed[3].outputs[0].text == "a"


def test_cut_by_max_tokens_is_length(llm):
    out = llm.generate(["hi"], _params(max_tokens=3, json=SCHEMAS["nested_with_ref"]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_same_tokens_with_preemption_and_async_scheduling(tiny_llama, llm):
    schema = SCHEMAS["bounded_strings_and_arrays"]
    prompts = [p * 3 for p in PROMPTS] + [p * 2 for p in PROMPTS[:2]]
    params = [_params(seed=i, max_tokens=40, json=schema) for i in range(len(prompts))]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(model=tiny_llama, dtype="float32", device="cpu", max_model_len=128, num_gpu_blocks_override=14,
                async_scheduling=True)
    executor = tight.llm_engine.core.executor
    deferred = []
    sample_tokens = executor.sample_tokens
    executor.sample_tokens = lambda grammar, non_block=False: deferred.append(grammar) or sample_tokens(grammar,
                                                                                                          non_block)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert tight.llm_engine.core.scheduler.num_preemptions_total > 0
    # the steps went out before their bitmasks were filled (the forward overlaps the fill)
    assert any(g.grammar_bitmask is not None for g in deferred)


def test_same_tokens_with_every_fill_on_the_fill_thread(tiny_llama, llm, monkeypatch):
    """The fill thread (a fill left running while the engine core schedules the next step) gives
    the tokens of the inline fill; the switch interval is back to what it was afterwards."""
    import sys

    from pagedlm.core.structured_output import manager

    monkeypatch.setattr(manager, "_BACKGROUND_FILL_MIN_S", -1.0)  # every fill, however small
    schema = SCHEMAS["nested_with_ref"]
    prompts = PROMPTS * 2
    params = [_params(seed=i, max_tokens=60, json=schema) for i in range(len(prompts))]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    interval = sys.getswitchinterval()
    threaded = LLM(model=tiny_llama, dtype="float32", device="cpu", max_model_len=256, async_scheduling=True)
    got = [o.outputs[0].token_ids for o in threaded.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    som = threaded.llm_engine.core.scheduler.structured_output_manager
    assert som._fill_thread is not None and som.num_fill_steps > 0
    assert sys.getswitchinterval() == interval
    threaded.llm_engine.core.shutdown()
    assert not som._fill_thread._thread.is_alive()


def test_guided_decoding_alias_and_pydantic_model(llm):
    from pydantic import BaseModel, Field

    class Item(BaseModel):
        id: int = Field(ge=0, le=9)
        kind: str = Field(pattern="^(a|b)$")

    params = SamplingParams(temperature=1.0, seed=3, max_tokens=200,
                            guided_decoding=StructuredOutputsParams(json=Item, disable_any_whitespace=True))
    assert params.structured_outputs is not None and params.guided_decoding is None
    for text in _finished(llm.generate(PROMPTS, params, use_tqdm=False)):
        Item.model_validate_json(text)


@pytest.mark.parametrize(("so", "match"), [
    ({"json": {"type": "bogus"}}, r"structured_outputs\.json is invalid: .*bogus"),
    ({"json": "{not json"}, r"structured_outputs\.json is not valid JSON"),
    ({"json": {"type": "array", "uniqueItems": True}}, r"uses 'uniqueItems' at #, which the xgrammar backend"),
    ({"json": {"properties": {"s": {"type": "string", "pattern": "a+", "maxLength": 3}}}},
     r"'pattern' together with 'minLength'/'maxLength' at #/properties/s"),
    ({"regex": "(a"}, r"structured_outputs\.regex is invalid"),
    ({"choice": []}, r"structured_outputs\.choice=\[\] is invalid: must be a non-empty list"),
    ({"grammar": "root ::= missing"}, r"structured_outputs\.grammar is invalid: .*missing"),
    ({}, r"exactly one of json, regex, choice, grammar, json_object, structural_tag; got none"),
    ({"regex": "a", "choice": ["a"]}, r"got regex, choice"),
])
def test_bad_constraints_are_value_errors(llm, so, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["hi"], SamplingParams(structured_outputs=so), use_tqdm=False)


class FailingBackend(XgrammarBackend):
    def compile(self, params):
        if params.regex == "FAIL":
            raise RuntimeError("compile failed on purpose")
        return super().compile(params)


class _FailingBackendPlugin:
    """A backend whose compilation fails for the regex "FAIL" (after the front end's checks)."""

    @hookimpl
    def pagedlm_register_structured_output_backends(self, register):
        register("failing", f"{__name__}:FailingBackend")


def test_a_grammar_that_fails_to_compile_fails_only_its_request(tiny_llama):
    plugins = get_plugins()
    plugins.register(_FailingBackendPlugin(), name="failing-so-backend")
    try:
        llm = LLM(model=tiny_llama, dtype="float32", device="cpu", structured_outputs_config={"backend": "failing"})
        outs = llm.generate(["a", "b", "c"], [_params(regex="FAIL"), _params(regex="ok[0-9]"),
                                              SamplingParams(max_tokens=4, ignore_eos=True)], use_tqdm=False)
        assert outs[0].error and "compile failed on purpose" in outs[0].error
        assert outs[0].outputs[0].finish_reason == "error"
        assert re.fullmatch("ok[0-9]", outs[1].outputs[0].text) and len(outs[2].outputs[0].token_ids) == 4
        assert not llm.llm_engine.core.scheduler.has_unfinished_requests()
        with pytest.raises(ValueError, match=r"backend='nope' is not a registered .*xgrammar"):
            LLM(model=tiny_llama, dtype="float32", device="cpu", structured_outputs_config={"backend": "nope"})
    finally:
        plugins.unregister("failing-so-backend")
