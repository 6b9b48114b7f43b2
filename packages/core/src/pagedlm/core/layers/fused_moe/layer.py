"""``FusedMoE``: a mixture-of-experts block's routed experts as one layer with stacked weights.

Parameters (vLLM's names and layouts), this rank's share only (see :mod:`.config`):

- ``w13_weight [E_local, 2 * I_tp, H]``: each expert's gate projection (rows ``[:I_tp]``,
  checkpoint shard ``"w1"``) and up projection (rows ``[I_tp:]``, shard ``"w3"``);
- ``w2_weight [E_local, H, I_tp]``: each expert's down projection (shard ``"w2"``).

``I_tp = I / tp`` with tensor-parallel experts, ``I`` with expert parallelism (``E_local`` then
``E / tp``). Per-expert HF checkpoints (``mlp.experts.3.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.3.w1.weight``) load through :meth:`FusedMoE.weight_loader`, which takes the
full checkpoint tensor of one expert and copies this rank's slice; :meth:`make_expert_params_mapping`
and :mod:`.weights` map checkpoint names onto the stacked parameters.

``forward(hidden_states [T, H], router_logits [T, E]) -> [T, H]``: routing (:mod:`.routing`),
then the ``fused_experts`` op: the platform's kernel when it registered one
(``pagedlm_register_ops``; pagedlm-backend-cuda's Triton kernel), else core's torch reference
(:mod:`.reference`). With ``reduce_results`` the partial outputs of the ranks are summed.

Quantized experts: the layer takes ``quant_config`` and ``prefix`` like vLLM's and asks
``quant_config.get_quant_method(layer, prefix)`` for a :class:`FusedMoEMethodBase` (None:
unquantized). The methods for experts (FP8, packed W4A16/W8A16) are in
:mod:`pagedlm.core.layers.quantization.moe_methods`; their parameters carry loader attributes
(``moe_layout``, ``moe_w2_sliced``, ``load_expert_shard``) that :meth:`FusedMoE.weight_loader` reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedlm.core.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagedlm.core.layers.custom_ops import bound_op
from pagedlm.core.layers.fused_moe.config import FusedMoEParallelConfig, determine_expert_map
from pagedlm.core.layers.fused_moe.reference import fused_experts
from pagedlm.core.layers.fused_moe.routing import fused_topk
from pagedlm.core.model_loader.weight_utils import set_weight_attrs

__all__ = ["FusedMoE", "FusedMoEMethodBase", "UnquantizedFusedMoEMethod"]

_SHARD_IDS = ("w1", "w2", "w3")


class FusedMoEMethodBase:
    """How a :class:`FusedMoE` layer stores its experts and runs them (vLLM's interface): a
    quantization method for experts subclasses it."""

    #: whether the experts are quantized (the loader counts quantized layers)
    quantized: bool = True

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra: Any) -> None:
        raise NotImplementedError

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Repack loaded weights for :meth:`apply` (the loader calls it on every layer's method, as
        on a linear layer's quantization method); nothing to do in the model dtype."""


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Experts in the model dtype, run by the ``fused_experts`` op."""

    quantized = False

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra: Any) -> None:
        inter = intermediate_size_per_partition
        # Values are garbage until the weight loader (or dummy init) fills them.
        w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=params_dtype), requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=params_dtype), requires_grad=False)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        for param in (w13, w2):
            set_weight_attrs(param, {"weight_loader": extra["weight_loader"]})

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        op = layer._fused_experts_op or fused_experts
        return op(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.expert_map)


def _materialise(tensor: Any) -> torch.Tensor:
    """A torch tensor of a checkpoint tensor or a lazy one (``LazyWeight``: read now)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.materialize()


def _current_enable_expert_parallel() -> bool:
    """``enable_expert_parallel`` of the config the model is being built with (False outside one)."""
    from pagedlm.core.forward_context import get_build_context

    try:
        config = get_build_context().vllm_config
    except RuntimeError:  # built outside set_current_vllm_config (unit tests)
        return False
    return bool(config.parallel_config.enable_expert_parallel)


class FusedMoE(nn.Module):
    """The routed experts of one MoE block (module docstring).

    ``num_experts`` and ``intermediate_size`` are the model's (global) sizes; ``top_k`` experts
    per token; ``renormalize`` rescales the top-k routing weights to sum to 1.
    ``enable_expert_parallel`` defaults to the config the model is built with
    (``ParallelConfig.enable_expert_parallel``); ``tp_size`` to the tensor-parallel group's size.
    """

    #: created by the quantization method (``create_weights``)
    w13_weight: nn.Parameter
    w2_weight: nn.Parameter

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = False,
        renormalize: bool = True,
        quant_config: Any = None,
        tp_size: int | None = None,
        prefix: str = "",
        custom_routing_function: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
        scoring_func: str = "softmax",
        activation: str = "silu",
        enable_expert_parallel: bool | None = None,
    ) -> None:
        super().__init__()
        if scoring_func != "softmax":
            raise ValueError(f"{prefix}: scoring_func={scoring_func!r} is not supported; supported: softmax")
        if activation != "silu":
            raise ValueError(f"{prefix}: activation={activation!r} is not supported; supported: silu")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: top_k={top_k} must be in 1..num_experts={num_experts}")
        self.prefix = prefix
        self.global_num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.reduce_results = reduce_results
        self.renormalize = renormalize
        self.custom_routing_function = custom_routing_function
        self.scoring_func = scoring_func
        self.activation = activation
        self.params_dtype = params_dtype or torch.get_default_dtype()
        if enable_expert_parallel is None:
            enable_expert_parallel = _current_enable_expert_parallel()
        group_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        group_rank = get_tensor_model_parallel_rank() if tp_size is None else 0
        self.moe_parallel_config = FusedMoEParallelConfig.make(group_size, group_rank, enable_expert_parallel)
        pc = self.moe_parallel_config
        self.tp_size, self.tp_rank, self.ep_size, self.ep_rank = pc.tp_size, pc.tp_rank, pc.ep_size, pc.ep_rank
        self.use_ep = pc.use_ep
        self.local_num_experts, expert_map = determine_expert_map(pc.ep_size, pc.ep_rank, num_experts)
        # NOTE: a buffer, so it follows the layer to its device; not persistent (no checkpoint has it).
        self.register_buffer("expert_map", expert_map, persistent=False)
        self.expert_map: torch.Tensor | None
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"{prefix}: the experts' intermediate size {intermediate_size} is not divisible by the "
                f"tensor-parallel size {self.tp_size}; use enable_expert_parallel=True to place whole experts"
            )
        self.intermediate_size_per_partition = intermediate_size // self.tp_size
        self.quant_method = self._quant_method(quant_config)
        self.quant_method.create_weights(
            self, num_experts=self.local_num_experts, hidden_size=hidden_size,
            intermediate_size_per_partition=self.intermediate_size_per_partition,
            params_dtype=self.params_dtype, weight_loader=self.weight_loader,
        )
        # the platform's kernel, if it registered one (layers.custom_ops); bound once, at build
        self._fused_experts_op = bound_op("fused_experts")

    def _quant_method(self, quant_config: Any) -> FusedMoEMethodBase:
        method = None if quant_config is None else quant_config.get_quant_method(self, self.prefix)
        if method is None or isinstance(method, UnquantizedFusedMoEMethod):
            return UnquantizedFusedMoEMethod()
        if isinstance(method, FusedMoEMethodBase):
            return method
        name = getattr(quant_config, "get_name", lambda: type(quant_config).__name__)()
        raise NotImplementedError(
            f"{self.prefix or 'FusedMoE'}: quantization method {name!r} gave the experts {type(method).__name__}, "
            "which is not a FusedMoEMethodBase; this method does not quantize experts (supported for experts: "
            "fp8, compressed-tensors). Load an unquantized checkpoint, or exclude the experts from quantization."
        )

    # -- weights --------------------------------------------------------------------------------
    @classmethod
    def make_expert_params_mapping(cls, ckpt_gate_proj_name: str, ckpt_down_proj_name: str,
                                   ckpt_up_proj_name: str, num_experts: int) -> list[tuple[str, str, int, str]]:
        """``(param_name, weight_name, expert_id, shard_id)`` for every expert's three checkpoint
        tensors, e.g. ``("experts.w13_", "experts.3.gate_proj.", 3, "w1")``: a checkpoint name
        containing ``weight_name`` belongs to the parameter named with it replaced by ``param_name``
        (``mlp.experts.3.gate_proj.weight`` -> ``mlp.experts.w13_weight``)."""
        mapping = []
        for expert_id in range(num_experts):
            for shard_id, name in (("w1", ckpt_gate_proj_name), ("w2", ckpt_down_proj_name),
                                   ("w3", ckpt_up_proj_name)):
                param = "experts.w2_" if shard_id == "w2" else "experts.w13_"
                mapping.append((param, f"experts.{expert_id}.{name}.", expert_id, shard_id))
        return mapping

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, weight_name: str, shard_id: str,
                      expert_id: int) -> bool:
        """Copy this rank's slice of one expert's full checkpoint tensor into ``param``.

        ``shard_id`` ``"w1"`` (gate) and ``"w3"`` (up) are ``[I(/f), ...]`` (the intermediate
        dimension first), ``"w2"`` (down) ``[H(/f), I(/f)]`` (it second), ``f`` a packing factor or a
        group size; ``expert_id`` is the global id. Returns False (copying nothing) for an expert that
        lives on another rank. ``loaded_weight`` may be a lazy safetensors slice: only this rank's rows
        or columns are read. The slice sizes come from ``param``'s shape (``[E_local, 2 * n, ...]``
        for w13 parameters: gate rows, then up rows; ``[E_local, ..., n]`` for w2's). A quantization
        method's parameter may say otherwise:

        - ``moe_layout="per_shard"``: one value per checkpoint tensor (``[E, 2]`` gate/up, ``[E]``
          down; per-tensor scales); ``"whole"``: the tensor as it is (``weight_shape``);
        - ``moe_w2_sliced=False``: w2's tensor is not split along its second dimension (per-channel
          scales ``[H, 1]``);
        - ``load_expert_shard(dst, src, full, local_expert, shard_id)``: stores ``src`` itself
          (online FP8 quantizes it; ``full`` is the whole checkpoint tensor).
        """
        if shard_id not in _SHARD_IDS:
            raise ValueError(f"{self.prefix}: shard_id must be one of {', '.join(_SHARD_IDS)}, got {shard_id!r}")
        if not 0 <= expert_id < self.global_num_experts:
            raise ValueError(f"{self.prefix}: expert {expert_id} of {weight_name} is out of range "
                             f"0..{self.global_num_experts - 1}")
        local = expert_id if self.expert_map is None else int(self.expert_map[expert_id])
        if local < 0:
            return False
        layout = getattr(param, "moe_layout", "stacked")
        dst = param.data[local]
        src = loaded_weight
        if layout == "per_shard":
            dst = dst if shard_id == "w2" else dst[0 if shard_id == "w1" else 1]
            src = _materialise(loaded_weight).reshape(())
        elif layout == "stacked":
            sliced = self.tp_size > 1
            if shard_id == "w2":
                size = dst.shape[1]
                if sliced and getattr(param, "moe_w2_sliced", True):
                    src = loaded_weight[:, self.tp_rank * size : (self.tp_rank + 1) * size]
            else:
                size = dst.shape[0] // 2
                dst = dst.narrow(0, 0 if shard_id == "w1" else size, size)
                if sliced:
                    src = loaded_weight[self.tp_rank * size : (self.tp_rank + 1) * size]
        src = _materialise(src)
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(
                f"{weight_name} (expert {expert_id}, {shard_id}): checkpoint tensor {tuple(loaded_weight.shape)} "
                f"gives {tuple(src.shape)} on this rank, the parameter expects {tuple(dst.shape)} (experts of "
                f"hidden size {self.hidden_size}, intermediate size {self.intermediate_size}, "
                f"{self.intermediate_size_per_partition} per rank)"
            )
        hook = getattr(param, "load_expert_shard", None)
        if hook is not None:
            hook(dst, src, loaded_weight, local, shard_id)
        else:
            dst.copy_(src)
        return True

    # -- forward --------------------------------------------------------------------------------
    def select_experts(self, hidden_states: torch.Tensor,
                       router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, top_k] float32, topk_ids [T, top_k] int32 global ids)``."""
        if self.custom_routing_function is not None:
            return self.custom_routing_function(hidden_states, router_logits, self.top_k, self.renormalize)
        return fused_topk(hidden_states, router_logits, self.top_k, self.renormalize)

    def maybe_all_reduce_tensor_model_parallel(self, final_hidden_states: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs (tensor- or expert-parallel); identity on one rank."""
        if self.tp_size > 1 or self.ep_size > 1:
            return tensor_model_parallel_all_reduce(final_hidden_states)
        return final_hidden_states

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``hidden_states [T, H]``, ``router_logits [T, E]`` -> ``[T, H]`` (summed across ranks
        when ``reduce_results``; this rank's partial sum otherwise)."""
        topk_weights, topk_ids = self.select_experts(hidden_states, router_logits)
        out = self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)
        if self.reduce_results:
            out = self.maybe_all_reduce_tensor_model_parallel(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.local_num_experts}/{self.global_num_experts}, top_k={self.top_k}, "
                f"hidden={self.hidden_size}, intermediate={self.intermediate_size_per_partition}/"
                f"{self.intermediate_size}, tp={self.tp_size}, ep={self.ep_size}, renormalize={self.renormalize}")
