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
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .._base.atomic import write_atomic
from .._base.problems import popart_vector
from .builder_base import (
    BuilderError,
    Scope,
    debug_name,
    is_count,
    is_str,
    overload,
    signature,
)
from .builder_settings import NodeSettings, scope_attributes
from .builder_subgraphs import SubgraphBuilding, control_method, control_methods
from .builder_subgraphs import call as subgraph_call
from .custom_ops import custom_op
from .graphcore import GRAPHCORE_OPS, REQUIRED
from .layout import PIPELINE_STAGE, VIRTUAL_GRAPH, PipelineLayout, save_popart_external_data
from .onnx_ops import OpSignature, signatures
from .popart_types import PopartRefusal, node_types
from .variables import VariableSettings, record_settings

__all__ = ["Builder", "BuilderError", "PipelineBuilder", "TensorInfo", "InputSettings",
           "ReplicatedStreamMode", "ReductionType", "DEFAULT_AI_ONNX_OPSET"]

DEFAULT_AI_ONNX_OPSET = 10  # popart.defaultAiOnnxOpset
AI_GRAPHCORE = "ai.graphcore"
_DELIMITER = "/"
STREAM_MODE_KEY = "__replicated_stream_mode/"  # metadata_props key prefix, as PopART writes it

# PopART's data type names and their ONNX types.
_DTYPES = {name: getattr(onnx.TensorProto, name) for name in (
    "FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE", "INT8", "INT16", "INT32", "INT64", "UINT8",
    "UINT16", "UINT32", "UINT64", "BOOL")}


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


def _lcase(type_name: str) -> str:
    """PopART's lower-case data type name (numpy's: FLOAT is float32, DOUBLE float64)."""
    return {"FLOAT": "float32", "DOUBLE": "float64"}.get(type_name, type_name.lower())


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
        return _lcase(self._type)

    def __repr__(self) -> str:
        return f"TensorInfo({self._type!r}, {self._shape})"


def _count(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return operator.index(value)


def _is_info(v: Any) -> bool:
    return isinstance(v, TensorInfo)


_ADD_INITIALIZED = (
    (signature("initVal", "debugContext", debugContext=""),
     {"debugContext": lambda v: not isinstance(v, VariableSettings)}),
    (signature("initVal", "variableSettings", "debugContext", debugContext=""),
     {"variableSettings": lambda v: isinstance(v, VariableSettings)}),
)


def _is_settings(v: Any) -> bool:
    return isinstance(v, InputSettings)


def _is_ids(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, set | list | tuple) and all(
        isinstance(i, str) for i in v))


_ADD_INPUT = (
    (signature("tensorInfo", "debugContext", debugContext=""),
     {"tensorInfo": _is_info, "debugContext": is_str}),
    (signature("tensorInfo", "settings", "debugContext", debugContext=""),
     {"tensorInfo": _is_info, "settings": _is_settings, "debugContext": is_str}),
    (signature("dataType", "shape", "debugContext", debugContext=""),
     {"dataType": is_str, "shape": lambda v: not isinstance(v, str), "debugContext": is_str}),
    (signature("dataType", "shape", "settings", "debugContext", debugContext=""),
     {"dataType": is_str, "shape": lambda v: not isinstance(v, str),
      "settings": _is_settings, "debugContext": is_str}),
)
_PIPELINE_STAGE = ((signature("nodeOutputNames", "value", value=0),
                    {"nodeOutputNames": is_str, "value": is_count}),
                   (signature("value"), {"value": is_count}))
_VIRTUAL_GRAPH = ((signature("nodeOutputNames", "value", value=0),
                   {"nodeOutputNames": _is_ids, "value": is_count}),
                  (signature("value"), {"value": is_count}))


class _AiOnnx:
    """``builder.aiOnnx``: every ai.onnx operator of the builder's opset."""

    def __init__(self, builder: Builder, version: int) -> None:
        self._builder, self.version = builder, version
        self._ops = signatures(version)

    def __getattr__(self, name: str) -> Any:
        control = control_method(self._builder, self.version, name)  # If, Loop, Scan
        if control is not None:
            return control
        try:
            op = self._ops[name]
        except KeyError:
            raise AttributeError(f"aiOnnx opset {self.version} has no operator {name!r}") from None
        return functools.partial(_call_onnx_op, self._builder, op)

    def __dir__(self) -> list[str]:
        return sorted({*self._ops, *control_methods(self.version)})


_DEFAULTED = frozenset({onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING})
_LIST_ATTRIBUTES = frozenset({onnx.AttributeProto.INTS, onnx.AttributeProto.FLOATS,
                              onnx.AttributeProto.STRINGS})


