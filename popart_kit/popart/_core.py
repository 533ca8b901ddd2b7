"""PopART's small types: enums, the exception, reserved prefixes, TensorInfo, AnchorReturnType,
DataFlow, InputShapeInfo, Patterns and the host-data objects (PyStepIO, PyStepIOCallback,
PyWeightsIO)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._base.names import GRADIENT_PREFIX
from .._base.shapes import AnchorReturnType as _KitART
from .._config import catalog
from .._model.builder import InputSettings, ReductionType, ReplicatedStreamMode
from .._model.builder import TensorInfo as _KitTensorInfo


class popart_exception(ValueError):  # noqa: N801 - PopART's name
    """The error PopART raises for a refused program or configuration. A ValueError, so code that
    catches the kit's refusals catches it too."""


class poplar_exception(popart_exception):  # noqa: N801
    """PopART's error for a failure inside Poplar (kept for ``except`` clauses)."""


poplar_runtime_error = poplar_exception
poplar_application_runtime_error = poplar_exception
poplar_recoverable_runtime_error = poplar_exception
poplar_unrecoverable_runtime_error = poplar_exception


class _Enum(enum.Enum):
    """A pybind11-like enum: members have ``name`` and ``value`` and convert with ``int()``."""

    def __int__(self) -> int:
        return int(self.value)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


def _enum(name: str, members: Sequence[str]) -> type[_Enum]:
    return _Enum(name, [(m, i) for i, m in enumerate(members)])  # type: ignore[return-value]


# Every enum a SessionOptions attribute uses, from the option catalog (PopART's member order);
# ReductionType and ReplicatedStreamMode are the Builder's.
ENUMS: dict[str, type] = {name: _enum(name, members) for name, members in catalog.ENUMS.items()
                          if name != "ReductionType"}
ENUMS["ReductionType"] = ReductionType
ENUMS["ReplicatedStreamMode"] = ReplicatedStreamMode
# Enums of the rest of PopART's API (popart.cpp), in PopART's member order.
for _name, _members in {
    "SyncPattern": ["Full", "SinglePipeline", "ReplicaAndLadder"],
    "DeviceConnectionType": ["Always", "OnDemand", "Never"],
    "DeviceSelectionCriterion": ["First", "Random"],
    "DeviceType": ["IpuModel", "Cpu", "Ipu", "OfflineIpu", "Sim"],
    "AnchorReturnTypeId": ["Final", "EveryN", "All", "Sum"],
    "ExchangeStrategy": ["JustInTime", "OverlapInnerLoop", "OverlapLoops", "OverlapStep"],
    "PatternsLevel": ["All", "Default", "Minimal", "NoPatterns"],
    "RecomputeType": ["Undefined", "Checkpoint", "Recompute", "Recomputed"],
    "DataType": ["UINT8", "INT8", "UINT16", "INT16", "INT32", "INT64", "UINT32", "UINT64",
                 "BOOL", "FLOAT", "FLOAT16", "BFLOAT16", "FLOAT8_143", "FLOAT8_152", "DOUBLE",
                 "COMPLEX64", "COMPLEX128", "STRING", "UNDEFINED"],
    "SGDAccumulatorAndMomentum": ["Combined", "Separate"],
    "AutodiffStitchStrategy": ["RecomputeMinimal", "RecomputeAllNonInputs", "AddFwdOutputs",
                               "SafeAddFwdOutputs"],
    "AdamMode": ["Adam", "AdamNoBias", "Lamb", "LambNoBias", "AdaMax"],
    "WeightDecayMode": ["Decay", "L2Regularization"],
    "OptimizerType": ["SGD", "Adam", "Adaptive", "NTYPES"],
    "CollectiveOperator": ["Add", "Mean", "Mul", "Min", "Max", "LogicalAnd", "LogicalOr",
                           "SquareAdd", "Local"],
    "ScatterReduction": ["Sum", "Max", "Min", "Mul", "NoReduction"],
    "VariableRetrievalMode": ["OnePerGroup", "AllReduceReplicas", "AllReplicas"],
}.items():
    ENUMS.setdefault(_name, _enum(_name, _members))

