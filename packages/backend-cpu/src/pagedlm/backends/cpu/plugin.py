"""pagedlm-backend-cpu's hook implementations.

NOTE: only hook implementations and class-path strings live here. The plugin module is imported
in every process that loads plugins, so the platform and attention modules are named as
``"module:Class"`` strings and imported only once the CPU platform or backend is selected.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedlm.core.plugins import hookimpl


def _always_available() -> bool:
    # Every host has a CPU; a named function (not a lambda) reads better in registry dumps.
    return True


@hookimpl
def pagedlm_register_platforms(register: Callable[..., None]) -> None:
    # Priority 0: any accelerator platform (CUDA registers 10) wins device="auto" when present.
    register("cpu", "pagedlm.backends.cpu.platform:CpuPlatform", is_available=_always_available, priority=0)


@hookimpl
def pagedlm_register_attention_backends(register: Callable[[str, str], None]) -> None:
    register("cpu_paged", "pagedlm.backends.cpu.attention:CpuPagedAttentionBackend")


@hookimpl
def pagedlm_register_ops(register: Callable[..., None]) -> None:
    # C kernels (kernels/gguf_kernels.c), compiled at first use, on GGUF blocks as stored.
    for op in ("gguf_mul_mat", "gguf_get_rows"):
        register(op, "cpu", f"pagedlm.backends.cpu.kernels.gguf_ops:{op}")
    # RMSNorm and rotary in C (kernels/norm_rope.c), rounding as core's torch code does
    for op in ("rms_norm", "fused_add_rms_norm", "gemma_rms_norm", "gemma_fused_add_rms_norm", "rotary_embedding",
               "qk_norm_rotary_embedding", "gemma_qk_norm_rotary_embedding"):
        register(op, "cpu", f"pagedlm.backends.cpu.kernels.norm_ops:{op}")
    # torch's int8 weight-only matmul (the online int8 method, compressed-tensors' W8A16 int8)
    register("int8_weight_only_gemm", "cpu", "pagedlm.backends.cpu.kernels.int8_ops:int8_weight_only_gemm")
