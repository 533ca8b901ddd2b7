"""PopART's refusals that only a PopART program meets: checks PopART makes while it builds,
prunes and lowers its IR, of things the kit runs (so ``pk`` sessions keep running them) or
annotations the kit ignores. A session of ``popart_kit.popart`` runs :func:`check_program`
before anything is compiled; each refusal raises ``popart_exception`` with PopART's message
(programs and PopART's tests match on it) and is listed in docs/rules.md under its rule id,
with the PopART source line it mirrors:

- V54 Clip-11's min and max are constants (willow/src/op/clip.cpp:155, :166);
- V55 MaxPool-10's dilations are 1 (op/maxpool.cpp:202);
- V56 AveragePool's count_include_pad is 0 (op/averagepool.cpp:46);
- V57 ``excludePatterns`` names patterns PopART has (op.cpp:842);
- V58 a MatMul's ``setSerializeMatMul`` factor divides the dimension it splits
  (op/matmul.cpp:241-283);
- V59 a gradient anchor names a tensor whose gradient exists (ir.cpp:2497 validateAnchors);
- V60 manual recomputation is not mixed with ``autoRecomputation`` (ir.cpp:1420);
- V61 something is left to compute once PopART prunes what no anchor or loss needs
  (transforms/prune.cpp:397);
- V6 (the kit's rule, here also with accumulation enabled at factor 1): when pipelining
  with gradient accumulation, the factor is at least the pipeline depth
  (transforms/pipeline.cpp:1389);
- V64 when pipelining, the ops of a called subgraph sit on the calling op's virtual graph
  (op/call.cpp:323-345);
- V62 an op that only a pattern removes (a gradient op without an Opx) is not left by a
  disabled pattern (popx/irlowering.cpp:675 IrLowering::createOpx).

V63 (resetHostWeights with constantWeights, session.cpp:787) is the session's own; V51-V53
(reduction axes, opset-6 variadic shapes, Reverse dimensions) are ONNX's or ai.graphcore's
rules for every user, in popart_kit._model.checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import onnx

from .._base.names import GRADIENT_PREFIX
from .._base.problems import popart_vector
from .._base.schedule import depth_text
from .._model.builder_settings import EXCLUDE_PATTERNS, RECOMPUTE_OUTPUT
from .._model.layout import PipelineLayout, opid
from ._core import PATTERNS, Patterns, popart_exception

__all__ = ["check_program", "PATTERN_NAMES", "NEEDS_PATTERN"]

#: Every name PopART's PatternNames knows (patterns.cpp): the pre-alias patterns and the
#: transforms registered by name (AddPatternName).
PATTERN_NAMES = frozenset(PATTERNS) | {
    "InPlace", "UpdateInplacePrioritiesForIpu", "AdamDecompose", "AdaptiveDecompose",
    "ContiguateIpuCopyIndicesPattern", "SGD0Decompose", "SGD1Decompose", "SGD2Decompose",
    "ViewSimplifyPattern"}

_ONNX, _GC = "ai.onnx", "ai.graphcore"

#: Gradient ops PopART has no Opx for (willow/src/popx has none): per forward operator, per
#: input whose gradient is computed, the gradient op and the mandatory pattern that replaces
#: it. With the pattern disabled (runtime asserts off), IrLowering::createOpx refuses it.
NEEDS_PATTERN: dict[tuple[str, str], dict[int, tuple[str, str]]] = {
    (_GC, "Atan2"): {0: ("Atan2Arg0Grad", "Atan2Arg0GradOp"),
                     1: ("Atan2Arg1Grad", "Atan2Arg1GradOp")},
    (_ONNX, "Cos"): {0: ("CosGrad", "CosGradOp")},
    (_ONNX, "Reciprocal"): {0: ("ReciprocalGrad", "ReciprocalGradOp")},
    (_ONNX, "Sqrt"): {0: ("SqrtGrad", "SqrtGradOp")},
    (_ONNX, "Sub"): {1: ("SubtractArg1Grad", "SubtractArg1GradOp")},
    (_ONNX, "Exp"): {0: ("ExpGrad", "ExpGradOp")},
    (_GC, "Expm1"): {0: ("Expm1Grad", "Expm1GradOp")},
    (_GC, "Log1p"): {0: ("Log1pGrad", "Log1pGradOp")},
    (_ONNX, "Abs"): {0: ("AbsGrad", "AbsGradOp")},
    (_ONNX, "MatMul"): {0: ("MatMulLhsGrad", "MatMulLhsGradOp"),
                        1: ("MatMulRhsGrad", "MatMulRhsGradOp")},
    (_ONNX, "Conv"): {0: ("ConvDataGrad", "ConvDataGrad")},
    # ConvTranspose becomes Conv and ConvFlipWeights (pattern ConvTranspose); the flip's
    # gradient is ConvFlipWeightsGrad
    (_ONNX, "ConvTranspose"): {0: ("ConvDataGrad", "ConvDataGrad"),
                               1: ("ConvFlipWeightsGrad", "ConvFlipWeightsGradOp")},
}
#: Forward operators PopART has no Opx for, and the pattern that replaces them.
_FORWARD_NEEDS_PATTERN = {(_ONNX, "Cosh"): "CoshOp", (_ONNX, "ConvTranspose"): "ConvTranspose"}
#: Operators PopART keeps whatever reads their outputs (Op::hasSideEffect).
_SIDE_EFFECTS = frozenset({"PrintTensor", "Call", "If", "Loop"})
#: The dimension each setSerializeMatMul mode splits: (lhs or rhs, index from the end).
_SERIALISED = {"input_channels": (0, 2, "input channels dim", "input_channels dim"),
               "reducing_dim": (0, 1, "reducing dimension", "reducing_dim dim"),
               "output_channels": (1, 1, "output channels dim", "output_channels dim")}


def _domain(node: onnx.NodeProto) -> str:
    return node.domain or _ONNX


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _version(model: onnx.ModelProto, domain: str) -> int:
    return next((int(o.version) for o in model.opset_import
                 if (o.domain or _ONNX) == domain), 0)


def _reads(node: onnx.NodeProto) -> list[str]:
    """The tensors a node reads: its inputs and, for control flow and calls, every name its
    subgraphs read (outer-scope tensors are read implicitly; an over-approximation)."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        for graph in ([attr.g] if attr.HasField("g") else list(attr.graphs)):
            for inner in graph.node:
                names.extend(_reads(inner))
    return names


