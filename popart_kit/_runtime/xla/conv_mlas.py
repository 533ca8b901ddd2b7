"""A float32 or float16 convolution on the CPU through onnxruntime's MLAS kernels, inside an
XLA program.

One onnxruntime session per convolution (shapes, attributes, bias or not; :func:`session_for`)
holds one Conv, in MLAS's channel-blocked layout (onnxruntime's ``com.microsoft.nchwc`` Conv
between ReorderInput / ReorderOutput, as its graph optimizer makes of a Conv with constant
weights; :func:`layout_for`) with the filter reordered by XLA (:func:`_reorder`), or a plain
ONNX Conv where that layout does not apply; a float16 one between Casts to float32 and back
(onnxruntime's own way on the CPU: it has no float16 convolution there). JAX's
``buffer_callback`` (jax.experimental) hands the session XLA's input buffers and the output
buffer to write in place (an ``io_binding`` per call: no copies, and concurrent calls from
pipeline threads each bind their own). Sessions are made once, under a lock, with one intra-op
thread per CPU the process may use and spinning off (:func:`options`). See ops_conv.py for when
it is chosen and what was measured.

:func:`conv` is forward only: a :func:`jax.custom_vjp` whose backward is the given XLA lowering's
(the gradient numerics of that lowering, unchanged), and where the program is lowered for
another platform than the CPU (:func:`jax.lax.platform_dependent`) the forward is that lowering
too. Under :func:`jax.vmap` with only the input batched the batch axis is folded into N (one
bigger convolution); any other batching runs the XLA lowering, vmapped.

An ``activation`` (:data:`ACTIVATIONS`: Relu) is applied by MLAS to the convolution's output as
it is written (the ``activation`` attribute of onnxruntime's NCHWc Conv, or of its
``com.microsoft`` FusedConv for the plain layout): no second pass over the output. Its gradient
is the activation's, computed from the output, then the XLA lowering's backward.

Refuses nothing itself: :func:`available` says whether onnxruntime imports and the installed jax
has ``buffer_callback`` (checked once); callers fall back to XLA when it does not.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .ops import _channel_bias, _popart_relu, relu_gradient

__all__ = ["ACTIVATIONS", "NCHWC", "available", "block_size", "conv",
           "layout_for", "options", "session_for"]

#: Sessions by key; created under :data:`_LOCK` (pipeline stages run in threads).
_SESSIONS: dict[tuple, Any] = {}
_LOCK = threading.Lock()

#: onnxruntime's domain of MLAS's channel-blocked (NCHWc) kernels.
NCHWC = "com.microsoft.nchwc"

Key = tuple  # (x shape, w shape, bias, strides, pads, dilations, group, activation, x dtype)


#: Activations MLAS applies to a convolution's output: name -> (the activation, as the xla
#: backend computes it; its gradient from its output ``y`` and the output's gradient ``dy``).
ACTIVATIONS: dict[str, tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]] = {
    "Relu": (_popart_relu, relu_gradient),
}


@functools.cache
def available() -> bool:
    """Whether onnxruntime imports and jax has ``buffer_callback`` (checked once, cached)."""
    try:
        import onnxruntime  # noqa: F401
        from jax.experimental.buffer_callback import buffer_callback  # noqa: F401
    except ImportError:
        return False
    return True


def session_for(key: Key) -> Any:
    """The onnxruntime session running the convolution ``key`` names (made once, under a
    lock): inputs ``x``, ``w`` (reordered for :func:`layout_for`) and ``b`` (padded alike),
    output ``y``."""
    session = _SESSIONS.get(key)
    if session is not None:
        return session
    with _LOCK:
        session = _SESSIONS.get(key)
        if session is None:
            session = _SESSIONS[key] = _make_session(key)
    return session


@functools.cache
def block_size() -> int:
    """MLAS's NCHWc channel block on this machine (16 with AVX-512, 8 with AVX2), read once from
    the shape onnxruntime's ReorderInput gives four channels (the fewest it takes, padded to a
    block); 0 where it has no NCHWc kernels."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReorderInput", ["x"], ["y"], domain=NCHWC)], "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11),
                                                    helper.make_opsetid(NCHWC, 1)])
    try:
        session = ort.InferenceSession(model.SerializeToString(), options(),
                                       providers=["CPUExecutionProvider"])
        size = int(session.run(None, {"x": np.ones((1, 4, 1, 1), np.float32)})[0].shape[1])
    except Exception:  # noqa: BLE001 - an onnxruntime without the NCHWc kernels
        return 0
    return size if size > 1 else 0


