"""Tiny, randomly initialised HF checkpoints (config.json + safetensors + tokenizer) for tests.

No hub is reachable where tests run, so correctness is measured on checkpoints we build: the same
files are loaded by HF transformers (the reference) and by the engine under test.

Random HF initialisation is a poor test subject: with std 0.02 weights attention is nearly
uniform, biases and norm weights are constants (0 and 1), and the top logits of a 64-wide model
are so close that greedy decoding flips on rounding noise. A bug that drops a bias, ignores a norm
weight or attends to the wrong block would pass unnoticed. So we re-initialise every tensor
ourselves (deterministically, independent of the transformers version):
  * matrices get std 1/sqrt(fan_in), so each layer's contribution to the residual stream is O(1),
    and q/k are scaled up so attention really selects positions (see _QK_GAIN);
  * norm weights are drawn from [0.5, 1.5] and biases are non-zero, so forgetting them shows;
  * the final norm is widened so logits have a spread of about ``logit_scale``; top-2 gaps are then
    mostly far above float32 noise and greedy output is stable across kernels.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from pathlib import Path
from typing import Any, Literal

from pagedlm.core.testing.tokenizer import BOS_ID, EOS_ID, MIN_VOCAB_SIZE, PAD_ID, build_bpe_tokenizer

Arch = Literal["llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral"]
ARCHITECTURES: tuple[Arch, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral")
#: the mixture-of-experts architectures of ARCHITECTURES
MOE_ARCHITECTURES: tuple[Arch, ...] = ("qwen3_moe", "mixtral")

#: arch -> (config class name, HF ``architectures`` entry), both in ``transformers``
HF_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}

#: arch -> (experts, experts per token) of the tiny MoE checkpoints: even counts, so expert
#: parallelism over two ranks splits them, and more than one expert per token, so the weighted
#: sum over experts is exercised
MOE_DEFAULTS: dict[str, tuple[int, int]] = {"qwen3_moe": (8, 2), "mixtral": (4, 2)}

#: Gemma 3's shape where a backend can get it wrong: the head size of every real Gemma 3 (256),
#: a score scale unlike ``head_dim ** -0.5``, and a window short enough that test prompts slide it
GEMMA3_HEAD_DIM = 256
GEMMA3_QUERY_PRE_ATTN_SCALAR = 192
GEMMA3_SLIDING_WINDOW = 8
GEMMA3_LOCAL_ROPE_THETA = 10000.0

# Realistic, non-default RoPE bases: an engine that ignores config.json's theta and falls back to
# 10000 produces different logits and fails the HF comparison.
_ROPE_THETA: dict[str, float] = {"llama": 500000.0, "mistral": 1000000.0, "qwen2": 1000000.0, "qwen3": 1000000.0,
                                  "gemma3": 1000000.0, "qwen3_moe": 1000000.0, "mixtral": 1000000.0}

_DTYPES = ("float32", "bfloat16", "float16")

# Scales q and k so attention scores have a spread of ~_QK_GAIN**2: attention then picks out a few
# positions instead of averaging. Softer attention let random models fall into repeating one token
# (tens of times in a row), and a repeated token hides position and cache bugs.
_QK_GAIN = 2.0


def _config(
    arch: str,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    rope_theta: float | None = None,
    rms_norm_eps: float = 1e-6,
    dtype: str = "float32",
    num_experts: int | None = None,
    num_experts_per_tok: int | None = None,
    norm_topk_prob: bool | None = None,
    mlp_only_layers: tuple[int, ...] | None = None,
):  # -> transformers.PretrainedConfig
    import transformers

    if arch not in HF_CLASSES:
        raise ValueError(f"arch={arch!r} is not one of {', '.join(HF_CLASSES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if head_dim is None and arch == "gemma3":
        head_dim = GEMMA3_HEAD_DIM
    if head_dim is None:
        # Qwen3 decouples head_dim from hidden_size/num_heads (real ones use 128 with any width);
        # doubling it here exercises an engine's handling of q_proj wider than the hidden size.
        head_dim = hidden_size // num_heads * (2 if arch in ("qwen3", "qwen3_moe") else 1)
    config_cls_name, arch_name = HF_CLASSES[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        # Accepted by transformers 4.x as is and folded into rope_parameters by 5.x.
        rope_theta=rope_theta if rope_theta is not None else _ROPE_THETA[arch],
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        hidden_act="silu",
        architectures=[arch_name],
    )
    if arch == "mistral":
        # Sliding windows longer than max_position_embeddings never slide; None says so plainly.
        kwargs["sliding_window"] = None
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        kwargs["use_sliding_window"] = False
    if arch in MOE_DEFAULTS:
        experts, per_token = MOE_DEFAULTS[arch]
        experts = num_experts or experts
        per_token = num_experts_per_tok or per_token
        if arch == "qwen3_moe":
            # Qwen3-30B-A3B's choices: renormalised top-k, every layer sparse
            kwargs.update(num_experts=experts, num_experts_per_tok=per_token, moe_intermediate_size=intermediate_size,
                          norm_topk_prob=True if norm_topk_prob is None else norm_topk_prob, decoder_sparse_step=1,
                          mlp_only_layers=list(mlp_only_layers or ()))
        else:
            kwargs.update(num_local_experts=experts, num_experts_per_tok=per_token, sliding_window=None)
    elif (num_experts, num_experts_per_tok, norm_topk_prob, mlp_only_layers) != (None, None, None, None):
        raise ValueError(f"arch={arch!r} has no experts; num_experts and the other MoE options are for "
                         f"{', '.join(MOE_DEFAULTS)}")
    if arch == "gemma3":
        # Every second layer global, the rest sliding (the real models use five local to one global;
        # two layers must have both kinds). Each kind has its own RoPE base.
        kwargs.update(
            hidden_activation="gelu_pytorch_tanh", sliding_window=GEMMA3_SLIDING_WINDOW,
            layer_types=["full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(num_layers)],
            rope_local_base_freq=GEMMA3_LOCAL_ROPE_THETA, query_pre_attn_scalar=GEMMA3_QUERY_PRE_ATTN_SCALAR,
            final_logit_softcapping=None,
        )
        del kwargs["hidden_act"]
    config = getattr(transformers, config_cls_name)(**kwargs)
    config.dtype = dtype  # written as "dtype" (5.x) or "torch_dtype" (4.x); _write_config_json adds the other
    return config


def _write_config_json(config, out: Path, rope_theta: float) -> None:
    config.save_pretrained(str(out))
    path = out / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    # transformers 5 writes only rope_parameters; the flat key lets 4.x-style readers find theta too.
    data.setdefault("rope_theta", rope_theta)
    data.setdefault("torch_dtype", data.get("dtype"))
    data.setdefault("dtype", data.get("torch_dtype"))
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_dummy_config_dir(out_dir: str | os.PathLike[str], arch: Arch, **hyper: Any) -> str:
    """Write only ``config.json`` for ``arch`` (same hyper-parameters as :func:`make_tiny_checkpoint`).

    For tests of configuration and model construction that need no weights and no tokenizer.
    Returns ``out_dir`` as a string.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(arch, **hyper)
    _write_config_json(config, out, _rope_theta_of(config))
    return str(out)