def _ancestors(nodes: Sequence[onnx.NodeProto], targets: Iterable[str],
               cut: frozenset[str] = frozenset()) -> tuple[set[str], set[int]]:
    """The tensors and node positions ``targets`` depend on; ops in ``cut`` pass nothing back."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    tensors, used, todo = set(), set(), list(targets)
    while todo:
        name = todo.pop()
        if name in tensors:
            continue
        tensors.add(name)
        i = producer.get(name)
        if i is None or i in used:
            continue
        used.add(i)
        if nodes[i].op_type not in cut:
            todo.extend(_reads(nodes[i]))
    return tensors, used


def _descendants(nodes: Sequence[onnx.NodeProto], sources: Iterable[str],
                 cut: frozenset[str] = frozenset()) -> set[str]:
    """The tensors computed from ``sources`` (nodes in topological order)."""
    found = set(sources)
    for node in nodes:
        if node.op_type not in cut and any(n in found for n in _reads(node)):
            found.update(o for o in node.output if o)
    return found


def _has_data(model: onnx.ModelProto) -> set[str]:
    """Tensors with data when PopART creates the ops: initializers, Constant outputs and what
    is computed from Constants alone (PopART folds those first)."""
    data = {t.name for t in model.graph.initializer}
    folded = set(data)
    for node in model.graph.node:
        if node.op_type == "Constant" or (node.input and all(n in folded for n in node.input
                                                             if n)):
            folded.update(o for o in node.output if o)
    return folded


def _debug_name(node: onnx.NodeProto, model: onnx.ModelProto, scope: str = "") -> str:
    """PopART's Op::debugName (op.cpp:1108): Op(name (opid) or opid, inputs=[..],
    outputs=[..]), tensor ids scoped by their graph."""
    head = f"{node.name} ({opid(node, model)})" if node.name else opid(node, model)
    inputs = ", ".join(scope + n for n in node.input if n)
    outputs = ", ".join(scope + n for n in node.output if n)
    return f"Op({head}, inputs=[{inputs}], outputs=[{outputs}])"


def _call_refusals(node: onnx.NodeProto, attrs: dict[str, Any],
                   model: onnx.ModelProto) -> Iterable[str]:
    """CallOp's creator when pipelining (op/call.cpp:323-345): every op of the called graph
    sits on the calling op's virtual graph."""
    callee, vgid = attrs.get("callee"), attrs.get("__ipu_number")
    if not isinstance(callee, onnx.GraphProto) or vgid is None:
        return
    scope = f"{callee.name}/" if callee.name else ""
    for op in callee.node:
        ipu = next((a.i for a in op.attribute if a.name == "__ipu_number"), None)
        if ipu is None:
            yield (f"Op {_debug_name(op, model, scope)} in subgraph \"{callee.name}\" does not "
                   f"have a virtual graph id. When pipelining, subgraph ops must have a "
                   f"virtual graph id set.")
        elif ipu != vgid:
            yield (f"The virtual graph id ({ipu}) for Op {_debug_name(op, model, scope)} in "
                   f"subgraph \"{callee.name}\" does not match the virtual graph id ({vgid}) "
                   f"of the calling op. When pipelining, subgraph ops must have a virtual "
                   f"graph id matching the calling op. If you are trying to call the same "
                   f"subgraph from different pipeline stages, you will need to create a "
                   f"separate subgraph for each virtual graph.")


