"""``use_beam_search`` on /v1/completions (vLLM's): the front-end beam search of
``pagedlm.core.beam_search`` over the engine, one engine request per live beam and step.

The choices of a prompt are its ``n`` best beams (``n`` is the beam width, as in vLLM), best first,
each as a ``CompletionOutput`` so the completions builder writes the response as usual.
"""

from __future__ import annotations

from typing import Any

from pagedlm.core.beam_search import BeamSearch, BeamSearchParams
from pagedlm.core.outputs import CompletionOutput, RequestOutput
from pagedlm.server.errors import APIError
from pagedlm.server.protocol import CompletionRequest
from pagedlm.server.serving_common import ServerState, merge


def beam_search_params(req: CompletionRequest, n: int, max_tokens: int, stream: bool) -> BeamSearchParams:
    """The request's BeamSearchParams; what beam search cannot honour is a 400 naming it."""
    if stream:
        raise APIError("use_beam_search=true does not stream: send stream=false", param="stream")
    refused = [name for name in ("logprobs", "prompt_logprobs", "stop", "seed", "top_p", "top_k", "logit_bias")
               if getattr(req, name) not in (None, [], 1.0 if name == "top_p" else None)]
    if refused:
        raise APIError(f"{refused[0]} is not supported with use_beam_search=true (beam search keeps the "
                       "most likely beams)", param=refused[0])
    try:
        return BeamSearchParams(beam_width=n, max_tokens=max_tokens, ignore_eos=bool(req.ignore_eos),
                                temperature=req.temperature or 0.0,
                                length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
                                include_stop_str_in_output=bool(req.include_stop_str_in_output))
    except ValueError as e:
        raise APIError(str(e), param="n") from None


async def beam_search_outputs(state: ServerState, prompts: list[Any], params: BeamSearchParams,
                              request_id: str, priority: int) -> list[RequestOutput]:
    """One finished ``RequestOutput`` per prompt (``prompts`` hold ``.text`` and ``.token_ids``)."""
    engine = state.engine
    search = BeamSearch([p.token_ids for p in prompts], params, engine.model_config.eos_token_ids
                        | ({engine.tokenizer.eos_token_id} if getattr(engine.tokenizer, "eos_token_id", None)
                           is not None else set()))
    step_params = search.step_sampling_params()
    step = 0
    while not search.finished:
        beams = search.prompts()
        gens = [engine.generate({"prompt_token_ids": tokens}, step_params, f"{request_id}-beam{step}-{j}",
                                priority=priority) for j, tokens in enumerate(beams)]
        finals: list[Any] = [None] * len(gens)
        async for j, out in merge(gens):
            finals[j] = out
        for out in finals:
            if out is None or out.error:
                raise APIError(f"beam search failed: {getattr(out, 'error', None) or 'aborted'}", status=500)
        search.advance([out.outputs[0].logprobs[0] for out in finals])
        step += 1
    results = []
    for i, (prompt, output) in enumerate(zip(prompts, search.outputs(engine.tokenizer))):
        choices = [CompletionOutput(index=j, text=seq.text or "", token_ids=seq.tokens[len(prompt.token_ids):],
                                    cumulative_logprob=seq.cum_logprob, logprobs=None, finish_reason=seq.finish_reason)
                   for j, seq in enumerate(output.sequences)]
        results.append(RequestOutput(request_id=f"{request_id}-{i}", prompt=prompt.text,
                                     prompt_token_ids=prompt.token_ids, prompt_logprobs=None, outputs=choices,
                                     finished=True))
    return results
