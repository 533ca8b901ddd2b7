"""Subgraphs in the Builder: PopART's sub-builders and the operators that call them.

``createSubgraphBuilder()`` gives a child builder whose graph becomes a GRAPH attribute of a
Call (``aiGraphcore.call``), If (``aiOnnx.logical_if``), Loop (``aiOnnx.loop``) or Scan
(``aiOnnx.scan``) node, as PopART's builder embeds it (willow/src/builder.cpp,
builder_impl.cpp):

* a child sees its ancestors' tensors: its nodes may read them (ONNX outer-scope values), and
  ``addInputTensorFromParentGraph(id)`` declares one as an input of the child's graph (an If
  branch's inputs are such tensors, read by name);
* ``addUntypedInputTensor`` adds an input typed by the node that calls the graph (refused on
  the top-level graph, with PopART's text);
* a new id is unique in the builder, its ancestors and its descendants (PopART's getNextId);
* child graphs are named ``BuilderGraph_<n>`` unless ``setGraphName`` names them.

The node's outputs are typed from the called graph, given the caller's input types (ONNX
inference over the graph, its outer-scope tensors typed as the builder knows them): Call and If
give the graph's output types; Loop stacks its scan outputs on a leading axis of the trip count
(when M is a constant); Scan follows PopART's ScanOp (willow/src/op/scan.cpp): a rank-1 scan
input is sliced to shape [1], and each scan output is the body's output concatenated along its
scan axis (``shape[axis] * iterations``).
"""

from __future__ import annotations

import functools
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import onnx
from onnx import helper, numpy_helper

from .builder_base import BuilderError, debug_name
from .builder_settings import _GRAPH_UIDS
from .graphcore import GRAPHCORE_OPS

__all__ = ["SubgraphBuilding", "control_method", "control_methods", "free_names", "node_reads",
           "without_branch_inputs"]

AI_GRAPHCORE = "ai.graphcore"


def _own(types: Mapping[str, Any]) -> dict[str, Any]:
    """A builder's own entries of a table it shares with its ancestors (a ChainMap)."""
    return types.maps[0] if isinstance(types, ChainMap) else types  # type: ignore[return-value]


def _typed(value: onnx.TypeProto | None) -> bool:
    return (value is not None and value.HasField("tensor_type")
            and value.tensor_type.elem_type != onnx.TensorProto.UNDEFINED)