def _creation_refusals(model: onnx.ModelProto, pipelining: bool) -> Iterable[str]:
    """What PopART refuses while creating and setting up the ops, in graph order."""
    data = _has_data(model)
    for node in model.graph.node:
        domain, attrs = _domain(node), _attrs(node)
        if pipelining and domain == _GC and node.op_type == "Call":
            yield from _call_refusals(node, attrs, model)
        opset = _version(model, _ONNX)
        if domain == _ONNX and node.op_type == "Clip" and opset >= 11:
            for index, role in ((1, "min"), (2, "max")):
                if len(node.input) > index and node.input[index] \
                        and node.input[index] not in data:
                    yield (f"Op {node.name}({_ONNX}.Clip:11), inputs=[{node.input[0]}] "
                           f"currently only supports constant min/max parameters. Input "
                           f"'{role}' ({node.input[index]}) has no data.")
        if domain == _ONNX and node.op_type == "MaxPool" and opset >= 10:
            dilations = list(attrs.get("dilations", []))
            if any(d != 1 for d in dilations):
                yield (f"MaxPool has dilations {popart_vector(dilations)}. Dilations of value "
                       f"other than 1 are currently not supported.")
        if domain == _ONNX and node.op_type == "AveragePool" \
                and attrs.get("count_include_pad", 0):
            yield "`count_include_pad` is not supported"
        for name in attrs.get(EXCLUDE_PATTERNS, []):
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name not in PATTERN_NAMES:
                yield f"Invalid pattern name '{name}' in Op::excludePatterns"


def _serialisation_refusals(model: onnx.ModelProto) -> Iterable[str]:
    """MatMulOp::setup's checks of setSerializeMatMul (op/matmul.cpp:238-283)."""
    nodes = [n for n in model.graph.node
             if n.op_type == "MatMul" and _domain(n) == _ONNX
             and any(a.name == "__serialize_matmul_mode" for a in n.attribute)]
    if not nodes:
        return
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - the kit's own checks report an unreadable model
        return
    graph = inferred.graph
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in (*graph.input, *graph.value_info, *graph.output)
              if v.type.tensor_type.HasField("shape")}
    shapes.update({t.name: list(t.dims) for t in graph.initializer})
    for node in nodes:
        attrs = _attrs(node)
        mode = attrs.get("__serialize_matmul_mode", b"none")
        mode = mode.decode() if isinstance(mode, bytes) else str(mode)
        factor = int(attrs.get("__serialize_matmul_factor", 0))
        if mode not in _SERIALISED:
            continue
        if factor == 0:
            yield (f"Invalid serialisation factor {factor}. Serialisation factor must be a "
                   f"non-zero positive integer.")
            continue
        side, from_end, what, dim_name = _SERIALISED[mode]
        shape = shapes.get(node.input[side])
        if not shape or len(shape) < from_end or not shape[-from_end]:
            continue
        if shape[-from_end] % factor:
            yield (f"Invalid serialisation factor {factor} for {what} {shape[-from_end]}. "
                   f"{dim_name} should be a multiple of the serialisation factor ")


def _float_tensors(model: onnx.ModelProto) -> set[str] | None:
    """Tensors of a floating-point type (None when ONNX's inference cannot read the model)."""
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001
        return None
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
              onnx.TensorProto.BFLOAT16}
    out = {v.name for v in (*graph.input, *graph.value_info, *graph.output)
           if v.type.tensor_type.elem_type in floats}
    return out | {t.name for t in graph.initializer if t.data_type in floats}


