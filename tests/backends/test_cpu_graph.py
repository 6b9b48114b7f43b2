"""CPU graphs (pagedlm.backends.cpu.kernels.graph, model_runner.CpuModelRunner): a recorded forward
replayed on refilled inputs gives the eager forward's results, and the runner uses graphs only
where they reproduce the eager step."""

from __future__ import annotations

import pytest
import torch

from pagedlm.backends.cpu import model_runner as cpu_runner
from pagedlm.backends.cpu.kernels import gguf_ops, norm_ops
from pagedlm.backends.cpu.kernels.graph import CaptureError, CpuGraph
from pagedlm.backends.cpu.platform import cpu_graph_max_batch
from pagedlm.core import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not norm_ops.kernels_reproduce_torch(), reason="the CPU kernels do not build here")


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner


def _q8_0_weight(n: int, k: int) -> torch.Tensor:
    """Q8_0 rows (fp16 scale 2^-7, random int8 values)."""
    blocks = torch.randint(-128, 128, (n, k // 32, 34), dtype=torch.int16).to(torch.uint8)
    blocks[:, :, 0], blocks[:, :, 1] = 0x00, 0x20
    return blocks.reshape(n, -1).contiguous()


def test_replay_recomputes_kernels_and_aten_ops_from_refilled_inputs():
    """C kernels (a GGUF matmul, a norm) and aten ops (gelu, mul, add) between them: the replay on a
    new input equals running the function on it."""
    weight, norm_w = _q8_0_weight(48, 64), torch.randn(48)
    x = torch.randn(3, 64)

    def forward() -> torch.Tensor:
        h = gguf_ops.gguf_mul_mat(x, weight, 8, 48, int8_activations=False)
        h = norm_ops.gemma_rms_norm(h, norm_w, 1e-6)
        return torch.nn.functional.gelu(h, approximate="tanh") * h + x[:, :48]

    graph = CpuGraph()
    first = graph.capture(forward).clone()
    assert graph.num_calls >= 5 and torch.equal(first, forward())
    for seed in (1, 2):
        x.copy_(torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)))
        replayed = graph.replay()
        assert torch.equal(replayed, forward())
        assert not torch.equal(replayed, first)


def test_capture_refuses_a_value_read_on_the_host():
    x = torch.randn(4)
    graph = CpuGraph()
    with pytest.raises(CaptureError, match="baked into the graph"):
        graph.capture(lambda: x * float(x.sum().item()))
    assert graph.num_calls == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_steps_give_the_eager_tokens_and_logprobs(tiny_checkpoint_factory, arch):
    """Batches of 1-3 decodes (requests of different lengths finish one by one) replay graphs,
    each checked against the eager forward first; tokens and logprobs are the eager engine's."""
    path = tiny_checkpoint_factory(arch)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 9)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2) for m in (6, 12, 20)]
    results = {}
    for eager in (True, False):
        llm = LLM(model=path, device="cpu", dtype="float32", enforce_eager=eager, num_gpu_blocks_override=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[eager] = [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs]
        runner = _runner(llm)
        if eager:
            assert runner.max_graph_batch == 0 and not runner._graphs
        else:
            assert runner.graphs_off is None
            assert {b: g.verified for b, g in runner._graphs.items()} == {1: True, 2: True, 3: True}
    for (eager_ids, eager_lp), (graph_ids, graph_lp) in zip(results[True], results[False], strict=True):
        assert graph_ids == eager_ids
        for a, b in zip(eager_lp, graph_lp, strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert all(abs(x.logprob - y.logprob) == 0.0 for (_, x), (_, y) in zip(a, b, strict=True))


def test_a_replay_that_differs_from_eager_switches_graphs_off(tiny_llama, monkeypatch, caplog):
    """A graph that does not reproduce the eager forward is never used: the check at its second
    step finds it, graphs go off with a warning, and the tokens stay the eager ones."""
    prompt = {"prompt_token_ids": list(range(3, 12))}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = LLM(model=tiny_llama, device="cpu", dtype="float32", enforce_eager=True,
               num_gpu_blocks_override=32).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    replay = CpuGraph.replay
    monkeypatch.setattr(CpuGraph, "replay", lambda self: tuple(t.add_(1.0) for t in replay(self)))
    llm = LLM(model=tiny_llama, device="cpu", dtype="float32", num_gpu_blocks_override=32)
    with caplog.at_level("WARNING", logger=cpu_runner.__name__):
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    runner = _runner(llm)
    assert runner.graphs_off is not None and "differs from the eager forward" in runner.graphs_off
    assert not runner._graphs and "CPU graphs off" in caplog.text


def test_graph_batch_setting(monkeypatch):
    monkeypatch.delenv("PAGEDLM_CPU_GRAPH_MAX_BATCH", raising=False)
    assert cpu_graph_max_batch() == 4
    monkeypatch.setenv("PAGEDLM_CPU_GRAPH_MAX_BATCH", "0")
    assert cpu_graph_max_batch() == 0
    for bad in ("-1", "two"):
        monkeypatch.setenv("PAGEDLM_CPU_GRAPH_MAX_BATCH", bad)
        with pytest.raises(ValueError, match=f"PAGEDLM_CPU_GRAPH_MAX_BATCH='{bad}' must be a whole number >= 0"):
            cpu_graph_max_batch()
