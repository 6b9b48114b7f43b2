"""Benchmark workloads: lists of token-id prompts and output lengths, fully determined by a seed.

Prompts are token ids, so no tokenizer is needed and every engine sees exactly the same input.
Every request runs to its output length (``ignore_eos``), so the amount of work is fixed.

* ``nano``: the workload nano-vllm publishes in its README (256 requests, prompt and output lengths
  uniform in [100, 1024], token ids uniform in [0, 10000], ``random.seed(0)``, temperature 0.6).
  The draws are made in the same order with Python's ``random`` module, so the requests are the
  same ones (133,966 output tokens in total) and throughputs compare with its table.
* ``fixed``: ``num_prompts`` requests of exactly ``input_len`` prompt and ``output_len`` output tokens.
* ``sharegpt-like``: prompt and output lengths drawn from log-normal distributions whose means
  (161 and 338 tokens before clipping) are the ShareGPT averages reported in the vLLM paper; see
  ``SHAREGPT_LIKE`` and docs/benchmarks.md. It imitates the length mix, not the text.
* ``prefix``: ``num_prefixes`` shared "system prompts" of ``prefix_len`` tokens, each request one of
  them (round robin) followed by its own ``suffix_len`` tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("nano", "fixed", "sharegpt-like")

#: nano-vllm's bench.py parameters
NANO: dict[str, Any] = {"num_prompts": 256, "min_len": 100, "max_input_len": 1024, "max_output_len": 1024,
                        "max_token_id": 10000, "seed": 0, "temperature": 0.6}

#: log-normal parameters of the sharegpt-like workload: mu and sigma of ln(length), and the clip range
SHAREGPT_LIKE: dict[str, Any] = {
    # median exp(mu): 98 prompt tokens, 225 output tokens; means exp(mu + sigma^2 / 2): 161 and 338
    "input_mu": math.log(98.0), "input_sigma": 1.0,
    "output_mu": math.log(225.0), "output_sigma": 0.9,
    "min_len": 4, "max_input_len": 1024, "max_output_len": 1024, "max_token_id": 10000,
}


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    temperature: float = 0.0
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.output_lens)} output lengths")
        if not self.prompts:
            raise ValueError("a workload needs at least one request (--num-prompts >= 1)")

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def max_total_len(self) -> int:
        """Longest prompt + output of any request: the ``max_model_len`` the workload needs."""
        return max(len(p) + o for p, o in zip(self.prompts, self.output_lens))

    def summary(self) -> dict[str, Any]:
        in_lens = [len(p) for p in self.prompts]
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "temperature": self.temperature,
            "total_input_tokens": sum(in_lens),
            "total_output_tokens": sum(self.output_lens),
            "input_len": _stats(in_lens),
            "output_len": _stats(self.output_lens),
            "params": dict(self.params),
        }

    def sampling_params(self) -> list[Any]:
        from pagedlm.core import SamplingParams

        # NOTE: no per-request seeds, as in nano-vllm's published workload: with ignore_eos the
        # output lengths are fixed, so which tokens are drawn does not change the work done.
        return [SamplingParams(max_tokens=o, ignore_eos=True, temperature=self.temperature) for o in self.output_lens]


def _stats(values: list[int]) -> dict[str, float]:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def _fold(token_id: int, vocab_size: int | None) -> int:
    # Models with fewer than 10001 tokens (tiny test checkpoints) cannot take nano's ids as drawn;
    # folding keeps the draw sequence, and thus every length, unchanged.
    return token_id % vocab_size if vocab_size is not None and token_id >= vocab_size else token_id


def nano_workload(*, vocab_size: int | None = None, num_prompts: int | None = None) -> Workload:
    """nano-vllm's workload; ``num_prompts`` takes the first N of its requests' draws order-wise.

    NOTE: nano draws every prompt first (its length, then its ids) and only then every output
    length, so a smaller ``num_prompts`` changes the output lengths: it is then a different workload.
    """
    p = NANO
    n = p["num_prompts"] if num_prompts is None else num_prompts
    rng = random.Random(p["seed"])
    prompts = []
    for _ in range(n):
        length = rng.randint(p["min_len"], p["max_input_len"])
        prompts.append([_fold(rng.randint(0, p["max_token_id"]), vocab_size) for _ in range(length)])
    output_lens = [rng.randint(p["min_len"], p["max_output_len"]) for _ in range(n)]
    params = {**p, "num_prompts": n, "vocab_size": vocab_size, "published": n == p["num_prompts"]}
    return Workload("nano", prompts, output_lens, temperature=p["temperature"], params=params)


def fixed_workload(*, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                   vocab_size: int | None = None) -> Workload:
    if min(num_prompts, input_len, output_len) < 1:
        raise ValueError(f"--num-prompts, --input-len and --output-len must be >= 1 (got {num_prompts}, "
                         f"{input_len}, {output_len})")
    rng = random.Random(seed)
    high = _max_id(vocab_size)
    prompts = [[rng.randint(0, high) for _ in range(input_len)] for _ in range(num_prompts)]
    params = {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "seed": seed}
    return Workload("fixed", prompts, [output_len] * num_prompts, params=params)


def sharegpt_like_workload(*, num_prompts: int, seed: int = 0, vocab_size: int | None = None,
                           max_model_len: int | None = None) -> Workload:
    """Log-normal prompt/output lengths (see ``SHAREGPT_LIKE``); a request longer than
    ``max_model_len`` has its output shortened to fit."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1 (got {num_prompts})")
    p = SHAREGPT_LIKE
    rng = random.Random(seed)
    high = _max_id(vocab_size)
    prompts, output_lens = [], []
    for _ in range(num_prompts):
        in_len = _clip(rng.lognormvariate(p["input_mu"], p["input_sigma"]), p["min_len"], p["max_input_len"])
        out_len = _clip(rng.lognormvariate(p["output_mu"], p["output_sigma"]), p["min_len"], p["max_output_len"])
        if max_model_len is not None:
            in_len = min(in_len, max_model_len - 1)
            out_len = max(1, min(out_len, max_model_len - in_len))
        prompts.append([rng.randint(0, high) for _ in range(in_len)])
        output_lens.append(out_len)
    params = {**p, "num_prompts": num_prompts, "seed": seed, "max_model_len": max_model_len}
    return Workload("sharegpt-like", prompts, output_lens, params=params)