def _graphs(node: onnx.NodeProto) -> Iterable[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def free_names(graph: onnx.GraphProto) -> list[str]:
    """The tensors ``graph`` reads from enclosing graphs (its nodes' and nested graphs'
    inputs, and its outputs, that it does not define), in first-use order."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    out: dict[str, None] = {}
    for node in graph.node:
        out.update((name, None) for name in node_reads(node) if name not in defined)
        defined.update(node.output)
    out.update((v.name, None) for v in graph.output if v.name not in defined)
    return list(out)


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The tensors ``node`` reads: its inputs, then those its subgraphs read from enclosing
    graphs (an If branch's declared inputs among them, as PopART reads them by name)."""
    reads = dict.fromkeys(node.input)
    for sub in _graphs(node):
        reads.update(dict.fromkeys(free_names(sub)))
        if node.op_type == "If":
            reads.update(dict.fromkeys(v.name for v in sub.input))
    return [name for name in reads if name]


def _if_with_inputs(graph: onnx.GraphProto) -> bool:
    return any((node.op_type == "If" and any(len(g.input) for g in _graphs(node)))
               or any(_if_with_inputs(g) for g in _graphs(node)) for node in graph.node)


def without_branch_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy whose If branches declare no inputs, as ONNX's If has them:
    PopART's builder declares the enclosing tensors a branch reads as its inputs
    (``addInputTensorFromParentGraph``) and PopART reads them by name - what ONNX's branches
    do with tensors of the enclosing graph they read, undeclared."""
    if not _if_with_inputs(model.graph):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    todo = [copy.graph]
    while todo:
        for node in todo.pop().node:
            for sub in _graphs(node):
                if node.op_type == "If":
                    del sub.input[:]
                todo.append(sub)
    return copy


def _shape(value: onnx.TypeProto | None) -> list[int] | None:
    if not _typed(value) or not value.tensor_type.HasField("shape"):
        return None
    dims = value.tensor_type.shape.dim
    if any(not d.HasField("dim_value") for d in dims):
        return None
    return [d.dim_value for d in dims]


class SubgraphBuilding:
    """The Builder's sub-builders (a base class of Builder): PopART's createSubgraphBuilder,
    addInputTensorFromParentGraph and addUntypedInputTensor."""

    _parent: Any
    _children: list[Any]
    _types: Any
    _data: Any
    _graph: onnx.GraphProto
    _uses_graphcore: bool

    def createSubgraphBuilder(self: Any) -> Any:
        """A child builder for the graph of a Call, If, Loop or Scan; its nodes may read this
        builder's tensors (and its ancestors')."""
        child = type(self)()
        child._parent = self
        child._types = ChainMap({}, self._types)
        child._data = ChainMap({}, self._data)
        child._graph.name = f"BuilderGraph_{next(_GRAPH_UIDS)}"
        self._children.append(child)
        return child

    def addInputTensorFromParentGraph(self: Any, tensorId: str) -> None:
        """Declare ``tensorId``, a tensor of an enclosing builder, an input of this graph."""
        parent = self._parent
        if parent is None or tensorId not in parent._types:
            raise BuilderError(f"Failed to add unrecognised Tensor {tensorId} from higher scope, "
                               f"Currently, a Tensor must already exist in a higher (parent) "
                               f"scope to add it as an input in a lower scope.")
        value = onnx.ValueInfoProto(name=tensorId)
        value.type.CopyFrom(parent._types[tensorId])
        self._graph.input.append(value)
        self._types[tensorId] = value.type

    def addUntypedInputTensor(self: Any, debugContext: str = "") -> str:
        """An input of this subgraph whose type the calling node gives."""
        if self._parent is None:
            raise BuilderError("Can not add untyped tensors to the top-level graph. Use "
                               "Builder::addInputTensor(const TensorInfo &tensorInfo, const "
                               "std::string &debugPrefix) instead.")
        tensor_id = self._next_id(debug_name(debugContext, "debugContext") or "input")
        self._graph.input.append(onnx.ValueInfoProto(name=tensor_id))
        self._types[tensor_id] = onnx.TypeProto()
        return tensor_id

    def _taken(self, name: str) -> bool:
        """Whether ``name`` is a tensor of this builder, an ancestor or a descendant."""
        return name in self._types or any(c._taken_below(name) for c in self._children)

    def _taken_below(self, name: str) -> bool:
        return name in _own(self._types) or any(c._taken_below(name) for c in self._children)

    def _graph_proto(self) -> onnx.GraphProto:
        """This builder's graph, with the types of its own tensors as value_info."""
        graph = onnx.GraphProto()
        graph.CopyFrom(self._graph)
        known = {v.name for v in (*graph.input, *graph.output)}
        for tensor, type_proto in _own(self._types).items():
            if tensor not in known and type_proto.HasField("tensor_type"):
                graph.value_info.append(onnx.ValueInfoProto(name=tensor, type=type_proto))
        return graph


# -- typing a called graph ------------------------------------------------------------------
#
# A scope is what types a graph's tensors: a builder, or a _Types over one (``_types``,
# ``_data``: constants, ``_onnx_version``, ``_infer(node, domain)``: the builder's ONNX
# inference of one node).


class _Types:
    """The tensors of a graph being typed: its own over its enclosing scope's."""

    def __init__(self, outer: Any) -> None:
        self._types = ChainMap({}, outer._types)
        self._data = ChainMap({}, outer._data)
        self._onnx_version = outer._onnx_version
        self._infer_node = outer._infer_node if isinstance(outer, _Types) \
            else functools.partial(type(outer)._infer)

    def _infer(self, node: onnx.NodeProto, domain: str) -> dict[str, onnx.TypeProto]:
        return self._infer_node(self, node, domain)


