"""CUDA kernels compiled for Hopper (sm_90) on a machine without a GPU: Triton's front end and the
ptxas its wheel ships, no launch. This catches what the interpreter does not check, which a GPU
run found: a helper whose constexpr branches return different types compiles under
``TRITON_INTERPRET=1`` and fails on the GPU, and inline PTX is only assembled there."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")


def _compile_for_sm90(kernel, signature: dict[str, str], constexprs: dict[str, object], num_warps: int = 4,
                      attrs: dict | None = None, num_stages: int = 3):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages})


@pytest.mark.parametrize("block_m", [1, 4])
def test_dense_gemv_prefetches_its_weights_before_the_pdl_wait(block_m):
    """The bf16 GEMV under PDL asks L2 for its first step's weights (inline PTX: Hopper's bulk
    prefetch) before it waits for the previous kernel, and only then reads activations."""
    from pagedlm.backends.cuda.kernels.dense_gemv import _dense_gemv_kernel

    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
                 "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
                 "stride_om": "i32", "k_per_split": "i32"}
    constexprs = {"HAS_BIAS": False, "SPLIT_K": 2, "EVEN_K": True, "BLOCK_M": block_m, "BLOCK_N": 4,
                  "BLOCK_K": 1024, "VEC": 8, "NUM_STAGES": 1, "USE_PDL": True, "PREFETCH": True, "THREADS": 128}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    ptx = _compile_for_sm90(_dense_gemv_kernel, signature, constexprs).asm["ptx"]
    assert "cp.async.bulk.prefetch.L2" in ptx and "griddepcontrol.wait" in ptx
    assert ptx.index("cp.async.bulk.prefetch.L2") < ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


def test_fp8_rowwise_gemm_runs_on_the_fp8_tensor_cores_for_every_tile_shape():
    """Each tile shape of the row-wise FP8 GEMM's table compiles for sm_90 to asynchronous
    warpgroup MMAs on e4m3 operands (not float32 or bf16 copies of them), pipelined through
    asynchronous copies (without the launch's divisibility of strides by 16, Triton falls back to
    byte loads and no pipeline)."""
    from pagedlm.backends.cuda.kernels.fp8_gemm import ROWWISE_TILES, _fp8_rowwise_kernel

    signature = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16",
                 "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
                 "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32", "k_per_split": "i32"}
    split_tiles = (128, 128, 128, 8, 8, 3, 2)  # cuBLASLt's tile, split along K
    for block_m, block_n, block_k, group_m, num_warps, num_stages, max_split in [
            *filter(None, ROWWISE_TILES.values()), split_tiles]:
        constexprs = {"HAS_BIAS": False, "EVEN_K": True, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                      "GROUP_M": group_m, "SPLIT_K": max_split, "ON_GPU": True, "USE_PDL": True}
        # the launch's specialisation: every pointer, size and stride but M divisible by 16
        attrs = {(list(signature).index(n),): [["tt.divisibility", 16]] for n in signature if n != "M"}
        ptx = _compile_for_sm90(_fp8_rowwise_kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")},
                                constexprs, num_warps=num_warps, attrs=attrs, num_stages=num_stages).asm["ptx"]
        assert re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx), (block_m, block_n)
        assert "cp.async" in ptx, (block_m, block_n)


def test_fp8_rowwise_gemm_takes_only_the_products_cublas_tiles_leave_sms_idle():
    """Llama-3.1-8B at 256 rows on 132 SMs: the 4096- and 6144-wide weights (64 and 96 of
    cuBLASLt's 128 x 128 tiles) take the Triton kernel, gate_up (448 tiles) and prefills keep
    cuBLASLt, as do row counts past the table."""
    from pagedlm.backends.cuda.kernels.fp8_gemm import ROWWISE_TILES, rowwise_tiles

    largest = max(ROWWISE_TILES)
    assert rowwise_tiles(largest, 4096, 4096, 132) == ROWWISE_TILES[largest]
    assert rowwise_tiles(1, 6144, 4096, 132) == ROWWISE_TILES[min(ROWWISE_TILES)]
    assert rowwise_tiles(256, 28672, 4096, 132) is None
    assert rowwise_tiles(16384, 4096, 4096, 132) is None
    assert rowwise_tiles(largest + 1, 128, 4096, 132) is None


def test_fp8_rowwise_split_tiles_take_only_the_products_they_split(monkeypatch):
    """A table entry of cuBLASLt-sized tiles split along K (256 rows, 132 SMs): o and down (64
    tiles) split in two and take the Triton kernel; q/k/v (96 tiles) would not split, so it keeps
    cuBLASLt, whose tiles are the same; a K too short for two 4-step splits keeps it too."""
    from pagedlm.backends.cuda.kernels import fp8_gemm

    split_tiles = (128, 128, 128, 8, 8, 3, 4)
    monkeypatch.setattr(fp8_gemm, "ROWWISE_TILES", {256: split_tiles})
    assert fp8_gemm.rowwise_tiles(256, 4096, 4096, 132) == split_tiles
    assert fp8_gemm.split_k(64, 14336, 128, 4, 132) == 2
    assert fp8_gemm.rowwise_tiles(256, 6144, 4096, 132) is None
    assert fp8_gemm.rowwise_tiles(256, 4096, 512, 132) is None


@pytest.mark.parametrize("has_residual", [False, True])
def test_norm_and_silu_fp8_quantization_kernels_compile_with_ieee_division(has_residual):
    """The producers fused with the FP8 activation quantization compile for sm_90 and divide by
    the scale with IEEE division (``div.rn``), as the unfused quantization and core's reference do."""
    from pagedlm.backends.cuda.kernels.norm_quant import _rms_norm_quant_kernel, _silu_and_mul_quant_kernel

    norm = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
            "sum_ptr": "*bf16", "stride_x": "i32", "stride_r": "i32", "eps": "fp32"}
    constexprs = {"N": 4096, "BLOCK": 4096, "HAS_RESIDUAL": has_residual, "USE_PDL": True}
    ptx = _compile_for_sm90(_rms_norm_quant_kernel, {**norm, **dict.fromkeys(constexprs, "constexpr")}, constexprs,
                            num_warps=8).asm["ptx"]
    assert "div.rn.f32" in ptx and "griddepcontrol.wait" in ptx
    silu = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "stride_x": "i32", "inter": "i32"}
    for block, one_pass, num_warps in ((16384, True, 16), (4096, False, 8)):
        constexprs = {"BLOCK": block, "ONE_PASS": one_pass, "USE_PDL": True}
        ptx = _compile_for_sm90(_silu_and_mul_quant_kernel, {**silu, **dict.fromkeys(constexprs, "constexpr")},
                                constexprs, num_warps=num_warps).asm["ptx"]
        assert "div.rn.f32" in ptx


