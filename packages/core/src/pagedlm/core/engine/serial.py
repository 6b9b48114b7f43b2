"""Wire format between the front end (AsyncLLM) and the engine-core process.

Every ZMQ message is one frame: a msgpack array ``[kind, payload]`` (msgspec's encoder). Objects
travel as plain arrays in a fixed field order rather than pickles, so a message is cheap to
build, cannot run code when decoded, and its layout is spelled out here:

  front end -> core (``InputKind``)
    HELLO     None                                   handshake: proves the input pipe is connected
    ADD       [request_id, prompt_token_ids, arrival_time, [sampling_params fields...],
               prompt_embeds as [dtype name, shape, raw bytes] or None,
               lora_request as [lora_name, lora_int_id, lora_path, base_model_name] or None,
               mm_features as [[modality, hash, offset, length, {name: tensor}], ...] or None, priority]
    ABORT     [request_id, ...]                      engine (child) request ids
    SHUTDOWN  None                                   finish the loop, release the device, exit 0
    UTILITY   [call_id, EngineCore method, [args...]]  between steps (pause, profile, collective_rpc)
  core -> front end (``OutputKind``)
    READY     {"num_gpu_blocks": int, "max_model_len": int, "pid": int}
    OUTPUTS   [timestamp, [output fields...], stats fields or None]
    FAILED    "message"                              startup or a step raised; the process exits
    UTILITY   [call_id, ok, result or error message]   the answer to one UTILITY call

Requests are validated by the front end's Processor before they are sent, so decoding does not
validate again (``SamplingParams.__post_init__`` would also reset the eos ids the Processor added).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pagedlm.core.metrics.stats import EngineStatsSnapshot
from pagedlm.core.request import EngineCoreRequest
from pagedlm.core.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from pagedlm.core.sched import EngineCoreOutput


class InputKind(enum.IntEnum):
    HELLO = 0
    ADD = 1
    ABORT = 2
    SHUTDOWN = 3
    UTILITY = 4


class OutputKind(enum.IntEnum):
    READY = 0
    OUTPUTS = 1
    FAILED = 2
    UTILITY = 3


@dataclass
class EngineCoreOutputs:
    """One batch from the core: the outputs of one step plus a fresh snapshot of its state.

    ``outputs`` may be empty (a prefill chunk that sampled nothing, or a state change such as an
    abort while idle); ``stats`` is None only for clients that do not collect it.
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: EngineStatsSnapshot | None = None
    timestamp: float = field(default_factory=time.time)


_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
_STATS_FIELDS = [f.name for f in dataclasses.fields(EngineStatsSnapshot)]
# NOTE: EngineCoreOutput's constructor parameters, in order: an output travels as their values,
# read with one attrgetter and passed back positionally (a few times cheaper per output than
# getattr and keyword calls, at ~24k outputs/s; serve_host_cost.py).
_OUTPUT_FIELDS = list(inspect.signature(EngineCoreOutput.__init__).parameters)[1:]
_output_values = operator.attrgetter(*_OUTPUT_FIELDS)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode(kind: int, payload: Any = None) -> bytes:
    return _encoder.encode((int(kind), payload))


def decode(frame: bytes) -> tuple[int, Any]:
    kind, payload = _decoder.decode(frame)
    return kind, payload


def peek_kind(frame: bytes) -> int:
    """A frame's kind without decoding its payload: the encoder writes ``[kind, payload]`` as a
    two-element msgpack array (``0x92``) whose first element, a small int, is one byte."""
    if len(frame) > 1 and frame[0] == 0x92 and frame[1] < 0x80:
        return frame[1]
    return decode(frame)[0]


# -- requests ----------------------------------------------------------------------------------
def _params_to_wire(params: SamplingParams) -> list[Any]:
    values = []
    for name in _PARAM_FIELDS:
        value = getattr(params, name)
        if isinstance(value, set):
            value = sorted(value)
        elif isinstance(value, enum.Enum):
            value = int(value.value)
        elif isinstance(value, StructuredOutputsParams):
            value = value.to_wire()
        values.append(value)
    return values


def _params_from_wire(values: list[Any]) -> SamplingParams:
    params = object.__new__(SamplingParams)  # skips __post_init__: see the module docstring
    fields = dict(zip(_PARAM_FIELDS, values))
    fields["all_stop_token_ids"] = set(fields["all_stop_token_ids"] or ())
    fields["output_kind"] = RequestOutputKind(fields["output_kind"])
    if fields["logit_bias"] is not None:
        fields["logit_bias"] = {int(k): float(v) for k, v in fields["logit_bias"].items()}
    if fields["structured_outputs"] is not None:
        fields["structured_outputs"] = StructuredOutputsParams.from_wire(fields["structured_outputs"])
    params.__dict__.update(fields)
    return params


def encode_add(request: EngineCoreRequest) -> bytes:
    payload = [request.request_id, list(request.prompt_token_ids), request.arrival_time,
               _params_to_wire(request.sampling_params), _tensor_to_wire(request.prompt_embeds),
               None if request.lora_request is None else request.lora_request.to_wire(),
               _features_to_wire(request.mm_features), request.priority]
    return encode(InputKind.ADD, payload)


def request_from_wire(payload: list[Any]) -> EngineCoreRequest:
    request_id, prompt_token_ids, arrival_time, params, embeds, lora, features, priority = payload
    from pagedlm.core.lora.request import LoRARequest

    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                             sampling_params=_params_from_wire(params), arrival_time=arrival_time,
                             prompt_embeds=_tensor_from_wire(embeds), lora_request=LoRARequest.from_wire(lora),
                             mm_features=_features_from_wire(features), priority=priority)



def _features_to_wire(features: list[Any] | None) -> list[Any] | None:
    if not features:
        return None
    return [[f.modality, f.identifier, f.offset, f.length, {k: _tensor_to_wire(v) for k, v in f.data.items()}]
            for f in features]


def _features_from_wire(value: list[Any] | None) -> list[Any] | None:
    if not value:
        return None
    from pagedlm.core.multimodal.inputs import MultiModalFeature

    return [MultiModalFeature(modality=m, identifier=h, offset=o, length=n,
                              data={k: _tensor_from_wire(t) for k, t in data.items()})
            for m, h, o, n, data in value]


def _tensor_to_wire(tensor: Any) -> list[Any] | None:
    """A CPU tensor as ``[dtype name, shape, raw bytes]`` (no pickle), or None."""
    if tensor is None:
        return None
    import torch

    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw]


def _tensor_from_wire(value: list[Any] | None) -> Any:
    if value is None:
        return None
    import torch

    dtype_name, shape, raw = value
    dtype = getattr(torch, dtype_name)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a tensor dtype on the wire: {dtype_name!r}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


# -- outputs -----------------------------------------------------------------------------------
def encode_outputs(batch: EngineCoreOutputs) -> bytes:
    outputs = [_output_values(o) for o in batch.outputs]
    stats = None if batch.stats is None else [getattr(batch.stats, n) for n in _STATS_FIELDS]
    return encode(OutputKind.OUTPUTS, [batch.timestamp, outputs, stats])


def outputs_from_wire(payload: list[Any]) -> EngineCoreOutputs:
    timestamp, outputs, stats = payload
    return EngineCoreOutputs(
        outputs=[EngineCoreOutput(*values) for values in outputs],
        stats=None if stats is None else EngineStatsSnapshot(**dict(zip(_STATS_FIELDS, stats))),
        timestamp=timestamp,
    )
