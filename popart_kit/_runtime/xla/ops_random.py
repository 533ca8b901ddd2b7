"""The xla backend's random operators: ai.onnx Dropout, RandomNormal, RandomNormalLike,
RandomUniform, RandomUniformLike and ai.graphcore ShapedDropout.

**Where the randomness comes from.** A session evaluates each micro-batch of each replica
inside :func:`random_scope`, given that evaluation's two 32-bit seed words (the session's
:class:`~.state.RandomSeed` makes them: PopART's seed, moved on for every micro-batch and
offset for every replica) and whether the session trains. Each random node draws from a
threefry key made of those words and folded with its own first output's name, so two random
nodes draw independently, and the same seed gives the same values on every run of the same
model, whatever the chunking, the executor or the pipelining. Control flow folds each call
site (Call) and iteration (Loop) into the words (:func:`random_subscope`), and the lowering
never folds a node that draws (itself or in its subgraphs) into a constant. Evaluated outside
a session (no scope), the words are zeros and nothing trains.

**Semantics** (PopART's willow/src/op and popx/op): Dropout and ShapedDropout drop at random
only in a training session (an inference session runs them as the identity, the mask all
true), keeping each element (ShapedDropout: each element of a mask of its ``shape``,
broadcast over the input) with probability 1 - ratio and scaling what is kept by
1 / (1 - ratio); the ratio must be in [0, 1). Their gradient is masked by the very mask of the
forward (JAX differentiates the same draw). RandomNormal/RandomUniform(Like) draw in both
kinds of session, as FLOAT or FLOAT16 (PopART's only types); a ``seed`` attribute is refused,
as PopART refuses it (the session's seed is the only one). From ai.onnx opset 12, Dropout's
``training_mode`` input, when given, says whether it drops (the session decides otherwise).

**Not bit-exact.** The values are drawn with JAX's threefry generator, not Poplar's: they
follow the same distributions, ratios and scaling, are reproducible from the seed and
independent across nodes, micro-batches, steps and replicas, but they are not the numbers an
IPU draws for the same seed.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
from onnx import TensorProto

from ..._base.problems import popart_vector
from ..._model.popart_types import popart_opid
from .ops import GRAPHCORE, Ctx, NotSupported, PopartRefusal, np_dtype, op

__all__ = ["RANDOM_STREAM", "RANDOM_OPS", "draws_random", "random_scope", "random_subscope",
           "uses_random"]

#: The name of the stream input that carries each micro-batch's seed words, [M, R, 2] uint32
#: (PopART's reserved id of its seed tensor; never a tensor of a model).
RANDOM_STREAM = "randomSeed___"
#: (domain, op type) of every random operator.
RANDOM_OPS = frozenset({("", "Dropout"), ("", "RandomNormal"), ("", "RandomNormalLike"),
                        ("", "RandomUniform"), ("", "RandomUniformLike"),
                        (GRAPHCORE, "ShapedDropout")})
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


@dataclass(frozen=True)
class _Scope:
    words: Any       # uint32[2]: this micro-batch's and replica's seed
    training: bool   # whether Dropout drops


_SCOPE: ContextVar[_Scope | None] = ContextVar("popart_kit_random_scope", default=None)


@contextlib.contextmanager
def random_scope(words: Any, training: bool) -> Iterator[None]:
    """Random nodes evaluated inside draw from ``words`` (uint32[2], traced or not); Dropout
    drops when ``training``."""
    token = _SCOPE.set(_Scope(words, bool(training)))
    try:
        yield
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def random_subscope(tag: Any) -> Iterator[None]:
    """Random nodes evaluated inside draw from the current words folded with ``tag`` (a str:
    a call site's name; an integer, traced or not: a loop's iteration): control flow gives
    each call of a subgraph and each iteration of a loop body values of its own. Outside a
    :func:`random_scope` (a model without random operators) it changes nothing."""
    scope = _SCOPE.get()
    if scope is None:
        yield
        return
    key = jax.random.fold_in(_wrapped(scope.words), _tag(tag))
    token = _SCOPE.set(_Scope(jax.random.key_data(key), scope.training))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def draws_random(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a random operator or has one in its subgraphs (the lowering never
    folds it into a constant)."""
    domain = GRAPHCORE if node.domain == GRAPHCORE else \
        "" if node.domain in ("", "ai.onnx") else node.domain
    return (domain, node.op_type) in RANDOM_OPS or any(
        draws_random(n) for a in node.attribute
        for g in ([a.g] if a.HasField("g") else a.graphs) for n in g.node)


