"""Collecting what plugins register through the ``register`` callbacks of the registration hooks.

Two rules live here, shared by every registration hook (models, platforms, attention backends,
layer ops, default models):

- Order: implementations run in the order pluggy itself calls them: ``tryfirst=True`` first,
  then the most recently registered plugin first, ``trylast=True`` last.
- Conflicts: two plugins claiming one name is an error naming both, unless a claim says
  ``override=True``. An override beats a plain claim whatever the order; of several overrides of
  one name, the first one called wins (so ``tryfirst=True`` gives a plugin the last word).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from pagedlm.core.logger import init_logger

logger = init_logger(__name__)


class PluginError(RuntimeError):
    """A plugin could not provide what was asked of it, or two plugins claim the same name."""


@dataclass(frozen=True)
class Registration:
    """One call of a ``register`` callback."""

    #: what is claimed: an architecture, a platform name, ``(op_name, platform_name)``, ...
    key: Hashable
    #: what the hook's parser made of the other arguments
    value: Any
    #: the plugin's name as the plugin manager knows it (the entry point's name)
    plugin: str
    override: bool


#: ``parse(*args, **kwargs) -> (key, value)``, the register signature minus ``override``; Python's
#: own argument binding reports wrong calls (a missing or unexpected argument) as ``TypeError``.
Parser = Callable[..., tuple[Hashable, Any]]


def call_registration_hook(pm: pluggy.PluginManager, hook_name: str, parse: Parser) -> list[Registration]:
    """Call every implementation of ``hook_name``, in pluggy's call order, each with a ``register``
    callback that records which plugin registered what."""
    hook_caller = getattr(pm.hook, hook_name)
    registrations: list[Registration] = []
    # NOTE: pluggy keeps implementations sorted trylast .. tryfirst and calls them from the end of
    # the list (pluggy._callers._multicall); walking it backwards is its call order. One call per
    # implementation is what lets each registration carry its plugin's name. Wrappers (which
    # registration hooks have no use for) are not called.
    for impl in reversed(hook_caller.get_hookimpls()):
        if impl.hookwrapper or impl.wrapper:
            continue
        plugin = impl.plugin_name

        def register(*args: Any, _plugin: str = plugin, override: bool = False, **kwargs: Any) -> None:
            key, value = parse(*args, **kwargs)
            registrations.append(Registration(key, value, _plugin, bool(override)))

        callbacks = {"register": register}
        try:
            impl.function(*[callbacks[name] for name in impl.argnames])
        except Exception as e:
            raise PluginError(f"plugin {plugin!r} failed in {hook_name}: {type(e).__name__}: {e}") from e
    return registrations


def resolve_conflicts(registrations: Iterable[Registration], what: str,
                      describe: Callable[[str], str] = repr) -> dict[Hashable, Registration]:
    """The winning registration of every key (see the module docstring for the rules).

    ``what`` names the kind of thing in messages (``"architecture"``); ``describe(plugin)`` says
    how a plugin is named in them (e.g. with its distribution).
    """
    winners: dict[Hashable, Registration] = {}
    for reg in registrations:
        held = winners.get(reg.key)
        if held is None:
            winners[reg.key] = reg
        elif reg.override and not held.override:
            logger.info("%s %r: plugin %s replaces plugin %s (override=True)",
                        what, reg.key, describe(reg.plugin), describe(held.plugin))
            winners[reg.key] = reg
        elif held.override:
            logger.info("%s %r: plugin %s keeps it over plugin %s (%s)", what, reg.key, describe(held.plugin),
                        describe(reg.plugin), "an override called earlier" if reg.override else "override=True")
        else:
            claimants = (f"twice by plugin {describe(reg.plugin)}" if reg.plugin == held.plugin
                         else f"by two plugins, {describe(held.plugin)} and {describe(reg.plugin)}")
            raise PluginError(
                f"{what} {reg.key!r} is registered {claimants}. Install or allow (PAGEDLM_PLUGINS) only one "
                "of them, or have the one meant to win register it with override=True (see docs/plugins.md)."
            )
    return winners