#: the pointer and scalar arguments of both wna16 kernels (the decode GEMV and the GEMM)
WNA16_SIGNATURE = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "g_ptr": "*i32",
                   "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
                   "stride_xm": "i32", "stride_om": "i32", "k_per_split": "i32"}


#: the decode GEMV's extra argument: float32 2**23's bits, in a register
GEMV_SIGNATURE = {**WNA16_SIGNATURE, "magic": "i32"}
#: the decode GEMV's Llama-8B-shaped launch at one row
GEMV_CONSTEXPRS = {"GROUP_SIZE": 128, "BITS": 4, "HAS_ZEROS": False, "HAS_G_IDX": False, "SPLIT_K": 4, "BLOCK_M": 1,
                   "BLOCK_N": 64, "KW": 32, "NUM_STAGES": 1, "USE_PDL": True, "EVEN": True, "PREFETCH": False}


def _wna16_ptx(kernel, constexprs: dict[str, object], signature=WNA16_SIGNATURE) -> str:
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    return _compile_for_sm90(kernel, signature, constexprs).asm["ptx"]


def _has_integer_division(ptx: str) -> bool:
    return "div.s32" in ptx or "div.u32" in ptx or "rem." in ptx


@pytest.mark.parametrize("even, prefetch", [(True, False), (False, True)])
@pytest.mark.parametrize("bits, group_size", [(4, 128), (8, 32), (4, 4096)])
def test_wna16_gemv_finds_groups_without_an_integer_division(bits, group_size, even, prefetch):
    """The decode GEMV's group index per word row comes from a constexpr group size, so the loop
    holds no integer division (a runtime divisor cost ~38 of a step's 728 sm_90 instructions); with
    masked loads and with the register prefetch too."""
    from pagedlm.backends.cuda.kernels.wna16_gemv import _gemv_kernel

    ptx = _wna16_ptx(_gemv_kernel, {**GEMV_CONSTEXPRS, "GROUP_SIZE": group_size, "BITS": bits, "EVEN": even,
                                    "PREFETCH": prefetch}, GEMV_SIGNATURE)
    assert not _has_integer_division(ptx)


