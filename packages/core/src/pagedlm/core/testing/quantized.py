"""Quantized tiny checkpoints for tests: compressed-tensors (through the real library), GPTQ, AWQ.

``make_compressed_tensors_checkpoint`` quantizes a tiny HF checkpoint with the
``compressed-tensors`` package itself (its preset schemes, ``apply_quantization_config``, its
``calculate_qparams`` on min/max observations, ``ModelCompressor`` to pack and write the config):
the files are what llm-compressor writes, minus the calibration algorithms (GPTQ/SmoothQuant),
which change the values but not the format. HF transformers loads them through the same package.

GPTQ and AWQ checkpoints are packed here by their formats' specification (AutoGPTQ's and
AutoAWQ's packing), because their producing libraries (gptqmodel, autoawq) need CUDA builds;
rounding is plain round-to-nearest. Each of these also writes ``reference_dir``: the same model
with the dequantized weights in full precision, HF's reference (transformers reads GPTQ/AWQ only
through optimum + gptqmodel / autoawq).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weight_qparams(w: Any, args: Any) -> tuple[Any, Any]:
    """compressed-tensors' ``(scale, zero_point)`` of weight ``w [N, K]`` for its quantization
    ``args``: from the min/max per group, per output channel or over the tensor."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    if args.strategy == "group":
        g = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        b = w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
        lo, hi = b.amin((1, 3)), b.amax((1, 3))
    elif args.strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    return calculate_qparams(lo, hi, args)


def _copy_side_files(src: Path, out: Path) -> None:
    for name in _COPIED:
        if (src / name).exists():
            shutil.copy(src / name, out / name)


