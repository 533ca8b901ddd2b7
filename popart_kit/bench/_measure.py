"""Measuring one variant: build, compile (timed apart), warm up, then timed runs of the session
interleaved with its baselines (a hand-written JAX program of the same model; onnxruntime for
inference). Several instances run as a short ``pk.launch`` of :mod:`._worker`."""

from __future__ import annotations

import io
import json
import os
import resource
import sys
import time
import warnings
from typing import Any

import numpy as np

from ..errors import PopartKitError
from ._models import CLASSES, Built, Sizes, build, check_size, load_onnx
from ._timing import Stats, interleaved
from ._variants import Variant

__all__ = ["prepare", "measure", "measure_instances", "rss_mib"]

RESULT = "POPART_KIT_BENCH_RESULT "  # the line a worker instance prints its numbers on


def rss_mib() -> float:
    """This process's resident memory now (MiB), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_of(v: Variant) -> Built:
    """The variant's model: its ONNX file, or the built-in model once its size is checked."""
    training = v.mode == "training"
    if v.onnx is not None:
        return load_onnx(v.onnx, training, v.loss)
    sizes = Sizes(v.width, v.layers, v.seq, v.heads, v.image)
    check_size(v.model, sizes, v.micro_batch,
               v.batches_per_step * v.accumulation * v.replication)
    return build(v.model, sizes, v.micro_batch, v.stages, training)


def prepare(v: Variant, backend: str, built: Built | None = None, cfg: Any = None) -> Any:
    """The variant's session (not compiled)."""
    import popart_kit as pk

    built = built or model_of(v)
    cfg = cfg or v.config("ipu" if backend == "popart" else "offline")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pk.PopartKitWarning)
        if v.mode == "training":
            return pk.TrainingSession(built.proto, cfg, loss=built.loss,
                                      optimizer=pk.SGD(learning_rate=0.01), backend=backend)
        return pk.InferenceSession(built.proto, cfg, anchors={built.output: "All"},
                                   backend=backend)


def inputs_of(sess: Any, built: Built) -> dict[str, np.ndarray]:
    inputs = sess.io.allocate_inputs("random")
    if built.label is not None and built.label in inputs:
        inputs[built.label] = (np.abs(inputs[built.label]) % CLASSES).astype(np.int32)
    return inputs


def _jax_baseline(v: Variant, built: Built, inputs: dict[str, np.ndarray]) -> Any:
    """The same step written by hand: a vmap of the forward over every micro-batch
    (inference), or a scan of bps SGD updates over A x R micro-batches each (training). Like a
    session's run it takes host inputs and returns host outputs (inference) or keeps the
    updated weights on the device (training)."""
    import jax
    import jax.numpy as jnp

    ws = [jnp.asarray(w) for w in built.weights]
    x = inputs[built.x]
    sample = sample_shape(built)
    if v.mode == "inference":
        xs = np.ascontiguousarray(x.reshape((-1, v.micro_batch, *sample)))
        program = jax.jit(jax.vmap(lambda m: built.forward(ws, m)))
        return lambda: np.asarray(program(xs))
    xs = np.ascontiguousarray(x.reshape((v.batches_per_step, -1, *sample)))
    ys = np.ascontiguousarray(inputs[built.label].reshape((v.batches_per_step, -1)))

    def update(w, batch):
        def objective(w):
            p = built.forward(w, batch[0])
            return -jnp.log(p[jnp.arange(p.shape[0]), batch[1]]).mean()
        grads = jax.grad(objective)(w)
        return [a - 0.01 * g for a, g in zip(w, grads, strict=True)], None

    program = jax.jit(lambda w, xs, ys: jax.lax.scan(update, w, (xs, ys))[0])
    return lambda: jax.block_until_ready(program(ws, xs, ys))


def sample_shape(built: Built) -> tuple[int, ...]:
    """One sample's shape: the model input's shape after its micro-batch dimension."""
    import onnx

    model = onnx.load_from_string(built.proto)
    for i in model.graph.input:
        if i.name == built.x:
            return tuple(d.dim_value for d in i.type.tensor_type.shape.dim[1:])
    raise AssertionError(built.x)  # pragma: no cover