def uses_random(model: onnx.ModelProto) -> bool:
    """Whether any node of ``model`` is a random operator, its subgraphs and functions
    included (PopART's Ir::getRequiresRandomSeed)."""
    return any(draws_random(n) for n in model.graph.node) or any(
        draws_random(n) for f in model.functions for n in f.node)


def _wrapped(words: Any) -> Any:
    words = jnp.zeros((2,), jnp.uint32) if words is None else jnp.asarray(words, jnp.uint32)
    return jax.random.wrap_key_data(words, impl="threefry2x32")


def _tag(tag: Any) -> Any:
    return zlib.crc32(tag.encode()) if isinstance(tag, str) else jnp.asarray(tag, jnp.uint32)


def _key(ctx: Ctx) -> Any:
    """The node's key: the scope's words folded with the node's first output name."""
    scope = _SCOPE.get()
    return jax.random.fold_in(_wrapped(None if scope is None else scope.words),
                              _tag(ctx.outputs[0] or ctx.name))



def _opid(ctx: Ctx) -> str:
    """The operator as PopART names it in messages: domain.type:version."""
    return popart_opid(ctx.op_type, ctx.opset,
                       "ai.graphcore" if ctx.op_type == "ShapedDropout" else "")



def _training() -> bool:
    scope = _SCOPE.get()
    return scope is not None and scope.training


# -- dropout ------------------------------------------------------------------------------------

def _ratio_value(ctx: Ctx) -> float | None:
    """The node's ratio (None when it is an input not known before running)."""
    if ctx.opset >= 12:
        if not ctx.has_input(1):
            return 0.5
        value = ctx.known(1)
        return None if value is None else float(value)
    return float(ctx.attr("ratio", 0.5))


def _check_ratio(ctx: Ctx, ratio: float | None) -> None:
    if ratio is not None and not 0.0 <= ratio < 1.0:
        raise PopartRefusal(f"{_opid(ctx)} ratio value {ratio:g} is not valid. Please use a value "
                       f"in the interval [0,1)", "give a ratio of at least 0 and below 1.")


def _check_dropout(ctx: Ctx) -> None:
    _check_ratio(ctx, _ratio_value(ctx))


def _drops(ctx: Ctx) -> bool:
    """Whether this Dropout drops: ``training_mode`` where given (opset 12 on), else
    ``is_test`` (opsets 1-6) or the session."""
    if ctx.opset >= 12 and ctx.has_input(2):
        return bool(ctx.static(2))
    if ctx.opset < 7 and ctx.attr("is_test", 0):
        return False
    return _training()


