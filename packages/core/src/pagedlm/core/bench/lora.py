"""``--num-loras N --lora-rank R`` of ``pagedlm bench throughput``: N random PEFT adapters of rank
R (every adaptable projection of the model), with the requests spread over them round-robin.

The adapters are written in PEFT's format to a temporary directory from the shapes the engine
reports (``LLMEngine.lora_registry.targets``), read into the workers' host caches before the
timed run, and deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any

__all__ = ["add_lora_options", "engine_overrides", "RandomAdapters"]


def add_lora_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA")
    group.add_argument("--num-loras", type=int, default=0, metavar="N",
                       help="spread the requests over N random LoRA adapters (turns on enable_lora with "
                            "max_loras=N unless --max-loras is larger)")
    group.add_argument("--lora-rank", type=int, default=16, metavar="R", help="rank of the random adapters")


def engine_overrides(args: argparse.Namespace, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``LLM`` options a run with ``--num-loras`` needs."""
    if args.num_loras < 0 or args.lora_rank < 1:
        raise ValueError(f"--num-loras={args.num_loras} must be >= 0 and --lora-rank={args.lora_rank} >= 1")
    if not args.num_loras:
        return {}
    max_loras = max(int(kwargs.get("max_loras") or 1), args.num_loras)
    return {"enable_lora": True, "max_loras": max_loras, "max_cpu_loras": max(max_loras, args.num_loras),
            "max_lora_rank": max(int(kwargs.get("max_lora_rank") or 16), args.lora_rank)}


class RandomAdapters:
    """``num`` adapters of rank ``rank`` for the model ``llm`` serves, as ``LoRARequest`` s."""

    def __init__(self, llm: Any, num: int, rank: int, *, seed: int = 0) -> None:
        import torch
        from safetensors.torch import save_file

        from pagedlm.core.lora.request import LoRARequest

        self.rank = rank
        self.dir = tempfile.mkdtemp(prefix="pagedlm-bench-lora-")
        engine = llm.llm_engine
        targets = engine.lora_registry.targets or {}
        modules = sorted({name.rsplit(".", 1)[-1] for name in targets})
        gen = torch.Generator().manual_seed(seed)
        self.requests = []
        for i in range(num):
            path = os.path.join(self.dir, f"lora-{i}")
            os.makedirs(path)
            tensors = {}
            for module, (size_in, size_out) in targets.items():
                # small values: the adapted model stays close to the base one (as trained adapters do)
                a = torch.randn(rank, size_in, generator=gen) / size_in ** 0.5
                b = torch.randn(size_out, rank, generator=gen) * 0.01
                tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(torch.bfloat16)
            save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
            with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
                json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules,
                           "bias": "none"}, f)
            request = LoRARequest(f"bench-lora-{i}", i + 1, path)
            engine.add_lora(request)  # into the host caches now, not during the timed run
            self.requests.append(request)

    def for_requests(self, num_requests: int) -> list[Any]:
        """Request ``i`` runs with adapter ``i % num`` (every step mixes all of them)."""
        return [self.requests[i % len(self.requests)] for i in range(num_requests)]

    def summary(self) -> dict[str, Any]:
        return {"num_loras": len(self.requests), "rank": self.rank}

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
