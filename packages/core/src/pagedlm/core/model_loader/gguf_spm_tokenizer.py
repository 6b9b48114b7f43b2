"""Gemma's tokenizer rebuilt from GGUF metadata with the ``tokenizers`` library alone.

Why not transformers' GGUF conversion: its result depends on the installed transformers release.
transformers 5.17 (the H200 image's) builds a wrong tokenizer from the Gemma 3 270M file: it
looks multi-space tokens up under the wrong spelling and orders the recovered merges by score,
which Gemma's scores do not follow, so " capital" came out as four pieces and, after a
``save_pretrained`` round trip, as single characters. The model then saw garbage on every device.
Building it here gives the same tokenizer under any transformers version.

What a Gemma GGUF file holds and how it maps onto a byte-fallback BPE model (the shape of
Google's own ``tokenizer.json``):

- ``tokenizer.ggml.tokens`` in id order, spaces written as ``▁`` except tokens made only of
  spaces, which are stored as real spaces and are respelled with ``▁`` here;
- no merges: they are recovered from the vocabulary (every split of a token into two tokens),
  ranked by the merged token's position in the file (earlier merges first), longer left parts
  first among the splits of one token;
- no prefix space, no pre-tokenizer: the normalizer only turns spaces into ``▁``;
- ``token_type`` 3 (control) tokens are special added tokens, 4 (user-defined) plain added tokens
  (newline runs, ``[multimodal]``; not the respelled space runs), both matched whole in the text;
- ``add_bos_token`` decides whether the post-processor prepends ``<bos>``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_gemma_tokenizer", "uses_builtin_builder"]

SPACE = "\u2581"
CONTROL, USER_DEFINED = 3, 4


def uses_builtin_builder(metadata: dict[str, Any]) -> bool:
    """True for files whose tokenizer pagedlm builds itself (Gemma 3's sentencepiece vocabulary)."""
    return metadata.get("general.architecture") == "gemma3" and metadata.get("tokenizer.ggml.model") == "llama"


def _respell(token: str) -> str:
    return SPACE * len(token) if token and not token.strip(" ") else token


def recover_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary whose file order is its merge order."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for merged, index in vocab.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                ranked.append((index, -cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def build_gemma_tokenizer(metadata: dict[str, Any]) -> Any:
    """A ``PreTrainedTokenizerFast`` equivalent to Google's Gemma tokenizer for this file."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    spelled = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
    tokens = [_respell(t) for t in spelled]
    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))]

    def token_of(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None else None

    unk = token_of("unknown_token_id") or "<unk>"
    model = BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=recover_merges(tokens), unk_token=unk,
                fuse_unk=True, byte_fallback=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    # NOTE: added tokens match the raw text, so they keep the file's spelling; the respelled space
    # runs are left to the model (the text never holds a literal "▁▁").
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(spelled, types) if kind == CONTROL])
    respelled = set(tokens)
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(spelled, types) if kind == USER_DEFINED and t in respelled])
    bos = token_of("bos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    eos = token_of("eos_token_id")
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos and eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos and eos else [])
    special = {t for t in (bos if add_bos else None, eos if add_eos else None) if t}
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, tokens.index(t)) for t in special]
    )
    kwargs = {name: token_of(key) for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                                    ("unk_token", "unknown_token_id"),
                                                    ("pad_token", "padding_token_id"))}
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        kwargs["chat_template"] = template
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left",
                                   **{k: v for k, v in kwargs.items() if v is not None})