# -- reserved tensor-name prefixes (willow/include/popart/tensornames.hpp) --------------------

RESERVED_PREFIXES = {
    "Gradient": GRADIENT_PREFIX, "UpdatedVar": "UpdatedVar___", "Accum": "Accum___",
    "Accl": "Accl___", "Accl1": "Accl1___", "Accl2": "Accl2___", "Accl3": "Accl3___",
    "Step": "Step___", "AcclToReduce": "AcclIntoReduce___", "AcclToUpdate": "AcclIntoUpdate___",
    "AcclFinalOut": "AcclOutOfAcclUpdate___", "FinalReducedGrad": "FinalReducedGradient___",
    "AdamUpdater": "AdamUpdater___", "LambR1Sq": "LambR1Sq___", "LambR2Sq": "LambR2Sq___",
    "Stashed": "Stashed___", "Restored": "Restored___", "LossScaling": "lossScaling_",
    "RandomSeed": "randomSeed___", "SeedModifier": "randomSeedModifier___",
    "RemoteArg": "RemoteArg___", "Counter": "Counter___", "ConcatInit": "ConcatInit___",
    "Init": "Init___", "Index": "Index___", "ConstValue": "ConstValue___",
    "GlobalNorm": "GlobalNorm___", "LoopIterator": "Iterator___", "LoopCond": "LoopCond___",
}


def _prefix_function(value: str) -> Callable[[], str]:
    def prefix() -> str:
        return value
    return prefix


PREFIX_FUNCTIONS = {f"reserved{k}Prefix": _prefix_function(v)
                    for k, v in RESERVED_PREFIXES.items()}


# -- tensors, anchors and the data flow -------------------------------------------------------


class TensorInfo(_KitTensorInfo):
    """popart.TensorInfo: ``TensorInfo("FLOAT", [2, 3])`` or ``TensorInfo(array)``."""

    def data_type(self) -> str:
        return self.dataType()

    def dim(self, i: int) -> int:
        return self.shape()[i]

    def nbytes(self) -> int:
        return self.nelms() * np.dtype(_NUMPY[self.dataType()]).itemsize

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _KitTensorInfo) and other.dataType() == self.dataType()
                and other.shape() == self.shape())

    __hash__ = None  # type: ignore[assignment]


_NUMPY = {"FLOAT": "float32", "FLOAT16": "float16", "DOUBLE": "float64", "INT8": "int8",
          "INT16": "int16", "INT32": "int32", "INT64": "int64", "UINT8": "uint8",
          "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64", "BOOL": "bool",
          "BFLOAT16": "float32"}


class AnchorReturnType:
    """popart.AnchorReturnType("All" | "Final" | "Sum" | "EveryN", returnPeriod); names are
    case-insensitive and PopART's constructor errors are raised as popart_exception."""

    def __init__(self, anchorReturnTypeString: str, returnPeriod: int | None = None,
                 tileSet: Any = None, exchangeStrategy: Any = None) -> None:
        if not isinstance(returnPeriod, int | type(None)):  # the (string, tileSet) overload
            returnPeriod, tileSet, exchangeStrategy = None, returnPeriod, tileSet
        try:
            self.kit = _KitART(anchorReturnTypeString, returnPeriod)
        except ValueError as err:
            raise popart_exception(str(err)) from None
        self._tile_set = tileSet or ENUMS["TileSet"].Compute
        self._exchange = exchangeStrategy or ENUMS["ExchangeStrategy"].JustInTime

    def id(self) -> Any:  # noqa: A003 - PopART's name
        return ENUMS["AnchorReturnTypeId"][self.kit.name]

    def rp(self) -> int:
        if self.kit.period is None:
            raise popart_exception("A return period should not be requested for this anchor "
                                   f"return type ({self.kit.name}); only EveryN has one.")
        return self.kit.period

    def tileSet(self) -> Any:
        return self._tile_set

    def exchangeStrategy(self) -> Any:
        return self._exchange

    def __repr__(self) -> str:
        return f"popart.{self.kit!r}"