def _type(elem_type: int, shape: Sequence[int] | None) -> onnx.TypeProto:
    if not elem_type:
        return onnx.TypeProto()
    return helper.make_tensor_type_proto(elem_type, None if shape is None else list(shape))


def _graphcore_types(scope: Any, node: onnx.NodeProto) -> list[onnx.TypeProto]:
    """A PopART operator's output types, by its registry entry (or, for the losses and Gelu,
    PopART's rule: the first input's type; a loss is a scalar unless unreduced)."""
    given = [scope._types.get(i) for i in node.input if i]
    if not given or not all(_typed(t) for t in given):
        return []
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    elem = given[0].tensor_type.elem_type
    if node.op_type in ("L1", "Nll", "IdentityLoss", "Gelu"):
        like = given[-1] if node.op_type == "Nll" else given[0]
        unreduced = node.op_type == "Gelu" or attrs.get("reduction") == "None"
        return [_type(elem, _shape(like) if unreduced else [])]
    entry = next((e for e in GRAPHCORE_OPS.values() if e.op_type == node.op_type), None)
    if entry is None:
        return []
    found = entry.infer([(t.tensor_type.elem_type, _shape(t)) for t in given], attrs)
    return [_type(dtype, shape) for dtype, shape in found[:len(node.output)]]


Typed = tuple[list[onnx.TypeProto], dict[str, onnx.GraphProto]]  # outputs' types, graphs


def _node_types(scope: Any, node: onnx.NodeProto) -> Typed:
    """``node``'s output types in ``scope`` (untyped where they cannot be found), and its
    graph attributes typed for the inputs it passes them."""
    graphs = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
    ints = {a.name: list(a.ints) for a in node.attribute if a.type == onnx.AttributeProto.INTS}
    inputs = list(node.input)
    typed: dict[str, onnx.GraphProto] = {}
    try:
        if node.op_type == "Call" and "callee" in graphs:
            found, typed = _call_types(scope, inputs, graphs["callee"])
        elif node.op_type == "If" and len(graphs) == 2:
            found, typed = _if_types(scope, graphs["then_branch"], graphs["else_branch"])
        elif node.op_type == "Loop" and "body" in graphs:
            found, typed = _loop_types(scope, inputs, graphs["body"])
        elif node.op_type == "Scan" and "body" in graphs:
            count = next(a.i for a in node.attribute if a.name == "num_scan_inputs")
            found, typed = _scan_types(scope, inputs, graphs["body"], count,
                                       ints.get("scan_input_axes", []),
                                       ints.get("scan_output_axes", []),
                                       batched=scope._onnx_version < 9)
        elif node.domain in ("", "ai.onnx"):
            types = scope._infer(node, "")
            found = [types.get(o, onnx.TypeProto()) for o in node.output]
        elif node.domain == AI_GRAPHCORE:
            found = _graphcore_types(scope, node)
        else:
            found = []
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, ValueError,
            KeyError, IndexError, TypeError, StopIteration):
        found = []
    return list(found) + [onnx.TypeProto()] * (len(node.output) - len(found)), typed


def _typed_graph(scope: Any, graph: onnx.GraphProto, inputs: Sequence[onnx.TypeProto | None]
                 ) -> tuple[onnx.GraphProto, list[onnx.TypeProto]]:
    """``graph`` typed for inputs of types ``inputs`` (None: as declared; a declared type is
    kept), its nodes typed one by one as the builder types them (nested graphs too), its
    outer-scope tensors as ``scope`` types them: the typed copy (its untyped inputs, its
    outputs and value_info filled in) and its outputs' types."""
    inner = _Types(scope)
    g = onnx.GraphProto()
    g.CopyFrom(graph)
    declared = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
    for i, value in enumerate(g.input):
        given = inputs[i] if i < len(inputs) else None
        if _typed(given) and not _typed(value.type):
            value.type.CopyFrom(given)
        inner._types[value.name] = value.type
    for tensor in g.initializer:
        inner._data[tensor.name] = tensor
        inner._types[tensor.name] = _type(tensor.data_type, list(tensor.dims))
    for node in g.node:
        found, typed = _node_types(inner, node)
        for attr in node.attribute:
            if attr.name in typed:
                attr.g.CopyFrom(typed[attr.name])
        for name, out in zip(node.output, found, strict=True):
            inner._types[name] = out if _typed(out) else declared.get(name, onnx.TypeProto())
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                inner._data[node.output[0]] = value
    for value in g.output:
        found = inner._types.get(value.name)
        if _typed(found):
            value.type.CopyFrom(found)
    ends = {v.name for v in (*g.input, *g.output)}
    del g.value_info[:]
    g.value_info.extend(onnx.ValueInfoProto(name=name, type=inner._types[name])
                        for node in g.node for name in node.output
                        if name and name not in ends and _typed(inner._types.get(name)))
    return g, [v.type for v in g.output]


