"""``builder.aiGraphcore``'s operators: the registry (:data:`GRAPHCORE_OPS`, method name ->
:class:`GraphcoreOp`) filled by one module per family of operators."""

from . import basic  # noqa: F401 - registers its operators
from ._registry import GRAPHCORE_OPS, REQUIRED, GraphcoreOp, TensorType, register, same

__all__ = ["GRAPHCORE_OPS", "REQUIRED", "GraphcoreOp", "TensorType", "register", "same"]
