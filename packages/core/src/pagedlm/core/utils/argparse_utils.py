"""``FlexibleArgumentParser``: the argparse parser vLLM's scripts build their command lines with.

What it adds to ``argparse.ArgumentParser`` (vLLM's behaviour):

- long options may be spelled with underscores: ``--max_model_len 512`` is ``--max-model-len 512``
  (only the option name is rewritten, never its value), and options declared with underscores
  answer to both spellings;
- ``--config FILE.yaml`` reads options from a YAML mapping (``max_model_len: 512``, lists for
  ``nargs`` options, booleans for flags); options on the command line win over the file's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["FlexibleArgumentParser"]


class FlexibleArgumentParser(argparse.ArgumentParser):
    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        # an option declared with underscores answers to its dashed spelling, which parse_args uses
        dashed = [_dash_option(n) for n in name_or_flags if n.startswith("--") and "_" in n]
        return super().add_argument(*name_or_flags, *(d for d in dashed if d not in name_or_flags), **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        argv = [_dash_option(a) for a in argv]
        if "--config" in argv or any(a.startswith("--config=") for a in argv):
            argv = _expand_config(argv)
        return super().parse_args(argv, namespace)


def _dash_option(arg: str) -> str:
    if not arg.startswith("--") or arg == "--":
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def _expand_config(argv: list[str]) -> list[str]:
    """``--config FILE`` replaced by the file's options, placed first so the command line wins."""
    rest, path = [], None
    i = 0
    while i < len(argv):
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise SystemExit("--config needs a YAML file")
            path = argv[i + 1]
            i += 2
            continue
        if argv[i].startswith("--config="):
            path = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    try:
        import yaml
    except ImportError:
        raise SystemExit("--config needs PyYAML: pip install pyyaml") from None
    with open(path, encoding="utf-8") as f:  # type: ignore[arg-type]
        options = yaml.safe_load(f) or {}
    if not isinstance(options, dict):
        raise SystemExit(f"--config {path}: expected a mapping of option names to values")
    expanded: list[str] = []
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            expanded.append(flag)
        elif value is False:
            expanded.append("--no-" + flag[2:])
        elif isinstance(value, list):
            expanded += [flag, *map(str, value)]
        else:
            expanded += [flag, str(value)]
    return expanded + rest
