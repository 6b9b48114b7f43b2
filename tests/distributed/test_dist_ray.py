"""The Ray executor with TP=2 on a local Ray instance gives the tokens of one process."""

from __future__ import annotations

import pytest
from dist_helpers import ENGINE_KWARGS, generate

from pagedlm.core import LLM

ray = pytest.importorskip("ray")


@pytest.mark.timeout(240)
def test_ray_tp2_matches_single_process(tiny_llama):
    expected = generate(LLM(model=tiny_llama, **ENGINE_KWARGS))
    # A local instance owned by the test, sized for two single-CPU bundles.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(model=tiny_llama, **ENGINE_KWARGS, tensor_parallel_size=2, distributed_executor_backend="ray")
        try:
            assert len(llm.llm_engine.core.executor.actors) == 2
            assert generate(llm) == expected
            # collective_rpc reaches every actor (rank order); a failing call leaves the engine up
            assert llm.collective_rpc(getattr, args=("rank",)) == [0, 1]
            with pytest.raises(RuntimeError, match=r"collective_rpc\('nope'\) failed on Ray worker rank 0"):
                llm.collective_rpc("nope")
            assert generate(llm) == expected
        finally:
            llm.shutdown()
        # The executor left the placement group and actors it made, not the instance it found.
        assert ray.is_initialized()
        assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    finally:
        ray.shutdown()
