"""PopART's ai.graphcore network operators: ``multiconv``, ``ctcloss``, ``ctcbeamsearchdecoder``,
``groupnormalization``, ``batchnormalization``, ``normalize_image``, ``replicatedallreduce``,
``replicatedreducescatter``, ``splinebasis`` and ``splineweighting`` (popart.cpp's bindings,
willow/src/builder.cpp; output types as the ops' ``setup`` gives them, willow/src/op/).

Most are plain registry entries. Those whose call PopART binds in its own way have a ``bind``:
multiconv (a list of input lists, flattened into one node with the per-convolution parameters,
as PopART's Builder stores them), batchnormalization (``unbiased_variance``) and
ctcbeamsearchdecoder (its ``debug_context``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from onnx import TensorProto

from ..._base.problems import popart_vector
from ..builder_base import BuilderError
from ..builder_settings import AVAILABLE_MEMORY, COMM_GROUP, PARTIALS_TYPE
from ._registry import REQUIRED, GraphcoreOp, TensorType, register

__all__ = ["COLLECTIVE_OPERATOR", "ENABLE_CONV_DITHERING", "reduction_name",
           "spatial_out_shape"]

COLLECTIVE_OPERATOR = "__collectiveOperator"          # sCollectiveOperator
ENABLE_CONV_DITHERING = "__enable_conv_dithering"     # sEnableConvDitheringAttribute
_FLOAT_EPSILON = 1.1920929e-07                        # std::numeric_limits<float>::epsilon()
_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}

Bound = tuple[list[str], dict[str, Any], dict[str, Any]]


def _bound(value: Any) -> None:
    """A parameter its operator's ``bind`` turns into attributes itself."""
    return None



def _inputs(args: Any) -> list[str]:
    return [args] if isinstance(args, str) else list(args)


def _type_of(builder: Any, tensor: str) -> TensorType:
    if tensor not in builder._types:
        raise BuilderError(f"{tensor!r} is not a tensor of this builder; inputs must be tensors "
                           f"of this builder.")
    return builder._tensor_type_of(tensor)


# -- multiconv ----------------------------------------------------------------------------------

def spatial_out_shape(data: Sequence[int], kernel: Sequence[int], pads: Sequence[int],
                      out_pads: Sequence[int], strides: Sequence[int],
                      dilations: Sequence[int], in_dilations: Sequence[int]) -> list[int]:
    """HasReceptiveFieldOp::getSpatialOutShape without auto padding: the input dilated, padded
    and convolved, then the output padded."""
    n, out = len(data), []
    for d in range(n):
        size = in_dilations[d] * (data[d] - 1) + 1
        size += pads[d] + pads[n + d] - 1 - dilations[d] * (kernel[d] - 1)
        size = math.floor(size / strides[d]) + 1
        out.append(size + out_pads[d] + out_pads[n + d])
    return out


_WINDOW = ("strides", "pads", "outPads", "dilations", "inDilations")  # PopART's attribute order


