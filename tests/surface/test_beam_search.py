"""LLM.beam_search against HF ``generate(num_beams=k, do_sample=False)`` on tiny checkpoints (fp32, CPU)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pagedlm.core import LLM, BeamSearchParams
from pagedlm.core.testing import EOS_ID
from pagedlm.core.testing.hf_reference import _load_hf_model

PROMPTS = [[1, 17, 42, 99, 7], [1, 64, 65, 66, 67, 68, 69, 70, 71]]


def hf_beams(model, prompt, *, k, max_tokens, length_penalty, early_stopping, ignore_eos):
    gen = model.generation_config
    eos = None if ignore_eos else gen.eos_token_id
    out = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, do_sample=False,
                         max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
                         eos_token_id=eos, pad_token_id=gen.pad_token_id, output_scores=True,
                         return_dict_in_generate=True, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    beams = []
    for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        generated = row[len(prompt):]
        if eos is not None and eos in generated:
            generated = generated[: generated.index(eos) + 1]
        beams.append((generated, score))
    return beams


_PAIRS: dict[str, tuple] = {}


def _with_likely_eos(path: str, out_dir: Path) -> str:
    """A copy of a tiny checkpoint whose EOS logit follows a frequent token's (a little above it), so
    beams end at different lengths and the length penalty and stopping rules matter."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out_dir, dirs_exist_ok=True)
    weights = load_file(str(out_dir / "model.safetensors"))
    hf = _load_hf_model(path)
    with torch.no_grad():
        first = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=3, do_sample=False,
                            attention_mask=torch.ones(1, len(PROMPTS[0]), dtype=torch.long))[0, -1].item()
    weights["lm_head.weight"][EOS_ID] = 1.02 * weights["lm_head.weight"][first]
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return str(out_dir)


def model_pair(arch, factory, tmp_path_factory):
    if arch not in _PAIRS:
        if arch == "llama-eos":
            path = _with_likely_eos(factory("llama"), tmp_path_factory.mktemp("llama-eos"))
        else:
            path = factory(arch)
        _PAIRS[arch] = (LLM(path, dtype="float32", device="cpu"), _load_hf_model(path))
    return _PAIRS[arch]


@pytest.mark.parametrize("arch, k, max_tokens, length_penalty, early_stopping, ignore_eos", [
    ("llama-eos", 2, 8, 1.0, False, False),
    ("llama-eos", 3, 10, 0.5, True, False),
    ("llama-eos", 4, 6, 2.0, "never", False),
    ("qwen3", 3, 7, 1.0, False, True),
])
def test_beam_search_equals_hf(tiny_checkpoint_factory, tmp_path_factory, arch, k, max_tokens, length_penalty,
                               early_stopping, ignore_eos):
    llm, hf = model_pair(arch, tiny_checkpoint_factory, tmp_path_factory)
    params = BeamSearchParams(beam_width=k, max_tokens=max_tokens, length_penalty=length_penalty,
                              ignore_eos=ignore_eos, early_stopping=early_stopping)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outputs):
        expected = hf_beams(hf, prompt, k=k, max_tokens=max_tokens, length_penalty=length_penalty,
                            early_stopping=early_stopping, ignore_eos=ignore_eos)
        got = [(seq.tokens[len(prompt):], seq.score) for seq in out.sequences]
        assert [g[0] for g in got] == [e[0] for e in expected], (prompt, got, expected)
        assert [g[1] for g in got] == pytest.approx([e[1] for e in expected], abs=1e-4)
        assert all(seq.tokens[: len(prompt)] == prompt for seq in out.sequences)
    if not ignore_eos:  # some hypotheses ended with EOS: the length rules were exercised
        assert any(seq.finish_reason == "stop" for out in outputs for seq in out.sequences)


def test_beam_search_text_and_refusals(tiny_checkpoint_factory, tmp_path_factory):
    llm, _ = model_pair("qwen3", tiny_checkpoint_factory, tmp_path_factory)
    out = llm.beam_search(["Hello there"], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    prompt_len = len(tok("Hello there").input_ids)
    assert [s.text for s in out.sequences] == [tok.decode(s.tokens[prompt_len:], skip_special_tokens=True)
                                               for s in out.sequences]
    with pytest.raises(ValueError, match="beam_width=0 must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=10_000))