class DataFlow:
    """popart.DataFlow(batchesPerStep, {id: AnchorReturnType}) or
    DataFlow(batchesPerStep, [ids], anchorReturnType=AnchorReturnType("All"))."""

    def __init__(self, batchesPerStep: int, anchorTensors: Any = None,
                 anchorReturnType: AnchorReturnType | None = None, *,
                 anchorIds: Sequence[str] | None = None) -> None:
        if anchorIds is not None:
            anchorTensors = anchorIds
        if anchorTensors is None:
            anchorTensors = {}
        if isinstance(anchorTensors, Mapping):
            if anchorReturnType is not None:
                raise TypeError("DataFlow(batchesPerStep, anchorTensors): a dict of anchors "
                                "carries its own return types; drop anchorReturnType.")
            anchors = dict(anchorTensors)
        else:
            art = anchorReturnType or AnchorReturnType("All")
            anchors = {name: art for name in anchorTensors}
        for name, art in anchors.items():
            if not isinstance(art, AnchorReturnType):
                raise TypeError(f"DataFlow: anchor {name!r} has {art!r}; give "
                                f"popart.AnchorReturnType('All' | 'Final' | 'Sum' | 'EveryN', N).")
        if isinstance(batchesPerStep, bool) or not isinstance(batchesPerStep, int):
            raise TypeError(f"DataFlow: batchesPerStep={batchesPerStep!r} must be an int.")
        if batchesPerStep <= 0:
            raise popart_exception("'Batches per step' must be greater than zero")
        for art in anchors.values():
            if art.kit.period is not None:
                if art.kit.period > batchesPerStep:
                    raise popart_exception("Return period must be <= to the number of batches "
                                           "per step")
                if batchesPerStep % art.kit.period:
                    raise popart_exception("Return period must be a factor of the number of "
                                           "batches per step")
        self._bps, self._anchors = batchesPerStep, anchors

    def batchesPerStep(self) -> int:
        return self._bps

    def setBatchesPerStep(self, batchesPerStep: int) -> None:
        self._bps = batchesPerStep

    def anchors(self) -> list[str]:
        return list(self._anchors)

    def nAnchors(self) -> int:
        return len(self._anchors)

    def isAnchored(self, id: str) -> bool:  # noqa: A002
        return id in self._anchors

    def art(self, id: str) -> AnchorReturnType:  # noqa: A002
        if id not in self._anchors:
            raise popart_exception(f"Tensor {id} is not anchored; anchors: {self.anchors()}")
        return self._anchors[id]

    def returnTypes(self) -> dict[str, AnchorReturnType]:
        return dict(self._anchors)


class InputShapeInfo:
    """popart.InputShapeInfo: shapes for inputs the model leaves unknown. Accepted; a model
    given to a session here must have every input shape set."""

    def __init__(self) -> None:
        self._infos: dict[str, TensorInfo] = {}

    def add(self, id: str, info: TensorInfo) -> None:  # noqa: A002
        self._infos[id] = info

    def get(self, id: str) -> TensorInfo:  # noqa: A002
        return self._infos[id]

    def has(self, id: str) -> bool:  # noqa: A002
        return id in self._infos


