"""The main job: train a small classifier with popart_kit on the embedded runtime.

    python examples/train.py [--config examples/configs/train_classifier.toml] [--runs 40]

A two-layer network is built with the PopART-compatible Builder in two pipeline stages, trained
on generated data (ten Gaussian classes in 64 features, like scikit-learn's digits) with
replicas, gradient accumulation and device iterations as the config says, then evaluated on
held-out samples. It prints the plan, a progress bar with the loss, and accuracy and samples/s.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

import popart_kit as pk

FEATURES, HIDDEN, CLASSES = 64, 128, 10
HERE = Path(__file__).parent


def dataset(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Ten classes of Gaussian blobs around fixed centres (the same centres for every seed)."""
    centres = np.random.default_rng(1234).normal(0.0, 1.0, (CLASSES, FEATURES))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, samples).astype(np.int32)
    features = centres[labels] + rng.normal(0.0, 3.0, (samples, FEATURES))
    return features.astype(np.float32), labels


def build(micro_batch: int) -> tuple[bytes, dict[str, str]]:
    """The classifier in two pipeline stages: stage 0 on IPU 0, stage 1 on IPU 1."""
    rng = np.random.default_rng(0)
    b = pk.Builder()
    pb = pk.PipelineBuilder(b)
    x = b.addInputTensor(pk.TensorInfo("FLOAT", [micro_batch, FEATURES]), debugContext="x")
    label = b.addInputTensor(pk.TensorInfo("INT32", [micro_batch]), debugContext="label")
    with pb.stage(0):
        w1 = b.addInitializedInputTensor(
            (rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES)).astype(np.float32))
        h = b.aiOnnx.relu([b.aiOnnx.matmul([x, w1])])
    with pb.stage(1):
        w2 = b.addInitializedInputTensor(
            (rng.standard_normal((HIDDEN, CLASSES)) / np.sqrt(HIDDEN)).astype(np.float32))
        probs = b.aiOnnx.softmax([b.aiOnnx.matmul([h, w2])], axis=1)
        loss = b.aiGraphcore.nllloss([probs, label], pk.ReductionType.Mean)
    return b.getModelProto(), {"x": x, "label": label, "probs": probs, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(HERE / "configs" / "train_classifier.toml"))
    parser.add_argument("--runs", type=int, default=40, help="training steps (session runs)")
    parser.add_argument("--learning-rate", type=float, default=0.01,
                        help="SGD learning rate, momentum 0.9 (default 0.01)")
    parser.add_argument("--backend", default="auto", choices=("auto", "xla", "popart"))
    args = parser.parse_args()
    console = Console()
    warnings.simplefilter("ignore", pk.PopartKitWarning)

    try:
        cfg = pk.SessionConfig.from_file(args.config)
        plan = cfg.plan()
        console.print(plan.render())
        model, t = build(cfg.micro_batch_size or 16)
        session = pk.TrainingSession(model, cfg, loss=t["loss"],
                                     optimizer=pk.SGD(learning_rate=args.learning_rate,
                                                      momentum=0.9),
                                     anchors={t["loss"]: "All"}, backend=args.backend)
        plan = session.plan
    except pk.PopartKitError as err:
        console.print(f"[red]{args.config} does not fit this example.[/red] train.py trains a "
                      f"classifier in 2 pipeline stages: it takes a training config "
                      f"(mode='training') of one instance with pipeline.stages 2 or unset, "
                      f"e.g. examples/configs/train_classifier.toml.\n{err}", soft_wrap=True)
        raise SystemExit(2) from None
    except ImportError as err:  # --backend popart without the Poplar SDK
        console.print(f"[red]--backend {args.backend} cannot run here:[/red] {err}",
                      soft_wrap=True)
        raise SystemExit(2) from None
    console.print(f"backend: [bold]{session.backend}[/bold]; {plan.samples_per_step} samples "
                  f"per run on {plan.local_replicas} replicas")
    features, labels = dataset(plan.samples_per_step * args.runs, seed=1)
    runs = session.io.batches({"x": f, "label": y} for f, y in zip(features, labels, strict=True))

    session.prepare()
    losses, started = [], time.perf_counter()
    columns = (TextColumn("training"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=args.runs, loss=float("nan"))
        for inputs in runs:
            try:
                losses.append(float(session.run(inputs)[t["loss"]].mean()))
            except pk.NonFiniteUpdate as err:  # the weights are as before this run
                progress.stop()
                console.print(f"[red]training diverged at run {len(losses) + 1}[/red] "
                              f"(learning rate {args.learning_rate}): {err}\nTry a lower "
                              f"--learning-rate.", soft_wrap=True)
                raise SystemExit(1) from None
            progress.update(task, advance=1, loss=losses[-1])
    seconds = time.perf_counter() - started

    test_x, test_y = dataset(2048, seed=2)
    infer_cfg = pk.SessionConfig(mode="inference", batches_per_step=2048 // cfg.micro_batch_size,
                                 device={"target": "offline"})
    evaluator = pk.InferenceSession(session.model_proto(), infer_cfg,
                                    anchors={t["probs"]: "All"}, backend="xla")
    io = evaluator.io
    probs = evaluator.run({"x": test_x.reshape(io.input_shape("x")),
                           "label": test_y.reshape(io.input_shape("label"))})[t["probs"]]
    accuracy = float((probs.reshape(-1, CLASSES).argmax(1) == test_y).mean())
    console.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} runs "
                  f"({len(losses) * cfg.batches_per_step} weight updates); held-out accuracy "
                  f"{accuracy:.1%}; {plan.samples_per_step * len(losses) / seconds:,.0f} "
                  f"samples/s")
    if runs.dropped:
        console.print(f"{runs.dropped} samples did not fill a last run")


if __name__ == "__main__":
    main()