def _dropped(ctx: Ctx, x: Any, ratio: float, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """x times a mask of ``shape`` (broadcast) keeping each element with probability
    1 - ratio, scaled by 1 / (1 - ratio); and the mask."""
    keep = jax.random.bernoulli(_key(ctx), 1.0 - ratio, shape)
    scale = jnp.asarray(1.0 / (1.0 - ratio), x.dtype)
    return x * keep.astype(x.dtype) * scale, keep


@op("Dropout", static=(1, 2), check=_check_dropout, random=True)
def dropout(ctx: Ctx, x: Any, ratio: Any = None, training: Any = None) -> Any:
    value = _ratio_value(ctx)
    _check_ratio(ctx, value)
    mask_type = bool if ctx.opset >= 10 else jnp.result_type(x)
    if not _drops(ctx) or value == 0.0:
        return x, jnp.ones(jnp.shape(x), mask_type)
    out, keep = _dropped(ctx, x, float(value), tuple(jnp.shape(x)))  # type: ignore[arg-type]
    return out, keep.astype(mask_type)


def _check_shaped_dropout(ctx: Ctx) -> None:
    _check_ratio(ctx, float(ctx.attr("ratio", 0.5)))
    if ctx.attr("shape") is None:
        raise NotSupported("attribute shape is missing: give the shape of the dropout mask")


@op("ShapedDropout", domain=GRAPHCORE, check=_check_shaped_dropout, random=True)
def shaped_dropout(ctx: Ctx, x: Any) -> Any:
    shape = tuple(int(d) for d in ctx.attr("shape"))
    try:
        fits = np.broadcast_shapes(shape, tuple(x.shape)) == tuple(x.shape)
    except ValueError:
        fits = False
    if not fits:
        raise PopartRefusal(f"ShapedDropout: incompatible input tensor and dropout shape. "
                       f"{_opid(ctx)} is configured with shape {popart_vector(shape)} which is not "
                       f"broadcastable to the input tensor with shape {popart_vector(x.shape)}.",
                       "give a mask shape that broadcasts to the input's (each dimension "
                       "the input's or 1).")
    ratio = float(ctx.attr("ratio", 0.5))
    if not _training() or ratio == 0.0:
        return x
    return _dropped(ctx, x, ratio, shape)[0]


# -- random normal and uniform ------------------------------------------------------------------

def _check_random(ctx: Ctx) -> None:
    if "seed" in ctx.attrs:
        raise PopartRefusal(f"{_opid(ctx)}: Optional seed attribute is not supported. Use "
                       f"session::setRandomSeed instead.",
                       "remove the seed attribute and seed the session (setRandomSeed).")
    dtype = ctx.attr("dtype")
    if dtype is not None and dtype not in _FLOATS:
        raise _bad_type(dtype)
    if ctx.op_type in ("RandomNormal", "RandomUniform") and ctx.attr("shape") is None:
        raise NotSupported("attribute shape is missing: give the output's shape")


def _bad_type(dtype: int) -> NotSupported:
    name = TensorProto.DataType.Name(dtype) if dtype in TensorProto.DataType.values() \
        else str(dtype)
    return PopartRefusal(f"The data type {name} is not supported in Poplar",
                         "give dtype FLOAT or FLOAT16, the types PopART's random operators make.")


def _target(ctx: Ctx, like: Any) -> tuple[tuple[int, ...], Any]:
    """The output's shape and dtype: the ``shape`` attribute or the input's shape; ``dtype``
    or (Like) the input's type, which must then be FLOAT or FLOAT16."""
    shape = tuple(jnp.shape(like)) if like is not None else \
        tuple(int(d) for d in ctx.attr("shape"))
    dtype = ctx.attr("dtype")
    if dtype is None and like is not None:
        found = np.dtype(jnp.result_type(like))
        if found not in (np.dtype(np.float32), np.dtype(np.float16)):
            raise NotSupported(f"the input is {found}: without a dtype attribute the output "
                               f"takes the input's type, and PopART's random operators make "
                               f"FLOAT or FLOAT16. Fix: give dtype FLOAT or FLOAT16.")
        return shape, found
    return shape, np_dtype(TensorProto.FLOAT if dtype is None else dtype)


@op("RandomNormal", "RandomNormalLike", check=_check_random, random=True)
def random_normal(ctx: Ctx, like: Any = None) -> Any:
    shape, dtype = _target(ctx, like)
    draw = jax.random.normal(_key(ctx), shape, jnp.float32)
    mean, scale = float(ctx.attr("mean", 0.0)), float(ctx.attr("scale", 1.0))
    return jax.lax.stop_gradient((draw * scale + mean).astype(dtype))


@op("RandomUniform", "RandomUniformLike", check=_check_random, random=True)
def random_uniform(ctx: Ctx, like: Any = None) -> Any:
    shape, dtype = _target(ctx, like)
    low, high = float(ctx.attr("low", 0.0)), float(ctx.attr("high", 1.0))
    draw = jax.random.uniform(_key(ctx), shape, jnp.float32, low, high)
    return jax.lax.stop_gradient(draw.astype(dtype))