def _call_onnx_op(builder: Builder, op: OpSignature, *args: Any, **kwargs: Any) -> Any:
    bound = op.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    name = values.pop("debugContext")
    if op.op_type == "Constant":
        value = numpy_helper.from_array(np.require(values["value"], requirements="C"))
        return builder._add_node("Constant", [], 1, {"value": value}, name, data=value)[0]
    inputs = list(values.pop("args", []))
    outputs = values.get("num_outputs") or op.fixed_outputs
    if not any(a[0] == "num_outputs" for a in op.attributes):
        values.pop("num_outputs", None)
    attrs, empty = {}, []
    for attr_name, attr_type, required, default in op.attributes:
        value = values[attr_name]
        if attr_type in _LIST_ATTRIBUTES and value is not None and not isinstance(value, str):
            value = list(value)  # any sequence, as pybind takes one: a tuple, a range
        if isinstance(value, list) and not value and default is None:  # a Reduce's axes=[]:
            # PopART writes it (an optional list, given)
            empty.append(attr_name)
        if value is None or (isinstance(value, list | str) and not value):
            continue
        # PopART's generated builder (builder.gen.cpp) writes a float or string attribute only
        # when it differs from the schema's default (ints always), so that addNodeAttribute can
        # still set it
        if not required and attr_type in _DEFAULTED and value == default:
            continue
        if attr_type == onnx.AttributeProto.TENSOR:
            value = numpy_helper.from_array(np.require(value, requirements="C"))
        elif op.op_type == "Cast" and attr_name == "to":
            value = _DTYPES[_dtype_name(value)]
        elif attr_type == onnx.AttributeProto.FLOAT:  # PopART takes floats: gemm(.., 1, 1)
            value = float(value)
        elif attr_type == onnx.AttributeProto.FLOATS:
            value = [float(v) for v in value]
        attrs[attr_name] = value
    if op.op_type == "Conv":
        _verify_conv(builder, inputs, attrs)
    elif op.op_type in ("AveragePool", "MaxPool"):
        _verify_pool(builder, inputs, attrs)
    # PopART's ReduceOp reduces nothing for an explicit empty axes (ONNX would reduce all)
    out_types = [builder._types[inputs[0]]] if empty and inputs[0] in builder._types else None
    ids = builder._add_node(op.op_type, inputs, outputs, attrs, name, out_types=out_types)
    builder._graph.node[-1].attribute.extend(
        helper.make_attribute(k, [], attr_type=onnx.AttributeProto.INTS) for k in empty)
    return ids if op.returns_list else ids[0]


def _listed_types(schema: onnx.defs.OpSchema, node: onnx.NodeProto,
                  inputs: Mapping[str, onnx.TypeProto]) -> dict[str, onnx.TypeProto] | None:
    """``inputs`` with each tensor whose type the schema does not list for its position given
    the nearest listed integer (INT64, INT32) or float (FLOAT) type; None if none changes."""
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    out, changed = dict(inputs), False
    for i, name in enumerate(node.input):
        if not name or not schema.inputs:
            continue
        formal = schema.inputs[min(i, len(schema.inputs) - 1)]
        options = allowed.get(formal.type_str)
        tensor = inputs[name].tensor_type
        if not options or not inputs[name].HasField("tensor_type"):
            continue
        if f"tensor({onnx.TensorProto.DataType.Name(tensor.elem_type).lower()})" in options:
            continue
        given = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        kinds = ("INT64", "INT32") if given.kind in "iu" else ("FLOAT",) if given.kind == "f" \
            else ()
        for kind in kinds:
            if f"tensor({kind.lower()})" in options:
                out[name] = onnx.TypeProto()
                out[name].CopyFrom(inputs[name])
                out[name].tensor_type.elem_type = getattr(onnx.TensorProto, kind)
                changed = True
                break
    return out if changed else None


def _resize_as_onnx(node: onnx.NodeProto, version: int, inputs: dict[str, onnx.TypeProto],
                    data: dict[str, onnx.TensorProto]) -> onnx.NodeProto:
    """A Resize as ONNX's inference takes it, for forms PopART's builder takes too: ``scales``
    omitted ("") beside ``sizes`` (given as an empty tensor, as ONNX writes it), float16
    scales and int32 sizes (read as float32 and int64, as PopART reads them). Updates
    ``inputs`` and ``data``."""
    at = 1 if version < 11 else 2
    if len(node.input) > at + 1 and not node.input[at]:
        node = onnx.NodeProto.FromString(node.SerializeToString())
        node.input[at] = "scales (empty)"
        data[node.input[at]] = numpy_helper.from_array(np.zeros(0, np.float32), "")
    for i, kind, wanted in ((at, onnx.TensorProto.FLOAT16, np.float32),
                            (at + 1, onnx.TensorProto.INT32, np.int64)):
        name = node.input[i] if i < len(node.input) else ""
        if name in data and data[name].data_type == kind:
            data[name] = numpy_helper.from_array(numpy_helper.to_array(data[name]).astype(wanted))
        if name in data:
            inputs[name] = helper.make_tensor_type_proto(data[name].data_type, data[name].dims)
    return node


def _with_hidden_size(node: onnx.NodeProto, inputs: Mapping[str, onnx.TypeProto]
                      ) -> onnx.NodeProto:
    """An ai.onnx LSTM, GRU or RNN without hidden_size, given the one its recurrence weights R
    [directions, gates * hidden, hidden] have, for inference (PopART's setup takes it from R;
    ONNX's inference leaves the dimension unknown); any other node as it is."""
    if (node.op_type not in ("LSTM", "GRU", "RNN") or len(node.input) < 3
            or any(a.name == "hidden_size" for a in node.attribute)):
        return node
    r = inputs.get(node.input[2])
    dims = r.tensor_type.shape.dim if r is not None and r.tensor_type.HasField("shape") else ()
    if len(dims) != 3 or not dims[2].HasField("dim_value"):
        return node
    typed = onnx.NodeProto()
    typed.CopyFrom(node)
    typed.attribute.append(helper.make_attribute("hidden_size", dims[2].dim_value))
    return typed


