"""ONNX to JAX: ``lower(model)`` checks a whole model against the operator table, once, and gives
a :class:`LoweredGraph` whose ``evaluate`` is pure ``jax.numpy`` (traceable under ``jit``,
``vmap`` and ``grad``).

Tensors are of three kinds:

* **constants**, known at lowering: Constant nodes, initializers that feed a compile-time input
  (a Reshape shape, Slice starts, Pad pads ...), graph inputs whose values the caller gave as
  ``static_inputs`` (used only where a constant is needed), and every node computed from them
  alone (folded here, once);
* **shape-derived** values, known when tracing: Shape and Size of any tensor, and nodes
  computed from those and constants (numpy values while tracing, never traced arrays);
* **runtime** values: graph inputs, weights (the other initializers) and everything computed
  from them.

Every node is validated before anything runs: an unknown operator, an attribute value the table
refuses, or a compile-time input that is not a constant is reported, all of them in one
:class:`UnsupportedModel`, naming each node (its name, else its first output) and op type. A node
that fails while evaluating (a shape mistake JAX finds) raises :class:`NodeFailed` naming the node,
its op type and its input shapes.

Subgraphs (the graph attributes of Call, If, Loop and Scan nodes) are lowered once, with their
node, into a :class:`Body` the op calls (``ops_control``); a problem inside one is reported with
its path (``node (If): subgraph then_branch (name): ...``). What a subgraph reads from enclosing
graphs becomes extra inputs of its node, so it is planned, folded and fed as any input (and
differentiated: gradients reach a weight read inside a Call or If body). An If whose condition
is a constant lowers only the branch it takes.

A node whose output only one other node reads may be lowered together with that reader where
:data:`FUSIONS` offers a lowering of the pair (a Conv and its Relu as one onnxruntime MLAS call):
never when that output is wanted (anchored, a graph output, a gradient anchor) or read by
anything else (a subgraph's read is its node's input), nor under recomputation, nor inside a
pipeline stage (whose every output is kept).

With ``delegation`` set (an inference session on one CPU device), runs of consecutive nodes
onnxruntime computes as PopART does are lowered as one node each, an onnxruntime session inside
the program (:mod:`.delegated`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from ..._base.problems import raise_errors
from ..._model.builder_settings import RECOMPUTE_OUTPUT
from ..._model.builder_subgraphs import free_names, node_reads
from ..._model.index_check import narrowing_problems
from ..._model.layout import load_model
from ..._model.tensors import to_array
from ...errors import InvalidModel, ModelError, clip
from . import delegated, ops_conv
from .delegated import Delegation
from .op_table import OPS
from .ops import (
    GRAPHCORE,
    SOFTMAX_AXIS,
    UNKNOWN,
    Ctx,
    NotSupported,
    Op,
    UnsupportedModel,
    node_partials,
    np_dtype,
    partials,
    popart_constant_text,
    read_attributes,
)
from .ops_custom import custom_entry
from .ops_random import draws_random

__all__ = ["Body", "LoweredGraph", "NodeFailed", "UnsupportedModel", "lower",
           "recomputation", "unsupported"]


class NodeFailed(ModelError):
    """A node the xla backend could not evaluate with the inputs it was given (a shape or type
    mistake in the model): names the node, its op type and its input shapes."""

    rule = "K-xla-node-failed"


def _describe(value: Any) -> str:
    if value is None:
        return "(omitted)"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    return f"{tuple(shape)} {dtype}" if shape is not None else type(value).__name__


@dataclass(frozen=True)
class _Node:
    label: str                  # the node's name, else its first output
    op: Op
    ctx: Ctx
    inputs: tuple[str, ...]     # "" for an omitted optional input
    outputs: tuple[str, ...]    # "" for an output not asked for
    static: bool                # runs on numpy values while tracing (shape-derived)
    partials: str | None = None  # the node's own partials type (PopART's setPartialsType)
    recompute: int = 0          # its RecomputeType (Builder.recomputeOutputInBackwardPass):
    #                             0 undefined, 1 checkpoint, 2 recompute
    proto: onnx.NodeProto | None = None  # the node as the model has it (delegated.py)


class LoweredGraph:
    """A model ready to evaluate with JAX.

    ``inputs``: ``{name: (shape, numpy dtype)}`` of the graph inputs to feed, in order (None for
    a dimension without a fixed size); ``weights``: ``{name: array}`` of the initializers that
    are weights; ``constants``: the initializers and inputs folded in as compile-time values;
    ``outputs``: the graph outputs; ``tensors``: every tensor that can be anchored;
    ``trainable``: the floating-point weights; ``fused``: whether the pairs :data:`FUSIONS`
    offers are lowered together (set False to run them apart, for comparison);
    ``delegation``: set (an inference session on one CPU device) to run forward segments by
    onnxruntime (:mod:`.delegated`).
    """

    fused: bool = True
    delegation: Delegation | None = None

    def __init__(self, *, opset: int, inputs: dict[str, tuple[tuple[int | None, ...] | None,
                                                              np.dtype]],
                 weights: dict[str, np.ndarray], constants: dict[str, np.ndarray],
                 known: dict[str, np.ndarray], outputs: list[str], nodes: list[_Node]) -> None:
        self.opset = opset
        self.inputs = inputs
        self.weights = weights
        self.constants = constants
        self.outputs = outputs
        self._known = known
        self._nodes = nodes
        self._producer = {out: i for i, n in enumerate(nodes) for out in n.outputs if out}
        self.tensors: set[str] = {*inputs, *weights, *constants, *known, *self._producer}
        self._plans: dict[tuple[str, ...], list[_Node]] = {}
        self._fused_plans: dict[tuple[str, ...], list[_Node]] = {}
        self._delegated_plans: dict[tuple[str, ...], list[_Node]] = {}
        self._reads: dict[str, int] = {}  # how many inputs of all nodes name each tensor
        for node in nodes:
            for name in node.inputs:
                if name:
                    self._reads[name] = self._reads.get(name, 0) + 1

    def part(self, produces: set[str], inputs: Mapping[str, tuple[tuple[int, ...], np.dtype]]
             ) -> LoweredGraph:
        """The nodes producing any of ``produces`` (a pipeline stage), as a graph of its own
        whose inputs are ``inputs`` (what earlier stages computed, and graph inputs)."""
        nodes = [n for n in self._nodes if any(o in produces for o in n.outputs if o)]
        read = {i for n in nodes for i in n.inputs if i}
        return LoweredGraph(opset=self.opset, inputs=dict(inputs),
                            weights={k: v for k, v in self.weights.items() if k in read},
                            constants=self.constants, known=self._known,
                            outputs=[o for n in nodes for o in n.outputs if o], nodes=nodes)

    @property
    def nodes(self) -> tuple[_Node, ...]:
        """The lowered nodes in order (each its operator, context, inputs and outputs)."""
        return tuple(self._nodes)

    @property
    def known(self) -> Mapping[str, np.ndarray]:
        """The tensors whose values are known when the graph is lowered (folded constants)."""
        return self._known

    @property
    def recomputes(self) -> bool:
        """Whether Builder.recomputeOutputInBackwardPass marks any node Recompute."""
        return any(n.recompute == 2 for n in self._nodes)

    def is_constant(self, name: str) -> bool:
        """Whether ``name`` was folded into a compile-time value when the model was lowered."""
        return name in self._known

    @property
    def trainable(self) -> list[str]:
        """The floating-point weights (integer and boolean ones cannot take gradients)."""
        return [name for name, value in self.weights.items()
                if np.issubdtype(value.dtype, np.inexact)]

    def _plan(self, wanted: tuple[str, ...]) -> list[_Node]:
        """The nodes ``wanted`` needs, in graph order (folded ones left out)."""
        if wanted not in self._plans:
            unknown = [w for w in wanted if w not in self.tensors]
            if unknown:
                raise KeyError(f"{unknown} are not tensors of the model; anchor an input, a "
                               f"weight or a node output.")
            needed, stack = set(), [w for w in wanted if w not in self._known]
            for i, node in enumerate(self._nodes):  # printing is what a PrintTensor is for,
                if node.ctx.op_type == "PrintTensor":  # read or not (ops_print)
                    needed.add(i)
                    stack.extend(n for n in node.inputs if n and n not in self._known)
            while stack:
                index = self._producer.get(stack.pop())
                if index is None or index in needed:
                    continue
                needed.add(index)
                stack.extend(i for i in self._nodes[index].inputs if i and i not in self._known)
            self._plans[wanted] = [self._nodes[i] for i in sorted(needed)]
        return self._plans[wanted]

    def _fused(self, wanted: tuple[str, ...]) -> list[_Node]:
        """:meth:`_plan`'s nodes with each pair :data:`FUSIONS` offers to lower together made
        one node (:meth:`_fuse_pairs`)."""
        if not self.fused:
            return self._plan(wanted)
        if wanted not in self._fused_plans:
            self._fused_plans[wanted] = self._fuse_pairs(self._plan(wanted), wanted)
        return self._fused_plans[wanted]

    def _fuse_pairs(self, plan: list[_Node], wanted: tuple[str, ...]) -> list[_Node]:
        """``plan`` with each pair :data:`FUSIONS` offers made one node, where the first's one
        output is read by the second alone (once), is not ``wanted`` (anchors, gradient
        anchors) nor a graph output, and both nodes are traced (not shape-derived) with the
        same partials type. The pair runs where the second stood (the first's other readers:
        none). Nothing is fused unless ``fused``."""
        if not self.fused:
            return plan
        kept = {*wanted, *self.outputs}
        made = {o: node for node in plan for o in node.outputs if o}
        firsts: set[int] = set()
        out: list[_Node] = []
        for node in plan:
            fused = None
            for name in dict.fromkeys(n for n in node.inputs if n):
                first = made.get(name)
                fn = first and _FUSION_OPS.get((id(first.op), id(node.op)))
                if (fn is None or name in kept or self._reads.get(name) != 1
                        or first.static or node.static or first.partials != node.partials
                        or [o for o in first.outputs if o] != [name]):
                    continue
                fused = _fused_node(first, node, node.inputs.index(name), fn)
                firsts.add(id(first))
                break
            out.append(fused or node)
        return [n for n in out if id(n) not in firsts]

    def _delegated(self, wanted: tuple[str, ...]) -> list[_Node]:
        """:meth:`_plan`'s nodes with each run of consecutive nodes that are :func:`_delegable`
        and that holds a :data:`~.delegated.HEAVY` operator made one node run by onnxruntime
        (:class:`~.delegated.Segment`); its outputs are what the rest of the plan reads and
        what is ``wanted``."""
        if wanted in self._delegated_plans:
            return self._delegated_plans[wanted]
        plan = self._plan(wanted)
        runs: list[list[_Node]] = [[]]
        for node in plan:
            if _delegable(node):
                runs[-1].append(node)
            elif runs[-1]:
                runs.append([])
        segments = {id(run[0]): run for run in runs
                    if any(n.ctx.op_type in delegated.HEAVY for n in run)}
        out: list[_Node] = []
        index = 0
        while index < len(plan):
            run = segments.get(id(plan[index]))
            if run is None:
                out.append(plan[index])
                index += 1
                continue
            inside = {id(n) for n in run}
            read_elsewhere = {i for n in plan if id(n) not in inside for i in n.inputs if i}
            out.append(self._segment(run, {*wanted, *read_elsewhere}))
            index += len(run)
        self._delegated_plans[wanted] = self._fuse_pairs(out, wanted)
        return self._delegated_plans[wanted]

    def _segment(self, run: list[_Node], needed: set[str]) -> _Node:
        """One node computing ``run`` by onnxruntime, giving the tensors in ``needed``."""
        made = [o for n in run for o in n.outputs if o]
        outputs = [o for o in made if o in needed]
        reads = list(dict.fromkeys(i for n in run for i in n.inputs if i and i not in made))
        label = f"{run[0].label}..{run[-1].label}" if len(run) > 1 else run[0].label
        fused = self._fuse_pairs(run, tuple(needed))

        def xla(args: list[Any], alone: bool) -> dict[str, Any]:  # the run's tensors by XLA
            values = dict(zip(reads, args, strict=True))
            for node in fused if alone else run:
                results = _compute(node, [values[i] if i else None for i in node.inputs])
                values.update((o, r) for o, r in zip(node.outputs, results, strict=False) if o)
            return values

        protos = [_without_popart_attributes(n.proto) for n in run if n.proto is not None]
        op = delegated.Segment(label, protos, reads, outputs,
                               {r for r in reads if r in self.weights}, self.opset, xla,
                               self.delegation)  # type: ignore[arg-type]
        ctx = Ctx(label, "onnxruntime", self.opset, {}, reads, outputs,
                  [r in self._known for r in reads])
        return _Node(label, op, ctx, tuple(reads), tuple(outputs), False)  # type: ignore[arg-type]

    def evaluate(self, weights: Mapping[str, Any], inputs: Mapping[str, Any],
                 wanted: Sequence[str],
                 offsets: Mapping[str, Any] | None = None,
                 fresh: Mapping[str, Any] | None = None,
                 constants: Mapping[str, Any] | None = None) -> dict[str, jax.Array]:
        """The ``wanted`` tensors, computed from ``inputs`` and ``weights`` (a weight missing
        from ``weights`` takes its value from the model). ``offsets`` are added to the named
        tensors where they come into being (zeros there make the gradient with respect to any
        tensor a gradient with respect to its offset). ``fresh``: other values of some
        weights that every node reading them differentiates at, while the values computed
        stay those of ``weights`` (PopART's backward reads a weight's current value but the
        activations stashed by the forward: pipelining's stale weights). ``constants``: inputs
        given as compile-time (numpy) values, used as they are (a subgraph's reads of its
        enclosing graph's shape-derived values). Pure: trace it with ``jax.jit``, ``jax.vmap``
        or ``jax.grad``."""
        keep = _KEEPS.get(_RECOMPUTATION.get())  # which outputs a recomputing backward keeps
        key = tuple(wanted) + tuple(offsets or ())
        if keep is not None:
            plan = self._plan(key)
        elif self.delegation is not None and not offsets and not fresh and not constants:
            plan = self._delegated(key)
        else:
            plan = self._fused(key)
        offsets = offsets or {}

        def shifted(name: str, value: Any) -> Any:
            return value + offsets[name] if name in offsets else value

        env: dict[str, Any] = {**self._known, **(constants or {})}

        def load(node: _Node) -> None:  # the weights and inputs the node reads, into env
            for name in node.inputs:
                if not name or name in env:
                    continue
                if name in self.weights:
                    env[name] = shifted(name, jnp.asarray(weights[name] if name in weights
                                                          else self.weights[name]))
                elif name in self.inputs:
                    if name not in inputs:
                        raise KeyError(f"input {name!r} is missing; the model's inputs are "
                                       f"{list(self.inputs)}.")
                    env[name] = shifted(name, jnp.asarray(inputs[name]))

        def compute(node: _Node, values: dict[str, Any],
                    shifts: Mapping[str, Any]) -> None:  # its outputs, into values
            args = [values[name] if name else None for name in node.inputs]
            if SOFTMAX_AXIS in node.ctx.attrs and node.inputs[0] in offsets:
                args[2] = None  # the probabilities' gradient is anchored: PopART's direct
                #                 Softmax-Nll pattern does not apply (its tensor is kept)
            results = _compute(node, args, fresh)
            missing = [name for i, name in enumerate(node.outputs) if name and i >= len(results)]
            if missing:
                raise UnsupportedModel([f"{node.label} ({node.ctx.op_type}): outputs {missing} "
                                        f"are not computed by the xla backend"])
            values.update((name, value + shifts[name] if name in shifts else value)
                          for name, value in zip(node.outputs, results, strict=False) if name)

        for segment in _segments(plan, keep, bool(fresh)):
            for node in segment:
                load(node)
            if len(segment) == 1 or keep is None:
                for node in segment:
                    compute(node, env, offsets)
                continue
            # PopART's recomputation: the backward recomputes this segment from its inputs
            # (every traced value it reads is an argument, so gradients reach them all)
            made = {o for node in segment for o in node.outputs if o}
            reads = list(dict.fromkeys(i for node in segment for i in node.inputs
                                       if i and i not in made and i not in self._known))
            shifts = {name: offsets[name] for name in made if name in offsets}

            def run(values: dict[str, Any], shifts: dict[str, Any],
                    segment: list[_Node] = segment, made: set[str] = made) -> dict[str, Any]:
                local = {**self._known, **(constants or {}), **values}
                for node in segment:
                    compute(node, local, shifts)
                return {name: local[name] for name in made}

            env.update(jax.checkpoint(run)({name: env[name] for name in reads}, shifts))
        out = {}
        for name in wanted:
            value = env.get(name)
            if value is None:  # an input or weight nobody consumes
                value = shifted(name, weights.get(name, self.weights.get(name))
                                if name in self.weights else inputs[name])
            out[name] = jnp.asarray(value)
        return out


#: Pairs of operators lowered as one where the first's output is read by the second alone
#: (:meth:`LoweredGraph._fused`): ((domain, op type) of the first, of the second) -> ``fn(
#: first's Ctx, second's Ctx, *first's inputs, *second's other inputs)`` giving the second's
#: outputs, or None to decline (the two then run apart, as always).
FUSIONS: dict[tuple[tuple[str, str], tuple[str, str]], Callable[..., Any]] = {
    (("", "Conv"), ("", "Relu")): ops_conv.conv_relu,
}
_FUSION_OPS = {(id(OPS[first]), id(OPS[second])): fn for (first, second), fn in FUSIONS.items()}


@dataclass(frozen=True)
class _Fused:
    """The operator of two fused nodes: the fusion's lowering, else the two in turn."""

    first: _Node
    second: _Node
    at: int                     # where the first's output is among the second's inputs
    fn: Callable[..., Any]

    def __call__(self, ctx: Ctx, *args: Any) -> tuple[Any, ...]:
        count = len(self.first.inputs)
        own, rest = list(args[:count]), list(args[count:])
        first = self.first.ctx.with_values(own)
        got = self.fn(first, self.second.ctx.with_values(
            [*rest[:self.at], UNKNOWN, *rest[self.at:]]), *own, *rest)
        if got is not None:
            return got if isinstance(got, tuple) else (got,)
        value = next(v for v, o in zip(self.first.op(first, *own), self.first.outputs,
                                       strict=False) if o)
        theirs = [*rest[:self.at], value, *rest[self.at:]]
        return self.second.op(self.second.ctx.with_values(theirs), *theirs)


def _fused_node(first: _Node, second: _Node, at: int, fn: Callable[..., Any]) -> _Node:
    """One node computing ``second`` from ``first``'s output (its input ``at``)."""
    inputs = (*first.inputs, *second.inputs[:at], *second.inputs[at + 1:])
    flags = [first.ctx.is_static(i) for i in range(len(first.inputs))] + [
        second.ctx.is_static(i) for i in range(len(second.inputs)) if i != at]
    ctx = Ctx(f"{first.label}+{second.label}", f"{first.ctx.op_type}+{second.ctx.op_type}",
              second.ctx.opset, {}, inputs, second.outputs, flags)
    return _Node(ctx.name, _Fused(first, second, at, fn), ctx, inputs,  # type: ignore[arg-type]
                 second.outputs, False, first.partials, second.recompute)


def _compute(node: _Node, args: list[Any],
             fresh: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
    """The node's outputs from its inputs' values ``args`` (``fresh``: see
    :meth:`LoweredGraph.evaluate`), its failures named as the node's."""
    try:
        with _own_partials(node):
            if node.static:
                with jax.ensure_compile_time_eval():
                    return tuple(np.asarray(r) for r in node.op(node.ctx.with_values(args), *args))
            results = node.op(node.ctx.with_values(args), *args)
            if fresh and any(n in fresh for n in node.inputs):
                results = _fresh_gradient(node, args, fresh, results)
            return results
    except ModelError:
        raise
    except NotSupported as err:
        failed = UnsupportedModel([f"{node.label} ({node.ctx.op_type}): {err}"])
        failed.popart_text = getattr(err, "popart_text", None)
        raise failed from err
    except Exception as err:  # JAX's shape and type errors do not name the node
        shapes = ", ".join(f"{n or '(omitted)'}: {_describe(a)}"
                           for n, a in zip(node.inputs, args, strict=True))
        raise NodeFailed(
            f"node {node.label} ({node.ctx.op_type}) cannot be computed from its inputs "
            f"[{clip(shapes, 400)}]: {type(err).__name__}: {clip(str(err), 400)} Fix: "
            f"correct the shapes or types feeding this node (onnx.checker with shape "
            f"inference finds most such mistakes).") from err


def _delegable(node: _Node) -> bool:
    """Whether onnxruntime may run the node in a segment (:mod:`.delegated`): an ONNX operator
    of :data:`~.delegated.OPS` as the model has it, computed when traced (not BatchNormalization
    in training mode). A partials type does not matter: XLA:CPU sums half products in
    float32 whatever it says, as a float16 segment does (:mod:`.half_segment`)."""
    return (node.proto is not None and node.ctx.op_type in delegated.OPS
            and node.op is OPS.get(("", node.ctx.op_type)) and not node.static
            and SOFTMAX_AXIS not in node.ctx.attrs and not node.ctx.attr("training_mode", 0))


def _without_popart_attributes(node: onnx.NodeProto) -> onnx.NodeProto:
    """``node`` without the Builder's own attributes (``__ipu_number``, ...), which
    onnxruntime does not know."""
    out = onnx.NodeProto()
    out.CopyFrom(node)
    del out.attribute[:]
    out.attribute.extend(a for a in node.attribute if not a.name.startswith("__"))
    return out


def _segments(plan: list[_Node], keep: Any, fresh: bool) -> list[list[_Node]]:
    """The plan cut after each node whose outputs the backward keeps (a checkpoint, by
    ``keep``): each segment is recomputed from its inputs in the backward. One node per
    segment without recomputation, and around nodes computed at trace time (shape-derived)
    or with fresh weights (pipelining), which are never recomputed."""
    if keep is None:
        return [[node] for node in plan]
    out: list[list[_Node]] = [[]]
    for position, node in enumerate(plan):
        if node.static or fresh:
            out += [[node], []]
            continue
        out[-1].append(node)
        if keep(position, node):
            out.append([])
    return [segment for segment in out if segment]


_RECOMPUTATION: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "recomputation", default=None)
_NORMS = frozenset({"BatchNormalization", "LayerNormalization", "GroupNormalization",
                    "InstanceNormalization", "RMSNormalization"})


def _recompute_type(node: onnx.NodeProto) -> int:
    return next((int(a.i) for a in node.attribute if a.name == RECOMPUTE_OUTPUT), 0)


def _standard(position: int, node: _Node) -> bool:
    """PopART's Standard: checkpoints spread through the forward (one node in eight here),
    explicit marks first."""
    return node.recompute != 2 and (node.recompute == 1 or position % 8 == 0)


#: recomputation mode -> whether node ``position`` of the plan keeps its outputs
_KEEPS: dict[str | None, Any] = {
    "marked": lambda position, node: node.recompute != 2,
    "standard": _standard,
    "recompute_all": lambda position, node: node.recompute == 1,
    "norm_only": lambda position, node: node.recompute != 2 and node.ctx.op_type not in _NORMS,
}


@contextlib.contextmanager
def recomputation(mode: str | None) -> Any:
    """Within this block :meth:`LoweredGraph.evaluate` recomputes in the backward what PopART's
    recomputation ``mode`` does not keep ("standard", "recompute_all", "norm_only", or "marked":
    only the nodes Builder.recomputeOutputInBackwardPass marks Recompute): the plan is cut
    after each kept node and each segment is a ``jax.checkpoint``, recomputed from its inputs
    when its backward runs. None: everything is kept."""
    token = _RECOMPUTATION.set(mode)
    try:
        yield
    finally:
        _RECOMPUTATION.reset(token)


def _own_partials(node: _Node) -> contextlib.AbstractContextManager[None]:
    """A node's own partials type (PopART's Builder.setPartialsType) while it is traced: it
    overrides the session's ``precision.partials_type``, as in PopART."""
    return partials(node.partials) if node.partials else contextlib.nullcontext()


def _fresh_gradient(node: _Node, args: list[Any], fresh: Mapping[str, Any],
                    results: Sequence[Any]) -> tuple[Any, ...]:
    """``results`` in value, differentiated as the node with its ``fresh`` weights."""
    again = [fresh.get(n, a) for n, a in zip(node.inputs, args, strict=True)]
    other = node.op(node.ctx.with_values(again), *again)
    stop = jax.lax.stop_gradient
    return tuple(stop(r) + o - stop(o) if jnp.issubdtype(jnp.result_type(r), jnp.inexact)
                 else r for r, o in zip(results, other, strict=False))


def _opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return int(onnx.defs.onnx_opset_version())


def _value_type(value: onnx.ValueInfoProto) -> tuple[tuple[int | None, ...] | None, np.dtype]:
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type":
        raise NotSupported(f"its type is a {kind or 'missing type'}, not a tensor")
    tensor = value.type.tensor_type
    shape = (tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
             if tensor.HasField("shape") else None)
    return shape, np_dtype(tensor.elem_type)


# -- subgraphs: the bodies of Call, If, Loop and Scan ---------------------------------------


@dataclass(frozen=True)
class _Outer:
    """What a subgraph may read of its enclosing graphs: constants, names whose values are
    compile-time (numpy) values when tracing, and every name."""

    known: Mapping[str, np.ndarray]
    static: set[str]
    names: set[str]


class Body:
    """A subgraph (the body of a Call, If, Loop or Scan node) lowered once, with the node.
    ``body(args, scope)``: its outputs, in order, computed from ``args`` (its inputs, in
    order) and the enclosing graph's tensors ``scope`` (by name) - for an If branch
    (``by_name``) its inputs too are read from ``scope``, as PopART's If does."""

    def __init__(self, name: str, graph: LoweredGraph, inputs: Sequence[str],
                 outer: Sequence[str], static: set[str], by_name: bool) -> None:
        self.name, self.graph, self.by_name = name, graph, by_name
        self.inputs, self.outer, self.static = tuple(inputs), tuple(outer), static
        self.outputs = tuple(graph.outputs)

    def __call__(self, args: Sequence[Any], scope: Mapping[str, Any]) -> list[Any]:
        feed = ({n: scope[n] for n in self.inputs} if self.by_name
                else dict(zip(self.inputs, args, strict=True)))
        constants = {}
        for name in self.outer:
            (constants if name in self.static else feed)[name] = scope[name]
        got = self.graph.evaluate({}, feed, self.outputs, constants=constants)
        return [got[n] for n in self.outputs]

    def __repr__(self) -> str:
        return f"Body({self.name!r}, inputs={list(self.inputs)}, outputs={list(self.outputs)})"


def _body_input_type(value: onnx.ValueInfoProto
                     ) -> tuple[tuple[int | None, ...] | None, np.dtype | None]:
    """A subgraph input's declared (shape, dtype), each None where not given."""
    try:
        return _value_type(value)
    except NotSupported:
        return None, None


def _node_graphs(node: onnx.NodeProto) -> list[tuple[str, onnx.GraphProto]]:
    return [(a.name, a.g) for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]


def _with_softmax_logits(nodes: list[onnx.NodeProto], opset: int) -> list[onnx.NodeProto]:
    """The nodes, each PopART Nll whose probabilities a Softmax makes given that Softmax's
    input (its logits) as a third input and its axis (:data:`SOFTMAX_AXIS`): PopART's default
    pattern NlllWithSoftmaxGradDirect, which :func:`~.ops.popart_nll` applies."""
    softmax = {n.output[0]: n for n in nodes if n.op_type == "Softmax"
               and n.domain in ("", "ai.onnx") and n.output}
    out = []
    for node in nodes:
        made = softmax.get(node.input[0]) if node.input else None
        if (node.op_type == "Nll" and node.domain == GRAPHCORE and made is not None
                and len(node.input) == 2):
            axis = next((int(a.i) for a in made.attribute if a.name == "axis"),
                        -1 if opset >= 13 else 1)
            node = onnx.NodeProto.FromString(node.SerializeToString())
            node.input.append(made.input[0])
            node.attribute.append(onnx.helper.make_attribute(SOFTMAX_AXIS, axis))
        out.append(node)
    return out


def _with_outer_inputs(graph_nodes: Sequence[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The nodes, each that calls subgraphs given as extra inputs (after its own) the tensors
    of this graph and enclosing ones that its subgraphs read (an If branch's inputs among
    them): the lowering plans, folds and feeds them like any input."""
    out = []
    for node in graph_nodes:
        if _node_graphs(node):
            reads = [n for n in node_reads(node) if n not in node.input]
            node = onnx.NodeProto.FromString(node.SerializeToString())
            node.input.extend(reads)
            node.attribute.append(onnx.helper.make_attribute(_OUTER, reads or [""]))
        out.append(node)
    return out


_OUTER = "__outer_inputs"  # a node's extra inputs: what its subgraphs read (not an attribute
#                            read_attributes passes on: it starts with "__")


def _with_bodies(node: onnx.NodeProto, attrs: dict[str, Any], opset: int, scope: _Outer,
                 declared: Mapping[str, tuple[int | None, ...] | None]) -> dict[str, Any]:
    """``attrs`` with each subgraph lowered into a :class:`Body`, and for the op: the node's
    extra inputs (``__outer``) and its outputs' declared shapes (``__declared``)."""
    out = dict(attrs)
    problems = []
    cond = scope.known.get(node.input[0]) if node.op_type == "If" and node.input else None
    for name, graph in _node_graphs(node):
        if cond is not None and name != ("then_branch" if np.asarray(cond).reshape(-1)[0]
                                         else "else_branch"):
            out[name] = None  # a branch never taken: its condition is a constant
            continue
        try:
            lowered = _lower_graph(graph, opset, {}, scope)
        except UnsupportedModel as err:
            problems.extend(f"subgraph {name} ({graph.name or 'unnamed'}): {p}"
                            for p in err.problems)
            continue
        declared_inputs = [v.name for v in graph.input]
        reads = [n for n in lowered.inputs if n not in declared_inputs]
        out[name] = Body(graph.name or name, lowered, declared_inputs, reads,
                         {n for n in reads if n in scope.static}, node.op_type == "If")
    if problems:
        raise UnsupportedModel(problems)
    extra = next(a for a in node.attribute if a.name == _OUTER)
    out["__outer"] = tuple(n.decode() for n in extra.strings if n)
    out["__declared"] = tuple(declared.get(o) for o in node.output)
    return out


def lower(model: onnx.ModelProto | bytes | str | Path,
          static_inputs: Mapping[str, Any] | None = None,
          unfolded: Collection[str] = ()) -> LoweredGraph:
    """Check every node of ``model`` and prepare it for :meth:`LoweredGraph.evaluate`.

    ``static_inputs``: values for graph inputs that may serve as compile-time constants (a
    shape or axes fed as an input); they are folded in only where the graph needs a constant,
    and are then no longer inputs. ``unfolded``: tensors computed when running rather than
    folded (gradient anchors on constants: PopART differentiates them), unless a compile-time
    input needs them. Raises :class:`UnsupportedModel` listing every problem.
    """
    model = load_model(model)
    given = {k: np.asarray(v) for k, v in (static_inputs or {}).items()}
    return _lower_graph(model.graph, _opset(model), given, None, frozenset(unfolded))


def _entry(node: onnx.NodeProto) -> Op | None:
    """The node's operator: the table's, else a custom op registered for its domain."""
    if node.domain in ("", "ai.onnx", GRAPHCORE):
        return OPS.get((GRAPHCORE if node.domain == GRAPHCORE else "", node.op_type))
    return OPS.get((node.domain, node.op_type)) or custom_entry(node.domain, node.op_type)


def _lower_graph(graph: onnx.GraphProto, opset: int, given: dict[str, np.ndarray],
                 outer: _Outer | None, unfolded: frozenset[str] = frozenset()) -> LoweredGraph:
    """:func:`lower` for one graph: the model's, or (``outer`` given: the enclosing graph's
    tensors) the body of a Call, If, Loop or Scan node, whose initializers are constants, whose
    inputs take the types of what the node passes, and which may read the enclosing graph's
    tensors."""
    problems: list[str] = []
    refused: dict[int, str | None] = {}  # PopART's own words for a problem (by its index)

    initializers: dict[str, np.ndarray] = {}
    for tensor in graph.initializer:
        try:
            np_dtype(tensor.data_type)
            initializers[tensor.name] = to_array(tensor)
        except (NotSupported, ValueError, TypeError) as err:
            problems.append(f"initializer {tensor.name!r}: {err}")
    for sparse in graph.sparse_initializer:
        problems.append(f"initializer {sparse.values.name!r}: sparse initializers are not "
                        f"supported")
    inputs: dict[str, tuple[tuple[int | None, ...] | None, np.dtype]] = {}
    unusable: set[str] = set()
    for value in graph.input:
        if value.name in initializers:
            continue
        if outer is not None:  # typed by what the calling node passes
            inputs[value.name] = _body_input_type(value)
            continue
        try:
            found = _value_type(value)
            if found[0] is None:
                raise NotSupported("its rank is unknown (no shape); the xla backend, like "
                                   "PopART, compiles static shapes: give it one")
            inputs[value.name] = found
        except NotSupported as err:
            problems.append(f"graph input {value.name!r}: {err}")
            unusable.add(value.name)

    # Which tensors can be constants (A), which must be (B), which are (C).
    entries = [(node, _entry(node)) for node in _with_softmax_logits(
        _with_outer_inputs(graph.node), opset)]
    capable = {*initializers, *given, *(outer.known if outer else ())}
    for node, entry in entries:
        if entry and not (entry.random or draws_random(node)) and (
                entry.shape_only or all(i in capable for i in node.input if i)):
            capable.update(node.output)
    needed: set[str] = set()
    for node, entry in reversed(entries):
        if not entry:
            continue
        needed.update(node.input[i] for i in entry.static
                      if i < len(node.input) and node.input[i] in capable)
        if not entry.shape_only and any(o in needed for o in node.output):
            needed.update(i for i in node.input if i)
    if outer is not None:
        needed.update(initializers)  # a subgraph has no weights of its own
    constants = {k: v for k, v in initializers.items() if k in needed}
    constants.update((k, v) for k, v in given.items() if k in needed and k in inputs)
    static: set[str] = set(constants)
    known: dict[str, np.ndarray] = dict(constants)
    if outer is not None:  # the enclosing graph's tensors this one reads
        reads = [n for n in free_names(graph) if n in outer.names and n not in inputs]
        known = {**outer.known, **known}
        static.update(n for n in reads if n in outer.known or n in outer.static)
        inputs.update((n, (None, None)) for n in reads if n not in outer.known)
    declared = {v.name: _body_input_type(v)[0] for v in (*graph.value_info, *graph.output)}

    available = {*inputs, *initializers, *unusable, *known}
    nodes: list[_Node] = []
    for node, entry in entries:
        label = node.name or (node.output[0] if node.output else node.op_type)
        where = f"{label} ({node.op_type})"
        missing = [i for i in node.input if i and i not in available]
        available.update(o for o in node.output if o)
        if missing:
            problems.append(f"{where}: input(s) {missing} are not produced by an earlier node, "
                            f"an initializer or a graph input")
        if entry is None:
            domain = node.domain or "ai.onnx"
            custom = "" if domain in ("ai.onnx", GRAPHCORE) else (
                f" (a custom op: give its computation with popart_kit.register_custom_op("
                f"{domain!r}, {node.op_type!r}, version, compute))")
            problems.append(f"{where}: operator {domain}.{node.op_type} is not supported"
                            f"{custom}")
            continue
        try:
            own_partials = node_partials(node)
        except NotSupported as err:
            problems.append(f"{where}: {err}")
            continue
        flags = [bool(i) and i in static for i in node.input]
        attrs = read_attributes(node)
        if any(isinstance(v, onnx.GraphProto) for v in attrs.values()):
            scope = _Outer(known, static, available | (outer.names if outer else set()))
            try:
                attrs = _with_bodies(node, attrs, opset, scope, declared)
            except UnsupportedModel as err:
                problems.extend(f"{where}: {p}" for p in err.problems)
                continue
        ctx = Ctx(label, node.op_type, opset, attrs, node.input, node.output, flags)
        bad = [i for i in entry.static if ctx.has_input(i) and not flags[i]]
        for i in bad:
            name = node.input[i]
            hint = (" (a graph input: give its value in lower(..., static_inputs={...}) or "
                    "make it an initializer)" if name in inputs else "")
            refused[len(problems)] = popart_constant_text(node.op_type, opset, i, name)
            problems.append(f"{where}: input {i} ({name!r}) must be a compile-time constant - "
                            f"an initializer, a Constant or computed from shapes{hint}")
        is_static = not (entry.random or draws_random(node)) and (entry.shape_only or all(
            flags[i] for i, n in enumerate(node.input) if n)) and not any(
            o in unfolded and o not in needed for o in node.output)
        if is_static:
            static.update(o for o in node.output if o)
        values = [known.get(i, UNKNOWN) if i else None for i in node.input]
        try:
            if entry.check:
                entry.check(ctx.with_values(values))
        except NotSupported as err:
            problems.append(f"{where}: {err}")
            refused[len(problems) - 1] = getattr(err, "popart_text", None)
            continue
        if is_static and not bad and all(v is not UNKNOWN for v in values):
            try:
                results = entry(ctx.with_values(values), *values)
                known.update((o, np.asarray(r))
                             for o, r in zip(node.output, results, strict=False) if o)
                continue
            except NotSupported as err:
                problems.append(f"{where}: {err}")
                continue
            except Exception as err:  # a model mistake found while folding constants
                if outer is None:
                    problems.append(f"{where}: cannot compute it from its constant inputs: "
                                    f"{type(err).__name__}: {err}")
                    continue
                # in a subgraph (an If branch not taken?) it fails only if it runs
        nodes.append(_Node(label, entry, ctx, tuple(node.input), tuple(node.output), is_static,
                           own_partials, _recompute_type(node), node))

    outputs = [o.name for o in graph.output]
    for name in outputs:
        if name not in available:
            problems.append(f"graph output {name!r} is not produced by any node, initializer or "
                            f"input")
    if problems:
        failed = UnsupportedModel(problems)
        if refused.get(0):  # popart_kit.popart raises PopART's text, for the first as PopART
            failed.popart_text = refused[0]
        raise failed
    weights = {k: v for k, v in initializers.items() if k not in constants}
    raise_errors("model", narrowing_problems("weights", weights), error=InvalidModel)
    return LoweredGraph(opset=opset,
                        inputs={k: v for k, v in inputs.items() if k not in constants},
                        weights=weights, constants=constants, known=known, outputs=outputs,
                        nodes=nodes)


def unsupported(model: onnx.ModelProto | bytes | str | Path,
                static_inputs: Mapping[str, Any] | None = None) -> list[str]:
    """Every reason the xla backend cannot run ``model`` (empty when it can)."""
    try:
        lower(model, static_inputs)
    except UnsupportedModel as err:
        return err.problems
    return []
