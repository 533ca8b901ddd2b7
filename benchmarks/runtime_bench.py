"""The xla backend's speed and memory, each against a baseline measured in the same run.

    python benchmarks/runtime_bench.py [--repeat 15] [--only inference,training,...]

Sections (every ratio comes from runs interleaved with their baseline in blocks of 5 calls,
medians of --repeat blocks):

* per_run: the fixed cost of a run, an MLP 784-256-256-10 at bps 1, micro-batch 32, against
  onnxruntime (goal >= 1x).
* inference: an MLP and a small convnet at bps 1, 16, 64 (one replica): samples/s of
  ``InferenceSession.run`` against onnxruntime running the same ONNX model micro-batch by
  micro-batch (target >= 1x at bps >= 16), and against a hand-written ``jax.jit`` program of
  the same maths (target <= 1.05x).
* training: an MLP classifier, bps 1, 16, 64 SGD updates per run, against a hand-written
  ``jax.jit`` training step (target <= 1.05x); beside it, a hand-written step doing the
  session's work besides the bare update (the losses out, hyperparameters as arguments, the
  losses and new weights checked finite) against the bare one: what that work costs alone.
* accumulation: the same 16 micro-batches as bps=1 x A=16 against bps=16 x A=1 (target
  <= 1.1x), and the step's memory at A=64 against A=1 (target <= 1.2x), a 4-layer MLP.
* memory: inference step memory at bps=256 against bps=16 with Final and Sum anchors (target
  <= 1.5x). Memory is what XLA reports for the compiled step (arguments, results,
  temporaries) less the inputs, the host buffers themselves.
* replication: samples/s at R = 1, 2, 4, 8 against R = 1 (target >= 0.95x), and replicas on
  one device (the kit's choice on CPU) against the same replicas split over several CPU
  devices.
* cache: a fresh process preparing the same session with and without the persistent
  compilation cache.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnxruntime as ort

import popart_kit as pk
from popart_kit._runtime.xla import compilation_cache, placement

MICRO_BATCH = 32


def interleaved(repeat: int, block: int = 5, **fns: Callable[[], object]) -> dict[str, float]:
    """Median seconds of each function, called in turn ``repeat`` times in blocks of
    ``block`` calls after one warm-up (:func:`popart_kit.bench.interleaved`: a block times each
    in its own steady state, and keeps onnxruntime's spinning idle threads out of the next
    one's times)."""
    return {name: s.median
            for name, s in pk.bench.interleaved(repeat, block=block, **fns).items()}


# -- models -------------------------------------------------------------------------------------


def mlp(layers: int = 1, width: int = 512, label: bool = False):
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((256 if i == 0 else width, width)).astype(np.float32) / 16
          for i in range(layers)]
    head = rng.standard_normal((width, 10)).astype(np.float32) / 16
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [MICRO_BATCH, 256]), debugContext="x")
    h = x
    for i, w in enumerate(ws):
        h = b.aiOnnx.relu([b.aiOnnx.matmul([h, b.addInitializedInputTensor(w, f"w{i}")])])
    y = b.aiOnnx.softmax([b.aiOnnx.matmul([h, b.addInitializedInputTensor(head, "head")])],
                         axis=1)
    loss = None
    if label:
        lab = b.addInputTensor(pk.TensorInfo("INT32", [MICRO_BATCH]), debugContext="label")
        loss = b.aiGraphcore.nllloss([y, lab], pk.ReductionType.Mean)
    else:
        b.addOutputTensor(y)

    def forward(weights, x):
        for w in weights[:-1]:
            x = jnp.maximum(x @ w, 0)
        return jax.nn.softmax(x @ weights[-1], axis=1)

    return b.getModelProto(), (*ws, head), forward, loss


def mlp_784():
    """The MLP of the per-run row: 784-256-256-10, ReLU between the layers, logits out."""
    rng = np.random.default_rng(0)
    dims = (784, 256, 256, 10)
    b = pk.Builder()
    h = b.addInputTensor(pk.TensorInfo("FLOAT", [MICRO_BATCH, dims[0]]), debugContext="x")
    for i, (n, m) in enumerate(zip(dims, dims[1:], strict=False)):
        w = rng.standard_normal((n, m)).astype(np.float32) / 16
        h = b.aiOnnx.matmul([h, b.addInitializedInputTensor(w, f"w{i}")])
        h = b.aiOnnx.relu([h]) if i < len(dims) - 2 else h
    b.addOutputTensor(h)
    return b.getModelProto()


def convnet():
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

    def forward(weights, v):
        v = jnp.maximum(conv(v, weights[0]), 0)
        v = jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        v = jnp.maximum(conv(v, weights[1]), 0).mean((2, 3))
        return jax.nn.softmax(v @ weights[2], axis=1)

    return b.getModelProto(), (k1, k2, w), forward, None


