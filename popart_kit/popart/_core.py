"""PopART's small types: enums, the exception, reserved prefixes, TensorInfo, AnchorReturnType,
DataFlow, InputShapeInfo, Patterns and the host-data objects (PyStepIO, PyStepIOCallback,
PyWeightsIO)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .._base.names import GRADIENT_PREFIX
from .._base.shapes import AnchorReturnType as _KitART
from .._config import catalog
from .._model.builder import InputSettings, ReductionType, ReplicatedStreamMode
from .._model.builder import TensorInfo as _KitTensorInfo
from ..errors import PopartException

#: The error PopART raises for a refused program or configuration (the Builder's refusals
#: are ones too). A ValueError, so code that catches the kit's refusals catches it too.
popart_exception = PopartException


def popart_text(err: BaseException) -> str:
    """What a popart_exception says for the kit's ``err``: PopART's own message where the
    refused rule has one (programs and tests match on it), else the kit's."""
    return getattr(err, "popart_text", None) or str(err)


class poplar_exception(popart_exception):  # noqa: N801
    """PopART's error for a failure inside Poplar (kept for ``except`` clauses)."""


poplar_runtime_error = poplar_exception
poplar_application_runtime_error = poplar_exception
poplar_recoverable_runtime_error = poplar_exception
poplar_unrecoverable_runtime_error = poplar_exception


class OutOfMemoryException(popart_exception):  # noqa: N818 - PopART's name
    """popart.OutOfMemoryException (popart.session): prepareDevice's error when the program
    does not fit the device; here, when the xla runtime's estimate of a step exceeds the
    memory it can use (the kit's rule K-memory)."""

    def __init__(self, e: BaseException | str) -> None:
        super().__init__(str(e))
        self.error = e

    def getSummaryReport(self) -> str:
        """The estimate that did not fit (no Poplar report exists off the IPU)."""
        return str(self.error)

    def getProfilePath(self) -> str:
        """"": no profile.pop is written off the IPU (PopART's answer when none exists)."""
        return ""


class _Enum(enum.Enum):
    """A pybind11-like enum: members have ``name`` and ``value`` and convert with ``int()``."""

    def __int__(self) -> int:
        return int(self.value)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


#: Enums whose C++ values are not their position in the binding's member order (int() of a
#: member gives the C++ value, as pybind11 does): DataType (willow/include/popart/datatype.hpp).
_CPP_ORDER = {"DataType": ["UINT8", "INT8", "FLOAT8_143", "FLOAT8_152", "UINT16", "INT16",
                           "INT32", "INT64", "UINT32", "UINT64", "BOOL", "FLOAT", "FLOAT16",
                           "BFLOAT16", "DOUBLE", "COMPLEX64", "COMPLEX128", "STRING",
                           "UNDEFINED"]}