def _loop_opcodes(sass: str) -> list[str]:
    """The opcodes of the body of the kernel's one backward-branching loop (nvdisasm's text)."""
    lines = sass.splitlines()
    for end, line in enumerate(lines):
        jump = re.search(r"BRA (LBB\d+);", line)
        if jump and f"{jump.group(1)}:" in lines[:end]:
            body = lines[lines.index(f"{jump.group(1)}:") + 1:end]
            return [re.sub(r"^@!?P\w+ ", "", op.split("\t", 1)[1]).split(" ")[0].split(".")[0]
                    for op in body if "\t" in op]
    raise AssertionError("no loop in the kernel's SASS")


def test_wna16_gemv_unpacks_a_4_bit_field_in_one_logic_instruction():
    """Each field of a packed word becomes a float with one LOP3 (mask and OR with 2**23's bits),
    then one multiply-add makes it q minus the zero point and one more takes it into the sum: the
    GEMV is instruction-bound at batch 1. A constant 2**23 (two LOP3s a field), a field at bit 0 of
    a shifted word (SHF + SGXT), activations scaled per field (FMUL) and masked 16-bit loads
    (PRMT) once made the loop 728 instructions, 5.7 a field."""
    from pagedlm.backends.cuda.kernels.wna16_gemv import _gemv_kernel

    signature = {**GEMV_SIGNATURE, **dict.fromkeys(GEMV_CONSTEXPRS, "constexpr")}
    # the launch's specialisation: every pointer and size but M divisible by 16
    names = list(signature)
    kernel = _compile_for_sm90(_gemv_kernel, signature, GEMV_CONSTEXPRS, attrs={
        (names.index(n),): [["tt.divisibility", 16]] for n in WNA16_SIGNATURE if n != "M"})
    try:
        ops = _loop_opcodes(kernel.asm["sass"])
    except RuntimeError as e:  # no nvdisasm in this Triton wheel
        pytest.skip(f"no SASS: {e}")
    fields = 32 * 64 // 128 * 8  # [KW, BLOCK_N] words over 128 threads, 8 fields each
    words = fields // 8
    assert ops.count("FFMA") + ops.count("FADD") == 2 * fields + words  # + a group scale a word
    assert ops.count("FMUL") == 0
    assert ops.count("LOP3") <= fields * 1.05
    assert ops.count("SGXT") < words  # not one per word
    assert len(ops) < 4.5 * fields


@pytest.mark.parametrize("mma_layout", [False, True])
def test_wna16_gemm_finds_groups_without_an_integer_division(mma_layout):
    """The same for the GEMM that takes more than four rows (in either weight layout: the mma
    layout's word index divides K by 64, a shift)."""
    from pagedlm.backends.cuda.kernels.quant_gemm import _wna16_kernel

    ptx = _wna16_ptx(_wna16_kernel, {"GROUP_SIZE": 128, "BITS": 4, "HAS_ZEROS": True, "HAS_G_IDX": False,
                                     "SPLIT_K": 1, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32,
                                     "DOT_PRECISION": "tf32", "MMA_LAYOUT": mma_layout})
    assert "mma.sync" in ptx or "wgmma" in ptx
    assert not _has_integer_division(ptx)


