"""Helpers vLLM users import from ``vllm.utils`` (the same names here)."""

from pagedlm.core.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
