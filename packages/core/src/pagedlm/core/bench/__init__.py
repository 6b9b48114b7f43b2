"""``pagedlm bench``: benchmarks that print a summary and save JSON (docs/benchmarks.md).

Subcommands, one module each: ``throughput``, ``latency``, ``serve``, ``prefix``, ``spec`` and
``startup``. Importing this package is cheap; each subcommand imports the engine only when it runs.
"""

from __future__ import annotations

import argparse

SUBCOMMANDS = ("throughput", "latency", "serve", "prefix", "spec", "startup")


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``pagedlm bench <subcommand>`` on the top-level CLI's subparsers."""
    from pagedlm.core.bench import latency, prefix, serve, spec, startup, throughput

    p = subparsers.add_parser("bench", description=__doc__,
                              help="benchmarks: throughput, latency, serve, prefix, spec, startup (print + save JSON)")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for module in (throughput, latency, serve, prefix, spec, startup):
        module.add_parser(sub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