def _compile_decode_attention(fp8: bool, ids_ahead: bool = False, split: bool = False,
                              config: dict[str, int] | None = None):
    """The decode launch of the paged-attention kernel at Llama-3.1-8B's heads (32 / 8, head 128,
    block 16), with the launch shape paged_attention takes by default or with ``config``
    (``split``: split-KV, the partials merged in the kernel)."""
    from pagedlm.backends.cuda.kernels.paged_attention import _paged_attention_kernel, launch_shape

    kv = "*fp8e4nv" if fp8 else "*bf16"
    signature = {"out_ptr": "*bf16", "query_ptr": "*bf16", "key_cache_ptr": kv, "value_cache_ptr": kv,
                 "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                 "req_order_ptr": "*i32", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                 "count_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "span_end_ptr": "*i32",
                 "num_reqs": "i32",
                 "num_heads": "i32", "scale": "fp32", "soft_cap": "fp32", "sliding_window": "i32", "num_splits": "i32",
                 "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32"}
    block_m, block_n, num_warps, num_stages = launch_shape(True, fp8, 4, config)
    constexprs = {"NUM_KV_HEADS": 8, "GROUP": 4, "GROUP_PAD": 4, "HEAD_SIZE": 128, "HEAD_PAD": 128, "BLOCK_SIZE": 16,
                  "BLOCK_Q": 1, "BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_KV": split, "COMBINE": split,
                  "DECODE_ONLY": True,
                  "ORDERED": True, "USE_SOFT_CAP": False, "USE_WINDOW": False, "DOT_PRECISION": "tf32",
                  "UPCAST_DOTS": False, "FP8_KV": fp8, "FP8_FP16_DOTS": False, "FP8_DECODE": fp8, "ON_GPU": True,
                  "HAS_SPANS": False, "USE_PDL": True, "IDS_AHEAD": ids_ahead}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    names = list(_paged_attention_kernel.arg_names)
    assert set(names) == set(signature)
    signature = {n: signature[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (
        "out_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr", "block_table_ptr", "stride_qt", "stride_qh",
        "stride_ot", "stride_oh", "stride_bt")}
    return _compile_for_sm90(_paged_attention_kernel, signature, constexprs, num_warps=num_warps, attrs=attrs,
                             num_stages=num_stages).asm["ptx"]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_split_decode_attention_merges_in_the_kernel(fp8):
    """A split decode launch counts its finished splits with one acquire-release atomic at GPU
    scope per program, reads the partials back past L1 (``ld.global.cg``) and resets the counter."""
    ptx = _compile_decode_attention(fp8, split=True)
    atomics = set(re.findall(r"atom\S*", ptx))
    assert atomics == {"atom.global.gpu.acq_rel.add.u32", "atom.global.gpu.acq_rel.exch.b32"}, atomics
    assert "ld.global.cg." in ptx


@pytest.mark.parametrize(("fp8", "ids_ahead"), [(True, False), (False, True)], ids=["fp8-decode", "ids-ahead"])
def test_decode_attention_keeps_two_tiles_of_copies_in_flight(fp8, ids_ahead):
    """The FP8 decode loop (and the common loop with ``IDS_AHEAD``) reads its block ids a tile
    ahead, so at 3 stages the pipeliner issues each tile's K/V copies two tiles early and waits, at
    the top of each iteration, with the next tile's two copy groups still in flight
    (``wait_group 2``). With the ids loaded in the loop it waited for every copy (``wait_group
    0``): an iteration then paid a whole memory latency. The FP8 loop's dots are float16 MMAs on
    the converted tiles. (The FP8 default is now 2 stages: one tile of copies ahead, below.)"""
    ptx = _compile_decode_attention(fp8, ids_ahead, config={"BLOCK_N": 32, "num_warps": 2, "num_stages": 3}
                                    if fp8 else None)
    waits = {int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)}
    assert 2 in waits, waits
    if fp8:
        assert set(re.findall(r"mma\.sync\.aligned\.\S+", ptx)) == {"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"}


def test_fp8_decode_attention_default_is_one_warp_streaming_its_tiles():
    """The FP8 decode default (8 rows, 16 keys, 1 warp, 2 stages: the H100's best at 256 x 768,
    2026-12-07) still copies K/V asynchronously a tile ahead and multiplies on float16 MMAs."""
    from pagedlm.backends.cuda.kernels.paged_attention import launch_shape

    assert launch_shape(True, True, 4) == (8, 16, 1, 2)
    ptx = _compile_decode_attention(True)
    assert "cp.async.cg.shared.global" in ptx or "cp.async.ca.shared.global" in ptx
    assert re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)
    assert set(re.findall(r"mma\.sync\.aligned\.\S+", ptx)) == {"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"}