def _known_shape(builder: Builder, tensor: str) -> list[int] | None:
    try:
        return builder.getTensorShape(tensor)
    except (BuilderError, KeyError):
        return None



def _verify_conv(builder: Builder, inputs: Sequence[str], attrs: Mapping[str, Any]) -> None:
    """PopART's checks when a Conv is added (willow/src/builder_helper.cpp verifyConvBase and
    verifyWindowParameters), in its words: the kernel_shape attribute matches the weights,
    the window vectors have one value per spatial dimension (pads two), and they give a
    spatial output of no negative size."""
    if len(inputs) < 2:
        raise BuilderError(f"Conv requires at least two inputs: data, and weights. "
                           f"{len(inputs)} inputs provided.")
    weights = _known_shape(builder, inputs[1])
    kernel = weights[2:] if weights is not None else []
    if weights is not None and "kernel_shape" in attrs and list(attrs["kernel_shape"]) != kernel:
        raise BuilderError(f"kernel_shape, {popart_vector(attrs['kernel_shape'])}, does not "
                           f"match inferred shape from weight input '{inputs[1]}', "
                           f"{popart_vector(kernel)}")
    _verify_window(builder, inputs[0], attrs, kernel)


def _verify_pool(builder: Builder, inputs: Sequence[str], attrs: Mapping[str, Any]) -> None:
    """PopART's checks when an AveragePool or MaxPool is added (builder_helper.cpp
    verifyPoolBase): the window checks of :func:`_verify_window`, with ``kernel_shape``."""
    if inputs:
        _verify_window(builder, inputs[0], attrs, list(attrs.get("kernel_shape", [])),
                       ceil_mode=bool(attrs.get("ceil_mode", 0)))


def _verify_window(builder: Builder, data_id: str, attrs: Mapping[str, Any], kernel: list[int],
                   ceil_mode: bool = False) -> None:
    """builder_helper.cpp verifyWindowParameters, in PopART's words: the window vectors have
    one value per spatial dimension of input ``data_id`` (pads two), and with a kernel they
    give a spatial output of no negative size."""
    data = _known_shape(builder, data_id)
    if data is None:
        return
    spatial = len(data) - 2
    if spatial < 1:
        raise BuilderError("Input tensor has no spatial dimensions")
    strides, pads = list(attrs.get("strides", [])), list(attrs.get("pads", []))
    dilations = list(attrs.get("dilations", []))
    for what, values, count in (("strides", strides, spatial), ("dilations", dilations, spatial)):
        if values and len(values) != count:
            raise BuilderError(f"Length of {what} vector {len(values)} != number of spatial "
                               f"dimensions {spatial}")
    if pads and len(pads) != 2 * spatial:
        raise BuilderError(f"Padding vector (length {len(pads)}) does not have 2 values for "
                           f"each spatial dimension {spatial}")
    if not kernel or attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET", ""):
        return
    out = []
    for d in range(min(spatial, len(kernel))):
        pad = (pads[d] + pads[d + spatial]) if pads else 0
        dilation = dilations[d] if dilations else 1
        stride = strides[d] if strides else 1
        span = data[2 + d] + pad - dilation * (kernel[d] - 1) - 1
        # C++ division rounds toward zero; ceil_mode rounds the quotient up
        quotient = int(np.ceil(span / stride)) if ceil_mode else int(np.trunc(span / stride))
        out.append(quotient + 1)
    if any(size < 0 for size in out):
        raise BuilderError(f"Window parameter values combine to give invalid spatial output "
                           f"shape: {popart_vector(out)}")