def _call_types(scope: Any, args: Sequence[str], graph: onnx.GraphProto) -> Typed:
    g, types = _typed_graph(scope, graph, [scope._types.get(a) if a else None for a in args])
    return types, {"callee": g}


def _if_types(scope: Any, then_graph: onnx.GraphProto, else_graph: onnx.GraphProto) -> Typed:
    then_g, then_types = _typed_graph(scope, then_graph, [])
    else_g, else_types = _typed_graph(scope, else_graph, [])
    return ([t if _typed(t) else e for t, e in zip(then_types, else_types, strict=False)],
            {"then_branch": then_g, "else_branch": else_g})


def _loop_types(scope: Any, args: Sequence[str], graph: onnx.GraphProto) -> Typed:
    """Loop: the carried values typed as the body gives them; each scan output the body's,
    stacked on a leading axis of the trip count M when M is a constant."""
    carried = max(len(args) - 2, 0)
    inputs: list[onnx.TypeProto | None] = [_type(onnx.TensorProto.INT64, []),
                                           _type(onnx.TensorProto.BOOL, [])]
    inputs += [scope._types.get(a) for a in args[2:]]
    g, found = _typed_graph(scope, graph, inputs)
    trip = scope._data.get(args[0]) if args and args[0] else None
    count = int(numpy_helper.to_array(trip).reshape(-1)[0]) if trip is not None else None
    types = []
    for i, out in enumerate(found[1:]):
        if i < carried:
            types.append(out if _typed(out) else inputs[2 + i] or onnx.TypeProto())
            continue
        shape = _shape(out)
        types.append(_type(out.tensor_type.elem_type, [count, *shape])
                     if shape is not None and count is not None else onnx.TypeProto())
    return types, {"body": g}


def _scan_types(scope: Any, args: Sequence[str], graph: onnx.GraphProto, scans: int,
                input_axes: Sequence[int], output_axes: Sequence[int], batched: bool) -> Typed:
    """Scan: PopART's ScanOp (a rank-1 scan input sliced to [1]; scan outputs concatenated
    along their axis); Scan-8 (``batched``): ONNX's, batched on axis 0."""
    first = 1 if batched else 0  # Scan-8's sequence_lens
    states = len(args) - first - scans
    inputs: list[onnx.TypeProto | None] = []
    lead: list[int] = []  # Scan-8's batch dimension
    trip = None
    for i, name in enumerate(args[first:]):
        given = scope._types.get(name)
        shape = _shape(given)
        if shape is not None and batched:
            lead, shape = shape[:1], shape[1:]
        if shape is None:
            inputs.append(None)
            continue
        if i < states:
            inputs.append(_type(given.tensor_type.elem_type, shape))
            continue
        m = i - states
        axis = 0 if batched else _entry(input_axes, m) % max(len(shape), 1)
        trip = shape[axis] if trip is None and shape else trip
        sliced = shape[:axis] + shape[axis + 1:] if len(shape) > 1 or batched else [1]
        inputs.append(_type(given.tensor_type.elem_type, sliced))
    g, found = _typed_graph(scope, graph, inputs)
    types = []
    for k, out in enumerate(found):
        shape = _shape(out)
        if shape is None or (k >= states and trip is None):
            types.append(onnx.TypeProto())
        elif k < states:
            types.append(_type(out.tensor_type.elem_type, lead + shape))
        elif batched:
            types.append(_type(out.tensor_type.elem_type, lead + [trip] + shape))
        elif not shape:  # a scalar per iteration: one value each
            types.append(_type(out.tensor_type.elem_type, [trip]))
        else:  # PopART's ScanOp: concatenated along the output axis
            axis = _entry(output_axes, k - states) % len(shape)
            shape[axis] *= trip
            types.append(_type(out.tensor_type.elem_type, shape))
    return types, {"body": g}


