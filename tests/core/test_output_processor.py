"""The output processor: incremental detokenization (the fast decode path included) and
``stream_interval`` (fewer streamed outputs, nothing lost)."""

from __future__ import annotations

import random

import pytest

from pagedlm.core.engine.detokenizer import IncrementalDetokenizer, make_decode
from pagedlm.core.engine.output_processor import OutputProcessor
from pagedlm.core.sampling_params import RequestOutputKind, SamplingParams
from pagedlm.core.sched import EngineCoreOutput


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from pagedlm.core.testing.tokenizer import build_bpe_tokenizer

    return AutoTokenizer.from_pretrained(build_bpe_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=600))


def _reference_text(tokenizer, prompt: list[int], outputs: list[int], skip_special_tokens: bool = True) -> str:
    """The sliding-window algorithm written plainly, every window decoded by ``tokenizer.decode``."""

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    ids = list(prompt[-5:])
    prefix, read, text = 0, len(ids), ""
    for token in outputs:
        ids.append(token)
        prefix_text, new_text = decode(ids[prefix:read]), decode(ids[prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            text += new_text[len(prefix_text):]
            prefix, read = read, len(ids)
    if read < len(ids):
        text += decode(ids[prefix:])[len(decode(ids[prefix:read])):]
    return text


def test_fast_decode_is_the_tokenizers_decode(tokenizer):
    assert make_decode(tokenizer, True).func == tokenizer.backend_tokenizer.decode  # the backend, directly
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert make_decode(tokenizer, skip)(ids) == tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_a_tokenizer_that_overrides_decode_keeps_its_decode(tokenizer):
    class Shouting(type(tokenizer)):
        def decode(self, ids, **kwargs):
            return super().decode(ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=tokenizer.backend_tokenizer)
    assert make_decode(shouting, True)([300, 301]) == tokenizer.decode([300, 301]).upper()


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_matches_the_plain_algorithm(tokenizer, skip_special_tokens):
    # Multi-byte characters split across tokens, special tokens and several tokens per update.
    rng = random.Random(1)
    text = "Grüße aus Köln — 東京タワー 🚀 and the quick brown fox. 数字 12345"
    pieces = tokenizer.encode(text, add_special_tokens=False) + [2, 5]
    for _ in range(30):
        prompt = [rng.randrange(9, 300) for _ in range(rng.randint(1, 8))]
        outputs = [rng.choice(pieces) if rng.random() < 0.7 else rng.randrange(len(tokenizer)) for _ in range(40)]
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        i = 0
        while i < len(outputs):
            step = rng.choice([1, 1, 1, 2, 3])
            assert detok.update(outputs[i:i + step]) is None
            i += step
        detok.flush()
        assert detok.text == _reference_text(tokenizer, prompt, outputs, skip_special_tokens)


def test_stop_string_cuts_the_text(tokenizer):
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["three"])
    stop = None
    for t in ids:
        stop = detok.update([t])
        if stop is not None:
            break
    assert stop == "three" and detok.text.strip() == "one two"


# -- stream_interval ------------------------------------------------------------------------------
def _run(tokenizer, interval: int, kind: RequestOutputKind, steps: list[list[int]], *, n: int = 1,
         stop: list[str] | None = None, with_logprobs: bool = False):
    """Feed ``steps`` (token ids per step, every child the same) through an output processor;
    returns the RequestOutputs it sent."""
    processor = OutputProcessor(tokenizer, stream_interval=interval)
    params = SamplingParams(max_tokens=100, n=n, output_kind=kind, stop=stop, logprobs=1 if with_logprobs else None)
    children = [f"{i}_r" for i in range(n)] if n > 1 else ["r"]
    processor.add_request("r", "prompt", [1, 20, 30], params, children, [params] * n)
    sent = []
    position = 0
    for k, tokens in enumerate(steps):
        last = k == len(steps) - 1
        outs = []
        for child in children:
            logprobs = None
            if with_logprobs:
                logprobs = ([[t, 7] for t in tokens], [[-0.5 - position - j, -3.0] for j in range(len(tokens))],
                            [1] * len(tokens))
            outs.append(EngineCoreOutput(child, list(tokens), "length" if last else None, None, logprobs))
        position += len(tokens)
        results, _ = processor.process_outputs(outs)
        sent.extend(results)
        if any(r.finished for r in results):
            break
    assert not processor.has_unfinished_requests()
    return sent


def _concatenated(outputs, kind: RequestOutputKind, index: int = 0):
    if kind == RequestOutputKind.CUMULATIVE:
        last = outputs[-1].outputs[index]
        return last.text, last.token_ids, last.logprobs
    text, token_ids, logprobs = "", [], []
    for out in outputs:
        c = out.outputs[index]
        text += c.text
        token_ids += c.token_ids
        logprobs += c.logprobs or []
    return text, token_ids, logprobs


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 5, 19, 20, 21])
def test_stream_interval_merges_outputs_and_loses_nothing(tokenizer, kind, num_tokens):
    ids = tokenizer.encode(" Grüße aus Köln, 東京 and the quick brown fox jumps over the dog", add_special_tokens=False)
    steps = [[ids[i % len(ids)]] for i in range(num_tokens)]
    every = _run(tokenizer, 1, kind, steps, with_logprobs=True)
    merged = _run(tokenizer, 4, kind, steps, with_logprobs=True)
    assert len(every) == num_tokens
    # the first token at once, then one output per 4 tokens, and the rest when it finishes
    assert len(merged) == 1 + -(-(num_tokens - 1) // 4)
    assert merged[0].outputs[0].token_ids == steps[0]
    assert merged[-1].finished and every[-1].finished and not any(o.finished for o in merged[:-1])
    assert [len(o.outputs[0].token_ids) for o in merged[1:-1]] == \
        ([4] * len(merged[1:-1]) if kind == RequestOutputKind.DELTA else [1 + 4 * i for i in range(1, len(merged) - 1)])
    text, token_ids, logprobs = _concatenated(merged, kind)
    assert (text, token_ids, logprobs) == _concatenated(every, kind)
    assert token_ids == [t for s in steps for t in s] and len(logprobs) == num_tokens


def test_stream_interval_counts_tokens_of_merged_steps(tokenizer):
    # Steps of several tokens (a front end that lags): an output once 3 or more are unsent.
    steps = [[300], [301, 302], [303], [304, 305, 306, 307], [308], [309]]
    outs = _run(tokenizer, 3, RequestOutputKind.DELTA, steps)
    assert [o.outputs[0].token_ids for o in outs] == [[300], [301, 302, 303], [304, 305, 306, 307], [308, 309]]


def test_stream_interval_with_n_and_stop_strings(tokenizer):
    ids = tokenizer.encode(" one two three four five six seven", add_special_tokens=False)
    steps = [[t] for t in ids]
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        every = _run(tokenizer, 1, kind, steps, n=2, stop=["five"])
        merged = _run(tokenizer, 5, kind, steps, n=2, stop=["five"])
        assert len(merged) < len(every)
        for index in (0, 1):
            assert _concatenated(merged, kind, index) == _concatenated(every, kind, index)
            assert _concatenated(merged, kind, index)[0].strip() == "one two three four"
            assert merged[-1].outputs[index].stop_reason == "five"


def test_final_only_ignores_stream_interval(tokenizer):
    steps = [[300 + i] for i in range(10)]
    (out,) = _run(tokenizer, 4, RequestOutputKind.FINAL_ONLY, steps)
    assert out.finished and out.outputs[0].token_ids == [300 + i for i in range(10)]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "3"])