def _window_of(spatial: int, window: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    """One convolution's window parameters, the empty ones at PopART's defaults."""
    ones, zeros = [1] * spatial, [0] * 2 * spatial
    return {k: list(window.get(k) or (zeros if "ads" in k else ones)) for k in _WINDOW}


def _verify_window(name: str, data: list[int], weights: list[int] | None,
                   window: Mapping[str, list[int]]) -> None:
    """builder_helper.cpp verifyConvBase / verifyWindowParameters for one convolution, in
    PopART's words."""
    spatial = len(data) - 2
    if spatial < 1:
        raise BuilderError("Input tensor has no spatial dimensions")
    for what in ("strides", "dilations", "inDilations"):
        if window[what] and len(window[what]) != spatial:
            raise BuilderError(f"Length of {what} vector {len(window[what])} != number of "
                               f"spatial dimensions {spatial}")
    for what in ("pads", "outPads"):
        if window[what] and len(window[what]) != 2 * spatial:
            raise BuilderError(f"Padding vector (length {len(window[what])}) does not have 2 "
                               f"values for each spatial dimension {spatial}")
    if weights is None:
        return
    full = _window_of(spatial, window)
    out = spatial_out_shape(data[2:], weights[2:], full["pads"], full["outPads"],
                            full["strides"], full["dilations"], full["inDilations"])
    if any(size < 0 for size in out):
        raise BuilderError(f"Window parameter values combine to give invalid spatial output "
                           f"shape: {popart_vector(out)}")


def _int_lists(value: Any, what: str) -> list[list[int]]:
    try:
        return [[int(v) for v in one] for one in value]
    except TypeError:
        raise TypeError(f"aiGraphcore.multiconv: {what} must be a list of integer lists, one "
                        f"per convolution; got {value!r}") from None


_OUTPUTS = " outputs"
_MULTICONV = ("dilations", "inDilations", "pads", "outPads", "strides",
              "availableMemoryProportions", "partialsTypes", "planType", "perConvReservedTiles",
              "cycleBackOff", "enableConvDithering", "debugContext")


def _bind_multiconv(builder: Any, args: Any, *rest: Any, **kwargs: Any) -> Bound:
    """AiGraphcoreOpset1::multiconv: the convolutions' inputs flattened (data, weights, bias
    or "" each) and their parameters flattened, with PopART's checks and errors."""
    if len(rest) > len(_MULTICONV) or set(kwargs) - set(_MULTICONV):
        raise TypeError(f"aiGraphcore.multiconv(args, {', '.join(_MULTICONV)}): got "
                        f"{len(rest)} positional and {sorted(kwargs)}")
    given = dict(zip(_MULTICONV, rest, strict=False)) | kwargs
    name = given.get("debugContext", "")
    if isinstance(args, str) or not all(isinstance(a, list | tuple) for a in args):
        raise TypeError(f"aiGraphcore.multiconv: args must be a list of input lists ([data, "
                        f"weights] or [data, weights, bias]), one per convolution; got "
                        f"{args!r}")
    convs = [list(a) for a in args]
    if not convs:
        raise BuilderError(f"MultiConvOp '{name}' has no input tensors. Provide at least one "
                           f"set of inputs")
    for inputs in convs:
        if len(inputs) < 2:
            raise BuilderError(f"Each convolution of MultiConvOp '{name}' must have at least "
                               f"two inputs - data and weights")
        if len(inputs) > 3:
            raise BuilderError(f"Each convolution of MultiConvOp '{name}' can have at most "
                               f"three inputs - data, weights, and bias")
    window = {k: _int_lists(given.get(k, []), k) for k in _WINDOW}
    memory = [float(v) for v in given.get("availableMemoryProportions", [])]
    partials = [str(v) for v in given.get("partialsTypes", [])]
    dithering = [int(v) for v in given.get("enableConvDithering", [])]
    for what, values in (("dilations", window["dilations"]),
                         ("inDilations", window["inDilations"]), ("pads", window["pads"]),
                         ("outPads", window["outPads"]), ("strides", window["strides"]),
                         ("availableMemoryProportions", memory), ("partialsTypes", partials),
                         ("enableConvDithering", dithering)):
        if values and len(values) != len(convs):
            raise BuilderError(f"For MultiConvOp '{name}', number of {what} parameter sets "
                               f"({len(values)}) does not match the number of input sets "
                               f"({len(convs)})")
    for i, inputs in enumerate(convs):
        data = _type_of(builder, inputs[0])[1]
        weights = _type_of(builder, inputs[1])[1]
        if data is not None:
            _verify_window(name, data, weights, {k: v[i] if v else [] for k, v in window.items()})
    # PopART's IR refuses these when it makes the op (MultiConvOptions): refused here already
    for kind in partials:
        if kind.lower() not in ("float", "half"):
            raise BuilderError(f"Bad partialsType '{kind.lower()}'")
    if any(not 0.0 < v <= 1.0 for v in memory):
        raise BuilderError("availableMemoryProportion must be in (0,1]")
    flat = [t for inputs in convs for t in (inputs if len(inputs) == 3 else [*inputs, ""])]
    attrs: dict[str, Any] = {k: [v for one in window[k] for v in one]
                             for k in _WINDOW if window[k]}
    for key, convert in (("planType", str), ("perConvReservedTiles", int),
                         ("cycleBackOff", float)):
        if given.get(key) is not None:
            attrs[key] = convert(given[key])
    if memory:
        attrs[AVAILABLE_MEMORY] = memory
    if partials:
        attrs[PARTIALS_TYPE] = partials
    attrs["numConvs"] = len(convs)
    if dithering:
        attrs[ENABLE_CONV_DITHERING] = dithering
    attrs[_OUTPUTS] = len(convs)  # the output count, not an attribute
    return flat, {"debugContext": name}, attrs


def _convolutions(inputs: Sequence[TensorType], count: int) -> list[tuple[TensorType, ...]]:
    """The (data, weights) types of each convolution from the typed inputs (an omitted bias
    has none): all biases given, none given, or told apart by rank (a bias is 1-D)."""
    if len(inputs) in (2 * count, 3 * count):
        step = len(inputs) // count
        return [tuple(inputs[i * step:i * step + 2]) for i in range(count)]
    convs, i = [], 0
    while i + 1 < len(inputs):
        convs.append((inputs[i], inputs[i + 1]))
        i += 2
        bias = inputs[i][1] if i < len(inputs) else None
        i += 1 if bias is not None and len(bias) == 1 else 0
    return convs


def _multiconv_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]
                     ) -> list[TensorType]:
    """MultiConvShapeInference: each output [N, M, *spatial] of its data's type, the flattened
    window parameters read at the convolution's place."""
    out, done = [], 0
    for (dtype, data), (_, weights) in _convolutions(inputs, attrs["numConvs"]):
        if data is None or weights is None:
            out.append((dtype, None))
            continue
        n = len(data) - 2
        own = {k: attrs[k][(2 if "ads" in k else 1) * done:(2 if "ads" in k else 1) * (done + n)]
               for k in _WINDOW if k in attrs}
        full = _window_of(n, own)
        spatial = spatial_out_shape(data[2:], weights[2:], full["pads"], full["outPads"],
                                    full["strides"], full["dilations"], full["inDilations"])
        out.append((dtype, [data[0], weights[0], *spatial]))
        done += n
    return out


