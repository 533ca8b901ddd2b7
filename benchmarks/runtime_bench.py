"""The xla backend's speed, against onnxruntime and against hand-written JAX.

    python benchmarks/runtime_bench.py [--repeat 20]

For an MLP and a small convolutional model, at bps 1, 16 and 64 (one replica): samples/s of
``InferenceSession.run`` against onnxruntime running the same ONNX model micro-batch by
micro-batch, and the session's run time against a hand-written ``jax.jit`` program of the same
math (vectorised over the bps micro-batches, as the session runs them). Targets: >= 1x
onnxruntime at bps >= 16; <= 1.05x the hand-written program. Then training: the session's
step (bps SGD updates of an MLP classifier) against a hand-written jax.jit training step of
the same math (target <= 1.05x).
All numbers come from this run, on this machine.
"""

from __future__ import annotations

import argparse
import functools
import platform
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnxruntime as ort

import popart_kit as pk
from timing import best_of

MICRO_BATCH = 32


def run_onnxruntime(session: ort.InferenceSession, micro_batches: np.ndarray) -> list:
    """The same step, micro-batch by micro-batch, as a host loop around onnxruntime does it."""
    return [session.run(None, {"x": m}) for m in micro_batches]


def run_jax(program: Callable, weights: tuple, micro_batches: np.ndarray) -> np.ndarray:
    return np.asarray(program(weights, micro_batches))


def mlp() -> tuple[bytes, dict[str, np.ndarray], Callable]:
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((256, 512)).astype(np.float32) / 16
    w2 = rng.standard_normal((512, 10)).astype(np.float32) / 16
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [MICRO_BATCH, 256]), debugContext="x")
    h = b.aiOnnx.relu([b.aiOnnx.matmul([x, b.addInitializedInputTensor(w1)])])
    y = b.aiOnnx.softmax([b.aiOnnx.matmul([h, b.addInitializedInputTensor(w2)])], axis=1)
    b.addOutputTensor(y)

    def math(weights, xs):
        def one(x):
            z = jnp.maximum(x @ weights[0], 0) @ weights[1]
            return jax.nn.softmax(z, axis=1)
        return jax.vmap(one)(xs)

    return b.getModelProto(), {"w": (w1, w2)}, math


def convnet() -> tuple[bytes, dict[str, np.ndarray], Callable]:
    rng = np.random.default_rng(0)
    k1 = rng.standard_normal((16, 3, 3, 3)).astype(np.float32) / 4
    k2 = rng.standard_normal((32, 16, 3, 3)).astype(np.float32) / 8
    w = rng.standard_normal((32, 10)).astype(np.float32) / 4
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [MICRO_BATCH, 3, 32, 32]), debugContext="x")
    h = b.aiOnnx.relu([b.aiOnnx.conv([x, b.addInitializedInputTensor(k1)], pads=[1, 1, 1, 1])])
    h = b.aiOnnx.maxpool([h], 1, [2, 2], strides=[2, 2])[0]
    h = b.aiOnnx.relu([b.aiOnnx.conv([h, b.addInitializedInputTensor(k2)], pads=[1, 1, 1, 1])])
    h = b.aiOnnx.flatten([b.aiOnnx.globalaveragepool([h])], axis=1)
    y = b.aiOnnx.softmax([b.aiOnnx.matmul([h, b.addInitializedInputTensor(w)])], axis=1)
    b.addOutputTensor(y)

    def conv(v, kernel):
        return jax.lax.conv_general_dilated(v, kernel, (1, 1), ((1, 1), (1, 1)))

    def math(weights, xs):
        def one(v):
            v = jnp.maximum(conv(v, weights[0]), 0)
            v = jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2),
                                      "VALID")
            v = jnp.maximum(conv(v, weights[1]), 0).mean((2, 3))
            return jax.nn.softmax(v @ weights[2], axis=1)
        return jax.vmap(one)(xs)

    return b.getModelProto(), {"w": (k1, k2, w)}, math


