"""Data-parallel training over several instances: one script for `popart-kit launch` and poprun.

    popart-kit launch --num-instances 2 --num-replicas 4 -- python3 examples/distributed_training.py
    poprun --num-instances 2 --num-replicas 4 --ipus-per-replica 1 \\
        python3 examples/distributed_training.py            # on IPUs, the popart backend
    python3 examples/distributed_training.py --replicas 4  # one instance, four local replicas
    popart-kit launch --num-instances 2 --num-replicas 4 --ipus-per-replica 2 -- \
        python3 examples/distributed_training.py --pipeline  # each replica two pipeline stages

Each instance takes its replication from the environment the launcher (or poprun) gives it
(``cfg.with_popdist_env()``), generates the same global data (seeded) and feeds only its own
replicas' share (``sess.io.shard``). Gradients are reduced over every replica of every
instance, so all instances end with the same weights - the weights one instance with all the
replicas reaches. ``--out DIR`` writes each instance's weights and anchors to
``DIR/instance<i>.npz``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

import numpy as np

import popart_kit as pk

FEATURES, HIDDEN, CLASSES, MICRO = 8, 16, 4, 4


def build(pipelined: bool = False) -> tuple[bytes, dict[str, str]]:
    """The model; ``pipelined``: its hidden layer on pipeline stage 0 (IPU 0), the rest on
    stage 1 (IPU 1)."""
    rng = np.random.default_rng(0)
    b = pk.Builder()
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [MICRO, FEATURES]), debugContext="x")
    label = b.addInputTensor(pk.TensorInfo("INT32", [MICRO]), debugContext="label")
    w1 = b.addInitializedInputTensor(rng.normal(0, 0.5, (FEATURES, HIDDEN)).astype(np.float32))
    w2 = b.addInitializedInputTensor(rng.normal(0, 0.5, (HIDDEN, CLASSES)).astype(np.float32))

    def on_stage(stage: int) -> contextlib.AbstractContextManager:
        if not pipelined:
            return contextlib.nullcontext()
        both = contextlib.ExitStack()
        both.enter_context(b.pipelineStage(stage))
        both.enter_context(b.virtualGraph(stage))
        return both

    with on_stage(0):
        hidden = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1])])
    with on_stage(1):
        probs = b.aiOnnx.softmax([b.aiOnnx.matmul([hidden, w2])], axis=1)
        loss = b.aiGraphcore.nllloss([probs, label], pk.ReductionType.Mean)
    return b.getModelProto(), {"x": x, "label": label, "probs": probs, "loss": loss}


def global_data(step: int, bps: int, accumulation: int, replicas: int,
                names: dict[str, str]) -> dict[str, np.ndarray]:
    """Inputs of one step for all global replicas, [bps, A, G, ...] without factors of 1."""
    rng = np.random.default_rng(step)
    lead = (bps, accumulation, replicas)
    x = rng.normal(0, 1, (*lead, MICRO, FEATURES)).astype(np.float32)
    label = rng.integers(0, CLASSES, (*lead, MICRO)).astype(np.int32)
    keep = tuple(n for n in lead if n != 1)
    return {names["x"]: x.reshape(*keep, MICRO, FEATURES),
            names["label"]: label.reshape(*keep, MICRO)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1,
                        help="local replicas when not launched by popart-kit launch / poprun")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batches-per-step", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--inference", action="store_true", help="run inference only")
    parser.add_argument("--pipeline", action="store_true",
                        help="two pipeline stages per replica (launch with --ipus-per-replica 2)")
    parser.add_argument("--stage-processes", action="store_true",
                        help="with --pipeline on the xla backend: each stage in a worker "
                             "process of its own (pipeline_workers='processes')")
    parser.add_argument("--backend", default="auto", choices=("auto", "xla", "popart"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model, names = build(args.pipeline)
    accumulation = 1 if args.inference else args.accumulation
    cfg = pk.SessionConfig(mode="inference" if args.inference else "training",
                           batches_per_step=args.batches_per_step,
                           ipus_per_replica=2 if args.pipeline else 1,
                           pipeline=pk.Pipeline(enabled=args.pipeline),
                           replication=pk.Replication(local_factor=args.replicas),
                           accumulation=pk.Accumulation(factor=accumulation, reduction="mean"))
    if "POPDIST_NUM_TOTAL_REPLICAS" in os.environ:  # started by popart-kit launch or poprun
        cfg = cfg.with_popdist_env()
    rep = cfg.replication
    options = {"pipeline_workers": "processes"} if args.stage_processes else {}
    if args.inference:
        sess = pk.InferenceSession(model, cfg, anchors={names["probs"]: "All"},
                                   backend=args.backend, **options)
    else:
        sess = pk.TrainingSession(model, cfg, loss=names["loss"], optimizer=pk.SGD(0.5),
                                  anchors={names["loss"]: "All"}, backend=args.backend,
                                  **options)
    anchors = []
    start = time.perf_counter()
    for step in range(args.steps):
        data = global_data(step, args.batches_per_step, accumulation, rep.global_replicas, names)
        anchors.append(sess.run(sess.io.shard(data)))
    elapsed = time.perf_counter() - start
    name = names["probs"] if args.inference else names["loss"]
    last = anchors[-1][name]
    print(f"instance {rep.instance_index} of {rep.instances}: replicas "
          f"{list(rep.replica_ids)} of {rep.global_replicas}; {name} anchor {last.shape}, "
          f"mean {last.mean():.6f}; {args.steps} steps in {elapsed:.2f} s")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        weights = sess.weights()
        np.savez(args.out / f"instance{rep.instance_index}.npz",
                 **{f"weight:{k}": v for k, v in weights.items()},
                 **{f"anchor:{s}": a[name] for s, a in enumerate(anchors)})


if __name__ == "__main__":
    main()
