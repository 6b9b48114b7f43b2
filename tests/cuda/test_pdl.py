"""Programmatic dependent launch (``kernels/launch.py``): the ``PAGEDLM_CUDA_PDL`` setting, and
(GPU only) a decode-shaped chain of the backend's kernels captured in a CUDA graph with PDL,
whose replays must equal the same chain launched serially, bit for bit. A kernel that touched
its predecessor's output before ``pdl_wait`` would read stale values there."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.cuda]


@pytest.fixture
def launch_module():
    pytest.importorskip("triton")
    from pagedlm.backends.cuda.kernels import launch

    launch.pdl_enabled.cache_clear()
    yield launch
    launch.pdl_enabled.cache_clear()


@pytest.mark.parametrize("value", ["2", "yes", ""])
def test_bad_setting_names_it(device, launch_module, monkeypatch, value):
    monkeypatch.setenv("PAGEDLM_CUDA_PDL", value)
    with pytest.raises(ValueError, match=rf"PAGEDLM_CUDA_PDL={value!r}.*allowed values are 0 .* and 1"):
        launch_module.pdl_enabled(0)


def test_off_for_cpu_tensors_and_when_disabled(device, launch_module, monkeypatch):
    assert launch_module.pdl_options(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setenv("PAGEDLM_CUDA_PDL", "0")
    assert launch_module.pdl_enabled(0) is False
    if device.type == "cuda":
        assert launch_module.pdl_options(device) == {"USE_PDL": False}


def _decode_chain(x, residual, norm_w, w_up, w_down, positions, cos_sin, w_qkv):
    """norm -> GEMV -> rotary -> norm -> GEMV -> SiLU-and-mul -> GEMV: each kernel reads the one
    before's output (the GEMVs with their L2 prefetch)."""
    from pagedlm.backends.cuda.kernels import dense_gemv, layer_ops

    cfg = dense_gemv.GemvConfig(4, 512, 1, 4, 1)
    h, res = layer_ops.fused_add_rms_norm(x, residual, norm_w, 1e-6)
    qkv = dense_gemv.dense_gemv(h, w_qkv, None, cfg)
    q, k = layer_ops.rotary_embedding(positions, qkv[:, :1024], qkv[:, 1024:1536], cos_sin, 128, 128, True)
    h2, res2 = layer_ops.fused_add_rms_norm(q[:, :1024].contiguous(), res, norm_w, 1e-6)
    up = dense_gemv.dense_gemv(h2, w_up, None, cfg)
    act = layer_ops.silu_and_mul(up)
    return dense_gemv.dense_gemv(act, w_down, None, cfg), k, res2


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and PDL need a GPU")
def test_graph_with_pdl_equals_serial_launches(device, launch_module, monkeypatch):
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    monkeypatch.setenv("PAGEDLM_CUDA_PDL", "1")
    assert launch_module.pdl_options(device) == {"USE_PDL": True, "launch_pdl": True}
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(device)

    x, residual = rand(1, 1024), rand(1, 1024)
    weights = dict(norm_w=rand(1024), w_up=rand(8192, 1024, scale=1024**-0.5),
                   w_down=rand(1024, 4096, scale=4096**-0.5), w_qkv=rand(1536, 1024, scale=1024**-0.5))
    positions = torch.tensor([7], device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, 128, 2).float() / 128))
    angles = torch.arange(64).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(device)

    _decode_chain(x, residual, positions=positions, cos_sin=cos_sin, **weights)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _decode_chain(x, residual, positions=positions, cos_sin=cos_sin, **weights)
    for step in range(3):
        x.copy_(rand(1, 1024))
        residual.copy_(rand(1, 1024))
        positions.fill_(11 + step)
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("PAGEDLM_CUDA_PDL", "0")
        launch_module.pdl_enabled.cache_clear()
        serial = _decode_chain(x, residual, positions=positions, cos_sin=cos_sin, **weights)
        torch.cuda.synchronize()
        monkeypatch.setenv("PAGEDLM_CUDA_PDL", "1")
        launch_module.pdl_enabled.cache_clear()
        for got, want in zip(outs, serial):
            assert torch.equal(got, want)
