"""vLLM V1's logits-processor interface: batch bookkeeping and the sampler's use of processors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedlm.core.sample import Sampler, build_sampling_metadata
from pagedlm.core.sample.logits_processor import (
    BatchLogitsProcessors,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessors,
    MoveDirectionality,
    process_dict_updates,
    resolve_logits_processor_classes,
)
from pagedlm.core.sampling_params import SamplingParams
from pagedlm.core.testing.logits_processors import DummyLogitsProcessor, TopOneLogitsProcessor

UNI = MoveDirectionality.UNIDIRECTIONAL


class Recorder(LogitsProcessor):
    """Keeps a model of the batch from the updates alone: index -> request (by its params)."""

    def __init__(self, vllm_config=None, device=None, is_pin_memory=False) -> None:
        self.batch: dict[int, str] = {}
        self.updates: list[BatchUpdate | None] = []

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)
        process_dict_updates(self.batch, batch_update, lambda params, _p, _o: params.extra_args["name"])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def _state(name: str) -> SimpleNamespace:
    return SimpleNamespace(sampling_params=SamplingParams(extra_args={"name": name}), prompt_token_ids=[1, 2],
                           output_token_ids=[], prompt_embeds=None)


def _requests(*names: str) -> dict[str, SimpleNamespace]:
    return {n: _state(n) for n in names}


def test_batch_updates_follow_vllms_model():
    """The design doc's example: [A,B,C,D], E joins, A and C leave -> E replaces A at 0, C's
    slot 2 is removed and D moves 3 -> 2."""
    rec = Recorder()
    tracker = BatchLogitsProcessors(LogitsProcessors([rec]))
    tracker.update(_requests("A", "B", "C", "D"), 1)
    first = rec.updates[-1]
    assert first is not None and first.batch_size == 4 and not first.removed and not first.moved
    assert [(i, p.extra_args["name"]) for i, p, _, _ in first.added] == [(0, "A"), (1, "B"), (2, "C"), (3, "D")]
    tracker.update(_requests("B", "D", "E"), 2)
    update = rec.updates[-1]
    assert update is not None and update.batch_size == 3
    assert [(i, p.extra_args["name"]) for i, p, _, _ in update.added] == [(0, "E")]
    assert list(update.removed) == [2] and list(update.moved) == [(3, 2, UNI)]
    assert rec.batch == {0: "E", 1: "B", 2: "D"} == {i: r for r, i in tracker.index_of.items()}
    tracker.update(_requests("B", "D", "E"), 2)  # same membership version: nothing changed
    assert rec.updates[-1] is None


def test_more_joins_than_leaves_extend_the_batch_and_leaves_only_condense_it():
    rec = Recorder()
    tracker = BatchLogitsProcessors(LogitsProcessors([rec]))
    tracker.update(_requests("A", "B", "C", "D"), 1)
    tracker.update(_requests("A", "B", "D", "E", "F"), 2)
    update = rec.updates[-1]
    assert [i for i, *_ in update.added] == [2, 4] and not update.removed and not update.moved
    tracker.update(_requests("F"), 3)  # four leave: F (at 4) moves down to 0
    update = rec.updates[-1]
    assert update.batch_size == 1 and not update.added
    assert sorted(update.removed) == [0, 1, 2, 3] and list(update.moved) == [(4, 0, UNI)]
    assert rec.batch == {0: "F"}
    tracker.update({}, 4)
    assert rec.updates[-1].batch_size == 0 and rec.batch == {}


def test_process_dict_updates_swaps_and_replacements():
    entries = {0: "a", 1: "b"}
    update = BatchUpdate(batch_size=3, removed=[], moved=[(0, 2, MoveDirectionality.SWAP)],
                         added=[(1, SamplingParams(), None, [])])
    assert process_dict_updates(entries, update, lambda *_: None)
    assert entries == {2: "a"}  # b was replaced by a request without state; a swapped with the empty 2
    assert not process_dict_updates(entries, None, lambda *_: None)


def test_resolving_specs():
    name = "pagedlm.core.testing.logits_processors:DummyLogitsProcessor"
    assert resolve_logits_processor_classes([name, TopOneLogitsProcessor]) == [DummyLogitsProcessor,
                                                                               TopOneLogitsProcessor]
    with pytest.raises(ValueError, match=r"logits_processors\[0\]='no_colon' must be 'package.module:Class'"):
        resolve_logits_processor_classes(["no_colon"])
    with pytest.raises(ValueError, match="cannot be loaded: ModuleNotFoundError"):
        resolve_logits_processor_classes(["nowhere.to.be:Found"])
    with pytest.raises(ValueError, match="is not a subclass of"):
        resolve_logits_processor_classes([dict])


# -- the sampler ---------------------------------------------------------------------------------

VOCAB = 16


def _metadata(params: list[SamplingParams], procs: list[LogitsProcessor], names: list[str]):
    tracker = BatchLogitsProcessors(LogitsProcessors(procs))
    states = {n: SimpleNamespace(sampling_params=p, prompt_token_ids=[1], output_token_ids=[], prompt_embeds=None)
              for n, p in zip(names, params, strict=True)}
    tracker.update(states, 1)
    md = build_sampling_metadata(params, prompt_token_ids=[[1]] * len(params),
                                 output_token_ids=[[] for _ in params], vocab_size=VOCAB)
    return md, tracker


def test_sampler_applies_processors_on_the_batch_layout():
    """Rows of the logits follow the schedule; processors see batch indices (a scatter in between)."""
    params = [SamplingParams(temperature=0, extra_args={"target_token": 3}), SamplingParams(temperature=0),
              SamplingParams(temperature=0, extra_args={"target_token": 11})]
    dummy = DummyLogitsProcessor(None, torch.device("cpu"), False)
    md, tracker = _metadata(params, [dummy], ["a", "b", "c"])
    logits = torch.randn(2, VOCAB)
    md_rows = build_sampling_metadata([params[2], params[1]], prompt_token_ids=[[1]] * 2,
                                      output_token_ids=[[], []], vocab_size=VOCAB)
    md_rows.logitsprocs = tracker.step_view(["c", "b"], torch.device("cpu"))  # rows: c then b; a does not sample
    before = logits.clone()
    out = Sampler()(logits, md_rows)
    assert out.sampled_token_ids.tolist() == [11, int(before[1].argmax())]
    assert torch.equal(logits, before)  # the model's logits are never written


class _FakeFused:
    """Stands in for a platform's fused ``gumbel_sample`` op: records what it was given."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def __call__(self, logits, temperature, seed, offset):
        self.calls.append(logits.clone())
        return logits.argmax(dim=-1)