def _ort_baseline(built: Built, inputs: dict[str, np.ndarray], sess: Any) -> Any:
    """onnxruntime running the model micro-batch by micro-batch, as many as the step has."""
    import onnx
    import onnxruntime as ort

    model = onnx.load_from_string(built.proto)
    for node in model.graph.node:  # the kit's stage annotations mean nothing to onnxruntime
        kept = [a for a in node.attribute if not a.name.startswith("__")]
        del node.attribute[:]
        node.attribute.extend(kept)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    shapes = {name: tuple(sess.io.inputs[name].shape) for name in inputs}
    feeds = [dict(zip(inputs, row, strict=True)) for row in zip(
        *(a.reshape((-1, *shapes[n])) for n, a in inputs.items()), strict=True)]
    return lambda: [session.run(None, f) for f in feeds]


def measure(v: Variant, backend: str = "xla", repeat: int = 5, warmup: int = 1,
            baselines: bool = True) -> dict[str, Any]:
    """The numbers of one variant run in this process (see ``COLUMNS``)."""
    built = model_of(v)
    start = time.perf_counter()
    sess = prepare(v, backend, built)
    sess.prepare()
    inputs = inputs_of(sess, built)
    sess.run(inputs)  # a pipelined session compiles its stages on the first run
    ready = time.perf_counter() - start
    fns: dict[str, Any] = {"session": lambda: sess.run(inputs)}
    if baselines and built.forward is not None:
        fns["jax"] = _jax_baseline(v, built, inputs)
    if baselines and v.mode == "inference":
        fns["onnxruntime"] = _ort_baseline(built, inputs, sess)
    for name, fn in fns.items():  # the baselines' first (compiling) run, as the session's
        if name != "session":
            fn()
    # with baselines, in turns of blocks (pk.bench.interleaved): each timed in its own steady
    # state, onnxruntime's spinning idle threads kept out of the session's times
    block = min(5, -(-repeat // 3)) if len(fns) > 1 else 1
    times = interleaved(-(-repeat // block), warmup, block=block, **fns)
    return _row(v, sess, times, ready)


def _row(v: Variant, sess: Any, times: dict[str, Stats], ready: float) -> dict[str, Any]:
    t = times["session"]
    plan = sess.plan
    samples = plan.samples_per_step or 0
    row: dict[str, Any] = {
        "compile_s": max(0.0, ready - t.median), "runs": t.runs,
        "step_ms": t.median * 1e3, "step_ms_p25": t.p25 * 1e3, "step_ms_p75": t.p75 * 1e3,
        "step_ms_min": t.min * 1e3, "step_ms_max": t.max * 1e3, "spread": t.spread,
        "samples_per_step": samples * v.instances, "samples_per_s": samples * v.instances
        / t.median, "rss_mib": rss_mib(),
    }
    backend = sess.runtime
    memory = getattr(backend, "memory", None)
    row["step_memory_mib"] = sum(memory.values()) / 2**20 if memory else None
    executor = getattr(backend, "pipeline", None)
    if executor is not None:
        row["bubble_planned"] = executor.schedule.bubble_fraction
        row["bubble_measured"] = executor.measured_bubble
    for name in ("jax", "onnxruntime"):
        if name in times:
            row[f"{name}_step_ms"] = times[name].median * 1e3
            row[f"overhead_vs_{name}"] = t.median / times[name].median
    return row


def measure_instances(v: Variant, repeat: int, warmup: int, timeout: float) -> dict[str, Any]:
    """A variant of several instances: ``pk.launch`` of the worker, each instance timing its
    own session; samples/s is the sum over instances (each reports its own)."""
    from ..launcher import launch

    out, err = io.StringIO(), io.StringIO()
    program = [sys.executable, "-m", "popart_kit.bench._worker",
               json.dumps({"variant": v.to_dict(), "repeat": repeat, "warmup": warmup})]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fork.*")  # JAX's threads; exec follows
        status = launch(program, num_instances=v.instances, num_replicas=v.replication,
                        ipus_per_replica=v.stages, timeout=timeout, fault_timeout=10.0,
                        out=out, err=err)
    found = [json.loads(line.split(RESULT, 1)[1]) for line in out.getvalue().splitlines()
             if RESULT in line]
    if status or len(found) != v.instances:
        tail = (err.getvalue() + out.getvalue())[-1500:]
        raise PopartKitError(f"bench: variant {v.name}: {v.instances} instances exited with "
                             f"status {status}, {len(found)} reported:\n{tail}",
                             rule="K-bench-instances")
    first = found[0]
    first["samples_per_s"] = sum(r["samples_per_s"] for r in found)
    first["rss_mib"] = sum(r["rss_mib"] for r in found)
    return first
