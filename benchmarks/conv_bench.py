"""Convolutions on the xla backend (CPU) against onnxruntime, forward and backward.

    python benchmarks/conv_bench.py [--repeat 9] [--only forward,backward] [--dtype fp32,fp16]
                                    [--rows big,resnet3x3,...] [--stat median|min] [--block 5]

Each row is one ONNX model, Conv + Relu (weights as initializers, the input fed), timed
interleaved in one process (medians of --repeat turns of --block calls each, after a warm-up;
:func:`popart_kit.bench.interleaved`: a block times each in its own steady state, and keeps
onnxruntime's spinning idle threads out of the next one's times; ``--block 1`` alternates
single calls):

* forward: onnxruntime's ``run``, the kit's ``InferenceSession.run`` at bps 1 (its Conv and
  Relu one onnxruntime session: delegated.py), the raw lowered op (``jax.jit`` of the lowered
  graph, no session around it and nothing delegated: what a training forward runs), the same
  with the lowering's fusions off (``apart``: the Conv and its Relu run apart, the Relu a pass
  over MLAS's output, what 889de59 ran), the same with onnxruntime's MLAS kept out (``xla``:
  :func:`~popart_kit._runtime.xla.ops_conv.xla_lowering_for`'s lowering, what 24ef92a ran),
  with MLAS forced (``mlas``, whether chosen or not: what the choice of
  :func:`~popart_kit._runtime.xla.ops_conv.mlas_wins` rests on) and XLA's NCHW convolution
  (``nchw``, what the lowering was before ops_conv.py). Ratios are onnxruntime's time / each
  (goal >= 1.0x); ``xla/raw`` is the xla column's time / the raw op's (goal >= 1.0x: the
  choice is no slower than XLA's lowering), ``apart/raw`` the apart column's (goal >= 1.0x:
  the fusion is no slower).
* backward (training): forward and gradient of sum(y ** 2) with respect to the input and the
  weights through the lowered op, against the same with the fusions off (``apart``),
  through the ``xla`` lowering and XLA's NCHW convolution (goal: no slower, >= 1.0x).
  onnxruntime has no gradient.

Every column runs with freed memory kept mapped (host_memory.py), as in a session, which sets
it when made; a backward row run alone would otherwise depend on whether a session was made
before it. Which lowering ops_conv.py chose is printed per row. Timings are noisy on a shared
machine: compare ratios of one run, and quote ``uptime``'s load average with them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import onnxruntime as ort
from jax import lax
from onnx import helper, numpy_helper

import popart_kit as pk
from popart_kit._runtime.xla import conv_mlas, ops_conv
from popart_kit._runtime.xla.host_memory import keep_freed_memory
from popart_kit._runtime.xla.lowering import lower
from popart_kit._runtime.xla.ops_conv import lowering_for

#: name: (description, (N, C, H, W), (M, C/g, kH, kW), stride, pad, group)
ROWS = {
    "big": ("Conv+Relu 4->64 k4 s2 p3, 540x960, batch 1", (1, 4, 540, 960), (64, 4, 4, 4),
            2, 3, 1),
    "resnet3x3": ("Conv+Relu 3x3 64->64 at 56x56, batch 8", (8, 64, 56, 56), (64, 64, 3, 3),
                  1, 1, 1),
    "resnet1x1": ("Conv+Relu 1x1 256->256 at 14x14, batch 8", (8, 256, 14, 14),
                  (256, 256, 1, 1), 1, 0, 1),
    "depthwise": ("depthwise 3x3, 128 channels at 28x28, batch 8", (8, 128, 28, 28),
                  (128, 1, 3, 3), 1, 1, 128),
    "grouped": ("grouped 3x3 128->128, 32 groups at 28x28, batch 8", (8, 128, 28, 28),
                (128, 4, 3, 3), 1, 1, 32),
    "mnist32": ("MNIST conv 1->32 k5 at 28x28, batch 32", (32, 1, 28, 28), (32, 1, 5, 5),
                1, 0, 1),
    "mnist1": ("MNIST conv 1->32 k5 at 28x28, batch 1", (1, 1, 28, 28), (32, 1, 5, 5),
               1, 0, 1),
}
DTYPES = {"fp32": np.float32, "fp16": np.float16}


STAT = "median"
BLOCK = 5


def interleaved(repeat: int, **fns: Callable[[], object]) -> dict[str, float]:
    """Median (or ``--stat min``: fastest) seconds of each function, called in turn in
    blocks of ``--block`` calls (:func:`popart_kit.bench.interleaved`)."""
    return {name: getattr(s, STAT)
            for name, s in pk.bench.interleaved(repeat, block=BLOCK, **fns).items()}


def model_of(row: str, dtype: type) -> tuple[bytes, np.ndarray, dict]:
    """The row's Conv + Relu model, an input for it, and the convolution's attributes."""
    _, x_shape, w_shape, stride, pad, group = ROWS[row]
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dtype)
    attrs = dict(strides=[stride] * 2, pads=[pad] * 4, group=group)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    out = [(size + 2 * pad - k) // stride + 1 for size, k in zip(x_shape[2:], w_shape[2:],
                                                                  strict=True)]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], **attrs),
         helper.make_node("Relu", ["c"], ["y"])], row,
        [helper.make_tensor_value_info("x", elem, list(x_shape))],
        [helper.make_tensor_value_info("y", elem, [x_shape[0], w_shape[0], *out])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return model.SerializeToString(), rng.standard_normal(x_shape).astype(dtype), attrs


@contextlib.contextmanager
def patched(module: object, name: str, value: object) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def compiled(fn: Callable, *args: object, mlas: str = "chosen") -> Callable:
    """``fn`` compiled for ``args``: with the lowering ops_conv.py chooses (``"chosen"``), with
    onnxruntime counted unavailable (``"off"``: XLA's lowering), MLAS forced on every float32
    4-D Conv (``"forced"``)."""
    context = {"chosen": contextlib.nullcontext(),
               "off": patched(conv_mlas, "available", lambda: False),
               "forced": patched(ops_conv, "mlas_wins", lambda x, w, g: len(x) == 4)}[mlas]
    with context:  # a new function each time: jax.jit would reuse an earlier trace of fn
        return jax.jit(lambda *a: fn(*a)).lower(*args).compile()


def before(x: jax.Array, w: jax.Array, attrs: dict) -> jax.Array:
    """The lowering before ops_conv.py: XLA's convolution on NCHW operands, then Relu."""
    pad = attrs["pads"][0]
    y = lax.conv_general_dilated(x, w, attrs["strides"], [(pad, pad)] * 2,
                                 feature_group_count=attrs["group"])
    return jnp.maximum(y, 0)


def forward_row(repeat: int, row: str, dtype_name: str) -> None:
    model, x, attrs = model_of(row, DTYPES[dtype_name])
    options = ort.SessionOptions()
    options.log_severity_level = 3
    ort_session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    sess = pk.InferenceSession(model, pk.SessionConfig(
        mode="inference", batches_per_step=1, device={"target": "offline"}), backend="xla")
    inputs = {"x": x}
    graph = lower(model)

    def lowered(w, x):
        return graph.evaluate(w, {"x": x}, ["y"])["y"]

    graph_apart = lower(model)
    graph_apart.fused = False

    def lowered_apart(w, x):
        return graph_apart.evaluate(w, {"x": x}, ["y"])["y"]

    xd, wd = jnp.asarray(x), jnp.asarray(graph.weights["w"])
    raw = compiled(lowered, graph.weights, xd)
    apart = compiled(lowered_apart, graph.weights, xd)
    xla = compiled(lowered, graph.weights, xd, mlas="off")
    mlas = compiled(lowered, graph.weights, xd, mlas="forced")
    old = compiled(functools.partial(before, attrs=attrs), xd, wd)
    want = ort_session.run(None, inputs)[0].astype(np.float32)
    for fn in (raw, apart, xla, mlas):
        np.testing.assert_allclose(np.asarray(fn(graph.weights, xd), np.float32), want,
                                   rtol=2e-2, atol=2e-2)
    t = interleaved(repeat, ort=lambda: ort_session.run(None, inputs),
                    session=functools.partial(sess.run, inputs),
                    raw=lambda: raw(graph.weights, xd).block_until_ready(),
                    apart=lambda: apart(graph.weights, xd).block_until_ready(),
                    xla=lambda: xla(graph.weights, xd).block_until_ready(),
                    mlas=lambda: mlas(graph.weights, xd).block_until_ready(),
                    nchw=lambda: old(xd, wd).block_until_ready())
    lowering = lowering_for(x.shape, ROWS[row][2], attrs["group"], x.dtype)
    cells = " ".join(f"{t[k] * 1e3:>7.2f}ms {t['ort'] / t[k]:>5.2f}x"
                     for k in ("session", "raw", "apart", "xla", "mlas", "nchw"))
    print(f"{dtype_name:<5} {ROWS[row][0]:<50} {t['ort'] * 1e3:>8.2f}ms {cells} (goal >= 1.0x)"
          f"  {t['xla'] / t['raw']:>5.2f}x {t['apart'] / t['raw']:>5.2f}x (goal >= 1.0x)  "
          f"{lowering}", flush=True)


def forward(repeat: int, dtypes: list[str], rows: list[str]) -> None:
    head = " ".join(f"{name:>9} {'ratio':>5}" for name in ("session", "raw op", "apart", "xla",
                                                            "mlas", "nchw"))
    print(f"\nforward {'row':<48} {'onnxrt':>10} {head} {'':>14}  xla/raw apart/raw {'':<14} "
          f"lowering")
    for dtype_name in dtypes:
        for row in rows:
            forward_row(repeat, row, dtype_name)


def backward_row(repeat: int, row: str, dtype_name: str) -> None:
    model, x, attrs = model_of(row, DTYPES[dtype_name])
    graph = lower(model)

    def loss(w, x):
        return jnp.sum(graph.evaluate(w, {"x": x}, ["y"])["y"].astype(jnp.float32) ** 2)

    def old_loss(w, x):
        return jnp.sum(before(x, w["w"], attrs).astype(jnp.float32) ** 2)

    graph_apart = lower(model)
    graph_apart.fused = False

    def loss_apart(w, x):
        return jnp.sum(graph_apart.evaluate(w, {"x": x}, ["y"])["y"].astype(jnp.float32) ** 2)

    xd, wd = jnp.asarray(x), {"w": jnp.asarray(graph.weights["w"])}
    grad = jax.grad(loss, argnums=(0, 1))
    new = compiled(grad, wd, xd)
    apart = compiled(jax.grad(loss_apart, argnums=(0, 1)), wd, xd)
    xla = compiled(grad, wd, xd, mlas="off")
    old = compiled(jax.grad(old_loss, argnums=(0, 1)), wd, xd)
    want = old(wd, xd)
    for fn in (new, apart, xla):
        for g, w in zip(jax.tree.leaves(fn(wd, xd)), jax.tree.leaves(want), strict=True):
            scale = float(jnp.max(jnp.abs(w.astype(jnp.float32)))) or 1.0
            error = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
            assert error <= 2e-2 * scale, (row, dtype_name, error, scale)
    t = interleaved(repeat, new=lambda: jax.block_until_ready(new(wd, xd)),
                    apart=lambda: jax.block_until_ready(apart(wd, xd)),
                    xla=lambda: jax.block_until_ready(xla(wd, xd)),
                    old=lambda: jax.block_until_ready(old(wd, xd)))
    print(f"{dtype_name:<5} {ROWS[row][0]:<50} {t['new'] * 1e3:>9.2f}ms "
          f"{t['apart'] * 1e3:>7.2f}ms {t['apart'] / t['new']:>5.2f}x "
          f"{t['xla'] * 1e3:>7.2f}ms {t['xla'] / t['new']:>5.2f}x "
          f"{t['old'] * 1e3:>7.2f}ms {t['old'] / t['new']:>5.2f}x (goal >= 1.0x)  "
          f"{lowering_for(x.shape, ROWS[row][2], attrs['group'], x.dtype)}", flush=True)


def backward(repeat: int, dtypes: list[str], rows: list[str]) -> None:
    print(f"\nbackward {'row':<49} {'lowered op':>11} {'apart':>9} {'ratio':>6} {'xla':>9} "
          f"{'ratio':>6} {'nchw':>9} "
          f"{'ratio':>6} {'':>14}  lowering")
    for dtype_name in dtypes:
        for row in rows:
            backward_row(repeat, row, dtype_name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--only", default="forward,backward")
    parser.add_argument("--dtype", default="fp32,fp16")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--stat", default="median", choices=["median", "min"],
                        help="min: the fastest call, steadier on a loaded machine")
    parser.add_argument("--block", type=int, default=5,
                        help="calls in a row per turn (1: single calls alternate)")
    args = parser.parse_args()
    global STAT, BLOCK
    STAT, BLOCK = args.stat, args.block
    dtypes, rows = args.dtype.split(","), args.rows.split(",")
    keep_freed_memory()  # as a session does (see the module docs)
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"{os.getloadavg()[2]:.2f}, {os.cpu_count()} cpus, jax {jax.__version__}, "
          f"onnxruntime {ort.__version__}, MLAS block {conv_mlas.block_size()}, {args.stat}s of "
          f"blocks of {BLOCK}")
    sections = {"forward": forward, "backward": backward}
    for name in args.only.split(","):
        sections[name](args.repeat, dtypes, rows)


if __name__ == "__main__":
    main()