class _AiGraphcore:
    """``builder.aiGraphcore``: PopART's losses, gelu and the operators of GRAPHCORE_OPS
    (domain ai.graphcore, opset 1)."""

    version = 1

    def __init__(self, builder: Builder) -> None:
        self._builder = builder

    def _loss(self, op_type: str, args: Sequence[str], reduction: ReductionType,
              debugContext: str, **attrs: Any) -> str:
        reduction = ReductionType(reduction) if not isinstance(reduction, ReductionType) \
            else reduction
        attrs["reduction"] = reduction.attribute
        # Scalars, or with NoReduction the shape of the input (the label's for Nll).
        source = list(args)[-1] if op_type == "Nll" else list(args)[0]
        shaped_like = source if reduction is ReductionType.NoReduction else None
        return self._builder._add_node(op_type, list(args), 1, attrs, debugContext,
                                       domain=AI_GRAPHCORE,
                                       custom_type=(list(args)[0], shaped_like))[0]

    def l1loss(self, args: Sequence[str], *rest: Any, **kwargs: Any) -> str:
        """``l1loss(args, lambda, reduction=ReductionType.Mean, debugContext="")``."""
        names = ("lambda", "reduction", "debugContext")
        given = dict(zip(names, rest, strict=False)) | kwargs
        unknown = set(given) - set(names)
        if unknown or "lambda" not in given or len(rest) > len(names):
            raise TypeError(f"l1loss(args, lambda, reduction=ReductionType.Mean, "
                            f"debugContext=''): got {sorted(given)}")
        return self._loss("L1", args, given.get("reduction", ReductionType.Mean),
                          given.get("debugContext", ""), **{"lambda": float(given["lambda"])})

    def nllloss(self, args: Sequence[str], reduction: ReductionType = ReductionType.Mean,
                ignoreIndex: int | None = None, inputIsLogProbability: bool = False,
                debugContext: str = "") -> str:
        attrs: dict[str, Any] = {"inputIsLogProbability": int(inputIsLogProbability)}
        if ignoreIndex is not None:
            attrs["ignoreIndex"] = _count(ignoreIndex)
        return self._loss("Nll", args, reduction, debugContext, **attrs)

    def identityloss(self, args: Sequence[str], reduction: ReductionType = ReductionType.Mean,
                     debugContext: str = "") -> str:
        return self._loss("IdentityLoss", args, reduction, debugContext)

    def gelu(self, args: Sequence[str], debugContext: str = "") -> str:
        source = list(args)[0]
        return self._builder._add_node("Gelu", list(args), 1, {}, debugContext,
                                       domain=AI_GRAPHCORE, custom_type=(source, source))[0]

    def packedDataBlock(self, args: Sequence[str], maxSequenceLengths: Sequence[int],
                        resultSize: int, callbackBatchSize: int, callback: Builder,
                        debugName: str = "") -> str:
        """PopART's PackedDataBlock: see :mod:`.graphcore.packed`."""
        from .graphcore.packed import packed_data_block
        return packed_data_block(self._builder, args, maxSequenceLengths, resultSize,
                                 callbackBatchSize, callback, debugName)

    def call(self, args: Sequence[str], num_outputs: int, callee: Builder,
             debugName: str = "") -> list[str]:
        """PopART's Call: ``callee``'s graph (a sub-builder) run on ``args``, its inputs in
        order; the graph's outputs (``num_outputs`` of them)."""
        return subgraph_call(self._builder, args, num_outputs, callee, debugName)

    def __getattr__(self, name: str) -> Any:
        if name not in GRAPHCORE_OPS:
            raise AttributeError(f"aiGraphcore has no operator {name!r}; popart_kit offers "
                                 f"l1loss, nllloss, identityloss, gelu, "
                                 f"{', '.join(GRAPHCORE_OPS)}.")
        return functools.partial(self._op, name)

    def __dir__(self) -> list[str]:
        return sorted({*GRAPHCORE_OPS, "l1loss", "nllloss", "identityloss", "gelu", "call",
                       "packedDataBlock"})

    def _op(self, method: str, args: Any, *rest: Any, **kwargs: Any) -> str | list[str] | None:
        entry = GRAPHCORE_OPS[method]
        names = [p[0] for p in entry.params] + ["debugContext"]
        attrs: dict[str, Any] = {}
        if entry.bind is not None:
            inputs, given, attrs = entry.bind(self._builder, args, *rest, **kwargs)
        elif len(rest) > len(names) or set(kwargs) - set(names):
            raise TypeError(f"aiGraphcore.{method}(args, {', '.join(names)}): got "
                            f"{len(rest)} positional and {sorted(kwargs)}")
        else:
            given = dict(zip(names, rest, strict=False)) | kwargs
            inputs = [args] if isinstance(args, str) else list(args)
        for pname, kind, default in entry.params:
            value = given.get(pname, default)
            if value is REQUIRED:
                raise TypeError(f"aiGraphcore.{method}: missing argument {pname!r}.")
            value = entry.convert(kind, value)
            if value is not None:
                attrs[entry.attribute(pname)] = value
        builder = self._builder
        count = attrs.pop(entry.outputs) if isinstance(entry.outputs, str) else entry.outputs
        in_types = [builder._tensor_type_of(t) for t in inputs if t in builder._types]
        try:
            out_types = [helper.make_tensor_type_proto(dtype, shape)
                         for dtype, shape in entry.infer(in_types, attrs)][:count]
        except (ValueError, IndexError, KeyError) as err:
            refusal = BuilderError(str(err))  # PopART's shape inference text, as its Builder
            refusal.add_note(f"(aiGraphcore.{method} on {inputs})")
            raise refusal from None
        empty = [k for k, v in attrs.items() if isinstance(v, list) and not v]
        ids = builder._add_node(entry.op_type, inputs, count,
                                {k: v for k, v in attrs.items() if k not in empty},
                                given.get("debugContext", ""), domain=AI_GRAPHCORE,
                                out_types=out_types)
        # an empty list (reducemedian's axes=[]) is an INTS attribute make_node cannot type
        builder._graph.node[-1].attribute.extend(
            helper.make_attribute(k, [], attr_type=onnx.AttributeProto.INTS) for k in empty)
        return ids if entry.returns_list else ids[0] if ids else None