def _entry(values: Sequence[int], i: int) -> int:
    return int(values[i]) if i < len(values) else 0


def _graph_of(sub: Any, what: str) -> onnx.GraphProto:
    if not isinstance(sub, SubgraphBuilding):
        raise TypeError(f"{what} must be a Builder (from createSubgraphBuilder()), got "
                        f"{type(sub).__name__}.")
    return sub._graph_proto()


def _uses_graphcore(*subs: Any) -> bool:
    return any(s._uses_graphcore for s in subs)


def _ids(args: Any) -> list[str]:
    return [args] if isinstance(args, str) else list(args)


def _add(builder: Any, op_type: str, args: list[str], count: int, attrs: dict[str, Any],
         name: str, subs: Sequence[Any], out_types: Sequence[onnx.TypeProto],
         domain: str = "") -> list[str]:
    count = int(count)
    if count < 0:
        raise BuilderError(f"{op_type}: num_outputs {count} must be a count.")
    ids = builder._add_node(op_type, args, count, attrs, name, domain=domain,
                            out_types=list(out_types)[:count])
    if _uses_graphcore(*subs):
        builder._uses_graphcore = True
    return ids


def call(builder: Any, args: Sequence[str], num_outputs: int, callee: Any,
         debugName: str = "") -> list[str]:
    """``aiGraphcore.call``: run ``callee``'s graph on ``args`` (its inputs, in order)."""
    args = _ids(args)
    graph = _graph_of(callee, "call: callee")
    for given, have, what in ((len(args), len(graph.input), "input"),
                              (int(num_outputs), len(graph.output), "output")):
        if given != have:
            raise BuilderError(f"For CallOp '{debugName}', number of {what}s ({given}) does "
                               f"not match that of the callee subgraph ({have})")
    types, graphs = _call_types(builder, args, graph)
    return _add(builder, "Call", args, num_outputs,
                {**graphs, "num_outputs": int(num_outputs)}, debugName, [callee], types,
                domain=AI_GRAPHCORE)


def logical_if(builder: Any, args: Sequence[str], num_outputs: int, else_branch: Any,
               then_branch: Any, name: str = "") -> list[str]:
    """``aiOnnx.logical_if``: ``then_branch``'s outputs where ``args[0]`` is true, else
    ``else_branch``'s; the branches read their inputs from the enclosing graph by name."""
    args = _ids(args)
    then_graph = _graph_of(then_branch, "logical_if: then_branch")
    else_graph = _graph_of(else_branch, "logical_if: else_branch")
    counts = (len(then_graph.output), len(else_graph.output))
    if counts != (int(num_outputs),) * 2:
        raise BuilderError(f"If '{name}': num_outputs is {num_outputs}, but then_branch has "
                           f"{counts[0]} outputs and else_branch {counts[1]}. Fix: give both "
                           f"branches num_outputs outputs (addOutputTensor).")
    types, graphs = _if_types(builder, then_graph, else_graph)
    return _add(builder, "If", args, num_outputs,
                {"else_branch": graphs["else_branch"], "then_branch": graphs["then_branch"]},
                name, [then_branch, else_branch], types)


