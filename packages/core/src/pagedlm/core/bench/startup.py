"""``pagedlm bench startup``: ``LLM(...)`` construction to the first generated token, split into phases.

Each run is a fresh Python process: imports, kernel compiles, graph captures and the allocator's
first requests cost what they cost only once per process, so a second ``LLM(...)`` in the same
process would measure a warm start no user gets. The child times, with ``time.perf_counter``:

* ``import torch``, then ``from pagedlm.core import LLM, SamplingParams`` (the package itself is
  lazy: importing ``LLM`` is what loads the engine's modules; torch is already loaded by then);
* ``LLM(...)``, and generating 1 token for a 4-token prompt of token ids;
* "LLM(...) to first token": the two together, the headline figure.

``LLM(...)`` is split by timing the model runner's start-up methods, whichever of ``load_model``,
``compile_kernels``, ``profile_run``, ``initialize_kv_cache`` and ``capture_model`` its class has
(the CUDA runner has all five; the CPU runner's ``profile_run`` is core's no-op). Each phase is
reported as measured, as a start offset from the beginning of ``LLM(...)`` and a duration; phases
nest (``compile_kernels`` runs inside ``load_model``, ``capture_model`` inside
``initialize_kv_cache``), so durations do not add up. Each phase ends with a device synchronize,
so queued device work counts in the phase that queued it. The time before the first phase is the
engine's config, the tokenizer (unless skipped), plugins and platform, the worker and the device
runtime; the time after the last one is the rest of the engine's set-up (scheduler, request and
output processors). Phases run in a worker in another process (``--tensor-parallel-size`` > 1,
data parallelism) are not seen: none is reported then.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from pagedlm.core.bench import common

PHASES = ("load_model", "compile_kernels", "profile_run", "initialize_kv_cache", "capture_model")

#: (result key, label): the per-run figures, in the order they happen
FIGURES = (
    ("import_torch_s", "import torch"),
    ("import_pagedlm_s", "import pagedlm.core (LLM)"),
    ("llm_init_s", "LLM(...)"),
    ("first_token_s", "first token (generate 1)"),
    ("llm_to_first_token_s", "LLM(...) to first token"),
    ("process_s", "process, spawn to exit"),
)

#: the child's result is the one stdout line that starts with this (the engine may print too)
RESULT_PREFIX = "PAGEDLM_BENCH_STARTUP_RESULT "

# Run with ``python -c``: the imports must be timed before anything of pagedlm is loaded.
_CHILD_CODE = """\
import sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from pagedlm.core import LLM, SamplingParams
t2 = time.perf_counter()
from pagedlm.core.bench.startup import child_main
child_main(sys.argv[1], import_torch_s=t1 - t0, import_pagedlm_s=t2 - t1)
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("startup", help="start-up time: LLM(...) to the first token, split into phases",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-runs", type=int, default=1, help="fresh processes to start, one after another")
    common.add_engine_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.num_runs < 1:
        raise ValueError(f"--num-runs must be >= 1 (got {args.num_runs})")
    return common.run_offline(args, None, measure, _print)


# -- the parent ---------------------------------------------------------------------------------
def measure(args: argparse.Namespace, setup: common.EngineSetup) -> dict[str, Any]:
    spec = {"kwargs": setup.kwargs, "model_label": setup.model_label, "model_config": setup.model_config_name}
    runs = []
    for i in range(1, args.num_runs + 1):
        print(f"startup run {i}/{args.num_runs}: a fresh process", file=sys.stderr, flush=True)
        runs.append(_run_child(spec, f"run {i} of {args.num_runs}"))
    engine = [r.pop("engine") for r in runs][0]  # the same for every run
    return {
        "benchmark": "startup",
        "engine": engine,
        "args": {"num_runs": args.num_runs, "model_config": setup.model_config_name, "engine_kwargs": setup.kwargs},
        "runs": runs,
        "median": _medians(runs),
    }


def _run_child(spec: dict[str, Any], what: str) -> dict[str, Any]:
    """One child's result; a ValueError naming what went wrong (and keeping its stderr) if it failed."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD_CODE, json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    process_s = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    result = json.loads(lines[-1].removeprefix(RESULT_PREFIX)) if lines else None
    if proc.returncode == 0 and result is not None and "error" not in result:
        result["process_s"] = process_s
        return result
    with tempfile.NamedTemporaryFile("w", prefix="pagedlm-bench-startup-", suffix=".log", delete=False,
                                     encoding="utf-8") as log:
        log.write(proc.stderr)
    # The child's own report of its exception, else (killed, crashed in an import) its last words.
    reason = result["error"] if result and "error" in result else "\n".join(proc.stderr.splitlines()[-15:])
    raise ValueError(f"start-up {what} failed: the child process exited with code {proc.returncode}: "
                     f"{reason}\n(its full stderr: {log.name})")


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in FIGURES] + ["before_first_phase_s", "after_last_phase_s"]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in keys
                           if all(r[k] is not None for r in runs)}
    per_phase: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        # reversed: a phase called twice in one start-up (none is today) counts with its first call
        for name, p in {p["name"]: p for p in reversed(r["phases"])}.items():
            per_phase.setdefault(name, []).append(p)
    medians = {name: {k: statistics.median(p[k] for p in ps) for k in ("start_s", "duration_s")}
               for name, ps in per_phase.items()}
    out["phases"] = dict(sorted(medians.items(), key=lambda kv: kv[1]["start_s"]))
    return out


# -- the child ----------------------------------------------------------------------------------
def child_main(spec_json: str, *, import_torch_s: float, import_pagedlm_s: float) -> None:
    """Measure one start-up and print its result line; on an exception print the traceback to
    stderr (for the log) and a result line that names the exception, and exit 1."""
    try:
        result = {"import_torch_s": import_torch_s, "import_pagedlm_s": import_pagedlm_s,
                  **_measure_child(json.loads(spec_json))}
    except Exception as e:  # noqa: BLE001 - any failure is reported to the parent, which says what failed
        import traceback

        traceback.print_exc()
        print(RESULT_PREFIX + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(1)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _measure_child(spec: dict[str, Any]) -> dict[str, Any]:
    from pagedlm.core import LLM, SamplingParams

    kwargs = spec["kwargs"]
    phases: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    # The platform LLM(...) would resolve first is resolved inside the clock: its cost stays in.
    platform = _time_runner_phases(kwargs.get("device") or "auto", phases, t0)
    llm = LLM(**kwargs)
    t1 = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=1), use_tqdm=False)
    t2 = time.perf_counter()
    phases.sort(key=lambda p: p["start_s"])
    # what engine_summary reads of an EngineSetup
    setup = argparse.Namespace(kwargs=kwargs, model_label=spec["model_label"], model_config_name=spec["model_config"])
    engine = {**common.engine_summary(llm, setup), **platform.get_device_description()}  # type: ignore[arg-type]
    llm.shutdown()
    return {
        "llm_init_s": t1 - t0,
        "first_token_s": t2 - t1,
        "llm_to_first_token_s": t2 - t0,
        "before_first_phase_s": phases[0]["start_s"] if phases else None,
        "after_last_phase_s": (t1 - t0) - max(p["start_s"] + p["duration_s"] for p in phases) if phases else None,
        "phases": phases,
        "engine": engine,
    }


def _time_runner_phases(device: str, phases: list[dict[str, Any]], t0: float) -> Any:
    """Wrap the phase methods of the model runner class the platform of ``device`` hands its
    workers, when a worker asks for it (the platform needs the engine's config to answer).
    Returns the platform."""
    import functools

    from pagedlm.core.platforms import resolve_platform
    from pagedlm.core.plugins import resolve_class_path

    platform = resolve_platform(device)
    get_cls = platform.get_model_runner_cls
    wrapped: set[type] = set()

    def timed(name: str, method: Any) -> Any:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                platform.synchronize()
                phases.append({"name": name, "start_s": start - t0, "duration_s": time.perf_counter() - start})
        return call

    def get_model_runner_cls(vllm_config: Any) -> str:
        path = get_cls(vllm_config)
        cls = resolve_class_path(path)
        if cls not in wrapped:
            wrapped.add(cls)
            for name in PHASES:
                if hasattr(cls, name):
                    setattr(cls, name, timed(name, getattr(cls, name)))
        return path

    platform.get_model_runner_cls = get_model_runner_cls  # type: ignore[method-assign]
    return platform


# -- output -------------------------------------------------------------------------------------
def _print(r: dict[str, Any]) -> None:
    e, runs, med = r["engine"], r["runs"], r["median"]
    several = len(runs) > 1

    def figure(key: str) -> str:
        if not several:
            return f"{runs[0][key]:.3f}"
        return f"{med[key]:.3f} (median; runs: {', '.join(f'{x[key]:.3f}' for x in runs)})"

    common.print_table("pagedlm bench startup", [
        ("model", f"{e['model']} ({e['device']}, {e['dtype']}, load_format={e['load_format']})"),
        *([("gpu", e["gpu"])] if e.get("gpu") else []),
        ("runs", f"{len(runs)}, each a fresh process"),
        *[(f"{label} (s)", figure(key)) for key, label in FIGURES],
    ])
    print("\nphases of LLM(...), seconds from its start (nested phases indented; they run inside the one above):")
    print(f"  {'run':<7} {'phase':<26} {'start':>8} {'duration':>9}")
    for i, run in enumerate(runs, 1):
        _print_phases(str(i), run["phases"], run["before_first_phase_s"], run["after_last_phase_s"], run["llm_init_s"])
    if several:
        phases = [{"name": n, **v} for n, v in med["phases"].items()]
        _print_phases("median", phases, med.get("before_first_phase_s"), med.get("after_last_phase_s"),
                      med["llm_init_s"])


def _print_phases(run: str, phases: list[dict[str, Any]], before: float | None, after: float | None,
                  total: float) -> None:
    if not phases:
        print(f"  {run:<7} no model-runner phase ran in this process (workers in other processes)")
        return
    rows = [(f"before {phases[0]['name']}", 0.0, before)]
    for p in phases:
        end = p["start_s"] + p["duration_s"]
        depth = sum(1 for o in phases if o is not p and o["start_s"] <= p["start_s"]
                    and o["start_s"] + o["duration_s"] >= end)
        rows.append(("  " * depth + p["name"], p["start_s"], p["duration_s"]))
    rows.append(("after the last phase", total - after, after))
    for name, start, duration in rows:
        print(f"  {run:<7} {name:<26} {start:>8.3f} {duration:>9.3f}")

