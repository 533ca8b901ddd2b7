"""An inference step that is one onnxruntime call, made from the host without the program.

Where a compiled inference program is nothing but one segment's callback between its
parameters and its results (:func:`~.hlo_text.one_callback`: the whole model delegated, its
micro-batches and replicas stacked into one onnxruntime run, every anchor one of its
outputs), :class:`DirectStep` makes the runs after the first by calling that callback itself:
the caller's arrays in where they lie (aligned or not), the anchors' memory out (large ones
recycled as the program's are, :mod:`.anchor_memory`), no program dispatch or callback
machinery between. The callback is the one the first run made (recorded by the session's
:class:`~.delegated.Delegation`), so what it computes is what the program computed. Measured
(2 cores, the same loop of runs): MNIST's 1->32 k5 convolution at batch 1, 73 against 37
microseconds a run; the depthwise row of benchmarks/conv_bench.py 0.60 against 0.47 ms; the
540x960 row 4.7 against 4.3 ms (onnxruntime alone: 34 us, 0.44 ms, 4.2 ms).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .anchor_memory import RecycledAnchors
from .hlo_text import OneCallback

__all__ = ["DirectStep", "direct_step"]


class DirectStep:
    """One run: ``call(None, outs, *ins)`` with ``operands`` (``("weights" | "inputs",
    name, shape)`` each, in the callback's order and shapes) and ``results`` (the anchor, its
    program shape and the callback's, in the callback's order)."""

    def __init__(self, call: Callable[..., None], operands: Sequence[tuple[str, str, tuple]],
                 results: Sequence[tuple[str, jax.ShapeDtypeStruct, tuple]],
                 recycled: RecycledAnchors) -> None:
        self.call, self.operands, self.results = call, list(operands), list(results)
        self.recycled = recycled
        self._weights: tuple[Any, dict[str, np.ndarray]] = (None, {})

    def run(self, inputs: Mapping[str, np.ndarray], weights: Mapping[str, Any],
            dtypes: Mapping[str, np.dtype]) -> dict[str, np.ndarray]:
        """The anchors of one run on the host arrays ``inputs`` (cast to ``dtypes``) with the
        session's current ``weights``: host arrays of the program's result shapes."""
        if self._weights[0] is not weights:  # views of the weights' memory, once per state
            self._weights = (weights, {n: np.asarray(weights[n]) for kind, n, _ in
                                       self.operands if kind == "weights"})
        views = self._weights[1]
        ins = [views[name].reshape(shape) if kind == "weights" else np.ascontiguousarray(
            inputs[name], dtypes[name]).reshape(shape) for kind, name, shape in self.operands]
        held = self.recycled.hand_out(self.recycled.slots())  # large anchors' kept memory
        anchors = {name: held[name] if name in held else np.empty(s.shape, s.dtype)
                   for name, s, _ in self.results}
        self.call(None, [anchors[name].reshape(shape) for name, _, shape in self.results], *ins)
        return anchors


def direct_step(shape: OneCallback, recorded: Sequence[tuple[Callable, list, list]],
                parameters: Sequence[tuple[str, str, tuple[int, ...]]],
                weights: Mapping[str, Any], outputs: Mapping[str, jax.ShapeDtypeStruct],
                recycled: RecycledAnchors) -> DirectStep | None:
    """The step as a :class:`DirectStep`, from the program's one-callback ``shape``, the
    callbacks its first run made (``(callback, [(operand shape, address)], result shapes)``
    each), ``parameters`` (``(kind, name, shape)`` of each program parameter, in order), the
    ``weights`` the run passed and the program's ``outputs`` (anchor buffers, in order); None
    unless the run made exactly one call, of the operands and results ``shape`` names: as
    many parameters, each operand of its parameter's size, each weight operand that weight's
    own buffer, each result of its output's size."""
    if len(recorded) != 1 or shape.parameters != len(parameters):
        return None
    call, ins, out_shapes = recorded[0]
    names = list(outputs)
    if len(ins) != len(shape.operands) or len(out_shapes) != len(shape.results) \
            or len(names) != len(shape.results):
        return None
    operands = []
    for number, (in_shape, address) in zip(shape.operands, ins, strict=True):
        kind, name, full = parameters[number]
        if kind not in ("weights", "inputs") or math.prod(full) != math.prod(in_shape) or (
                kind == "weights" and weights[name].unsafe_buffer_pointer() != address):
            return None
        operands.append((kind, name, tuple(in_shape)))
    by_result = {r: names[j] for j, r in enumerate(shape.results)}
    results = []
    for r, out_shape in enumerate(out_shapes):
        name = by_result[r]
        spec = outputs[name]
        if math.prod(spec.shape) != math.prod(out_shape) or np.dtype(spec.dtype) != np.float32:
            return None
        results.append((name, spec, tuple(out_shape)))
    return DirectStep(call, operands, results, recycled)
