"""``python -m pagedlm.core.testing.conformance --device NAME [...]``: exit 0 when the backend
conforms, 1 when a check fails, 2 when the arguments name no usable device, backend or dtype."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pagedlm.core.testing.conformance",
        description="Check a pagedlm backend's attention and layer ops against the CPU references "
                    "and its greedy output against HF transformers.",
    )
    p.add_argument("--device", required=True, help="registered platform name (device=), e.g. cpu, cuda")
    p.add_argument("--attention-backend", default=None,
                   help="registered attention backend name (default: the platform's choice)")
    p.add_argument("--dtype", default=None,
                   help="comma-separated compute dtypes, e.g. float32,bfloat16 (default: the platform's)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (minutes become seconds)")
    p.add_argument("--skip-e2e", action="store_true", help="skip the end-to-end HF parity checks")
    p.add_argument("--skip-ops", action="store_true", help="skip the layer-op checks")
    p.add_argument("--verbose", action="store_true", help="keep the engine's INFO logs (stderr)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from pagedlm.core.testing.conformance.runner import run_conformance

    args = build_parser().parse_args(argv)
    if not args.verbose:
        # the result lines are the output; engine start-up chatter would bury them
        logging.getLogger("pagedlm").setLevel(logging.WARNING)
    try:
        report = run_conformance(args.device, args.attention_backend, args.dtype, quick=args.quick,
                                 skip_e2e=args.skip_e2e, skip_ops=args.skip_ops,
                                 on_result=lambda r: print(r.line(), flush=True))
    except (ValueError, TypeError, ImportError, RuntimeError) as e:
        print(f"conformance: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(report.summary(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
