"""A tiny sentence-transformers checkpoint for the tests of pooling models."""

from __future__ import annotations

import json
import os
import shutil

_MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def make_sentence_transformers_checkpoint(base_dir: str, out_dir: str, *, pooling: str = "mean",
                                          normalize: bool = True) -> str:
    """``base_dir`` (a tiny HF checkpoint) copied to ``out_dir`` with sentence-transformers'
    files: ``modules.json`` (Transformer, Pooling, and Normalize when ``normalize``),
    ``1_Pooling/config.json`` (``pooling``: mean, cls or last) and ``sentence_bert_config.json``.
    Returns ``out_dir``."""
    if pooling not in _MODES:
        raise ValueError(f"pooling={pooling!r} is not one of {', '.join(_MODES)}")
    shutil.copytree(base_dir, out_dir, dirs_exist_ok=True)
    with open(os.path.join(base_dir, "config.json")) as f:
        hidden_size = json.load(f)["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(out_dir, "2_Normalize"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "1_Pooling"), exist_ok=True)
    pooling_config = {"word_embedding_dimension": hidden_size, "include_prompt": True,
                      **dict.fromkeys((*_MODES.values(), *_OTHER_MODES), False)}
    pooling_config[_MODES[pooling]] = True
    files = {"modules.json": modules, "1_Pooling/config.json": pooling_config,
             "sentence_bert_config.json": {"max_seq_length": 256, "do_lower_case": False}}
    for name, content in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2)
    return out_dir
