"""Structured outputs: grammar-constrained decoding (JSON Schema, regex, choice, EBNF).

- ``params``: :class:`StructuredOutputsParams`, what a request asks for (``SamplingParams.structured_outputs``).
- ``backend``: the interface a grammar engine implements; backends register through the
  ``pagedlm_register_structured_output_backends`` hook (xgrammar is the built-in one).
- ``manager``: the engine core's side: compiles grammars on a thread pool (cached by spec), holds
  a request out of the scheduler until its grammar is ready, fills the bitmask rows of the
  requests that sample in a step and advances each request's matcher with its sampled tokens.
- ``bitmask``: the worker's side: applies a step's bitmask rows to the logits before sampling.

Nothing here imports a grammar engine until a request asks for one.
"""

from pagedlm.core.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