# -- losses -------------------------------------------------------------------------------------

_REDUCTIONS = ("Sum", "Mean", "None")  # popart.ReductionType's order: Sum, Mean, NoReduction


def reduction_name(value: Any) -> str:
    """PopART's attribute string (Sum, Mean, None) of a popart.ReductionType, its index or its
    written form ``"ReductionType.Mean"``."""
    name = getattr(value, "name", None)
    if isinstance(value, str):
        name = value.split(".")[-1]
    elif name is None and isinstance(value, int) and not isinstance(value, bool) \
            and 0 <= value < 3:
        return _REDUCTIONS[value]
    if name == "NoReduction":
        name = "None"
    if name not in _REDUCTIONS:
        raise TypeError(f"reduction must be a popart.ReductionType (Sum, Mean or NoReduction), "
                        f"got {value!r}")
    return name


def _out_data_type(value: Any) -> int:
    """ctcloss's outDataType: a PopART type name (UNDEFINED: the input's type) as the ONNX type
    PopART stores; only floating-point types name an output type."""
    text = str(value).upper()
    names = {"UNDEFINED": TensorProto.UNDEFINED, "FLOAT": TensorProto.FLOAT,
             "FLOAT16": TensorProto.FLOAT16}
    if text in names:
        return names[text]
    if text in ("DOUBLE", "BFLOAT16"):
        raise BuilderError(f"ctcloss: outDataType {text} is not one of the Ctc op's output "
                           f"types (FLOAT, FLOAT16, or UNDEFINED for the input's type).")
    if text in TensorProto.DataType.keys():  # noqa: SIM118 - an enum wrapper, not a dict
        raise BuilderError(f"Unsupported data type for output 0 of Op Ctc (expected a floating "
                           f"point type, got {text}).")
    raise BuilderError(f"ctcloss: unknown outDataType {value!r}; PopART's names are FLOAT, "
                       f"FLOAT16 and UNDEFINED (the input's type).")


def _log_probabilities(op: str, given: TensorType) -> TensorType:
    """Input 0 of a CTC op: floating point of rank 3, or PopART's refusal."""
    dtype, shape = given
    if dtype not in _FLOATS:
        raise ValueError(f"Unsupported data type for input 0 of Op {op} (expected a "
                         f"'logarithmized probabilities' tensor comprised of floating point "
                         f"data, got {TensorProto.DataType.Name(dtype)}).")
    if shape is not None and len(shape) != 3:
        raise ValueError(f"Unsupported shape for input 0 of Op {op} (expected a "
                         f"'logarithmized probabilities' tensor of rank 3, got a tensor with "
                         f"shape {popart_vector(shape)}).")
    return dtype, shape


