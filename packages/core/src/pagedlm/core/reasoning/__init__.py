"""Reasoning parsers: split a reasoning model's thinking from its answer (``--reasoning-parser``).

Parsers register through ``pagedlm_register_reasoning_parsers``; pagedlm-core registers the
``<think>...</think>`` ones (``deepseek_r1``, ``qwen3``) in ``think.py``.
"""

from __future__ import annotations

from pagedlm.core.reasoning.parser import ReasoningParser, get_reasoning_parser

__all__ = ["ReasoningParser", "get_reasoning_parser"]
