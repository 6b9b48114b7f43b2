"""Loading a transformers config class without its documentation machinery.

transformers 5.x decorates every config class with ``auto_docstring``, which builds the class's
docstring when the class is created: it imports the auto *model* mappings and, through them,
``transformers.generation`` (scikit-learn), ``torch._dynamo`` and ``torch.distributed.tensor``.
Measured on the H200 machine (transformers 5.17, no bytecode cache): 6.0-8.4 s of
``AutoConfig.from_pretrained`` for a Qwen3 config, 0.01 s with the decorator passed through. An
engine never reads those docstrings, so config classes are imported under
:func:`without_auto_docstrings`; the class is the same class with its plain docstring.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()


def _passthrough(obj: Any = None, **_: Any) -> Any:
    # ``@auto_docstring`` and ``@auto_docstring(custom_intro=...)`` both leave the object as is
    return obj if obj is not None else (lambda o: o)


@contextlib.contextmanager
def without_auto_docstrings() -> Iterator[None]:
    """Within: transformers modules imported for the first time get ``auto_docstring`` as a
    no-op. Modules imported before keep their docstrings; nothing changes if transformers has no
    such decorator."""
    try:
        import transformers.utils as utils
    except ImportError:
        yield
        return
    real = getattr(utils, "auto_docstring", None)
    if real is None:
        yield
        return
    with _lock:
        utils.auto_docstring = _passthrough
        try:
            yield
        finally:
            utils.auto_docstring = real


def load_hf_config(model: str, **kwargs: Any) -> Any:
    """``AutoConfig.from_pretrained(model, **kwargs)``, config classes imported without
    ``auto_docstring``."""
    from transformers import AutoConfig

    with without_auto_docstrings():
        return AutoConfig.from_pretrained(model, **kwargs)


def config_class(name: str) -> Any:
    """``transformers.<name>`` (a config class), imported without ``auto_docstring``."""
    import transformers

    with without_auto_docstrings():
        return getattr(transformers, name)
