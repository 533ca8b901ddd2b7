"""PopART's pipeline schedule as data: which stage does what to which micro-batch, and when.

Pure (no JAX, no I/O). A :class:`PipelineSchedule` is a list of :class:`Action` s, each a
(time slot, stage, kind, micro-batch): ``F`` a stage's forward pass, ``B`` its backward pass,
``U`` its weight update. It prints as a stage x time grid (:meth:`~PipelineSchedule.render`),
dumps as JSON (:meth:`~PipelineSchedule.to_json`), checks itself (:meth:`~PipelineSchedule.
validate`) and is what the xla backend's pipeline executor runs.

The arithmetic is PopART's implicit pipelining (``willow/src/transforms/pipeline.cpp``,
``PipelineInfo``): F forward stages give K pipeline stages - F for inference, 2F - 1 for
training, the backward of stage s being pipeline stage 2F - 2 - s (the last forward stage and
its backward are one stage, the loss stage). In cycle ``t`` pipeline stage ``p`` works on
micro-batch ``t - p`` when there is one: K - 1 fill cycles, M - K + 1 main cycles, K - 1
flush cycles, M + K - 1 in all, so a fraction ``(K - 1) / (M + K - 1)`` of every stage's
cycles is idle - the plan's bubble.

* **inference**: one fill-drain of the step's micro-batches.
* **training with gradient accumulation**: per weight update, a fill-drain of its A
  micro-batches, then one slot in which every stage applies its accumulated gradient.
* **training without accumulation** ("continuous pipelining"): one fill-drain of the step's
  micro-batches; each backward is followed, in the same cycle, by its stage's weight update, so
  later micro-batches run on weights earlier ones updated (see the xla pipeline executor for
  which version each pass sees).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .arith import bubble_fraction as plan_bubble_fraction

__all__ = ["Action", "PipelineSchedule", "chrome_trace", "depth_text", "measured_bubble"]

KINDS = ("F", "B", "U")


@dataclass(frozen=True, order=True)
class Action:
    """One thing a stage does in one time slot: its ``kind`` (F, B or U) on ``micro_batch``
    (a U after accumulation concerns the whole update: micro_batch None), within ``update``."""

    slot: int
    stage: int
    kind: str
    micro_batch: int | None
    update: int = 0

    def __str__(self) -> str:
        mb = "" if self.micro_batch is None else str(self.micro_batch)
        return f"{self.stage}{self.kind}{mb}"


class PipelineSchedule:
    """The actions of one ``run`` of a pipelined session (build it with :meth:`inference`,
    :meth:`training` or :meth:`for_config`)."""

    def __init__(self, mode: str, stages: int, micro_batches: int, updates: int = 1,
                 accumulate: bool = False) -> None:
        if mode not in ("inference", "training"):
            raise ValueError(f"mode={mode!r}: a schedule is for 'inference' or 'training'.")
        for name, value in (("stages", stages), ("micro_batches", micro_batches),
                            ("updates", updates)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: give a positive integer.")
        if mode == "inference" and (accumulate or updates != 1):
            raise ValueError("an inference schedule has no weight updates: leave accumulate "
                             "and updates unset.")
        if mode == "training" and not accumulate and updates != 1:
            raise ValueError(f"updates={updates} without accumulation: every micro-batch "
                             f"updates the weights; give the step's micro-batches instead.")
        self.mode, self.stages, self.micro_batches = mode, stages, micro_batches
        self.updates, self.accumulate = updates, accumulate
        self.actions: list[Action] = sorted(self._build())

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def inference(cls, stages: int, micro_batches: int) -> PipelineSchedule:
        return cls("inference", stages, micro_batches)

    @classmethod
    def training(cls, stages: int, micro_batches: int, updates: int = 1,
                 accumulate: bool = True) -> PipelineSchedule:
        """``micro_batches`` per fill-drain: A with accumulation (``updates`` = bps of them),
        the step's bps without."""
        return cls("training", stages, micro_batches, updates, accumulate)

    @classmethod
    def for_config(cls, config: Any, stages: int) -> PipelineSchedule:
        """The schedule of one run of a session with ``config`` and ``stages`` forward stages."""
        bps, acc = config.batches_per_step, config.accumulation.factor
        if not config.is_training:
            return cls.inference(stages, bps * acc)
        if acc > 1:
            return cls.training(stages, acc, updates=bps)
        return cls.training(stages, bps, accumulate=False)

    @property
    def depth(self) -> int:
        """K: pipeline stages (forward ones, and for training the backward ones)."""
        return self.stages if self.mode == "inference" else 2 * self.stages - 1

    def pipeline_stage(self, action: Action) -> int:
        """The pipeline stage (row of the grid) an action belongs to."""
        if action.kind == "F":
            return action.stage
        return 2 * self.stages - 2 - action.stage

    @property
    def slots_per_update(self) -> int:
        """Cycles of one fill-drain, plus the update slot with accumulation."""
        return self.micro_batches + self.depth - 1 + (1 if self.accumulate else 0)

    def _build(self) -> Iterable[Action]:
        k, m, f = self.depth, self.micro_batches, self.stages
        for u in range(self.updates):
            base = u * self.slots_per_update
            for mb in range(m):
                for s in range(f):
                    yield Action(base + mb + s, s, "F", mb, u)
                    if self.mode == "training":
                        slot = base + mb + 2 * f - 2 - s
                        yield Action(slot, s, "B", mb, u)
                        if not self.accumulate:
                            yield Action(slot, s, "U", mb, u)
            if self.accumulate:
                yield from (Action(base + m + k - 1, s, "U", None, u) for s in range(f))

    # -- derived -----------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return max(a.slot for a in self.actions) + 1

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the pipeline stages' compute cycles (update slots left out): the
        plan's (K - 1) / (M + K - 1)."""
        busy = {(self.pipeline_stage(a), a.slot) for a in self.actions if a.kind != "U"}
        compute_slots = self.updates * (self.micro_batches + self.depth - 1)
        return 1.0 - len(busy) / (self.depth * compute_slots)

    @property
    def planned_bubble_fraction(self) -> float:
        """The plan's formula, for comparison."""
        return plan_bubble_fraction(self.depth, self.micro_batches)

    def by_slot(self) -> list[list[Action]]:
        """The actions of each slot, in order (within a slot: by pipeline stage, as PopART
        adds each cycle's stages)."""
        out: list[list[Action]] = [[] for _ in range(self.slots)]
        for a in self.actions:
            out[a.slot].append(a)
        for group in out:
            group.sort(key=lambda a: (self.pipeline_stage(a), KINDS.index(a.kind)))
        return out

    def for_stage(self, stage: int) -> list[Action]:
        """What one stage (one device) does, in the order it does it."""
        return [a for group in self.by_slot() for a in group if a.stage == stage]

    def validate(self) -> None:
        """A dry run: every pass comes after what it needs and each pipeline stage does one
        micro-batch per slot. Raises ValueError naming the first action out of place."""
        when = {(a.kind, a.stage, a.micro_batch, a.update): a.slot for a in self.actions}
        used: set[tuple[int, int, str]] = set()
        last = self.stages - 1
        for a in self.actions:
            needs = []
            if a.kind == "F" and a.stage > 0:
                needs.append(("F", a.stage - 1, a.micro_batch, a.update))
            if a.kind == "B":
                needs.append(("F", a.stage, a.micro_batch, a.update))
                if a.stage < last:
                    needs.append(("B", a.stage + 1, a.micro_batch, a.update))
            if a.kind == "U":
                mbs = [a.micro_batch] if a.micro_batch is not None else range(self.micro_batches)
                needs += [("B", a.stage, mb, a.update) for mb in mbs]
            for need in needs:
                at = when.get(need)
                # the loss stage's forward and backward share a slot, forward first
                same_slot_ok = need[0] == "F" and a.kind == "B" and need[1] == last == a.stage
                if at is None or at > a.slot or (at == a.slot and not same_slot_ok
                                                 and a.kind != "U"):
                    raise ValueError(f"action {a} (slot {a.slot}) needs {need[1]}{need[0]}"
                                     f"{need[2]} of update {need[3]}, which runs at slot {at}.")
            key = (self.pipeline_stage(a), a.slot, a.kind)
            if a.kind != "U" and key in used:
                raise ValueError(f"pipeline stage {key[0]} has two {a.kind} actions in slot "
                                 f"{a.slot}.")
            used.add(key)

    # -- display and dump -------------------------------------------------------------------

    def _row_label(self, p: int) -> str:
        if self.mode == "inference":
            return f"stage {p} fwd"
        f = self.stages
        if p == f - 1:
            return f"stage {p} fwd+bwd"
        return f"stage {p} fwd" if p < f else f"stage {2 * f - 2 - p} bwd"

    def describe(self) -> str:
        kind = (self.mode if self.mode == "inference" else
                "training, " + ("gradient accumulation" if self.accumulate
                                else "no accumulation (continuous, stale weights)"))
        per = "per update" if self.accumulate else "per step"
        ups = f", {self.updates} update(s)" if self.accumulate else ""
        return (f"{kind}: {self.stages} stage(s), {self.depth} pipeline stage(s), "
                f"{self.micro_batches} micro-batch(es) {per}{ups}; bubble "
                f"{self.bubble_fraction:.1%} = (K-1)/(M+K-1) = ({self.depth}-1)/"
                f"({self.micro_batches}+{self.depth}-1)")

    def render(self, max_slots: int | None = 64) -> str:
        """A stage x time grid: one row per pipeline stage, one column per slot; a cell is the
        micro-batch worked on ('.' idle), U a weight update after accumulation, and ``*`` a
        weight update right after that backward (no accumulation). ``max_slots`` cuts long
        schedules (None: all)."""
        rows = {p: {} for p in range(self.depth)}
        for a in self.actions:
            p = self.pipeline_stage(a) if a.kind != "U" else 2 * self.stages - 2 - a.stage
            if self.mode == "inference":
                p = a.stage
            cell = rows[p].get(a.slot, "")
            if a.kind == "U":
                cell = cell + "*" if a.micro_batch is not None else "U"
            else:  # the loss stage's forward and backward share one cell
                cell = str(a.micro_batch)
            rows[p][a.slot] = cell
        shown = self.slots if max_slots is None else min(self.slots, max_slots)
        width = 1 + max(len(str(shown - 1)), *(len(c) for r in rows.values() for c in r.values()))
        label = max(len(self._row_label(p)) for p in rows)
        head = "slot".ljust(label) + "".join(str(t).rjust(width) for t in range(shown))
        lines = [self.describe(), head]
        for p in range(self.depth):
            lines.append(self._row_label(p).ljust(label)
                         + "".join(rows[p].get(t, ".").rjust(width) for t in range(shown)))
        if shown < self.slots:
            lines.append(f"... {self.slots - shown} more slot(s)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        return (f"PipelineSchedule({self.mode!r}, stages={self.stages}, micro_batches="
                f"{self.micro_batches}, updates={self.updates}, accumulate={self.accumulate})")

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "stages": self.stages, "micro_batches": self.micro_batches,
                "updates": self.updates, "accumulate": self.accumulate,
                "pipeline_stages": self.depth, "slots": self.slots,
                "bubble_fraction": self.bubble_fraction,
                "actions": [{"slot": a.slot, "stage": a.stage, "kind": a.kind,
                             "micro_batch": a.micro_batch, "update": a.update}
                            for a in self.actions]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> PipelineSchedule:
        """The schedule :meth:`to_json` wrote (its actions checked against a rebuilt one)."""
        data = json.loads(text)
        out = cls(data["mode"], data["stages"], data["micro_batches"], data["updates"],
                  data["accumulate"])
        given = sorted(Action(**a) for a in data["actions"])
        if given != out.actions:
            raise ValueError("the JSON's actions are not those of the schedule it describes.")
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PipelineSchedule) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash((self.mode, self.stages, self.micro_batches, self.updates,
                     self.accumulate))


