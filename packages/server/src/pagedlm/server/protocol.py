"""Request bodies of the OpenAI-compatible API (pydantic models; FastAPI publishes their schemas).

Validation is strict, as OpenAI's own API is: ``"0.5"`` is not a number, ``2.5`` is not an
integer (``2.0`` is, as in JSON Schema), ``1`` is not a boolean, NaN and infinities are refused.
Every field OpenAI marks nullable accepts ``null`` (= the default). Unknown fields are ignored,
so clients that send newer OpenAI parameters keep working; parameters whose meaning we cannot
honour (``suffix``, ...) are refused with a 400 by the serving code instead. Structured outputs
and tools are parsed further by ``structured.py`` and ``tools.py`` (400s naming the field).

Range checks that need the model (context length, vocabulary) happen in the engine's Processor.
Responses are built as plain dicts in ``serving_*`` modules, field by field as OpenAI sends them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from pagedlm.core.text import utf8_problem

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Largest seed accepted: choice i of a request with n > 1 samples with seed + i (n <= 128).
MAX_SEED = INT64_MAX - 128
MAX_N = 128
#: default of --max-logprobs (vLLM's default max_logprobs)
MAX_LOGPROBS = 20


# Integer fields (or lists of integers): JSON Schema, and so the schema we publish, counts 2.0
# as an integer, so 2.0 is accepted there as 2 (2.5 and "2" are still refused).
_INT_FIELDS = frozenset({"n", "seed", "priority", "top_k", "min_tokens", "max_tokens", "logprobs", "best_of",
                         "max_completion_tokens", "top_logprobs", "stop_token_ids", "allowed_token_ids",
                         "logprob_token_ids", "prompt", "tokens",
                         "prompt_logprobs", "truncate_prompt_tokens", "input", "dimensions",
                         "max_output_tokens"})


#: the pydantic error type of text that cannot be encoded as UTF-8 (errors.py reports it first)
TEXT_NOT_UTF8 = "text_not_utf8"


def _encodable(value: str) -> str:
    problem = utf8_problem(value)
    if problem is not None:
        raise PydanticCustomError(TEXT_NOT_UTF8, "{problem}", {"problem": problem})
    return value


#: a string that must be valid Unicode: every string of a request is one, since each may reach a
#: tokenizer, a stop-string matcher or an error message encoded as UTF-8
Text = Annotated[str, AfterValidator(_encodable)]


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        kinds = set(map(type, value))  # (C speed: a prompt of token ids has thousands)
        return [_integral(v) for v in value] if float in kinds or list in kinds else value
    return value


class OpenAIModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _integral_floats(cls, value: Any, info: Any) -> Any:
        return _integral(value) if info.field_name in _INT_FIELDS else value


class StreamOptions(OpenAIModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's extension: with include_usage, every chunk also carries the usage so far")


class SamplingFields(OpenAIModel):
    """Sampling parameters shared by completions and chat (OpenAI's, then vLLM's extensions)."""

    model: Text | None = Field(None, description="served model name; default: the only model served")
    n: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=MAX_SEED)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[Text, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit"
    )
    user: Text | None = None
    # vLLM extensions
    # (the upper bounds keep every integer within what the engine's wire format carries)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX, description="-1 or 0 disables top-k")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = Field(None, description="sample only among these token ids")
    logprob_token_ids: list[int] | None = Field(
        None, description="with logprobs: the logprobs of these token ids at each generated position, in place of the "
                          "top ones (the sampled token's too)")
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    return_token_ids: bool | None = Field(
        None, description="also return token ids: the prompt's and the generated ones (in a stream: the prompt's "
                          "in each choice's first chunk, each chunk's own generated ids)")
    prompt_logprobs: int | None = Field(
        None, ge=-1, description="logprobs of the prompt's tokens with this many alternatives each (-1: the whole "
                                 "vocabulary, within --max-logprobs); not with stream=true")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="keep at most this many prompt tokens (-1: max_model_len - 1)")
    use_beam_search: bool | None = Field(
        None, description="vLLM's beam search (/v1/completions only): the n best beams of width n, not streamed")
    length_penalty: float | None = Field(None, description="beam search: scores divide by length ** length_penalty")
    priority: int | None = Field(
        None, ge=INT64_MIN, le=INT64_MAX,
        description="vLLM's scheduling priority (lower first); nonzero needs --scheduling-policy priority")
    return_tokens_as_token_ids: bool | None = Field(
        None, description="write the tokens of logprobs as 'token_id:<id>' (for tokens that are not valid text alone)")
    kv_transfer_params: dict[Text, Any] | None = Field(
        None, description="KV-transfer parameters for the engine's KV connector (disaggregated prefill: what a "
                          "prefill instance's response returned, passed to the decode instance)")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="with truncate_prompt_tokens: 'right' keeps the first tokens, 'left' the last (default: "
                          "the tokenizer's side, else 'right')")
    vllm_xargs: dict[Text, Any] | None = Field(
        None, description="vLLM's extra arguments for custom logits processors (SamplingParams.extra_args)")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's structured outputs: one of json (a JSON Schema), regex, choice, grammar (EBNF), "
                          "json_object, structural_tag; plus disable_any_whitespace, disable_additional_properties")
    # vLLM's older names of structured_outputs' fields
    guided_json: Text | dict[str, Any] | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None


class CompletionRequest(SamplingFields):
    # NOTE: optional: a request may give vLLM's prompt_embeds instead (or both); one without
    # either is a 400 naming prompt.
    prompt: Text | list[Text] | list[int] | list[list[int]] | None = Field(
        None, description="a string, a list of strings, a list of token ids or a list of lists of token ids"
    )
    prompt_embeds: Text | list[Text] | None = Field(
        None, description="vLLM's prompt embeddings: base64 of a [num_tokens, hidden_size] tensor written by "
                          "torch.save (needs --enable-prompt-embeds); their prompts come before prompt's")
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX, description="default 16")
    logprobs: int | None = Field(None, ge=-1, description="-1: the whole vocabulary (within --max-logprobs)")
    echo: bool | None = None
    suffix: Text | None = Field(None, description="not supported: must be null")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="must equal n when given")
    add_special_tokens: bool | None = None


class ChatImageURL(OpenAIModel):
    url: Text
    detail: Text | None = None


class ChatContentPart(OpenAIModel):
    type: Text
    text: Text | None = None
    #: ``{"type": "image_url", "image_url": {"url": ...}}`` (multimodal models)
    image_url: ChatImageURL | None = None
    #: ``{"type": "image_embeds", "image_embeds": base64 of a torch.save()d [feature_size, hidden]
    #: tensor}`` (vLLM's; needs --enable-mm-embeds)
    image_embeds: Text | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ChatContentPart] | None = None
    name: Text | None = None
    #: an assistant message's tool calls ({"id", "type": "function", "function": {"name", "arguments"}})
    tool_calls: list[dict[str, Any]] | None = None
    #: a tool message: the id of the call it answers
    tool_call_id: Text | None = None
    #: an assistant message's thinking (reasoning models); templates that show it read it
    reasoning_content: Text | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX,
                                   description="deprecated by OpenAI: use max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=-1, description="-1: the whole vocabulary (within --max-logprobs)")
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = Field(
        None, description="template the last (assistant) message open, for the model to continue it; not with "
                          "add_generation_prompt")
    echo: bool | None = Field(None, description="start each choice's content with the last message's content when "
                                                "that message is the assistant's")
    # Parsed by tools.py and structured.py, which name the bad field in their 400s.
    tools: list[Any] | None = Field(None, description="function tools ({\"type\": \"function\", \"function\": "
                                                      "{\"name\", \"description\", \"parameters\"}})")
    tool_choice: Any = Field(None, description="\"none\", \"auto\" (default with tools), \"required\" or "
                                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = Field(
        None, description="{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                          "\"json_schema\": {\"name\", \"schema\", \"strict\"}}")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (e.g. enable_thinking)")


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch: the fields of a chat request, ``messages`` a list of
    conversations (each answered by the choice of its index)."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(  # type: ignore[assignment]
        min_length=1, description="the conversations, each a list of messages")


class TokenizeRequest(OpenAIModel):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = Field(None, description="also return the tokenizer's piece of every id")
    # with messages: rendered by the chat template as /v1/chat/completions renders them
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIModel):
    model: Text | None = None
    tokens: list[int]


class EmbeddingRequest(OpenAIModel):
    """POST /v1/embeddings (OpenAI's, plus vLLM's extensions); /pooling takes the same body."""

    model: Text | None = None
    input: Text | list[Text] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids or a list of lists of token ids")
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1, le=INT64_MAX,
                                   description="shorten the embeddings (matryoshka models only)")
    user: Text | None = None
    # vLLM extensions
    normalize: bool | None = Field(None, description="L2-normalize (default: the model's pooler says)")
    add_special_tokens: bool | None = None
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)


class ResponsesInputMessage(OpenAIModel):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[dict[str, Any]]


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses: text input and output (OpenAI's Responses API)."""

    model: Text | None = None
    input: Text | list[ResponsesInputMessage]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = None
    store: bool | None = None
    user: Text | None = None
    metadata: dict[str, Text] | None = None
    # accepted so that they can be refused by name (serving_responses)
    tools: list[Any] | None = None
    previous_response_id: Text | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    seed: int | None = Field(None, ge=INT64_MIN, le=MAX_SEED)
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for model in models:
        names.update(model.model_fields)
    return frozenset(names)


#: every field name of every request model (tells field names from pydantic's union-member tags)
FIELD_NAMES = _field_names(StreamOptions, CompletionRequest, ChatContentPart, ChatMessage,
                           ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, EmbeddingRequest,
                           ResponsesRequest)

#: what a field that is a union of types accepts, for error messages
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "input": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "content": "a string or a list of content parts ({\"type\": \"text\", \"text\": ...})",
}
