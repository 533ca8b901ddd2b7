"""Convolutions on the xla backend (CPU) against onnxruntime, forward and backward.

    python benchmarks/conv_bench.py [--repeat 9] [--only forward,backward] [--dtype fp32,fp16]
                                    [--rows big,resnet3x3,...]

Each row is one ONNX model, Conv + Relu (weights as initializers, the input fed), timed
interleaved in one process (medians of --repeat, after a warm-up):

* forward: onnxruntime's ``run``, the kit's ``InferenceSession.run`` at bps 1, the raw lowered
  op (``jax.jit`` of the lowered graph, no session around it) and XLA's NCHW convolution (what
  the lowering was before ops_conv.py). Ratios are onnxruntime's time / the kit's (goal
  >= 1.0x).
* backward: the gradient of sum(y ** 2) with respect to the input and the weights through the
  lowered op, against the same gradient of XLA's NCHW convolution (the lowering before; goal:
  no slower, >= 1.0x). onnxruntime has no gradient.

Which lowering ops_conv.py chose is printed per row. Timings are noisy on a shared machine:
compare ratios of one run, and quote ``uptime``'s load average with them.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import onnxruntime as ort
from jax import lax
from onnx import helper, numpy_helper

import popart_kit as pk
from popart_kit._runtime.xla.lowering import lower

try:
    from popart_kit._runtime.xla.ops_conv import lowering_for
except ImportError:  # a checkout from before ops_conv.py, for its "before" figures
    def lowering_for(x_shape, w_shape, group) -> str:
        return "xla nchw"

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


def interleaved(repeat: int, **fns: Callable[[], object]) -> dict[str, float]:
    """Median seconds of each function, called in turn (:func:`popart_kit.bench.interleaved`)."""
    return {name: s.median for name, s in pk.bench.interleaved(repeat, **fns).items()}


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
    raw = jax.jit(lambda w, x: graph.evaluate(w, {"x": x}, ["y"])["y"])
    old = jax.jit(functools.partial(before, attrs=attrs))
    xd, wd = jnp.asarray(x), jnp.asarray(graph.weights["w"])
    np.testing.assert_allclose(np.asarray(raw(graph.weights, xd), np.float32),
                               ort_session.run(None, inputs)[0].astype(np.float32),
                               rtol=2e-2, atol=2e-2)
    t = interleaved(repeat, ort=lambda: ort_session.run(None, inputs),
                    session=functools.partial(sess.run, inputs),
                    raw=lambda: raw(graph.weights, xd).block_until_ready(),
                    before=lambda: old(xd, wd).block_until_ready())
    print(f"{dtype_name:<8} {ROWS[row][0]:<52} {t['ort'] * 1e3:>9.2f}ms "
          f"{t['session'] * 1e3:>7.2f}ms {t['ort'] / t['session']:>5.2f}x "
          f"{t['raw'] * 1e3:>7.2f}ms {t['ort'] / t['raw']:>5.2f}x "
          f"{t['before'] * 1e3:>7.2f}ms {t['ort'] / t['before']:>5.2f}x  "
          f"{lowering_for(x.shape, ROWS[row][2], attrs['group'])} (goal >= 1.0x)", flush=True)


def forward(repeat: int, dtypes: list[str], rows: list[str]) -> None:
    print(f"\nforward  {'row':<52} {'onnxruntime':>11} {'session':>9} {'ratio':>6} "
          f"{'raw op':>9} {'ratio':>6} {'before':>9} {'ratio':>6}  lowering")
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

    new = jax.jit(jax.grad(loss, argnums=(0, 1)))
    old = jax.jit(jax.grad(old_loss, argnums=(0, 1)))
    xd, wd = jnp.asarray(x), {"w": jnp.asarray(graph.weights["w"])}
    got, want = new(wd, xd), old(wd, xd)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = float(jnp.max(jnp.abs(w.astype(jnp.float32)))) or 1.0
        error = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
        assert error <= 2e-2 * scale, (row, dtype_name, error, scale)
    t = interleaved(repeat, new=lambda: jax.block_until_ready(new(wd, xd)),
                    old=lambda: jax.block_until_ready(old(wd, xd)))
    print(f"{dtype_name:<8} {ROWS[row][0]:<52} {t['new'] * 1e3:>9.2f}ms "
          f"{t['old'] * 1e3:>7.2f}ms {t['old'] / t['new']:>5.2f}x  "
          f"{lowering_for(x.shape, ROWS[row][2], attrs['group'])} (goal >= 1.0x)", flush=True)


def backward(repeat: int, dtypes: list[str], rows: list[str]) -> None:
    print(f"\nbackward {'row':<52} {'lowered op':>11} {'before':>9} {'ratio':>6}  lowering")
    for dtype_name in dtypes:
        for row in rows:
            backward_row(repeat, row, dtype_name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--only", default="forward,backward")
    parser.add_argument("--dtype", default="fp32,fp16")
    parser.add_argument("--rows", default=",".join(ROWS))
    args = parser.parse_args()
    dtypes, rows = args.dtype.split(","), args.rows.split(",")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"{os.getloadavg()[2]:.2f}, {os.cpu_count()} cpus, jax {jax.__version__}, "
          f"onnxruntime {ort.__version__}")
    sections = {"forward": forward, "backward": backward}
    for name in args.only.split(","):
        sections[name](args.repeat, dtypes, rows)


if __name__ == "__main__":
    main()
