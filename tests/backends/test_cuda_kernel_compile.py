"""CUDA kernels compiled for Hopper (sm_90) on a machine without a GPU: Triton's front end and the
ptxas its wheel ships, no launch. This catches what the interpreter does not check, which a GPU
run found: a helper whose constexpr branches return different types compiles under
``TRITON_INTERPRET=1`` and fails on the GPU, and inline PTX is only assembled there."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def _compile_for_sm90(kernel, signature: dict[str, str], constexprs: dict[str, object], num_warps: int = 4):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


@pytest.mark.parametrize("zeros", [False, True])
def test_tensor_core_gemv_compiles_for_hopper(zeros):
    """The 4-bit tensor-core GEMV with its inline-PTX unpacking: eight tensor-core dots a step, the
    fields made by LOP3 and packed bfloat16 FMAs."""
    import triton.language as tl

    from pagedlm.backends.cuda.kernels.wna16_gemv import _gemv_tc_kernel

    signature = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16",
                 "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
                 "stride_om": "i32", "group_size": "i32", "k_per_split": "i32"}
    constexprs = {"HAS_ZEROS": zeros, "SPLIT_K": 4, "BLOCK_N": 64, "KW": 16, "ASM": True, "DOT_DTYPE": tl.bfloat16,
                  "USE_PDL": True}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    ptx = _compile_for_sm90(_gemv_tc_kernel, signature, constexprs).asm["ptx"]
    assert ptx.count("mma.sync") >= 8 and ptx.count("fma.rn.bf16x2") >= 4 and "lop3.b32" in ptx