def _load_hf(src: str | os.PathLike[str]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    return auto.from_pretrained(str(src), dtype=torch.float32).eval()


def _calibrate_input_amax(model: Any, vocab_size: int, seed: int) -> dict[str, float]:
    """``amax(|input|)`` of every linear layer's input over a few random prompts (static scales)."""
    import torch

    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in _LINEARS:
            def hook(mod: Any, args: Any, _name: str = name) -> None:
                amax[_name] = max(amax.get(_name, 0.0), float(args[0].detach().abs().amax()))
            hooks.append(module.register_forward_pre_hook(hook))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model(input_ids=torch.randint(4, vocab_size, (4, 48), generator=gen))
    for h in hooks:
        h.remove()
    return amax


def make_compressed_tensors_checkpoint(src: str | os.PathLike[str], out_dir: str | os.PathLike[str], scheme: str, *,
                                       group_size: int | None = None, ignore: tuple[str, ...] = ("lm_head",),
                                       targets: tuple[str, ...] = ("Linear",), seed: int = 0) -> str:
    """Quantize the HF checkpoint ``src`` with compressed-tensors preset ``scheme`` (``"W4A16"``,
    ``"W4A16_ASYM"``, ``"W8A16"``, ``"W8A8"`` (int8), ``"FP8"`` (static per-tensor),
    ``"FP8_DYNAMIC"``) into ``out_dir``; ``group_size`` overrides the preset's (128) for narrow
    tiny models; ``-1`` makes the weights per channel. ``targets`` are the scheme's module classes
    or name patterns (``("Linear", "Embedding")`` packs the token embedding too). Static activation
    scales are calibrated on random prompts. Returns ``out_dir``."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    src, out = Path(src), Path(out_dir)
    model = _load_hf(src)
    qscheme = preset_name_to_scheme(scheme, list(targets))
    if group_size is not None and qscheme.weights is not None and qscheme.weights.group_size is not None:
        if group_size == -1:
            qscheme.weights.strategy = "channel"
            qscheme.weights.group_size = None
        else:
            qscheme.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": qscheme}, ignore=list(ignore),
                                quantization_status=QuantizationStatus.INITIALIZED)
    acts = qscheme.input_activations
    input_amax = (_calibrate_input_amax(model, model.config.vocab_size, seed)
                  if acts is not None and not acts.dynamic else {})
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for name, module in model.named_modules():
            s = getattr(module, "quantization_scheme", None)
            if s is None:
                continue
            scale, zero_point = weight_qparams(module.weight.data, s.weights)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
            if name in input_amax and hasattr(module, "input_scale"):
                a = torch.tensor([input_amax[name]])
                in_scale, _ = calculate_qparams(-a, a, acts)
                module.input_scale.data.copy_(in_scale.reshape(module.input_scale.shape))
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    _copy_side_files(src, out)
    return str(out)


# -- GPTQ and AWQ, packed by the formats' specification ------------------------------------------


def _rtn_groups(w: Any, bits: int, group_size: int, sym: bool, g_idx: Any) -> tuple[Any, Any, Any]:
    """Round-to-nearest ``w [N, K]`` by input groups: ``(q [K, N] unsigned, scales [G, N], zeros [G, N])``."""
    import torch

    n, k = w.shape
    wt = w.t().float()  # [K, N]
    num_groups = int(g_idx.max()) + 1
    qmax = (1 << bits) - 1
    scales = torch.empty(num_groups, n)
    zeros = torch.empty(num_groups, n, dtype=torch.int64)
    for g in range(num_groups):
        rows = wt[g_idx == g]
        lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
        if sym:
            s = torch.maximum(hi.abs(), lo.abs()) * 2 / qmax
            z = torch.full((n,), (qmax + 1) // 2, dtype=torch.int64)
        else:
            s = (hi - lo) / qmax
            z = torch.round(-lo / s.clamp(min=1e-10)).to(torch.int64).clamp(0, qmax)
        scales[g] = s.clamp(min=1e-10)
        zeros[g] = z
    gi = g_idx.to(torch.int64)
    q = torch.round(wt / scales[gi] + zeros[gi]).clamp(0, qmax).to(torch.int64)
    return q, scales, zeros


def _write_quantized(src: Path, out: Path, tensors: dict[str, Any], quantization_config: dict[str, Any],
                     reference: Path | None = None, dequantized: dict[str, Any] | None = None) -> None:
    """``out``: ``src`` with the ``weight`` of every module named in ``tensors`` replaced by those
    tensors; ``reference`` (with ``dequantized``): ``src`` with those modules' dequantized weights."""
    import torch
    from safetensors.torch import save_file

    from pagedlm.core.model_loader.weight_utils import find_weight_files, safetensors_weights_iterator

    base = dict(safetensors_weights_iterator(find_weight_files(str(src), "auto")))
    out.mkdir(parents=True, exist_ok=True)
    quantized_names = {name.rsplit(".", 1)[0] for name in tensors}
    plain = {n: t for n, t in base.items() if n.rsplit(".", 1)[0] not in quantized_names or not n.endswith(".weight")}
    save_file({**plain, **{n: t.contiguous() for n, t in tensors.items()}}, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if reference is not None and dequantized is not None:
        reference.mkdir(parents=True, exist_ok=True)
        save_file({**plain, **{n: t.to(torch.float32).contiguous() for n, t in dequantized.items()}},
                  str(reference / "model.safetensors"))
        (reference / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        _copy_side_files(src, reference)
    config["quantization_config"] = quantization_config
    # NOTE: keys in the order given: GPTQ's ``dynamic`` patterns apply first match first
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(src, out)


def _linear_weights(src: Path, lm_head: bool = False) -> dict[str, Any]:
    """The checkpoint's linear layers (and with ``lm_head`` its untied LM head) by module name."""
    from pagedlm.core.model_loader.weight_utils import find_weight_files, safetensors_weights_iterator

    tensors = dict(safetensors_weights_iterator(find_weight_files(str(src), "auto")))
    if lm_head and "lm_head.weight" not in tensors:
        raise ValueError(f"{src} has no lm_head.weight (tied embeddings): its head cannot be quantized apart")
    return {n[: -len(".weight")]: t for n, t in tensors.items()
            if n.endswith(".weight") and (n.rsplit(".", 2)[-2] in _LINEARS or (lm_head and n == "lm_head.weight"))}


def make_gptq_checkpoint(src: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, bits: int = 4,
                         group_size: int = 128, desc_act: bool = False, sym: bool = True, seed: int = 0,
                         lm_head: bool = False, dynamic: dict[str, dict[str, Any]] | None = None,
                         reference_dir: str | os.PathLike[str] | None = None) -> tuple[str, str]:
    """GPTQ (AutoGPTQ ``gptq`` format: ``qzeros`` hold zero - 1) of ``src``; with ``desc_act`` the
    input rows are visited in a random order, so ``g_idx`` scatters groups; ``lm_head`` quantizes
    the (untied) LM head too (``"lm_head": true``, as GPTQModel and AutoRound write it);
    ``dynamic`` (GPTQModel's per-module overrides, written to the config too): the first pattern
    matching a module name gives its ``bits`` / ``group_size`` / ``sym``, or with ``-:`` leaves it
    in full precision. Returns ``(out_dir, reference_dir)`` (default ``out_dir + "-dequantized"``)."""
    import re

    import torch

    from pagedlm.core.layers.quantization.utils import pack_cols, pack_rows

    src, out = Path(src), Path(out_dir)
    reference = Path(reference_dir) if reference_dir else out.with_name(out.name + "-dequantized")
    tensors: dict[str, Any] = {}
    dequantized: dict[str, Any] = {}
    perms: dict[str, Any] = {}
    defaults = {"bits": bits, "group_size": group_size, "sym": sym}
    for name, w in _linear_weights(src, lm_head).items():
        rule = next(((p, o) for p, o in (dynamic or {}).items() if re.match(p.removeprefix("-:").removeprefix("+:"),
                                                                              name)), None)
        if rule is not None and rule[0].startswith("-:"):
            continue  # stays in full precision, in both directories
        fields = {**defaults, **(rule[1] if rule else {})}
        bits, group_size, sym = fields["bits"], fields["group_size"], fields["sym"]
        k = w.shape[1]
        g = group_size if group_size != -1 else k
        if desc_act:
            # GPTQ orders rows by its Hessian of the layer's input, so layers reading one input
            # (q/k/v, gate/up) share one order and one g_idx (fused layers rely on it)
            head, _, proj = name.rpartition(".")
            key = f"{head}.{'qkv' if proj in ('q_proj', 'k_proj', 'v_proj') else 'gu' if proj != 'down_proj' else proj}"
            if key not in perms:
                perms[key] = torch.randperm(k, generator=torch.Generator().manual_seed(seed + len(perms)))
            perm = perms[key]
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
        else:
            g_idx = (torch.arange(k) // g).to(torch.int32)
        q, scales, zeros = _rtn_groups(w, bits, g, sym, g_idx)
        gi = g_idx.to(torch.int64)
        tensors[f"{name}.qweight"] = pack_rows(q, bits)
        tensors[f"{name}.qzeros"] = pack_cols((zeros - 1) & ((1 << bits) - 1), bits)
        tensors[f"{name}.scales"] = scales.to(torch.float16)
        tensors[f"{name}.g_idx"] = g_idx
        dequantized[f"{name}.weight"] = ((q - zeros[gi]).float() * scales.to(torch.float16).float()[gi]).t()
    _write_quantized(src, out, tensors, {
        "quant_method": "gptq", **defaults, "desc_act": desc_act, "checkpoint_format": "gptq", "damp_percent": 0.01,
        "true_sequential": True, "static_groups": False, "lm_head": lm_head,
        **({"dynamic": dynamic} if dynamic else {}),
    }, reference, dequantized)
    return str(out), str(reference)


def make_awq_checkpoint(src: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, group_size: int = 128,
                        lm_head: bool = False,
                        reference_dir: str | os.PathLike[str] | None = None) -> tuple[str, str]:
    """AWQ (AutoAWQ's GEMM layout, 4-bit with zero points) of ``src``; ``lm_head`` quantizes the
    (untied) LM head too (``"lm_head": true``). Returns ``(out_dir, reference_dir)``."""
    import torch

    from pagedlm.core.layers.quantization.utils import AWQ_PACK_ORDER, pack_cols

    src, out = Path(src), Path(out_dir)
    reference = Path(reference_dir) if reference_dir else out.with_name(out.name + "-dequantized")
    tensors: dict[str, Any] = {}
    dequantized: dict[str, Any] = {}
    for name, w in _linear_weights(src, lm_head).items():
        k = w.shape[1]
        g = group_size if group_size != -1 else k
        g_idx = (torch.arange(k) // g).to(torch.int32)
        q, scales, zeros = _rtn_groups(w, 4, g, False, g_idx)
        gi = g_idx.to(torch.int64)
        tensors[f"{name}.qweight"] = pack_cols(q, 4, order=AWQ_PACK_ORDER)
        tensors[f"{name}.qzeros"] = pack_cols(zeros, 4, order=AWQ_PACK_ORDER)
        tensors[f"{name}.scales"] = scales.to(torch.float16)
        dequantized[f"{name}.weight"] = ((q - zeros[gi]).float() * scales.to(torch.float16).float()[gi]).t()
    _write_quantized(src, out, tensors, {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None, "lm_head": lm_head,
    }, reference, dequantized)
    return str(out), str(reference)


def make_fp8_block_checkpoint(src: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                              block_size: tuple[int, int] = (128, 128)) -> str:
    """Block-wise FP8 (``quant_method: fp8`` with ``weight_block_size``: DeepSeek-V3's and
    Qwen3-FP8's layout) of ``src``: each linear ``weight`` as float8_e4m3fn over one scale per
    ``block_size`` block (``amax / 448``, stored as ``weight_scale_inv``, the factor to multiply
    by). HF transformers reads the format itself (on a CPU it dequantizes the weights). Returns
    ``out_dir``."""

    from pagedlm.core.layers.quantization.utils import FP8_DTYPE, FP8_MAX

    src, out = Path(src), Path(out_dir)
    bn, bk = block_size
    tensors: dict[str, Any] = {}
    for name, w in _linear_weights(src).items():
        n, k = w.shape
        blocks = w.float().reshape(n // bn, bn, k // bk, bk)
        scale = (blocks.abs().amax((1, 3)) / FP8_MAX).clamp(min=1e-12)
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(n, k)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale_inv"] = scale
    _write_quantized(src, out, tensors, {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk],
    })
    return str(out)


def dequantized_compressed_tensors_reference(ct_dir: str | os.PathLike[str],
                                             out_dir: str | os.PathLike[str]) -> str:
    """The model of a ``pack-quantized`` compressed-tensors checkpoint with its weights decompressed
    to float32 by the compressed-tensors package itself (for schemes this transformers cannot load,
    e.g. asymmetric packs). Returns ``out_dir``."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import save_file

    from pagedlm.core.model_loader.weight_utils import find_weight_files, safetensors_weights_iterator

    ct_dir, out = Path(ct_dir), Path(out_dir)
    config = json.loads((ct_dir / "config.json").read_text())
    qcfg = config.pop("quantization_config")
    (group,) = qcfg["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    state = dict(safetensors_weights_iterator(find_weight_files(str(ct_dir), "auto")))
    modules = {n[: -len(".weight_packed")] for n in state if n.endswith(".weight_packed")}
    weights = {n: t for n, t in state.items() if n.rsplit(".", 1)[0] not in modules}
    for m in sorted(modules):
        local = {n[len(m) + 1 :]: t for n, t in state.items() if n.startswith(m + ".")}
        weights[f"{m}.weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    _copy_side_files(ct_dir, out)
    return str(out)