def test_stream_interval_is_validated(bad):
    from pagedlm.core.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="stream_interval"):
        EngineArgs(stream_interval=bad).create_vllm_config()
    with pytest.raises(ValueError, match="stream_interval"):
        OutputProcessor(None, stream_interval=bad)


def test_stream_interval_cli_flag():
    import argparse

    from pagedlm.core.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--stream-interval", "3"]))
    assert args.stream_interval == 3
    assert args.create_vllm_config().scheduler_config.stream_interval == 3
    assert EngineArgs.from_cli_args(parser.parse_args([])).stream_interval == 1


def test_engine_streams_every_interval_with_the_same_tokens(tiny_llama):
    """The engine end to end: greedy outputs are those of stream_interval=1, in fewer outputs."""
    from pagedlm.core import LLM

    prompts = ["The quick brown fox", "Once upon a time", "1, 2, 3,"]
    results = {}
    for interval in (1, 4):
        llm = LLM(model=tiny_llama, device="cpu", dtype="float32", max_model_len=256, stream_interval=interval)
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params.clone())
        streamed: dict[str, list] = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for out in engine.step():
                streamed[out.request_id].append(out)
        llm.llm_engine.shutdown()
        results[interval] = streamed
    for request_id, every in results[1].items():
        merged = results[4][request_id]
        assert len(every) == 17 and len(merged) == 1 + -(-16 // 4)
        assert len(merged[0].outputs[0].token_ids) == 1 and merged[-1].finished
        assert _concatenated(merged, RequestOutputKind.DELTA) == _concatenated(every, RequestOutputKind.DELTA)