def inference_cfg(bps: int, replicas: int = 1) -> pk.SessionConfig:
    return pk.SessionConfig(mode="inference", batches_per_step=bps,
                            replication={"local_factor": replicas}, device={"target": "offline"})


def training_cfg(bps: int, acc: int = 1, replicas: int = 1) -> pk.SessionConfig:
    return pk.SessionConfig(mode="training", batches_per_step=bps,
                            accumulation={"factor": acc}, replication={"local_factor": replicas},
                            device={"target": "offline"})


def labelled(sess: Any) -> dict[str, np.ndarray]:
    inputs = sess.io.allocate_inputs("random")
    if "label" in inputs:
        inputs["label"] = (np.abs(inputs["label"]) % 10).astype(np.int32)
    return inputs


def step_memory(sess: Any) -> int:
    """Bytes XLA reports for the step beyond its inputs (see the module docs)."""
    sess.prepare()
    parts = sess.runtime.memory
    return sum(v for k, v in parts.items() if k != "inputs on the device")


# -- sections -----------------------------------------------------------------------------------


def inference(repeat: int) -> None:
    print(f"\n{'inference':<10} {'bps':>4} {'session':>11} {'onnxruntime':>12} {'vs ort':>7} "
          f"{'jax.jit':>9} {'vs jit':>7}   (target: vs ort >= 1 at bps >= 16, vs jit <= 1.05)")
    for name, build in (("mlp", mlp), ("convnet", convnet)):
        model, weights, forward, _ = build()
        options = ort.SessionOptions()
        options.log_severity_level = 3  # no notes about initializers listed as graph inputs
        ort_session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        device_w = tuple(jnp.asarray(w) for w in weights)
        program = jax.jit(lambda w, xs, f=forward: jax.vmap(lambda x: f(w, x))(xs))
        for bps in (1, 16, 64):
            sess = pk.InferenceSession(model, inference_cfg(bps), backend="xla")
            inputs = sess.io.allocate_inputs("random")
            micro = inputs["x"].reshape((bps,) + sess.io.inputs["x"].shape)
            t = interleaved(
                repeat, session=functools.partial(sess.run, inputs),
                ort=lambda m=micro, o=ort_session: [o.run(None, {"x": v}) for v in m],
                jit=lambda m=micro, p=program, w=device_w: np.asarray(p(w, m)))
            samples = bps * MICRO_BATCH
            print(f"{name:<10} {bps:>4} {samples / t['session']:>9.0f}/s "
                  f"{samples / t['ort']:>10.0f}/s {t['ort'] / t['session']:>6.2f}x "
                  f"{t['jit'] * 1e3:>7.2f}ms {t['session'] / t['jit']:>6.2f}x")


def per_run(repeat: int) -> None:
    """The fixed cost of a run: the 784-256-256-10 MLP at bps 1 against onnxruntime, where a
    run is little more than its program call."""
    model = mlp_784()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    ort_session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    sess = pk.InferenceSession(model, inference_cfg(1), backend="xla")
    inputs = sess.io.allocate_inputs("random")
    x = inputs["x"].reshape(sess.io.inputs["x"].shape)
    t = interleaved(max(repeat, 20), block=10, session=functools.partial(sess.run, inputs),
                    ort=lambda: ort_session.run(None, {"x": x}))
    print(f"\nper run: MLP 784-256-256-10 inference at bps 1, micro-batch {MICRO_BATCH}: "
          f"session {t['session'] * 1e6:.0f} us, onnxruntime {t['ort'] * 1e6:.0f} us: "
          f"{t['ort'] / t['session']:.2f}x (goal >= 1.0x)")


