"""``pagedlm serve --speculative-config JSON``: requests are served with drafts verified, and
/metrics carries vLLM's speculative-decoding counters; a bad config stops the server naming the field."""

from __future__ import annotations

import json
import time

import openai
import pytest
from server_harness import API_KEY
from test_server_metrics import samples, value

pytestmark = pytest.mark.timeout(300)


def test_serve_with_speculation_exports_acceptance_counters(start_server, tiny_llama):
    spec = {"model": tiny_llama, "num_speculative_tokens": 3}  # a model without method: a draft model
    server = start_server(tiny_llama, "--max-model-len", "256", "--served-model-name", "tiny-llama",
                          "--speculative-config", json.dumps(spec))
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        reply = client.completions.create(model="tiny-llama", prompt="speculate on this", max_tokens=12,
                                          temperature=0.0)
    assert reply.usage.completion_tokens == 12 or reply.choices[0].finish_reason == "stop"
    snap = samples(server)
    drafts = value(snap, "pagedlm:spec_decode_num_drafts_total")
    draft_tokens = value(snap, "pagedlm:spec_decode_num_draft_tokens_total")
    accepted = value(snap, "pagedlm:spec_decode_num_accepted_tokens_total")
    per_pos = [value(snap, "pagedlm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)]
    assert drafts > 0 and 0 < accepted <= draft_tokens and sum(per_pos) == accepted
    deadline = time.monotonic() + 30  # the periodic stats log (--log-stats-interval 1) reports them too
    while "SpecDecoding metrics:" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "SpecDecoding metrics: Mean acceptance length" in server.log()


def test_bad_speculative_config_stops_the_server_naming_the_field(start_server, tiny_llama):
    server = start_server(tiny_llama, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}',
                          wait=False)
    assert server.proc.wait(120) != 0
    server.stop()
    assert "speculative_config.num_speculative_tokens=0 is invalid" in server.log()
    assert "Traceback" not in server.log()