def _ctc_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    """CtcOp::setup: the loss ([] reduced, [N] with NoReduction) and the gradient of the loss
    with respect to the log probabilities ([T, N, C]), both of outDataType (default: input 0's
    type)."""
    if len(inputs) != 4:
        raise ValueError(f"Ctc takes 4 inputs (log probabilities [T, N, C], targets [N, S], "
                         f"input lengths [N], target lengths [N]); got {len(inputs)}")
    dtype, shape = _log_probabilities("Ctc", inputs[0])
    for i, what in ((1, "targets"), (2, "input lengths"), (3, "target lengths")):
        if inputs[i][0] not in (TensorProto.UINT32, TensorProto.INT32):
            raise ValueError(f"Unsupported data type for input {i} of Op Ctc (expected a "
                             f"'{what}' tensor of type UINT32 or type INT32, got "
                             f"{TensorProto.DataType.Name(inputs[i][0])}).")
    out = attrs.get("outDataType") or dtype
    loss = None if shape is None else ([] if attrs["reduction"] != "None" else [shape[1]])
    return [(out, loss), (out, None if shape is None else list(shape))]


# -- normalisation ------------------------------------------------------------------------------

def _epsilon(value: Any) -> float | None:
    """groupnormalization writes epsilon only when it is not the default 1e-5 (builder.cpp)."""
    value = float(value)
    return None if abs(value - 1e-5) <= _FLOAT_EPSILON else value


def _group_norm_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]
                      ) -> list[TensorType]:
    """GroupNormOp::setup: y as x; mean and inverse standard deviation [N * num_groups]."""
    dtype, shape = inputs[0]
    stats = None if shape is None else [shape[0] * attrs["num_groups"]]
    return [(dtype, None if shape is None else list(shape)), (dtype, stats), (dtype, stats)]


_BATCH_NORM = ("num_outputs", "epsilon", "momentum", "debugContext")


def _bind_batch_norm(builder: Any, args: Any, *rest: Any, **kwargs: Any) -> Bound:
    """AiGraphcoreOpset1::batchnormalization: epsilon and momentum written when they are not
    the defaults (compared as C++ floats), unbiased_variance=0 always (PopART's op ignores it:
    this batch normalization's running and saved variances are unbiased)."""
    if len(rest) > len(_BATCH_NORM) or set(kwargs) - set(_BATCH_NORM):
        raise TypeError(f"aiGraphcore.batchnormalization(args, {', '.join(_BATCH_NORM)}): got "
                        f"{len(rest)} positional and {sorted(kwargs)}")
    given = dict(zip(_BATCH_NORM, rest, strict=False)) | kwargs
    if "num_outputs" not in given:
        raise TypeError("aiGraphcore.batchnormalization: missing argument 'num_outputs'.")
    given.setdefault("epsilon", 1e-05)
    given.setdefault("momentum", 0.9)
    return _inputs(args), given, {"unbiased_variance": 0}


def _unless(default: float) -> Any:
    def convert(value: Any) -> float | None:
        return None if np.float32(value) == np.float32(default) else float(value)
    return convert


def _batch_norm_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]
                      ) -> list[TensorType]:
    """BatchNormOp::setup: y as x; running mean and variance, saved mean and variance as the
    mean input."""
    if len(inputs) != 5:
        raise ValueError(f"batchnormalization takes 5 inputs (x, scale, b, mean, var); got "
                         f"{len(inputs)}")
    (dtype, shape), (mean_type, mean_shape) = inputs[0], inputs[3]
    if shape is not None and len(shape) < 3:
        raise ValueError(f"batch norm requires X to have a rank >= 3.  x has rank {len(shape)}")
    stats = (mean_type, None if mean_shape is None else list(mean_shape))
    return [(dtype, None if shape is None else list(shape)), stats, stats, stats, stats]


