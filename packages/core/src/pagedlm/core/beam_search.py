"""Beam search in the front end, over the engine (vLLM's ``LLM.beam_search`` and ``BeamSearchParams``).

Each step asks the engine for one token of every live beam with ``logprobs = 2 * beam_width``
(each beam's prompt is its whole token list, so the prefix cache shares the prompt's and the
beams' common blocks), then keeps the best continuations. The union of every beam's top
``2 * beam_width`` next tokens holds the top ``2 * beam_width`` candidates over all beams, which is
all beam search reads.

Scoring and stopping follow HF transformers' ``generate(num_beams=k, do_sample=False)``, so the
two give the same beams on the same weights:

- candidates are ranked by cumulative logprob; the best ``beam_width`` that do not end the
  sequence go on; a candidate that ends it (an EOS token, or the ``max_tokens``-th token) is a
  finished hypothesis only when it ranks within the first ``beam_width`` candidates;
- a finished hypothesis scores ``cum_logprob / num_generated_tokens ** length_penalty``, the EOS
  counted and the prompt not;
- ``early_stopping`` is HF's: ``False`` (its default) stops once the best live beam, normalised by
  the current length, cannot beat the worst of ``beam_width`` finished ones; ``True`` stops as
  soon as ``beam_width`` are finished; ``"never"`` assumes live beams may grow to ``max_tokens``.

vLLM's own loop differs (docs/vllm-compat.md): it normalises by the whole sequence length (prompt
included, a final EOS not), takes every EOS candidate as finished and always runs ``max_tokens``
steps. With ``ignore_eos=True`` every hypothesis has the same length and the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedlm.core.outputs import Logprob
from pagedlm.core.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (``early_stopping`` is HF's, a pagedlm extension)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width={self.beam_width!r} must be an integer >= 1")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping={self.early_stopping!r} must be True, False or 'never'")


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt and the generated tokens (as vLLM's)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: the score it was ranked by (finished hypotheses: length-normalised)
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class BeamSearchInstance:
    """The search of one prompt: live beams and finished hypotheses."""

    prompt_tokens: list[int]
    beams: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    done: bool = False


class BeamSearch:
    """Drives the search of many prompts; the caller runs one engine step per :meth:`prompts`."""

    def __init__(self, prompt_token_ids: list[list[int]], params: BeamSearchParams, eos_token_ids: set[int]) -> None:
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.instances = [BeamSearchInstance(list(p), [BeamSearchSequence(list(p), [])]) for p in prompt_token_ids]
        self.num_steps = 0
        #: candidates read per beam (HF keeps ``max(2, 1 + #eos) * beam_width`` over all beams)
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * params.beam_width

    @property
    def finished(self) -> bool:
        return all(i.done for i in self.instances)

    def step_sampling_params(self) -> SamplingParams:
        """One token per beam with the candidates' logprobs (the token itself is not read)."""
        return SamplingParams(max_tokens=1, temperature=self.params.temperature, logprobs=self.num_candidates,
                              ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

    def prompts(self) -> list[list[int]]:
        """The token lists of every live beam this step, instance by instance."""
        return [beam.tokens for inst in self.instances if not inst.done for beam in inst.beams]

    def advance(self, step_logprobs: list[dict[int, Logprob]]) -> None:
        """Take the next-token logprobs of each beam of :meth:`prompts` (same order) and move on."""
        p = self.params
        k = p.beam_width
        self.num_steps += 1
        last_step = self.num_steps >= p.max_tokens
        position = 0
        for inst in self.instances:
            if inst.done:
                continue
            candidates = []
            for beam in inst.beams:
                entry = step_logprobs[position]
                position += 1
                for token_id, lp in entry.items():
                    candidates.append((beam.cum_logprob + lp.logprob, token_id, beam, entry))
            # NOTE: ranked by cumulative logprob, ties by the order HF's topk over (beam, token) sees
            candidates.sort(key=lambda c: -c[0])
            candidates = candidates[: self.num_candidates]
            live: list[BeamSearchSequence] = []
            num_generated = self.num_steps
            # NOTE: an instance still searching has passed the stop checks of the step before, so
            # every candidate that ends within the first beam_width is a finished hypothesis
            for rank, (cum, token_id, beam, entry) in enumerate(candidates):
                is_eos = token_id in self.eos_token_ids
                seq = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [entry], cum)
                if is_eos or last_step:
                    if rank < k:
                        seq.score = cum / (num_generated ** p.length_penalty)
                        seq.finish_reason = "stop" if is_eos else "length"
                        inst.finished.append(seq)
                elif len(live) < k:
                    seq.score = cum
                    live.append(seq)
            inst.finished.sort(key=lambda s: -s.score)
            del inst.finished[k:]
            inst.beams = live
            if last_step or not live or self._heuristic_says_stop(inst, num_generated) or (
                    p.early_stopping is True and len(inst.finished) >= k):
                inst.done = True

    def _heuristic_says_stop(self, inst: BeamSearchInstance, num_generated: int) -> bool:
        """HF's early-stop check: no live beam can still beat the worst of ``beam_width`` finished."""
        p = self.params
        if len(inst.finished) < p.beam_width or not inst.beams or num_generated == 0:
            return False
        length = p.max_tokens if (p.early_stopping == "never" and p.length_penalty > 0) else num_generated
        best_possible = inst.beams[0].cum_logprob / (length ** p.length_penalty)
        return best_possible <= min(s.score for s in inst.finished)

    def outputs(self, tokenizer: Any | None) -> list[BeamSearchOutput]:
        results = []
        for inst in self.instances:
            best = sorted(inst.finished, key=lambda s: -s.score)[: self.params.beam_width]
            for seq in best:
                tokens = seq.tokens
                if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    tokens = tokens[:-1]
                if tokenizer is not None:
                    seq.text = tokenizer.decode(tokens[len(inst.prompt_tokens):], skip_special_tokens=True)
            results.append(BeamSearchOutput(best))
        return results


def beam_search_token_ids(processor: Any, prompts: list[Any], params: BeamSearchParams,
                          max_model_len: int) -> list[list[int]]:
    """Each prompt's token ids, checked to leave room for ``max_tokens`` (ValueError otherwise)."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    token_lists = []
    for prompt in prompts:
        _, token_ids = processor.tokenize_prompt(prompt)
        processor.validate(token_ids, SamplingParams(max_tokens=params.max_tokens))
        token_lists.append(token_ids)
    return token_lists


def run_offline(llm: Any, prompts: list[Any], params: BeamSearchParams, *, use_tqdm: bool) -> list[BeamSearchOutput]:
    """``LLM.beam_search``: one ``LLM.generate`` call per step over every live beam of every prompt."""
    engine = llm.llm_engine
    search = BeamSearch(beam_search_token_ids(engine.processor, prompts, params, engine.vllm_config.max_model_len),
                        params, engine.processor.eos_token_ids)
    step_params = search.step_sampling_params()
    steps = range(params.max_tokens)
    if use_tqdm:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="Beam search", dynamic_ncols=True)
    for _ in steps:
        if search.finished:
            break
        beams = search.prompts()
        outputs = llm.generate([{"prompt_token_ids": t} for t in beams], step_params, use_tqdm=False)
        search.advance([out.outputs[0].logprobs[0] for out in outputs])
    return search.outputs(llm.llm_engine.tokenizer)