def training(repeat: int) -> None:
    """A training step (bps SGD updates of an MLP classifier) against hand-written JAX."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((256, 512)).astype(np.float32) / 16
    w2 = rng.standard_normal((512, 10)).astype(np.float32) / 16
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [MICRO_BATCH, 256]), debugContext="x")
    label = b.addInputTensor(pk.TensorInfo("INT32", [MICRO_BATCH]), debugContext="label")
    h = b.aiOnnx.relu([b.aiOnnx.matmul([x, b.addInitializedInputTensor(w1, "w1")])])
    probs = b.aiOnnx.softmax([b.aiOnnx.matmul([h, b.addInitializedInputTensor(w2, "w2")])],
                             axis=1)
    loss = b.aiGraphcore.nllloss([probs, label], pk.ReductionType.Mean)

    def update(weights, batch):
        def objective(w):
            p = jax.nn.softmax(jnp.maximum(batch[0] @ w[0], 0) @ w[1], axis=1)
            return -jnp.log(p[jnp.arange(MICRO_BATCH), batch[1]]).mean()
        grads = jax.grad(objective)(weights)
        return tuple(w - 0.01 * g for w, g in zip(weights, grads, strict=True)), None

    program = jax.jit(lambda w, xs, ys: jax.lax.scan(update, w, (xs, ys))[0])
    print(f"{'training':<8} {'bps':>4} {'session':>12} {'jax.jit':>10} {'vs jit':>7}")
    for bps in (1, 16, 64):
        cfg = pk.SessionConfig(mode="training", batches_per_step=bps,
                               device={"target": "offline"})
        sess = pk.TrainingSession(b.getModelProto(), cfg, loss=loss,
                                  optimizer=pk.SGD(learning_rate=0.01), backend="xla")
        inputs = sess.io.allocate_inputs("random")
        inputs["label"] = (np.abs(inputs["label"]) % 10).astype(np.int32)
        xs = inputs["x"].reshape(bps, MICRO_BATCH, 256)
        ys = inputs["label"].reshape(bps, MICRO_BATCH)
        weights = (jnp.asarray(w1), jnp.asarray(w2))
        session_s = best_of(repeat, functools.partial(sess.run, inputs))
        jit_s = best_of(repeat, functools.partial(run_jax_training, program, weights, xs, ys))
        print(f"{'mlp':<8} {bps:>4} {session_s * 1e3:>10.2f}ms {jit_s * 1e3:>8.2f}ms "
              f"{session_s / jit_s:>6.2f}x")
    print("target: 'vs jit' <= 1.05x (the session adds PopART's anchors and its checks)")


def run_jax_training(program: Callable, weights: tuple, xs: np.ndarray, ys: np.ndarray) -> Any:
    return jax.block_until_ready(program(weights, xs, ys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    warnings.simplefilter("ignore", pk.PopartKitWarning)
    print(f"machine: {platform.machine()} {platform.processor() or ''}; jax {jax.__version__} on "
          f"{jax.devices()[0].platform}; onnxruntime {ort.__version__}")
    print(f"{'model':<8} {'bps':>4} {'session':>12} {'onnxruntime':>12} {'vs ort':>7} "
          f"{'jax.jit':>10} {'vs jit':>7}")
    for name, build in (("mlp", mlp), ("convnet", convnet)):
        model, weights, math = build()
        ort_session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        for bps in (1, 16, 64):
            cfg = pk.SessionConfig(mode="inference", batches_per_step=bps,
                                   device={"target": "offline"})
            sess = pk.InferenceSession(model, cfg, backend="xla")
            (output,) = sess.anchors
            inputs = sess.io.allocate_inputs("random")
            micro = inputs["x"].reshape((bps,) + sess.io.inputs["x"].shape)
            program = jax.jit(math)
            device_w = tuple(jnp.asarray(w) for w in weights["w"])
            session_s = best_of(args.repeat, functools.partial(sess.run, inputs))
            ort_s = best_of(args.repeat, functools.partial(run_onnxruntime, ort_session, micro))
            jit_s = best_of(args.repeat, functools.partial(run_jax, program, device_w, micro))
            samples = bps * MICRO_BATCH
            print(f"{name:<8} {bps:>4} {samples / session_s:>10.0f}/s {samples / ort_s:>10.0f}/s "
                  f"{ort_s / session_s:>6.2f}x {jit_s * 1e3:>8.2f}ms {session_s / jit_s:>6.2f}x")
    print("targets: 'vs ort' >= 1x at bps >= 16 (higher is better); 'vs jit' <= 1.05x")
    training(args.repeat)


if __name__ == "__main__":
    main()