def training(repeat: int) -> None:
    model, weights, forward, loss = mlp(label=True)

    def update(ws, batch):
        def objective(w):
            p = forward(w, batch[0])
            return -jnp.log(p[jnp.arange(MICRO_BATCH), batch[1]]).mean()
        grads = jax.grad(objective)(ws)
        return tuple(w - 0.01 * g for w, g in zip(ws, grads, strict=True)), None

    def same_work(ws, hyper, batch):
        """An update with the session's work besides the bare one: the loss out and the
        hyperparameters as arguments."""
        def objective(w):
            p = forward(w, batch[0])
            return -jnp.log(p[jnp.arange(MICRO_BATCH), batch[1]]).mean()
        value, grads = jax.value_and_grad(objective)(ws)
        return tuple(w - hyper["lr"] * (g * hyper["scale"] / hyper["scale"] + hyper["decay"] * w)
                     for w, g in zip(ws, grads, strict=True)), value

    def same_run(ws, hyper, xs, ys):
        """A run of such updates, its losses and new weights then checked finite, as the
        session checks them."""
        new, losses = jax.lax.scan(lambda c, b: same_work(c, hyper, b), ws, (xs, ys))
        finite = [jnp.isfinite(losses).all()] + [jnp.isfinite(jnp.matmul(
            w.reshape(-1, w.shape[-1]), jnp.zeros(w.shape[-1]), precision="highest")).all()
            for w in new]
        return new, (losses, jnp.stack(finite))

    program = jax.jit(lambda w, xs, ys: jax.lax.scan(update, w, (xs, ys))[0])
    same = jax.jit(same_run)
    hyper = {k: jnp.float32(v) for k, v in (("lr", 0.01), ("scale", 1.0), ("decay", 0.0))}
    print(f"\n{'training':<10} {'bps':>4} {'session':>11} {'jax.jit':>9} {'vs jit':>7}   "
          f"(target: vs jit <= 1.05)   same-work jit (loss out, finite checks) vs jit")
    for bps in (1, 16, 64):
        sess = pk.TrainingSession(model, training_cfg(bps), loss=loss,
                                  optimizer=pk.SGD(learning_rate=0.01), backend="xla")
        inputs = labelled(sess)
        xs = inputs["x"].reshape(bps, MICRO_BATCH, 256)
        ys = inputs["label"].reshape(bps, MICRO_BATCH)
        device_w = tuple(jnp.asarray(w) for w in weights)
        t = interleaved(repeat, session=functools.partial(sess.run, inputs),
                        jit=lambda xs=xs, ys=ys, w=device_w: jax.block_until_ready(
                            program(w, xs, ys)),
                        same=lambda xs=xs, ys=ys, w=device_w: [np.asarray(a) for a in same(
                            w, hyper, xs, ys)[1]])
        print(f"{'mlp':<10} {bps:>4} {t['session'] * 1e3:>9.2f}ms {t['jit'] * 1e3:>7.2f}ms "
              f"{t['session'] / t['jit']:>6.2f}x" + (" the time (goal <= 1.05x)" if bps == 1
                                                       else " " * 24)
              + f" {t['same'] * 1e3:>7.2f}ms {t['same'] / t['jit']:>5.2f}x")
    unchecked = pk.TrainingSession(model, training_cfg(16), loss=loss,
                                   optimizer=pk.SGD(learning_rate=0.01), backend="xla",
                                   check_finite=False)
    checked = pk.TrainingSession(model, training_cfg(16), loss=loss,
                                 optimizer=pk.SGD(learning_rate=0.01), backend="xla")
    inputs = labelled(checked)
    t = interleaved(repeat, checked=functools.partial(checked.run, inputs),
                    unchecked=functools.partial(unchecked.run, inputs))
    print(f"the non-finite check at bps 16: {t['checked'] / t['unchecked']:.3f}x the run "
          f"without it")


def accumulation(repeat: int) -> None:
    """Accumulation's time and memory at the default chunk, and what other chunks trade.

    A step at A > 1 holds, beyond an A=1 step, the activations of a chunk of micro-batches
    (evaluated at once, for speed) and one weight's gradient beside the accumulator (XLA:CPU
    has no matrix product that adds into its output); neither grows with A."""
    model, _, _, loss = mlp(layers=4, label=True)

    def session(bps: int, acc: int, chunk: int | None = None) -> Any:
        return pk.TrainingSession(model, training_cfg(bps, acc), loss=loss,
                                  optimizer=pk.SGD(learning_rate=0.01), backend="xla",
                                  micro_batches_per_chunk=chunk)

    at16 = session(1, 16).runtime.chunk  # the default chunk at A=16
    chunks = sorted({1, 2, at16})
    base = session(16, 1)
    runs = {"bps": functools.partial(base.run, labelled(base))}
    for c in chunks:
        sess = session(1, 16, c)
        runs[f"c{c}"] = functools.partial(sess.run, labelled(sess))
    t = interleaved(repeat, **runs)
    m1 = step_memory(session(1, 1))
    m64 = {c: step_memory(session(1, 64, c)) for c in chunks}
    at64 = session(1, 64)  # its own default chunk, by the same rule
    default, m64_default = at64.runtime.chunk, step_memory(at64)
    by_a = {a: step_memory(session(1, a)) for a in (default, 16)}
    print(f"\naccumulation (4-layer MLP, micro-batch {MICRO_BATCH}, default chunk {default}, "
          f"load {os.getloadavg()[0]:.2f}):")
    print(f"  time, bps=1 x A=16 vs bps=16 x A=1: {t[f'c{at16}'] * 1e3:.2f}ms vs "
          f"{t['bps'] * 1e3:.2f}ms: {t[f'c{at16}'] / t['bps']:.2f}x (goal <= 1.1x)")
    print(f"  step memory beyond the inputs, A=64 vs A=1: {m64_default / 2**20:.1f} MiB vs "
          f"{m1 / 2**20:.1f} MiB: {m64_default / m1:.2f}x (goal <= 1.2x)")
    print("  memory vs A=1 by A (default chunk): " + ", ".join(
        f"A={a} {m / m1:.2f}x" for a, m in (*by_a.items(), (64, m64_default))))
    for c in chunks:
        print(f"  micro_batches_per_chunk={c}: A=64 memory {m64[c] / m1:.2f}x, A=16 time "
              f"{t[f'c{c}'] / t['bps']:.2f}x")


