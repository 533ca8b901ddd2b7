"""The xla backend's operator table: one small JAX function per ONNX operator.

``OPS[(domain, op_type)]`` is an :class:`Op` (domain ``""`` for ai.onnx, ``"ai.graphcore"`` for
PopART's own operators). ``op(ctx, *inputs)`` returns a tuple of outputs; ``inputs`` are arrays, or
``None`` for omitted optional inputs. ``ctx`` (:class:`Ctx`) gives the node's attributes, the
compile-time value of an input (``ctx.static(i)``: shapes, axes, pads ...), the ai.onnx opset and
the outputs asked for.

Every ``Op`` names the inputs that must be compile-time constants (``static``) and may carry a
``check(ctx)`` hook that refuses, with :class:`NotSupported`, the attribute values it does not
implement; the lowering runs the hooks before anything runs. Semantics follow the ONNX schema of
the model's opset (Softmax flattens to 2-D before opset 13; Reduce, Squeeze, Split, Slice, Pad,
Clip read attributes or inputs as their opset says).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from onnx import AttributeProto, NodeProto, TensorProto, helper, numpy_helper

from ..._base.problems import popart_vector
from ..._model.popart_types import popart_opid, tensor_data_text
from ...errors import ModelError

__all__ = ["GRAPHCORE", "OPS", "SOFTMAX_AXIS", "UNKNOWN", "Ctx", "NotSupported", "Op",
           "PopartRefusal",
           "UnsupportedModel", "node_partials", "np_dtype", "partials", "read_attributes"]

GRAPHCORE = "ai.graphcore"


class NotSupported(Exception):
    """An operator, attribute value or input form the xla backend does not implement."""


class PopartRefusal(NotSupported):
    """A refusal PopART makes too: ``popart_text`` is PopART's own message (what
    ``popart_kit.popart`` raises), then the fix."""

    def __init__(self, popart_text: str, fix: str = "") -> None:
        super().__init__(popart_text + (f" Fix: {fix}" if fix else ""))
        self.popart_text = popart_text


class UnsupportedModel(ModelError):
    """The model uses operators, attributes or input forms the xla backend does not run; one
    message per problem, in ``problems``."""

    rule = "K-xla-unsupported"

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"the xla backend cannot run this model ({len(self.problems)} "
                         f"problem(s)):\n{lines}\nFix: express these nodes with the operators "
                         f"and attribute values the xla backend implements (see "
                         f"popart_kit._runtime.xla.op_table.OPS), or run on the popart backend.")


# -- data types ---------------------------------------------------------------------------------

_UNSUPPORTED_TYPES = {TensorProto.UNDEFINED, TensorProto.STRING}
_FLOAT8 = {np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz,
                                 ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz)}
_NARROW_INTS = {np.dtype(t) for t in (ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2,
                                      ml_dtypes.uint2)}


@functools.cache
def np_dtype(onnx_type: int) -> np.dtype:
    """The numpy dtype of an ONNX ``TensorProto`` data type; NotSupported for strings and
    types JAX has no array type for."""
    name = TensorProto.DataType.Name(onnx_type) if onnx_type in TensorProto.DataType.values() \
        else str(onnx_type)
    if onnx_type in _UNSUPPORTED_TYPES:
        raise NotSupported(f"data type {name} has no JAX array type")
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(onnx_type))
    except (KeyError, TypeError, ValueError) as err:
        raise NotSupported(f"data type {name} has no JAX array type") from err
    if dtype.kind in "OSUM" or not hasattr(jnp, dtype.name):
        raise NotSupported(f"data type {name} has no JAX array type")
    return dtype


def _canon(dtype: Any) -> np.dtype:
    """The dtype JAX gives ``dtype`` here (int64 is int32 unless x64 is enabled)."""
    return jax.dtypes.canonicalize_dtype(dtype)


def _int64() -> np.dtype:
    return _canon(np.int64)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


# -- nodes as op functions see them -------------------------------------------------------------

UNKNOWN = object()  # an input value not known before running


class Ctx:
    """One node: its attributes, its inputs' compile-time values and the outputs asked for."""

    __slots__ = ("name", "op_type", "opset", "attrs", "inputs", "outputs", "_static", "_values")

    def __init__(self, name: str, op_type: str, opset: int, attrs: dict[str, Any],
                 inputs: Sequence[str], outputs: Sequence[str], static: Sequence[bool],
                 values: Sequence[Any] = ()) -> None:
        self.name, self.op_type, self.opset, self.attrs = name, op_type, opset, attrs
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self._static = tuple(static)
        self._values = tuple(values) or (UNKNOWN,) * len(self.inputs)

    def with_values(self, values: Sequence[Any]) -> Ctx:
        """This node with its inputs' values (numpy for compile-time constants)."""
        return Ctx(self.name, self.op_type, self.opset, self.attrs, self.inputs, self.outputs,
                   self._static, values)

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def has_input(self, i: int) -> bool:
        return i < len(self.inputs) and bool(self.inputs[i])

    def is_static(self, i: int) -> bool:
        return self.has_input(i) and self._static[i]

    def static(self, i: int) -> np.ndarray | None:
        """Input ``i`` as a numpy value (None when omitted); NotSupported unless it is a
        compile-time constant."""
        if not self.has_input(i):
            return None
        if not self._static[i]:
            raise NotSupported(f"input {i} ({self.inputs[i]!r}) must be a compile-time constant")
        value = self._values[i]
        if value is UNKNOWN:
            raise NotSupported(f"input {i} ({self.inputs[i]!r}) is not known before running")
        return np.asarray(value)

    def known(self, i: int) -> np.ndarray | None:
        """Input ``i``'s value when already known (checks at lowering), else None."""
        if not self.is_static(i) or self._values[i] is UNKNOWN:
            return None
        return np.asarray(self._values[i])

    def wants(self, i: int) -> bool:
        return i < len(self.outputs) and bool(self.outputs[i])


@dataclass(frozen=True)
class Op:
    """A table entry: the function, its lowering-time check and its compile-time inputs."""

    fn: Callable[..., Any]
    check: Callable[[Ctx], None] | None = None
    static: tuple[int, ...] = ()      # input positions that must be compile-time constants
    shape_only: bool = False          # the outputs depend on the inputs' shapes only
    random: bool = False              # draws random numbers: never folded into a constant

    def __call__(self, ctx: Ctx, *inputs: Any) -> tuple[Any, ...]:
        out = self.fn(ctx, *inputs)
        return out if isinstance(out, tuple) else (out,)


OPS: dict[tuple[str, str], Op] = {}

#: ai.onnx inputs whose value PopART's op reads when the IR is built (Op::getInTensorData):
#: op type -> {input position: the name PopART's message gives it}.
_POPART_DATA_INPUTS = {"Slice": {1: "starts", 2: "ends", 3: "axes", 4: "steps"},
                       "Reshape": {1: "shape"}, "Expand": {1: "shape"}}


def popart_constant_text(op_type: str, opset: int, index: int, tensor: str) -> str | None:
    """PopART's refusal of an ai.onnx op whose input ``index`` (``tensor``) has no constant
    value (tile.cpp, slice.cpp, reshape.cpp, expand.cpp connectInTensor); None where PopART has
    no such refusal."""
    if op_type == "Tile" and index == 1:
        return f"The 'Repeats' Tensor `{tensor}' must be of type Constant"
    what = _POPART_DATA_INPUTS.get(op_type, {}).get(index)
    if what is None:
        return None
    return tensor_data_text(popart_opid(op_type, opset), what, tensor)


def op(*names: str, domain: str = "", check: Callable[[Ctx], None] | None = None,
       static: Sequence[int] = (), shape_only: bool = False,
       random: bool = False) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        for name in names:
            OPS[(domain, name)] = Op(fn, check, tuple(static), shape_only, random)
        return fn
    return register


#: PopART annotations that are part of an op's meaning, kept among its attributes: the
#: replicated collectives' operator and replica group, MultiConv's per-convolution partials.
#: On an Nll node whose probabilities a Softmax makes: that Softmax's axis (its logits are the
#: node's third input), for PopART's direct gradient (see :func:`popart_nll`).
SOFTMAX_AXIS = "__softmax_axis"


SEMANTIC_ANNOTATIONS = frozenset({"__collectiveOperator", "__collectiveCommGroup",
                                  "__collectiveReplicaGrouping", "__partials_type",
                                  SOFTMAX_AXIS})


def read_attributes(node: NodeProto) -> dict[str, Any]:
    """A node's attributes as Python values: strings decoded, tensors as numpy arrays, lists as
    lists; PopART's own annotations (``__pipeline_stage`` ...) left out but for
    :data:`SEMANTIC_ANNOTATIONS`."""
    out: dict[str, Any] = {}
    for attribute in node.attribute:
        if attribute.name.startswith("__") and attribute.name not in SEMANTIC_ANNOTATIONS:
            continue
        value = helper.get_attribute_value(attribute)
        if attribute.type == AttributeProto.TENSOR:
            value = numpy_helper.to_array(value)
        elif attribute.type == AttributeProto.STRING:
            value = value.decode("utf-8", "replace")
        elif attribute.type == AttributeProto.STRINGS:
            value = [v.decode("utf-8", "replace") for v in value]
        elif attribute.type in (AttributeProto.INTS, AttributeProto.FLOATS):
            value = list(value)
        out[attribute.name] = value
    return out


# -- checks -------------------------------------------------------------------------------------

def _refuse(name: str, value: Any, supported: Sequence[Any] = ()) -> None:
    hint = f"; supported: {', '.join(map(repr, supported))}" if supported else ""
    raise NotSupported(f"attribute {name}={value!r} is not supported{hint}")


def _one_of(name: str, default: Any, *allowed: Any) -> Callable[[Ctx], None]:
    def check(ctx: Ctx) -> None:
        value = ctx.attr(name, default)
        if value not in allowed:
            _refuse(name, value, allowed)
    return check


def _checks(*checks: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    def check(ctx: Ctx) -> None:
        for one in checks:
            one(ctx)
    return check


def _check_dtype(name: str, default: int | None = None) -> Callable[[Ctx], None]:
    def check(ctx: Ctx) -> None:
        value = ctx.attr(name, default)
        if value is not None:
            try:
                np_dtype(value)
            except NotSupported as err:
                raise NotSupported(f"attribute {name}={value}: {err}") from None
    return check


_check_auto_pad = _one_of("auto_pad", "NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


# -- helpers ------------------------------------------------------------------------------------

def _axis(axis: Any, rank: int) -> int:
    axis = int(axis)
    return axis + rank if axis < 0 else axis


def _ints(value: Any) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1)]


def _scalar(value: Any) -> Any:
    return np.asarray(value).reshape(-1)[0].item()


def _nonneg(indices: Any, size: int) -> Any:
    """ONNX indices count from the end when negative."""
    return jnp.where(indices < 0, indices + size, indices)


