"""``builder.aiGraphcore``'s operators: the registry (:data:`GRAPHCORE_OPS`, method name ->
:class:`GraphcoreOp`) filled by one module per family of operators."""

from . import basic, nn_ops, random_ops, rnn, tensor_ops  # noqa: F401 - they register
from ._registry import GRAPHCORE_OPS, REQUIRED, GraphcoreOp, TensorType, register, same

__all__ = ["GRAPHCORE_OPS", "REQUIRED", "GraphcoreOp", "TensorType", "register", "same"]
