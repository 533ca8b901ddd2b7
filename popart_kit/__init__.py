"""popart_kit: a typed, fail-fast toolkit for Graphcore PopART sessions.

This module is the public surface; everything not in ``__all__`` is internal.
"""

from ._problems import PopartKitWarning
from .errors import (
    ConfigError,
    ConfigTypeError,
    DataError,
    DataTypeError,
    Invalid,
    InvalidConfig,
    InvalidData,
    InvalidModel,
    ModelError,
    ModelTypeError,
    PopartKitError,
)
from .builder import (
    Builder,
    BuilderError,
    InputSettings,
    PipelineBuilder,
    ReductionType,
    ReplicatedStreamMode,
    TensorInfo,
)
from .config import (
    Accumulation,
    Device,
    Pipeline,
    Precision,
    Profiling,
    Replication,
    SessionConfig,
)
from .layout import PipelineLayout
from .optimizers import SGD, Adam
from .plan import Plan, ReplicaPlacement
from .popdist import PopdistEnv
from .session import InferenceSession, TrainingSession
from .shapes import AnchorReturnType, anchor_elements, anchor_shape, input_elements, input_shape
from .stepio import CallbackFeeder, RunBatches, StepIOFactory, TensorSpec

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
    "TensorInfo",
    "InputSettings",
    "ReplicatedStreamMode",
    "ReductionType",
    "InferenceSession",
    "TrainingSession",
    "SGD",
    "Adam",
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
]
