"""Gemma's tokenizer rebuilt from GGUF metadata (``gguf_spm_tokenizer``) on a hand-made vocabulary."""

from __future__ import annotations

from pagedlm.core.model_loader.gguf_spm_tokenizer import build_gemma_tokenizer, recover_merges, uses_builtin_builder

# id order is merge order: "ab" merges before "bc", so "abc" is "ab" + "c"
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n", "a", "b", "c", "\u2581", "ab", "bc",
          "\u2581a", "abc", "  "] + [f"<0x{i:02X}>" for i in range(256)]
TYPES = [3, 3, 3, 2, 3, 4, 1, 1, 1, 1, 1, 1, 1, 1, 4] + [6] * 256


def metadata(**extra):
    return {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": TOKENS,
            "tokenizer.ggml.token_type": TYPES, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0, **extra}


def test_merges_follow_file_order_longer_left_first():
    merges = recover_merges(["a", "b", "c", "ab", "bc", "abc"])
    assert merges == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


def test_builds_gemma_tokenizer_from_metadata():
    tok = build_gemma_tokenizer(metadata())
    assert uses_builtin_builder(metadata()) and not uses_builtin_builder(metadata(**{"general.architecture": "llama"}))
    # <bos> prepended, spaces as "\u2581", "abc" by file-order merges, control and user-defined tokens whole
    assert tok("abc a").input_ids == [2, 13, 12]
    assert tok("<start_of_turn>ab\nc").input_ids == [2, 4, 10, 5, 8]
    # a run of spaces is stored as real spaces and looked up respelled; unknown text falls back to bytes
    assert tok("a  b").input_ids == [2, 6, 14, 7]
    assert tok("z").input_ids == [2, len(TYPES) - 256 + ord("z")]
    assert tok.decode(tok("abc a  z").input_ids, skip_special_tokens=True) == "abc a  z"
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == ("<bos>", "<eos>", "<unk>", "<pad>")
    assert build_gemma_tokenizer(metadata(**{"tokenizer.ggml.add_bos_token": False}))("ab").input_ids == [10]