def _enum(name: str, members: Sequence[str]) -> type[_Enum]:
    order = _CPP_ORDER.get(name, members)
    return _Enum(name, [(m, order.index(m)) for m in members])  # type: ignore[return-value]


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
    "IrSerializationFormat": ["JSON"],
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
    "InitType": ["NoInit", "Zero"],
    "TensorRemapType": ["FwdBwdReverse", "FwdBwd", "Fwd"],
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
    "AutomaticLossScale": "AutomaticLossScaleProxy___",
    "Init": "Init___", "Index": "Index___", "ConstValue": "ConstValue___",
    "GlobalNorm": "GlobalNorm___", "LoopIterator": "Iterator___", "LoopCond": "LoopCond___",
}
# the optimizer hyperparameter tensors: reserved{Default,Specific}<Name>Prefix
RESERVED_PREFIXES.update({
    f"{kind}{name}": f"{stem}___{kind.lower()}___"
    for name, stem in (("AdamBeta1", "adamBeta1"), ("AdamBeta2", "adamBeta2"),
                       ("AdamEps", "adamEps"), ("DampeningScaleFactor1", "dampeningScaleFactor1"),
                       ("LearningRate", "learningRate"), ("LossScaling", "lossScaling"),
                       ("MaxWeightNorm", "maxWeightNorm"),
                       ("ScaledLearningRate0", "scaledLearningRate0"),
                       ("ScaledLearningRate1", "scaledLearningRate1"),
                       ("ScaledMomentum1", "scaledMomentum1"),
                       ("ScaledWeightDecay1", "scaledWeightDecay1"), ("Step", "step"),
                       ("WeightDecay", "weightDecay"),
                       ("WeightDecayScaleFactor0", "weightDecayScaleFactor0"))
    for kind in ("Default", "Specific")})


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
            raise popart_exception(popart_text(err)) from None
        self._tile_set = tileSet or ENUMS["TileSet"].Compute
        self._exchange = exchangeStrategy or ENUMS["ExchangeStrategy"].JustInTime

    def id(self) -> Any:  # noqa: A003 - PopART's name
        return ENUMS["AnchorReturnTypeId"][self.kit.name]

    def rp(self) -> int:
        if self.kit.period is None:
            raise popart_exception("A return period should not be supplied for this anchor "
                                   "return type")  # PopART's text (dataflow.cpp rp())
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
    """popart.InputShapeInfo: the type and shape of graph inputs the model leaves unknown (a
    ``dim_param`` or a negative size); a session takes them in place of the model's."""

    def __init__(self) -> None:
        self._infos: dict[str, TensorInfo] = {}

    def add(self, id: str, info: TensorInfo) -> None:  # noqa: A002
        self._infos[id] = info

    def get(self, id: str) -> TensorInfo:  # noqa: A002
        return self._infos[id]

    def has(self, id: str) -> bool:  # noqa: A002
        return id in self._infos

    def shaped(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """A copy of ``model`` whose graph inputs named here have the given type and shape."""
        if not self._infos:
            return model
        out = onnx.ModelProto()
        out.CopyFrom(model)
        for value in out.graph.input:
            info = self._infos.get(value.name)
            if info is not None:
                value.type.CopyFrom(helper.make_tensor_type_proto(
                    getattr(onnx.TensorProto, info.dataType()), info.shape()))
        return out


#: PopART's graph patterns (willow/src/patterns/*.cpp, each ``PatternCreator<...>(name,
#: enabled, mandatory)``): name -> (enabled by default, mandatory).
PATTERNS: dict[str, tuple[bool, bool]] = {
    "AllReduceToIdentity": (True, True), "Atan2Arg0GradOp": (True, True),
    "Atan2Arg1GradOp": (True, True), "ConvDataGrad": (True, True),
    "ConvFlipWeightsDoubleFlip": (True, False), "ConvFlipWeightsGradOp": (True, True),
    "ConvTranspose": (True, True), "CosGradOp": (True, True), "CoshOp": (True, True),
    "DecomposeBinaryConstScalar": (True, False), "DivArg0GradOp": (True, True),
    "DivArg1GradOp": (True, True), "AbsGradOp": (True, True), "SinGradOp": (True, True),
    "ExpandCast": (True, False), "ExpGradOp": (True, True), "Expm1GradOp": (True, True),
    "FmodArg0GradOp": (True, True), "InitAccumulate": (True, False),
    "LambSerialisedWeight": (True, False), "RandomNormalLikeOpPattern": (True, True),
    "RandomUniformLikeOpPattern": (True, True), "ZerosLikeOpPattern": (True, True),
    "Log1pGradOp": (True, True), "LogGradOp": (True, True), "LoopScanOut": (True, True),
    "LSTMOp": (False, False), "MatMulOp": (True, True), "MatMulLhsGradOp": (True, True),
    "MatMulRhsGradOp": (True, True), "MulArgGradOp": (True, True),
    "NegativeOneScale": (True, False), "NlllWithSoftmaxGradDirect": (True, False),
    "OpToIdentity": (True, False), "PackedDataBlock": (True, False), "PadSum": (True, False),
    "PostNRepl": (True, False), "PowArg0GradOp": (True, True), "PowArg1GradOp": (True, True),
    "PreUniRepl": (True, False), "ReciprocalGradOp": (True, True),
    "RemoveUnnecessaryLossGradCast": (True, False), "ScanToLoop": (True, True),
    "Slice2SliceSubsample": (False, False), "SoftmaxGradDirect": (True, False),
    "SplitGather": (False, False), "SplitGradOpToConcat": (True, False),
    "SplitOp": (True, False), "SqrtGradOp": (True, True), "SubtractArg1GradOp": (True, True),
    "SumToAdd": (True, False), "TiedGather": (False, False),
    "TiedGatherAccumulate": (False, False),
    "TransposeToIdentityOrReshapePattern": (True, False), "UpsampleToResize": (True, False),
}
#: The patterns PopART's Python Patterns has a property for (popart.cpp), by property name.
_PROPERTIES = {"PreUniRepl": "PreUniRepl", "PostNRepl": "PostNRepl",
               "SoftMaxGradDirect": "SoftmaxGradDirect",
               "NlllWithSoftMaxGradDirect": "NlllWithSoftmaxGradDirect",
               "OpToIdentity": "OpToIdentity", "SubtractArg1GradOp": "SubtractArg1GradOp",
               "MulArgGradOp": "MulArgGradOp", "MatMulOp": "MatMulOp",
               "MatMulLhsGradOp": "MatMulLhsGradOp", "MatMulRhsGradOp": "MatMulRhsGradOp"}
#: Not graph patterns: switches PopART's Patterns keeps beside them.
_SWITCHES = ("InPlace", "UpdateInplacePrioritiesForIpu")


class Patterns:
    """popart.Patterns: which graph transformations PopART applies, as PopART keeps them
    (willow/src/patterns/patterns.cpp): levels, names, mandatory patterns and the checks on
    them. The xla runtime lowers the ONNX graph directly, so patterns (inplacing, op fusion,
    gradient rewrites) cannot change what is computed here; numbers are those of PopART's
    default patterns."""

    def __init__(self, level: Any = None, *, patterns: Sequence[str] | None = None) -> None:
        if isinstance(level, list | tuple):
            patterns, level = level, None
        levels = ENUMS["PatternsLevel"]
        self.level = level if level is not None else levels.Default
        self.runtimeAsserts = True
        self.updateInplacePrioritiesForIpuEnabled = False
        if patterns is not None:  # Patterns(strings): only these
            self._settings: dict[str, bool] = {}
            self.inplaceEnabled = False
            for name in patterns:
                if name == "InPlace":
                    self.inplaceEnabled = True
                elif name == "UpdateInplacePrioritiesForIpu":
                    self.updateInplacePrioritiesForIpuEnabled = True
                else:
                    self._known(name)
                    self._settings[name] = True
            return
        name = getattr(self.level, "name", str(self.level))
        if name == "NoPatterns":
            self._settings, self.inplaceEnabled = {}, False
        elif name == "Minimal":
            self._settings = {p: mandatory for p, (_, mandatory) in PATTERNS.items()}
            self.inplaceEnabled = False
        else:  # Default, All
            self._settings = {p: on or name == "All" for p, (on, _) in PATTERNS.items()}
            self.inplaceEnabled = True

    @staticmethod
    def _known(name: str) -> None:
        if name not in PATTERNS:
            raise popart_exception(f"Unknown pattern {name}, did you mean InPlace?"
                                   if name == "Inplace" else f"Unknown pattern {name}")

    def enablePattern(self, name: str, enabled: bool) -> Patterns:
        """PopART's Patterns::enablePattern: a mandatory pattern cannot be disabled."""
        if name == "InPlace":
            return self.enableInPlace(enabled)
        if name == "UpdateInplacePrioritiesForIpu":
            self.updateInplacePrioritiesForIpuEnabled = bool(enabled)
            return self
        self._known(name)
        if not enabled and PATTERNS[name][1]:
            raise popart_exception(f"Pattern '{name}' is mandatory and cannot be disabled")
        self._settings[name] = bool(enabled)
        return self

    def isPatternEnabled(self, name: str) -> bool:
        if name == "InPlace":
            return self.inplaceEnabled
        if name == "UpdateInplacePrioritiesForIpu":
            return self.updateInplacePrioritiesForIpuEnabled
        self._known(name)
        return self._settings.get(name, False)

    def enableRuntimeAsserts(self, enabled: bool) -> Patterns:
        self.runtimeAsserts = bool(enabled)
        return self

    def enableInPlace(self, enabled: bool) -> Patterns:
        self.inplaceEnabled = bool(enabled)
        return self

    def check(self) -> None:
        """PopART's check when a session applies the patterns (with runtime asserts on):
        every mandatory pattern is enabled."""
        if not self.runtimeAsserts:
            return
        off = [p for p, (_, mandatory) in PATTERNS.items()
               if mandatory and not self._settings.get(p, False)]
        if off:
            raise popart_exception(f"Pattern '{off[0]}' must be enabled")

    def __repr__(self) -> str:
        on = [p for p in PATTERNS if self._settings.get(p, False)]
        on += ["InPlace"] if self.inplaceEnabled else []
        return f"Patterns({', '.join(on)})"

    def __getattr__(self, name: str) -> Any:
        if name in _PROPERTIES:
            return self.isPatternEnabled(_PROPERTIES[name])
        if name == "InPlace":
            return self.inplaceEnabled
        if name.startswith("enable") and name[6:7].isupper():  # enableMatMulOp(...) etc.
            pattern = name[6:]
            return lambda enabled: self.enablePattern(pattern, enabled)
        if name.startswith("is") and name.endswith("Enabled"):
            return lambda: self.isPatternEnabled(name[2:-7])
        raise AttributeError(f"'popart.Patterns' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PROPERTIES:
            self.enablePattern(_PROPERTIES[name], value)
        elif name == "InPlace":
            self.enableInPlace(value)
        else:
            object.__setattr__(self, name, value)


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


__all__ = ["popart_exception", "poplar_exception", "OutOfMemoryException", "ENUMS",
           "RESERVED_PREFIXES", "PREFIX_FUNCTIONS", "TensorInfo", "AnchorReturnType",
           "DataFlow", "InputShapeInfo", "Patterns", "PyStepIO", "PyStepIOCallback",
           "PyWeightsIO", "InputSettings"]
