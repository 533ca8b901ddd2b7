"""Forward subgraphs of a CPU inference program run by onnxruntime, each in one call.

An inference session on one CPU device hands each run of consecutive nodes whose forward
arithmetic in PopART is ONNX's (:data:`OPS`; the operator table's "as ONNX" rows) and
that holds a Conv, Gemm or MatMul (:data:`HEAVY`) to one onnxruntime session, called inside
the XLA program by ``jax.experimental.buffer_callback`` on XLA's own buffers (``io_binding``:
no copies). The session is onnxruntime's whole optimizer at work on the subgraph: MLAS's
channel-blocked convolutions kept blocked from one to the next, its fused activations, its
packed matrix products. Where XLA:CPU runs such a model 2-3x slower than onnxruntime (its
convolutions and matrix products), the program then runs at onnxruntime's speed plus the
call's fixed cost.

onnxruntime's optimizer rewrites convolutions and packs matrices only for weights it holds as
constants, so a segment's session is built with the weights' values in it ("baked"), for the
weight buffers a run passes: the runtime offers the session's current weights
(:meth:`Delegation.offer`) and a baked session keeps the arrays it was built from alive, so
their memory can hold nothing else while the session is in use (a run with other weights, by
buffer address, builds another; :data:`KEEP` per segment). Where the weights passed are not
the offered ones, the segment runs a session that reads them as inputs instead.

A float16 segment runs in float32 with the XLA lowering's roundings (:mod:`.half_segment`)
where every operator in it is of :data:`.half_segment.OPS` (a partials type does not matter:
XLA:CPU sums half products in float32 whatever it says). What is never delegated: training
(the backward needs XLA's forward), bfloat16 and integer tensors, a float16 segment holding
another operator (these run the XLA lowering, decided when traced), a segment whose outputs
are not all of its float type (a MaxPool's indices read elsewhere), a segment onnxruntime
refuses to build or whose output shapes, checked once on zeros, are not the lowering's (XLA
then runs it). A batched weight (grouped weights) runs the XLA lowering. A segment is
differentiable (its gradient is the XLA lowering's) though no session asks.

An input that nothing but segments reads (:func:`~.hlo_text.callback_only_parameters`, from
the compiled program) is read by onnxruntime where the caller's array lies: the program takes
an unfilled aligned buffer instead of the copy :mod:`.input_memory` would make (XLA reads in
place only 64-byte-aligned memory, numpy's arrays are 16-byte aligned) and each segment
reading it binds the same bytes of the caller's array (:meth:`Delegation.lend`); a run in
which no segment read a lent buffer is made again with the values copied, as every later one
(the program read a copy). A segment's single run binds its buffers by address and keeps the
binding for a run with the same buffers. Measured (benchmarks/conv_bench.py, 2 cores): a 3x3
convolution at 56x56x64, batch 8 (6.4 MB in), 5.4 against 4.9 ms a run; the 540x960 row 5.3
against 4.7 ms (onnxruntime alone 4.6 and 4.4).

Under ``vmap`` (the replicas and micro-batches of a chunk) they run as one, stacked along
axis 0, where every node keeps that axis apart (:func:`foldable`, and the XLA lowering agrees
on the stacked shapes): MLP 784-256-256-10 at micro-batch 32, bps 16, 0.54 ms a run against
0.8-1.0 ms one by one (runtime_bench.py). Elsewhere the session runs once per micro-batch
and replica in one call.

A segment's session has one intra-op thread per core the process may use, spinning between
parallel sections and for a while after a run, as onnxruntime does by default. Measured
(runtime_bench.py, 2 cores), against threads that stop when a run ends: an MLP's run at bps 1
150-180 against 180 microseconds, the convnet 62 000 against 50 000 samples/s (one thread: the
depthwise row 1.25 against 0.58 ms). The cost is other CPU work in the 40 ms after a run:
numpy matrix products ran 1.6x slower there, onnxruntime's own runs up to 2x.
``POPART_KIT_ORT_SPINNING=0`` (read as a session is built) stops the threads when each run
ends.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from . import conv_mlas, half_segment

__all__ = ["CHUNK_BYTES", "HEAVY", "KEEP", "LOOPED_CHUNK", "OPS", "SPINNING", "Delegation",
           "Segment", "SegmentCall", "available", "foldable"]

#: ONNX operators (default domain) whose forward PopART computes as ONNX defines it, which a
#: segment may hold.
OPS = frozenset({
    "Add", "AveragePool", "BatchNormalization", "Concat", "Conv", "Div", "Flatten", "Gemm",
    "GlobalAveragePool", "GlobalMaxPool", "Identity", "LeakyRelu", "MatMul", "MaxPool", "Mul",
    "Relu", "Reshape", "Sigmoid", "Softmax", "Squeeze", "Sub", "Sum", "Tanh", "Transpose",
    "Unsqueeze",
})

#: A segment is delegated only when it holds one of these (elsewhere XLA is as fast).
HEAVY = frozenset({"Conv", "Gemm", "MatMul"})

#: Baked sessions kept per segment and shape (each with the weight arrays it was built from).
KEEP = 2

#: A chunk's activations in a session that delegates are kept under this many bytes, 8x the
#: CPU's default (steps.chunk_bytes, a cache's worth for XLA): its segments run stacked, in
#: onnxruntime's kernels. The runtime_bench convnet at bps 16 (6.6 MB a micro-batch): 12.3-14.6
#: ms a run at the default chunk of 1, 9.4-9.9 at 4, 7.6-7.8 at 16 (onnxruntime 14.2-14.3).
CHUNK_BYTES = 64 << 20
#: ... but at most this many micro-batches where the step loops over chunks anyway (a step of
#: one chunk may be one onnxruntime call from the host, :mod:`.direct`): more gained nothing.
#: runtime_bench's MLP at bps 256 on 4 replicas, three interleaved runs: 32.7-34.2 ms a run at
#: 16, 31.8-34.3 at 64 (the budget's choice), 35.5 at 8; the step's memory 2.9 MiB at 16
#: against 9.1 at 64.
LOOPED_CHUNK = 16

#: Environment variable: "0" stops the segments' onnxruntime threads spinning when a run ends.
SPINNING = "POPART_KIT_ORT_SPINNING"


def available() -> bool:
    """Whether onnxruntime imports and jax has ``buffer_callback``."""
    return conv_mlas.available()


class Delegation:
    """A lowered graph's delegated segments' shared state: the weights the runtime offers for
    baking, by buffer address."""

    def __init__(self) -> None:
        self._offered: dict[int, jax.Array] = {}
        self._source: Mapping[str, Any] | None = None
        self._lent: list[list[Any]] = []  # [address, bytes, values, read]
        #: While a list: each segment call a run makes, as (:class:`SegmentCall`, its
        #: operands' shapes and addresses, its results' shapes) (see :mod:`.direct`).
        self.recording: list[tuple[SegmentCall, list, list]] | None = None
        self._lock = threading.Lock()

    def offer(self, weights: Mapping[str, Any]) -> None:
        """The session's current weights (device arrays on the CPU), which a run passes to the
        program: segments may build sessions holding their values."""
        if weights is self._source:
            return
        offered = {}
        for array in weights.values():
            if isinstance(array, jax.Array) and len(array.devices()) == 1 and array.size:
                offered[array.unsafe_buffer_pointer()] = array
        with self._lock:
            self._offered, self._source = offered, weights

    def lend(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """For the run about to start: each pair is a buffer the program takes for an input
        that only segments read (:func:`~.hlo_text.callback_only_parameters`), left unfilled,
        and the array holding the input's values (C-contiguous, of the buffer's dtype and size); a
        segment given (part of) the buffer reads the same part of the array instead."""
        self._lent = [[b.ctypes.data, b.nbytes, s.reshape(-1).view(np.uint8), False]
                      for b, s in pairs]

    @property
    def lent(self) -> bool:
        """Whether buffers are lent (a run is under way)."""
        return bool(self._lent)

    def returned(self) -> int:
        """The run has ended: nothing is lent from here on. Returns how many lent buffers no
        segment read: a program that took a copy of one, whose segments read the copy's
        unfilled memory (the run's results are then not to be used)."""
        unread = sum(not read for *_, read in self._lent)
        self._lent = []
        return unread

    def source(self, array: np.ndarray) -> np.ndarray:
        """``array`` (a segment's operand), or where it lies in a lent buffer the same bytes
        of the array lent with it."""
        start = array.ctypes.data
        for lent in self._lent:
            base, size, values, _ = lent
            if base <= start and start + array.nbytes <= base + size:
                lent[3] = True
                offset = start - base
                return values[offset:offset + array.nbytes].view(array.dtype).reshape(
                    array.shape)
        return array

    def arrays_at(self, addresses: Sequence[int]) -> list[jax.Array] | None:
        """The offered arrays whose buffers are at ``addresses`` (None unless all are): alive
        while offered, so the memory at an address is theirs."""
        with self._lock:
            found = [self._offered.get(a) for a in addresses]
        return None if any(a is None for a in found) else found  # type: ignore[return-value]


@dataclass(frozen=True)
class SegmentCall:
    """What one segment call runs: ``plan``'s sessions, fed the operands ``names`` and
    writing ``outputs``, once per index of ``loops`` (the leading axes of its batched
    operands; ``()``: one run)."""

    plan: _Plan
    names: tuple[str, ...]
    outputs: tuple[str, ...]
    loops: tuple[int, ...]


class _Plan:
    """One segment at one set of operand shapes: its onnxruntime sessions (weights as inputs;
    baked, by weight buffer addresses)."""

    def __init__(self, build: Callable[[dict[str, np.ndarray] | None], Any],
                 weights: list[str], delegation: Delegation) -> None:
        self._build, self._weights, self.delegation = build, weights, delegation
        self.unbaked = build(None)  # validates the subgraph: raises where onnxruntime refuses
        self._baked: OrderedDict[tuple[int, ...], tuple[Any, list[jax.Array]]] = OrderedDict()
        self._lock = threading.Lock()

    def session(self, weights: Sequence[np.ndarray]) -> tuple[Any, bool]:
        """The session for a run passing ``weights`` (host views of the weight operands),
        and whether it holds them (baked)."""
        if not weights:
            return self.unbaked, True
        addresses = tuple(w.ctypes.data for w in weights)
        with self._lock:
            found = self._baked.get(addresses)
            if found is not None:
                self._baked.move_to_end(addresses)
                return found[0], True
            arrays = self.delegation.arrays_at(addresses)
            if arrays is None:
                return self.unbaked, False
            session = self._build({n: np.array(w) for n, w in
                                   zip(self._weights, weights, strict=True)})
            self._baked[addresses] = (session, arrays)
            while len(self._baked) > KEEP:
                self._baked.popitem(last=False)
            return session, True


class Segment:
    """The operator of a delegated segment: ``nodes`` (onnx NodeProtos, in order, with their
    PopART-only attributes dropped) reading ``reads`` and giving ``outputs``; ``weights``: the
    reads that are weights; ``xla(args, alone)`` computes the tensors of the segment the XLA
    way from the reads' values, by name: each node's lowering in turn (``alone`` False: XLA's
    side of a delegated call, holding no callback of its own), or with the lowering's fused
    pairs (``alone``: the segment computed by XLA instead of onnxruntime, as the lowering
    computes any other node)."""

    def __init__(self, name: str, nodes: list[Any], reads: Sequence[str],
                 outputs: Sequence[str], weights: set[str], opset: int,
                 xla: Callable[[list[Any]], dict[str, Any]], delegation: Delegation) -> None:
        self.name, self.nodes, self.reads, self.outputs = name, nodes, list(reads), list(outputs)
        self.weights, self.opset, self._xla, self._delegation = weights, opset, xla, delegation
        self._plans: dict[tuple, _Plan | None] = {}
        self._lock = threading.Lock()

    def __call__(self, ctx: Any, *args: Any) -> tuple[Any, ...]:
        traced = [i for i, a in enumerate(args) if a is not None and not isinstance(a, np.ndarray)]
        constants = {self.reads[i]: a for i, a in enumerate(args) if isinstance(a, np.ndarray)}

        def every(*values: Any, alone: bool = False) -> dict[str, Any]:  # by XLA
            full = list(args)
            for i, v in zip(traced, values, strict=True):
                full[i] = v
            return self._xla(full, alone)

        values = [args[i] for i in traced]
        dtype = self._dtype(values)
        if dtype is None:
            return self._outputs(every(*values, alone=True))
        return self._delegate([self.reads[i] for i in traced], values, constants, every, True,
                              dtype)

    def _dtype(self, values: Sequence[Any]) -> np.dtype | None:
        """The one float type of ``values`` if onnxruntime may compute the segment in it:
        float32, or float16 where every node is of :data:`.half_segment.OPS`; else None."""
        dtypes = {np.dtype(v.dtype) for v in values}
        if dtypes == {np.dtype(np.float32)}:
            return np.dtype(np.float32)
        if dtypes == {np.dtype(np.float16)} and all(n.op_type in half_segment.OPS
                                                    for n in self.nodes):
            return np.dtype(np.float16)
        return None

    def _outputs(self, tensors: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(tensors[o] for o in self.outputs)

    def _delegate(self, names: list[str], values: list[Any], constants: dict[str, np.ndarray],
                  every: Callable[..., dict[str, Any]], fold: bool,
                  dtype: np.dtype) -> tuple[Any, ...]:
        """The outputs from the traced operands ``values`` (named ``names``, all of
        :meth:`_dtype` ``dtype``) by a plan for their shapes, else by XLA; ``fold``:
        micro-batches batched by vmap may be stacked into one run where :func:`foldable` says
        so."""
        def xla(*values: Any) -> tuple[Any, ...]:
            return self._outputs(every(*values))

        abstract = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values]
        tensors = jax.eval_shape(every, *abstract)
        types = self._outputs(tensors)
        plan = None if any(np.dtype(t.dtype) != dtype for t in types) else \
            self._plan(names, values, constants, types, dtype)
        if plan is None:
            return self._outputs(every(*values, alone=True))
        kinds = [name in self.weights for name in names]
        stack = None
        per_sample = {n for n, w in zip(names, kinds, strict=True) if not w}
        if fold and per_sample and foldable(
                self.nodes, per_sample, {n: t.shape for n, t in tensors.items()}, constants,
                self.opset):
            def stack(size: int, values: Sequence[Any]) -> tuple[Any, ...] | None:
                return self._stacked(size, names, values, kinds, constants, every, types,
                                     dtype)
        return _delegated(plan, names, self.outputs, kinds, types, xla, values, stack)

    def _stacked(self, size: int, names: list[str], values: Sequence[Any], kinds: list[bool],
                 constants: dict[str, np.ndarray], every: Callable[..., dict[str, Any]],
                 types: Sequence[Any], dtype: np.dtype) -> tuple[Any, ...] | None:
        """The outputs of ``size`` micro-batches (the per-sample operands' leading axis) as
        one run of the segment with them stacked along axis 0, where the XLA lowering agrees
        that the stacked shapes give stacked outputs (else None: run them one by one)."""
        stacked = [v if w else v.reshape((size * v.shape[1], *v.shape[2:]))
                   for v, w in zip(values, kinds, strict=True)]
        try:
            got = self._outputs(jax.eval_shape(
                every, *[jax.ShapeDtypeStruct(v.shape, v.dtype) for v in stacked]))
        except Exception:  # noqa: BLE001 - shapes that do not stack (a literal batch size)
            return None
        if any(not t.shape or tuple(g.shape) != (size * t.shape[0], *t.shape[1:])
               for g, t in zip(got, types, strict=True)):
            return None
        out = self._delegate(names, stacked, constants, every, True, dtype)  # next vmap too
        return tuple(o.reshape((size, *t.shape)) for o, t in zip(out, types, strict=True))

    def _plan(self, names: list[str], values: list[Any], constants: dict[str, np.ndarray],
              types: Sequence[Any], dtype: np.dtype) -> _Plan | None:
        """The plan for these operand shapes and float type (made once; None where
        onnxruntime refuses)."""
        key = (tuple((n, tuple(v.shape)) for n, v in zip(names, values, strict=True)),
               tuple((n, a.dtype.str, a.shape, a.tobytes()) for n, a in constants.items()),
               dtype.str)
        with self._lock:
            if key in self._plans:
                return self._plans[key]
            weights = [n for n in names if n in self.weights]
            shapes = {n: tuple(v.shape) for n, v in zip(names, values, strict=True)}
            out_shapes = {n: tuple(t.shape) for n, t in zip(self.outputs, types, strict=True)}

            def build(baked: dict[str, np.ndarray] | None) -> Any:
                return _session(self, shapes, constants, out_shapes, baked, dtype)

            try:
                plan: _Plan | None = _Plan(build, weights, self._delegation)
                _check_shapes(plan.unbaked, shapes, constants, out_shapes,  # type: ignore[union-attr]
                              dtype)
            except Exception:  # noqa: BLE001 - onnxruntime refuses it, or computes other
                plan = None    # shapes than the xla backend: XLA runs the nodes
            self._plans[key] = plan
            return plan


def _check_shapes(session: Any, shapes: Mapping[str, tuple[int, ...]],
                  constants: Mapping[str, np.ndarray],
                  out_shapes: Mapping[str, tuple[int, ...]], dtype: np.dtype) -> None:
    """Run ``session`` once on zeros: ValueError unless its outputs have the shapes the xla
    backend's lowering gives (an attribute read otherwise would fail every run)."""
    feeds = {n: np.zeros(s, dtype) for n, s in shapes.items() if n not in constants}
    got = session.run(list(out_shapes), feeds)
    wrong = {n: (g.shape, s) for (n, s), g in zip(out_shapes.items(), got, strict=True)
             if tuple(g.shape) != tuple(s)}
    if wrong:
        raise ValueError(f"onnxruntime's shapes differ from the lowering's: {wrong}")


def _session(segment: Segment, shapes: Mapping[str, tuple[int, ...]],
             constants: Mapping[str, np.ndarray], out_shapes: Mapping[str, tuple[int, ...]],
             baked: Mapping[str, np.ndarray] | None, dtype: np.dtype) -> Any:
    """An onnxruntime session of ``segment`` in ``dtype`` (float32, or float16 computed as
    :mod:`.half_segment` says): its traced operands as inputs (but the weights in ``baked``,
    which it holds as constants with ``constants``)."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    held = _initializers({**constants, **(baked or {})})
    initializers = [numpy_helper.from_array(a, name) for name, a in held.items()]
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    fed = [n for n in shapes if n not in held]
    inputs = [helper.make_tensor_value_info(n, elem, list(shapes[n])) for n in fed]
    outputs = [helper.make_tensor_value_info(n, elem, list(s)) for n, s in out_shapes.items()]
    nodes = segment.nodes if dtype == np.float32 else half_segment.half_graph(
        segment.nodes, fed, [n for n, a in held.items() if a.dtype == np.float32],
        list(out_shapes), {**{n: len(s) for n, s in shapes.items()},
                           **{n: a.ndim for n, a in held.items()}})
    graph = helper.make_graph(nodes, segment.name, inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", segment.opset)])
    model.ir_version = min(model.ir_version, 10)
    options = conv_mlas.options(spinning=True)
    if os.environ.get(SPINNING, "1") == "0":
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _initializers(held: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A segment's constants and baked weights as its graph holds them: integer arrays as
    int64, float16 ones converted to float32 (exactly: a float16 segment computes in float32,
    :mod:`.half_segment`), the rest as they are."""
    return {name: a.astype(np.int64) if np.issubdtype(a.dtype, np.integer) else
            a.astype(np.float32) if a.dtype == np.float16 else a for name, a in held.items()}


def _delegated(plan: _Plan, names: list[str], outputs: list[str], kinds: list[bool],
               types: Sequence[Any], xla: Callable[..., tuple[Any, ...]],
               values: list[Any], stack: Callable[..., Any] | None = None
               ) -> tuple[Any, ...]:
    """The segment's outputs from ``values`` by ``plan``'s sessions, differentiated (and, for
    batched weights, batched) as ``xla``; ``stack(size, values)``: the outputs of micro-batches
    batched by vmap as one stacked run, or None."""

    @jax.custom_vjp
    def run(*values: Any) -> tuple[Any, ...]:
        return _call(plan, names, outputs, kinds, types, xla, (),
                     (False,) * len(values), stack)(*values)

    def forward(*values: Any) -> tuple[Any, Any]:
        return jax.vjp(xla, *values)

    def backward(vjp: Any, cotangents: Any) -> Any:
        return vjp(cotangents)

    run.defvjp(forward, backward)
    return run(*values)


def _looped_xla(xla: Callable[..., Any], loops: tuple[int, ...],
                looped: Sequence[bool]) -> Callable[..., Any]:
    """``xla`` over the leading ``loops`` axes of the looped operands."""
    fn = xla
    for _ in loops:
        fn = jax.vmap(fn, in_axes=tuple(0 if flag else None for flag in looped))
    return fn


def _call(plan: _Plan, names: list[str], outputs: list[str], kinds: list[bool],
          types: Sequence[Any], xla: Callable[..., Any], loops: tuple[int, ...],
          looped: tuple[bool, ...], stack: Callable[..., Any] | None = None
          ) -> Callable[..., tuple[Any, ...]]:
    """The buffer callback running the segment once per index of ``loops`` (the leading axes
    of the ``looped`` operands; the others shared), batched by custom_vmap: one stacked run
    (``stack``) where every per-sample operand is batched, else a loop more."""
    from jax.experimental.buffer_callback import buffer_callback

    results = [jax.ShapeDtypeStruct((*loops, *t.shape), t.dtype) for t in types]

    last: list[Any] = [None, None]  # the last single run's (buffer addresses, binding)
    called = SegmentCall(plan, tuple(names), tuple(outputs), loops)

    def run(ctx: Any, outs: Any, *ins: Any) -> None:
        arrays = [np.asarray(a) for a in ins]
        if plan.delegation.lent:  # an input the program holds no copy of
            arrays = [plan.delegation.source(a) for a in arrays]
        session, baked = plan.session([a for a, w in zip(arrays, kinds, strict=True) if w])
        fed = [(n, a, flag) for n, a, flag, w in zip(names, arrays, looped, kinds, strict=True)
               if not (w and baked)]
        targets = [np.asarray(o) for o in (outs if isinstance(outs, list | tuple) else [outs])]
        recording = plan.delegation.recording
        if recording is not None:
            recording.append((called, [(a.shape, a.ctypes.data) for a in arrays],
                              [t.shape for t in targets]))
        if not loops:  # the same buffers as the last run: its binding (bound by address)
            key = (id(session), *(a.ctypes.data for _, a, _ in fed),
                   *(t.ctypes.data for t in targets))
            if last[0] == key:
                session.run_with_iobinding(last[1])
                return
        binding = session.io_binding()
        for index in np.ndindex(*loops):
            for name, array, flag in fed:
                view = array[index] if flag else array
                binding.bind_input(name, "cpu", 0, view.dtype, list(view.shape),
                                   view.ctypes.data)
            for name, target in zip(outputs, targets, strict=True):
                view = target[index]
                binding.bind_output(name, "cpu", 0, view.dtype, list(view.shape),
                                    view.ctypes.data)
            session.run_with_iobinding(binding)
        if not loops:
            last[:] = key, binding

    @jax.custom_batching.custom_vmap
    def call(*values: Any) -> tuple[Any, ...]:
        return tuple(buffer_callback(run, results)(*values))

    @call.def_vmap
    def batched(size: int, in_batched: Sequence[bool], *values: Any) -> tuple[Any, Any]:
        if any(b and w for b, w in zip(in_batched, kinds, strict=True)):
            fn = jax.vmap(_looped_xla(xla, loops, looped),
                          in_axes=tuple(0 if b else None for b in in_batched), axis_size=size)
            out = fn(*values)
            return out, tuple(True for _ in out)
        if stack is not None and not loops and all(
                b for b, w in zip(in_batched, kinds, strict=True) if not w):
            out = stack(size, values)
            if out is not None:
                return out, tuple(True for _ in out)
        moved, flags = [], []
        for value, b, flag in zip(values, in_batched, looped, strict=True):
            if not b and not flag:
                moved.append(value)
                flags.append(False)
                continue
            base = value.shape[(1 if b else 0) + (len(loops) if flag else 0):]
            if b and not flag:
                value = value.reshape((size,) + (1,) * len(loops) + base)
            value = jax.numpy.broadcast_to(value, (size, *loops, *base))
            moved.append(value)
            flags.append(True)
        out = _call(plan, names, outputs, kinds, types, xla, (size, *loops),
                    tuple(flags))(*moved)
        return out, tuple(True for _ in out)

    return call


#: Operators that compute each index of their first input's axis 0 apart, given the others
#: are not per-sample.
_PER_SAMPLE = frozenset({"Conv", "MaxPool", "AveragePool", "GlobalAveragePool",
                         "GlobalMaxPool", "BatchNormalization"})
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Sum", "Relu", "Sigmoid", "Tanh",
                          "LeakyRelu", "Identity"})


