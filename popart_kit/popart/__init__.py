"""PopART's Python API on popart_kit, so PopART programs run unchanged without an IPU.

``import popart_kit.popart as popart`` (or ``popart-kit run SCRIPT``, which makes ``import
popart`` resolve here) gives PopART's names - Builder, TensorInfo, DataFlow, AnchorReturnType,
SessionOptions, DeviceManager, InferenceSession, TrainingSession, PyStepIO, PyStepIOCallback,
PyWeightsIO, SGD, ConstSGD, Adam, Adaptive, GraphTransformer, VariableSettings (grouped weights),
the enums, the reserved prefixes, popart_exception and OutOfMemoryException - with PopART's
signatures and defaults. Sessions
run on the kit's xla runtime: replicated, accumulated and pipelined programs run on a CPU or
GPU.

What cannot change here: Patterns are accepted and recorded but the runtime lowers the ONNX
graph itself, so they change nothing (a Softmax followed by Nll always gets PopART's default
direct gradient); options about Poplar (engineOptions, tile counts,
outlining, memory proportions) are validated and kept but do not change the numbers;
executables, reports and cycle counts do not exist (those methods raise popart_exception).
"""

from __future__ import annotations

import logging as _logging
import sys as _sys
from typing import Any

from .._model.builder import InputSettings, ReductionType, ReplicatedStreamMode
from ._builder import Builder
from ._core import (
    ENUMS,
    PREFIX_FUNCTIONS,
    AnchorReturnType,
    DataFlow,
    InputShapeInfo,
    OutOfMemoryException,
    Patterns,
    PyStepIO,
    PyStepIOCallback,
    PyWeightsIO,
    TensorInfo,
    popart_exception,
    poplar_application_runtime_error,
    poplar_exception,
    poplar_recoverable_runtime_error,
    poplar_runtime_error,
    poplar_unrecoverable_runtime_error,
)
from ._devices import DeviceInfo, DeviceManager
from ._graph_transformer import GraphTransformer
from ._operators import (
    OpDefinition,
    OperatorIdentifier,
    getSupportedOperations,
    getSupportedOperationsDefinition,
    getUnsupportedOperations,
)
from ._optimizers import (
    SGD,
    Adam,
    Adaptive,
    AdaptiveMode,
    ClipNormSettings,
    ConstSGD,
    Optimizer,
    OptimizerValue,
    OptimizerValueMap,
)
from ._options import STRUCTS, SessionOptions
from ._variables import VariableSettings

# popart_kit marks this module so that backend "auto" never takes it for the Poplar SDK.
IS_POPART_KIT = True
__version__ = "3.4.0+popart_kit"
defaultAiOnnxOpset = 10
defaultAiGraphcoreOpset = 1
popart_runtime_error = popart_exception
popart_internal_exception = popart_exception

_module = _sys.modules[__name__]
for _name, _enum in ENUMS.items():
    setattr(_module, _name, _enum)
for _name, _struct in STRUCTS.items():
    setattr(_module, _name, _struct)
for _name, _fn in PREFIX_FUNCTIONS.items():
    setattr(_module, _name, _fn)


def versionString() -> str:
    return __version__


def versionNumber() -> tuple[int, int, int]:
    """PopART's (major, minor, point) of the API this module follows."""
    return (3, 4, 0)


def packageHash() -> str:
    """The build's identifier (PopART: its git hash); here popart_kit's drop-in version."""
    return __version__


_debug_info: list[str] = []  # the file initializePoplarDebugInfo named, until it is closed


def initializePoplarDebugInfo(filename: str, format: str = "json") -> None:  # noqa: A002
    """Start Poplar's debug-info stream to ``filename``. Off the IPU there is no Poplar program
    and so no debug context: :func:`closePoplarDebugInfo` writes the file with none (JSON,
    whatever ``format`` asks)."""
    _debug_info[:] = [str(filename)]


def closePoplarDebugInfo() -> None:
    """Finish the stream :func:`initializePoplarDebugInfo` started: its file is written
    (``{"contexts": [], "stringTable": []}``, atomically)."""
    from .._base.atomic import write_atomic

    for filename in _debug_info:
        write_atomic(filename, '{"contexts": [], "stringTable": []}\n')
    _debug_info.clear()


def getLogger(name: str = "all") -> Any:
    """PopART's logger; here a standard Python logger (popart.<name>) with setLevel."""
    logger = _logging.getLogger(f"popart.{name}")
    set_level = logger.setLevel
    logger.setLevel = lambda level: set_level(  # type: ignore[method-assign]
        {"TRACE": "DEBUG", "OFF": "CRITICAL", "ERR": "ERROR", "WARN": "WARNING"}.get(
            str(level).upper(), str(level).upper()))
    return logger


def __getattr__(name: str) -> Any:
    if name in ("InferenceSession", "TrainingSession"):
        from . import _session

        return getattr(_session, name)
    raise AttributeError(f"module 'popart' (popart_kit.popart) has no attribute {name!r}")


__all__ = [
    "Builder", "TensorInfo", "DataFlow", "AnchorReturnType", "InputShapeInfo", "Patterns",
    "SessionOptions", "DeviceManager", "DeviceInfo", "InferenceSession", "TrainingSession",
    "PyStepIO", "PyStepIOCallback", "PyWeightsIO", "SGD", "ConstSGD", "Adam", "Optimizer",
    "OptimizerValue", "OptimizerValueMap", "Adaptive", "AdaptiveMode", "ClipNormSettings",
    "InputSettings", "ReductionType", "ReplicatedStreamMode",
    "popart_exception", "OutOfMemoryException", "poplar_exception", "poplar_runtime_error",
    "poplar_application_runtime_error", "poplar_recoverable_runtime_error",
    "poplar_unrecoverable_runtime_error", "popart_runtime_error", "popart_internal_exception",
    "getLogger", "versionString", "versionNumber", "packageHash", "initializePoplarDebugInfo",
    "closePoplarDebugInfo", "OperatorIdentifier", "getSupportedOperations",
    "getSupportedOperationsDefinition", "OpDefinition",
    "getUnsupportedOperations", "GraphTransformer", "VariableSettings", *ENUMS, *STRUCTS,
    *PREFIX_FUNCTIONS,
]
