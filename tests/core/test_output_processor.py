"""The output processor: incremental detokenization (the fast decode path included)."""

from __future__ import annotations

import random

import pytest

from pagedlm.core.engine.detokenizer import IncrementalDetokenizer, make_decode


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
