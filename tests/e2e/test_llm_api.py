"""The offline LLM API: sampling semantics, n > 1, stop strings, chat, bad input, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.testing import EOS_ID


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_llama, request):
    # Every sampling semantic must hold with async scheduling (step N+1 scheduled before step
    # N's tokens are back) exactly as without it.
    return LLM(model=tiny_llama, dtype="float32", device="cpu", async_scheduling=request.param)


def tokens(out):
    return list(out.outputs[0].token_ids)


def test_text_prompts_and_output_fields(llm):
    outs = llm.generate(["Hello there", {"prompt": "The fox"}], SamplingParams(temperature=0, max_tokens=6),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello there", "The fox"]
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.prompt_token_ids == tok(o.prompt).input_ids
        c = o.outputs[0]
        assert o.finished and c.finish_reason in ("length", "stop")
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    target = {"prompt_token_ids": [11, 12, 13, 14, 15]}
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = tokens(llm.generate([target], params, use_tqdm=False)[0])
    others = [{"prompt_token_ids": [20 + i] * (3 + 5 * i)} for i in range(4)]
    mixed_params = [SamplingParams(temperature=0, max_tokens=7),
                    SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True),
                    SamplingParams(temperature=1.2, max_tokens=9, ignore_eos=True),
                    SamplingParams(temperature=0.5, seed=99, max_tokens=12, ignore_eos=True)]
    batch = others[:2] + [target] + others[2:]
    outs = llm.generate(batch, mixed_params[:2] + [params] + mixed_params[2:], use_tqdm=False)
    assert tokens(outs[2]) == alone
    assert len(alone) == 20
    # a different seed gives a different stream (with overwhelming probability over 20 tokens)
    other = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=4321, max_tokens=20, ignore_eos=True)
    assert tokens(llm.generate([target], other, use_tqdm=False)[0]) != alone


def test_n_greater_than_one(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [4, 5, 6]}], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([{"prompt_token_ids": [4, 5, 6]}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_strings_are_excluded_from_text(llm):
    prompt = "The quick brown"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    text = full[0].outputs[0].text
    stop = text[5:8]
    assert stop and stop in text
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == text[: text.index(stop) + len(stop)]


def test_eos_min_tokens_ignore_eos_and_stop_token_ids(llm):
    prompt = [{"prompt_token_ids": [9, 10, 11]}]
    force_eos = {EOS_ID: 100.0}
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, logit_bias=force_eos), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.token_ids == [EOS_ID] and c.finish_reason == "stop" and c.stop_reason is None
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, logit_bias=force_eos, min_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].token_ids[-1] == EOS_ID
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, logit_bias=force_eos, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 10 and out[0].outputs[0].finish_reason == "length"
    free = tokens(llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                               use_tqdm=False)[0])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                              stop_token_ids=[free[3]]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: free.index(free[3]) + 1] and out.stop_reason == free[3]


def test_repetition_penalty_matches_hf(llm, tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    prompt = [30, 31, 32, 30, 31, 32, 30, 31]
    for penalty in (1.0, 1.8):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=penalty,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        ours = tokens(llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=penalty), use_tqdm=False)[0])
        assert ours == ref, penalty
        if penalty == 1.0:
            plain = ours
    assert ours != plain, "the penalty should change this greedy output"


def test_streamed_generation_matches_batch_generation(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The first prompt", "and a second one"]
    batch = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    streamed = [(p, list(pieces)) for p, pieces in llm.generate_streamed(prompts, params)]
    assert [p for p, _ in streamed] == prompts
    assert ["".join(pieces) for _, pieces in streamed] == batch
    assert len(streamed[0][1]) > 1, "the first prompt's text came in one piece: not streamed"


def test_missing_chat_template_error_names_the_argument(tiny_checkpoint_factory, tmp_path):
    import shutil

    no_template = tmp_path / "no-template"
    shutil.copytree(tiny_checkpoint_factory("llama"), no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in no_template.glob("chat_template.*"):
        extra.unlink()
    llm = LLM(model=str(no_template), dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20)
    with pytest.raises(ValueError, match=r"chat_template=.*--chat-template"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hi there"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
    assert out.prompt_token_ids == list(expected)
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"temperature": -0.5}, ["temperature", "-0.5"]),
        ({"top_p": 0.0}, ["top_p", "(0, 1]"]),
        ({"top_p": 1.5}, ["top_p"]),
        ({"top_k": -2}, ["top_k"]),
        ({"max_tokens": 0}, ["max_tokens", ">= 1"]),
        ({"n": 0}, ["n="]),
        ({"repetition_penalty": 0.0}, ["repetition_penalty"]),
        # NaN passes every range comparison; infinities are no probabilities or penalties either
        *[({name: value}, [name, "finite"]) for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                                          "frequency_penalty", "repetition_penalty")
          for value in (float("nan"), float("inf"))],
        ({"logit_bias": {3: float("nan")}}, ["logit_bias", "finite"]),
    ],
)
def test_bad_sampling_params(kwargs, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_bad_prompts_name_the_problem_and_leave_the_batch_alone(llm):
    max_len = llm.vllm_config.max_model_len
    good = {"prompt_token_ids": [5, 6, 7]}
    params = SamplingParams(temperature=0, max_tokens=5)
    cases = [
        ({"prompt_token_ids": []}, params, "empty"),
        ("", params, "empty"),
        ({"prompt_token_ids": [1] * max_len}, params, "max_model_len"),
        ({"prompt_token_ids": [1] * (max_len - 3)}, params, "max_tokens"),
        ({"prompt_token_ids": [10**6]}, params, "vocabulary"),
        (good, SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ]
    for prompt, p, word in cases:
        with pytest.raises(ValueError, match=word):
            llm.generate([good, prompt], p, use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    # a failed add between steps does not disturb a request already running
    engine = llm.llm_engine
    engine.add_request("ok", good, params)
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", {"prompt_token_ids": [1] * max_len}, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["ok"]
    assert finished[0].outputs[0].token_ids == tokens(llm.generate([good], params, use_tqdm=False)[0])


def test_kv_cache_too_small_for_one_request(tiny_llama):
    with pytest.raises(ValueError) as e:
        LLM(model=tiny_llama, dtype="float32", device="cpu", num_gpu_blocks_override=3)
    msg = str(e.value)
    assert "3 blocks" in msg and "needs 32 blocks" in msg and "num_gpu_blocks_override" in msg


def test_unknown_options_and_missing_model(tiny_llama):
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(model=tiny_llama, no_such_option=1)
    with pytest.raises(ValueError, match="not a directory"):
        LLM(model="/no/such/dir")
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=tiny_llama, dtype="int7")
    with pytest.raises(ValueError, match="device"):
        LLM(model=tiny_llama, device="tpu9")


def test_dummy_weights_and_no_tokenizer(tmp_path):
    from pagedlm.core.testing import make_dummy_config_dir

    model_dir = make_dummy_config_dir(tmp_path / "cfg", "qwen3")
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, device="cpu", dtype="float32")
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=5,
                                                                          ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text"], use_tqdm=False)


def test_pickle_checkpoints_are_refused(tmp_path, tiny_llama):
    import shutil

    import torch
    from safetensors.torch import load_file

    model_dir = tmp_path / "pickled"
    shutil.copytree(tiny_llama, model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    torch.save(weights, model_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        LLM(model=str(model_dir), dtype="float32", device="cpu")
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", load_format="pt")
    assert len(llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) >= 1


def test_cli_generate(tiny_llama):
    proc = subprocess.run(
        [sys.executable, "-m", "pagedlm.core.cli", "generate", "--model", tiny_llama, "Hello world",
         "--max-tokens", "5", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--- prompt: 'Hello world'" in proc.stdout
    # streamed (the default) and --no-stream print the same greedy text
    quiet = subprocess.run(
        [sys.executable, "-m", "pagedlm.core.cli", "generate", "--model", tiny_llama, "Hello world",
         "--max-tokens", "5", "--dtype", "float32", "--no-stream"],
        capture_output=True, text=True, timeout=300,
    )
    assert quiet.returncode == 0 and quiet.stdout == proc.stdout, (quiet.stdout, proc.stdout)
    bad = subprocess.run([sys.executable, "-m", "pagedlm.core.cli", "generate", "--model", tiny_llama, "x",
                          "--temperature", "-1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "temperature" in bad.stderr and "Traceback" not in bad.stderr
    assert json.dumps  # keep import used