def measured_bubble(busy: Sequence[tuple[int, float, float]]) -> float:
    """The idle share of a trace of (device, start, end) intervals: 1 - busy time /
    (devices x span)."""
    if not busy:
        raise ValueError("an empty trace has no bubble.")
    devices = {d for d, _, _ in busy}
    span = max(e for _, _, e in busy) - min(s for _, s, _ in busy)
    work = sum(e - s for _, s, e in busy)
    return 1.0 - work / (len(devices) * span) if span > 0 else 0.0


def chrome_trace(trace: Sequence[tuple[Action, int, float, float]]) -> dict[str, Any]:
    """A run's trace - (action, device, start, end) in seconds - as Chrome trace events (the
    JSON Perfetto and chrome://tracing open): one complete event ("ph": "X") per action, one
    thread per device, times in microseconds from the run's start; save it with json.dump."""
    if not trace:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(start for _, _, start, _ in trace)
    names = {"F": "forward", "B": "backward", "U": "update"}
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": device,
         "args": {"name": f"device {device}"}}
        for device in sorted({d for _, d, _, _ in trace})]
    for action, device, start, end in trace:
        events.append({
            "name": str(action), "cat": names.get(action.kind, action.kind), "ph": "X",
            "pid": 0, "tid": device, "ts": round((start - origin) * 1e6, 3),
            "dur": round(max(end - start, 0.0) * 1e6, 3),
            "args": {"stage": action.stage, "slot": action.slot, "kind": action.kind,
                     "micro_batch": action.micro_batch, "update": action.update}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def depth_text(what: str, depth: int) -> str:
    """PopART's refusal of too few micro-batches to fill the pipeline
    (transforms/pipeline.cpp:1389 and :1396)."""
    return (f"For pipelining, depth ({what}) must equal at least the number of pipeline stages "
            f"({depth})")