def _pattern_refusals(model: onnx.ModelProto, training: bool, patterns: Patterns,
                      loss: str | None, anchors: Sequence[str]) -> Iterable[str]:
    """Ops left for IrLowering::createOpx that only a (disabled) pattern removes."""
    def text(opid: str, pattern: str) -> str:
        return (f"Could not create opx for '{opid}'. This op should have been removed by "
                f"pattern {pattern}")

    nodes = list(model.graph.node)
    conv_transpose = patterns.isPatternEnabled("ConvTranspose")
    for node in nodes:
        pattern = _FORWARD_NEEDS_PATTERN.get((_domain(node), node.op_type))
        if pattern and not patterns.isPatternEnabled(pattern):
            yield text(opid(node, model), pattern)
    if not training or loss is None or all(
            patterns.isPatternEnabled(p) for grads in NEEDS_PATTERN.values()
            for _, p in grads.values()):
        return
    # gradients flow from the loss to the weights and to the anchored gradients' tensors
    floats = _float_tensors(model)
    weights = {t.name for t in model.graph.initializer}
    wanted = weights | {a[len(GRADIENT_PREFIX):] for a in anchors if a.startswith(GRADIENT_PREFIX)}
    to_loss, _ = _ancestors(nodes, [loss], cut=frozenset({"Detach"}))
    from_wanted = _descendants(nodes, wanted, cut=frozenset({"Detach"}))
    for node in reversed(nodes):  # the backward pass runs in reverse
        grads = NEEDS_PATTERN.get((_domain(node), node.op_type))
        if not grads or not any(o in to_loss for o in node.output):
            continue
        if node.op_type == "ConvTranspose" and not conv_transpose:
            continue  # refused above, as a forward op
        for index, (grad, pattern) in sorted(grads.items()):
            name = node.input[index] if len(node.input) > index else ""
            if (name and name in from_wanted and (floats is None or name in floats)
                    and not patterns.isPatternEnabled(pattern)):
                yield text(f"{_GC}.{grad}:1", pattern)


def _anchor_refusals(model: onnx.ModelProto, loss: str | None,
                     anchors: Sequence[str]) -> Iterable[str]:
    """Ir::validateAnchors: an anchored gradient exists only for a tensor the loss depends on
    (through differentiable ops: Detach passes no gradient)."""
    grads = [a for a in anchors if a.startswith(GRADIENT_PREFIX)]
    if not grads or loss is None:
        return
    nodes = list(model.graph.node)
    to_loss, _ = _ancestors(nodes, [loss], cut=frozenset({"Detach"}))
    known = ({v.name for v in model.graph.input} | {t.name for t in model.graph.initializer}
             | {o for n in nodes for o in n.output if o})
    for anchor in grads:
        base = anchor[len(GRADIENT_PREFIX):]
        if base in known and base not in to_loss:
            yield (f"Anchor tensor `{anchor}' not in Ir Tensors. \nInterestingly, `{base}' IS "
                   f"in tensors.\nNote that not all tensors can have their gradients "
                   f"anchored:\nif an activation tensor does not lead to the loss,\nits "
                   f"gradient is zero and never computed.")


def _pruned_refusals(model: onnx.ModelProto, loss: str | None,
                     anchors: Sequence[str]) -> Iterable[str]:
    """transforms/prune.cpp: what no anchor, loss or side effect needs is pruned; nothing
    left is refused."""
    nodes = list(model.graph.node)
    targets = [a[len(GRADIENT_PREFIX):] if a.startswith(GRADIENT_PREFIX) else a for a in anchors]
    targets += [loss] if loss else []
    _, used = _ancestors(nodes, targets)
    if not used and not any(n.op_type in _SIDE_EFFECTS for n in nodes):
        yield "All operations in the main graph were pruned, nothing to compute"


def check_program(model: onnx.ModelProto, *, training: bool, options: Any,
                  patterns: Patterns | None, loss: str | None,
                  anchors: Mapping[str, Any] | Sequence[str]) -> None:
    """Raise ``popart_exception`` with PopART's message for the first of PopART's refusals
    (rules V6, V54-V66) that ``model`` with these options meets, in the order PopART meets them."""
    anchors = list(anchors)
    patterns = patterns if patterns is not None else Patterns()
    recompute = any(a.name == RECOMPUTE_OUTPUT and a.i == 2 for n in model.graph.node
                    for a in n.attribute)

    def refusals() -> Iterable[str]:
        if not training and not anchors:  # V65: ir.cpp:416 Ir::setDataFlow, first of prepareImpl
            yield "User must specify an anchor tensor when doing inference."
        if any(n.op_type == "Constant" and _domain(n) == _ONNX
               and any(a.name == "sparse_value" for a in n.attribute)
               for n in model.graph.node):  # V66: constfoldops.cpp:98
            yield "The Constant op attribute 'sparse_value' is not supported."
        yield from _creation_refusals(model, bool(options.enablePipelining))
        yield from _serialisation_refusals(model)
        if training:
            yield from _anchor_refusals(model, loss, anchors)
        if (recompute and int(options.autoRecomputation) != 0  # RecomputationType.NoRecompute
                and options.executionPhaseSettings.phases < 2):
            yield "A mixture of auto and manual recomputation is not supported"
        if training and options.enablePipelining and options.enableGradientAccumulation:
            depth = PipelineLayout.from_model(model).depth(training=True)
            if options.accumulationFactor < depth:
                yield depth_text("gradient accumulation factor", depth)
        yield from _pruned_refusals(model, loss if training else None, anchors)
        yield from _pattern_refusals(model, training, patterns, loss, anchors)

    first = next(iter(refusals()), None)
    if first is not None:
        raise popart_exception(first)
