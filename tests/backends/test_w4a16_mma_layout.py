"""The W4A16 tensor-core GEMV's weight layout (pure torch) and its CUDA source (compiled by NVRTC
where the library is installed; no GPU needed). Kernel results: tests/cuda/test_w4a16_mma.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pagedlm.core.layers.quantization.utils import pack_rows


@pytest.mark.parametrize("k, n", [(64, 16), (128, 48), (256, 32)])
def test_repack_keeps_every_value_where_the_formula_says(k, n):
    from pagedlm.backends.cuda.kernels.w4a16_mma import mma_repack, mma_unpack, mma_word_and_shift

    q = torch.randint(0, 16, (k, n), dtype=torch.int32, generator=torch.Generator().manual_seed(k + n))
    packed = mma_repack(pack_rows(q, 4))
    assert packed.shape == (k // 8, n) and packed.dtype == torch.int32
    assert torch.equal(mma_unpack(packed), q)
    word, shift = mma_word_and_shift(torch.arange(k)[:, None], torch.arange(n)[None, :], k)
    slots = (word * 8 + shift // 4).flatten()
    assert torch.equal(slots.sort().values, torch.arange(k * n))  # a bijection onto the fields


def test_a_lane_finds_its_mma_fragments_in_one_word():
    """Word ``j`` of lane ``4 g + t`` holds rows ``g``, ``g + 8`` and K offsets ``16 t + 4 j + 0..3``
    of the block, fields ``(p, p + 4)`` being fragment register ``p`` (rows g, g+8, g, g+8)."""
    from pagedlm.backends.cuda.kernels.w4a16_mma import mma_word_and_shift

    for n in range(16):
        for kk in range(64):
            word, shift = mma_word_and_shift(torch.tensor(kk), torch.tensor(n), 64)
            lane, j = int(word) // 4, int(word) % 4
            g, t = lane // 4, lane % 4
            field = int(shift) // 4
            assert g == n % 8 and kk // 16 == t and (kk // 4) % 4 == j
            p, half = field % 4, field // 4
            assert (p % 2, p // 2, half) == (n // 8, (kk // 2) % 2, kk % 2)


def _cubin(defines):
    from pagedlm.backends.cuda import nvrtc
    from pagedlm.backends.cuda.kernels import w4a16_mma

    try:
        nvrtc.nvrtc_library()
    except nvrtc.NvrtcUnavailable:
        pytest.skip("libnvrtc is not installed here (nvidia-cuda-nvrtc; CI's tests-cpu installs it)")
    return nvrtc.compile_cubin(w4a16_mma._SOURCE, "w4a16_mma_gemv", 90,
                               {"FP16": 0, "HAS_ZEROS": 0, "WARPS": 4, "STAGES": 8, "MIN_BLOCKS": 8, "GROUP_KB": 2,
                                **defines})


def _sass(cubin: bytes, tmp_path: Path) -> list[str]:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        tool = shutil.which("cuobjdump")
    assert tool, "triton's cuobjdump is missing"
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    ops = []
    for line in out.splitlines():
        words = line.split("*/", 1)[-1].split() if line.strip().startswith("/*") else []
        if words and words[0].startswith("@"):
            words = words[1:]  # a predicate
        if words and words[0][0].isalpha():
            ops.append(words[0])
    return ops


@pytest.mark.parametrize("defines", [{}, {"FP16": 1, "HAS_ZEROS": 1},
                                     {"WARPS": 1, "STAGES": 1, "MIN_BLOCKS": 32, "GROUP_KB": 0},
                                     {"WARPS": 8, "STAGES": 4, "MIN_BLOCKS": 4, "PDL": 1},
                                     {"HAS_ZEROS": 1, "GROUP_KB": 0}, {"GROUP_KB": 1}, {"GROUP_KB": 8, "HAS_ZEROS": 1},
                                     {"BULK": 1, "PDL": 1, "STAGES": 4}, {"BULK": 1, "STAGES": 1, "GROUP_KB": 0}])
def test_every_variant_compiles(defines):
    assert _cubin(defines)[:4] == b"\x7fELF"


def test_the_bulk_variant_streams_blocks_through_the_copy_engine(tmp_path):
    """``BULK``: the weight blocks arrive by bulk copies (UBLKCP, one lane a block) completing on
    mbarriers (SYNCS), with no per-lane async copy (LDGSTS) left and no register spill; without
    it, no bulk copy."""
    ops = _sass(_cubin({"BULK": 1, "PDL": 1, "STAGES": 4}), tmp_path)
    assert any(op.startswith("UBLKCP") for op in ops)
    assert any(op.startswith("SYNCS.PHASECHK") for op in ops) and any(op.startswith("SYNCS.ARRIVE") for op in ops)
    assert not any(op.startswith("LDGSTS") for op in ops)
    assert not any(op.startswith(("LDL", "STL")) for op in ops)
    assert not any(op.startswith("UBLKCP") for op in _sass(_cubin({"PDL": 1, "STAGES": 4}), tmp_path))


def test_a_block_of_64_values_a_lane_is_one_loop_step(tmp_path):
    """sm_90 SASS of the default variant (4 warps, 4 blocks in flight, group 128): the loop over K
    blocks is unrolled by the ring's 4 slots, each step waiting for its slot, re-filling it (one
    async copy) and running 8 mma on the lane's 32 values: 4 on the pairs ``128 + q`` that one
    LOP3 each makes (and a shift per pair but one), 4 taking ``128 + z`` off with the activations;
    no packed FMA. The group's end (its scales applied, those of the group two ahead requested) is
    in every second step, neither a branch nor predicated: about 2.2 instructions a value, the
    FMA GEMV's ~4.2 (docs/quantization.md)."""
    ops = _sass(_cubin({"STAGES": 4}), tmp_path)
    waits = [i for i, op in enumerate(ops) if op.startswith("DEPBAR")]
    assert len(waits) == 4
    group_end = ops[waits[1]:waits[2]]
    assert sum(op.startswith("HMMA") for op in group_end) == 8
    assert sum(op.startswith("LDGSTS") for op in group_end) == 1
    assert not any(op.startswith("HFMA2") for op in group_end)
    assert sum(op.startswith("LOP3") for op in group_end) <= 16 + 2
    assert sum(op.startswith("SHF") for op in group_end) <= 12 + 2
    assert sum(op.startswith("FFMA") for op in group_end) == 4  # the scales
    assert sum(op.startswith("BRA") for op in group_end) <= 1  # the slice's end
    assert len(group_end) < 2.5 * 32
    assert not any(op.startswith(("LDL", "STL")) for op in ops)  # no register spills
