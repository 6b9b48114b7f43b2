"""The CUDA model runner's persistent step buffers for a model of two KV-cache groups (Gemma 3's
sliding-window and full layers), on the CPU with the reference attention backend (no Triton, no
graphs: every step goes through the same staging and per-group metadata the graphs read), and
its staging buffers waiting for the copies out of them.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedlm.core import LLM, SamplingParams
from pagedlm.core.testing import assert_greedy_matches_hf


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(4, 500) for _ in range(n)] for n in (40, 19, 3, 27)]


@pytest.fixture(scope="module")
def gemma3_llm(tiny_checkpoint_factory):
    mp = pytest.MonkeyPatch()
    from pagedlm.backends.cpu.platform import CpuPlatform

    mp.setattr(CpuPlatform, "get_model_runner_cls",
               lambda self, cfg: "pagedlm.backends.cuda.model_runner:CudaModelRunner")
    model = tiny_checkpoint_factory("gemma3")
    llm = LLM(model=model, dtype="float32", device="cpu", max_num_batched_tokens=8, max_num_seqs=4)
    yield model, llm
    llm.shutdown()
    mp.undo()


def runner_of(llm):
    return llm.llm_engine.core.executor.worker.model_runner


def test_two_groups_chunked_prefill_matches_hf(gemma3_llm):
    model, llm = gemma3_llm
    runner = runner_of(llm)
    assert type(runner).__name__ == "CudaModelRunner" and len(runner.block_tables) == 2
    steps = []
    stage = runner._stage

    def recording(step, num_tokens, num_reqs, **kw):
        if step is not None and len(step.input_ids) > len(step.req_ids):
            steps.append(step)
        return stage(step, num_tokens, num_reqs, **kw)

    runner._stage = recording
    try:
        assert assert_greedy_matches_hf(model, prompts(), 12, llm=llm) <= 1
    finally:
        del runner._stage
    assert steps, "no step had a prompt chunk"


def test_mixed_padding_fills_every_group(gemma3_llm):
    """A step staged for a mixed-batch graph (tokens padded to 16, requests to max_num_seqs):
    each group's slot-mapping segment holds the step's slots then -1, each group's block table the
    step's rows, and each group's metadata reads its own persistent buffers."""
    _, llm = gemma3_llm
    runner = runner_of(llm)
    captured = []
    stage = runner._stage

    def recording(step, *args, **kwargs):
        if step is not None:
            captured.append(step)
        return stage(step, *args, **kwargs)

    runner._stage = recording
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts()[:2]],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        del runner._stage
    step = next(s for s in captured if len(s.req_ids) == 2 and len(s.input_ids) > 2)
    padded, num_reqs = 16, runner.max_num_reqs
    common = runner._stage(step, padded, num_reqs, mixed=True)
    metadata = runner._metadata(common)
    assert isinstance(metadata, list) and len(metadata) == 2
    real_t, real_b = len(step.input_ids), len(step.req_ids)
    assert common.query_start_loc.tolist() == list(step.query_start_loc) + [real_t] * (num_reqs - real_b)
    assert common.seq_lens.tolist() == list(step.seq_lens) + [0] * (num_reqs - real_b)
    for g, md in enumerate(metadata):
        slots = md.slot_mapping.tolist()
        assert slots == list(step.slot_mappings[g]) + [-1] * (padded - real_t)
        assert md.block_table.data_ptr() == runner.block_tables[g].data_ptr()
        np.testing.assert_array_equal(md.block_table[:real_b].numpy(), runner.input_batch.block_tables[g][step.rows])
    # the two groups' slots differ (their blocks come from one pool)
    assert list(step.slot_mappings[0]) != list(step.slot_mappings[1])


def test_staging_buffers_wait_for_the_copies_out_of_them(gemma3_llm, monkeypatch):
    """Staging set ``i % 2`` is reused by step ``i + 2`` only after the event recorded behind step
    ``i``'s copies completed: with async scheduling a step that samples nothing gives the engine
    nothing to wait for, so nothing else orders the host's writes after those copies."""
    _, llm = gemma3_llm
    runner = runner_of(llm)
    events = []

    class LaggingEvent:  # a device that finishes a copy only when the host waits for it
        def __init__(self) -> None:
            self.waited_at: int | None = None
            events.append(self)

        def synchronize(self) -> None:
            self.waited_at = runner._num_staged

    monkeypatch.setattr(runner.platform, "record_event", lambda timing=False: LaggingEvent())
    start = runner._num_staged
    for _ in range(5):
        runner._stage(None, 16, runner.max_num_reqs, mixed=True)
    # the stage call that reuses a set (the call numbered start + i + 3) waits for that set's event
    assert [e.waited_at for e in events] == [start + 3, start + 4, start + 5, None, None]


def test_image_steps_get_their_bidirectional_spans(tiny_gemma3_vision, monkeypatch):
    """The CUDA runner's eager image steps hand the backend the images' spans: Gemma 3 with
    images through it gives HF's greedy tokens (images attend within themselves both ways)."""
    from pagedlm.backends.cpu.platform import CpuPlatform
    from pagedlm.core.testing.multimodal import hf_multimodal_greedy, load_hf_vlm, random_image

    monkeypatch.setattr(CpuPlatform, "get_model_runner_cls",
                        lambda self, cfg: "pagedlm.backends.cuda.model_runner:CudaModelRunner")
    images = [random_image(0, (80, 60)), random_image(1, (40, 70))]
    requests = [("The quick <start_of_image> brown fox jumps over", [images[0]]),
                ("Once <start_of_image> upon a time <start_of_image> there lived", images)]
    reference = hf_multimodal_greedy(*load_hf_vlm(tiny_gemma3_vision), requests, 6)
    llm = LLM(model=tiny_gemma3_vision, dtype="float32", device="cpu", kv_cache_memory_bytes=16 << 20,
              block_size=4, max_model_len=128)
    spans = []
    runner = runner_of(llm)
    build = runner.metadata_builder.build

    def recording(common):
        spans.append(common.bidirectional_spans)
        return build(common)

    runner.metadata_builder.build = recording
    try:
        outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in requests],
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert type(runner).__name__ == "CudaModelRunner"
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    assert any(s for s in spans)