def prefix_workload(*, num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                    seed: int = 0, vocab_size: int | None = None) -> Workload:
    if min(num_prompts, num_prefixes, prefix_len, output_len) < 1 or suffix_len < 0:
        raise ValueError("--num-prompts, --num-prefixes, --prefix-len and --output-len must be >= 1 and "
                         "--suffix-len >= 0")
    rng = random.Random(seed)
    high = _max_id(vocab_size)
    prefixes = [[rng.randint(0, high) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts = [prefixes[i % num_prefixes] + [rng.randint(0, high) for _ in range(suffix_len)]
               for i in range(num_prompts)]
    params = {"num_prompts": num_prompts, "num_prefixes": num_prefixes, "prefix_len": prefix_len,
              "suffix_len": suffix_len, "output_len": output_len, "seed": seed}
    return Workload("prefix", prompts, [output_len] * num_prompts, params=params)


def _max_id(vocab_size: int | None) -> int:
    return min(10000, vocab_size - 1) if vocab_size else 10000


def _clip(value: float, low: int, high: int) -> int:
    return int(min(max(round(value), low), high))


def add_workload_options(parser: Any, *, default_num_prompts: int | None = None) -> None:
    parser.add_argument("--workload", choices=WORKLOADS, default="fixed",
                        help="nano: nano-vllm's published workload; fixed: --num-prompts x --input-len/--output-len; "
                             "sharegpt-like: seeded log-normal lengths (docs/benchmarks.md)")
    parser.add_argument("--num-prompts", type=int, default=default_num_prompts,
                        help="number of requests (default: 256 for nano, 64 otherwise)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (fixed workload)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (fixed workload)")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the workload's random draws")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: 0.6 for nano, as published; 0 = greedy otherwise)")


def workload_from_args(args: Any, *, vocab_size: int | None, max_model_len: int | None = None) -> Workload:
    if args.workload == "nano":
        wl = nano_workload(vocab_size=vocab_size, num_prompts=args.num_prompts)
    elif args.workload == "fixed":
        wl = fixed_workload(num_prompts=args.num_prompts or 64, input_len=args.input_len,
                            output_len=args.output_len, seed=args.workload_seed, vocab_size=vocab_size)
    elif args.workload == "sharegpt-like":
        wl = sharegpt_like_workload(num_prompts=args.num_prompts or 64, seed=args.workload_seed,
                                    vocab_size=vocab_size, max_model_len=max_model_len)
    else:
        raise ValueError(f"--workload {args.workload!r} is not one of {', '.join(WORKLOADS)}")
    if args.temperature is not None:
        if args.temperature < 0:
            raise ValueError(f"--temperature {args.temperature} must be >= 0")
        wl.temperature = args.temperature
    return wl
