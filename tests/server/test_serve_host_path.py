"""The API process's cheaper per-chunk paths give what the plain ones gave (serve_host_cost.py)."""

from __future__ import annotations

import json

import pytest

MODEL = "tiny-llama"


def test_every_engine_core_output_field_crosses_the_pipe():
    from pagedlm.core.engine import serial
    from pagedlm.core.sched import EngineCoreOutput

    out = EngineCoreOutput("r-1", [7, 8], finish_reason="stop", stop_reason="###",
                           new_logprobs=[[[7, 9]], [[-0.5, -1.5]], [1]], new_prompt_logprobs=[[[1]], [[-2.0]], [3]],
                           num_cached_tokens=16, error="boom", timing=(1.5, 2.5), num_preemptions=2,
                           kv_transfer_params={"remote": "x"}, pooling_output=[0.25, 0.5])
    batch = serial.EngineCoreOutputs([out, EngineCoreOutput("r-2", [3])], None, 3.0)
    kind, payload = serial.decode(serial.encode_outputs(batch))
    got = serial.outputs_from_wire(payload).outputs
    assert kind == serial.OutputKind.OUTPUTS and len(got) == 2
    for name in EngineCoreOutput.__slots__:
        sent, back = getattr(out, name), getattr(got[0], name)
        assert (list(back) if isinstance(sent, tuple) else back) == (list(sent) if isinstance(sent, tuple) else sent)
    assert (got[1].request_id, got[1].new_token_ids, got[1].finish_reason) == ("r-2", [3], None)


def test_observe_all_matches_one_observe_per_value():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from pagedlm.server.metrics import observe_all

    values = [0.004, 0.004, 0.004, 0.01, 0.0, 2.5, 0.004, 1e9, 0.075, 0.075]
    exposition = []
    for batched in (False, True):
        registry = CollectorRegistry()
        child = Histogram("itl", "ITL", ["model_name"], buckets=[0.001, 0.004, 0.01, 0.075, 1.0],
                          registry=registry).labels(model_name="m")
        if batched:
            observe_all(child, values)
            observe_all(child, [0.5])  # the one-value path
            observe_all(child, [])
        else:
            for value in [*values, 0.5]:
                child.observe(value)
        exposition.append(generate_latest(registry).decode())
    lines = [[line for line in text.splitlines() if not line.startswith("#") and "_created" not in line]
             for text in exposition]
    assert [x for x in lines[0] if "_sum" not in x] == [x for x in lines[1] if "_sum" not in x]
    sums = [float(next(x for x in ls if "_sum" in x).split()[-1]) for ls in lines]
    assert sums[1] == pytest.approx(sums[0], rel=1e-12)


@pytest.mark.parametrize("payload", [
    {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
     "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None, "token_ids": [5, 6]}]},
    {"text": "naïve — 漢字 🙂 \"quoted\" back\\slash tab\t nl\n ctrl\x01\x1f del\x7f </script>"},
    {"logprobs": {"token_logprobs": [-0.5, -9999.0, 0.0], "top_logprobs": [{"a": -0.25}, None]}, "n": [True, False]},
])
def test_sse_json_is_what_json_dumps_writes(payload):
    from pagedlm.server.serving_common import sse

    event = sse(payload)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[6:-2]) == payload
    assert event[6:-2] == json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def test_token_id_prompts_echo_and_offsets_with_their_decoded_text(client):
    # token-id prompts skip the tokenizer thread and the decode unless echo or logprobs need the text
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0, echo=True)
    prompt_text = echoed.choices[0].text[: len(echoed.choices[0].text) - len(ids.choices[0].text)]
    assert prompt_text and echoed.choices[0].text == prompt_text + ids.choices[0].text
    lp = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0,
                                   logprobs=1).choices[0].logprobs
    assert lp.text_offset[0] == len(prompt_text)  # offsets count from the end of the prompt's text
    streamed = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0, stream=True,
                                         echo=True)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_token_id_type_checks_keep_their_verdicts(tiny_llama):
    # the C-speed fast paths (set of element types) must accept and refuse what the loops did
    from pagedlm.core.engine.arg_utils import EngineArgs
    from pagedlm.core.engine.processor import Processor
    from pagedlm.server.protocol import CompletionRequest

    processor = Processor(EngineArgs(model=tiny_llama, skip_tokenizer_init=True).create_vllm_config(), None)
    assert processor.tokenize_prompt({"prompt_token_ids": [3, True, 4]})[1] == [3, True, 4]  # bool is an int
    for bad in ([3, "4"], [3, 4.0], [3, None]):
        with pytest.raises(ValueError, match="prompt_token_ids must be a list of integers"):
            processor.tokenize_prompt({"prompt_token_ids": bad})
    assert CompletionRequest(prompt=[5, 6.0, 7]).prompt == [5, 6, 7]  # integral floats become ints
    assert CompletionRequest(prompt=[[5.0], [6, 7]]).prompt == [[5], [6, 7]]
    with pytest.raises(ValueError):
        CompletionRequest(prompt=[5, 6.5])
