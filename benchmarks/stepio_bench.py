"""StepIOFactory costs against one memcpy of the same bytes, measured in the same run.

    python benchmarks/stepio_bench.py [--sizes-mib 1 32 256] [--repeat 15]

For each size (bytes of one instance's input per run) it times from_samples, check_inputs,
replica (all local replicas) and shard (this instance's share of 2 instances' data) and prints
each against ``numpy.copyto`` of the bytes that operation hands over (the whole run for the view
operations, the shard for shard) into a buffer already in use; ``shard`` allocates its result,
so it is measured against a copy into new memory (first-touch page faults in both), while
``shard out=`` fills this instance's arrays reused run after run. Targets: views cost
microseconds whatever the size; shard within 1.25x of one memcpy of the shard's bytes.
"""

from __future__ import annotations

import argparse
import platform

import numpy as np

import popart_kit as pk
from popart_kit.bench import best_of

BPS, ACCUMULATION, LOCAL, INSTANCES, MICRO_BATCH = 16, 4, 4, 2, 8


def bench(size_mib: float, repeat: int) -> list[tuple[str, float, float]]:
    micro_batches = BPS * ACCUMULATION * LOCAL
    features = max(1, int(size_mib * 2**20 / (4 * micro_batches * MICRO_BATCH)))
    spec = pk.TensorSpec((MICRO_BATCH, features), "float32")
    cfg = pk.SessionConfig(mode="training", batches_per_step=BPS,
                           accumulation={"factor": ACCUMULATION},
                           replication={"local_factor": LOCAL, "global_factor": LOCAL * INSTANCES,
                                        "global_offset": LOCAL})
    io = pk.StepIOFactory(cfg, inputs={"x": spec})
    rng = np.random.default_rng(0)
    samples = rng.standard_normal((micro_batches * MICRO_BATCH, features), dtype=np.float32)
    arrays = io.from_samples({"x": samples})
    glob = rng.standard_normal(pk.input_shape(spec.shape, BPS, ACCUMULATION, LOCAL * INSTANCES),
                               dtype=np.float32)
    run_copy = np.empty_like(samples)
    shard_copy = np.empty(io.input_shape("x"), np.float32)
    shard_bytes = np.ascontiguousarray(glob[:, :, LOCAL:2 * LOCAL])  # as many bytes, contiguous
    reused = io.allocate_inputs()

    memcpy_run = best_of(repeat, lambda: np.copyto(run_copy, samples))
    memcpy_shard = best_of(repeat, lambda: np.copyto(shard_copy, shard_bytes))
    fresh_memcpy_shard = best_of(repeat, lambda: shard_bytes.copy())  # into new memory
    return [
        ("from_samples", best_of(repeat, lambda: io.from_samples({"x": samples})), memcpy_run),
        ("check_inputs", best_of(repeat, lambda: io.check_inputs(arrays)), memcpy_run),
        ("replica x R", best_of(repeat, lambda: [io.replica(arrays, r) for r in range(LOCAL)]),
         memcpy_run),
        ("shard", best_of(repeat, lambda: io.shard({"x": glob})), fresh_memcpy_shard),
        ("shard out=", best_of(repeat, lambda: io.shard({"x": glob}, out=reused)), memcpy_shard),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 32, 256])
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {platform.processor() or ''}, numpy {np.__version__}")
    print(f"layout: bps={BPS} A={ACCUMULATION} R={LOCAL} of G={LOCAL * INSTANCES}, "
          f"micro-batch {MICRO_BATCH}")
    print(f"{'MiB/run':>8} {'operation':<14} {'time':>11} {'memcpy':>11} {'ratio':>9}  target")
    for size in args.sizes_mib:
        for name, seconds, baseline in bench(size, args.repeat):
            if name.startswith("shard"):
                verdict = "ok" if seconds <= 1.25 * baseline else "MISSED (<= 1.25x memcpy)"
            else:
                verdict = "ok" if seconds < 100e-6 else "MISSED (microseconds)"
            print(f"{size:>8g} {name:<14} {seconds * 1e6:>9.1f}us {baseline * 1e6:>9.1f}us "
                  f"{seconds / baseline:>8.3f}x  {verdict}")
    print("baselines: numpy.copyto of the same bytes into a buffer in use; for 'shard', a copy "
          "into new memory (as shard allocates)")


if __name__ == "__main__":
    main()