class Patterns:
    """popart.Patterns: which graph transformations PopART applies. Accepted and recorded: the
    xla runtime lowers the ONNX graph directly, so patterns (inplacing, op fusion, recompute
    rewrites) cannot change what is computed here; numbers are the same as with PopART's
    default patterns."""

    def __init__(self, level: Any = None, *, patterns: Sequence[str] = ()) -> None:
        if isinstance(level, list | tuple):
            patterns, level = level, None
        self.level = level if level is not None else ENUMS["PatternsLevel"].Default
        self._enabled: dict[str, bool] = {p: True for p in patterns}
        self.runtimeAsserts = True
        self.inplaceEnabled = True
        self.updateInplacePrioritiesForIpuEnabled = False

    def enablePattern(self, name: str, enabled: bool) -> Patterns:
        self._enabled[name] = bool(enabled)
        return self

    def isPatternEnabled(self, name: str) -> bool:
        return self._enabled.get(name, self.level is not ENUMS["PatternsLevel"].NoPatterns)

    def enableRuntimeAsserts(self, enabled: bool) -> Patterns:
        self.runtimeAsserts = bool(enabled)
        return self

    def enableInPlace(self, enabled: bool) -> Patterns:
        self.inplaceEnabled = bool(enabled)
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("enable") and name[6:7].isupper():  # enableMatMulOp(...) etc.
            pattern = name[6:]
            return lambda enabled: self.enablePattern(pattern, enabled)
        if name.startswith("is") and name.endswith("Enabled"):
            return lambda: self.isPatternEnabled(name[2:-7])
        raise AttributeError(f"'popart.Patterns' object has no attribute {name!r}")


# -- host data --------------------------------------------------------------------------------


def _contiguous(kind: str, name: str, array: Any, who: str = "PyStepIO") -> np.ndarray:
    """``array`` if it is a C-contiguous numpy array, as PopART's bindings require of host
    arrays (a converted copy would be read or written in its place); ``who`` names the user."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{who}: the {kind} for tensor {name!r} is a "
                        f"{type(array).__name__}; give a numpy array.")
    if not array.flags.c_contiguous:
        raise popart_exception(f"{who} is unable to use the numpy {kind} array for tensor "
                               f"'{name}' as it is not c-contiguous (a data layout requirement). "
                               f"Fix: pass np.ascontiguousarray(array).")
    return array


class PyStepIO:
    """popart.PyStepIO(inputs, outputs): one run's host arrays. Only element counts and dtypes
    matter, as in PopART; outputs are written in place."""

    def __init__(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]
                 ) -> None:
        self.inputs = {k: _contiguous("input", k, v) for k, v in inputs.items()}
        self.outputs = {k: _contiguous("output", k, v) for k, v in outputs.items()}
        self.runtime_asserts = True

    def enableRuntimeAsserts(self, b: bool) -> None:
        self.runtime_asserts = bool(b)


class PyStepIOCallback:
    """popart.PyStepIOCallback(input_callback, input_complete_callback, output_callback,
    output_complete_callback): one array per micro-batch and replica, asked for in PopART's
    order (micro-batch major, replica minor)."""

    def __init__(self, input_callback: Callable[[str, bool], Any],
                 input_complete_callback: Callable[[str], Any],
                 output_callback: Callable[[str], Any],
                 output_complete_callback: Callable[[str], Any]) -> None:
        self.input_callback = input_callback
        self.input_complete_callback = input_complete_callback
        self.output_callback = output_callback
        self.output_complete_callback = output_complete_callback
        self.runtime_asserts = True

    def enableRuntimeAsserts(self, b: bool) -> None:
        self.runtime_asserts = bool(b)


class PyWeightsIO:
    """popart.PyWeightsIO({weight id: array}): the arrays readWeights fills and writeWeights
    reads."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        for name, array in weights.items():
            if not isinstance(array, np.ndarray):
                raise TypeError(f"PyWeightsIO: {name!r} maps to a {type(array).__name__}; give "
                                f"a numpy array.")
        self.weights = dict(weights)

    def contains(self, id: str) -> bool:  # noqa: A002
        return id in self.weights


__all__ = ["popart_exception", "poplar_exception", "ENUMS", "RESERVED_PREFIXES",
           "PREFIX_FUNCTIONS", "TensorInfo", "AnchorReturnType", "DataFlow", "InputShapeInfo",
           "Patterns", "PyStepIO", "PyStepIOCallback", "PyWeightsIO", "InputSettings"]