def _normalize_image_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]
                           ) -> list[TensorType]:
    """NormalizeImageOp::setup: the last dimension, 3, padded to 4; UINT8 gives FLOAT16."""
    dtype, shape = inputs[0]
    if shape is not None and (len(shape) < 2 or shape[-1] != 3):
        raise ValueError("requires the inner dimension to be 3.")
    out = TensorProto.FLOAT16 if dtype == TensorProto.UINT8 else dtype
    return [(out, None if shape is None else [*shape[:-1], 4])]


def _image_scale(value: Any) -> float:
    value = float(value)
    if abs(value) < _FLOAT_EPSILON:
        raise BuilderError("[normalizeImageOpCreator] scale should be greater than 0.")
    return value


# -- collectives --------------------------------------------------------------------------------

def _collective_operator(value: Any) -> int | None:
    """popart.CollectiveOperator (or its index) as the INT PopART stores; None: none stored
    (Add)."""
    if value is None:
        return None
    index = getattr(value, "value", value)
    if isinstance(index, bool) or not isinstance(index, int | np.integer) or \
            not 0 <= index <= 8:
        raise TypeError(f"collectiveOperator must be a popart.CollectiveOperator, got "
                        f"{value!r}")
    return int(index)


def _comm_group(value: Any) -> list[int] | None:
    """popart.CommGroup as PopART stores it: [type, replicaGroupSize]; None: none stored (all
    replicas)."""
    if value is None:
        return None
    if hasattr(value, "replicaGroupSize"):
        return [int(getattr(value.type, "value", value.type)), int(value.replicaGroupSize)]
    try:
        kind, size = value
        return [int(getattr(kind, "value", kind)), int(size)]
    except (TypeError, ValueError):
        raise TypeError(f"commGroup must be a popart.CommGroup, got {value!r}") from None


def _scattered_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]
                     ) -> list[TensorType]:
    """ReplicatedReduceScatterOp::setup: [ceil(elements / group size)], the replica count known
    only to the session (PopART's Builder leaves the shape unknown too)."""
    return [(inputs[0][0], None)]


# -- splines ------------------------------------------------------------------------------------

def _spline_basis_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]
                        ) -> list[TensorType]:
    """SplineBasisOp::setup: basis (pseudo's type) and weight_index (kernel_size's type),
    [E, (degree + 1) ** D]."""
    if len(inputs) != 3:
        raise ValueError(f"splinebasis takes 3 inputs (pseudo, kernel_size, is_open_spline); "
                         f"got {len(inputs)}")
    (dtype, pseudo), (index_type, _) = inputs[0], inputs[1]
    if pseudo is None:
        return [(dtype, None), (index_type, None)]
    if len(pseudo) != 2:
        raise ValueError(f"SplineBasisOp::setup: pseudo tensor is not a 2-D tensor. Pseudo "
                         f"tensor rank = {len(pseudo)}.")
    shape = [pseudo[0], (attrs["degree"] + 1) ** pseudo[1]]
    return [(dtype, shape), (index_type, list(shape))]


def _spline_weighting_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]
                            ) -> list[TensorType]:
    """SplineWeightingOp::setup: [E, M_out] of the input's type."""
    if len(inputs) != 4:
        raise ValueError(f"splineweighting takes 4 inputs (input, weight, basis, weight_index); "
                         f"got {len(inputs)}")
    (dtype, x), (_, weight) = inputs[0], inputs[1]
    if x is None or weight is None:
        return [(dtype, None)]
    return [(dtype, [x[0], weight[2]])]


# -- ctc beam search ----------------------------------------------------------------------------

_BEAM_SEARCH = ("blank", "beam_width", "top_paths", "debug_context")


def _bind_beam_search(builder: Any, args: Any, *rest: Any, **kwargs: Any) -> Bound:
    """ctcbeamsearchdecoder(args, blank=0, beam_width=100, top_paths=1, debug_context="")."""
    if len(rest) > len(_BEAM_SEARCH) or set(kwargs) - set(_BEAM_SEARCH):
        raise TypeError(f"aiGraphcore.ctcbeamsearchdecoder(args, {', '.join(_BEAM_SEARCH)}): "
                        f"got {len(rest)} positional and {sorted(kwargs)}")
    given = dict(zip(_BEAM_SEARCH, rest, strict=False)) | kwargs
    given["debugContext"] = given.pop("debug_context", "")
    for p in ("blank", "beam_width", "top_paths"):
        if p in given and int(given[p]) < 0:
            raise TypeError(f"aiGraphcore.ctcbeamsearchdecoder: {p} is unsigned; got "
                            f"{given[p]}.")
    return _inputs(args), given, {}


