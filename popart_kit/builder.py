"""Builder: popart.Builder's API without the SDK, and PipelineBuilder, its stage helper.

A script written against ``popart.Builder`` builds the same ONNX model with :class:`Builder`:
the same method names, parameter names and tensor ids, PopART's own annotation attributes
(``__pipeline_stage``, ``__ipu_number`` as INT), Broadcast inputs stored as PopART stores them
(``metadata_props``), and PopART's failures (an attribute a node already has, a node named by
only some of its outputs). Models pass ``onnx.checker``; those using only ai.onnx operators load
into onnxruntime.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._onnx_ops import OpSignature, signatures
from .layout import PIPELINE_STAGE, VIRTUAL_GRAPH, PipelineLayout

__all__ = ["Builder", "BuilderError", "PipelineBuilder", "TensorInfo", "InputSettings",
           "ReplicatedStreamMode", "ReductionType", "DEFAULT_AI_ONNX_OPSET"]

DEFAULT_AI_ONNX_OPSET = 10  # popart.defaultAiOnnxOpset
AI_GRAPHCORE = "ai.graphcore"
_DELIMITER = "/"

# PopART's data type names and their ONNX types.
_DTYPES = {name: getattr(onnx.TensorProto, name) for name in (
    "FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE", "INT8", "INT16", "INT32", "INT64", "UINT8",
    "UINT16", "UINT32", "UINT64", "BOOL")}


class BuilderError(ValueError):
    """A model-building mistake PopART's Builder also refuses."""


class ReductionType(enum.Enum):
    """popart.ReductionType; losses store it as the strings Sum, Mean and None."""

    Sum = 0
    Mean = 1
    NoReduction = 2

    @property
    def attribute(self) -> str:
        return "None" if self is ReductionType.NoReduction else self.name


class ReplicatedStreamMode(enum.Enum):
    """popart.ReplicatedStreamMode: Broadcast sends one host value to every replica."""

    Broadcast = 0
    Replicate = 1


class InputSettings:
    """popart.InputSettings (its keyword is spelt ``relicatedStreamMode``, as in PopART)."""

    def __init__(self, relicatedStreamMode: ReplicatedStreamMode = ReplicatedStreamMode.Replicate
                 ) -> None:
        self._mode = ReplicatedStreamMode(relicatedStreamMode)

    def replicatedStreamMode(self) -> ReplicatedStreamMode:
        return self._mode


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        if dtype.upper() in _DTYPES:
            return dtype.upper()
        raise BuilderError(f"unknown data type {dtype!r}; PopART's names are "
                           f"{', '.join(_DTYPES)}.")
    try:
        np_dtype = np.dtype(dtype)
        return onnx.TensorProto.DataType.Name(helper.np_dtype_to_tensor_dtype(np_dtype))
    except (TypeError, KeyError) as err:
        raise BuilderError(f"cannot use {dtype!r} as a tensor data type") from err


