"""What every ``pagedlm bench`` subcommand shares: engine options, model configs, stats, output.

Nothing here imports torch or the engine at module level, so ``pagedlm --help`` stays fast.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from typing import Any

#: ``--model-config`` names -> JSON files shipped in ``pagedlm/core/bench/model_configs``
MODEL_CONFIGS = ("qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b", "qwen3-30b-a3b", "mixtral-8x7b", "llava-1.5-7b")

PERCENTILES = (50, 90, 99)


# -- options ------------------------------------------------------------------------------------
def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Every ``LLM`` option (``--device``, ``--dtype``, ...) plus ``--model-config`` and ``--output-json``."""
    from pagedlm.core.engine.arg_utils import EngineArgs

    parser.add_argument("--model-config", choices=MODEL_CONFIGS, default=None,
                        help="use the published hyperparameters of this model with random weights "
                             "(implies --load-format dummy; no weight files are needed)")
    add_output_option(parser)
    EngineArgs.add_cli_args(parser)


def add_output_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-json", default=None, metavar="FILE", help="write the full result as JSON here")


def model_config_dir(name: str, out_dir: str) -> str:
    """Write the shipped ``config.json`` of ``name`` into ``out_dir``; returns ``out_dir``."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"--model-config {name!r} is not one of {', '.join(MODEL_CONFIGS)}")
    os.makedirs(out_dir, exist_ok=True)
    source = resources.files("pagedlm.core.bench").joinpath("model_configs").joinpath(f"{name}.json")
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        f.write(source.read_text(encoding="utf-8"))
    return out_dir


class EngineSetup:
    """Turns parsed options into ``LLM(**kwargs)`` and cleans up the temporary config dir."""

    def __init__(self, args: argparse.Namespace, *, need_len: int | None = None) -> None:
        from pagedlm.core.engine.arg_utils import EngineArgs

        self.model_config_name: str | None = getattr(args, "model_config", None)
        self._tmp: str | None = None
        self._default_name: str | None = None
        engine_args = EngineArgs.from_cli_args(args)
        kwargs = {k: v for k, v in vars(engine_args).items() if k != "additional_config"}
        if self.model_config_name:
            if engine_args.model:
                raise ValueError("pass either --model DIR or --model-config NAME, not both")
            self._tmp = tempfile.mkdtemp(prefix=f"pagedlm-bench-{self.model_config_name}-")
            kwargs["model"] = model_config_dir(self.model_config_name, self._tmp)
            # Published configs come without weights or tokenizer: random weights, token-id prompts.
            kwargs["load_format"] = "dummy"
            kwargs["skip_tokenizer_init"] = True
        elif not engine_args.model:
            from pagedlm.core.default_model import resolve_default_model

            # as `pagedlm generate`: the default model (ValueError saying how to install one, or
            # to pass --model DIR / --model-config NAME)
            kwargs["model"], offer = resolve_default_model()
            self._default_name = offer.served_name or offer.name
        if kwargs.get("max_model_len") is None and need_len is not None:
            # NOTE: the default would be the model's full context (40k-128k tokens for the shipped
            # configs); one such request may not even fit the CPU's KV cache. The workload's longest
            # request is what the benchmark needs.
            block = int(kwargs.get("block_size") or 16)
            kwargs["max_model_len"] = -(-need_len // block) * block
        self.kwargs = kwargs

    @property
    def model_label(self) -> str:
        return (self.model_config_name or self._default_name
                or os.path.basename(os.path.normpath(str(self.kwargs["model"]))))

    def build(self, **overrides: Any):
        from pagedlm.core import LLM

        return LLM(**{**self.kwargs, **overrides})

    def _hf_config(self) -> dict[str, Any]:
        model = str(self.kwargs["model"])
        if os.path.isfile(model):  # a .gguf file: the hyperparameters live in its metadata
            from pagedlm.core.model_loader.gguf_loader import load_gguf_model_config

            cfg = load_gguf_model_config(model)[0].to_dict()
            return cfg.get("text_config") or cfg
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        return cfg.get("text_config") or cfg

    def vocab_size(self) -> int:
        return int(self._hf_config().get("vocab_size") or 32000)

    def model_max_len(self) -> int:
        return int(self._hf_config().get("max_position_embeddings") or 2048)

    def cleanup(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def engine_summary(llm: Any, setup: EngineSetup) -> dict[str, Any]:
    """The resolved engine configuration a result was measured with."""
    cfg = llm.vllm_config
    mc, cc, sc = cfg.model_config, cfg.cache_config, cfg.scheduler_config
    return {
        "model": setup.model_label,
        "model_path": str(setup.kwargs["model"]) if not setup.model_config_name else None,
        "load_format": cfg.load_config.load_format,
        "device": cfg.device_config.device,
        "dtype": str(mc.dtype).removeprefix("torch."),
        "max_model_len": cfg.max_model_len,
        "block_size": cc.block_size,
        "num_blocks": llm.llm_engine.num_gpu_blocks,
        "enable_prefix_caching": cc.enable_prefix_caching,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "async_scheduling": sc.async_scheduling,
        "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
        "pipeline_parallel_size": cfg.parallel_config.pipeline_parallel_size,
        "data_parallel_size": cfg.parallel_config.data_parallel_size,
        "attention_backend": cfg.attention_backend,
        "enforce_eager": cfg.enforce_eager,
        "quantization": cfg.quant_config.describe() if cfg.quant_config is not None else None,
        "kv_cache_dtype": cc.cache_dtype,
        "weight_memory_gib": _weight_memory_gib(llm),
    }


def _weight_memory_gib(llm: Any) -> float | None:
    """GiB the model's weights take on rank 0, when the engine runs in this process (else None:
    the start-up log of each worker says it)."""
    try:
        model = llm.llm_engine.core.executor.worker.model_runner.model
    except (AttributeError, RuntimeError):  # RuntimeError: data-parallel cores run elsewhere
        return None
    size = getattr(model, "weight_memory_bytes", None)
    return None if size is None else round(size / 2**30, 4)


def warm_up(llm: Any, vocab_size: int) -> None:
    """One small untimed batch: first-call costs (allocations, JIT, graph capture) stay out of timings.

    The ids are fixed and few, so the prefix cache keeps at most a couple of blocks from it.
    """
    from pagedlm.core import SamplingParams

    max_len = llm.vllm_config.max_model_len
    prompt_len = max(1, min(24, max_len // 2))
    prompts = [{"prompt_token_ids": [(7 * i + j) % vocab_size for j in range(prompt_len)]} for i in range(2)]
    max_tokens = max(1, min(4, max_len - prompt_len))
    # greedy and random: each sampler path compiles its kernels (e.g. Triton's) here, not in a timing
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature)
        llm.generate(prompts, params, use_tqdm=False)


# -- statistics ---------------------------------------------------------------------------------
def resident_memory_mb() -> float | None:
    """This process's resident set size now (``VmRSS``), MB; None where /proc is absent."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without needing numpy."""
    if not values:
        return float("nan")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def distribution(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int]:
    """mean / p50 / p90 / p99 / min / max of ``values`` times ``scale`` (e.g. 1000 for ms)."""
    data = [v * scale for v in values]
    if not data:
        return {"count": 0}
    out: dict[str, float | int] = {"count": len(data), "mean": sum(data) / len(data)}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(data, q)
    out["min"], out["max"] = min(data), max(data)
    return out


