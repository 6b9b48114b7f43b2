"""The plugin system: registration, lazy loading, failures reported, docs covering every hook."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pluggy
import pytest

from pagedlm.core.plugins import Plugins, get_plugins, hookimpl, hookspecs

REPO = Path(__file__).resolve().parents[2]


def hookspec_names() -> list[str]:
    return [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("pagedlm_")]


def test_builtin_packages_register_through_entry_points():
    plugins = get_plugins()
    names = plugins.plugin_names()
    for name in ("backend_cpu", "models_llama", "models_qwen"):
        assert name in names
    models = plugins.models()
    assert models["LlamaForCausalLM"] == "pagedlm.models.llama.modeling:LlamaForCausalLM"
    assert "MistralForCausalLM" in models and "Qwen2ForCausalLM" in models and "Qwen3ForCausalLM" in models
    assert "cpu_paged" in plugins.attention_backends()
    assert any(spec.name == "cpu" for spec in plugins.platforms())


class _ObjectPlugin:
    @hookimpl
    def pagedlm_register_models(self, register):
        register("ToyForCausalLM", "toy.module:Toy")


class _PlainMarkerPlugin:
    marker = pluggy.HookimplMarker("pagedlm")

    @marker
    def pagedlm_register_models(self, register):
        register(architecture="PlainForCausalLM", class_path="plain.module:Plain")


def test_registered_objects_and_plain_pluggy_marker():
    plugins = Plugins(autoload=False)
    plugins.register(_ObjectPlugin(), name="toy")
    plugins.register(_PlainMarkerPlugin(), name="plain")
    assert plugins.models() == {"ToyForCausalLM": "toy.module:Toy", "PlainForCausalLM": "plain.module:Plain"}


def _fake_distribution(tmp_path: Path, entry_point: str) -> None:
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[pagedlm]\nbroken = {entry_point}\n")


def test_plugin_that_fails_to_import_is_reported(tmp_path, monkeypatch, caplog):
    _fake_distribution(tmp_path, "pagedlm_no_such_module_xyz")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = Plugins()
    plugins.load()
    failure = next(f for f in plugins.failures if f.name == "broken")
    assert failure.distribution == "broken-plugin"
    assert "pagedlm_no_such_module_xyz" in failure.error
    # other plugins still load
    assert "backend_cpu" in plugins.plugin_names()


def test_allow_list_and_disable_autoload(monkeypatch):
    monkeypatch.setenv("PAGEDLM_PLUGINS", "backend_cpu")
    plugins = Plugins()
    assert plugins.plugin_names() == ["backend_cpu"]
    monkeypatch.delenv("PAGEDLM_PLUGINS")
    monkeypatch.setenv("PAGEDLM_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert Plugins().plugin_names() == []


def test_unknown_architecture_lists_registered_and_plugins():
    from pagedlm.core.model_loader.registry import get_model_class

    with pytest.raises(ValueError) as e:
        get_model_class(["NoSuchForCausalLM"])
    msg = str(e.value)
    assert "NoSuchForCausalLM" in msg and "LlamaForCausalLM" in msg and "pagedlm-models-llama" in msg


def test_loading_is_lazy_and_imports_nothing_heavy():
    code = (
        "import sys; from pagedlm.core.plugins import get_plugins; p = get_plugins(); p.models(); "
        "p.platforms(); p.attention_backends(); "
        "heavy = [m for m in ('torch', 'transformers', 'pagedlm.models.llama.modeling') if m in sys.modules]; "
        "print(heavy)"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_docs_cover_every_hook():
    text = (REPO / "docs" / "plugins.md").read_text()
    missing = [name for name in hookspec_names() if name not in text]
    assert not missing, f"docs/plugins.md does not document {missing}"
    assert len(hookspec_names()) >= 5