@pytest.mark.parametrize("argmax_invariant", [False, True])
def test_fused_sampler_never_bypasses_processors(argmax_invariant):
    params = [SamplingParams(temperature=1.0, extra_args={"target_token": 5, "top_one": True}),
              SamplingParams(temperature=1.0)]
    proc = (TopOneLogitsProcessor if argmax_invariant else DummyLogitsProcessor)(None, torch.device("cpu"), False)
    md, tracker = _metadata(params, [proc], ["a", "b"])
    md.logitsprocs = tracker.step_view(["a", "b"], torch.device("cpu"))
    sampler = Sampler()
    fused = sampler._gumbel_sample_op = _FakeFused()
    logits = torch.randn(2, VOCAB)
    sampled = sampler(logits, md).sampled_token_ids
    if argmax_invariant:
        # It runs after the temperature, which the fused op applies itself: the torch path samples.
        assert not fused.calls and sampled[0] == logits[0].argmax()
    else:
        # The fused op gets the processed logits: only the target survives in row 0.
        assert len(fused.calls) == 1 and sampled[0] == 5
        assert torch.isinf(fused.calls[0][0]).sum() == VOCAB - 1 and torch.equal(fused.calls[0][1], logits[1])


def test_argmax_invariant_processors_skip_greedy_rows():
    params = [SamplingParams(temperature=0, extra_args={"top_one": True})]
    proc = TopOneLogitsProcessor(None, torch.device("cpu"), False)
    calls = []
    proc.apply = lambda logits: calls.append(1) or logits  # type: ignore[method-assign]
    md, tracker = _metadata(params, [proc], ["a"])
    md.logitsprocs = tracker.step_view(["a"], torch.device("cpu"))
    logits = torch.randn(1, VOCAB)
    assert Sampler()(logits, md).sampled_token_ids.item() == logits.argmax().item() and not calls


def test_installed_entry_points_load_in_every_engine(monkeypatch, tiny_llama):
    """vLLM's plugin group ``vllm.logits_processors``: an installed processor runs in every
    engine without being named, once even when also configured; a broken one fails start-up."""
    import importlib.metadata

    from pagedlm.core import LLM, SamplingParams
    from pagedlm.core.sample.logits_processor import load

    real = importlib.metadata.entry_points

    def installed(value: str):
        def entry_points(group=None):
            if group != "vllm.logits_processors":
                return real(group=group)
            return importlib.metadata.EntryPoints((importlib.metadata.EntryPoint("dummy", value, group),))
        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
        load._installed_entry_points.cache_clear()

    name = "pagedlm.core.testing.logits_processors:DummyLogitsProcessor"
    installed(name)
    try:
        assert load.installed_logits_processor_classes() == [DummyLogitsProcessor]
        llm = LLM(model=tiny_llama, device="cpu", dtype="float32", logits_processors=[name])
        assert llm.llm_engine.processor.logits_processor_classes == [DummyLogitsProcessor]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, extra_args={"target_token": 77})
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == [77] * 4
        llm.shutdown()
        installed("nowhere.to.be:Found")
        with pytest.raises(ValueError, match="vllm.logits_processors entry point dummy='nowhere.to.be:Found' cannot"):
            load.installed_logits_processor_classes()
    finally:
        monkeypatch.undo()
        load._installed_entry_points.cache_clear()