def _beam_search_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]
                       ) -> list[TensorType]:
    """CtcBeamSearchDecoderOp::setup: label probabilities [N, top_paths] (the input's type),
    label lengths [N, top_paths] and decoded labels [N, top_paths, T] (UINT32)."""
    dtype, shape = _log_probabilities("CtcBeamSearchDecoder", inputs[0])
    if len(inputs) != 2 or inputs[1][0] != TensorProto.UINT32:
        got = TensorProto.DataType.Name(inputs[1][0]) if len(inputs) > 1 else "no input"
        raise ValueError(f"Unsupported data type for input 1 of Op CtcBeamSearchDecoder "
                         f"(expected a 'input lengths' tensor of type UINT32, got {got}).")
    top = attrs["top_paths"]
    pair = None if shape is None else [shape[1], top]
    return [(dtype, pair), (TensorProto.UINT32, pair),
            (TensorProto.UINT32, None if shape is None else [shape[1], top, shape[0]])]


# -- the registry -------------------------------------------------------------------------------

_COLLECTIVE = (("collectiveOperator", _collective_operator, None),
               ("commGroup", _comm_group, None))
_COLLECTIVE_ATTRIBUTES = (("collectiveOperator", COLLECTIVE_OPERATOR), ("commGroup", COMM_GROUP))

register("multiconv", GraphcoreOp("MultiConv", (
    ("dilations", _bound, []), ("inDilations", _bound, []), ("pads", _bound, []),
    ("outPads", _bound, []), ("strides", _bound, []), ("availableMemoryProportions", _bound, []),
    ("partialsTypes", _bound, []), ("planType", _bound, None),
    ("perConvReservedTiles", _bound, None), ("cycleBackOff", _bound, None),
    ("enableConvDithering", _bound, [])), _multiconv_types, outputs=_OUTPUTS,
    returns_list=True, bind=_bind_multiconv))
register("ctcloss", GraphcoreOp("Ctc", (
    ("reduction", reduction_name, "ReductionType.Mean"), ("blank", "int", 0),
    ("outDataType", _out_data_type, "UNDEFINED"), ("zeroInfinity", "bool", False)),
    _ctc_types, outputs=2))
register("ctcbeamsearchdecoder", GraphcoreOp("CtcBeamSearchDecoder", (
    ("blank", "int", 0), ("beam_width", "int", 100), ("top_paths", "int", 1),
    ("debug_context", _bound, "")), _beam_search_types, outputs=3, returns_list=True,
    bind=_bind_beam_search))
register("groupnormalization", GraphcoreOp("GroupNormalization", (
    ("num_groups", "int", REQUIRED), ("epsilon", _epsilon, 1e-05)),
    _group_norm_types, outputs=3, returns_list=True))
register("batchnormalization", GraphcoreOp("BatchNormalization", (
    ("num_outputs", "int", REQUIRED), ("epsilon", _unless(1e-05), 1e-05),
    ("momentum", _unless(0.9), 0.9)), _batch_norm_types, outputs="num_outputs",
    returns_list=True, bind=_bind_batch_norm))
register("normalize_image", GraphcoreOp("NormalizeImage", (("scale", _image_scale, 1.0),),
                                        _normalize_image_types))
register("replicatedallreduce", GraphcoreOp("ReplicatedAllReduce", _COLLECTIVE,
                                            renamed=_COLLECTIVE_ATTRIBUTES))
register("replicatedreducescatter", GraphcoreOp("ReplicatedReduceScatter", _COLLECTIVE,
                                                _scattered_types,
                                                renamed=_COLLECTIVE_ATTRIBUTES))
register("splinebasis", GraphcoreOp("SplineBasis", (("degree", "int", REQUIRED),),
                                    _spline_basis_types, outputs=2, returns_list=True))
register("splineweighting", GraphcoreOp("SplineWeighting", (), _spline_weighting_types))