@pytest.mark.parametrize("fp8", [False, True], ids=["cache16", "fp8"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_kernel_writes_the_kv_cache(fp8, qk_norm):
    """The rotary kernel with the K/V write (``WRITE_KV``) compiles for sm_90, Qwen3-0.6B's heads
    (16 + 8, head size 128): a branch on the slot stores the key and the value into the cache
    (float8 with ``FP8_KV``, through the division write_kv_fp8 compiles to) and the query is rotated
    either way."""
    from pagedlm.backends.cuda.kernels.layer_ops import _rotary_kernel

    cache = "*fp8e4nv" if fp8 else "*bf16"
    signature = {"pos_ptr": "*i64", "cos_sin_ptr": "*fp32", "q_ptr": "*bf16", "k_ptr": "*bf16", "q_out_ptr": "*bf16",
                 "k_out_ptr": cache, "stride_q": "i32", "stride_k": "i32", "num_q_heads": "i32",
                 "num_k_heads": "i32", "q_w_ptr": "*bf16", "k_w_ptr": "*bf16", "eps": "fp32", "v_ptr": "*bf16",
                 "stride_v": "i32", "v_out_ptr": cache, "slot_ptr": "*i64", "num_slots": "i32",
                 "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    constexprs = {"HEAD_SIZE": 128, "ROT_DIM": 128, "HEADS_PAD": 16, "HALF_PAD": 64, "PASS_PAD": 0, "NEOX": True,
                  "HAS_KEY": True, "QK_NORM": qk_norm, "WRITE_KV": True, "FP8_KV": fp8, "HEAD_PAD": 128,
                  "USE_PDL": True}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    ptx = _compile_for_sm90(_rotary_kernel, signature, constexprs).asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    assert len(re.findall(r"st\.global", ptx)) >= 3  # the query, the key, the value
    if fp8:  # the same float32 division instruction as write_kv_fp8's, so the same bytes
        from pagedlm.backends.cuda.kernels.kv_cache_fp8 import _write_kv_fp8_kernel

        sig = {"key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": cache, "value_cache_ptr": cache,
               "slot_mapping_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "stride_kt": "i32",
               "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32"}
        cx = {"NUM_KV_HEADS": 8, "HEAD_SIZE": 128, "HEADS_PAD": 8, "HEAD_PAD": 128, "FMAX": 448.0, "USE_PDL": True}
        sig.update(dict.fromkeys(cx, "constexpr"))
        reference = _compile_for_sm90(_write_kv_fp8_kernel, sig, cx).asm["ptx"]
        divisions = set(re.findall(r"\bdiv\.[a-z.]*f32", reference))
        assert divisions and divisions <= set(re.findall(r"\bdiv\.[a-z.]*f32", ptx))
        assert "e4m3x2" in ptx


@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_reads_its_weight_before_the_pdl_wait(has_residual):
    """The RMSNorm kernel under PDL loads its (constant) weight before ``griddepcontrol.wait``, so
    that load overlaps the previous kernel's tail, and reads the activations only after it."""
    from pagedlm.backends.cuda.kernels.layer_ops import _rms_norm_kernel

    signature = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
                 "inner": "i32", "stride_x0": "i32", "stride_x1": "i32", "stride_r": "i32", "eps": "fp32"}
    constexprs = {"N": 4096, "BLOCK": 4096, "HAS_RESIDUAL": has_residual, "USE_PDL": True}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    ptx = _compile_for_sm90(_rms_norm_kernel, signature, constexprs, num_warps=8).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    loads = [m.start() for m in re.finditer(r"ld\.global", ptx)]
    assert loads[0] < wait  # the weight
    assert any(at > wait for at in loads)  # the activations (and the residual)


def test_the_rotary_kernel_does_not_specialise_on_the_step_token_count():
    """The fused rotary + K/V write takes the step's slot count (``num_slots``) as an argument:
    specialised on its value (1, or a multiple of 16) like other integers, a step of a token count
    the start-up pass did not use compiled a variant on first launch (a GPU run of
    tests/cuda/test_kernel_precompile.py, 2026-12-07)."""
    from pagedlm.backends.cuda.kernels.layer_ops import _rotary_kernel

    assert "num_slots" in _rotary_kernel.do_not_specialize


@pytest.mark.parametrize("zeros", [False, True])
def test_the_mma_dequantize_kernel_compiles_and_reads_whole_blocks(zeros):
    """The batch path of mma-layout int4 weights (``w4a16_dequant``) compiles for sm_90, reads each
    512-byte block with 16-byte loads and writes the dense rows with 16-byte stores: its first
    version stored each value where it was unpacked, 2 bytes at a time, and wrote ~0.5 TB/s (H100)."""
    from pagedlm.backends.cuda.kernels.w4a16_dequant import _mma_dequant_kernel

    signature = {"qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*i32", "out_ptr": "*bf16", "N": "i32", "K": "i32",
                 "tile0": "i32"}
    constexprs = {"GROUP_SIZE": 128, "HAS_ZEROS": zeros, "KB": 4}
    # the launch's specialisation: pointers 16-byte aligned, K a multiple of 16 (64, in fact)
    attrs = {(list(signature).index(n),): [["tt.divisibility", 16]]
             for n in ("qw_ptr", "s_ptr", "z_ptr", "out_ptr", "K")}
    ptx = _compile_for_sm90(_mma_dequant_kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs,
                            attrs=attrs).asm["ptx"]
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "the packed words are not read 16 bytes at a time"
    assert set(re.findall(r"st\.global\S*", ptx)) == {"st.global.v4.b32"}, "the rows are not stored 16 bytes at a time"
    assert not _has_integer_division(ptx)
