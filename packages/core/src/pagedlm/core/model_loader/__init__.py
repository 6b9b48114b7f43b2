"""Model construction and weight loading: the registry, the loader and weight-file helpers."""

from pagedlm.core.model_loader.loader import get_weights_iterator, load_model
from pagedlm.core.model_loader.registry import get_model_class, registered_architectures
from pagedlm.core.model_loader.weight_utils import (
    default_weight_loader,
    load_weights_by_name,
    set_weight_attrs,
)

__all__ = [
    "default_weight_loader",
    "get_model_class",
    "get_weights_iterator",
    "load_model",
    "load_weights_by_name",
    "registered_architectures",
    "set_weight_attrs",
]
