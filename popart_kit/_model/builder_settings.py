"""The Builder's per-node settings: PopART's annotation methods and attribute accessors.

:class:`NodeSettings` is a base class of :class:`~popart_kit._model.builder.Builder`. Each method
writes the node attribute PopART writes (same name, ONNX type and encoding) and checks its
arguments as PopART does, with PopART's error text, raised as ``BuilderError``. The attribute
names are PopART's (``willow/include/popart/names.hpp``).

Off the IPU these annotations change nothing (the xla backend reads none of them), except a
MatMul's or Conv's partials type (:meth:`NodeSettings.setPartialsType`), which the xla backend
honours as it honours ``precision.partials_type``.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, helper

from .builder_base import BuilderError, Scope, debug_name, is_count, is_str, overload, signature

__all__ = ["NodeSettings", "scope_attributes", "EXECUTION_PHASE", "RECOMPUTE_OUTPUT",
           "PARTIALS_TYPE", "AVAILABLE_MEMORY", "OUTPUT_TENSOR_LOCATION", "SCHEDULE_PRIORITY",
           "OUTLINE", "COMM_GROUP", "EXCLUDE_PATTERNS", "INPLACE_OP_NAMES",
           "INPLACE_OP_PRIORITIES", "ENABLE_CONV_DITHERING", "SERIALIZE_MATMUL_MODE",
           "SERIALIZE_MATMUL_FACTOR", "SERIALIZE_MATMUL_PRECISION", "REPLICATION_FACTOR"]

# PopART's attribute names (willow/include/popart/names.hpp).
EXECUTION_PHASE = "__execution_phase"                      # sExecutionPhaseAttribute
RECOMPUTE_OUTPUT = "__recompute_output_in_backward_pass"   # sRecomputeOutputAttribute
PARTIALS_TYPE = "__partials_type"                          # sPartialsTypeAttribute
AVAILABLE_MEMORY = "__available_memory"                    # sAvailMemAttribute
ENABLE_CONV_DITHERING = "__enable_conv_dithering"          # sEnableConvDitheringAttribute
OUTPUT_TENSOR_LOCATION = "__output_tensor_location"        # sOutputTensorLocationAttribute
EXCLUDE_PATTERNS = "__exclude_patterns"                    # sExcludePatternsAttribute
SCHEDULE_PRIORITY = "__schedule_priority"                  # sSchedulePriority
OUTLINE = "__outline"                                      # sOutlineAttribute
INPLACE_OP_NAMES = "__inplace_op_names"                    # sInplaceOpNames
INPLACE_OP_PRIORITIES = "__inplace_op_priorities"          # sInplaceOpPriorities
SERIALIZE_MATMUL_MODE = "__serialize_matmul_mode"          # sSerializeMatMulModeAttribute
SERIALIZE_MATMUL_FACTOR = "__serialize_matmul_factor"      # sSerializeMatMulFactorAttribute
SERIALIZE_MATMUL_PRECISION = "__serialize_matmul_precision"  # sSerializeMatMulPrecisionAttr.
COMM_GROUP = "__collectiveCommGroup"                       # sCollectiveCommGroup
REPLICATION_FACTOR = "__replicationFactor"                 # sReplicationFactor (metadata key)

# sSerializeMatMulMode_InputChannels, _ReducingDim, _OutputChannels, _None (names.hpp)
_SERIALIZE_MODES = ("input_channels", "reducing_dim", "output_channels", "none")
# RecomputeType (willow/include/popart/op.hpp), in value order.
_RECOMPUTE_TYPES = ("Undefined", "Checkpoint", "Recompute", "Recomputed")
_RECOMPUTE = 2  # RecomputeType::Recompute
_CHECKPOINT = 1  # RecomputeType::Checkpoint
# The ai.onnx opsets PopART's Python Builder has classes for (AiOnnx6 ... AiOnnx11).
_POPART_AI_ONNX = range(6, 12)
# The ONNX type of each attribute a scope puts on nodes; the others are INT.
_SCOPE_TYPES = {OUTLINE: AttributeProto.STRINGS, COMM_GROUP: AttributeProto.INTS,
                OUTPUT_TENSOR_LOCATION: AttributeProto.INTS,
                SCHEDULE_PRIORITY: AttributeProto.FLOAT}
_GRAPH_UIDS = itertools.count()


def scope_attributes(scopes: Mapping[str, list[Any]]) -> list[onnx.AttributeProto]:
    """The attributes the open scopes put on a new node, by name (as PopART's BuilderImpl::
    finalizeOp adds the builder's attribute map, a std::map, after the op's own)."""
    return [helper.make_attribute(name, stack[-1],
                                  attr_type=_SCOPE_TYPES.get(name, AttributeProto.INT))
            for name, stack in sorted(scopes.items()) if name.startswith("__") and stack]


def _is_ids(v: Any) -> bool:
    """A set of tensor ids (PopART's std::set<TensorId>; lists and tuples are taken too)."""
    return isinstance(v, set | frozenset | list | tuple) and all(isinstance(i, str) for i in v)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float | np.integer | np.floating)


