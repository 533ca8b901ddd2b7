"""An inference step that is one onnxruntime call, made from the host without the program.

Where a compiled inference program is nothing but one segment's callback between its
parameters and its results (:func:`~.hlo_text.one_callback`: the whole model delegated, its
micro-batches and replicas stacked into one onnxruntime run, every anchor one of its
outputs), :class:`DirectStep` makes the runs after the first as that segment's onnxruntime
``run`` on the caller's arrays, as a program of onnxruntime alone would: no program dispatch,
callback machinery or binding between, the outputs' memory onnxruntime's (kept by its
allocator between runs). The session is the one the first run's call used (recorded by the
session's :class:`~.delegated.Delegation`), so what it computes is what the program
computed. Measured (2 cores, in turns with onnxruntime's own session of the model, medians),
against the same call made through the segment's binding: MNIST's 1->32 k5 convolution at
batch 1, 26-28 against 41-44 microseconds a run (onnxruntime alone 21-22); at batch 32, 298
against 385-438 (onnxruntime 270-276).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .delegated import SegmentCall
from .hlo_text import OneCallback

__all__ = ["DirectStep", "direct_step"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16))


class DirectStep:
    """Runs of one segment call (:class:`~.delegated.SegmentCall`, a single onnxruntime run)
    with ``operands`` (``("weights" | "inputs", name, shape)`` each, in the call's order and
    shapes) and ``results`` (each anchor's name, the session's anchor shape and the call's
    shape, in the call's order), by onnxruntime's own ``run``: it reads the inputs where they
    lie and hands out its outputs' memory (writable arrays of their own, its allocator
    keeping memory between runs). The session, and the weights where it reads them as inputs,
    are looked up once per weights mapping."""

    def __init__(self, segment: SegmentCall, operands: Sequence[tuple[str, str, tuple]],
                 results: Sequence[tuple[str, tuple[int, ...], tuple]]) -> None:
        self.segment, self.operands = segment, list(operands)
        feeds = list(zip(self.operands, segment.names, strict=True))
        self._inputs = [(name, shape, fed) for (kind, name, shape), fed in feeds
                        if kind == "inputs"]
        self._weights = [(name, shape, fed) for (kind, name, shape), fed in feeds
                         if kind == "weights"]
        self._outputs = list(segment.outputs)
        self._anchors = [(anchor, None if tuple(shape) == tuple(called) else shape)
                         for anchor, shape, called in results]  # None: as onnxruntime gives
        self._state: Any = None  # the weights mapping the session is for
        self._run: Any = None  # the session's run
        self._fed: dict[str, np.ndarray] = {}  # weights the session reads as inputs

    def _use(self, weights: Mapping[str, Any]) -> None:
        """The session for the session's weights ``weights``."""
        plan = self.segment.plan
        plan.delegation.offer(weights)
        views = [np.asarray(weights[name]).reshape(shape) for name, shape, _ in self._weights]
        session, baked = plan.session(views)
        self._fed = {} if baked else {fed: view for view, (_, _, fed) in
                                      zip(views, self._weights, strict=True)}
        # onnxruntime's binding itself: its Python wrapper's ``run`` only checks the feeds'
        # names, which this step fixed when it was made (a few microseconds a run)
        self._state, self._run = weights, getattr(session, "_sess", session).run

    def run(self, inputs: Mapping[str, np.ndarray], weights: Mapping[str, Any],
            dtypes: Mapping[str, np.dtype]) -> dict[str, np.ndarray]:
        """The anchors of one run on the host arrays ``inputs`` (cast to ``dtypes``) with the
        session's current ``weights``: writable arrays of their own, in the anchors' shapes."""
        if self._state is not weights:
            self._use(weights)
        feeds = dict(self._fed)
        for name, shape, fed in self._inputs:
            array = inputs[name]  # C-contiguous (StepIOFactory.check_inputs)
            if array.dtype != dtypes[name]:
                array = array.astype(dtypes[name])
            feeds[fed] = array if array.shape == shape else array.reshape(shape)
        outs = self._run(self._outputs, feeds, None)
        return {anchor: out if shape is None else out.reshape(shape)
                for (anchor, shape), out in zip(self._anchors, outs, strict=True)}


def direct_step(shape: OneCallback, recorded: Sequence[tuple[SegmentCall, list, list]],
                parameters: Sequence[tuple[str, str, tuple[int, ...]]],
                weights: Mapping[str, Any], outputs: Mapping[str, jax.ShapeDtypeStruct],
                anchor_shapes: Mapping[str, tuple[int, ...]]) -> DirectStep | None:
    """The step as a :class:`DirectStep`, from the program's one-callback ``shape``, the
    segment calls its first run made (``(call, [(operand shape, address)], result shapes)``
    each), ``parameters`` (``(kind, name, shape)`` of each program parameter, in order), the
    ``weights`` the run passed, the program's ``outputs`` (anchor buffers, in order) and the
    session's ``anchor_shapes``; None unless the run made exactly one call, a single
    onnxruntime run, of the operands and results ``shape`` names: as many parameters, each
    operand of its parameter's size, each weight operand that weight's own buffer, each result
    of its output's size, float32 or float16 (the types segments compute in)."""
    if len(recorded) != 1 or shape.parameters != len(parameters):
        return None
    call, ins, out_shapes = recorded[0]
    names = list(outputs)
    if call.loops or len(ins) != len(shape.operands) or len(out_shapes) != len(shape.results) \
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
        if math.prod(spec.shape) != math.prod(out_shape) or np.dtype(spec.dtype) not in _FLOATS:
            return None
        results.append((name, tuple(anchor_shapes[name]), tuple(out_shape)))
    return DirectStep(call, operands, results)
