"""Tiny mixture-of-experts checkpoints with quantized experts, made with the compressed-tensors
package, and HF's reference on the same weights decompressed.

transformers 5 stores a MoE block's experts as fused 3-D parameters, not ``nn.Linear`` modules,
so compressed-tensors' model-level flow (``apply_quantization_config``) does not reach them. The
per-expert checkpoint tensors are quantized here one module at a time with the package's own
pieces instead: ``calculate_qparams`` on the weight's min/max (per group, channel or tensor), the
format's compressor (``PackedQuantizationCompressor`` / ``FloatQuantizationCompressor``:
``compress`` and ``decompress``), and its ``QuantizationConfig`` for ``config.json``. By default
only the experts are quantized (the config group targets ``experts.N.<projection>``); the
reference checkpoint holds the decompressed tensors in float32 and the rest unchanged.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pagedlm.core.testing.quantized import _copy_side_files, weight_qparams

__all__ = ["ALL_PROJECTIONS", "EXPERT_TARGET", "make_quantized_experts_checkpoint"]

#: the config group's target: every expert projection of Qwen-MoE (gate/up/down_proj) and Mixtral (w1/w2/w3)
EXPERT_TARGET = r"re:.*experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$"
#: the experts and the attention projections (what ``quantization="fp8"`` quantizes in these models)
ALL_PROJECTIONS = r"re:.*(experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)|self_attn\.[qkvo]_proj)$"


def _scheme(preset: str, group_size: int | None, strategy: str | None, target: str) -> Any:
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, [target])
    if strategy is not None:
        scheme.weights.strategy = strategy
        if strategy != "group":
            scheme.weights.group_size = None
    if group_size is not None and scheme.weights.strategy == "group":
        scheme.weights.group_size = group_size
    return scheme


def make_quantized_experts_checkpoint(src: str, out_dir: str | Path, preset: str, *, group_size: int | None = None,
                                      strategy: str | None = None, targets: str = EXPERT_TARGET,
                                      reference_dir: str | Path | None = None) -> tuple[str, str]:
    """Quantize the experts of the tiny MoE checkpoint ``src`` with compressed-tensors preset
    ``preset`` (``"W4A16"``, ``"W4A16_ASYM"``, ``"W8A16"``, ``"FP8_DYNAMIC"``; ``group_size`` and
    ``strategy`` (``"group"``, ``"channel"``, ``"tensor"``) override the preset's; ``targets``: the
    modules quantized, the experts by default, :data:`ALL_PROJECTIONS`) into ``out_dir``.
    Returns ``(out_dir, reference_dir)``: the reference holds the experts decompressed by
    compressed-tensors in float32 (default ``out_dir`` + ``-dequantized``)."""
    import torch
    from compressed_tensors.compressors import FloatQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from safetensors.torch import save_file

    from pagedlm.core.model_loader.weight_utils import find_weight_files, safetensors_weights_iterator

    src_dir, out = Path(src), Path(out_dir)
    reference = Path(reference_dir) if reference_dir else out.with_name(out.name + "-dequantized")
    scheme = _scheme(preset, group_size, strategy, targets)
    fmt = "float-quantized" if scheme.weights.type == "float" else "pack-quantized"
    compressor: Any = FloatQuantizationCompressor if fmt == "float-quantized" else PackedQuantizationCompressor
    pattern = re.compile(targets[3:])
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in safetensors_weights_iterator(find_weight_files(str(src_dir), "auto")):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or not pattern.match(module):
            quantized[name] = dequantized[name] = tensor
            continue
        w = tensor.float()
        scale, zero_point = weight_qparams(w, scheme.weights)
        local = {"weight": w, "weight_scale": scale.to(tensor.dtype), "weight_zero_point": zero_point}
        packed = {k: v for k, v in compressor.compress(local, scheme).items() if v is not None}
        for key, value in packed.items():
            quantized[f"{module}.{key}"] = value
        dequantized[name] = compressor.decompress(dict(packed), scheme)["weight"].to(torch.float32)
    config = json.loads((src_dir / "config.json").read_text())
    qconfig = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=fmt,
                                 quantization_status=QuantizationStatus.COMPRESSED)
    quantized_config = {**config, "quantization_config": {**qconfig.model_dump(mode="json"),
                                                          "quant_method": "compressed-tensors"}}
    for path, tensors, cfg in ((out, quantized, quantized_config), (reference, dequantized, config)):
        path.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        _copy_side_files(src_dir, path)
    return str(out), str(reference)
