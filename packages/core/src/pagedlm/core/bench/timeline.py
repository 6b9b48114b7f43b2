"""KV-cache memory over time: per-step samples from the engine's stats hook, and their picture.

``StepRecorder`` listens to ``EngineCore.add_stats_listener`` (the engine builds the stats object
only while a listener exists) and keeps one small dict per step. ``plot_timelines`` draws one
column per run (e.g. prefix caching on / off) with three rows sharing the step axis:

1. KV blocks, stacked: held by running requests | free but still holding prefix-cache content
   (reusable by a later hit, evicted LRU when space is needed) | empty. The stack always sums to
   the cache size, so the picture reads as "how full is the cache".
2. Requests running and waiting, with a red mark at each step that preempted requests.
3. Tokens scheduled per step, split into prefill (prompt) and decode tokens.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from typing import Any

SAMPLE_FIELDS = (
    "step", "time_s", "used_blocks", "cached_free_blocks", "empty_blocks", "num_blocks", "kv_cache_usage",
    "running", "waiting", "preemptions", "scheduled_tokens", "prefill_tokens", "decode_tokens",
    "prefix_cache_queries", "prefix_cache_hits",
)


class StepRecorder:
    """Collects one sample per engine step while ``active``; attach once, right after warm-up."""

    def __init__(self, llm: Any) -> None:
        self.samples: list[dict[str, Any]] = []
        self.active = True
        self._t0 = time.perf_counter()
        self._step0: int | None = None
        llm.llm_engine.core.add_stats_listener(self._on_step)

    def restart_clock(self) -> None:
        self._t0 = time.perf_counter()

    def _on_step(self, s: Any) -> None:
        if not self.active:
            return
        if self._step0 is None:
            self._step0 = s.step - 1  # steps count from 1 in each run, whatever warm-up did
        self.samples.append({
            "step": s.step - self._step0,
            "time_s": time.perf_counter() - self._t0,
            "used_blocks": s.num_used_blocks,
            "cached_free_blocks": s.num_cached_free_blocks,
            "empty_blocks": s.num_blocks - s.num_used_blocks - s.num_cached_free_blocks,
            "num_blocks": s.num_blocks,
            "kv_cache_usage": s.kv_cache_usage,
            "running": s.num_running_reqs,
            "waiting": s.num_waiting_reqs,
            "preemptions": s.num_preemptions,
            "scheduled_tokens": s.num_scheduled_tokens,
            "prefill_tokens": s.num_prefill_tokens,
            "decode_tokens": s.num_decode_tokens,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
        })

    def finish(self, llm: Any) -> None:
        """Stop recording and add the state after the last step, read from the KV-cache manager.

        Each step's sample is taken when it is scheduled, so the blocks that finished requests leave
        to the prefix cache would otherwise never show.
        """
        self.active = False
        if not self.samples:
            return
        kv = llm.llm_engine.core.scheduler.kv_cache_manager
        used = kv.num_blocks - kv.num_free_blocks
        cached = kv.num_cached_free_blocks
        self.samples.append({
            **dict.fromkeys(SAMPLE_FIELDS, 0),
            "step": self.samples[-1]["step"] + 1,
            "time_s": time.perf_counter() - self._t0,
            "used_blocks": used,
            "cached_free_blocks": cached,
            "empty_blocks": kv.num_blocks - used - cached,
            "num_blocks": kv.num_blocks,
            "kv_cache_usage": kv.usage,
            "prefix_cache_queries": kv.prefix_cache_stats.num_queries_tokens,
            "prefix_cache_hits": kv.prefix_cache_stats.num_hit_tokens,
        })

    def summary(self) -> dict[str, Any]:
        s = self.samples
        if not s:
            return {"num_steps": 0}
        return {
            "num_steps": len(s) - 1,  # the last sample is the state after the run (see finish)
            "peak_kv_cache_usage": max(x["kv_cache_usage"] for x in s),
            "peak_used_blocks": max(x["used_blocks"] for x in s),
            "num_blocks": s[-1]["num_blocks"],
            "num_preemptions": sum(x["preemptions"] for x in s),
            "steps_with_preemption": sum(1 for x in s if x["preemptions"]),
            "peak_running": max(x["running"] for x in s),
            "prefill_tokens_computed": sum(x["prefill_tokens"] for x in s),
            "decode_tokens_computed": sum(x["decode_tokens"] for x in s),
        }


def timeline_json_path(png_path: str) -> str:
    root, _ = os.path.splitext(png_path)
    return root + ".json"


def write_timelines(png_path: str, runs: list[tuple[str, list[dict[str, Any]]]], title: str,
                    config: dict[str, Any]) -> tuple[str, str]:
    """Draw ``runs`` (label, samples) into ``png_path`` and save the samples beside it as JSON."""
    json_path = timeline_json_path(png_path)
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump({"title": title, "config": config, "fields": list(SAMPLE_FIELDS),
                   "runs": [{"label": label, "samples": samples} for label, samples in runs]}, f)
        f.write("\n")
    plot_timelines(png_path, runs, title)
    return png_path, json_path


def plot_timelines(png_path: str, runs: list[tuple[str, list[dict[str, Any]]]], title: str) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--kv-timeline needs matplotlib: pip install 'pagedlm-core[plot]'") from e
    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    ncols = len(runs)
    fig, axes = plt.subplots(3, ncols, figsize=(7.5 * ncols + 1.8, 9.0), sharex="col", squeeze=False,
                             gridspec_kw={"height_ratios": [2.2, 1.3, 1.3]})
    # One scale per row for every column, so runs compare at a glance.
    all_samples = [s for _, samples in runs for s in samples]
    req_top = max([max(s["running"], s["waiting"]) for s in all_samples] + [1])
    tok_top = max([s["scheduled_tokens"] for s in all_samples] + [1])
    blocks_top = max([s["num_blocks"] for s in all_samples] + [1])
    colors = {"used": "#1f77b4", "cached": "#ff9f1c", "empty": "#d9d9d9", "running": "#2ca02c",
              "waiting": "#9467bd", "preempt": "#d62728", "prefill": "#8c564b", "decode": "#17becf"}
    for col, (label, samples) in enumerate(runs):
        ax_kv, ax_req, ax_tok = axes[0][col], axes[1][col], axes[2][col]
        steps = [s["step"] for s in samples]
        if not samples:
            ax_kv.set_title(f"{label}: no engine steps recorded")
            continue
        num_blocks = samples[-1]["num_blocks"]
        ax_kv.stackplot(
            steps, [s["used_blocks"] for s in samples], [s["cached_free_blocks"] for s in samples],
            [s["empty_blocks"] for s in samples],
            labels=["in use by requests", "free, kept by prefix cache", "empty"],
            colors=[colors["used"], colors["cached"], colors["empty"]], step="post",
        )
        ax_kv.set_ylim(0, blocks_top * 1.02)
        ax_kv.set_ylabel(f"KV blocks (of {num_blocks:,})")
        peak = max(s["used_blocks"] for s in samples)
        n_pre = sum(s["preemptions"] for s in samples)
        last = samples[-1]
        hit = last["prefix_cache_hits"] / last["prefix_cache_queries"] if last["prefix_cache_queries"] else 0.0
        ax_kv.set_title(f"{label}\npeak {peak:,}/{num_blocks:,} blocks ({peak / num_blocks:.0%}), "
                        f"{n_pre} preemptions, prefix hit rate {hit:.0%}, {last['time_s']:.1f}s", fontsize=10)

        ax_req.step(steps, [s["running"] for s in samples], where="post", color=colors["running"], label="running")
        ax_req.step(steps, [s["waiting"] for s in samples], where="post", color=colors["waiting"], label="waiting")
        pre_steps = [s["step"] for s in samples if s["preemptions"]]
        if pre_steps:
            ax_req.scatter(pre_steps, [req_top * 1.08] * len(pre_steps), marker="v", color=colors["preempt"], s=18,
                           label="preemption", zorder=3)
        ax_req.set_ylabel("requests")
        ax_req.set_ylim(0, req_top * 1.18)

        # Log scale: a prefill step schedules ~100x the tokens of a decode step, and both must show.
        # Decode bars are drawn over prefill bars (not stacked), the taller one stays visible.
        ax_tok.bar(steps, [s["prefill_tokens"] for s in samples], width=1.0, color=colors["prefill"],
                   label="prefill tokens", align="edge")
        ax_tok.bar(steps, [s["decode_tokens"] for s in samples], width=1.0, color=colors["decode"],
                   label="decode tokens", align="edge", alpha=0.85)
        ax_tok.set_yscale("log")
        ax_tok.set_ylim(0.8, tok_top * 2.0)
        ax_tok.set_ylabel("tokens scheduled (log)")
        ax_tok.set_xlabel("engine step")
        for ax in (ax_kv, ax_req, ax_tok):
            ax.grid(alpha=0.3)
            ax.set_xlim(0, max(steps) + 1)
            if col == ncols - 1:  # one legend per row, outside the data, right of the last column
                ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, framealpha=0.9)
    # Long configuration lines must wrap, not run off a narrow (one-run) figure.
    width = 95 * ncols
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.splitlines()), fontsize=11)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110, bbox_inches="tight")
    plt.close(fig)
