"""Pipelined vs unpipelined on the xla backend: measured vs planned bubble and speedup.

A compute-bound model with balanced stages (each stage: ``--layers`` matmuls of a [mb, D] x
[D, D] and tanh) runs pipelined over K stages (one device each) and unpipelined (one device),
one XLA thread per device (``--xla_cpu_multi_thread_eigen=false``), in the same process so the
ratios share the machine's load. Reported per K: the schedule's bubble (K-1)/(M+K-1), the
bubble measured from the executor's trace, and the speedup planned for the cores available
against the measured one.

Planned speedup: unpipelined, one device does all M x K stage-passes one after the other;
pipelined, K devices share ``cores`` cores: a run takes at least M + K - 1 slots (the schedule)
and at least M x K / min(K, cores) slots (the work), so the planned speedup is
M x K / max(M + K - 1, M x K / min(K, cores)). On a 2-core machine K = 4 stages cannot be
faster than 2x, however small the bubble. XLA:CPU does not run K virtual devices fully in
parallel even with K free cores, so the script also measures that ceiling - K independent
copies of one stage's program on K devices at once against one after the other - and gives the
speedup planned with it (``parallel`` devices instead of ``min(K, cores)``).

    python benchmarks/pipeline_bench.py [--stages 2 4] [--micro-batches 16] [--training]
"""

from __future__ import annotations

import argparse
import os
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                                   "intra_op_parallelism_threads=1")

import numpy as np  # noqa: E402

import popart_kit as pk  # noqa: E402
from popart_kit.bench import best_of  # noqa: E402


def model(stages: int, width: int, layers: int, micro: int):
    rng = np.random.default_rng(0)
    b = pk.Builder()
    pb = pk.PipelineBuilder(b)
    h = x = b.addInputTensor(pk.TensorInfo("FLOAT", [micro, width]), debugContext="x")
    for s in range(stages):
        with pb.stage(s):
            for i in range(layers):
                w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
                h = b.aiOnnx.tanh([b.aiOnnx.matmul([h, b.addInitializedInputTensor(
                    w, f"w{s}_{i}")])])
            if s == stages - 1:
                loss = b.aiOnnx.reducesumsquare([h], keepdims=0)
    return b.getModelProto(), x, h, loss


def session(stages, pipelined, training, args):
    proto, x, y, loss = model(stages, args.width, args.layers, args.micro)
    depth = 2 * stages - 1 if training else stages
    m = max(args.micro_batches, depth)
    cfg = pk.SessionConfig(mode="training" if training else "inference",
                           batches_per_step=1 if training else m,
                           accumulation={"factor": m if training else 1},
                           ipus_per_replica=stages, pipeline={"enabled": pipelined},
                           device={"target": "offline"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if training:
            sess = pk.TrainingSession(proto, cfg, loss=loss, optimizer=pk.SGD(learning_rate=1e-4),
                                      anchors={loss: "Final"}, backend="xla")
        else:
            sess = pk.InferenceSession(proto, cfg, anchors={y: "Final"}, backend="xla")
    feed = {x: np.random.default_rng(1).standard_normal(sess.io.input_shape(x))
            .astype(np.float32)}
    return sess, feed, m, depth


def device_parallelism(k: int, args: argparse.Namespace) -> float:
    """How much faster K devices run K independent copies of one stage's program at once (one
    thread each) than one device after the other: what the platform gives a K-stage pipeline."""
    import threading

    import jax
    import jax.numpy as jnp

    def stage(w: jax.Array, x: jax.Array) -> jax.Array:
        for _ in range(args.layers):
            x = jnp.tanh(x @ w)
        return x

    devices = jax.devices()[:k]
    program = jax.jit(stage)
    rng = np.random.default_rng(0)
    ws = [jax.device_put(rng.standard_normal((args.width, args.width)).astype(np.float32)
                         / args.width, d) for d in devices]
    xs = [jax.device_put(rng.standard_normal((args.micro, args.width)).astype(np.float32), d)
          for d in devices]

    def one(i: int) -> None:
        for _ in range(args.micro_batches):
            program(ws[i], xs[i]).block_until_ready()

    def together() -> None:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    sequential = best_of(args.repeat, lambda: [one(i) for i in range(k)])
    return sequential / best_of(args.repeat, together)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--training", action="store_true")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    mode = "training" if args.training else "inference"
    print(f"{mode}, {cores} cores, load {os.getloadavg()[0]:.2f}, one XLA thread per device, "
          f"mb {args.micro} x {args.width}, {args.layers} matmul+tanh per stage")
    print(f"{'K':>2} {'M':>3} {'planned':>8} {'measured':>8}   {'unpiped':>8} {'threads':>8} "
          f"{'dispatch':>8}   {'speedup':>7} {'planned':>7}   {'parallel':>8} {'planned':>7}")
    for k in args.stages:
        piped, feed, m, depth = session(k, True, args.training, args)
        plain, _, _, _ = session(k, False, args.training, args)
        executor = piped._backend.pipeline
        t_plain = best_of(args.repeat, lambda p=plain, f=feed: p.run(f))
        executor.threads = True
        t_threads = best_of(args.repeat, lambda p=piped, f=feed: p.run(f))
        measured = executor.measured_bubble
        executor.threads = False
        t_dispatch = best_of(args.repeat, lambda p=piped, f=feed: p.run(f))
        planned_bubble = piped.schedule.bubble_fraction
        # the unit of work is one stage pass; training's loss stage does F and B in one slot
        passes = m * k
        planned = passes / max(m + depth - 1, passes / min(k, cores))
        best = min(t_threads, t_dispatch)
        # training: a device holds a forward and a backward pipeline stage of unequal cost, so
        # neither the grid's bubble nor this speedup formula describes its devices; not planned
        parallel = device_parallelism(k, args)
        with_ceiling = passes / max(m + depth - 1, passes / parallel)
        shown = "    n/a" if args.training else f"{planned:>6.2f}x"
        ceiling = "    n/a" if args.training else f"{with_ceiling:>6.2f}x"
        print(f"{k:>2} {m:>3} {planned_bubble:>8.1%} {measured:>8.1%}   {t_plain * 1e3:>6.1f}ms "
              f"{t_threads * 1e3:>6.1f}ms {t_dispatch * 1e3:>6.1f}ms   "
              f"{t_plain / best:>6.2f}x {shown}   {parallel:>7.2f}x {ceiling}")


if __name__ == "__main__":
    main()