def memory() -> None:
    print("\ninference step memory beyond the inputs, anchors Final + Sum (target: bps 256 "
          "<= 1.5x bps 16)")
    for name, build in (("mlp", mlp), ("convnet", convnet)):
        model, *_ = build()
        out = {}
        for bps in (16, 256):
            sess = pk.InferenceSession(model, inference_cfg(bps, 4), backend="xla",
                                       anchors={"x": "Final", model_output(model): "Sum"})
            out[bps] = step_memory(sess)
        print(f"{name:<10} bps 16 {out[16] / 2**20:.1f} MiB, bps 256 {out[256] / 2**20:.1f} MiB:"
              f" {out[256] / out[16]:.2f}x")


def model_output(model: bytes) -> str:
    import onnx

    return onnx.load_from_string(model).graph.output[0].name


def replication(repeat: int) -> None:
    print(f"\nreplication: samples/s vs R=1 (target >= 0.95), and one device vs the replicas "
          f"split over CPU devices (>= 1 means the kit's choice is faster); "
          f"{len(jax.devices())} CPU devices, {os.cpu_count()} cores")
    model, _, _, loss = mlp(label=True)
    imodel, *_ = mlp()
    for mode in ("inference", "training"):
        def make(replicas: int, devices: int, mode: str = mode) -> Any:
            placement.CPU_REPLICA_DEVICES = devices
            if mode == "inference":
                return pk.InferenceSession(imodel, inference_cfg(16, replicas), backend="xla")
            return pk.TrainingSession(model, training_cfg(16, 1, replicas), loss=loss,
                                      optimizer=pk.SGD(learning_rate=0.01), backend="xla")
        base = make(1, 1)
        base_inputs = labelled(base)
        for replicas in (2, 4, 8):
            one, split = make(replicas, 1), make(replicas, replicas)
            ione, isplit = labelled(one), labelled(split)
            t = interleaved(repeat, base=functools.partial(base.run, base_inputs),
                            one=functools.partial(one.run, ione),
                            split=functools.partial(split.run, isplit))
            print(f"{mode:<10} R={replicas}: {replicas * t['base'] / t['one']:.2f}x R=1 "
                  f"throughput; one device vs {len(split.runtime.placement.devices)} devices: "
                  f"{t['split'] / t['one']:.2f}x")
    placement.CPU_REPLICA_DEVICES = 1


def cache() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    script = textwrap.dedent(f"""
        import time, sys
        sys.path.insert(0, {here!r})
        from runtime_bench import mlp, training_cfg
        import popart_kit as pk
        model, _, _, loss = mlp(layers=4, label=True)
        sess = pk.TrainingSession(model, training_cfg(16, 4), loss=loss,
                                  optimizer=pk.Adam(learning_rate=0.01), backend="xla")
        start = time.perf_counter(); sess.prepare(); print(time.perf_counter() - start)
    """)
    with tempfile.TemporaryDirectory() as directory:
        times = {}
        for label, setting in (("off", "off"), ("first", directory), ("second", directory)):
            env = {**os.environ, compilation_cache.CACHE_VARIABLE: setting}
            out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                 text=True, check=True)
            times[label] = float(out.stdout.strip().splitlines()[-1])
    print(f"\ncompilation cache (4-layer MLP training step, a fresh process each): prepare "
          f"without the cache {times['off']:.2f}s, filling it {times['first']:.2f}s, from it "
          f"{times['second']:.2f}s ({times['off'] / times['second']:.1f}x faster)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--only", default="per_run,inference,training,accumulation,memory,"
                                           "replication,cache")
    args = parser.parse_args()
    warnings.simplefilter("ignore", pk.PopartKitWarning)
    placement.ensure_host_devices()  # before anything starts JAX, as a session would
    # the hand-written baselines compute float32 products in float32, as the sessions do
    jax.config.update("jax_default_matmul_precision", "float32")
    load = os.getloadavg()
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores,"
          f" load {load[0]:.2f}; jax {jax.__version__} on {jax.devices()[0].platform}; "
          f"onnxruntime {ort.__version__}")
    sections = {"per_run": lambda: per_run(args.repeat),
                "inference": lambda: inference(args.repeat),
                "training": lambda: training(args.repeat),
                "accumulation": lambda: accumulation(args.repeat), "memory": memory,
                "replication": lambda: replication(args.repeat), "cache": cache}
    for name in args.only.split(","):
        sections[name]()
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
