"""PopART's execution phases (``VirtualGraphMode.ExecutionPhases``): every op gets a phase and
the IPU ``phase % stages``, as PopART's StreamingMemory transform places them
(willow/src/transforms/streamingmemory.cpp, streamingmemoryopinserter.cpp).

In graph order: an op without ``__execution_phase`` takes the current phase of a greedy split of
the weight bytes into ``phases`` equal shares (an op that would overflow the share moves on to
the next phase); no op runs in an earlier phase than the ops that feed it; an op without an IPU
gets ``phase % stages``. PopART's refusals: a phase at or past ``phases``, and an IPU that does
not match its phase modulo ``stages``.

Off the IPU a phased program computes what the unphased one does: the xla backend runs the ops
in order on the IPUs they are given (the phases' loads and stores of off-chip weights have no
meaning on a host's memory). Pure arithmetic on the model: no JAX.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import helper

from .._base.problems import Problem, raise_errors
from ..errors import InvalidModel
from .auto_virtual_graph import tensor_bytes
from .builder_settings import EXECUTION_PHASE
from .layout import VIRTUAL_GRAPH

__all__ = ["phase_placement", "phase_placed"]


def _int(node: onnx.NodeProto, name: str) -> int | None:
    return next((int(a.i) for a in node.attribute if a.name == name), None)


def phase_placement(model: onnx.ModelProto, phases: int, stages: int
                    ) -> tuple[list[tuple[int, int]], list[str]]:
    """Each node's (phase, IPU) in graph order, and PopART's refusals (texts)."""
    graph = model.graph
    sizes = tensor_bytes(model)
    weights = {t.name for t in graph.initializer}
    weights |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}

    def cost(node: onnx.NodeProto) -> float:
        return float(sum(sizes.get(name, 0) for name in node.input if name in weights))

    per_phase = sum(cost(n) for n in graph.node) / max(phases, 1)
    producer_phase: dict[str, int] = {}
    placed: list[tuple[int, int]] = []
    refusals: list[str] = []
    phase, spent = 0, 0.0
    for index, node in enumerate(graph.node):
        label = node.name or (node.output[0] if node.output else f"{node.op_type}#{index}")
        own = cost(node)
        if spent > 0 and spent + own > per_phase and phase < phases - 1:
            phase, spent = phase + 1, 0.0
        spent += own
        given, ipu = _int(node, EXECUTION_PHASE), _int(node, VIRTUAL_GRAPH)
        if given is not None and given >= phases:
            refusals.append(f"[StreamingMemory] Maximum phase is {phases - 1}, but op {label} "
                            f"has phase {given}.")
        at = max([given if given is not None else phase,
                  *(producer_phase[i] for i in node.input if i in producer_phase)])
        if ipu is None:
            ipu = at % stages
        elif at % stages != ipu % stages:
            refusals.append(f"[StreamingMemory] Op {label} inconsistent execution phase {at} "
                            f"and virtual graph ID {ipu}")
        producer_phase.update((o, at) for o in node.output if o)
        placed.append((at, ipu))
    return placed, refusals


def phase_placed(model: onnx.ModelProto, config: Any) -> onnx.ModelProto:
    """``model`` with every node's phase and IPU (:func:`phase_placement`) for a session
    ``config`` with ``virtual_graph_mode='execution_phases'`` (its
    ``executionPhaseSettings``); InvalidModel (rule V50, PopART's text) on a refusal."""
    settings = config.popart_options.get("executionPhaseSettings") or {}
    phases, stages = int(settings.get("phases", 1)), int(settings.get("stages", 2))
    placed, refusals = phase_placement(model, phases, stages)
    raise_errors("model", [Problem(("model", "execution_phases"), text,
                                   "give each op a phase below executionPhaseSettings.phases "
                                   "and an IPU equal to its phase modulo "
                                   "executionPhaseSettings.stages (or none).", "V50",
                                   popart=text) for text in refusals], error=InvalidModel)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node, (phase, ipu) in zip(out.graph.node, placed, strict=True):
        kept = [a for a in node.attribute if a.name not in (EXECUTION_PHASE, VIRTUAL_GRAPH)]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute(EXECUTION_PHASE, phase),
                               helper.make_attribute(VIRTUAL_GRAPH, ipu)])
    return out
