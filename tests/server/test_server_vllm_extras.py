"""vLLM's request and response extras that its clients use: prompt_logprobs, truncate_prompt_tokens,
logprobs=-1 (the whole vocabulary, within --max-logprobs), and the fields vLLM always sends
(null unless they have a value): stop_reason, prompt_logprobs, message.reasoning.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
import torch

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "Say something"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, headers=server.headers, timeout=60)


def tokenize(server, prompt: str) -> list[int]:
    return post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]


def check_prompt_logprobs(entries: list, prompt_ids: list[int], k: int) -> None:
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for tid, position in zip(prompt_ids[1:], entries[1:]):
        assert str(tid) in position, (tid, position)  # the prompt's own token, whatever its rank
        ranks = sorted(e["rank"] for e in position.values())
        assert set(range(1, k + 1)) <= set(ranks) and len(position) in (k, k + 1)
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in position.values())


def test_prompt_logprobs(server, openai_schemas):
    prompt = "The quick brown fox jumps"
    ids = tokenize(server, prompt)
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    openai_schemas.validate("CreateCompletionResponse", r.json())
    check_prompt_logprobs(r.json()["choices"][0]["prompt_logprobs"], ids, 3)
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    openai_schemas.validate("CreateChatCompletionResponse", chat.json())
    rendered = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    check_prompt_logprobs(chat.json()["prompt_logprobs"], rendered, 0)
    for path, body in (("/v1/completions", {"prompt": prompt}), ("/v1/chat/completions", {"messages": CHAT})):
        streamed = post(server, path, {**body, "prompt_logprobs": 1, "stream": True})
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs", streamed.text
        negative = post(server, path, {**body, "prompt_logprobs": -2})
        assert negative.status_code == 400 and negative.json()["error"]["param"] == "prompt_logprobs"


def test_minus_one_logprobs_is_the_vocabulary_within_max_logprobs(server, flagged_server):
    for body, param in (({"prompt": "hi", "logprobs": -1}, "logprobs"),
                        ({"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs")):
        r = post(server, "/v1/completions", {**body, "max_tokens": 1})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "--max-logprobs" in error["message"] and "at most 20" in error["message"]
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "logprobs": True,
                                              "top_logprobs": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 21}).status_code == 400
    # --max-logprobs -1: the whole vocabulary
    r = post(flagged_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": True,
                                                      "top_logprobs": -1})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    vocab = len(content[0]["top_logprobs"])
    assert vocab >= 256 and all(len(c["top_logprobs"]) == vocab for c in content)
    r = post(flagged_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": -1})
    # (the legacy object keys alternatives by their text, and byte tokens share one: fewer keys)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) > 20


def test_truncate_prompt_tokens(server):
    prompt = "one two three four five six seven eight nine ten"
    ids = tokenize(server, prompt)
    assert len(ids) > 6
    base = {"prompt": prompt, "max_tokens": 1, "return_token_ids": True}
    for side, expected in (("left", ids[-4:]), ("right", ids[:4])):
        r = post(server, "/v1/completions", {**base, "truncate_prompt_tokens": 4, "truncation_side": side})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["prompt_token_ids"] == expected and r.json()["usage"]["prompt_tokens"] == 4
    # not longer than the prompt: the prompt as it is; -1: max_model_len - 1
    for keep in (len(ids), 100, -1):
        r = post(server, "/v1/completions", {**base, "truncate_prompt_tokens": keep})
        assert r.json()["choices"][0]["prompt_token_ids"] == ids, keep
    r = post(server, "/v1/completions", {**base, "prompt": [5] * 600, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 511, r.text
    too_many = post(server, "/v1/completions", {**base, "truncate_prompt_tokens": 513})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "truncate_prompt_tokens"
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "return_token_ids": True,
                                                 "truncate_prompt_tokens": 3, "truncation_side": "left"})
    rendered = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert chat.status_code == 200 and chat.json()["prompt_token_ids"] == rendered[-3:], chat.text


def test_fields_vllm_always_sends(server, openai_schemas):
    out = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 3}).json()
    choice = out["choices"][0]
    assert {"stop_reason", "prompt_logprobs", "prompt_token_ids", "token_ids"} <= set(choice)
    assert choice["stop_reason"] is None and choice["prompt_logprobs"] is None
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3}).json()
    openai_schemas.validate("CreateChatCompletionResponse", chat)
    message = chat["choices"][0]["message"]
    assert "reasoning" in message and message["reasoning"] is None
    assert "reasoning_content" in message and message["reasoning_content"] is None
    assert chat["choices"][0]["stop_reason"] is None and chat["prompt_logprobs"] is None
    # stop_reason: the stop string that ended the text
    text = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 12, "temperature": 0,
                                            "ignore_eos": True}).json()["choices"][0]["text"]
    stop = text[3:5]
    if stop.strip():
        stopped = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 12, "temperature": 0,
                                                   "stop": [stop]}).json()["choices"][0]
        assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop, stopped


def test_batch_chat_completions(server, client, openai_schemas):
    conversations = [[{"role": "user", "content": "Hello"}], [{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": "Hi there"}]]
    r = post(server, "/v1/chat/completions/batch", {"messages": conversations, "max_tokens": 5, "temperature": 0,
                                                    "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    openai_schemas.validate("CreateChatCompletionResponse", body)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for conversation, choice in zip(conversations, body["choices"]):
        single = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=5, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert choice["message"]["content"] == single.choices[0].message.content
        assert len(choice["token_ids"]) == 5
    prompt_tokens = sum(post(server, "/tokenize", {"messages": c}).json()["count"] for c in conversations)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 10,
                             "total_tokens": prompt_tokens + 10}
    for extra, param in (({"stream": True}, "stream"), ({"n": 2}, "n")):
        bad = post(server, "/v1/chat/completions/batch", {"messages": conversations, **extra})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    empty = post(server, "/v1/chat/completions/batch", {"messages": [conversations[0], []]})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages[1]", empty.text
    bad_role = post(server, "/v1/chat/completions/batch", {"messages": [[{"role": "x", "content": "hi"}]]})
    assert bad_role.status_code == 400 and bad_role.json()["error"]["param"] == "messages[0][0].role", bad_role.text


def _b64(obj) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_prompt_embeds_on_completions(server, flagged_server, tiny_llama):
    """vLLM's prompt_embeds: the model's own input embeddings of some ids give those ids' text,
    alone, beside text prompts (embeddings first), streamed, and through the openai client."""
    from openai import OpenAI
    from transformers import AutoModelForCausalLM

    ids = tokenize(flagged_server, "The quick brown fox")
    with torch.no_grad():
        embeds = AutoModelForCausalLM.from_pretrained(tiny_llama).get_input_embeddings()(torch.tensor(ids))
    greedy = {"max_tokens": 6, "temperature": 0}
    by_ids = post(flagged_server, "/v1/completions", {"prompt": ids, **greedy}).json()
    r = post(flagged_server, "/v1/completions", {"prompt_embeds": _b64(embeds), **greedy})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == by_ids["choices"][0]["text"]
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    both = post(flagged_server, "/v1/completions", {"prompt": ids, "prompt_embeds": [_b64(embeds), _b64(embeds[None])],
                                                    "return_token_ids": True, **greedy}).json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2] and both["usage"]["prompt_tokens"] == 3 * len(ids)
    assert {c["text"] for c in both["choices"]} == {by_ids["choices"][0]["text"]}
    assert both["choices"][0]["prompt_token_ids"] is None and both["choices"][2]["prompt_token_ids"] == ids
    streamed = post(flagged_server, "/v1/completions", {"prompt_embeds": _b64(embeds), "stream": True, **greedy})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == by_ids["choices"][0]["text"]
    client = OpenAI(base_url=flagged_server.url + "/v1", api_key=flagged_server.api_key)
    out = client.completions.create(model=MODEL, prompt=None, extra_body={"prompt_embeds": _b64(embeds)}, **greedy)
    assert out.choices[0].text == by_ids["choices"][0]["text"]


@pytest.mark.parametrize("payload, needle", [
    ("not base64!", "not valid base64"),
    (base64.b64encode(b"garbage").decode(), "not a tensor saved with torch.save"),
    (_b64({"a": 1}), "holds a dict"),
    (_b64(torch.zeros(3, 5)), "hidden_size"),
    (_b64(torch.zeros(3, 64, dtype=torch.int64)), "dtype torch.int64"),
    (_b64(torch.zeros(3, 64).to_sparse()), "only dense tensors"),
])
def test_bad_prompt_embeds_are_400s_naming_them(flagged_server, payload, needle):
    r = post(flagged_server, "/v1/completions", {"prompt_embeds": [payload], "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_embeds[0]" and needle in error["message"], error


def test_prompt_embeds_need_the_flag(server):
    r = post(server, "/v1/completions", {"prompt_embeds": _b64(torch.zeros(2, 64)), "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_embeds" and "--enable-prompt-embeds" in error["message"]
    r = post(server, "/v1/completions", {"max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_chat_echo_continue_final_message_and_tokens_as_ids(server):
    saying = "An apple a day keeps"
    messages = [{"role": "user", "content": "a saying?"}, {"role": "assistant", "content": saying}]
    body = {"messages": messages, "max_tokens": 4, "add_generation_prompt": False,
            "continue_final_message": True, "return_token_ids": True}
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"].startswith(saying), echoed
    plain = post(server, "/v1/chat/completions", body).json()
    assert not plain["choices"][0]["message"]["content"].startswith(saying)
    # the prompt ends inside the last message: no end-of-turn after the saying
    rendered = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                          "continue_final_message": True},
                          headers=server.headers).json()["tokens"]
    assert plain["prompt_token_ids"] == rendered
    assert post(server, "/detokenize", {"tokens": rendered}).json()["prompt"].endswith(saying)
    both = post(server, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message", both.text
    # streamed echo: after the role chunk, a chunk with the saying
    import json as _json

    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                      json={"model": MODEL, **body, "echo": True, "stream": True}) as r:
        events = [_json.loads(e[6:]) for e in r.read().decode().split("\n\n") if e.startswith("data: {")]
    assert events[1]["choices"][0]["delta"] == {"content": saying}
    # return_tokens_as_token_ids: logprob tokens as token_id:<id>
    lp = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
                                               "return_tokens_as_token_ids": True, "return_token_ids": True}).json()
    content = lp["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in lp["choices"][0]["token_ids"]]
    cmpl = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 1,
                                            "return_tokens_as_token_ids": True}).json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in cmpl["tokens"])
    # tokenize a chat with the tokenizer's own specials (BOS) added
    special = httpx.post(server.url + "/tokenize", json={"messages": CHAT, "add_special_tokens": True},
                         headers=server.headers).json()["tokens"]
    without = httpx.post(server.url + "/tokenize", json={"messages": CHAT}, headers=server.headers).json()["tokens"]
    assert len(special) >= len(without)


def test_beam_search_equals_offline_beam_search(server, tiny_llama, openai_schemas):
    from pagedlm.core import LLM, BeamSearchParams

    body = {"prompt": [1, 17, 42, 99, 7], "n": 3, "max_tokens": 6, "use_beam_search": True, "length_penalty": 0.5,
            "return_token_ids": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    openai_schemas.validate("CreateCompletionResponse", r.json())
    offline = LLM(tiny_llama, dtype="float32", device="cpu", num_gpu_blocks_override=256).beam_search(
        [{"prompt_token_ids": body["prompt"]}], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))[0]
    assert [c["token_ids"] for c in r.json()["choices"]] == [s.tokens[5:] for s in offline.sequences]
    assert [c["text"] for c in r.json()["choices"]] == [s.text for s in offline.sequences]
    for bad, param in (({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs")):
        r = post(server, "/v1/completions", {**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search", r.text
    ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "use_beam_search": False})
    assert ok.status_code == 200, ok.text


def test_tokenize_renders_tools_and_template_kwargs_as_chat_does(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "tools": tools, "tool_choice": "none",
                                                 "max_tokens": 1, "return_token_ids": True}).json()
    with_tools = post(server, "/tokenize", {"messages": CHAT, "tools": tools}).json()["tokens"]
    assert with_tools == chat["prompt_token_ids"]
    assert "get_weather" in post(server, "/detokenize", {"tokens": with_tools}).json()["prompt"]
    assert with_tools != post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    kwargs = post(server, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs.status_code == 200, kwargs.text
    for body, param in [({"prompt": "hi", "tools": tools}, "tools"),
                        ({"prompt": "hi", "chat_template_kwargs": {}}, "chat_template_kwargs"),
                        ({"messages": CHAT, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
                        ({"messages": CHAT, "tools": tools * 2}, "tools")]:
        r = post(server, "/tokenize", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_allowed_token_ids_and_logprob_token_ids(server, tiny_llama):
    allowed, asked = [17, 99, 230], [3, 300]
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 6, "ignore_eos": True, "return_token_ids": True,
                                         "allowed_token_ids": allowed, "logprobs": 0,
                                         "logprob_token_ids": asked, "return_tokens_as_token_ids": True}).json()
    choice = r["choices"][0]
    assert set(choice["token_ids"]) <= set(allowed), choice
    for tid, top in zip(choice["token_ids"], choice["logprobs"]["top_logprobs"], strict=True):
        assert set(top) == {f"token_id:{t}" for t in (tid, *asked)}
    events = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                      json={"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True, "logprobs": True,
                            "top_logprobs": 1, "logprob_token_ids": asked, "return_tokens_as_token_ids": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    content = [c for e in events for ch in e["choices"] if ch.get("logprobs") for c in ch["logprobs"]["content"]]
    assert len(content) == 3
    for entry in content:
        assert [t["token"] for t in entry["top_logprobs"]][1:] == [f"token_id:{t}" for t in asked]
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    with open(f"{tiny_llama}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    for body, param in [({"logprob_token_ids": [3]}, "logprob_token_ids"),
                        ({"logprobs": 1, "logprob_token_ids": list(range(21))}, "logprob_token_ids"),
                        ({"logprobs": 1, "logprob_token_ids": [vocab + 5]}, "logprob_token_ids"),
                        ({"allowed_token_ids": [1, vocab]}, "allowed_token_ids"),
                        ({"allowed_token_ids": [1.5]}, "allowed_token_ids")]:
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == 400, (body, r.text)
        assert param in (r.json()["error"]["param"] or r.json()["error"]["message"]), (body, r.text)
