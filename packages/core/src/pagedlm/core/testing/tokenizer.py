"""A real byte-level BPE tokenizer, trained in well under a second on a corpus kept in this module.

There is no hub access on the machines that run our tests, so every checkpoint we test against has
to carry a tokenizer we make ourselves. A real trained BPE (rather than a character map) matters:
multi-byte merges, special tokens and byte fallback are exactly what incremental detokenization
and stop-string handling get wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

# Fixed ids at the front of the vocabulary, so a checkpoint's config can name them without having
# to load the tokenizer first.
UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
END_OF_TURN_TOKEN = "<|end|>"
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS, END_OF_TURN_TOKEN)
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3

# Roles outside ROLE_TOKENS are rendered as plain text, so the template never fails on them.
# Tools are listed by name in a turn of their own, as real templates render them before the chat.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|tool|>' }}\n{% for tool in tools %}{{ tool.function.name }}\n{% endfor %}"
    "{{ '<|end|>' }}\n{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ '<|end|>' }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)

# The split Qwen2 tokenizers apply before byte-level mapping (as in their published tokenizer.json).
_QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# 256 byte symbols + the special tokens: anything smaller cannot encode arbitrary text.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Varied on purpose: prose, numbers, punctuation, code, non-ASCII text and emoji, so that merges
# cover common English and the tokenizer still has to fall back to raw bytes on rarer input.
_CORPUS = r"""
The quick brown fox jumps over the lazy dog. The dog did not seem to mind; it had seen foxes before.
Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter.
Every morning they pushed the boat into the water, and every evening they pulled it back onto the sand.
The daughter wanted to see the world beyond the horizon, but her father said the world would come to them.
One day a stranger arrived with a map, a compass, and a story about an island where the rivers ran with honey.
"Maps are only promises," said the fisherman. "The sea keeps its own counsel."
Still, the daughter studied the map by candlelight, tracing the coastline with her finger until she knew it by heart.

In the spring of 1998, the city council approved a plan to build a new library. It opened three years later,
on 14 September 2001, with 120,000 books, 42 computers and a reading room that could seat 350 people.
Attendance grew by 7.5% per year. By 2010 the library lent more than 2 million items annually.
Questions? Call (555) 013-2468, or write to info@example.org. Opening hours: Mon-Fri 9:00-18:00, Sat 10:00-14:00.

Large language models predict the next token given the tokens before it. A transformer computes attention
between every pair of positions, so memory for the key/value cache grows with the length of the sequence.
Paged attention stores that cache in fixed-size blocks, the way an operating system stores memory in pages.
A scheduler decides which requests run in each step: it admits new prompts, continues running sequences,
and preempts a sequence when the cache is full, recomputing it later. Prefix caching lets requests that share
a system prompt share the blocks that hold it, counted by reference and evicted in least-recently-used order.
Greedy decoding always picks the most likely token; sampling draws from the distribution instead, shaped by
temperature, top-p and top-k. Logprobs report how likely each chosen token was.

Weather report: cloudy in the north with scattered showers; sunny and warm in the south, highs near 28 degrees.
Winds from the west at 15 to 20 kilometres per hour. Tomorrow: clearer skies, cooler nights.

Recipe for bread: mix 500 g of flour, 10 g of salt, 7 g of yeast and 350 ml of warm water. Knead for ten minutes,
let it rise for an hour, shape the loaf, let it rise again, and bake at 220 degrees for thirty-five minutes.

Some words from elsewhere: café, naïve, façade, jalapeño, Straße, smörgåsbord, crème brûlée, São Paulo.
Greek: αβγ δέλτα. Russian: привет, мир. Japanese: こんにちは世界. Chinese: 你好，世界. Emoji: 🙂 🚀 ✨.

def fibonacci(n: int) -> list[int]:
    '''Return the first n Fibonacci numbers.'''
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        self.free = list(range(num_blocks))
        self.block_size = block_size

    def allocate(self, num_tokens: int) -> list[int]:
        needed = (num_tokens + self.block_size - 1) // self.block_size
        if needed > len(self.free):
            raise RuntimeError(f"out of blocks: need {needed}, have {len(self.free)}")
        blocks, self.free = self.free[:needed], self.free[needed:]
        return blocks


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