def layout_for(w_shape: Sequence[int], group: int) -> str:
    """How onnxruntime's own graph optimizer would run a Conv of these weights (its NCHWc
    transformer, which it applies to constant weights only): ``"nchwc"`` (the input reordered
    to channel blocks, the filter to blocks of input and output channels), ``"nchwc_bo"`` (the
    filter in blocks of output channels: depthwise with the input reordered, or fewer input
    channels than a block with the NCHW input read directly), or ``"nchw"`` (MLAS's plain
    convolution)."""
    block = block_size()
    out_channels, in_channels = w_shape[0], w_shape[1]
    if not block or len(w_shape) != 4:
        return "nchw"
    if group > 1:
        if out_channels % block:
            return "nchw"
        if in_channels == 1 and out_channels == group:
            return "nchwc_bo"
        if in_channels % block or (out_channels // group) % block:
            return "nchw"
        return "nchwc"
    if in_channels < block:
        return "nchwc_bo"
    return "nchw" if in_channels % 4 else "nchwc"  # ReorderInput takes whole 4-channel groups


def _reorder(w: Any, b: Any, layout: str) -> tuple[Any, Any]:
    """The filter (and bias) in ``layout``'s channel blocks, padded with zeros to whole blocks
    (MLAS's ReorderFilterOIHWBiBo / OIHWBo, done by XLA: the weights are run inputs)."""
    if layout == "nchw":
        return w, b
    block = block_size()
    o, i, h, k = w.shape
    o_pad = -(-o // block) * block
    if layout == "nchwc_bo":
        w = jnp.pad(w, [(0, o_pad - o), (0, 0), (0, 0), (0, 0)])
        w = w.reshape(o_pad // block, block, i, h, k).transpose(0, 2, 3, 4, 1)
        w = w.reshape(o_pad, i, h, k)
    else:
        i_pad = -(-i // block) * block
        w = jnp.pad(w, [(0, o_pad - o), (0, i_pad - i), (0, 0), (0, 0)])
        w = w.reshape(o_pad // block, block, i_pad // block, block, h, k)
        w = w.transpose(0, 2, 4, 5, 3, 1).reshape(o_pad, i_pad, h, k)
    return w, None if b is None else jnp.pad(b, (0, o_pad - o))


def options(spinning: bool = False) -> Any:
    """Session options: one intra-op thread per CPU this process may use (as XLA's pool; one
    thread in all was 1.5-5x slower on the larger convolutions), threads that sleep when idle
    rather than spin unless ``spinning`` (spinning ones took cores from XLA's pool)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return options


def _make_session(key: Key) -> Any:
    """A new session for ``key`` (see :func:`session_for`)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    x_shape, w_shape, bias, strides, pads, dilations, group, activation, dtype = key
    layout = layout_for(w_shape, group)
    half = dtype == "float16"  # converted to float32 and back by the session's Casts
    names = ["x", "w"] + (["b"] if bias else [])
    attrs = dict(strides=list(strides), pads=[lo for lo, _ in pads] + [hi for _, hi in pads],
                 dilations=list(dilations), group=group)
    if activation:
        attrs["activation"] = activation
    w_in, b_in = jax.eval_shape(lambda w, b: _reorder(w, b, layout),
                                jax.ShapeDtypeStruct(w_shape, np.float32),
                                jax.ShapeDtypeStruct((w_shape[0],), np.float32))
    shapes = [x_shape, w_in.shape] + ([b_in.shape] if bias else [])
    x, y = ("x32", "y32") if half else ("x", "y")
    if layout == "nchw":
        inputs = [x, *names[1:]]
        nodes = [helper.make_node("FusedConv", inputs, [y], domain="com.microsoft", **attrs)
                 if activation else helper.make_node("Conv", inputs, [y], **attrs)]
    else:
        reordered = layout == "nchwc" or group > 1
        first = ["xc" if reordered else x] + names[1:]
        nodes = ([helper.make_node("ReorderInput", [x], ["xc"], domain=NCHWC)]
                 if reordered else [])
        nodes += [helper.make_node("Conv", first, ["yc"], domain=NCHWC, **attrs),
                  helper.make_node("ReorderOutput", ["yc"], [y], domain=NCHWC,
                                   channels=w_shape[0])]
    elem = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    if half:
        nodes = [helper.make_node("Cast", ["x"], [x], to=TensorProto.FLOAT), *nodes,
                 helper.make_node("Cast", [y], ["y"], to=elem)]
    graph = helper.make_graph(
        nodes, "conv",
        [helper.make_tensor_value_info(n, elem if n == "x" else TensorProto.FLOAT, list(s))
         for n, s in zip(names, shapes, strict=True)],
        [helper.make_tensor_value_info("y", elem, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11),
                                                    helper.make_opsetid(NCHWC, 1),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), options(),
                                providers=["CPUExecutionProvider"])


def _out_shape(key: Key) -> tuple[int, ...]:
    x_shape, w_shape, _, strides, pads, dilations, _, _, _ = key
    out = [(s + lo + hi - (k - 1) * d - 1) // st + 1 for s, k, (lo, hi), d, st
           in zip(x_shape[2:], w_shape[2:], pads, dilations, strides, strict=True)]
    return (x_shape[0], w_shape[0], *out)


def _callback(key: Key) -> Callable[..., None]:
    def run(ctx: Any, out: Any, x: Any, w: Any, *b: Any) -> None:
        session = session_for(key)
        binding = session.io_binding()
        binding.bind_cpu_input("x", np.asarray(x))
        binding.bind_cpu_input("w", np.asarray(w))
        if b:
            binding.bind_cpu_input("b", np.asarray(b[0]))
        y = np.asarray(out)
        binding.bind_output("y", "cpu", 0, y.dtype, list(y.shape), y.ctypes.data)
        session.run_with_iobinding(binding)
    return run


def _forward(x: Any, w: Any, b: Any, strides: tuple, pads: tuple, dilations: tuple,
             group: int, xla: Callable[..., Any], activation: str | None) -> Any:
    """The MLAS convolution (then ``activation``), batched by
    :func:`jax.custom_batching.custom_vmap`; ``xla`` is the whole of it by XLA."""
    from jax.experimental.buffer_callback import buffer_callback

    key = (tuple(x.shape), tuple(w.shape), b is not None, strides, pads, dilations, group,
           activation, np.dtype(x.dtype).name)
    args = (x, w) if b is None else (x, w, b)

    @jax.custom_batching.custom_vmap
    def call(*args: Any) -> Any:
        x, w, *rest = args
        w, b = _reorder(w, rest[0] if rest else None, layout_for(w.shape, group))
        shape = jax.ShapeDtypeStruct(_out_shape(key), x.dtype)
        return buffer_callback(_callback(key), shape)(*((x, w) if b is None else (x, w, b)))

    @call.def_vmap
    def batched(size: int, in_batched: Sequence[bool], *args: Any) -> tuple[Any, bool]:
        x, w, *rest = args
        if in_batched[0] and not any(in_batched[1:]):
            y = _forward(x.reshape((-1, *x.shape[2:])), w, rest[0] if rest else None,
                         strides, pads, dilations, group, xla, activation)
            return y.reshape((size, -1, *y.shape[1:])), True
        axes = [0 if batched else None for batched in in_batched]
        return jax.vmap(lambda *a: xla(*a) if len(a) == 3 else xla(*a, None),
                        in_axes=axes, axis_size=size)(*args), True

    return call(*args)


def conv(x: Any, w: Any, b: Any, strides: Sequence[int], pads: Sequence[tuple[int, int]],
         dilations: Sequence[int], group: int, xla: Callable[[Any, Any, Any], Any],
         activation: str | None = None) -> Any:
    """``xla(x, w, b)`` (an NCHW convolution with bias ``b`` or None), then ``activation`` (a
    name in :data:`ACTIVATIONS`, or None), computed by MLAS where lowered for the CPU,
    differentiated as ``xla`` followed by the activation (the activation's gradient read from
    the output, then ``xla``'s backward). Half-precision operands are convolved in float32 (they
    convert exactly; the sum rounds once to their type, as a convolution of float partials
    does), then the bias and activation follow in their type, as ``xla`` adds them."""
    strides, dilations = tuple(int(s) for s in strides), tuple(int(d) for d in dilations)
    pads = tuple((int(lo), int(hi)) for lo, hi in pads)
    after, gradient = ACTIVATIONS[activation] if activation else (None, None)

    def whole(x: Any, w: Any, b: Any = None) -> Any:  # the convolution and activation, by XLA
        y = xla(x, w, b)
        return y if after is None else after(y)

    def on_cpu(x: Any, w: Any, b: Any) -> Any:
        if x.dtype == jnp.float32:
            return _forward(x, w, b, strides, pads, dilations, group, whole, activation)
        half = w.dtype
        fused = activation if b is None else None  # a bias is added after the rounding

        def apart(x: Any, w: Any, b: Any = None) -> Any:  # XLA's, for what vmap cannot fold
            y = xla(x, w.astype(half), None)
            return y if fused is None else after(y)

        y = _forward(x, w.astype(jnp.float32), None, strides, pads, dilations, group, apart,
                     fused)
        if b is not None:
            y = _channel_bias(y, b)
            y = y if after is None else after(y)
        return y

    def forward(*args: Any) -> Any:
        x, w, *rest = args
        b = rest[0] if rest else None
        return lax.platform_dependent(x, w, b, default=whole, cpu=on_cpu)

    @jax.custom_vjp
    def fn(*args: Any) -> Any:
        return forward(*args)

    def fn_forward(*args: Any) -> tuple[Any, Any]:
        y = forward(*args)
        return y, (args, None if gradient is None else y)

    def fn_backward(saved: Any, dy: Any) -> Any:
        args, y = saved
        if gradient is not None:  # the activation's gradient, then the convolution's
            dy = gradient(y, dy)
        _, vjp = jax.vjp(lambda *a: xla(*a) if len(a) == 3 else xla(*a, None), *args)
        return vjp(dy)

    fn.defvjp(fn_forward, fn_backward)
    return fn(x, w) if b is None else fn(x, w, b)