def loop(builder: Any, args: Sequence[str], num_outputs: int, body: Any,
         debugContext: str = "") -> list[str]:
    """``aiOnnx.loop``: args are [M, cond, loop-carried values...]; the body takes [iteration,
    cond, carried...] and gives [cond, carried..., scan outputs...]."""
    args = _ids(args)
    graph = _graph_of(body, "loop: body")
    carried = max(len(args) - 2, 0)
    scans = len(graph.output) - 1 - carried
    if len(args) < 2 or len(graph.input) != carried + 2 or scans < 0 \
            or int(num_outputs) != carried + scans:
        raise BuilderError(f"Loop '{debugContext}': {len(args)} inputs (M, cond and {carried} "
                           f"loop-carried values), a body of {len(graph.input)} inputs and "
                           f"{len(graph.output)} outputs, num_outputs {num_outputs}. Fix: the "
                           f"body takes [iteration, cond, carried...] and gives [cond, "
                           f"carried..., scan outputs...]; num_outputs counts the carried and "
                           f"scan outputs.")
    types, graphs = _loop_types(builder, args, graph)
    return _add(builder, "Loop", args, num_outputs, graphs, debugContext, [body], types)


def _scan(builder: Any, args: Sequence[str], num_outputs: int, body: Any, num_scan_inputs: int,
          attrs: dict[str, Any], input_axes: Sequence[int], output_axes: Sequence[int],
          debugContext: str, batched: bool) -> list[str]:
    args = _ids(args)
    graph = _graph_of(body, "scan: body")
    first = 1 if batched else 0  # Scan-8's sequence_lens
    states = len(args) - first - int(num_scan_inputs)
    if states < 0 or len(graph.input) != states + int(num_scan_inputs) \
            or int(num_outputs) != len(graph.output):
        raise BuilderError(f"Scan '{debugContext}': {len(args)} inputs with num_scan_inputs "
                           f"{num_scan_inputs}, a body of {len(graph.input)} inputs and "
                           f"{len(graph.output)} outputs, num_outputs {num_outputs}. Fix: the "
                           f"body takes [states..., scan slices...] and gives [states..., scan "
                           f"outputs...], one node output each.")
    types, graphs = _scan_types(builder, args, graph, int(num_scan_inputs), input_axes,
                                output_axes, batched)
    attrs = {**graphs, "num_scan_inputs": int(num_scan_inputs),
             **{k: [int(v) for v in vs] for k, vs in attrs.items() if len(vs)}}
    return _add(builder, "Scan", args, num_outputs, attrs, debugContext, [body], types)


def scan8(builder: Any, args: Sequence[str], num_outputs: int, body: Any, num_scan_inputs: int,
          directions: Sequence[int] = [],  # noqa: B006 - PopART's default
          debugContext: str = "") -> list[str]:
    """``aiOnnxOpset8.scan``: Scan-8 (inputs [sequence_lens, states..., scan inputs...],
    batched on axis 0)."""
    return _scan(builder, args, num_outputs, body, num_scan_inputs,
                 {"directions": directions}, (), (), debugContext, batched=True)


def scan(builder: Any, args: Sequence[str], num_outputs: int, body: Any, num_scan_inputs: int,
         scan_input_axes: Sequence[int] = [],  # noqa: B006 - PopART's defaults
         scan_input_directions: Sequence[int] = [],  # noqa: B006
         scan_output_axes: Sequence[int] = [],  # noqa: B006
         scan_output_directions: Sequence[int] = [],  # noqa: B006
         debugContext: str = "") -> list[str]:
    """``aiOnnx.scan`` (opset 9 on): inputs [states..., scan inputs...]; the body takes the
    states and one slice of each scan input and gives [states..., scan outputs...]."""
    return _scan(builder, args, num_outputs, body, num_scan_inputs,
                 {"scan_input_axes": scan_input_axes,
                  "scan_input_directions": scan_input_directions,
                  "scan_output_axes": scan_output_axes,
                  "scan_output_directions": scan_output_directions},
                 scan_input_axes, scan_output_axes, debugContext, batched=False)


def control_methods(version: int) -> list[str]:
    """The subgraph operators ``aiOnnx`` of opset ``version`` offers (PopART's AiOnnxN)."""
    return ["logical_if", "loop"] + (["scan"] if version >= 8 else [])


def control_method(builder: Any, version: int, name: str) -> Callable[..., list[str]] | None:
    """``builder.aiOnnx.<name>`` for a subgraph operator of opset ``version``, else None."""
    if name not in control_methods(version):
        return None
    fn = {"logical_if": logical_if, "loop": loop,
          "scan": scan8 if version == 8 else scan}[name]
    return functools.partial(fn, builder)
