"""Global replication on this host: 2 instances x 2 replicas against 1 instance x 4 replicas.

    python benchmarks/distributed_bench.py [--repeat 3] [--runs 20] [--hidden 256]

Both train the same MLP on the same global batches (bps 16 SGD updates per run, 4 replicas in
all), measured in the same invocation, alternated ``--repeat`` times (each the median of
``--runs`` runs after a warm-up, timed by ``popart_kit.bench``); the ratio is the median
2 x 2 samples/s over the median 1 x 4 samples/s. The expected overhead is the gloo all-reduce
of the gradients between the processes, reported per update: a program that does nothing but
all-reduce gradient-shaped arrays over the two instances, timed inside the 2 x 2 run.
(Both layouts share the host's cores, so the 2 x 2 run also pays for two processes' threads.)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys

import numpy as np

import popart_kit as pk

BPS, MICRO, FEATURES, CLASSES = 16, 8, 64, 10


def build(hidden: int) -> tuple[bytes, dict[str, str]]:
    rng = np.random.default_rng(0)
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [MICRO, FEATURES]))
    label = b.addInputTensor(pk.TensorInfo("INT32", [MICRO]))
    w1 = b.addInitializedInputTensor(rng.normal(0, 0.1, (FEATURES, hidden)).astype(np.float32))
    w2 = b.addInitializedInputTensor(rng.normal(0, 0.1, (hidden, hidden)).astype(np.float32))
    w3 = b.addInitializedInputTensor(rng.normal(0, 0.1, (hidden, CLASSES)).astype(np.float32))
    h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1])])
    h = b.aiOnnx.relu([b.aiOnnx.matmul([h, w2])])
    probs = b.aiOnnx.softmax([b.aiOnnx.matmul([h, w3])], axis=1)
    loss = b.aiGraphcore.nllloss([probs, label], pk.ReductionType.Mean)
    return b.getModelProto(), {"x": x, "label": label, "loss": loss}


def allreduce_seconds(shapes: list[tuple[int, ...]], count: int = 50) -> float:
    """Seconds per all-reduce of the float32 gradients of weights of ``shapes`` over every
    process's device, as training does it: one flat buffer."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = [[d for d in jax.devices() if d.process_index == p][:1]
               for p in range(jax.process_count())]
    mesh = Mesh(np.array(devices), ("process", "replica"))

    def body(_: int, grads: list) -> list:
        return [jax.lax.psum(g, ("process", "replica")) * 0.5 for g in grads]

    program = jax.jit(jax.shard_map(lambda g: jax.lax.fori_loop(0, count, body, g), mesh=mesh,
                                    in_specs=P(), out_specs=P(), check_vma=False))
    size = sum(int(np.prod(s)) for s in shapes)
    grads = [jax.make_array_from_process_local_data(NamedSharding(mesh, P()),
                                                    np.ones(size, np.float32))]
    return pk.bench.best_of(3, lambda: jax.block_until_ready(program(grads))) / count


def worker(args: argparse.Namespace) -> None:
    model, names = build(args.hidden)
    cfg = pk.SessionConfig(mode="training", batches_per_step=BPS,
                           replication=pk.Replication(local_factor=args.replicas))
    if "POPDIST_NUM_TOTAL_REPLICAS" in os.environ:
        cfg = cfg.with_popdist_env()
    sess = pk.TrainingSession(model, cfg, loss=names["loss"], optimizer=pk.SGD(0.01),
                              backend="xla")
    rng = np.random.default_rng(0)
    g = cfg.replication.global_replicas
    data = {names["x"]: rng.normal(0, 1, (BPS, g, MICRO, FEATURES)).astype(np.float32),
            names["label"]: rng.integers(0, CLASSES, (BPS, g, MICRO)).astype(np.int32)}
    share = sess.io.shard(data)
    sess.run(share)  # compile
    step = pk.bench.interleaved(args.runs, run=lambda: sess.run(share))["run"].median
    result = {"samples_per_s": BPS * g * MICRO / step, "update_ms": 1e3 * step / BPS}
    if cfg.replication.is_distributed:
        shapes = [w.shape for w in sess.weights().values()]
        result["allreduce_ms"] = 1e3 * allreduce_seconds(shapes)
    if cfg.replication.instance_index == 0:
        print("RESULT " + json.dumps(result), flush=True)


def measure(layout: str, args: argparse.Namespace) -> dict:
    me = [sys.executable, os.path.abspath(__file__), "--worker", "--runs", str(args.runs),
          "--hidden", str(args.hidden)]
    if layout == "1x4":
        text = subprocess.run([*me, "--replicas", "4"], capture_output=True, text=True,
                              check=True, timeout=600).stdout
    else:
        out, err = io.StringIO(), io.StringIO()
        status = pk.launch(me, num_instances=2, num_replicas=4, timeout=600, out=out, err=err)
        if status:
            raise SystemExit(f"2 x 2 failed ({status}):\n{err.getvalue()}{out.getvalue()}")
        text = out.getvalue()
    line = next(x for x in text.splitlines() if "RESULT " in x)
    return json.loads(line.split("RESULT ", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    found: dict[str, list[dict]] = {"1x4": [], "2x2": []}
    for _ in range(args.repeat):
        for layout in found:
            found[layout].append(measure(layout, args))
    one = statistics.median(r["samples_per_s"] for r in found["1x4"])
    two = statistics.median(r["samples_per_s"] for r in found["2x2"])
    update = {k: statistics.median(r["update_ms"] for r in v) for k, v in found.items()}
    reduce_ms = statistics.median(r["allreduce_ms"] for r in found["2x2"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"MLP {FEATURES}-{args.hidden}-{args.hidden}-{CLASSES}, micro-batch {MICRO}, bps {BPS}, "
          f"4 replicas; {os.cpu_count()} cores, load {load:.2f}")
    print(f"1 x 4: {one:10.0f} samples/s, {update['1x4']:.3f} ms per update")
    print(f"2 x 2: {two:10.0f} samples/s, {update['2x2']:.3f} ms per update")
    print(f"ratio 2 x 2 / 1 x 4 throughput: {two / one:.3f}")
    print(f"gloo all-reduce of the gradients ({args.hidden * (FEATURES + args.hidden + CLASSES)} "
          f"floats) per update: {reduce_ms:.3f} ms")
    return None


if __name__ == "__main__":
    main()