def foldable(nodes: Sequence[Any], per_sample: set[str],
             shapes: Mapping[str, tuple[int, ...]], constants: Mapping[str, np.ndarray],
             opset: int) -> bool:
    """Whether ``nodes`` compute each index of axis 0 of the ``per_sample`` tensors (a
    micro-batch's inputs) apart and keep it as axis 0 of what they compute from them, so that
    micro-batches stacked along axis 0 give their results stacked: one onnxruntime run for a
    chunk. Conservative: an operator not known to keep the axis, or an attribute that could
    touch it (a Softmax, Concat, Flatten, Squeeze or Unsqueeze on axis 0, a Transpose moving
    it, a Reshape whose first size is not 0 or -1, a transposed Gemm input), says no."""
    batched = set(per_sample)
    for node in nodes:
        if not any(i in batched for i in node.input if i):
            continue
        if not _keeps_axis_0(node, batched, shapes, constants, opset):
            return False
        batched.update(o for o in node.output if o)
    return True


def _keeps_axis_0(node: Any, batched: set[str], shapes: Mapping[str, tuple[int, ...]],
                  constants: Mapping[str, np.ndarray], opset: int) -> bool:
    from onnx import helper

    op = node.op_type
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    first = node.input[0]
    rank = len(shapes.get(first, ()))
    others = [i for i in node.input[1:] if i]

    def axis(value: int, of: int = rank) -> int:
        return value + of if value < 0 else value

    if op in _ELEMENTWISE:
        out_rank = len(shapes.get(node.output[0], ()))
        return all(len(shapes.get(i, ())) == out_rank for i in node.input if i in batched)
    if op in _PER_SAMPLE:
        return first in batched and not any(i in batched for i in others)
    if op == "Gemm":
        return first in batched and not attrs.get("transA", 0) and \
            not any(i in batched for i in others)
    if op == "MatMul":
        return first in batched and rank >= 2 and node.input[1] not in batched
    if op == "Flatten":
        return axis(attrs.get("axis", 1)) >= 1
    if op == "Softmax":
        return rank >= 2 and axis(attrs.get("axis", 1 if opset < 13 else -1)) >= 1
    if op == "Concat":
        return all(i in batched for i in node.input if i) and axis(attrs["axis"]) >= 1
    if op == "Transpose":
        perm = attrs.get("perm")
        return perm is not None and perm[0] == 0
    if op == "Reshape":
        shape = constants.get(node.input[1]) if len(node.input) > 1 else None
        if shape is None or attrs.get("allowzero", 0):
            return False
        shape = np.asarray(shape).ravel()
        return shape.size >= 1 and int(shape[0]) in (0, -1)
    if op in ("Squeeze", "Unsqueeze"):
        axes = attrs.get("axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            axes = constants.get(node.input[1])
        if axes is None:
            return False
        out_rank = rank if op == "Squeeze" else rank + len(np.ravel(axes))
        return all(axis(int(a), out_rank) != 0 for a in np.ravel(axes))
    return False