def _rope_theta_of(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    params = params.get("full_attention", params)  # per layer type (Gemma 3 under transformers 5)
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _reinitialise(model, *, seed: int, logit_scale: float, tied: bool) -> None:
    """Overwrite every parameter (see the module docstring for why), in name order, from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    params = dict(model.named_parameters())  # tied weights appear once
    has_qk_norm = any(name.endswith("q_norm.weight") for name in params)
    # Tied: the output layer scores each token by its own embedding, so a large embedding makes
    # the model predict whatever token it was just fed. A small one leaves the layers in charge.
    embed_std = 1.0 / (2.0 * math.sqrt(hidden)) if tied else 1.0
    if getattr(model.config, "model_type", "").startswith("gemma"):
        embed_std /= math.sqrt(hidden)  # Gemma multiplies embeddings by sqrt(hidden) itself
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            if name.endswith("norm.weight"):
                w = 0.5 + torch.rand(p.shape, generator=gen)
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    w *= _QK_GAIN  # Qwen3 normalises q and k, so their scale lives here
                p.copy_(w)
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(embed_std * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                std = 1.0 / math.sqrt(p.shape[1])
                if name.endswith(("q_proj.weight", "k_proj.weight")) and not has_qk_norm:
                    std *= _QK_GAIN
                p.copy_(std * torch.randn(p.shape, generator=gen))
            elif p.dim() == 3 and ".experts." in name:
                # transformers 5 keeps the experts stacked in memory ([E, out, in]); saved per expert
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[2]))
            else:
                raise AssertionError(f"no initialisation rule for parameter {name} {tuple(p.shape)}")
        # Untied lm_head rows have norm ~1, so logits spread ~logit_scale; tied rows are smaller.
        widen = logit_scale / (embed_std * math.sqrt(hidden)) if tied else logit_scale
        model.model.norm.weight.mul_(widen)


def top2_gaps(logits) -> Any:  # torch.Tensor [..., vocab] -> [...]
    """Gap between the largest and second-largest logit along the last dimension."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def _check_wide_logits(model, *, seed: int, max_near_tie_fraction: float = 0.05) -> None:
    """Fail loudly if this configuration leaves greedy decoding at the mercy of rounding noise."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    near = (top2_gaps(logits) < 1e-3).float().mean().item()
    if near > max_near_tie_fraction:
        raise RuntimeError(
            f"tiny checkpoint has {near:.1%} near-tied top-2 logits (gap < 1e-3); "
            "raise logit_scale or hidden_size so greedy comparisons are meaningful"
        )


def make_tiny_checkpoint(
    out_dir: str | os.PathLike[str],
    arch: Arch,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    sharded: bool = False,
    dtype: str = "float32",
    head_dim: int | None = None,
    rope_theta: float | None = None,
    logit_scale: float = 8.0,
    num_experts: int | None = None,
    num_experts_per_tok: int | None = None,
    norm_topk_prob: bool | None = None,
    mlp_only_layers: tuple[int, ...] | None = None,
) -> str:
    """Build a tiny random HF checkpoint of ``arch`` in ``out_dir`` and return the directory.

    Writes config.json, model.safetensors (or, with ``sharded=True``, several shards plus
    model.safetensors.index.json), generation_config.json (bos 1, eos 2, pad 3) and a byte-level BPE
    tokenizer whose vocabulary is exactly ``vocab_size``. Weights are saved in ``dtype``. The same
    arguments always give the same weights. ``head_dim`` defaults to hidden_size // num_heads
    (twice that for qwen3, as real Qwen3 models decouple the two); ``rope_theta`` defaults to the
    architecture's usual base (not 10000). Qwen2 has q/k/v biases, Qwen3 has q/k norms. Gemma 3
    has head size 256 by default, ``query_pre_attn_scalar`` 192, GELU-tanh, q/k norms, zero-centred
    norms (``1 + w``), a sqrt(hidden) embedding scale and alternating sliding-window (8 tokens, RoPE
    base 10k) and global layers (RoPE base 1M). The mixture-of-experts architectures (Qwen3-MoE,
    Mixtral) have ``num_experts`` experts of width ``intermediate_size`` (defaults: 8 and 4,
    :data:`MOE_DEFAULTS`), ``num_experts_per_tok`` of them per token (2); Qwen3-MoE renormalises
    the top-k weights unless ``norm_topk_prob=False`` and keeps a dense MLP in ``mlp_only_layers``.
    Their checkpoints store every expert's projections as separate tensors, as HF's do.
    """
    import torch
    import transformers
    from transformers import GenerationConfig

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size} must be at least {MIN_VOCAB_SIZE} (bytes + special tokens)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        head_dim=head_dim,
        rope_theta=rope_theta,
        dtype=dtype,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=mlp_only_layers,
    )
    model_cls = getattr(transformers, HF_CLASSES[arch][1])
    # HF's own initialisation draws from the global RNG; keep the caller's RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
    # Offset by architecture so llama and mistral (same tensor names and shapes) get different weights.
    weight_seed = seed * len(ARCHITECTURES) + ARCHITECTURES.index(arch)
    _reinitialise(model, seed=weight_seed, logit_scale=logit_scale, tied=tie_word_embeddings)
    _check_wide_logits(model, seed=seed)

    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model = model.to(getattr(torch, dtype))
    save_kwargs: dict[str, Any] = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True  # transformers 4.x; 5.x only writes safetensors
    if sharded:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        save_kwargs["max_shard_size"] = max(total // 4, 1)
    model.save_pretrained(str(out), **save_kwargs)
    _write_config_json(model.config, out, _rope_theta_of(model.config))
    build_bpe_tokenizer(
        out,
        vocab_size=vocab_size,
        model_max_length=max_position_embeddings,
        style="qwen2" if arch.startswith("qwen") else "gpt2",
    )
    if sharded and not (out / "model.safetensors.index.json").exists():
        raise AssertionError(f"sharded checkpoint in {out} has no model.safetensors.index.json")
    return str(out)