# -- output -------------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    """Where a result was measured: enough to put it in a table next to the command."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # sys.argv is this command's only when pagedlm was started from a shell (not in-process).
        "command": shlex.join(["pagedlm", *sys.argv[1:]]) if "bench" in sys.argv[1:2] else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "processor": _cpu_model(),
        # Other work on the machine skews CPU timings; the load says how much there was.
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        from pagedlm.core.platforms import resolve_platform

        info.update(resolve_platform("auto").get_device_description())
    except ImportError:  # the serve load generator needs no torch
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_offline(args: Any, need_len: int | None, measure: Callable[[Any, EngineSetup], dict[str, Any]],
                print_result: Callable[[dict[str, Any]], None]) -> int:
    """The body of an offline subcommand: build the engine setup, ``measure``, always clean up,
    then print the result and write it to ``--output-json``."""
    setup = EngineSetup(args, need_len=need_len)
    try:
        result = measure(args, setup)
    finally:
        setup.cleanup()
    print_result(result)
    finish(result, args.output_json)
    return 0


def finish(result: dict[str, Any], path: str | None) -> None:
    """Attach the environment and write ``result`` to ``path`` (if given)."""
    result.setdefault("environment", environment())
    if path:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, sort_keys=False, default=_json_default)
            f.write("\n")
        print(f"wrote {path}")


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def print_table(title: str, rows: Sequence[tuple[str, Any]]) -> None:
    """A two-column summary, numbers formatted to a readable precision."""
    print(f"\n== {title} ==")
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        if isinstance(value, float):
            value = f"{value:,.2f}" if abs(value) >= 1 or value == 0 else f"{value:.4f}"
        elif isinstance(value, int) and not isinstance(value, bool):
            value = f"{value:,}"
        print(f"  {key.ljust(width)}  {value}")
