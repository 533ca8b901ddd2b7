"""Sessions of every combination of replication, accumulation, pipelining (off, stage threads,
stage processes) and instances, on the model and data of examples/distributed_training.py, and
the one-replica sequential reference each must equal. Run as a script by each instance of
`popart-kit launch` (``python combinations.py OUT``), it runs the combinations for several
instances and saves each one's results to ``OUT/<combination>.instance<i>.npz``."""

from __future__ import annotations

import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import popart_kit as pk

EXAMPLE = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "distributed_training.py"))
BPS, STEPS = 2, 2


@dataclass(frozen=True)
class Combination:
    mode: str            # "training" or "inference"
    replicas: int        # global replicas
    accumulation: int
    pipeline: str        # "off", "threads" or "processes"
    instances: int = 1

    @property
    def name(self) -> str:
        return (f"{self.mode}-r{self.replicas}-a{self.accumulation}-{self.pipeline}"
                f"-i{self.instances}")

    def config(self) -> pk.SessionConfig:
        piped = self.pipeline != "off"
        cfg = pk.SessionConfig(
            mode=self.mode, batches_per_step=BPS, ipus_per_replica=2 if piped else 1,
            pipeline=pk.Pipeline(enabled=piped),
            replication=pk.Replication(local_factor=self.replicas // self.instances),
            accumulation=pk.Accumulation(factor=self.accumulation, reduction="mean"))
        return cfg.with_popdist_env() if self.instances > 1 else cfg


def run(c: Combination) -> dict[str, np.ndarray]:
    """The combination's weights after STEPS runs and its anchors (this instance's share),
    as ``weight:<id>`` and ``anchor:<step>``."""
    model, names = EXAMPLE["build"](c.pipeline != "off")
    cfg = c.config()
    options = {"pipeline_workers": "processes"} if c.pipeline == "processes" else {}
    if c.mode == "training":
        sess = pk.TrainingSession(model, cfg, loss=names["loss"], optimizer=pk.SGD(0.5),
                                  anchors={names["loss"]: "All"}, backend="xla", **options)
        anchor = names["loss"]
    else:
        sess = pk.InferenceSession(model, cfg, anchors={names["probs"]: "All"}, backend="xla",
                                   **options)
        anchor = names["probs"]
    out = {}
    with sess:
        for step in range(STEPS):
            data = EXAMPLE["global_data"](step, BPS, c.accumulation, c.replicas, names)
            out[f"anchor:{step}"] = sess.run(sess.io.shard(data))[anchor]
        out.update((f"weight:{k}", v) for k, v in sess.weights().items())
    return out


def reference(c: Combination) -> dict[str, np.ndarray]:
    """The one-replica sequential run of the same global data: training as one replica
    accumulating all A x G micro-batches of an update (mean reduction: the same update);
    inference as bps x G micro-batches. Anchors come back in the combination's global layout
    ([bps, A, G, ...] without factors of 1)."""
    model, names = EXAMPLE["build"](False)
    g, a = c.replicas, c.accumulation
    training = c.mode == "training"
    cfg = pk.SessionConfig(mode=c.mode, batches_per_step=BPS if training else BPS * g,
                           accumulation=pk.Accumulation(factor=a * g if training else 1,
                                                        reduction="mean"))
    if training:
        sess = pk.TrainingSession(model, cfg, loss=names["loss"], optimizer=pk.SGD(0.5),
                                  anchors={names["loss"]: "All"}, backend="xla")
        anchor = names["loss"]
    else:
        sess = pk.InferenceSession(model, cfg, anchors={names["probs"]: "All"}, backend="xla")
        anchor = names["probs"]
    lead = tuple(n for n in (BPS, a, g) if n != 1)
    out = {}
    with sess:
        for step in range(STEPS):
            data = EXAMPLE["global_data"](step, BPS, a, g, names)
            flat = {k: v.reshape(sess.io.input_shape(k)) for k, v in data.items()}
            found = sess.run(flat)[anchor]  # [micro-batches, ...] (training: the losses)
            out[f"anchor:{step}"] = found.reshape(*lead, *found.shape[1:] if not training
                                                  else ())
        out.update((f"weight:{k}", v) for k, v in sess.weights().items())
    return out


def distributed(instances: int) -> list[Combination]:
    """The combinations run over ``instances`` instances (one launch runs them all)."""
    return [Combination(mode, instances, acc, pipe, instances)
            for mode, acc in (("training", 4), ("inference", 1))
            for pipe in ("off", "threads", "processes")]


def main(out: Path) -> None:
    rep = pk.SessionConfig(mode="inference").with_popdist_env().replication
    for c in distributed(rep.instances):
        np.savez(out / f"{c.name}.instance{rep.instance_index}.npz", **run(c))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
