"""Fixtures of the CUDA-backend tests.

These tests run on a GPU (marked ``cuda``; skipped without one) and, for kernel development
without a GPU, on the CPU under Triton's interpreter: ``TRITON_INTERPRET=1 pytest tests/cuda``.
In that mode the ``cuda`` mark is left off (see ``CUDA_MARK``) and tensors live on the CPU.
"""

from __future__ import annotations

import os

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_patch() -> None:
    """Triton 3.x's interpreter turns a scalar into an int with ``int(ndarray of shape (1,))``,
    which NumPy 2 refuses; loop bounds computed in a kernel (``range(lo, hi)``) need it."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "_pagedlm_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagedlm_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    interpreter_patch()


@pytest.fixture(scope="session")
def device():
    """``cuda`` on a GPU; ``cpu`` under the Triton interpreter."""
    import torch

    pytest.importorskip("triton")
    if INTERPRET:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1 for the interpreter)")
    return torch.device("cuda")


@pytest.fixture
def engine_kwargs(device, monkeypatch):
    """LLM(...) options that put the engine on the CUDA runner and the Triton backend."""
    if device.type == "cuda":
        return {"device": "cuda"}
    from pagedlm.backends.cpu.platform import CpuPlatform
    from pagedlm.backends.cuda.model_runner import CudaModelRunner

    monkeypatch.setattr(CpuPlatform, "get_model_runner_cls",
                        lambda self, cfg: "pagedlm.backends.cuda.model_runner:CudaModelRunner")
    monkeypatch.setattr(CudaModelRunner, "emulate_graphs", True)
    # few graph sizes: every emulated capture is a forward pass through the slow interpreter
    # (a 64-token budget: one mixed-batch graph)
    return {"device": "cpu", "attention_backend": "triton", "num_gpu_blocks_override": 64, "max_num_seqs": 8,
            "max_num_batched_tokens": 64}
