"""Pipelined vs unpipelined on the xla backend: measured vs planned bubble and speedup.

A compute-bound model with balanced stages (each stage: ``--layers`` matmuls of a [mb, D] x
[D, D] and tanh) runs pipelined over K stages and unpipelined, in the same process so the
ratios share the machine's load. One thread per device: the unpipelined run is this process
with one CPU device and one XLA thread (``PJRT_NPROC=1``), and the pipelined run puts each stage
in a worker process of its own with one thread (``pipeline_workers="processes"``), kept to a
core of its own where there are enough. XLA:CPU gives
all virtual devices of one process a single shared thread pool, so stages on virtual devices of
one process (``--workers threads``) cannot compute side by side, whatever the cores.

Reported per K: the schedule's bubble (K-1)/(M+K-1), the bubble measured from the executor's
trace, and the speedup planned for the cores available against the measured one. Planned:
unpipelined, one thread does all M x K stage-passes one after the other; pipelined, K stages
share ``cores`` cores, so a run takes at least M + K - 1 slots (the schedule) and at least
M x K / min(K, cores) slots (the work): the planned speedup is M x K / max(M + K - 1,
M x K / min(K, cores)). On a 2-core machine K = 4 stages cannot be faster than 2x, however
small the bubble. Training counts a slot as a forward and a backward (of different
micro-batches on each device in the main phase, each costing about as much as the loss
stage's forward+backward); its 2K - 1 pipeline stages take M + 2K - 2 slots. Fill and flush
slots hold only one of the two passes, so the training plan is conservative.

    python benchmarks/pipeline_bench.py [--stages 2 4] [--micro-batches 16] [--training]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ["PJRT_NPROC"] = "1"  # one XLA thread for this process's device (read at start)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import popart_kit as pk  # noqa: E402
from popart_kit.bench import interleaved


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


def session(stages, pipelined, training, args, workers="threads"):
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
                                      anchors={loss: "Final"}, backend="xla",
                                      pipeline_workers=workers)
        else:
            sess = pk.InferenceSession(proto, cfg, anchors={y: "Final"}, backend="xla",
                                       pipeline_workers=workers)
    feed = {x: np.random.default_rng(1).standard_normal(sess.io.input_shape(x))
            .astype(np.float32)}
    return sess, feed, m, depth


def stage_copy(args: argparse.Namespace) -> None:
    """Print the seconds 2 x ``--micro-batches`` passes of one stage's work (``--layers``
    matmul+tanh of a [micro, width] batch) take on this process's one thread, from a line on
    stdin (run as a copy by ``concurrency``)."""
    import time

    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((args.width, args.width)).astype(np.float32)
                      / args.width) for _ in range(args.layers)]
    x = jnp.asarray(rng.standard_normal((args.micro, args.width)).astype(np.float32))

    @jax.jit
    def stage(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    stage(ws, x).block_until_ready()
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    start = time.perf_counter()
    for _ in range(args.micro_batches * 2):
        stage(ws, x).block_until_ready()
    print(f"{time.perf_counter() - start:.6f}", flush=True)


def concurrency(k: int, args: argparse.Namespace) -> float:
    """How much work K single-threaded processes, each doing one stage's work, get done at
    once against one alone (K x one alone's time / their time): the most a K-stage pipeline
    of one-thread devices can gain on this machine."""
    import subprocess

    def together(n: int) -> float:
        cmd = [sys.executable, __file__, "--stage-copy", "--layers", str(args.layers),
               "--width", str(args.width), "--micro", str(args.micro),
               "--micro-batches", str(args.micro_batches), "--repeat", str(args.repeat)]
        procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True) for _ in range(n)]
        for p in procs:
            p.stdout.readline()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        return max(float(p.communicate()[0]) for p in procs)  # until the last is done

    alone, all_k = [], []
    for _ in range(3):  # interleaved: the machine's load changes as it goes
        alone.append(together(1))
        all_k.append(together(k))
    return k * float(np.median(alone)) / float(np.median(all_k))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--training", action="store_true")
    parser.add_argument("--workers", choices=["processes", "threads"], default="processes",
                        help="where the pipelined stages run (threads: virtual devices of this "
                             "process, which share its one thread)")
    parser.add_argument("--stage-copy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage_copy:
        return stage_copy(args)
    jax.config.update("jax_num_cpu_devices", 1 if args.workers == "processes" else
                      max(args.stages))
    jax.devices()  # start JAX now, with that many devices
    cores = len(os.sched_getaffinity(0))
    mode = "training" if args.training else "inference"
    print(f"{mode}, {cores} cores, load {os.getloadavg()[0]:.2f}, one XLA thread per device, "
          f"stages in {args.workers}, mb {args.micro} x {args.width}, {args.layers} "
          f"matmul+tanh per stage")
    print(f"{'K':>2} {'M':>3} {'bubble':>7} {'measured':>8}   {'unpiped':>8} {'piped':>8}   "
          f"{'speedup':>7} {'planned':>7}   {'parallel':>8} {'planned':>7} {'reached':>7}")
    for k in args.stages:
        piped, feed, m, depth = session(k, True, args.training, args, args.workers)
        plain, _, _, _ = session(k, False, args.training, args)
        workers = piped.runtime.pipeline.processes
        if workers is not None:
            workers.threads, workers.pin = 1, True  # one thread per device, a core each
        piped.prepare()  # start the stage workers
        times = interleaved(args.repeat, plain=lambda p=plain, f=feed: p.run(f),
                            piped=lambda p=piped, f=feed: p.run(f))
        t_plain, t_piped = times["plain"].median, times["piped"].median
        piped.run(feed)
        measured = piped.runtime.pipeline.measured_bubble
        piped_bubble = piped.schedule.bubble_fraction
        piped.close()  # its workers stop before the machine is measured
        passes = m * k  # the unit of work is one stage pass
        planned = passes / max(m + depth - 1, passes / min(k, cores))
        parallel = concurrency(k, args)
        # this machine's timings swing by 10-25 % over seconds, so the measured concurrency
        # can come out above what the cores allow: the plan takes the smaller of the two
        with_parallel = passes / max(m + depth - 1, passes / min(parallel, k, cores))
        speedup = t_plain / t_piped
        shown = (f"{planned:>6.2f}x   {parallel:>7.2f}x {with_parallel:>6.2f}x "
                 f"{speedup / with_parallel:>7.0%}")
        print(f"{k:>2} {m:>3} {piped_bubble:>7.1%} {measured:>8.1%}   "
              f"{t_plain * 1e3:>6.1f}ms {t_piped * 1e3:>6.1f}ms   {speedup:>6.2f}x {shown}")


if __name__ == "__main__":
    main()
