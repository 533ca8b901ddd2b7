"""popart_kit: a typed, fail-fast toolkit for Graphcore PopART sessions.

This module is the public surface; everything not in ``__all__`` is internal.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Where each public name lives. The package loads a module when one of its names is first used,
# so configuration-only use (SessionConfig, plan, the CLI's plan/check/schema) never pays for
# the Builder's onnx or the runtime's JAX.
_HOMES = {
    "._base.problems": ("PopartKitWarning",),
    ".errors": ("PopartKitError", "ConfigError", "ModelError", "DataError", "ConfigTypeError",
                "ModelTypeError", "DataTypeError", "Invalid", "InvalidConfig", "InvalidModel",
                "InvalidData", "FileWriteError", "SessionClosedError", "NonFiniteUpdate"),
    "._model.builder": ("Builder", "BuilderError", "InputSettings", "PipelineBuilder",
                        "ReductionType", "ReplicatedStreamMode", "TensorInfo"),
    "._config.session_config": ("Accumulation", "Device", "Pipeline", "Precision", "Profiling",
                                "Replication", "SessionConfig"),
    "._model.layout": ("PipelineLayout",),
    ".launcher": ("launch",),
    "._model.custom_ops": ("register_custom_op",),
    "._runtime.optimizers": ("SGD", "Adam", "Adaptive"),
    "._config.plan": ("Plan", "ReplicaPlacement"),
    "._base.schedule": ("PipelineSchedule",),
    "._config.popdist": ("PopdistEnv",),
    "._model.precision": ("to_half",),
    "._runtime.session": ("InferenceSession", "TrainingSession"),
    "._base.shapes": ("AnchorReturnType", "anchor_elements", "anchor_shape", "input_elements",
                      "input_shape"),
    "._host.stepio": ("CallbackFeeder", "RunBatches", "StepIOFactory", "TensorSpec"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

if TYPE_CHECKING:
    from ._base.problems import PopartKitWarning
    from ._base.schedule import PipelineSchedule
    from ._base.shapes import (
        AnchorReturnType,
        anchor_elements,
        anchor_shape,
        input_elements,
        input_shape,
    )
    from ._config.plan import Plan, ReplicaPlacement
    from ._config.popdist import PopdistEnv
    from ._config.session_config import (
        Accumulation,
        Device,
        Pipeline,
        Precision,
        Profiling,
        Replication,
        SessionConfig,
    )
    from ._host.stepio import CallbackFeeder, RunBatches, StepIOFactory, TensorSpec
    from ._model.builder import (
        Builder,
        BuilderError,
        InputSettings,
        PipelineBuilder,
        ReductionType,
        ReplicatedStreamMode,
        TensorInfo,
    )
    from ._model.custom_ops import register_custom_op
    from ._model.layout import PipelineLayout
    from ._model.precision import to_half
    from ._runtime.optimizers import SGD, Adam, Adaptive
    from ._runtime.session import InferenceSession, TrainingSession
    from .errors import (
        ConfigError,
        ConfigTypeError,
        DataError,
        DataTypeError,
        FileWriteError,
        Invalid,
        InvalidConfig,
        InvalidData,
        InvalidModel,
        ModelError,
        ModelTypeError,
        NonFiniteUpdate,
        PopartKitError,
        SessionClosedError,
    )
    from .launcher import launch

__version__ = "0.1.0"

__all__ = [
    "SessionConfig",
    "Replication",
    "Accumulation",
    "Pipeline",
    "Device",
    "Precision",
    "Profiling",
    "Plan",
    "ReplicaPlacement",
    "PopdistEnv",
    "AnchorReturnType",
    "input_shape",
    "anchor_shape",
    "input_elements",
    "anchor_elements",
    "TensorSpec",
    "StepIOFactory",
    "RunBatches",
    "CallbackFeeder",
    "Builder",
    "BuilderError",
    "PipelineBuilder",
    "PipelineLayout",
    "PipelineSchedule",
    "TensorInfo",
    "InputSettings",
    "ReplicatedStreamMode",
    "ReductionType",
    "InferenceSession",
    "TrainingSession",
    "SGD",
    "Adam",
    "Adaptive",
    "launch",
    "register_custom_op",
    "PopartKitWarning",
    "PopartKitError",
    "ConfigError",
    "ModelError",
    "DataError",
    "ConfigTypeError",
    "ModelTypeError",
    "DataTypeError",
    "Invalid",
    "InvalidConfig",
    "InvalidModel",
    "InvalidData",
    "FileWriteError",
    "SessionClosedError",
    "NonFiniteUpdate",
    "to_half",
    "bench",
]


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:  # a submodule, as after an eager import: pk.bench, pk.popart, ...
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'popart_kit' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME_OF])