class Builder(NodeSettings, SubgraphBuilding):
    """An ONNX model builder with popart.Builder's methods (see the module docstring); the
    per-node settings (recomputation, execution phases, partials ...) and the typed attribute
    accessors are :class:`~popart_kit._model.builder_settings.NodeSettings`, sub-builders
    :class:`~popart_kit._model.builder_subgraphs.SubgraphBuilding`."""

    def __init__(self, opsets: dict[str, int] | None = None) -> None:
        opsets = dict(opsets or {})
        bad = {k: v for k, v in opsets.items()
               if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int)
               or v < 1}
        if bad or opsets.get(AI_GRAPHCORE, 1) != 1:
            raise BuilderError(f"opsets {opsets}: give domain names and positive opset "
                               f"versions: 'ai.onnx' (a version) and 'ai.graphcore' (1); other "
                               f"domains (such as 'ai.onnx.ml') are accepted and unused, as "
                               f"PopART does.")
        # PopART's rule: the ai.onnx version is the one given here, else the one of the first
        # aiOnnx / aiOnnxOpsetN the program uses; another version after that is refused
        self._chosen_onnx: int | None = None
        self._ai_onnx: _AiOnnx | None = None
        if "ai.onnx" in opsets:
            self._choose_onnx(int(opsets["ai.onnx"]))
        self._graph = helper.make_graph([], "BuilderGraph", [], [])
        self._metadata: dict[str, str] = {}
        self._types: dict[str, onnx.TypeProto] = {}   # every tensor's type, inferred as built
        self._data: dict[str, onnx.TensorProto] = {}  # constants and initializers
        self._scopes: dict[str, list[Any]] = {}
        self._uses_graphcore = False
        self._custom_domains: dict[str, int] = {}   # customOp domains and their versions
        self._parent: Builder | None = None      # the enclosing builder of a sub-builder
        self._children: list[Builder] = []
        self.aiGraphcore = self.aiGraphcoreOpset1 = _AiGraphcore(self)

    def _load(self, model: onnx.ModelProto) -> None:
        """Start from ``model`` (PopART's Builder(modelProtoOrFilename)): its graph, opsets,
        metadata and every tensor's type (ONNX's inference, lenient as PopART's), so that ops
        added now extend it. Its ai.onnx opset becomes the builder's."""
        for entry in model.opset_import:
            if entry.domain in ("", "ai.onnx"):
                self._use_onnx(int(entry.version))
            elif entry.domain == AI_GRAPHCORE:
                self._uses_graphcore = True
            else:
                self._custom_domains[entry.domain] = int(entry.version)
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError):
            inferred = model
        self._graph.CopyFrom(model.graph)
        del self._graph.value_info[:]
        graph = inferred.graph
        for value in (*graph.input, *graph.value_info, *graph.output):
            self._types[value.name] = value.type
        for node in model.graph.node:
            for name in node.output:
                self._types.setdefault(name, onnx.TypeProto())
            if node.op_type == "Constant" and node.output:
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    self._data[node.output[0]] = value
        for tensor in model.graph.initializer:
            self._data[tensor.name] = tensor
            self._types.setdefault(tensor.name, helper.make_tensor_type_proto(
                tensor.data_type, list(tensor.dims)))
        self._metadata.update({p.key: p.value for p in model.metadata_props})

    def _choose_onnx(self, version: int) -> _AiOnnx:
        """The ai.onnx opset ``version`` for this builder's ops, if none is chosen yet."""
        if self._ai_onnx is None:
            self._use_onnx(version)
        elif version != self._chosen_onnx:
            raise BuilderError(f"Invalid opset 'aiOnnxOpset{version}' selected. Opset for "
                               f"domain ai.onnx already defined as {self._chosen_onnx} (by "
                               f"Builder(opsets=...) or the first aiOnnx op added). Fix: use "
                               f"aiOnnxOpset{self._chosen_onnx}, or a new Builder for opset "
                               f"{version}.")
        return self._ai_onnx

    def _use_onnx(self, version: int) -> None:
        """Make ``version`` the builder's ai.onnx opset (aiOnnxOpsetVersion may switch it)."""
        self._chosen_onnx, self._ai_onnx = version, _AiOnnx(self, version)

    @property
    def _onnx_version(self) -> int:
        """The ai.onnx opset the model imports: the chosen one, else PopART's default."""
        return self._chosen_onnx or DEFAULT_AI_ONNX_OPSET

    @property
    def aiOnnx(self) -> Any:
        """The ai.onnx operators of the builder's opset (PopART's default, 10, unless another
        was chosen)."""
        return self._choose_onnx(self._chosen_onnx or DEFAULT_AI_ONNX_OPSET)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("aiOnnxOpset") and name[11:].isdigit():
            return self._choose_onnx(int(name[11:]))
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    # -- ids and nodes ------------------------------------------------------------------------

    def _next_id(self, name: str) -> str:
        """PopART's unique ids: name scopes, then the name, then "/1", "/2"... if taken."""
        base = self.getNameScope(name)
        proposed, counter = base, 0
        while self._taken(proposed):
            counter += 1
            proposed = f"{base}{_DELIMITER}{counter}"
        return proposed

    def _add_node(self, op_type: str, inputs: list[str], outputs: int, attrs: dict[str, Any],
                  name: str, domain: str = "", data: onnx.TensorProto | None = None,
                  custom_type: tuple[str, str | None] | None = None,
                  out_types: Sequence[onnx.TypeProto] | None = None) -> list[str]:
        """Add a node; its outputs are typed at once (ONNX inference, as PopART does), so a
        mistake fails here, naming the op."""
        debug_name(name, f"{op_type}: debugContext")
        unknown = [t for t in inputs if t and t not in self._types]  # "": omitted optional input
        if unknown:
            raise BuilderError(f"{op_type}: unknown tensor(s) {unknown}; inputs must be tensors "
                               f"of this builder.")
        ids = []
        for i in range(outputs):
            ids.append(self._next_id(f"{op_type}:{i}"))
            self._types[ids[-1]] = onnx.TypeProto()  # reserve the id
        # PopART names a node only when given a name or inside a name scope
        node_name = (self.getNameScope(name or op_type)
                     if name or self._scopes.get("name") else None)
        node = helper.make_node(op_type, inputs, ids, name=node_name, domain=domain or None,
                                **attrs)
        # then the open scopes' attributes (__pipeline_stage, __ipu_number, __execution_phase
        # ...), by name, as PopART's BuilderImpl::finalizeOp adds them after the op's own
        node.attribute.extend(scope_attributes(self._scopes))
        untyped = any(t and not self._types[t].tensor_type.elem_type for t in inputs)
        try:
            types = (dict(zip(ids, out_types, strict=False)) if out_types is not None else
                     {} if untyped else  # a subgraph's untyped input: typed when called
                     self._custom_types(ids[0], custom_type) if custom_type else
                     self._infer(node, domain))
        except onnx.shape_inference.InferenceError as err:
            for tensor in ids:
                del self._types[tensor]
            raise BuilderError(f"{op_type} on {inputs}: {err}") from None
        for tensor, proto in types.items():  # builder_impl.cpp addOp's check, in its words
            dims = [d.dim_value for d in proto.tensor_type.shape.dim]
            if any(d < 0 for d in dims):
                for reserved in ids:
                    del self._types[reserved]
                raise BuilderError(f"Output '{tensor}' of node '{node_name or op_type}' has "
                                   f"invalid shape, {popart_vector(dims)}. Values must "
                                   f"be non-negative in each shape dimension.")
        self._types.update(types)
        self._graph.node.append(node)
        if data is not None:
            self._data[ids[0]] = data
        elif op_type == "Shape" and not domain and inputs[0] in self._types:
            self._shape_value(node, inputs[0])
        if domain == AI_GRAPHCORE:
            self._uses_graphcore = True
        return ids

    def _shape_value(self, node: onnx.NodeProto, tensor: str) -> None:
        """A Shape's value, known where its input's shape is: later nodes' inference reads it,
        as PopART's IR reads the value of a Shape of a known tensor (a Reshape's shape)."""
        found = self._types[tensor].tensor_type
        if not found.HasField("shape") or any(not d.HasField("dim_value")
                                              for d in found.shape.dim):
            return
        dims = [d.dim_value for d in found.shape.dim]
        attrs = {a.name: a.i for a in node.attribute}
        value = np.array(dims[attrs.get("start", 0):attrs.get("end", len(dims))], np.int64)
        self._data[node.output[0]] = numpy_helper.from_array(value, node.output[0])

    def _infer(self, node: onnx.NodeProto, domain: str) -> dict[str, onnx.TypeProto]:
        """The outputs' types as PopART gives them (popart_types.node_types): ONNX's strict
        inference; where it refuses, an input of a type the schema does not list (UINT32
        indices of a Gather) read as its nearest listed type, then the op's PopART rule, then
        ONNX's inference without type constraints. Inputs PopART's op refuses leave the
        outputs untyped, as PopART's Builder does."""
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if node.op_type == "Constant" and not domain and value is not None:
            # its value's type and shape, whatever the opset: PopART's ConstantOp takes any
            # tensor, where ONNX's Constant-1 lists only float types
            return {node.output[0]: helper.make_tensor_type_proto(value.data_type,
                                                                  list(value.dims))}
        inputs = {t: self._types[t] for t in node.input if t}
        node = _with_hidden_size(node, inputs)
        data = {t: self._data[t] for t in node.input if t in self._data}
        if node.op_type == "Resize" and not domain:
            node = _resize_as_onnx(node, self._onnx_version, inputs, data)
        schema = onnx.defs.get_schema(node.op_type, self._onnx_version, domain)
        try:
            return node_types(node, self._onnx_version, inputs, data, domain,
                              refine=functools.partial(_listed_types, schema, node))
        except PopartRefusal:
            # PopART's Builder leaves the outputs untyped; its op refuses them when a session
            # is made (the kit's model checks, K-model-popart-setup)
            return {}

    def _tensor_type_of(self, tensor: str) -> tuple[int, list[int] | None]:
        """``tensor``'s (ONNX elem type, shape or None when unknown)."""
        found = self._types[tensor].tensor_type
        shape = ([d.dim_value for d in found.shape.dim] if found.HasField("shape") else None)
        return found.elem_type, shape

    def _custom_types(self, output: str, custom: tuple[str, str | None]
                      ) -> dict[str, onnx.TypeProto]:
        """PopART ops ONNX cannot infer: the first input's dtype; a scalar, or the shape of
        ``shaped_like``."""
        dtype_source, shaped_like = custom
        dtype = self._types[dtype_source].tensor_type.elem_type
        if shaped_like is None:
            return {output: helper.make_tensor_type_proto(dtype, [])}
        like = self._types[shaped_like].tensor_type
        shape = [d.dim_value for d in like.shape.dim] if like.HasField("shape") else None
        return {output: helper.make_tensor_type_proto(dtype, shape)}

    def _node(self, nodeOutputNames: str | Sequence[str]) -> onnx.NodeProto:
        wanted = {nodeOutputNames} if isinstance(nodeOutputNames, str) else set(nodeOutputNames)
        for node in self._graph.node:
            if set(node.output) == wanted:
                return node
        raise BuilderError(f"Could not find a node with outputs {sorted(wanted)}. Must specify "
                           f"all outputs of a node.")

    # -- inputs and outputs -------------------------------------------------------------------

    def addInputTensor(self, *args: Any, **kwargs: Any) -> str:
        """PopART's overloads: ``(tensorInfo, debugContext="")``, ``(tensorInfo, settings,
        debugContext="")``, ``(dataType, shape, debugContext="")`` and ``(dataType, shape,
        settings, debugContext="")`` - the last drops its settings, as PopART's does."""
        given = overload("addInputTensor", args, kwargs, *_ADD_INPUT)
        info = given.get("tensorInfo") or TensorInfo(given["dataType"], given["shape"])
        settings = given.get("settings") if "tensorInfo" in given else None
        tensor_id = self._next_id(debug_name(given["debugContext"], "debugContext") or "input")
        value = helper.make_tensor_value_info(tensor_id, _DTYPES[info.dataType()], info.shape())
        self._graph.input.append(value)
        self._types[tensor_id] = value.type
        mode = (settings or InputSettings()).replicatedStreamMode()
        self._metadata[f"{STREAM_MODE_KEY}{tensor_id}"] = str(mode.value)
        return tensor_id

    def addInitializedInputTensor(self, *args: Any, **kwargs: Any) -> str:
        """PopART's overloads: ``(initVal, debugContext="")`` and ``(initVal,
        variableSettings, debugContext="")`` - a weight with one value per group of replicas,
        ``initVal`` holding [groups, *shape] (see :mod:`.variables`; the grouping is recorded
        in the model's metadata, as PopART records it)."""
        given = overload("addInitializedInputTensor", args, kwargs, *_ADD_INITIALIZED)
        array = np.require(given["initVal"], requirements="C")
        debugContext = given["debugContext"]
        tensor_id = self._next_id(debug_name(debugContext, "debugContext") or "init_input")
        if given.get("variableSettings") is not None:
            record_settings(self._metadata, tensor_id, given["variableSettings"])
        if array.dtype == np.float32:  # PopART stores FLOAT initializers in float_data
            tensor = helper.make_tensor(tensor_id, onnx.TensorProto.FLOAT, array.shape,
                                        array.reshape(-1))
        else:
            tensor = numpy_helper.from_array(array, tensor_id)
        value = helper.make_tensor_value_info(tensor_id, tensor.data_type, list(array.shape))
        self._graph.input.append(value)
        self._graph.initializer.append(tensor)
        self._types[tensor_id] = value.type
        self._data[tensor_id] = tensor
        return tensor_id

    def addOutputTensor(self, outputName: str) -> None:
        if outputName not in self._types:
            raise BuilderError(f"addOutputTensor: {outputName!r} is not a tensor of this "
                               f"builder.")
        value = onnx.ValueInfoProto(name=outputName)
        value.type.CopyFrom(self._types[outputName])
        self._graph.output.append(value)

    def reshape_const(self, aiOnnx: Any, args: Sequence[str], shape: Sequence[int],
                      debugContext: str = "") -> str:
        """PopART's helper: a Reshape of ``args[0]`` to ``shape`` through an INT64 constant."""
        debug_name(debugContext, "debugContext")
        new_shape = aiOnnx.constant(np.array(shape).astype(np.int64), debugContext + "_const")
        return aiOnnx.reshape([args[0], new_shape], debugContext)

    def getInputTensorIds(self) -> list[str]:
        return [i.name for i in self._graph.input]

    def getOutputTensorIds(self) -> list[str]:
        return [o.name for o in self._graph.output]

    # -- the model ------------------------------------------------------------------------------

    def _opsets(self) -> list[onnx.OperatorSetIdProto]:
        opsets = [helper.make_opsetid("", self._onnx_version)]
        if self._uses_graphcore:
            opsets.append(helper.make_opsetid(AI_GRAPHCORE, 1))
        opsets += [helper.make_opsetid(d, v) for d, v in self._custom_domains.items()]
        return opsets

    def customOp(self, opName: str, opVersion: int, domain: str, inputs: Sequence[str],
                 attributes: Mapping[str, Any], numOutputs: int = 1,
                 name: str = "") -> list[str]:
        """PopART's customOp: a node of ``domain``'s ``opName`` (version ``opVersion``) on
        ``inputs`` with ``attributes``; its ``numOutputs`` output ids. An ai.onnx or
        ai.graphcore op comes out as that op; another domain's runs on the xla backend once
        registered (``popart_kit.register_custom_op``), whose ``infer`` types its outputs
        (left untyped otherwise, as PopART leaves them)."""
        if not is_count(numOutputs):
            raise TypeError(f"customOp: numOutputs={numOutputs!r} is not a count.")
        inputs, attrs = [str(i) for i in inputs], dict(attributes)
        if domain in ("", "ai.onnx"):
            return self._add_node(opName, inputs, numOutputs, attrs, name)
        if domain == AI_GRAPHCORE:
            return self._add_node(opName, inputs, numOutputs, attrs, name, domain=domain,
                                  out_types=[])
        registered = custom_op(domain, opName, opVersion)
        types = [self._tensor_type_of(t) for t in inputs if t in self._types]
        out_types = ([helper.make_tensor_type_proto(dtype, shape)
                      for dtype, shape in registered.infer(types, attrs)]
                     if registered is not None and registered.infer is not None else [])
        ids = self._add_node(opName, inputs, numOutputs, attrs, name, domain=domain,
                             out_types=out_types)
        self._custom_domains[domain] = int(opVersion)
        return ids

    def _proto(self) -> onnx.ModelProto:
        graph = self._graph_proto()
        model = helper.make_model(graph, opset_imports=self._opsets(),
                                  producer_name="popart_kit")
        model.ir_version = helper.find_min_ir_version_for(self._opsets(), ignore_unknown=True)
        helper.set_model_props(model, self._metadata)
        return model

    def getModelProto(self) -> bytes:
        """The model, serialised (as PopART returns it)."""
        return self._proto().SerializeToString()

    def saveModelProto(self, filename: str) -> None:
        """Write the model to ``filename``, replacing any file there whole or not at all."""
        write_atomic(filename, self._proto().SerializeToString())

    def saveInitializersExternally(self, ids: Sequence[str], fn: str) -> None:
        """PopART's: the data of initializers ``ids`` moves to the file ``fn`` (written whole,
        one after another) and the model refers to it (ONNX external data, location ``fn``);
        refused in PopART's words, changing nothing. A session reads such a model from a
        file: save it with saveModelProto so that ``fn`` is relative to its folder (the kit
        reads external data only from there)."""
        problem = save_popart_external_data(self._graph, ids, fn)
        if problem:
            raise BuilderError(problem)

    def _tensor_type(self, tensor_id: str) -> onnx.TypeProto.Tensor:
        if tensor_id not in self._types:
            raise BuilderError(f"{tensor_id!r} is not a tensor of this builder.")
        return self._types[tensor_id].tensor_type

    def getTensorShape(self, id: str) -> list[int]:  # noqa: A002 - PopART's parameter name
        tensor = self._tensor_type(id)
        if not tensor.HasField("shape") or any(not d.HasField("dim_value")
                                               for d in tensor.shape.dim):
            raise BuilderError(f"the shape of {id!r} is not known (ONNX shape inference could "
                               f"not determine it from the op's inputs).")
        return [d.dim_value for d in tensor.shape.dim]

    def getTensorDtypeString(self, id: str) -> str:  # noqa: A002
        tensor = self._tensor_type(id)
        if not tensor.elem_type:
            raise BuilderError(f"the data type of {id!r} is not known.")
        return _lcase(onnx.TensorProto.DataType.Name(tensor.elem_type))

    # -- attributes -----------------------------------------------------------------------------

    def addNodeAttribute(self, attributeName: str, attributeValue: Any,
                         nodeOutputNames: str | Sequence[str]) -> None:
        node = self._node(nodeOutputNames)
        if any(a.name == attributeName for a in node.attribute):
            raise BuilderError(f"Node already has attribute {attributeName}.")
        if isinstance(attributeValue, list | tuple) and not attributeValue:
            attribute = helper.make_attribute(attributeName, [], attr_type=onnx.AttributeProto.INTS)
        else:
            attribute = helper.make_attribute(attributeName, attributeValue)
        node.attribute.append(attribute)

    def nodeHasAttribute(self, attributeName: str, nodeOutputNames: str | Sequence[str]) -> bool:
        return any(a.name == attributeName for a in self._node(nodeOutputNames).attribute)

    def getInt64NodeAttribute(self, attributeName: str,
                              nodeOutputNames: str | Sequence[str]) -> int:
        for attr in self._node(nodeOutputNames).attribute:
            if attr.name == attributeName:
                if attr.type != onnx.AttributeProto.INT:
                    raise BuilderError(f"Attribute {attributeName} is not an integer.")
                return int(attr.i)
        raise BuilderError(f"Node does not have an attribute {attributeName}.")

    def _annotate(self, attribute: str, given: dict[str, Any]) -> Scope | None:
        """The setter overload annotates one node; the ``(value)`` overload opens a scope."""
        if "nodeOutputNames" not in given:
            return Scope(self, attribute, _count(given["value"]))
        self.addNodeAttribute(attribute, _count(given["value"]), given["nodeOutputNames"])
        return None

    def pipelineStage(self, *args: Any, **kwargs: Any) -> Scope | None:
        """``pipelineStage(nodeOutputName, value=0)`` sets a node's stage;
        ``with pipelineStage(value):`` stages every node created inside."""
        return self._annotate(PIPELINE_STAGE,
                              overload("pipelineStage", args, kwargs, *_PIPELINE_STAGE))

    def virtualGraph(self, *args: Any, **kwargs: Any) -> Scope | None:
        """``virtualGraph(nodeOutputNames, value=0)`` places a node on an IPU;
        ``with virtualGraph(value):`` places every node created inside."""
        return self._annotate(VIRTUAL_GRAPH,
                              overload("virtualGraph", args, kwargs, *_VIRTUAL_GRAPH))

    def nameScope(self, name: str) -> Scope:
        """``with nameScope(name):`` prefixes the ids and node names created inside; refuses a
        name that is not UTF-8 text (:func:`debug_name`)."""
        return Scope(self, "name", debug_name(name, "name scope"))

    def getNameScope(self, name: str = "") -> str:
        return "".join(f"{scope}{_DELIMITER}" for scope in self._scopes.get("name", ())) + name

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


def broadcast_inputs(model: onnx.ModelProto) -> set[str]:
    """The inputs a model marks Broadcast (one host value for every replica)."""
    mode = str(ReplicatedStreamMode.Broadcast.value)
    return {p.key[len(STREAM_MODE_KEY):] for p in model.metadata_props
            if p.key.startswith(STREAM_MODE_KEY) and p.value == mode}


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
