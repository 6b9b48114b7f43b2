"""The peer suite: vLLM's own OpenAI-server tests, adapted to `pagedlm serve` (see README.md).

Every test here is marked ``peer``: ``nox -s tests-peer`` runs them, ``nox -s tests-cpu`` leaves
them out (they start a server per module and take minutes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # peer_utils, as vLLM's tests import tests.utils

try:
    import pytest_asyncio  # noqa: F401 - vLLM's tests are async
except ImportError:  # e.g. nox -s tests-cpu, which leaves the peer suite out: nox -s tests-peer installs it
    collect_ignore_glob = ["test_peer_*.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.peer)


from peer_fixtures import (  # noqa: E402, F401 - vLLM's sample constraints, as its conftest provides them
    sample_json_schema,
    sample_regex,
    sample_structured_outputs_choices,
)

#: the images vLLM's adapted tests fetch from local_asset_server
ASSETS = ["2560px-Gfp-wisconsin-madison-the-nature-boardwalk.jpg"]


@pytest.fixture(scope="session")
def local_asset_server():
    from peer_utils import LocalAssetServer

    server = LocalAssetServer(ASSETS)
    yield server
    server.close()


@pytest.fixture(scope="session")
def qwen3_lora_files():
    """vLLM downloads a Qwen3 LoRA adapter; here, a PEFT adapter of the tiny checkpoint."""
    from peer_utils import tiny_lora_dir

    return tiny_lora_dir()
