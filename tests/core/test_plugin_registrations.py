"""Registration hooks: pluggy's call order, conflicts naming both plugins, override=True, API_VERSION."""

from __future__ import annotations

import logging

import pytest

from pagedlm.core.plugins import API_VERSION, PluginError, Plugins, hookimpl


def _plugins(*named: tuple[str, object]) -> Plugins:
    plugins = Plugins(autoload=False)
    for name, plugin in named:
        plugins.register(plugin, name=name)
    return plugins


class _Models:
    """A plugin registering ``{architecture: class_path}`` (keyword arguments for ``register``)."""

    def __init__(self, models: dict[str, str], **register_kwargs) -> None:
        self.models = models
        self.register_kwargs = register_kwargs

    @hookimpl
    def pagedlm_register_models(self, register):
        for arch, path in self.models.items():
            register(arch, path, **self.register_kwargs)


# one plain registration of the same name per registration hook
_SAME_NAME = {
    "models": ("pagedlm_register_models", ("ToyForCausalLM", "{p}.m:Toy")),
    "platforms": ("pagedlm_register_platforms", ("toydev", "{p}.m:Platform", bool)),
    "attention_backends": ("pagedlm_register_attention_backends", ("toy_attn", "{p}.m:Backend")),
    "ops": ("pagedlm_register_ops", ("rms_norm", "cpu", "{p}.m:rms_norm")),
    "multimodal_processors": ("pagedlm_register_multimodal_processors", ("ToyForConditionalGeneration", "{p}.m:P")),
    "structured_output_backends": ("pagedlm_register_structured_output_backends", ("toy_grammar", "{p}.m:Backend")),
    "reasoning_parsers": ("pagedlm_register_reasoning_parsers", ("toy_think", "{p}.m:Parser")),
    "tool_parsers": ("pagedlm_register_tool_parsers", ("toy_tools", "{p}.m:Parser")),
}


def _claiming(hook_name: str, args: tuple, plugin: str, **register_kwargs) -> object:
    """A plugin object whose ``hook_name`` registers ``args`` ("{p}" replaced by ``plugin``)."""

    def impl(register):
        register(*[a.format(p=plugin) if isinstance(a, str) else a for a in args], **register_kwargs)

    return type(f"_{plugin}", (), {hook_name: staticmethod(hookimpl(impl))})()


@pytest.mark.parametrize("registry", list(_SAME_NAME))
def test_a_name_registered_twice_names_both_plugins(registry):
    hook_name, args = _SAME_NAME[registry]
    plugins = _plugins(("alpha", _claiming(hook_name, args, "alpha")), ("beta", _claiming(hook_name, args, "beta")))
    with pytest.raises(PluginError) as e:
        getattr(plugins, registry)()
    msg = str(e.value)
    assert "'alpha'" in msg and "'beta'" in msg and "override=True" in msg


def test_a_default_model_offered_twice_names_both_plugins(monkeypatch):
    from pagedlm.core import default_model

    args = ("Toy", "{p}.m:resolve")
    plugins = _plugins(("alpha", _claiming("pagedlm_default_model", args, "alpha")),
                       ("beta", _claiming("pagedlm_default_model", args, "beta")))
    monkeypatch.setattr("pagedlm.core.plugins.get_plugins", lambda: plugins)
    with pytest.raises(PluginError, match="default model 'Toy' is registered by two plugins, 'beta' and 'alpha'"):
        default_model.default_model_offers()


@pytest.mark.parametrize("registry", list(_SAME_NAME))
@pytest.mark.parametrize("overrider_first", [True, False])
def test_override_replaces_whatever_the_order(registry, overrider_first, caplog):
    hook_name, args = _SAME_NAME[registry]
    plain = ("vendor", _claiming(hook_name, args, "vendor"))
    overriding = ("site", _claiming(hook_name, args, "site", override=True))
    plugins = _plugins(*((overriding, plain) if overrider_first else (plain, overriding)))
    with caplog.at_level(logging.INFO, logger="pagedlm"):
        result = getattr(plugins, registry)()
    values = list(result.values()) if isinstance(result, dict) else result
    values = [v for v in values if ".m:" in str(v)]  # core's own registrations aside
    assert "site.m:" in str(values) and "vendor.m:" not in str(values) and len(values) == 1
    assert ("plugin 'site' replaces plugin 'vendor'" in caplog.text
            or "plugin 'site' keeps it over plugin 'vendor'" in caplog.text)


def test_of_two_overrides_the_first_called_wins():
    """``tryfirst=True`` gives a plugin the last word among overrides."""

    class First:
        @hookimpl(tryfirst=True)
        def pagedlm_register_models(self, register):
            register("ToyForCausalLM", "first.m:Toy", override=True)

    # registered last, so without tryfirst on First it would be called first
    plugins = _plugins(("first", First()), ("other", _Models({"ToyForCausalLM": "other.m:Toy"}, override=True)))
    assert plugins.models() == {"ToyForCausalLM": "first.m:Toy"}


def test_registration_follows_pluggys_call_order():
    """tryfirst first, then the latest registered first, trylast last: what pluggy itself does."""
    calls: list[str] = []

    def recording(name: str, **opts):
        def impl(register):
            calls.append(name)
            register(f"{name}ForCausalLM", f"{name}.m:Model")

        return type(name, (), {"pagedlm_register_models": staticmethod(hookimpl(**opts)(impl))})()

    plugins = _plugins(("last", recording("last", trylast=True)), ("early", recording("early")),
                       ("first", recording("first", tryfirst=True)), ("late", recording("late")))
    models = plugins.models()
    ours = list(calls)
    calls.clear()
    plugins.hook.pagedlm_register_models(register=lambda *a, **k: None)
    assert ours == calls == ["first", "late", "early", "last"]
    assert list(models) == [f"{n}ForCausalLM" for n in ours]


def test_positional_arguments_work_and_override_is_keyword_only():
    class Positional:
        @hookimpl
        def pagedlm_register_platforms(self, register):
            register("toydev", "toy.m:Platform", bool, 5)

    assert [(s.name, s.priority, s.plugin) for s in _plugins(("toy", Positional())).platforms()] == [
        ("toydev", 5, "toy")]

    class OverridePositional:
        @hookimpl
        def pagedlm_register_models(self, register):
            register("ToyForCausalLM", "toy.m:Toy", True)

    with pytest.raises(PluginError, match="'toy' failed in pagedlm_register_models: TypeError"):
        _plugins(("toy", OverridePositional())).models()


def test_the_same_plugin_registering_a_name_twice_is_an_error():
    class Twice:
        @hookimpl
        def pagedlm_register_attention_backends(self, register):
            register("toy_attn", "a.m:B")
            register("toy_attn", "b.m:B")

    with pytest.raises(PluginError, match="attention backend 'toy_attn' is registered twice by plugin 'twice'"):
        _plugins(("twice", Twice())).attention_backends()


def test_api_version_is_major_minor():
    major, minor = (int(part) for part in API_VERSION.split("."))
    assert major >= 1 and minor >= 0
