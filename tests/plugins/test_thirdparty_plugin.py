"""A third-party plugin package, pip-installed, registers a new architecture that is served."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pagedlm.core import LLM, SamplingParams
    from pagedlm.core.plugins import get_plugins
    plugins = get_plugins()
    assert "demo_thirdparty" in plugins.plugin_names(), plugins.plugin_names()
    llm = LLM(model=sys.argv[1], dtype="float32", device="cpu", num_gpu_blocks_override=64)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=8,
                       ignore_eos=True), use_tqdm=False)
    print(json.dumps({"arch": type(llm.llm_engine.core.executor.worker.model_runner.model).__name__,
                      "tokens": out[0].outputs[0].token_ids}))
    """
)


def _run(model_dir: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, model_dir], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def installed_plugin():
    pip = [sys.executable, "-m", "pip"]
    proc = subprocess.run([*pip, "install", "-q", "--no-deps", "--no-build-isolation", str(HERE / "thirdparty")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        yield
    finally:
        subprocess.run([*pip, "uninstall", "-y", "-q", "pagedlm-demo-thirdparty"], capture_output=True, timeout=300)


def test_thirdparty_architecture_is_served(installed_plugin, tiny_llama, tmp_path):
    model_dir = tmp_path / "demo"
    shutil.copytree(tiny_llama, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["DemoTinyForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    demo = _run(str(model_dir))
    llama = _run(str(tiny_llama))
    assert demo["arch"] == "DemoTinyForCausalLM"
    assert llama["arch"] == "LlamaForCausalLM"
    assert demo["tokens"] == llama["tokens"] and len(demo["tokens"]) == 8
    assert os.path.isdir(tiny_llama)