def _int64(value: Any, what: str) -> int:
    """An integer argument: ints and enum members convert, as pybind11 converts them."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, enum.Enum):
        try:
            return int(value)  # type: ignore[call-overload]
        except TypeError:
            pass
    raise TypeError(f"{what} must be an integer, got {value!r}")


def _recompute_type(value: Any, method: str) -> int:
    """A RecomputeType as the INT PopART writes (Undefined 0, Checkpoint 1, Recompute 2,
    Recomputed 3): a ``popart.RecomputeType`` member, or its value."""
    if isinstance(value, enum.Enum) and value.name in _RECOMPUTE_TYPES:
        return _RECOMPUTE_TYPES.index(value.name)
    if is_count(value) and 0 <= int(value) < len(_RECOMPUTE_TYPES):
        return int(value)
    raise TypeError(f"{method}(): value must be a popart.RecomputeType "
                    f"({', '.join(_RECOMPUTE_TYPES)}) or its value 0-3, got {value!r}")


def _is_recompute(v: Any) -> bool:
    return (isinstance(v, enum.Enum) and v.name in _RECOMPUTE_TYPES) or (
        is_count(v) and 0 <= int(v) < len(_RECOMPUTE_TYPES))


def _is_location(v: Any) -> bool:
    return v is None or (hasattr(v, "storage") and hasattr(v, "shardingDomain"))


def _serialized_location(value: Any) -> list[int]:
    """TensorLocation::serialize (willow/src/tensorlocation.cpp): storage, loadTileSet,
    storageTileSet, replicatedTensorSharding, shardingDomain.type and .replicaGroupSize. None is
    ``TensorLocation()``: OnChip, Compute, Compute, Off, CommGroup(All, 0)."""
    if value is None:
        return [0, 0, 0, 0, 0, 0]
    domain = value.shardingDomain
    fields = (value.storage, value.loadTileSet, value.storageTileSet,
              value.replicatedTensorSharding, domain.type, domain.replicaGroupSize)
    return [_int64(f, "outputTensorLocation(): a TensorLocation field") for f in fields]


def _partials_problem(op_type: str, partials_type: str) -> str | None:
    """PopART's refusal of a partials type, as its op creators word it (MatMul:
    willow/src/op/matmul.cpp fromString; Conv: willow/src/op/convbase.cpp MultiConvOptions)."""
    if partials_type.lower() in ("float", "half"):
        return None
    if op_type == "MatMul":
        return (f"Unable to get option 'partialsTypeMatMul' from string '{partials_type}'. "
                f"Possible values are 'float' and 'half' in any letter case.")
    return f"Bad partialsType '{partials_type.lower()}'"


class _MergedScope:
    """outlineAttributes' scope (KeyValueContextManager, python/popart/popart_core/popart.cpp):
    the key/value pairs of the enclosing scope, then the new ones for keys it lacks (std::map
    insert keeps the first), as a flat sorted [key, value, ...] list."""

    def __init__(self, builder: Any, attribute: str, pairs: dict[str, str]) -> None:
        self._builder, self._attribute, self._pairs = builder, attribute, pairs

    def __enter__(self) -> _MergedScope:
        stack = self._builder._scopes.setdefault(self._attribute, [])
        merged = dict(zip(stack[-1][::2], stack[-1][1::2], strict=True)) if stack else {}
        for key, value in self._pairs.items():
            merged.setdefault(key, value)
        stack.append([item for key in sorted(merged) for item in (key, merged[key])])
        return self

    def __exit__(self, *exc: object) -> None:
        self._builder._scopes[self._attribute].pop()


_EXECUTION_PHASE = ((signature("nodeOutputNames", "value", value=0),
                     {"nodeOutputNames": lambda v: is_str(v) or _is_ids(v),
                      "value": is_count}),
                    (signature("value", value=0), {"value": is_count}))
_RECOMPUTE_OUTPUT = ((signature("nodeOutputNames", "value", value=0),
                      {"nodeOutputNames": is_str, "value": _is_recompute}),
                     (signature("value", value=0), {"value": _is_recompute}))
_RECOMPUTE_BACKWARD = ((signature("nodeOutputName", "value", value=_RECOMPUTE),
                        {"nodeOutputName": is_str, "value": _is_recompute}),
                       (signature("nodeOutputNames", "value", value=_RECOMPUTE),
                        {"nodeOutputNames": _is_ids, "value": _is_recompute}))
_GET_RECOMPUTE_BACKWARD = ((signature("nodeOutputName"), {"nodeOutputName": is_str}),
                           (signature("nodeOutputNames"), {"nodeOutputNames": _is_ids}))
_OUTPUT_LOCATION = ((signature("nodeOutputNames", "value", value=None),
                     {"nodeOutputNames": is_str, "value": _is_location}),
                    (signature("value", value=None), {"value": _is_location}))
_AVAILABLE_MEMORY = ((signature("nodeOutputName", "availableMemoryProportion"),
                      {"nodeOutputName": is_str, "availableMemoryProportion": _is_number}),
                     (signature("nodeOutputNames", "availableMemoryProportion"),
                      {"nodeOutputNames": _is_ids, "availableMemoryProportion": _is_number}))


class NodeSettings:
    """PopART's per-node settings and attribute accessors (a base class of Builder)."""

    _scopes: dict[str, list[Any]]
    _graph: onnx.GraphProto
    _metadata: dict[str, str]
    _data: dict[str, onnx.TensorProto]

    # -- attributes: typed writes, reads and removal (willow/src/builder_impl.cpp) -----------

    def _add_typed(self: Any, name: str, attr_type: int, value: Any,
                   nodeOutputNames: str | Sequence[str]) -> None:
        """BuilderImpl::addNodeAttribute: one attribute of an explicit ONNX type (empty lists
        keep their type)."""
        node = self._node(nodeOutputNames)
        if any(a.name == name for a in node.attribute):
            raise BuilderError(f"Node already has attribute {name}.")
        node.attribute.append(helper.make_attribute(name, value, attr_type=attr_type))

    def _attribute(self: Any, attributeName: str, nodeOutputNames: str | Sequence[str],
                   attr_type: int, what: str) -> onnx.AttributeProto:
        """BuilderImpl::getNodeAttribute and the type check of its typed getters."""
        for attr in self._node(nodeOutputNames).attribute:
            if attr.name == attributeName:
                if attr.type != attr_type:
                    raise BuilderError(f"Attribute {attributeName} is not {what}.")
                return attr
        raise BuilderError(f"Node does not have an attribute {attributeName}.")

    def getInt64VectorNodeAttribute(self, attributeName: str,
                                    nodeOutputNames: str | Sequence[str]) -> list[int]:
        # builder_impl.cpp BuilderImpl::getInt64VectorNodeAttribute
        return list(self._attribute(attributeName, nodeOutputNames, AttributeProto.INTS,
                                    "an integer vector").ints)

    def getFloatNodeAttribute(self, attributeName: str,
                              nodeOutputNames: str | Sequence[str]) -> float:
        # builder_impl.cpp BuilderImpl::getFloatNodeAttribute
        return self._attribute(attributeName, nodeOutputNames, AttributeProto.FLOAT,
                               "a float").f

    def getFloatVectorNodeAttribute(self, attributeName: str,
                                    nodeOutputNames: str | Sequence[str]) -> list[float]:
        # builder_impl.cpp BuilderImpl::getFloatVectorNodeAttribute
        return list(self._attribute(attributeName, nodeOutputNames, AttributeProto.FLOATS,
                                    "a float vector").floats)

    def getStringNodeAttribute(self, attributeName: str,
                               nodeOutputNames: str | Sequence[str]) -> str:
        # builder_impl.cpp BuilderImpl::getStringNodeAttribute
        return self._attribute(attributeName, nodeOutputNames, AttributeProto.STRING,
                               "a string").s.decode("utf-8")

    def getStringVectorNodeAttribute(self, attributeName: str,
                                     nodeOutputNames: str | Sequence[str]) -> list[str]:
        # builder_impl.cpp BuilderImpl::getStringVectorNodeAttribute
        return [s.decode("utf-8") for s in self._attribute(
            attributeName, nodeOutputNames, AttributeProto.STRINGS, "a string vector").strings]

    def _bool_attribute(self, attributeName: str, nodeOutputNames: str | Sequence[str]) -> bool:
        # builder_impl.cpp BuilderImpl::getBoolNodeAttribute (not bound in Python by PopART)
        return bool(self._attribute(attributeName, nodeOutputNames, AttributeProto.INT,
                                    "a int").i)

    def getAllNodeAttributeNames(self: Any,
                                 nodeOutputNames: str | Sequence[str]) -> list[str]:
        # builder_impl.cpp BuilderImpl::getAllNodeAttributeNames
        return [a.name for a in self._node(nodeOutputNames).attribute]

    def removeNodeAttribute(self: Any, attributeName: str,
                            nodeOutputNames: str | Sequence[str]) -> None:
        # builder_impl.cpp BuilderImpl::removeNodeAttribute
        node = self._node(nodeOutputNames)
        for i, attr in enumerate(node.attribute):
            if attr.name == attributeName:
                del node.attribute[i]
                return
        raise BuilderError(f"Cannot remove attribute {attributeName} as it does not exist.")

    # -- tensors and the graph (willow/src/builder_impl.cpp) ---------------------------------

    def getValueTensorIds(self) -> list[str]:
        """Every node output, in creation order: PopART's value_info, which keeps them all
        (BuilderImpl::getValueTensorIds; runShapeInference adds each output)."""
        return [o for node in self._graph.node for o in node.output if o]

    def getTrainableTensorIds(self) -> list[str]:
        # builder_impl.cpp BuilderImpl::getTrainableTensorIds: the initializers
        return [t.name for t in self._graph.initializer]

    def isInitializer(self, id: str) -> bool:  # noqa: A002 - PopART's parameter name
        # builder_impl.cpp BuilderImpl::isInitializer
        return any(t.name == id for t in self._graph.initializer)

    def setGraphName(self, name: str) -> None:
        """BuilderImpl::setGraphName: the graph's name; an empty one becomes a unique name
        (``_0``, ``_1`` ...), as PopART's generateUniqueGraphName makes it."""
        name = debug_name(name, "graph name")
        self._graph.name = name or f"_{next(_GRAPH_UIDS)}"

    def embedReplicationFactor(self, replicationFactor: int) -> None:
        """BuilderImpl::embedReplicationFactor: the model's ``__replicationFactor`` metadata
        (read as 1 when absent). Has no effect off the IPU: the session's replication comes
        from its config; PopART reads this only when resetting grouped weights."""
        self._metadata[REPLICATION_FACTOR] = str(_int64(replicationFactor,
                                                        "replicationFactor"))

    def aiOnnxOpsetVersion(self: Any, version: int) -> None:
        """python/popart/python_files/builder.py Builder.aiOnnxOpsetVersion: make ``aiOnnx``
        the opset ``version`` (6 to 11). As in PopART it matters only once an ai.onnx opset is
        chosen (``opsets=`` or a first aiOnnx op); before that the first ``aiOnnx`` still picks
        the default, 10. A builder with ai.onnx ops of another opset is refused with PopART's
        error (PopART raises it at the next op)."""
        version = _int64(version, "version")
        if version not in _POPART_AI_ONNX:
            raise BuilderError(f"Unsupported or unrecognized ai.Onnx version: {version}")
        chosen = self._chosen_onnx
        if chosen is None or version == chosen:
            return
        if any(node.domain in ("", "ai.onnx") for node in self._graph.node):
            raise BuilderError(f"Invalid opset {version} used to add an operation. Opset for "
                               f"domain ai.onnx already defined as {chosen}")
        self._use_onnx(version)

    # -- scopes: the attributes every node created inside carries ----------------------------

    def executionPhase(self: Any, *args: Any, **kwargs: Any) -> Any:
        """``executionPhase(nodeOutputNames, value=0)`` sets a node's execution phase
        (``__execution_phase``, INT); ``with executionPhase(value=0):`` sets it on every node
        created inside (builder.hpp Builder::executionPhase; popart.cpp's binding). Has no
        effect off the IPU: execution phases schedule a model too large for the IPUs through
        streaming memory; the xla backend runs the whole graph as one program."""
        return self._annotate(EXECUTION_PHASE,
                              overload("executionPhase", args, kwargs, *_EXECUTION_PHASE))

    def getExecutionPhase(self: Any) -> int:
        # builder.cpp Builder::getExecutionPhase: the phase of the innermost scope
        return self._scope_value(EXECUTION_PHASE, "Execution phase")

    def hasExecutionPhase(self) -> bool:
        # popart.cpp: hasAttribute(sExecutionPhaseAttribute)
        return bool(self._scopes.get(EXECUTION_PHASE))

    def recomputeOutput(self: Any, *args: Any, **kwargs: Any) -> Any:
        """``recomputeOutput(nodeOutputNames, value=RecomputeType.Undefined)`` sets a node's
        RecomputeType (``__recompute_output_in_backward_pass``, INT: Undefined 0, Checkpoint 1,
        Recompute 2, Recomputed 3); ``with recomputeOutput(value):`` sets it on every node
        created inside (builder.hpp Builder::recomputeOutput; popart.cpp's binding). Has no
        effect off the IPU: recomputation trades IPU memory for cycles; XLA keeps or
        recomputes activations as it sees fit and the results are the same."""
        given = overload("recomputeOutput", args, kwargs, *_RECOMPUTE_OUTPUT)
        value = _recompute_type(given["value"], "recomputeOutput")
        if "nodeOutputNames" in given:
            self.addNodeAttribute(RECOMPUTE_OUTPUT, value, given["nodeOutputNames"])
            return None
        return Scope(self, RECOMPUTE_OUTPUT, value)

    def recomputeOutputInBackwardPass(self: Any, *args: Any, **kwargs: Any) -> None:
        """``recomputeOutputInBackwardPass(nodeOutputName | nodeOutputNames,
        value=RecomputeType.Recompute)``: ``__recompute_output_in_backward_pass`` (INT) on the
        node (builder.hpp Builder::recomputeOutputInBackwardPass). Has no effect off the IPU:
        see :meth:`recomputeOutput`."""
        given = overload("recomputeOutputInBackwardPass", args, kwargs, *_RECOMPUTE_BACKWARD)
        names = given.get("nodeOutputName", given.get("nodeOutputNames"))
        self.addNodeAttribute(RECOMPUTE_OUTPUT,
                              _recompute_type(given["value"], "recomputeOutputInBackwardPass"),
                              names)

    def getRecomputeOutputInBackwardPass(self, *args: Any, **kwargs: Any) -> bool:
        """Whether the node's ``__recompute_output_in_backward_pass`` is non-zero - True for
        Checkpoint too, as PopART's reads it (builder.hpp, getBoolNodeAttribute)."""
        given = overload("getRecomputeOutputInBackwardPass", args, kwargs,
                         *_GET_RECOMPUTE_BACKWARD)
        return self._bool_attribute(RECOMPUTE_OUTPUT, next(iter(given.values())))

    def checkpointOutput(self: Any, nodeOutputNames: Sequence[str]) -> list[str]:
        """An Identity node (named "Checkpoint") per tensor, its output marked Checkpoint and
        excluding the PreUniRepl and PostNRepl patterns; returns the new tensors
        (builder_impl.cpp BuilderImpl::checkpointOutput). Has no effect off the IPU: the
        tensors are copies, see :meth:`recomputeOutput`."""
        if not isinstance(nodeOutputNames, list | tuple) or not all(
                isinstance(t, str) for t in nodeOutputNames):
            raise TypeError(f"checkpointOutput(): nodeOutputNames must be a list of tensor ids, "
                            f"got {nodeOutputNames!r}")
        results = []
        for tensor in nodeOutputNames:
            output = self._add_node("Identity", [tensor], 1, {}, "Checkpoint")[0]
            self.addNodeAttribute(RECOMPUTE_OUTPUT, _CHECKPOINT, output)
            self.addNodeAttribute(EXCLUDE_PATTERNS, ["PreUniRepl", "PostNRepl"], output)
            results.append(output)
        return results

    def outputTensorLocation(self: Any, *args: Any, **kwargs: Any) -> Any:
        """``outputTensorLocation(nodeOutputNames, value=TensorLocation())`` sets where a node's
        output lives (``__output_tensor_location``, INTS: TensorLocation::serialize, six
        values); ``with outputTensorLocation(value):`` sets it on every node created inside
        (builder.hpp Builder::outputTensorLocation; popart.cpp's binding). ``value`` is a
        ``popart.TensorLocation``. Has no effect off the IPU: on-chip, streaming-memory and
        replica-sharded storage are IPU memory placements."""
        given = overload("outputTensorLocation", args, kwargs, *_OUTPUT_LOCATION)
        value = _serialized_location(given["value"])
        if "nodeOutputNames" in given:
            self._add_typed(OUTPUT_TENSOR_LOCATION, AttributeProto.INTS, value,
                            given["nodeOutputNames"])
            return None
        return Scope(self, OUTPUT_TENSOR_LOCATION, value)

    def schedulePriority(self: Any, value: float) -> Any:
        """``with schedulePriority(value):`` gives every node created inside the scheduling
        priority ``value`` (``__schedule_priority``, FLOAT; popart.cpp's binding). Has no effect
        off the IPU: it orders PopART's op schedule; XLA schedules its own."""
        if not _is_number(value):
            raise TypeError(f"schedulePriority(): value must be a number, got {value!r}")
        return Scope(self, SCHEDULE_PRIORITY, float(np.float32(value)))

    def outlineAttributes(self: Any, arg0: Mapping[Any, Any], /) -> _MergedScope:
        """``with outlineAttributes({key: value, ...}):`` gives every node created inside the
        outlining key/value pairs (``__outline``, STRINGS ``[key, value, ...]`` sorted by key,
        as ``str()``; an enclosing scope's pairs kept, its value winning for a repeated key) -
        popart.cpp's KeyValueContextManager. Has no effect off the IPU: outlining shares code
        between identical IPU subgraphs."""
        if not isinstance(arg0, Mapping):
            raise TypeError(f"outlineAttributes(): expected a dict, got {arg0!r}")
        pairs: dict[str, str] = {}
        for key, value in arg0.items():
            pairs.setdefault(str(key), str(value))
        return _MergedScope(self, OUTLINE, pairs)

    def commGroup(self: Any, type: Any = 0, groupSize: Any = 0) -> Any:  # noqa: A002
        """``with commGroup(type=0, groupSize=0):`` gives every node created inside the
        collective replica group ``[type, groupSize]`` (``__collectiveCommGroup``, INTS;
        popart.cpp's binding, PopART's deprecated sCollectiveCommGroup). Has no effect off the
        IPU: the xla backend's collectives span the replicas of its config."""
        return Scope(self, COMM_GROUP, [_int64(type, "commGroup(): type"),
                                                 _int64(groupSize, "commGroup(): groupSize")])

    # -- per-node settings -------------------------------------------------------------------

    def setAvailableMemoryProportion(self: Any, *args: Any, **kwargs: Any) -> None:
        """``setAvailableMemoryProportion(nodeOutputName | nodeOutputNames,
        availableMemoryProportion)``: ``__available_memory`` (FLOAT), replacing any earlier
        value; refused outside (0, 1] (builder.cpp Builder::setAvailableMemoryProportion). Has
        no effect off the IPU: it bounds the temporary tile memory of IPU convolutions and
        matmuls."""
        given = overload("setAvailableMemoryProportion", args, kwargs, *_AVAILABLE_MEMORY)
        names = given.get("nodeOutputName", given.get("nodeOutputNames"))
        proportion = np.float32(given["availableMemoryProportion"])  # PopART takes a float
        if not 0.0 < proportion <= 1.0:  # NaN is refused too
            raise BuilderError("availableMemoryProportion must be in (0,1]")
        if self.nodeHasAttribute(AVAILABLE_MEMORY, names):
            self.removeNodeAttribute(AVAILABLE_MEMORY, names)
        self._add_typed(AVAILABLE_MEMORY, AttributeProto.FLOAT, float(proportion), names)

    def setSerializeMatMul(self: Any, nodeOutputName: str | Sequence[str], mode: str,
                           factor: int = 0, keep_precision: bool = False) -> None:
        """``__serialize_matmul_mode`` (STRING), ``__serialize_matmul_factor`` (INT) and
        ``__serialize_matmul_precision`` (INT 0/1) on a node; mode "none" writes nothing
        (builder.hpp Builder::setSerializeMatMul). Has no effect off the IPU: splitting a
        matmul into ``factor`` serial ones saves IPU memory and gives the same product."""
        if not isinstance(mode, str):
            raise TypeError(f"setSerializeMatMul(): mode must be text, got {mode!r}")
        factor = _int64(factor, "setSerializeMatMul(): factor")
        if mode in _SERIALIZE_MODES[:3]:
            self._add_typed(SERIALIZE_MATMUL_MODE, AttributeProto.STRING, mode, nodeOutputName)
            self._add_typed(SERIALIZE_MATMUL_FACTOR, AttributeProto.INT, factor, nodeOutputName)
            self._add_typed(SERIALIZE_MATMUL_PRECISION, AttributeProto.INT,
                            int(bool(keep_precision)), nodeOutputName)
        elif mode != _SERIALIZE_MODES[3]:
            raise BuilderError(f"Unsupported mat mul serialization mode '{mode}'. Supported modes "
                               f"are '{_SERIALIZE_MODES[0]}', '{_SERIALIZE_MODES[1]}', "
                               f"'{_SERIALIZE_MODES[2]}' or '{_SERIALIZE_MODES[3]}'")

    def setPartialsType(self: Any, nodeOutputName: str, partialsType: str) -> None:
        """``__partials_type`` (STRING, as given) on a Conv or MatMul (builder.cpp
        Builder::setPartialsType); a type other than float or half (any letter case) is refused
        here with the error PopART's op gives when the session is made. The xla backend
        honours it: a half-precision product of this node accumulates in float32 ("float") or
        float16 ("half"), overriding ``precision.partials_type``; float32 products are
        unchanged."""
        if not isinstance(partialsType, str):
            raise TypeError(f"setPartialsType(): partialsType must be text, got "
                            f"{partialsType!r}")
        op_type = self._node(nodeOutputName).op_type
        if op_type not in ("Conv", "MatMul"):
            raise BuilderError(f"Builder::setPartialsType should only be called on operators: "
                               f"Conv, MatMul; but was given: {op_type}")
        problem = _partials_problem(op_type, partialsType)
        if problem:
            raise BuilderError(problem)
        self._add_typed(PARTIALS_TYPE, AttributeProto.STRING, partialsType, nodeOutputName)

    def getPartialsType(self: Any, nodeOutputName: str) -> str:
        # builder.cpp Builder::getPartialsType: the node's, else Poplar's default "FLOAT"
        if self.nodeHasAttribute(PARTIALS_TYPE, nodeOutputName):
            return self.getStringNodeAttribute(PARTIALS_TYPE, nodeOutputName)
        return "FLOAT"

    def setEnableConvDithering(self: Any, nodeOutputName: str,
                               enableConvDithering: int) -> None:
        """``__enable_conv_dithering`` (INT 0/1) on a Conv (builder.cpp
        Builder::setEnableConvDithering). Has no effect off the IPU: dithering varies the tile
        placement of IPU convolutions."""
        value = (int(enableConvDithering) if isinstance(enableConvDithering, bool) else
                 _int64(enableConvDithering, "setEnableConvDithering(): enableConvDithering"))
        if value not in (0, 1):
            raise BuilderError("enableConvDithering must be a bool value")
        op_type = self._node(nodeOutputName).op_type
        if op_type != "Conv":
            raise BuilderError(f"Builder::setEnableConvDithering should only be called on "
                               f"convolutions but was given: {op_type}")
        self._add_typed(ENABLE_CONV_DITHERING, AttributeProto.INT, value, nodeOutputName)

    def setInplacePreferences(self: Any, nodeOutputName: str,
                              prefs: Mapping[str, float]) -> None:
        """``__inplace_op_names`` (STRINGS) and ``__inplace_op_priorities`` (FLOATS), by op
        name (builder.hpp Builder::setInplacePreferences). Has no effect off the IPU: XLA
        decides which buffers it reuses; the results are the same."""
        if not isinstance(prefs, Mapping) or not all(
                isinstance(k, str) and _is_number(v) for k, v in prefs.items()):
            raise TypeError(f"setInplacePreferences(): prefs must map op names to numbers, got "
                            f"{prefs!r}")
        names = sorted(prefs)  # a std::map
        self._add_typed(INPLACE_OP_NAMES, AttributeProto.STRINGS, names, nodeOutputName)
        self._add_typed(INPLACE_OP_PRIORITIES, AttributeProto.FLOATS,
                        [float(np.float32(prefs[n])) for n in names], nodeOutputName)

    def excludePatterns(self: Any, nodeOutputName: str | Sequence[str],
                        patternNames: Sequence[str]) -> None:
        """``__exclude_patterns`` (STRINGS): PopART patterns not to apply to the node
        (builder.hpp Builder::excludePatterns). Has no effect off the IPU: the xla backend
        applies no PopART patterns."""
        if not isinstance(patternNames, list | tuple) or not all(
                isinstance(p, str) for p in patternNames):
            raise TypeError(f"excludePatterns(): patternNames must be a list of pattern names, "
                            f"got {patternNames!r}")
        self._add_typed(EXCLUDE_PATTERNS, AttributeProto.STRINGS, list(patternNames),
                        nodeOutputName)