class TensorInfo:
    """popart.TensorInfo: ``TensorInfo("FLOAT", [2, 3])``, ``TensorInfo(np.float32, shape)`` or
    ``TensorInfo(array)``."""

    def __init__(self, *args: Any) -> None:
        if len(args) == 1 and isinstance(args[0], np.ndarray):
            dtype, shape = args[0].dtype, args[0].shape
        elif len(args) == 2:
            dtype, shape = args
        else:
            raise TypeError(f"Can not create TensorInfo with args {args!r}")
        self._type = _dtype_name(dtype)
        self._shape = [int(d) for d in shape]

    def shape(self) -> list[int]:
        return list(self._shape)

    def rank(self) -> int:
        return len(self._shape)

    def nelms(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    def dataType(self) -> str:
        return self._type

    def data_type_lcase(self) -> str:
        return self._type.lower()

    def __repr__(self) -> str:
        return f"TensorInfo({self._type!r}, {self._shape})"


class _Scope:
    """A context manager that pushes an attribute value for the nodes created inside it."""

    def __init__(self, builder: Builder, attribute: str, value: int) -> None:
        self._builder, self._attribute, self._value = builder, attribute, int(value)

    def __enter__(self) -> _Scope:
        self._builder._scopes.setdefault(self._attribute, []).append(self._value)
        return self

    def __exit__(self, *exc: object) -> None:
        self._builder._scopes[self._attribute].pop()


class _AiOnnx:
    """``builder.aiOnnx``: every ai.onnx operator of the builder's opset."""

    def __init__(self, builder: Builder, version: int) -> None:
        self._builder, self.version = builder, version
        self._ops = signatures(version)

    def __getattr__(self, name: str) -> Any:
        try:
            op = self._ops[name]
        except KeyError:
            raise AttributeError(f"aiOnnx opset {self.version} has no operator {name!r}") from None
        return functools.partial(_call_onnx_op, self._builder, op)

    def __dir__(self) -> list[str]:
        return sorted(self._ops)


def _call_onnx_op(builder: Builder, op: OpSignature, *args: Any, **kwargs: Any) -> Any:
    bound = op.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    name = values.pop("debugContext")
    if op.op_type == "Constant":
        attrs = {"value": numpy_helper.from_array(np.ascontiguousarray(values["value"]))}
        return builder._add_node("Constant", [], 1, attrs, name)[0]
    inputs = list(values.pop("args", []))
    outputs = values.pop("num_outputs", op.fixed_outputs)
    attrs = {}
    for attr_name, attr_type, _, _ in op.attributes:
        value = values[attr_name]
        if value is None or (isinstance(value, list | str) and not value):
            continue
        if attr_type == onnx.AttributeProto.TENSOR:
            value = numpy_helper.from_array(np.asarray(value))
        elif op.op_type == "Cast" and attr_name == "to":
            value = _DTYPES[_dtype_name(value)]
        attrs[attr_name] = value
    ids = builder._add_node(op.op_type, inputs, outputs, attrs, name)
    return ids if op.returns_list else ids[0]


class _AiGraphcore:
    """``builder.aiGraphcore``: PopART's losses and gelu (domain ai.graphcore, opset 1)."""

    version = 1

    def __init__(self, builder: Builder) -> None:
        self._builder = builder

    def _loss(self, op_type: str, args: Sequence[str], reduction: ReductionType,
              debugContext: str, **attrs: Any) -> str:
        reduction = ReductionType(reduction) if not isinstance(reduction, ReductionType) \
            else reduction
        attrs["reduction"] = reduction.attribute
        return self._builder._add_node(op_type, list(args), 1, attrs, debugContext,
                                       domain=AI_GRAPHCORE, loss=reduction)[0]

    def l1loss(self, args: Sequence[str], *rest: Any, **kwargs: Any) -> str:
        """``l1loss(args, lambda, reduction=ReductionType.Mean, debugContext="")``."""
        names = ("lambda", "reduction", "debugContext")
        given = dict(zip(names, rest, strict=False)) | kwargs
        unknown = set(given) - set(names)
        if unknown or "lambda" not in given:
            raise TypeError(f"l1loss(args, lambda, reduction=ReductionType.Mean, "
                            f"debugContext=''): got {sorted(given)}")
        return self._loss("L1", args, given.get("reduction", ReductionType.Mean),
                          given.get("debugContext", ""), **{"lambda": float(given["lambda"])})

    def nllloss(self, args: Sequence[str], reduction: ReductionType = ReductionType.Mean,
                ignoreIndex: int | None = None, inputIsLogProbability: bool = False,
                debugContext: str = "") -> str:
        attrs: dict[str, Any] = {"inputIsLogProbability": int(inputIsLogProbability)}
        if ignoreIndex is not None:
            attrs["ignoreIndex"] = int(ignoreIndex)
        return self._loss("Nll", args, reduction, debugContext, **attrs)

    def identityloss(self, args: Sequence[str], reduction: ReductionType = ReductionType.Mean,
                     debugContext: str = "") -> str:
        return self._loss("IdentityLoss", args, reduction, debugContext)

    def gelu(self, args: Sequence[str], debugContext: str = "") -> str:
        return self._builder._add_node("Gelu", list(args), 1, {}, debugContext,
                                       domain=AI_GRAPHCORE)[0]


class Builder:
    """An ONNX model builder with popart.Builder's methods (see the module docstring)."""

    def __init__(self, opsets: dict[str, int] | None = None) -> None:
        opsets = dict(opsets or {})
        unknown = set(opsets) - {"ai.onnx", AI_GRAPHCORE}
        if unknown or opsets.get(AI_GRAPHCORE, 1) != 1:
            raise BuilderError(f"opsets {opsets}: give 'ai.onnx' (a version) and 'ai.graphcore' "
                               f"(1).")
        self._onnx_version = int(opsets.get("ai.onnx", DEFAULT_AI_ONNX_OPSET))
        self._graph = helper.make_graph([], "BuilderGraph", [], [])
        self._metadata: dict[str, str] = {}
        self._ids: set[str] = set()
        self._scopes: dict[str, list[int]] = {}
        self._loss_shapes: dict[str, tuple[str, ReductionType, str]] = {}
        self._uses_graphcore = False
        self._inferred: tuple[int, dict[str, onnx.ValueInfoProto]] | None = None
        self.aiOnnx = _AiOnnx(self, self._onnx_version)
        self.aiGraphcore = self.aiGraphcoreOpset1 = _AiGraphcore(self)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("aiOnnxOpset") and name[11:].isdigit():
            version = int(name[11:])
            if version != self._onnx_version:
                raise BuilderError(f"Invalid opset {version}: this builder uses ai.onnx opset "
                                   f"{self._onnx_version}; only one version per builder. Fix: "
                                   f"Builder(opsets={{'ai.onnx': {version}, 'ai.graphcore': 1}}).")
            return self.aiOnnx
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    # -- ids and nodes ------------------------------------------------------------------------

    def _next_id(self, base: str) -> str:
        proposed, counter = base, 0
        while proposed in self._ids:
            counter += 1
            proposed = f"{base}{_DELIMITER}{counter}"
        self._ids.add(proposed)
        return proposed

    def _add_node(self, op_type: str, inputs: list[str], outputs: int, attrs: dict[str, Any],
                  name: str, domain: str = "", loss: ReductionType | None = None) -> list[str]:
        missing = [t for t in inputs if t and t not in self._ids]
        if missing:
            raise BuilderError(f"{op_type}: input tensor(s) {missing} do not exist in this "
                               f"builder.")
        base = name or op_type
        ids = [self._next_id(f"{base}:{i}") for i in range(outputs)]
        for attribute, stack in self._scopes.items():
            if stack:
                attrs[attribute] = stack[-1]
        node = helper.make_node(op_type, inputs, ids, name=name or None, domain=domain or None,
                                **attrs)
        self._graph.node.append(node)
        if domain == AI_GRAPHCORE:
            self._uses_graphcore = True
        if loss is not None:
            self._loss_shapes[ids[0]] = (op_type, loss, inputs[-1] if op_type == "Nll"
                                         else inputs[0])
        return ids

    def _node(self, nodeOutputNames: str | Sequence[str]) -> onnx.NodeProto:
        wanted = {nodeOutputNames} if isinstance(nodeOutputNames, str) else set(nodeOutputNames)
        for node in self._graph.node:
            if set(node.output) == wanted:
                return node
        raise BuilderError(f"Could not find a node with outputs {sorted(wanted)}. Must specify "
                           f"all outputs of a node.")

    # -- inputs and outputs -------------------------------------------------------------------

    def addInputTensor(self, tensorInfo: TensorInfo | str, *args: Any,
                       **kwargs: Any) -> str:
        """``addInputTensor(tensorInfo, settings=InputSettings(), debugContext="")`` or
        ``addInputTensor(dataType, shape, debugContext="")``."""
        if isinstance(tensorInfo, TensorInfo):
            params = ("settings", "debugContext")
            info = tensorInfo
        else:
            params = ("shape", "settings", "debugContext")
        given = dict(zip(params, args, strict=False)) | kwargs
        if set(given) - set(params):
            raise TypeError(f"addInputTensor: unexpected {sorted(set(given) - set(params))}")
        if not isinstance(tensorInfo, TensorInfo):
            if "shape" not in given:
                raise TypeError("addInputTensor(dataType, shape, debugContext='') needs a shape")
            info = TensorInfo(tensorInfo, given["shape"])
        tensor_id = self._next_id(given.get("debugContext") or "input")
        self._graph.input.append(helper.make_tensor_value_info(
            tensor_id, _DTYPES[info.dataType()], info.shape()))
        settings = given.get("settings")
        if isinstance(settings, InputSettings) and isinstance(tensorInfo, TensorInfo):
            # PopART's (dataType, shape, settings) overload drops the settings: so do we.
            self._metadata[f"__replicated_stream_mode/{tensor_id}"] = str(
                settings.replicatedStreamMode().value)
        return tensor_id

    def addInitializedInputTensor(self, initVal: np.ndarray, debugContext: str = "") -> str:
        array = np.ascontiguousarray(initVal)
        tensor_id = self._next_id(debugContext or "init_input")
        tensor = numpy_helper.from_array(array, tensor_id)
        self._graph.input.append(helper.make_tensor_value_info(
            tensor_id, tensor.data_type, list(array.shape)))
        self._graph.initializer.append(tensor)
        return tensor_id

    def addOutputTensor(self, outputName: str) -> None:
        if outputName not in self._ids:
            raise BuilderError(f"addOutputTensor: {outputName!r} is not a tensor of this "
                               f"builder.")
        info = self._value_info(outputName)
        self._graph.output.append(info if info is not None else helper.make_tensor_value_info(
            outputName, onnx.TensorProto.UNDEFINED, None))

    def getInputTensorIds(self) -> list[str]:
        return [i.name for i in self._graph.input]

    def getOutputTensorIds(self) -> list[str]:
        return [o.name for o in self._graph.output]

    # -- the model ------------------------------------------------------------------------------

    def _opsets(self) -> list[onnx.OperatorSetIdProto]:
        opsets = [helper.make_opsetid("", self._onnx_version)]
        if self._uses_graphcore:
            opsets.append(helper.make_opsetid(AI_GRAPHCORE, 1))
        return opsets

    def _proto(self) -> onnx.ModelProto:
        model = helper.make_model(self._graph, opset_imports=self._opsets(),
                                  producer_name="popart_kit")
        model.ir_version = helper.find_min_ir_version_for(self._opsets(), ignore_unknown=True)
        helper.set_model_props(model, self._metadata)
        return model

    def getModelProto(self) -> bytes:
        """The model, serialised (as PopART returns it)."""
        return self._proto().SerializeToString()

    def saveModelProto(self, filename: str) -> None:
        onnx.save(self._proto(), filename)

    def _value_info(self, tensor_id: str) -> onnx.ValueInfoProto | None:
        """Type and shape of a tensor, from ONNX shape inference (cached per graph size).

        ONNX cannot infer PopART's losses; they are scalars, or keep their input's shape with
        NoReduction, so their types are added and inference runs again past them."""
        stamp = len(self._graph.node) + len(self._graph.input)
        if self._inferred is None or self._inferred[0] != stamp:
            model = self._proto()
            table = _infer(model)
            for loss_id, (_, reduction, source) in self._loss_shapes.items():
                known = table.get(source)
                dtype = known.type.tensor_type.elem_type if known else onnx.TensorProto.FLOAT
                shape: list[int] | None = []
                if reduction is ReductionType.NoReduction:
                    shape = ([d.dim_value for d in known.type.tensor_type.shape.dim]
                             if known and known.type.tensor_type.HasField("shape") else None)
                model.graph.value_info.append(helper.make_tensor_value_info(loss_id, dtype,
                                                                            shape))
            self._inferred = (stamp, _infer(model) if self._loss_shapes else table)
        return self._inferred[1].get(tensor_id)

    def getTensorShape(self, id: str) -> list[int]:  # noqa: A002 - PopART's parameter name
        info = self._value_info(id)
        if info is None or not info.type.tensor_type.HasField("shape"):
            raise BuilderError(f"the shape of {id!r} is not known (ONNX shape inference could "
                               f"not determine it).")
        return [d.dim_value for d in info.type.tensor_type.shape.dim]

    def getTensorDtypeString(self, id: str) -> str:  # noqa: A002
        info = self._value_info(id)
        if info is None or not info.type.tensor_type.elem_type:
            raise BuilderError(f"the data type of {id!r} is not known.")
        return onnx.TensorProto.DataType.Name(info.type.tensor_type.elem_type).lower()

    # -- attributes -----------------------------------------------------------------------------

    def addNodeAttribute(self, attributeName: str, attributeValue: Any,
                         nodeOutputNames: str | Sequence[str]) -> None:
        node = self._node(nodeOutputNames)
        if any(a.name == attributeName for a in node.attribute):
            raise BuilderError(f"Node already has attribute {attributeName}.")
        node.attribute.append(helper.make_attribute(attributeName, attributeValue))

    def nodeHasAttribute(self, attributeName: str, nodeOutputNames: str | Sequence[str]) -> bool:
        return any(a.name == attributeName for a in self._node(nodeOutputNames).attribute)

    def getInt64NodeAttribute(self, attributeName: str,
                              nodeOutputNames: str | Sequence[str]) -> int:
        for attr in self._node(nodeOutputNames).attribute:
            if attr.name == attributeName:
                if attr.type != onnx.AttributeProto.INT:
                    raise BuilderError(f"Attribute {attributeName} is not an int64.")
                return int(attr.i)
        raise BuilderError(f"Node does not have an attribute {attributeName}.")

    def _scope_or_set(self, attribute: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> _Scope | None:
        names = ("nodeOutputNames", "value")
        given = dict(zip(names, args, strict=False)) | kwargs
        if set(given) - set(names) or not given:
            raise TypeError(f"expected (nodeOutputNames, value=0) or (value), got {given}")
        if "nodeOutputNames" in given and isinstance(given["nodeOutputNames"], int) and (
                "value" not in given):
            return _Scope(self, attribute, given["nodeOutputNames"])  # (value): a context
        if "nodeOutputNames" not in given:
            return _Scope(self, attribute, given["value"])
        self.addNodeAttribute(attribute, int(given.get("value", 0)), given["nodeOutputNames"])
        return None

    def pipelineStage(self, *args: Any, **kwargs: Any) -> _Scope | None:
        """``pipelineStage(nodeOutputName, value=0)`` sets a node's stage;
        ``with pipelineStage(value):`` stages every node created inside."""
        return self._scope_or_set(PIPELINE_STAGE, args, kwargs)

    def virtualGraph(self, *args: Any, **kwargs: Any) -> _Scope | None:
        """``virtualGraph(nodeOutputNames, value=0)`` places a node on an IPU;
        ``with virtualGraph(value):`` places every node created inside."""
        return self._scope_or_set(VIRTUAL_GRAPH, args, kwargs)

    def _scope_value(self, attribute: str, what: str) -> int:
        stack = self._scopes.get(attribute)
        if not stack:
            raise BuilderError(f"{what} not set in current scope.")
        return stack[-1]

    def getPipelineStage(self) -> int:
        return self._scope_value(PIPELINE_STAGE, "Pipeline stage")

    def hasPipelineStage(self) -> bool:
        return bool(self._scopes.get(PIPELINE_STAGE))

    def getVirtualGraph(self, nodeOutputNames: str | Sequence[str] | None = None) -> int:
        if nodeOutputNames is None:
            return self._scope_value(VIRTUAL_GRAPH, "Virtual graph")
        return self.getInt64NodeAttribute(VIRTUAL_GRAPH, nodeOutputNames)

    def hasVirtualGraph(self) -> bool:
        return bool(self._scopes.get(VIRTUAL_GRAPH))


def _infer(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    return {v.name: v for v in (*inferred.graph.input, *inferred.graph.value_info,
                                *inferred.graph.output)}


class PipelineBuilder:
    """Stage helper over this Builder or a real ``popart.Builder``: ``with pb.stage(k):``
    annotates both the pipeline stage and the IPU (stage k on IPU k, or ``stage_to_ipu``)."""

    def __init__(self, builder: Any, stage_to_ipu: Sequence[int] | dict[int, int] | None = None
                 ) -> None:
        self.builder = builder
        self._stage_to_ipu = (dict(enumerate(stage_to_ipu)) if isinstance(stage_to_ipu, Sequence)
                              else dict(stage_to_ipu or {}))
        self._last: int | None = None

    def ipu_of(self, stage: int) -> int:
        return self._stage_to_ipu.get(stage, stage)

    @contextlib.contextmanager
    def stage(self, k: int, ipu: int | None = None) -> Iterator[int]:
        """Annotate the ops created inside with pipeline stage ``k`` and its IPU."""
        if k < 0 or (ipu is not None and ipu < 0):
            raise BuilderError(f"stage {k} on IPU {ipu}: stages and IPUs count from 0.")
        ipu = self.ipu_of(k) if ipu is None else ipu
        self._last = k
        with self.builder.pipelineStage(k), self.builder.virtualGraph(ipu):
            yield k

    def next_stage(self, ipu: int | None = None) -> contextlib.AbstractContextManager[int]:
        """The stage after the last one entered (0 first)."""
        return self.stage(0 if self._last is None else self._last + 1, ipu)

    def layout(self) -> PipelineLayout:
        return PipelineLayout.from_model(self.builder.getModelProto())