def _legacy_broadcast(ctx: Ctx, a: Any, b: Any) -> Any:
    """Before opset 7, ``broadcast=1`` aligned B with A at ``axis`` (default: the trailing
    dimensions, as numpy does)."""
    if ctx.opset < 7 and ctx.attr("broadcast", 0) and ctx.attr("axis") is not None:
        axis = _axis(ctx.attr("axis"), jnp.ndim(a))
        b = jnp.reshape(b, jnp.shape(b) + (1,) * (jnp.ndim(a) - axis - jnp.ndim(b)))
    return b


# -- elementwise --------------------------------------------------------------------------------

def _unary(fn: Callable[[Any], Any]) -> Callable[..., Any]:
    return lambda ctx, x: fn(x)


def _softplus(x: Any) -> Any:
    return jnp.logaddexp(x, jnp.zeros((), x.dtype))


# -- PopART's own arithmetic where it departs from the ONNX formula or from autodiff; each
#    departure, with the PopART source it follows, is listed in operator_docs.DEPARTURES ------

@jax.custom_jvp
def _popart_relu(x: Any) -> Any:
    """popnn's RELU: its gradient is 0 at x = 0 (``maximum`` would give 0.5); NaN passes.
    The gradient reads the output, as PopART's ReluGradOp does (:func:`relu_gradient`)."""
    return jnp.where(x <= 0, jnp.zeros((), x.dtype), x)


def relu_gradient(y: Any, dy: Any) -> Any:
    """Relu's gradient from its output ``y``: 0 where the input was <= 0 (exactly where ``y``
    is), ``dy`` elsewhere, NaN included. Read from the output, which the next operator keeps
    for its own gradient anyway, the input need not outlive the forward pass: a step holds
    one activation per Relu, not two."""
    return jnp.where(y <= 0, jnp.zeros((), dy.dtype), dy)


_popart_relu.defjvps(lambda dx, y, x: relu_gradient(y, dx))


@jax.custom_vjp
def _popart_abs(x: Any) -> Any:
    """|x| with PopART's gradient sign(x) (AbsGradOp as Sign * grad): 0 at x = 0, where
    autodiff gives 1."""
    return jnp.abs(x)


def _popart_abs_fwd(x: Any) -> tuple[Any, Any]:
    return jnp.abs(x), x


def _popart_abs_bwd(x: Any, g: Any) -> tuple[Any]:
    return ((g * jnp.sign(x)).astype(g.dtype),)


_popart_abs.defvjp(_popart_abs_fwd, _popart_abs_bwd)


@jax.custom_vjp
def _popart_sinh(x: Any) -> Any:
    """PopART's Sinh, 0.5 (exp(x) - 1/exp(x)), with its gradient 0.5 (exp(x) + 1/exp(x))."""
    e = jnp.exp(x)
    return 0.5 * (e - 1 / e)


def _popart_sinh_fwd(x: Any) -> tuple[Any, Any]:
    return _popart_sinh(x), x


def _popart_sinh_bwd(x: Any, g: Any) -> tuple[Any]:
    e = jnp.exp(x)
    return (g * (0.5 * (e + 1 / e)),)


_popart_sinh.defvjp(_popart_sinh_fwd, _popart_sinh_bwd)


@jax.custom_vjp
def _popart_softplus(x: Any) -> Any:
    """PopART's Softplus, max(x, 0) + log(1 + exp(-|x|)), with its gradient sigmoid(x)."""
    return jnp.maximum(x, 0) + jnp.log(1 + jnp.exp(-jnp.abs(x)))


def _popart_softplus_fwd(x: Any) -> tuple[Any, Any]:
    return _popart_softplus(x), x


def _popart_softplus_bwd(x: Any, g: Any) -> tuple[Any]:
    return (g * jax.nn.sigmoid(x),)