#include <stdio.h>
int main(void) {
    int total = 0;
    for (int k = 0; k < 100; ++k) { total += k * k; }
    printf("sum of squares: %d\n", total);
    return 0;
}

SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01' GROUP BY name ORDER BY orders DESC LIMIT 10;

{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "temperature": 0.7, "max_tokens": 64}

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: And how many people live there?
Assistant: About two million people live in the city itself, and over twelve million in the wider region.
User: Thank you! Can you write a short poem about the ocean?
Assistant: Waves fold into waves, the grey light breaks, and the tide remembers what the shore forsakes.

It was the best of times, it was the worst of times; it was the age of wisdom, it was the age of foolishness.
All happy families are alike; each unhappy family is unhappy in its own way.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse,
I thought I would sail about a little and see the watery part of the world.
"""


def corpus_lines() -> list[str]:
    """The embedded training corpus, one non-empty line per item."""
    return [line for line in _CORPUS.splitlines() if line.strip()]


def _train(vocab_size: int, style: str):  # -> tokenizers.Tokenizer
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    if style == "gpt2":
        # add_prefix_space=False keeps encode/decode an exact round trip; use_regex splits words
        # the way GPT-2-style tokenizers do, so merges never cross word boundaries.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif style == "qwen2":
        # transformers 5 ignores tokenizer_class for qwen2 checkpoints and rebuilds the tokenizer
        # with exactly this normalizer and pre-tokenizer (digits split one by one). Training with
        # the same pipeline keeps tokenizer.json and AutoTokenizer in agreement on every input.
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ValueError(f"style={style!r} is not one of 'gpt2', 'qwen2'")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocabulary, so no text ever needs <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Training runs in a Rust thread pool; the result does not depend on it, but forking test
    # workers after it warns loudly unless parallelism is settled first.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    # Llama-style: the bos token is prepended when encoding with add_special_tokens=True.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tok


def _pad_vocab(tok, vocab_size: int) -> None:
    """Fill the vocabulary up to exactly ``vocab_size`` with visible reserved tokens.

    A randomly initialised model emits any id below its vocab size. If the tokenizer were smaller,
    those ids would decode to nothing; reserved tokens (not special, so skip_special_tokens keeps
    them) make every id decode to visible text, as in real checkpoints with padded vocabularies.
    """
    from tokenizers import AddedToken

    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_tokens([AddedToken(f"<|reserved_{i}|>", special=False, normalized=False) for i in range(missing)])


def build_bpe_tokenizer(
    out_dir: str | os.PathLike[str],
    vocab_size: int = 512,
    *,
    model_max_length: int = 512,
    style: Literal["gpt2", "qwen2"] = "gpt2",
) -> str:
    """Train a byte-level BPE tokenizer and save it (tokenizer.json + tokenizer_config.json) to ``out_dir``.

    The vocabulary has exactly ``vocab_size`` entries: ids 0-3 are ``<unk> <s> </s> <pad>``, then
    the chat tokens ``<|system|> <|user|> <|assistant|> <|tool|> <|end|>``, the 256 byte symbols,
    learned merges, and reserved filler tokens when the corpus runs out of merges. Encoding with
    special tokens prepends ``<s>``. ``style`` picks the pre-tokenizer: GPT-2 byte-level, or
    Qwen2's (NFC, digits split singly), which transformers 5 imposes on qwen2 checkpoints anyway.
    The same arguments always give byte-identical files.

    Returns ``out_dir`` as a string.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {MIN_VOCAB_SIZE}")
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train(vocab_size, style)
    _pad_vocab(tok, vocab_size)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, f"special token {token} got id {tok.token_to_id(token)}, expected {i}"

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[*ROLE_TOKENS, END_OF_TURN_TOKEN],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    _pin_tokenizer_config(out)
    return str(out)


def _pin_tokenizer_config(out: Path) -> None:
    """Make tokenizer_config.json self-describing and independent of the transformers version.

    Without ``tokenizer_class``, AutoTokenizer picks a class from the model's config.json (e.g.
    LlamaTokenizer), and newer transformers rebuild such tokenizers with their own pre-tokenizer,
    which would silently change our ids. Some transformers versions write the chat template to a
    separate chat_template.jinja; we also keep it in tokenizer_config.json, where every reader
    (ours included) looks first.
    """
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["bos_token"] = BOS_TOKEN
    cfg["eos_token"] = EOS_TOKEN
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