_popart_softplus.defvjp(_popart_softplus_fwd, _popart_softplus_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _popart_elu(x: Any, alpha: float, gamma: float) -> Any:
    """Elu (gamma 1) and Selu, gamma (min(alpha expm1(x), 0) + max(0, x)), with PopART's
    gradient gamma ((1 - sign x)/2 alpha exp(x) + (1 + sign x)/2): (1 + alpha)/2 at 0.
    (PopART's forward writes exp(x) - 1, which in bfloat16 fails ONNX's conformance.)"""
    return gamma * (jnp.minimum(alpha * jnp.expm1(x), 0) + jnp.maximum(0, x))


def _popart_elu_fwd(x: Any, alpha: float, gamma: float) -> tuple[Any, Any]:
    return _popart_elu(x, alpha, gamma), x


def _popart_elu_bwd(alpha: float, gamma: float, x: Any, g: Any) -> tuple[Any]:
    s = jnp.sign(x)  # exp of min(x, 0): PopART's 0 * exp(x) is NaN where exp overflows
    return (g * (gamma * ((1 - s) / 2 * alpha * jnp.exp(jnp.minimum(x, 0)) + (1 + s) / 2)),)


_popart_elu.defvjp(_popart_elu_fwd, _popart_elu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _popart_shrink(x: Any, lambd: float, bias: float) -> Any:
    """ONNX's Shrink with PopART's gradient 0.5 (1 + sign(|x| - lambd)): 0.5 at |x| = lambd."""
    zero = jnp.zeros((), x.dtype)
    return jnp.where(x < -lambd, x + bias, jnp.where(x > lambd, x - bias, zero)).astype(x.dtype)


def _popart_shrink_fwd(x: Any, lambd: float, bias: float) -> tuple[Any, Any]:
    return _popart_shrink(x, lambd, bias), x


def _popart_shrink_bwd(lambd: float, bias: float, x: Any, g: Any) -> tuple[Any]:
    return (g * (0.5 * (1 + jnp.sign(jnp.abs(x) - lambd))).astype(g.dtype),)


_popart_shrink.defvjp(_popart_shrink_fwd, _popart_shrink_bwd)


def _sum_to(g: Any, shape: Sequence[int]) -> Any:
    """``g`` summed over the axes numpy broadcasting added or stretched to reach its shape."""
    lead = g.ndim - len(shape)
    g = jnp.sum(g, tuple(range(lead))) if lead else g
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return jnp.sum(g, stretched, keepdims=True) if stretched else g


def _popart_extremum(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """Variadic Max or Min with PopART's gradient: every input equal to the output gets the
    whole incoming gradient (mask sign(x - out) + 1), where JAX splits it between ties."""
    @jax.custom_vjp
    def run(*xs: Any) -> Any:
        return functools.reduce(fn, xs)

    def fwd(*xs: Any) -> tuple[Any, Any]:
        out = run(*xs)
        return out, (xs, out)

    def bwd(res: Any, g: Any) -> tuple[Any, ...]:
        xs, out = res
        zero = jnp.zeros((), g.dtype)
        return tuple(_sum_to(jnp.where(x == out, g, zero), x.shape).astype(x.dtype)
                     for x in xs)

    run.defvjp(fwd, bwd)

    def call(ctx: Ctx, *xs: Any) -> Any:
        xs = tuple(jnp.asarray(x) for x in xs)
        if all(jnp.issubdtype(x.dtype, jnp.inexact) for x in xs):
            return run(*xs)
        return functools.reduce(fn, xs)
    return call


def _popart_fmod(a: Any, b: Any) -> Any:
    """C's fmod; PopART's Fmod has a gradient for the dividend only (FmodArg0GradOp)."""
    return jnp.fmod(a, lax.stop_gradient(b))


def _popart_remainder(a: Any, b: Any) -> Any:
    """PopART's Remainder and Mod (fmod 0) as its ONNX pass writes them for floats,
    fmod(fmod(a, b) + b, b): the divisor's gradient is the incoming one (through the Add);
    integers take Python's %, which that form equals short of overflow."""
    if not jnp.issubdtype(jnp.result_type(a, b), jnp.inexact):
        return jnp.remainder(a, b)
    return _popart_fmod(_popart_fmod(a, b) + b, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _popart_reduce_extreme(x: Any, axes: tuple[int, ...], keepdims: bool, biggest: bool) -> Any:
    """ReduceMax (``biggest``) or ReduceMin of a float tensor with PopART's gradient: every
    element equal to the result gets the whole incoming gradient, where JAX splits it."""
    if biggest:
        return jnp.max(x, axes, keepdims=keepdims, initial=-jnp.inf)
    return jnp.min(x, axes, keepdims=keepdims, initial=jnp.inf)


def _popart_reduce_extreme_fwd(x: Any, axes: tuple[int, ...], keepdims: bool,
                               biggest: bool) -> tuple[Any, Any]:
    out = _popart_reduce_extreme(x, axes, keepdims, biggest)
    return out, (x, out)


def _popart_reduce_extreme_bwd(axes: tuple[int, ...], keepdims: bool, biggest: bool,
                               res: Any, g: Any) -> tuple[Any]:
    x, out = res
    if not keepdims:
        out, g = jnp.expand_dims(out, axes), jnp.expand_dims(g, axes)
    return (jnp.where(x == out, g, jnp.zeros((), g.dtype)),)


_popart_reduce_extreme.defvjp(_popart_reduce_extreme_fwd, _popart_reduce_extreme_bwd)


def _extreme(biggest: bool) -> Callable[[Any, Any, bool], Any]:
    def run(x: Any, a: Any, k: bool) -> Any:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return _popart_reduce_extreme(x, tuple(a), k, biggest)
        if biggest:
            return jnp.max(x, a, keepdims=k, initial=_lowest(x.dtype))
        return jnp.min(x, a, keepdims=k, initial=_highest(x.dtype))
    return run


_UNARY: dict[str, Callable[[Any], Any]] = {
    "Identity": lambda x: x,
    "Abs": _popart_abs, "Neg": jnp.negative, "Sign": jnp.sign,
    "Exp": jnp.exp, "Log": jnp.log, "Sqrt": jnp.sqrt, "Reciprocal": jnp.reciprocal,
    "Floor": jnp.floor, "Ceil": jnp.ceil, "Round": jnp.round,
    "Relu": _popart_relu,
    "Sigmoid": jax.nn.sigmoid, "Tanh": jnp.tanh, "Erf": lax.erf,
    "Sin": jnp.sin, "Cos": jnp.cos, "Asin": jnp.arcsin, "Atan": jnp.arctan,
    # PopART's ONNX pass writes these five with other operators (onnxpasses/nodepatterns/trig.cpp)
    "Tan": lambda x: jnp.sin(x) / jnp.cos(x),
    "Acos": lambda x: math.pi / 2 - jnp.arcsin(x),
    "Asinh": lambda x: jnp.log(x + jnp.sqrt(x ** 2 + 1)),
    "Acosh": lambda x: jnp.log(x + jnp.sqrt(x ** 2 - 1)),
    "Atanh": lambda x: 0.5 * jnp.log((1 + x) / (1 - x)),
    "Sinh": _popart_sinh, "Cosh": lambda x: 0.5 * (jnp.exp(x) + jnp.exp(-x)),
    "Softplus": _popart_softplus, "Softsign": lambda x: x / (1 + jnp.abs(x)),
    "Mish": lambda x: x * jnp.tanh(_softplus(x)),
    "Not": jnp.logical_not, "BitwiseNot": jnp.bitwise_not, "IsNaN": jnp.isnan,
}
for _name, _fn in _UNARY.items():
    op(_name)(_unary(_fn))


def _div(a: Any, b: Any) -> Any:
    if jnp.issubdtype(jnp.result_type(a, b), jnp.integer):
        a, b = jnp.broadcast_arrays(a, b)
        return lax.div(a, b)  # rounds towards zero, as C and ONNX do
    return jnp.divide(a, b)


@jax.custom_vjp
def _float_pow(x: Any, y: Any) -> Any:
    """``x ** y`` of one shape and float type, with PopART's gradients
    (patterns/powarg0gradoppattern.cpp, powarg1gradoppattern.cpp): for the base,
    ``g * y * x ** (y - 1)``, 0 where ``y == 0``; for the exponent, ``g * out * log(x)``, 0
    where ``x == 0`` and ``y >= 0`` (not NaN)."""
    return jnp.power(x, y)


def _float_pow_fwd(x: Any, y: Any) -> tuple[Any, tuple[Any, Any, Any]]:
    out = jnp.power(x, y)
    return out, (x, y, out)


def _float_pow_bwd(saved: tuple[Any, Any, Any], g: Any) -> tuple[Any, Any]:
    x, y, out = saved
    zero = jnp.zeros((), x.dtype)
    dx = jnp.where(y == 0, zero, g * (y * jnp.power(x, y - 1)))
    y_nonnegative = ~((y < 0) | jnp.isnan(y))
    dy = g * jnp.where((x == 0) & y_nonnegative, zero, out * jnp.log(x))
    return dx, dy


_float_pow.defvjp(_float_pow_fwd, _float_pow_bwd)


def _pow(x: Any, y: Any) -> Any:
    """Pow keeps the base's type, whatever the exponent's; float powers have PopART's
    gradients (:func:`_float_pow`)."""
    if jnp.issubdtype(x.dtype, jnp.integer) and jnp.issubdtype(y.dtype, jnp.integer):
        return jnp.power(x, y.astype(x.dtype))
    dtype = x.dtype
    wide = dtype if dtype == y.dtype else jnp.promote_types(
        jnp.promote_types(dtype, y.dtype), jnp.float32)
    x, y = jnp.broadcast_arrays(x.astype(wide), y.astype(wide))
    return _float_pow(x, y).astype(dtype)


def _mul(a: Any, b: Any) -> Any:
    """PopART's MulOp: a FLOAT16 tensor times a FLOAT scalar (either way round) is FLOAT16
    (popart_types._mul); computed in float32."""
    if {jnp.dtype(a.dtype), jnp.dtype(b.dtype)} == {jnp.dtype(jnp.float16),
                                                    jnp.dtype(jnp.float32)}:
        return jnp.multiply(a.astype(jnp.float32), b.astype(jnp.float32)).astype(jnp.float16)
    return jnp.multiply(a, b)


_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "Add": jnp.add, "Sub": jnp.subtract, "Mul": _mul, "Div": _div, "Pow": _pow,
    "Equal": jnp.equal, "Less": jnp.less, "Greater": jnp.greater,
    "LessOrEqual": jnp.less_equal, "GreaterOrEqual": jnp.greater_equal,
    "And": jnp.logical_and, "Or": jnp.logical_or, "Xor": jnp.logical_xor,
    "BitwiseAnd": jnp.bitwise_and, "BitwiseOr": jnp.bitwise_or, "BitwiseXor": jnp.bitwise_xor,
}


def _binary(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    def run(ctx: Ctx, a: Any, b: Any) -> Any:
        return fn(jnp.asarray(a), jnp.asarray(_legacy_broadcast(ctx, a, b)))
    return run


for _name, _fn in _BINARY.items():
    op(_name)(_binary(_fn))


@op("Mod")
def mod(ctx: Ctx, a: Any, b: Any) -> Any:
    if ctx.attr("fmod", 0):
        return _popart_fmod(a, b)  # the dividend's sign, as C's fmod
    # PopART's fmod(fmod(a, b) + b, b) makes NaN of inf inputs that ONNX defines, so Mod
    # keeps Python's % (operator_docs.DEPARTURES); aiGraphcore.remainder takes PopART's form
    return jnp.remainder(a, b)  # the divisor's sign, as Python's %


@op("BitShift", check=_one_of("direction", None, "LEFT", "RIGHT"))
def bit_shift(ctx: Ctx, x: Any, y: Any) -> Any:
    shift = jnp.left_shift if ctx.attr("direction") == "LEFT" else jnp.right_shift
    return shift(x, y)


def _variadic(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    return lambda ctx, *xs: functools.reduce(fn, (jnp.asarray(x) for x in xs))


op("Max")(_popart_extremum(jnp.maximum))
op("Min")(_popart_extremum(jnp.minimum))
op("Sum")(_variadic(jnp.add))


@op("Mean")
def mean(ctx: Ctx, *xs: Any) -> Any:
    total = functools.reduce(jnp.add, (jnp.asarray(x) for x in xs))
    return (total / len(xs)).astype(total.dtype)


@op("Where")
def where(ctx: Ctx, c: Any, x: Any, y: Any) -> Any:
    return jnp.where(c, x, y)


@op("IsInf")
def is_inf(ctx: Ctx, x: Any) -> Any:
    neg, pos = ctx.attr("detect_negative", 1), ctx.attr("detect_positive", 1)
    return jnp.isinf(x) & ((x > 0) if not neg else True) & ((x < 0) if not pos else True)


@op("Clip")
def clip(ctx: Ctx, x: Any, lo: Any = None, hi: Any = None) -> Any:
    """ONNX's Clip as PopART computes it (popx/op/clipx.cpp): in float16 the bounds, given or
    not, are clamped to +-65504; the gradient is 0 where the output equals a bound."""
    if ctx.opset < 11:
        lo, hi = ctx.attr("min"), ctx.attr("max")
    if x.dtype == np.float16:
        lo = -65504.0 if lo is None else jnp.clip(jnp.asarray(lo, np.float32), -65504, 65504)
        hi = 65504.0 if hi is None else jnp.clip(jnp.asarray(hi, np.float32), -65504, 65504)
    out, keep = x, jnp.ones(jnp.shape(x), bool)
    if lo is not None:
        lo = jnp.asarray(lo, x.dtype)
        out = jnp.maximum(out, lo)
    if hi is not None:
        hi = jnp.asarray(hi, x.dtype)
        out = jnp.minimum(out, hi)  # min > max gives max, as ONNX says
    if lo is not None:
        keep = keep & (out != lo)
    if hi is not None:
        keep = keep & (out != hi)
    return jnp.where(keep, x, lax.stop_gradient(out))


# -- activations --------------------------------------------------------------------------------

@op("LeakyRelu")
def leaky_relu(ctx: Ctx, x: Any) -> Any:
    return jnp.where(x < 0, ctx.attr("alpha", 0.01) * x, x)


@op("Elu")
def elu(ctx: Ctx, x: Any) -> Any:
    return _popart_elu(x, ctx.attr("alpha", 1.0), 1.0)


@op("Selu")
def selu(ctx: Ctx, x: Any) -> Any:
    alpha = ctx.attr("alpha", 1.67326319217681884765625)
    gamma = ctx.attr("gamma", 1.05070102214813232421875)
    return _popart_elu(x, alpha, gamma)


@op("Celu")
def celu(ctx: Ctx, x: Any) -> Any:
    alpha = ctx.attr("alpha", 1.0)
    return jnp.maximum(x, 0) + jnp.minimum(0, alpha * jnp.expm1(x / alpha))


@op("HardSigmoid")
def hard_sigmoid(ctx: Ctx, x: Any) -> Any:
    return jnp.clip(ctx.attr("alpha", 0.2) * x + ctx.attr("beta", 0.5), 0, 1)


@op("HardSwish")
def hard_swish(ctx: Ctx, x: Any) -> Any:
    return x * jnp.clip(x / 6 + 0.5, 0, 1)


@op("ThresholdedRelu")
def thresholded_relu(ctx: Ctx, x: Any) -> Any:
    return jnp.where(x > ctx.attr("alpha", 1.0), x, jnp.zeros((), x.dtype))


@op("Shrink")
def shrink(ctx: Ctx, x: Any) -> Any:
    bias, lambd = ctx.attr("bias", 0.0), ctx.attr("lambd", 0.5)
    return _popart_shrink(x, lambd, bias)


@op("PRelu")
def prelu(ctx: Ctx, x: Any, slope: Any) -> Any:
    return jnp.where(x < 0, slope * x, x)


@op("Swish")
def swish(ctx: Ctx, x: Any) -> Any:
    return x * jax.nn.sigmoid(ctx.attr("alpha", 1.0) * x)


def _gelu(x: Any, approximate: str = "none") -> Any:
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
        return 0.5 * x * (1 + jnp.tanh(inner))
    return 0.5 * x * (1 + lax.erf(x / math.sqrt(2)))


@op("Gelu", check=_one_of("approximate", "none", "none", "tanh"))
def gelu(ctx: Ctx, x: Any) -> Any:
    return _gelu(x, ctx.attr("approximate", "none"))


def _flattened(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Softmax, LogSoftmax, Hardmax: before opset 13 the input is seen as 2-D, split at
    ``axis`` (default 1); from 13 on they work along ``axis`` (default -1)."""
    def run(ctx: Ctx, x: Any) -> Any:
        if ctx.opset >= 13:
            return fn(x, _axis(ctx.attr("axis", -1), x.ndim))
        axis = _axis(ctx.attr("axis", 1), x.ndim)
        flat = x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))
        return fn(flat, 1).reshape(x.shape)
    return run


def _hardmax(x: Any, axis: int) -> Any:
    return jax.nn.one_hot(jnp.argmax(x, axis), x.shape[axis], axis=axis, dtype=x.dtype)


op("Softmax")(_flattened(lambda x, axis: jax.nn.softmax(x, axis=axis)))
op("LogSoftmax")(_flattened(lambda x, axis: jax.nn.log_softmax(x, axis=axis)))
op("Hardmax")(_flattened(_hardmax))


# -- types, constants, shapes -------------------------------------------------------------------

def _to_e8m0(x: Any, saturate: int, round_mode: str) -> Any:
    """float8e8m0 keeps a float32's exponent, rounded as ``round_mode`` says (ONNX's rule)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    exponent = (bits >> 23) & 0xFF
    if round_mode == "nearest":
        up = ((bits & 0x400000) > 0) & (((bits & 0x3FFFFF) > 0) | (exponent > 0))
    elif round_mode == "up":
        up = (bits & 0x7FFFFF) > 0
    else:
        up = jnp.zeros(bits.shape, bool)
    if saturate:
        up = up & (exponent != 0xFE)
    exponent = jnp.where(exponent == 0xFF, exponent, exponent + up.astype(jnp.uint32))
    return lax.bitcast_convert_type(exponent.astype(jnp.uint8), jnp.float8_e8m0fnu)


def _cast(x: Any, dtype: np.dtype, saturate: int = 1, round_mode: str = "up") -> Any:
    x, dtype = jnp.asarray(x), np.dtype(dtype)
    if dtype == np.dtype(ml_dtypes.float8_e8m0fnu) and x.dtype != dtype:
        return _to_e8m0(x, saturate, round_mode)
    if saturate and dtype in _FLOAT8 and _is_float(x):
        largest = float(ml_dtypes.finfo(dtype).max)
        x = jnp.where(jnp.isnan(x), x, jnp.clip(x, -largest, largest))
    if dtype in _NARROW_INTS and x.dtype != dtype:  # int4, uint2 ...: wrap around, as ONNX does
        bits = ml_dtypes.iinfo(dtype).bits
        wide = x.astype(jnp.int32)
        low = ml_dtypes.iinfo(dtype).min
        x = (wide - low) % (1 << bits) + low
    return x.astype(_canon(dtype))


_check_cast = _one_of("round_mode", "up", "up", "down", "nearest")


def _cast_to(ctx: Ctx) -> int:
    to = ctx.attr("to")  # a type name before opset 6
    return TensorProto.DataType.Value(to.upper()) if isinstance(to, str) else to


def _check_cast_to(ctx: Ctx) -> None:
    try:
        np_dtype(_cast_to(ctx))
    except (NotSupported, ValueError) as err:
        raise NotSupported(f"attribute to={ctx.attr('to')!r}: {err}") from None


@op("Cast", check=_checks(_check_cast_to, _check_cast))
def cast(ctx: Ctx, x: Any) -> Any:
    return _cast(x, np_dtype(_cast_to(ctx)), ctx.attr("saturate", 1),
                 ctx.attr("round_mode", "up"))


@op("CastLike", check=_check_cast)
def cast_like(ctx: Ctx, x: Any, like: Any) -> Any:
    return _cast(x, like.dtype, ctx.attr("saturate", 1), ctx.attr("round_mode", "up"))


def _check_constant(ctx: Ctx) -> None:
    for name in ("sparse_value", "value_string", "value_strings"):
        if name in ctx.attrs:
            _refuse(name, ctx.attrs[name])
    value = ctx.attr("value")
    if isinstance(value, np.ndarray) and value.dtype.kind in "OSU":
        _refuse("value", "a string tensor")


@op("Constant", check=_check_constant)
def constant(ctx: Ctx) -> Any:
    kinds = {"value": None, "value_float": np.float32, "value_floats": np.float32,
             "value_int": np.int64, "value_ints": np.int64}
    for name, dtype in kinds.items():
        if name in ctx.attrs:
            return np.asarray(ctx.attrs[name], dtype)
    raise NotSupported("Constant without a value")


@op("ConstantOfShape", static=(0,))
def constant_of_shape(ctx: Ctx, shape: Any) -> Any:
    value = ctx.attr("value")
    value = np.zeros(1, np.float32) if value is None else np.asarray(value)
    return jnp.full(tuple(_ints(ctx.static(0))), value.reshape(-1)[0], _canon(value.dtype))


@op("Shape", shape_only=True)
def shape(ctx: Ctx, x: Any) -> Any:
    dims = np.shape(x)
    return np.asarray(dims[ctx.attr("start", 0):ctx.attr("end", len(dims))], np.int64)


@op("Size", shape_only=True)
def size(ctx: Ctx, x: Any) -> Any:
    return np.asarray(math.prod(np.shape(x)), np.int64)


@op("Range", static=(0, 1, 2))
def range_(ctx: Ctx, start: Any, limit: Any, delta: Any) -> Any:
    start, limit, delta = (ctx.static(i) for i in range(3))
    count = max(math.ceil((limit.item() - start.item()) / delta.item()), 0)
    return (start + np.arange(count, dtype=start.dtype) * delta).astype(start.dtype)


@op("EyeLike", check=_check_dtype("dtype"))
def eye_like(ctx: Ctx, x: Any) -> Any:
    dtype = np_dtype(ctx.attr("dtype")) if ctx.attr("dtype") is not None else x.dtype
    return jnp.eye(x.shape[0], x.shape[1], ctx.attr("k", 0), dtype=_canon(dtype))


def _window(fn: Callable[[np.ndarray, int], np.ndarray]) -> Callable[..., Any]:
    def run(ctx: Ctx, size: Any) -> Any:
        n = int(_scalar(ctx.static(0)))
        denominator = n if ctx.attr("periodic", 1) else n - 1
        values = fn(np.arange(n, dtype=np.float64), denominator)
        return values.astype(np_dtype(ctx.attr("output_datatype", TensorProto.FLOAT)))
    return run


_WINDOWS = {
    "HannWindow": lambda n, d: np.sin(n * np.pi / d) ** 2,
    "HammingWindow": lambda n, d: 25 / 46 - np.cos(n * np.pi * 2 / d) * (21 / 46),
    "BlackmanWindow": lambda n, d: (0.42 - 0.5 * np.cos(n * np.pi * 2 / d)
                                    + 0.08 * np.cos(n * np.pi * 4 / d)),
}
for _name, _fn in _WINDOWS.items():
    op(_name, static=(0,), check=_check_dtype("output_datatype"))(_window(_fn))


# -- shape manipulation -------------------------------------------------------------------------

@op("Reshape", static=(1,))
def reshape(ctx: Ctx, x: Any, shape: Any = None) -> Any:
    dims = _ints(ctx.static(1)) if ctx.opset >= 5 else list(ctx.attr("shape"))
    if not ctx.attr("allowzero", 0):
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    if -1 in dims:  # inferred here: jnp cannot infer it for empty tensors
        known = math.prod(d for d in dims if d != -1)
        dims[dims.index(-1)] = math.prod(x.shape) // known if known else 0
    return jnp.reshape(x, dims)


@op("Flatten")
def flatten(ctx: Ctx, x: Any) -> Any:
    axis = _axis(ctx.attr("axis", 1), x.ndim)
    return jnp.reshape(x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


@op("Transpose")
def transpose(ctx: Ctx, x: Any) -> Any:
    perm = ctx.attr("perm")
    return jnp.transpose(x, perm if perm else None)


def _axes(ctx: Ctx, since: int, i: int = 1) -> list[int] | None:
    """Axes: an attribute before opset ``since``, input ``i`` from it on."""
    axes = ctx.static(i) if ctx.opset >= since else ctx.attr("axes")
    return None if axes is None else _ints(axes)


@op("Squeeze", static=(1,))
def squeeze(ctx: Ctx, x: Any, axes: Any = None) -> Any:
    axes = _axes(ctx, 13)
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    return jnp.squeeze(x, tuple(_axis(a, x.ndim) for a in axes))


@op("Unsqueeze", static=(1,))
def unsqueeze(ctx: Ctx, x: Any, axes: Any = None) -> Any:
    axes = _axes(ctx, 13) or []
    rank = jnp.ndim(x) + len(axes)
    return jnp.expand_dims(x, tuple(sorted(_axis(a, rank) for a in axes)))


@op("Concat")
def concat(ctx: Ctx, *xs: Any) -> Any:
    axis = ctx.attr("axis", 1 if ctx.opset < 4 else 0)
    return jnp.concatenate([jnp.asarray(x) for x in xs], _axis(axis, jnp.ndim(xs[0])))


@op("Split", static=(1,))
def split(ctx: Ctx, x: Any, sizes: Any = None) -> Any:
    axis = _axis(ctx.attr("axis", 0), x.ndim)
    dim, count = x.shape[axis], len(ctx.outputs)
    sizes = _ints(ctx.static(1)) if ctx.opset >= 13 and ctx.has_input(1) else ctx.attr("split")
    if not sizes:
        if ctx.attr("num_outputs") is not None:
            chunk = -(-dim // ctx.attr("num_outputs"))
            sizes = [chunk] * (count - 1) + [dim - chunk * (count - 1)]
        else:
            sizes = [dim // count] * count
    return tuple(jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis))


def _slice(start: int, end: int, step: int, dim: int) -> slice:
    """ONNX's clamping rules as a Python slice."""
    if step == 0:
        raise NotSupported("Slice step 0")
    start, end = (start + dim if start < 0 else start), (end + dim if end < 0 else end)
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return slice(start, None if end < 0 else end, step)


@op("Slice", static=(1, 2, 3, 4))
def slice_(ctx: Ctx, x: Any, *rest: Any) -> Any:
    if ctx.opset < 10:
        starts, ends, axes, steps = (ctx.attr(n) for n in ("starts", "ends", "axes", "steps"))
    else:
        starts, ends, axes, steps = (None if ctx.static(i) is None else _ints(ctx.static(i))
                                     for i in (1, 2, 3, 4))
    axes = range(len(starts)) if axes is None else [_axis(a, x.ndim) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * x.ndim
    for axis, start, end, step in zip(axes, starts, ends, steps, strict=True):
        index[axis] = _slice(start, end, step, x.shape[axis])
    return x[tuple(index)]


@op("Expand", static=(1,))
def expand(ctx: Ctx, x: Any, shape: Any) -> Any:
    x = jnp.asarray(x)
    return jnp.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(_ints(ctx.static(1)))))


@op("Tile", static=(1,))
def tile(ctx: Ctx, x: Any, repeats: Any) -> Any:
    return jnp.tile(x, _ints(ctx.static(1)))


@op("Pad", static=(1, 3), check=_one_of("mode", "constant", "constant", "reflect", "edge",
                                        "wrap"))
def pad(ctx: Ctx, x: Any, pads: Any = None, value: Any = None, axes: Any = None) -> Any:
    if ctx.opset < 11:
        pads, value = ctx.attr("pads", ctx.attr("paddings")), ctx.attr("value", 0.0)
        axes = None
    else:
        pads, axes = _ints(ctx.static(1)), ctx.static(3)
    axes = range(x.ndim) if axes is None else [_axis(a, x.ndim) for a in _ints(axes)]
    widths = [(0, 0)] * x.ndim
    for i, axis in enumerate(axes):
        widths[axis] = (pads[i], pads[i + len(axes)])
    x = x[tuple(slice(max(-lo, 0), dim - max(-hi, 0))
                for (lo, hi), dim in zip(widths, x.shape, strict=True))]
    widths = [(max(lo, 0), max(hi, 0)) for lo, hi in widths]
    mode = ctx.attr("mode", "constant")
    if mode != "constant":
        return jnp.pad(x, widths, mode=mode)
    fill = jnp.zeros((), x.dtype) if value is None else jnp.asarray(value).reshape(()).astype(
        x.dtype)
    return jnp.pad(x, widths, constant_values=fill)


@op("DepthToSpace", check=_one_of("mode", "DCR", "DCR", "CRD"))
def depth_to_space(ctx: Ctx, x: Any) -> Any:
    b, (n, c, h, w) = ctx.attr("blocksize"), x.shape
    if ctx.attr("mode", "DCR") == "DCR":
        y = x.reshape(n, b, b, c // b // b, h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // b // b, b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return y.reshape(n, c // b // b, h * b, w * b)


@op("SpaceToDepth", check=_one_of("mode", "DCR", "DCR", "CRD"))
def space_to_depth(ctx: Ctx, x: Any) -> Any:
    b, (n, c, h, w) = ctx.attr("blocksize"), x.shape
    order = (0, 3, 5, 1, 2, 4) if ctx.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
    y = x.reshape(n, c, h // b, b, w // b, b).transpose(order)
    return y.reshape(n, c * b * b, h // b, w // b)


@op("Trilu", static=(1,))
def trilu(ctx: Ctx, x: Any, k: Any = None) -> Any:
    k = 0 if ctx.static(1) is None else int(_scalar(ctx.static(1)))
    return jnp.triu(x, k) if ctx.attr("upper", 1) else jnp.tril(x, k)


# -- indexing -----------------------------------------------------------------------------------

@op("Gather")
def gather(ctx: Ctx, x: Any, indices: Any) -> Any:
    axis = _axis(ctx.attr("axis", 0), jnp.ndim(x))
    return jnp.take(x, _nonneg(jnp.asarray(indices), jnp.shape(x)[axis]), axis=axis,
                    mode="clip")


@op("GatherElements")
def gather_elements(ctx: Ctx, x: Any, indices: Any) -> Any:
    axis = _axis(ctx.attr("axis", 0), x.ndim)
    return jnp.take_along_axis(x, _nonneg(indices, x.shape[axis]), axis=axis, mode="clip")


def _batched(data: Any, indices: Any, batch_dims: int) -> tuple[Any, Any, tuple[Any, ...]]:
    """GatherND / ScatterND's leading batch dimensions flattened to one, and the index tuple."""
    batch = math.prod(data.shape[:batch_dims])
    data = data.reshape((batch,) + data.shape[batch_dims:])
    indices = indices.reshape((batch,) + indices.shape[batch_dims:])
    rows = jnp.arange(batch).reshape((batch,) + (1,) * (indices.ndim - 2))
    index = tuple(_nonneg(indices[..., j], data.shape[1 + j]) for j in range(indices.shape[-1]))
    return data, indices, (rows, *index)


@op("GatherND")
def gather_nd(ctx: Ctx, data: Any, indices: Any) -> Any:
    b = ctx.attr("batch_dims", 0)
    flat, idx, index = _batched(data, indices, b)
    out = flat[index]
    return out.reshape(data.shape[:b] + indices.shape[b:-1] + data.shape[b + idx.shape[-1]:])


_SCATTER = ("none", "add", "mul", "max", "min")


def _scatter(target: Any, reduction: str, updates: Any) -> Any:
    method = {"none": "set", "add": "add", "mul": "multiply", "max": "max", "min": "min"}
    return getattr(target, method[reduction])(updates)


@op("ScatterElements", "Scatter", check=_one_of("reduction", "none", *_SCATTER))
def scatter_elements(ctx: Ctx, data: Any, indices: Any, updates: Any) -> Any:
    axis = _axis(ctx.attr("axis", 0), data.ndim)
    big, small = jnp.shape(updates), jnp.shape(indices)
    if len(big) == len(small) and big != small and all(
            u >= i for u, i in zip(big, small, strict=True)):
        # larger updates: their leading block of the indices' shape (PopART, as torch)
        updates = updates[tuple(slice(0, n) for n in jnp.shape(indices))]
    grid = list(jnp.indices(indices.shape, sparse=True))
    grid[axis] = _nonneg(indices, data.shape[axis])
    return _scatter(jnp.asarray(data).at[tuple(grid)], ctx.attr("reduction", "none"), updates)


@op("ScatterND", check=_one_of("reduction", "none", *_SCATTER))
def scatter_nd(ctx: Ctx, data: Any, indices: Any, updates: Any) -> Any:
    index = tuple(_nonneg(indices[..., j], data.shape[j]) for j in range(indices.shape[-1]))
    return _scatter(jnp.asarray(data).at[index], ctx.attr("reduction", "none"), updates)


@op("OneHot", static=(1,))
def one_hot(ctx: Ctx, indices: Any, depth: Any, values: Any) -> Any:
    depth = int(_scalar(ctx.static(1)))
    indices = jnp.asarray(indices)
    indices = _nonneg(indices.astype(_int64()) if _is_float(indices) else indices, depth)
    axis = _axis(ctx.attr("axis", -1), indices.ndim + 1)
    classes = jnp.arange(depth).reshape((depth,) + (1,) * (indices.ndim - axis))
    hot = jnp.expand_dims(indices, axis) == classes
    return jnp.where(hot, values[1], values[0])


@op("ReverseSequence")
def reverse_sequence(ctx: Ctx, x: Any, lengths: Any) -> Any:
    time, batch = ctx.attr("time_axis", 0), ctx.attr("batch_axis", 1)
    shape = [1] * x.ndim
    shape[time] = x.shape[time]
    t = jnp.arange(x.shape[time]).reshape(shape)
    shape = [1] * x.ndim
    shape[batch] = x.shape[batch]
    n = lengths.reshape(shape).astype(t.dtype)
    source = jnp.broadcast_to(jnp.where(t < n, n - 1 - t, t), x.shape)
    return jnp.take_along_axis(x, source, axis=time)


@op("TopK", static=(1,))
def top_k(ctx: Ctx, x: Any, k: Any = None) -> Any:
    k = int(_scalar(ctx.static(1))) if ctx.opset >= 10 else ctx.attr("k")
    axis = _axis(ctx.attr("axis", -1), x.ndim)
    moved = jnp.moveaxis(x, axis, -1)
    key = moved
    if not ctx.attr("largest", 1):  # smallest first, ties still by lowest index
        key = -moved if _is_float(moved) else ~moved
    _, idx = lax.top_k(key, k)
    values = jnp.take_along_axis(moved, idx, axis=-1)
    return jnp.moveaxis(values, -1, axis), jnp.moveaxis(idx.astype(_int64()), -1, axis)


def _arg(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(ctx: Ctx, x: Any) -> Any:
        axis = _axis(ctx.attr("axis", 0), x.ndim)
        if ctx.attr("select_last_index", 0):
            y = x.shape[axis] - 1 - fn(jnp.flip(x, axis), axis=axis)
        else:
            y = fn(x, axis=axis)
        y = y.astype(_int64())
        return jnp.expand_dims(y, axis) if ctx.attr("keepdims", 1) else y
    return run


op("ArgMax")(_arg(jnp.argmax))
op("ArgMin")(_arg(jnp.argmin))


def _cumulative(fn: Callable[..., Any], identity: int) -> Callable[..., Any]:
    def run(ctx: Ctx, x: Any, axis: Any) -> Any:
        axis = _axis(_scalar(ctx.static(1)), x.ndim)
        if ctx.attr("reverse", 0):
            x = jnp.flip(x, axis)
        y = fn(x, axis=axis, dtype=x.dtype)
        if ctx.attr("exclusive", 0):
            first = jnp.full_like(lax.slice_in_dim(x, 0, 1, axis=axis), identity)
            y = jnp.concatenate([first, lax.slice_in_dim(y, 0, x.shape[axis] - 1, axis=axis)],
                                axis)
        return jnp.flip(y, axis) if ctx.attr("reverse", 0) else y
    return run


op("CumSum", static=(1,))(_cumulative(jnp.cumsum, 0))
op("CumProd", static=(1,))(_cumulative(jnp.cumprod, 1))


# -- reductions ---------------------------------------------------------------------------------

def _lowest(dtype: Any) -> Any:
    if jnp.issubdtype(dtype, jnp.inexact):
        return -jnp.inf
    return False if dtype == jnp.bool_ else jnp.iinfo(dtype).min


def _highest(dtype: Any) -> Any:
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.inf
    return True if dtype == jnp.bool_ else jnp.iinfo(dtype).max


def _log_sum_exp(x: Any, axes: Any, keepdims: bool) -> Any:
    top = lax.stop_gradient(jnp.max(x, axes, keepdims=True, initial=-jnp.inf))
    top = jnp.where(jnp.isfinite(top), top, jnp.zeros((), x.dtype))
    out = jnp.log(jnp.sum(jnp.exp(x - top), axes, keepdims=True)) + top
    return out if keepdims else jnp.squeeze(out, axes)


_REDUCE: dict[str, tuple[int, Callable[[Any, Any, bool], Any]]] = {
    # op: (opset from which axes are an input, f(x, axes, keepdims))
    "ReduceSum": (13, lambda x, a, k: jnp.sum(x, a, keepdims=k, dtype=x.dtype)),
    "ReduceMean": (18, lambda x, a, k: jnp.mean(x, a, keepdims=k)),
    "ReduceProd": (18, lambda x, a, k: jnp.prod(x, a, keepdims=k, dtype=x.dtype)),
    "ReduceMax": (18, _extreme(True)),  # PopART's gradient: see _popart_reduce_extreme
    "ReduceMin": (18, _extreme(False)),
    "ReduceL1": (18, lambda x, a, k: jnp.sum(_popart_abs(x), a, keepdims=k, dtype=x.dtype)),
    "ReduceL2": (18, lambda x, a, k: jnp.sqrt(jnp.sum(x * x, a, keepdims=k))),
    "ReduceSumSquare": (18, lambda x, a, k: jnp.sum(x * x, a, keepdims=k, dtype=x.dtype)),
    "ReduceLogSum": (18, lambda x, a, k: jnp.log(jnp.sum(x, a, keepdims=k))),
    "ReduceLogSumExp": (18, _log_sum_exp),
}


def _reduce(since: int, fn: Callable[[Any, Any, bool], Any]) -> Callable[..., Any]:
    def run(ctx: Ctx, x: Any, axes: Any = None) -> Any:
        axes = _axes(ctx, since)
        if axes == [] and ctx.opset < since:  # PopART's ReduceOp: an explicit empty axes
            return fn(x, (), False).astype(x.dtype)  # attribute reduces nothing (ReduceL1: |x|)
        if not axes:
            if ctx.opset >= since and ctx.attr("noop_with_empty_axes", 0):
                return x
            axes = range(x.ndim)
        axes = tuple(sorted({_axis(a, x.ndim) for a in axes}))
        return fn(x, axes, bool(ctx.attr("keepdims", 1))).astype(x.dtype)
    return run


for _name, (_since, _fn) in _REDUCE.items():
    op(_name, static=(1,))(_reduce(_since, _fn))


# -- matrix products ----------------------------------------------------------------------------

_PARTIALS: ContextVar[str | None] = ContextVar("partials", default=None)
_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


@contextlib.contextmanager
def partials(kind: str | None) -> Iterator[None]:
    """While tracing under it, half-precision matrix products and convolutions accumulate in
    float32 (``"float"``, PopART's partialsType float) or in their own type (``"half"``);
    ``None`` leaves it to XLA. The result keeps the inputs' type either way."""
    token = _PARTIALS.set(kind)
    try:
        yield
    finally:
        _PARTIALS.reset(token)


# PopART's per-node partials (Builder.setPartialsType): the ops whose creators read it
# (willow/src/op/matmul.cpp, convbase.cpp MultiConvOptions for Conv and ConvTranspose).
_PARTIALS_ATTRIBUTE = "__partials_type"
_PARTIALS_OPS = ("MatMul", "Conv", "ConvTranspose")


def node_partials(node: NodeProto) -> str | None:
    """The partials type a node carries (``__partials_type``, as Builder.setPartialsType
    writes it), lower-cased for :func:`partials`; None when it has none or is not a MatMul,
    Conv or ConvTranspose. NotSupported, with PopART's error, for another type than float or
    half."""
    if node.op_type not in _PARTIALS_OPS:
        return None
    for attribute in node.attribute:
        if attribute.name != _PARTIALS_ATTRIBUTE:
            continue
        if attribute.type != AttributeProto.STRING:
            raise NotSupported(f"attribute {_PARTIALS_ATTRIBUTE} must be a STRING (float or "
                               f"half)")
        given = attribute.s.decode("utf-8", "replace")
        kind = given.lower()
        if kind in ("float", "half"):
            return kind
        if node.op_type == "MatMul":
            raise NotSupported(f"Unable to get option 'partialsTypeMatMul' from string "
                               f"'{given}'. Possible values are 'float' and 'half' in any "
                               f"letter case.")
        raise NotSupported(f"Bad partialsType '{kind}'")
    return None


def _accumulator(x: Any) -> Any:
    """The preferred_element_type of a product of ``x`` under :func:`partials`."""
    kind = _PARTIALS.get()
    if kind is None or np.dtype(x.dtype) not in _HALF:
        return None
    return jnp.float32 if kind == "float" else x.dtype


def _product(a: Any, b: Any) -> Any:
    accumulator = _accumulator(a)
    if accumulator is None:
        return jnp.matmul(a, b)
    return jnp.matmul(a, b, preferred_element_type=accumulator).astype(a.dtype)


@op("MatMul")
def matmul(ctx: Ctx, a: Any, b: Any) -> Any:
    return _product(a, b)


@op("Gemm")
def gemm(ctx: Ctx, a: Any, b: Any, c: Any = None) -> Any:
    a = a.T if ctx.attr("transA", 0) else a
    b = b.T if ctx.attr("transB", 0) else b
    y = _product(a, b)
    if ctx.attr("alpha", 1.0) != 1.0:
        y = (ctx.attr("alpha", 1.0) * y).astype(y.dtype)
    if c is not None:
        beta = ctx.attr("beta", 1.0)
        y = y + (c if beta == 1.0 else (beta * c).astype(c.dtype))
    return y


@op("Einsum")
def einsum(ctx: Ctx, *xs: Any) -> Any:
    return jnp.einsum(ctx.attr("equation").replace(" ", ""), *xs)


@op("Det")
def det(ctx: Ctx, x: Any) -> Any:
    return jnp.linalg.det(x)


# -- convolution and pooling --------------------------------------------------------------------

def _auto_pads(auto_pad: str, size: Sequence[int], window: Sequence[int],
               strides: Sequence[int]) -> list[tuple[int, int]]:
    """SAME_UPPER / SAME_LOWER: ceil(size / stride) outputs, the odd pad at the end / start."""
    pads = []
    for n, w, s in zip(size, window, strides, strict=True):
        total = max((-(-n // s) - 1) * s + w - n, 0)
        small, large = total // 2, total - total // 2
        pads.append((small, large) if auto_pad == "SAME_UPPER" else (large, small))
    return pads


def _geometry(ctx: Ctx, size: Sequence[int], kernel: Sequence[int]
              ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Strides, dilations and (begin, end) pads of a convolution or pooling window."""
    n = len(size)
    strides = list(ctx.attr("strides") or [1] * n)
    dilations = list(ctx.attr("dilations") or [1] * n)
    window = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = _auto_pads(auto_pad, size, window, strides)
    elif auto_pad == "VALID":
        pads = [(0, 0)] * n
    else:
        flat = list(ctx.attr("pads") or [0] * 2 * n)
        pads = list(zip(flat[:n], flat[n:], strict=True))
    return strides, dilations, pads


def _channel_bias(y: Any, b: Any) -> Any:
    return y if b is None else y + b.reshape((-1,) + (1,) * (y.ndim - 2))


def _pool_geometry(ctx: Ctx, x: Any) -> tuple[list[int], list[int], list[int],
                                              list[tuple[int, int]], list[int]]:
    """Kernel, strides, dilations, explicit pads and the extra end padding ceil_mode needs."""
    kernel = list(ctx.attr("kernel_shape"))
    size = x.shape[2:]
    strides, dilations, pads = _geometry(ctx, size, kernel)
    extra = [0] * len(size)
    if ctx.attr("ceil_mode", 0) and ctx.attr("auto_pad", "NOTSET") == "NOTSET":
        for i, (n, k, s, d, (lo, hi)) in enumerate(zip(size, kernel, strides, dilations, pads,
                                                       strict=True)):
            window = (k - 1) * d + 1
            out = -(-(n + lo + hi - window) // s) + 1
            if (out - 1) * s >= n + lo:  # the last window must start inside
                out -= 1
            extra[i] = max((out - 1) * s + window - (n + lo + hi), 0)
    return kernel, strides, dilations, pads, extra


def _reduce_window(x: Any, init: Any, fn: Callable[..., Any], kernel: Sequence[int],
                   strides: Sequence[int], dilations: Sequence[int],
                   pads: Sequence[tuple[int, int]]) -> Any:
    return lax.reduce_window(x, init, fn, (1, 1, *kernel), (1, 1, *strides),
                             [(0, 0), (0, 0), *pads], window_dilation=(1, 1, *dilations))


def _counts(size: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
            dilations: Sequence[int], pads: Sequence[tuple[int, int]],
            extra: Sequence[int], include_pad: bool) -> np.ndarray:
    """How many window positions fall inside the input (or inside its explicit padding)."""
    counts = np.ones((), np.float64)
    for n, k, s, d, (lo, hi), e in zip(size, kernel, strides, dilations, pads, extra,
                                       strict=True):
        outs = (n + lo + hi + e - (k - 1) * d - 1) // s + 1
        pos = np.arange(outs)[:, None] * s + np.arange(k)[None, :] * d - lo
        inside = (pos >= -lo) & (pos < n + hi) if include_pad else (pos >= 0) & (pos < n)
        counts = np.multiply.outer(counts, inside.sum(1))
    return counts


@op("AveragePool", check=_check_auto_pad)
def average_pool(ctx: Ctx, x: Any) -> Any:
    kernel, strides, dilations, pads, extra = _pool_geometry(ctx, x)
    padded = [(lo, hi + e) for (lo, hi), e in zip(pads, extra, strict=True)]
    total = _reduce_window(x, np.zeros((), x.dtype), lax.add, kernel, strides, dilations,
                           padded)
    counts = _counts(x.shape[2:], kernel, strides, dilations, pads, extra,
                     bool(ctx.attr("count_include_pad", 0)))
    return (total / counts.astype(np.float32)).astype(x.dtype)


@op("LpPool", check=_check_auto_pad)
def lp_pool(ctx: Ctx, x: Any) -> Any:
    kernel, strides, dilations, pads, extra = _pool_geometry(ctx, x)
    padded = [(lo, hi + e) for (lo, hi), e in zip(pads, extra, strict=True)]
    p = ctx.attr("p", 2)
    total = _reduce_window(jnp.abs(x) ** p, np.zeros((), x.dtype), lax.add, kernel, strides,
                           dilations, padded)
    return (total ** (1.0 / p)).astype(x.dtype)


def _windows(x: Any, kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int],
             pads: Sequence[tuple[int, int]], extra: Sequence[int],
             flat_strides: Sequence[int]) -> tuple[Any, np.ndarray]:
    """Every pooling window's values, ``[N, C, *out, K]`` (the lowest value outside the
    input), and each value's flat position in its channel, ``[*out, K]``."""
    n = len(kernel)
    index, inside, flat = [], np.ones((), bool), np.zeros((), np.int64)
    for i, (size, k, s, d, (lo, hi), e) in enumerate(zip(x.shape[2:], kernel, strides,
                                                         dilations, pads, extra, strict=True)):
        outs = (size + lo + hi + e - (k - 1) * d - 1) // s + 1
        pos = np.arange(outs)[:, None] * s + np.arange(k)[None, :] * d - lo
        shape = [1] * 2 * n
        shape[i], shape[n + i] = outs, k
        index.append(np.clip(pos, 0, size - 1).reshape(shape))
        inside = inside & ((pos >= 0) & (pos < size)).reshape(shape)
        flat = flat + index[-1] * flat_strides[i]
    values = jnp.where(inside, x[(slice(None), slice(None), *index)], _lowest(x.dtype))
    out = values.shape[2:2 + n]
    return values.reshape((*values.shape[:2 + n], -1)), flat.reshape((*out, -1))


#: The most window taps a max pool takes as a maximum of strided slices (:func:`_sliced_max`).
SLICED_MAX_TAPS = 16


def _sliced_max(x: Any, kernel: Sequence[int], strides: Sequence[int],
                dilations: Sequence[int], pads: Sequence[tuple[int, int]]) -> Any:
    """The max pool of :func:`_reduce_window` as the elementwise maximum of one strided slice
    of the padded input per window tap: the same values (a maximum is exact), one fused pass
    where XLA:CPU runs reduce_window as a slow loop (2x2 stride 2 at 32x16x32x32: 2.7x). Its
    gradient is reduce_window's (a custom_vjp), ties included."""
    lowest = np.asarray(_lowest(x.dtype), x.dtype)

    def windowed(v: Any) -> Any:
        return _reduce_window(v, lowest, lax.max, kernel, strides, dilations, pads)

    @jax.custom_vjp
    def sliced(v: Any) -> Any:
        padded = jnp.pad(v, [(0, 0), (0, 0), *pads], constant_values=lowest)
        outs = [(n - (k - 1) * d - 1) // s + 1 for n, k, s, d
                in zip(padded.shape[2:], kernel, strides, dilations, strict=True)]
        out = None
        for taps in itertools.product(*(range(k) for k in kernel)):
            start = [t * d for t, d in zip(taps, dilations, strict=True)]
            part = lax.slice(padded, (0, 0, *start),
                             (*padded.shape[:2], *(b + (o - 1) * s + 1 for b, o, s
                                                   in zip(start, outs, strides, strict=True))),
                             (1, 1, *strides))
            out = part if out is None else jnp.maximum(out, part)
        return out

    sliced.defvjp(lambda v: (sliced(v), v), lambda v, g: jax.vjp(windowed, v)[1](g))
    return sliced(x)


@op("MaxPool", check=_checks(_check_auto_pad, _one_of("storage_order", 0, 0, 1)))
def max_pool(ctx: Ctx, x: Any) -> Any:
    kernel, strides, dilations, pads, extra = _pool_geometry(ctx, x)
    if not ctx.wants(1):
        padded = [(lo, hi + e) for (lo, hi), e in zip(pads, extra, strict=True)]
        if math.prod(kernel) <= SLICED_MAX_TAPS and all(n > 0 for n in x.shape):
            return _sliced_max(x, kernel, strides, dilations, padded)
        return _reduce_window(x, np.asarray(_lowest(x.dtype), x.dtype), lax.max, kernel,
                              strides, dilations, padded)
    size = x.shape[2:]
    if ctx.attr("storage_order", 0):  # column-major: the first spatial axis varies fastest
        flat_strides = [math.prod(size[:i]) for i in range(len(size))]
    else:
        flat_strides = [math.prod(size[i + 1:]) for i in range(len(size))]
    values, flat = _windows(x, kernel, strides, dilations, pads, extra, flat_strides)
    best = jnp.argmax(values, axis=-1)[..., None]
    within = jnp.take_along_axis(jnp.broadcast_to(flat, values.shape), best, axis=-1)[..., 0]
    channel = jnp.arange(x.shape[0] * x.shape[1]).reshape(x.shape[:2] + (1,) * len(size))
    indices = (channel * math.prod(size) + within).astype(_int64())
    return jnp.max(values, axis=-1), indices


@op("GlobalAveragePool")
def global_average_pool(ctx: Ctx, x: Any) -> Any:
    return jnp.mean(x, tuple(range(2, x.ndim)), keepdims=True)


@op("GlobalMaxPool")
def global_max_pool(ctx: Ctx, x: Any) -> Any:
    return jnp.max(x, tuple(range(2, x.ndim)), keepdims=True)


@op("LRN")
def lrn(ctx: Ctx, x: Any) -> Any:
    size = ctx.attr("size")
    alpha, beta, bias = ctx.attr("alpha", 1e-4), ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    window = (1, size) + (1,) * (x.ndim - 2)
    pads = [(0, 0), ((size - 1) // 2, size - 1 - (size - 1) // 2)] + [(0, 0)] * (x.ndim - 2)
    square_sum = lax.reduce_window(x * x, np.zeros((), x.dtype), lax.add, window,
                                   (1,) * x.ndim, pads)
    return x / (bias + alpha / size * square_sum) ** beta


# -- normalisation ------------------------------------------------------------------------------

def _batch_norm_training(ctx: Ctx) -> bool:
    if ctx.opset >= 14:
        return bool(ctx.attr("training_mode", 0))
    if ctx.opset < 7 and "is_test" in ctx.attrs:
        return not ctx.attr("is_test")
    return any(ctx.wants(i) for i in range(1, len(ctx.outputs)))


@op("BatchNormalization")
def batch_norm(ctx: Ctx, x: Any, scale: Any, bias: Any, mean: Any, var: Any) -> Any:
    """ONNX's BatchNormalization as PopART computes it (batchnormx.cpp). ``spatial=0``
    (opsets before 9) normalises each element of a sample over the batch: scale, B, mean and
    var have X's shape but the first dimension, and X is normalised as ``[N, C*D1*...*Dn, 1]``
    with spatial statistics."""
    if ctx.opset < 9 and not ctx.attr("spatial", 1):
        features = math.prod(x.shape[1:])
        outs = _batch_norm_spatial(ctx, x.reshape(x.shape[0], features, 1),
                                   *(t.reshape(features) for t in (scale, bias, mean, var)))
        return (outs[0].reshape(x.shape), *(t.reshape(scale.shape) for t in outs[1:]))
    return _batch_norm_spatial(ctx, x, scale, bias, mean, var)


def _batch_norm_spatial(ctx: Ctx, x: Any, scale: Any, bias: Any, mean: Any, var: Any
                        ) -> tuple[Any, ...]:
    eps = ctx.attr("epsilon", 1e-5)
    shape = (1, -1) + (1,) * (x.ndim - 2)

    def normalise(m: Any, v: Any) -> Any:
        y = (x - m.reshape(shape)) / jnp.sqrt(v.reshape(shape) + eps)
        return (y * scale.reshape(shape) + bias.reshape(shape)).astype(x.dtype)

    if not _batch_norm_training(ctx):
        return normalise(mean, var), mean, var
    axes = (0,) + tuple(range(2, x.ndim))
    batch_mean, batch_var = jnp.mean(x, axes), jnp.var(x, axes)
    momentum = ctx.attr("momentum", 0.9)
    running_mean = (mean * momentum + batch_mean * (1 - momentum)).astype(mean.dtype)
    running_var = (var * momentum + batch_var * (1 - momentum)).astype(var.dtype)
    return normalise(batch_mean, batch_var), running_mean, running_var, batch_mean, batch_var


@op("InstanceNormalization")
def instance_norm(ctx: Ctx, x: Any, scale: Any, bias: Any) -> Any:
    axes = tuple(range(2, x.ndim))
    m, v = jnp.mean(x, axes, keepdims=True), jnp.var(x, axes, keepdims=True)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    y = (x - m) / jnp.sqrt(v + ctx.attr("epsilon", 1e-5))
    return y * scale.reshape(shape) + bias.reshape(shape)


def _stash(ctx: Ctx) -> np.dtype:
    return _canon(np_dtype(ctx.attr("stash_type", TensorProto.FLOAT)))


_check_stash = _checks(_check_dtype("stash_type", TensorProto.FLOAT))


@op("LayerNormalization", check=_check_stash)
def layer_norm(ctx: Ctx, x: Any, scale: Any, bias: Any = None) -> Any:
    axis = _axis(ctx.attr("axis", -1), x.ndim)
    axes = tuple(range(axis, x.ndim))
    xs = x.astype(_stash(ctx))
    m = jnp.mean(xs, axes, keepdims=True)
    inv = lax.rsqrt(jnp.mean(jnp.square(xs - m), axes, keepdims=True) + ctx.attr("epsilon", 1e-5))
    y = (xs - m) * inv * scale
    y = (y if bias is None else y + bias).astype(x.dtype)
    return y, m, inv


@op("RMSNormalization", check=_check_stash)
def rms_norm(ctx: Ctx, x: Any, scale: Any) -> Any:
    axes = tuple(range(_axis(ctx.attr("axis", -1), x.ndim), x.ndim))
    xs = x.astype(_stash(ctx))
    inv = lax.rsqrt(jnp.mean(jnp.square(xs), axes, keepdims=True) + ctx.attr("epsilon", 1e-5))
    return (xs * inv * scale).astype(x.dtype)


@op("GroupNormalization", check=_check_stash)
def group_norm(ctx: Ctx, x: Any, scale: Any, bias: Any) -> Any:
    groups, (n, c) = ctx.attr("num_groups"), x.shape[:2]
    xs = x.astype(_stash(ctx)).reshape((n, groups, -1))
    m = jnp.mean(xs, -1, keepdims=True)
    y = (xs - m) * lax.rsqrt(jnp.var(xs, -1, keepdims=True) + ctx.attr("epsilon", 1e-5))
    y = y.reshape(x.shape).astype(x.dtype)
    if scale.shape[0] != c:  # opset 18: one scale and bias per group
        scale, bias = jnp.repeat(scale, c // groups), jnp.repeat(bias, c // groups)
    return _channel_bias(y * scale.reshape((-1,) + (1,) * (x.ndim - 2)), bias)


@op("LpNormalization", check=_one_of("p", 2, 1, 2))
def lp_norm(ctx: Ctx, x: Any) -> Any:
    axis = _axis(ctx.attr("axis", -1), x.ndim)
    if ctx.attr("p", 2) == 1:
        norm = jnp.sum(jnp.abs(x), axis, keepdims=True)
    else:
        norm = jnp.sqrt(jnp.sum(x * x, axis, keepdims=True))
    return jnp.where(norm == 0, jnp.zeros((), x.dtype), x / jnp.where(norm == 0, 1, norm))


@op("MeanVarianceNormalization")
def mean_variance_norm(ctx: Ctx, x: Any) -> Any:
    axes = tuple(_axis(a, x.ndim) for a in ctx.attr("axes", [0, 2, 3]))
    m = jnp.mean(x, axes, keepdims=True)
    return (x - m) / (jnp.sqrt(jnp.mean(jnp.square(x - m), axes, keepdims=True)) + 1e-9)


# -- losses -------------------------------------------------------------------------------------

def _nll(x: Any, target: Any, weight: Any, ignore: int | None, reduction: str) -> Any:
    """ai.onnx NegativeLogLikelihoodLoss: classes on axis 1."""
    mask = jnp.ones(target.shape, bool) if ignore is None else target != ignore
    safe = jnp.where(mask, target, 0)
    picked = -jnp.take_along_axis(x, jnp.expand_dims(safe, 1), axis=1, mode="clip")[:, 0]
    w = mask.astype(x.dtype) if weight is None else jnp.where(mask, weight[safe], 0)
    loss = picked * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    return (jnp.sum(loss) / jnp.sum(w)).astype(x.dtype)


_check_reduction = _one_of("reduction", "mean", "none", "sum", "mean")


@op("NegativeLogLikelihoodLoss", check=_check_reduction)
def nll_loss(ctx: Ctx, x: Any, target: Any, weight: Any = None) -> Any:
    return _nll(x, target, weight, ctx.attr("ignore_index"), ctx.attr("reduction", "mean"))


@op("SoftmaxCrossEntropyLoss", check=_check_reduction)
def softmax_cross_entropy(ctx: Ctx, scores: Any, labels: Any, weight: Any = None) -> Any:
    log_prob = jax.nn.log_softmax(scores, axis=1)
    loss = _nll(log_prob, labels, weight, ctx.attr("ignore_index"),
                ctx.attr("reduction", "mean"))
    return loss, log_prob


# -- ai.graphcore -------------------------------------------------------------------------------

_check_popart_reduction = _one_of("reduction", "Mean", "Sum", "Mean", "None")


def _popart_reduce(ctx: Ctx, loss: Any, count: Any = None) -> Any:
    reduction = ctx.attr("reduction", "Mean")
    if reduction == "None":
        return loss
    # accumulated in float32 at least (popops' reductions of float16), then cast back: a
    # float16 sum of many elements would overflow where PopART's does not
    wide = jnp.promote_types(loss.dtype, jnp.float32) if _is_float(loss) else loss.dtype
    total = jnp.sum(loss, dtype=wide)
    if reduction == "Sum":
        return total.astype(loss.dtype)
    return (total / (loss.size if count is None else count)).astype(loss.dtype)


@op("L1", domain=GRAPHCORE, check=_check_popart_reduction)
def l1_loss(ctx: Ctx, x: Any) -> Any:
    return _popart_reduce(ctx, ctx.attr("lambda", 1.0) * _popart_abs(x))  # l1x: grad sign(x)


@op("IdentityLoss", domain=GRAPHCORE, check=_check_popart_reduction)
def identity_loss(ctx: Ctx, x: Any) -> Any:
    return _popart_reduce(ctx, x)


def _nll_eps(dtype: Any, forward: bool) -> float:
    """PopART's Nll clamps (popx/op/nllx.cpp): the forward takes log(max(p, 1e-7)), the
    gradient -1/max(p, 1e-10); in float16 both use 6.104e-5."""
    if np.dtype(dtype) == np.float16:
        return 6.104e-05
    return 1e-7 if forward else 1e-10


@jax.custom_vjp
def _nll_log(p: Any) -> Any:
    """log of a label's probability as PopART's Nll takes it: clamped below, and with
    PopART's gradient 1/max(p, eps) (not the clamp's zero) where p is tiny."""
    return jnp.log(jnp.maximum(p, jnp.asarray(_nll_eps(p.dtype, True), p.dtype)))


def _nll_log_fwd(p: Any) -> tuple[Any, Any]:
    return _nll_log(p), p


def _nll_log_bwd(p: Any, g: Any) -> tuple[Any]:
    return (g / jnp.maximum(p, jnp.asarray(_nll_eps(p.dtype, False), p.dtype)),)


_nll_log.defvjp(_nll_log_fwd, _nll_log_bwd)


def _popart_info(x: Any) -> str:
    """A tensor's type and shape as PopART's TensorInfo prints them: ``FLOAT   [2 4 3]``."""
    name = TensorProto.DataType.Name(helper.np_dtype_to_tensor_dtype(np.dtype(x.dtype)))
    return f"{name:<8}{popart_vector(jnp.shape(x))}"


@op("Nll", domain=GRAPHCORE, check=_check_popart_reduction)
def popart_nll(ctx: Ctx, probs: Any, label: Any, logits: Any = None) -> Any:
    """PopART's Nll: classes on the last axis; ``inputIsLogProbability`` takes -x[label],
    else -log(max(x[label], eps)) with PopART's clamps (:func:`_nll_eps`); ``ignoreIndex``
    labels add 0 and Mean divides by the others. Given the ``logits`` of the Softmax that made
    ``probs`` (over the last axis), the gradient goes to them directly as p - onehot, as
    PopART's default pattern NlllWithSoftmaxGradDirect gives it (finite where the chain rule
    through log is not), and none to ``probs``."""
    if jnp.shape(label) != jnp.shape(probs)[:-1]:  # nll.cpp's check, in its words
        want = popart_vector(jnp.shape(probs)[:-1])
        text = (f"The label tensor ({_popart_info(label)}) must have shape {want} to match "
                f"all but the final dimension of the probabilities tensor "
                f"({_popart_info(probs)}) in Op {ctx.name}.")
        raise PopartRefusal(text, "give one label per row of the probabilities.")
    ignore = ctx.attr("ignoreIndex")
    mask = jnp.ones(label.shape, bool) if ignore is None else label != ignore
    safe = jnp.where(mask, label, 0)
    picked = jnp.take_along_axis(probs, safe[..., None], axis=-1, mode="clip")[..., 0]
    direct = (logits is not None and not ctx.attr("inputIsLogProbability", 0)
              and ctx.attr(SOFTMAX_AXIS) in (-1, probs.ndim - 1)
              and logits.shape == probs.shape)
    if direct:  # PopART's NlllWithSoftmaxGradDirect: d loss / d logits = p - onehot
        value = jax.lax.stop_gradient(probs)
        picked = _nll_log(jax.lax.stop_gradient(picked))
        step = value - jax.nn.one_hot(safe, probs.shape[-1], dtype=probs.dtype)
        carrier = jnp.sum(jax.lax.stop_gradient(step) * logits, axis=-1)
        picked = picked - (carrier - jax.lax.stop_gradient(carrier))
    elif not ctx.attr("inputIsLogProbability", 0):
        picked = _nll_log(picked)
    loss = jnp.where(mask, -picked, jnp.zeros((), probs.dtype))
    count = None if ignore is None else jnp.maximum(jnp.sum(mask), 1).astype(probs.dtype)
    return _popart_reduce(ctx, loss, count)


@op("Gelu", domain=GRAPHCORE)
def popart_gelu(ctx: Ctx, x: Any) -> Any:
    """popnn's GELU (popx/op/gelux.cpp): the tanh approximation; GeluErf is the erf form."""
    return _gelu(x, "tanh")


# -- the other ai.graphcore operators the Builder offers (popart_kit/_model/graphcore/) ---------


@op("Scale", domain=GRAPHCORE)
def popart_scale(ctx: Ctx, x: Any) -> Any:
    return (x * ctx.attr("scale", 1.0)).astype(x.dtype)


@op("ScaledAdd", domain=GRAPHCORE)
def popart_scaled_add(ctx: Ctx, a: Any, b: Any, scale0: Any = None, scale1: Any = None) -> Any:
    s0 = ctx.attr("scale0", 1.0) if scale0 is None else scale0
    s1 = ctx.attr("scale1", 1.0) if scale1 is None else scale1
    return (a * s0 + b * s1).astype(a.dtype)


@op("Detach", domain=GRAPHCORE)
def popart_detach(ctx: Ctx, x: Any) -> Any:
    return lax.stop_gradient(x)


@op("Nop", domain=GRAPHCORE)  # PrintTensor: ops_print
def popart_identity(ctx: Ctx, x: Any) -> Any:
    return x


@op("GeluErf", domain=GRAPHCORE)
def popart_gelu_erf(ctx: Ctx, x: Any) -> Any:
    return _gelu(x)


@op("Swish", domain=GRAPHCORE)
def popart_swish(ctx: Ctx, x: Any) -> Any:
    return x * jax.nn.sigmoid(x)


for _name, _fn in {"Atan2": jnp.arctan2, "Fmod": _popart_fmod, "Remainder": _popart_remainder,
                   "BitwiseAnd": jnp.bitwise_and, "BitwiseOr": jnp.bitwise_or,
                   "BitwiseXor": jnp.bitwise_xor,
                   "BitwiseXnor": lambda a, b: jnp.bitwise_not(jnp.bitwise_xor(a, b))}.items():
    op(_name, domain=GRAPHCORE)(functools.partial(lambda fn, ctx, a, b: fn(a, b), _fn))
for _name, _fn in {"Expm1": jnp.expm1, "Log1p": jnp.log1p, "NearbyInt": jnp.rint,
                   "BitwiseNot": jnp.bitwise_not,
                   # PopART's Round rounds halves away from zero
                   "Round": lambda x: jnp.sign(x) * jnp.floor(jnp.abs(x) + 0.5)}.items():
    op(_name, domain=GRAPHCORE)(functools.partial(lambda fn, ctx, x: fn(x).astype(x.dtype),
                                                  _fn))


@op("IncrementMod", domain=GRAPHCORE)
def popart_increment_mod(ctx: Ctx, x: Any) -> Any:
    return jnp.fmod(x + ctx.attr("increment"), ctx.attr("modulus")).astype(x.dtype)


@op("Reshape", domain=GRAPHCORE)
def popart_reshape(ctx: Ctx, x: Any) -> Any:
    """PopART's ReshapeOp: a 0 takes the input's size at that position, one -1 is inferred."""
    dims = [x.shape[i] if d == 0 else d for i, d in enumerate(ctx.attr("shape"))]
    return jnp.reshape(x, tuple(dims))


@op("Subsample", domain=GRAPHCORE)
def popart_subsample(ctx: Ctx, x: Any) -> Any:
    strides = list(ctx.attr("strides"))
    return x[tuple(slice(None, None, s) for s in strides)]


@op("Reverse", domain=GRAPHCORE)
def popart_reverse(ctx: Ctx, x: Any) -> Any:
    return jnp.flip(x, axis=tuple(ctx.attr("dimensions")))


def _dynamic_starts(ctx: Ctx, x: Any, offset: Any) -> list[Any]:
    starts: list[Any] = [0] * x.ndim
    for i, axis in enumerate(ctx.attr("axes")):
        starts[axis] = jnp.reshape(offset, (-1,))[i].astype(jnp.int32)
    return starts


def _dynamic_sizes(ctx: Ctx, x: Any) -> list[int]:
    sizes = list(x.shape)
    for axis, size in zip(ctx.attr("axes"), ctx.attr("sizes"), strict=True):
        sizes[axis] = size
    return sizes


@op("DynamicSlice", domain=GRAPHCORE)
def popart_dynamic_slice(ctx: Ctx, x: Any, offset: Any, slice_in: Any = None) -> Any:
    """The slice; with PopART's optional third input (the tensor the slice is written into),
    the slice copied into that tensor's shape (its size: a sliced axis of size 1 dropped)."""
    out = lax.dynamic_slice(x, _dynamic_starts(ctx, x, offset), _dynamic_sizes(ctx, x))
    return out if slice_in is None else jnp.reshape(out, jnp.shape(slice_in))


@op("DynamicUpdate", domain=GRAPHCORE)
def popart_dynamic_update(ctx: Ctx, x: Any, offset: Any, update: Any) -> Any:
    """``x`` with the slice at ``offset`` replaced by ``update``, which may leave out a sliced
    axis of size 1 (PopART reshapes it to the slice)."""
    update = jnp.reshape(update, _dynamic_sizes(ctx, x)).astype(x.dtype)
    return lax.dynamic_update_slice(x, update, _dynamic_starts(ctx, x, offset))


@op("DynamicZero", domain=GRAPHCORE)
def popart_dynamic_zero(ctx: Ctx, x: Any, offset: Any, *_: Any) -> Any:
    zeros = jnp.zeros(_dynamic_sizes(ctx, x), x.dtype)
    return lax.dynamic_update_slice(x, zeros, _dynamic_starts(ctx, x, offset))


@op("DynamicAdd", domain=GRAPHCORE)
def popart_dynamic_add(ctx: Ctx, x: Any, offset: Any, update: Any) -> Any:
    starts = _dynamic_starts(ctx, x, offset)
    current = lax.dynamic_slice(x, starts, update.shape)
    return lax.dynamic_update_slice(x, current + update.astype(x.dtype), starts)
