"""Whether an ONNX model is a valid graph, before any backend lowers it (pure: no JAX, no I/O).

:func:`model_problems` runs the kit's graph checks, reporting every problem at once with node
names: graph inputs and initializers named once each, every tensor produced once, every node
input and graph output defined, no cycles, and attributes that the operator's schema knows, of
the type it says. When those pass it runs ``onnx.checker`` with strict shape inference, which
finds shape and type mistakes (one at a time). Attributes named ``__*`` are PopART annotations
(pipeline stage, IPU) and are not checked against schemas; ops of domains onnx does not know
(PopART's ``ai.graphcore``) are checked by the backend that runs them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import onnx

from .._base.problems import Problem, raise_errors
from ..errors import InvalidModel, clip
from .builder_subgraphs import AI_GRAPHCORE, without_branch_inputs
from .popart_types import first_refusal, first_setup_refusal

__all__ = ["model_problems", "check_model"]

_SHOW = 6  # names listed before "…"


def _names(items: list[str]) -> str:
    shown = ", ".join(clip(i, 60) for i in items[:_SHOW])
    return shown + (f" and {len(items) - _SHOW} more" if len(items) > _SHOW else "")


def _label(node: onnx.NodeProto, index: int) -> str:
    return f"{_name(node, index)} ({clip(node.op_type, 40)})"


def _name(node: onnx.NodeProto, index: int) -> str:
    """The node's name, else its first output, else its position."""
    return clip(node.name or (node.output[0] if node.output and node.output[0]
                              else f"node #{index}"), 60)


def _problem(loc: str, message: str, fix: str, rule: str) -> Problem:
    return Problem(("model", loc), message, fix, rule)


#: Opset versions a model may import: onnx numbers them from 1, as C ints.
_OPSET_VERSIONS = range(1, 2**31)


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    """Each domain's imported version; versions out of range are left out (they are reported
    by :func:`_opset_problems`)."""
    return {("" if o.domain == "ai.onnx" else o.domain): int(o.version)
            for o in model.opset_import if o.version in _OPSET_VERSIONS}


def _opset_problems(model: onnx.ModelProto) -> list[Problem]:
    return [_problem(f"opset_import.{clip(o.domain or 'ai.onnx', 60)}",
                     f"the model imports opset version {o.version} of "
                     f"{clip(o.domain or 'ai.onnx', 60)}; versions start at 1 and fit 32 bits.",
                     "import the opset version the model was written for.", "K-model-opset")
            for o in model.opset_import if o.version not in _OPSET_VERSIONS]


def _schema(node: onnx.NodeProto, opsets: dict[str, int]) -> onnx.defs.OpSchema | None:
    domain = "" if node.domain == "ai.onnx" else node.domain
    if domain not in opsets:
        return None
    try:
        return onnx.defs.get_schema(node.op_type, opsets[domain], domain)
    except onnx.defs.SchemaError:
        return None


def _graph_problems(model: onnx.ModelProto) -> list[Problem]:
    graph, out = model.graph, []

    def repeated(names: list[str]) -> list[str]:
        seen, twice = set(), []
        for n in names:
            if n in seen and n not in twice:
                twice.append(n)
            seen.add(n)
        return twice

    inputs = [v.name for v in graph.input]
    inits = [t.name for t in graph.initializer]
    if twice := repeated(inputs):
        out.append(_problem("inputs", f"graph input(s) {_names(twice)} are declared more than "
                                      f"once.", "declare each graph input once.",
                            "K-model-duplicate-input"))
    if twice := repeated(inits):
        out.append(_problem("initializers", f"initializer(s) {_names(twice)} are given more than "
                                            f"once (which value wins is undefined).",
                            "keep one initializer per name.", "K-model-duplicate-initializer"))

    producers: dict[str, list[str]] = defaultdict(list)
    for i, node in enumerate(graph.node):
        for o in node.output:
            if o:
                producers[o].append(_label(node, i))
    defined = set(inputs) | set(inits)
    clashes = [f"{clip(t, 60)} by {', '.join(p[:3])}" for t, p in producers.items()
               if len(p) > 1]
    clashes += [f"{clip(t, 60)} by {p[0]} and the graph" for t, p in producers.items()
                if len(p) == 1 and t in defined]
    if clashes:
        more = f" and {len(clashes) - _SHOW} more" if len(clashes) > _SHOW else ""
        out.append(_problem("nodes", f"tensors produced more than once: "
                                     f"{'; '.join(clashes[:_SHOW])}{more}.",
                            "give every node output a name no other node, input or initializer "
                            "uses.", "K-model-duplicate-producer"))

    known = defined | set(producers)
    undefined = [f"{_label(node, i)} reads {clip(name, 60)}"
                 for i, node in enumerate(graph.node) for name in node.input
                 if name and name not in known]
    undefined += [f"graph output {clip(o.name, 60)}" for o in graph.output
                  if o.name not in known]
    if undefined:
        out.append(_problem("nodes", f"tensors nothing defines: {'; '.join(undefined[:_SHOW])}"
                                     + (f" and {len(undefined) - _SHOW} more"
                                        if len(undefined) > _SHOW else "") + ".",
                            "feed each from a graph input, an initializer or a node output.",
                            "K-model-undefined-input"))

    cyclic = _cycle(graph, defined)
    if cyclic:
        out.append(_problem("nodes", f"nodes {_names(cyclic)} are on a cycle or depend on one.",
                            "an ONNX graph is acyclic: break the cycle (loops belong in a Loop "
                            "node).", "K-model-cycle"))

    out += _attribute_problems(model)
    out += _input_shape_problems(graph, set(inits))
    out += _operator_problems(model)
    return out


def _input_shape_problems(graph: onnx.GraphProto, initializers: set[str]) -> list[Problem]:
    """Graph inputs whose shape uses a symbolic (``dim_param``) or negative size, as PopART's
    ``checkForDimParams`` (ir.cpp) refuses them."""
    out = []
    for value in graph.input:
        tensor = value.type.tensor_type
        if value.name in initializers or not value.type.HasField("tensor_type") \
                or not tensor.HasField("shape"):
            continue
        dims = [d.dim_param if d.HasField("dim_param") else
                str(d.dim_value) if d.HasField("dim_value") else "?" for d in tensor.shape.dim]
        unknown = next((d for d, v in zip(dims, tensor.shape.dim, strict=True)
                        if not v.HasField("dim_value") or v.dim_value < 0), None)
        if unknown is None:
            continue
        shape = f"[{', '.join(dims)}]"
        text = (f"Input tensor '{value.name}' must be specified in InputShapeInfo, as it has "
                f"shape {shape}, which uses an unknown value '{unknown}'.")
        out.append(Problem(("model", "inputs", value.name), text,
                           "give the input a fixed shape in the model, or its shape in "
                           "popart.InputShapeInfo (PopART compiles static shapes).",
                           "K-static-shape", popart=text))
    return out


#: Reductions whose axes PopART checks (willow/src/util.cpp validateReduceAxis, called from
#: ReduceOp::setup, op/reduce.cpp:47): ai.onnx's, and ai.graphcore's ReduceMedian.
_REDUCE_OPS = frozenset({"ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax",
                         "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum",
                         "ReduceSumSquare", "ReduceMedian"})
#: Variadic operators whose version 6 takes inputs of one type and shape (no broadcasting).
_VARIADIC_OPS = frozenset({"Sum", "Mean", "Max", "Min"})


def _is_onnx(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx")


def _checked_here(node: onnx.NodeProto) -> bool:
    return (node.op_type in _REDUCE_OPS and (_is_onnx(node) or node.op_type == "ReduceMedian")
            or node.op_type in _VARIADIC_OPS and _is_onnx(node)
            or node.op_type == "Reverse" and node.domain == AI_GRAPHCORE)


def _known_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every main-graph tensor's type as ONNX's lenient shape inference finds it."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - the checker reports what inference cannot read
        inferred = model
    graph = inferred.graph
    types = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
    for init in graph.initializer:
        types[init.name] = onnx.helper.make_tensor_type_proto(init.data_type, init.dims)
    return types


def _rank(types: dict[str, onnx.TypeProto], name: str) -> int | None:
    t = types.get(name)
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    return len(t.tensor_type.shape.dim)


def _static_ints(model: onnx.ModelProto, name: str) -> list[int] | None:
    """The values of ``name`` when an initializer or a Constant node gives them."""
    for init in model.graph.initializer:
        if init.name == name:
            return [int(v) for v in onnx.numpy_helper.to_array(init).reshape(-1)]
    for node in model.graph.node:
        if node.op_type == "Constant" and name in node.output:
            for a in node.attribute:
                if a.name == "value":
                    return [int(v) for v in onnx.numpy_helper.to_array(a.t).reshape(-1)]
                if a.name in ("value_int", "value_ints"):
                    return list(onnx.helper.get_attribute_value(a)) if a.name.endswith("s") \
                        else [int(a.i)]
    return None


def _reduce_axes(model: onnx.ModelProto, node: onnx.NodeProto) -> list[int] | None:
    attrs = {a.name: a for a in node.attribute}
    if "axes" in attrs:
        return list(attrs["axes"].ints)
    if len(node.input) > 1 and node.input[1]:  # opset 18 (ReduceSum 13): axes as an input
        return _static_ints(model, node.input[1])
    return None


def _op_str(node: onnx.NodeProto, index: int, opid: str) -> str:
    """What PopART's Op::str() says of a node: its id and operator (op.cpp:1102); here the
    node's position stands for PopART's op id."""
    return f"{index} ({opid})"


def _operator_problems(model: onnx.ModelProto) -> list[Problem]:
    """Attribute values PopART refuses when it sets an operator up (its message, verbatim):
    reduction axes out of ``[-rank, rank - 1]`` (util.cpp:359, as ONNX's text says too),
    opset-6 Sum/Mean/Max/Min inputs of different types or shapes (op/variadic.cpp:35, as
    ONNX's Mean-6 says), and ai.graphcore Reverse dimensions that are negative, not below the
    rank or repeated (op/reverse.cpp:38-55)."""
    opsets = _opsets(model)
    nodes = [(i, n) for i, n in enumerate(model.graph.node) if _checked_here(n)
             and (n.op_type not in _VARIADIC_OPS or _version(n, opsets) == 6)]
    if not nodes:
        return []
    types, out = _known_types(model), []

    def refuse(node: onnx.NodeProto, i: int, text: str, fix: str, rule: str) -> None:
        out.append(Problem(("model", "nodes", _name(node, i)), f"{_label(node, i)}: {text}",
                           fix, rule, popart=text))

    for i, node in nodes:
        rank = _rank(types, node.input[0]) if node.input else None
        if node.op_type in _REDUCE_OPS:
            axes = _reduce_axes(model, node)
            if rank is None or not axes:
                continue
            opid = (f"{AI_GRAPHCORE}.ReduceMedian:1" if node.domain == AI_GRAPHCORE else
                    f"ai.onnx.{node.op_type}:{_version(node, opsets)}")
            if rank == 0:
                refuse(node, i, f"Reduce input rank must be greater than 0, invalid Reduce "
                                f"{_op_str(node, i, opid)}.",
                       "reduce a tensor of rank 1 or more, or give no axes.", "V51")
                continue
            bad = next((a for a in axes if not -rank <= a <= rank - 1), None)
            if bad is not None:
                refuse(node, i, f"Axis {bad} is out of acceptable range [{-rank}, {rank - 1}]",
                       f"give axes in [{-rank}, {rank - 1}] (the input has rank {rank}).",
                       "V51")
        elif node.op_type in _VARIADIC_OPS:
            if len(node.input) < 2:  # (opset 6 only: see `nodes`)
                continue
            first = types.get(node.input[0])
            if first is None or any(_rank(types, n) is None for n in node.input):
                continue
            if any(types.get(n) != first for n in node.input[1:]):
                refuse(node, i, f"Inputs to ai.onnx.{node.op_type}:6 do not all the same type "
                                f"& shape, with opid.version = 6",
                       f"give {node.op_type} inputs of one shape (broadcasting needs opset 8 "
                       f"or later).", "V52")
        else:  # ai.graphcore Reverse
            dims = next((list(a.ints) for a in node.attribute if a.name == "dimensions"), [])
            if rank is None:
                continue
            what = _op_str(node, i, f"{AI_GRAPHCORE}.Reverse:1")
            seen: set[int] = set()
            for dim in dims:
                text = (f"ReverseOp '{what}' invalid dimension '{dim}'. Only positive "
                        f"dimensions are supported" if dim < 0 else
                        f"ReverseOp '{what}' invalid dimension '{dim}' for input tensor of "
                        f"rank {rank}" if dim >= rank else
                        f"Dimension {dim} appears multiple times in the list of dimensions "
                        f"of ReverseOp '{what}'" if dim in seen else "")
                if text:
                    refuse(node, i, text, f"give each dimension once, in [0, {rank - 1}].",
                           "V53")
                    break
                seen.add(dim)
    return out


def _version(node: onnx.NodeProto, opsets: dict[str, int]) -> int:
    """The version of the node's operator the model's opset import selects (0 if unknown)."""
    schema = _schema(node, opsets)
    return schema.since_version if schema is not None else 0


def _cycle(graph: onnx.GraphProto, defined: set[str]) -> list[str]:
    """Labels of the nodes left over by a topological sort (Kahn's algorithm): on a cycle."""
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    waiting = [0] * len(graph.node)
    users: dict[int, list[int]] = defaultdict(list)
    for i, node in enumerate(graph.node):
        for name in set(node.input):
            j = producer.get(name)
            if name and name not in defined and j is not None:
                waiting[i] += 1
                users[j].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    done = 0
    while ready:
        j = ready.pop()
        done += 1
        for i in users[j]:
            waiting[i] -= 1
            if waiting[i] == 0:
                ready.append(i)
    if done == len(graph.node):
        return []
    return [_label(n, i) for i, n in enumerate(graph.node) if waiting[i] > 0]


#: Attributes PopART reads on ai.onnx operators at opsets whose schema lacks them (its
#: Resize reads these at opset 10 too): neither the kit's check nor onnx.checker refuses them.
_POPART_READS = {"Resize": {"nearest_mode", "coordinate_transformation_mode", "exclude_outside"}}


def _popart_extra(node: onnx.NodeProto, schema: onnx.defs.OpSchema | None, name: str) -> bool:
    return (schema is not None and node.domain in ("", "ai.onnx") and name not in
            schema.attributes and name in _POPART_READS.get(node.op_type, ()))


def _scales_omitted(node: onnx.NodeProto, schema: onnx.defs.OpSchema | None) -> bool:
    """A Resize-11 whose scales are "" beside sizes: PopART's builder writes it so, ONNX's
    text allows it, its schema (scales not optional) does not."""
    return (schema is not None and schema.since_version == 11 and len(node.input) > 3
            and not node.input[2])


def _without_popart_extras(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy as onnx.checker takes it: without the attributes of
    :data:`_POPART_READS` where its schema lacks them, omitted Resize scales given as an empty
    Constant."""
    opsets = _opsets(model)
    if not any(_scales_omitted(node, schema) or any(_popart_extra(node, schema, a.name)
                                                    for a in node.attribute)
               for node in model.graph.node if node.op_type in _POPART_READS
               for schema in [_schema(node, opsets)]):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    empty = "scales (empty)"
    for node in copy.graph.node:
        if node.op_type in _POPART_READS:
            schema = _schema(node, opsets)
            for attr in [a for a in node.attribute if _popart_extra(node, schema, a.name)]:
                node.attribute.remove(attr)
            if _scales_omitted(node, schema):
                node.input[2] = empty
    if any(node.input[2:3] == [empty] for node in copy.graph.node):
        copy.graph.node.insert(0, onnx.helper.make_node(
            "Constant", [], [empty], value=onnx.helper.make_tensor(empty, onnx.TensorProto.FLOAT,
                                                                   [0], [])))
    return copy


_LISTS = {onnx.AttributeProto.INTS: "ints", onnx.AttributeProto.FLOATS: "floats",
          onnx.AttributeProto.STRINGS: "strings"}


def _empty_list(attr: onnx.AttributeProto, wanted: int) -> bool:
    """An empty list where the schema wants a list of another kind: an empty list has no
    element type (PopART's addNodeAttribute(name, []) writes INTS, and its op reads it as the
    empty list of what it wants)."""
    return (attr.type in _LISTS and wanted in _LISTS
            and not len(getattr(attr, _LISTS[attr.type])))


def _empty_lists_retyped(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy whose empty list attributes (:func:`_empty_list`) have the list
    type their schema defines, as onnx.checker takes them."""
    opsets = _opsets(model)

    def retyped(node: onnx.NodeProto) -> list[tuple[onnx.AttributeProto, int]]:
        schema = _schema(node, opsets)
        if schema is None:
            return []
        return [(a, int(schema.attributes[a.name].type)) for a in node.attribute
                if a.name in schema.attributes
                and _empty_list(a, int(schema.attributes[a.name].type))]

    if not any(retyped(node) for node in model.graph.node):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        for attr, wanted in retyped(node):
            attr.type = wanted
    return copy


def _attribute_problems(model: onnx.ModelProto) -> list[Problem]:
    opsets, out = _opsets(model), []
    for i, node in enumerate(model.graph.node):
        schema = _schema(node, opsets)
        if schema is None:
            continue
        for attr in node.attribute:
            if attr.name.startswith("__") or _popart_extra(node, schema, attr.name):
                continue  # PopART's annotations, attributes PopART reads
            spec = schema.attributes.get(attr.name)
            if spec is None:
                allowed = ", ".join(sorted(schema.attributes)) or "none"
                out.append(_problem(f"nodes.{_name(node, i)}",
                                    f"{_label(node, i)} has attribute {clip(attr.name, 60)}, "
                                    f"which {node.op_type} (opset {schema.since_version}) does "
                                    f"not define (it defines: {allowed}).",
                                    "remove it, or spell it as the operator defines it.",
                                    "K-model-attribute-unknown"))
            elif int(spec.type) != int(attr.type) and not _empty_list(attr, int(spec.type)):
                given = onnx.AttributeProto.AttributeType.Name(attr.type)
                want = onnx.AttributeProto.AttributeType.Name(int(spec.type))
                out.append(_problem(f"nodes.{_name(node, i)}",
                                    f"{_label(node, i)} attribute {attr.name} is {given}; "
                                    f"{node.op_type} defines it as {want}.",
                                    f"write {attr.name} as {want}.", "K-model-attribute-type"))
    return out


def _popart_refusal(model: onnx.ModelProto, typed: bool = False) -> list[Problem]:
    """The first node PopART's op refuses (popart_types.first_refusal; ``typed``: a model
    ONNX's inference accepts, popart_types.first_setup_refusal), in its words."""
    try:
        refusal = first_setup_refusal(model) if typed else first_refusal(model)
    except (ValueError, onnx.checker.ValidationError, onnx.shape_inference.InferenceError):
        return []
    if refusal is None:
        return []
    problem = _problem("checker", f"PopART refuses the model: {clip(refusal, 600)}",
                       "give the op inputs it takes (shapes that broadcast, one data type, "
                       "constant shape inputs).", "K-model-popart-setup")
    return [replace(problem, popart=refusal)]  # popart_kit.popart raises PopART's text alone


def _checker_problems(model: onnx.ModelProto) -> list[Problem]:
    """onnx.checker's structural check (PopART's), then ONNX's strict shape and type inference
    (the kit's: PopART infers leniently, so under popart_kit.popart it only warns); where that
    refuses, a node PopART's op refuses (popart_types.first_refusal) is the error reported."""
    model = without_branch_inputs(_without_popart_extras(_empty_lists_retyped(model)))
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        # an op PopART refuses leaves its outputs untyped (as in PopART's Builder), which the
        # checker refuses first; PopART (which runs no checker on a session's model) refuses
        # the op
        refused = _popart_refusal(model)
        if refused:
            return refused
        text = clip(str(err).strip(), 600)
        return [_problem("checker", f"onnx.checker refuses the model: {text}",
                         "correct the node it names (shapes, types and attributes as the "
                         "operator's schema says).", "K-model-onnx-checker")]
    except ValueError as err:  # e.g. a model over protobuf's 2 GB limit
        return [_problem("checker", f"onnx.checker cannot read the model: {clip(str(err), 300)}",
                         "save large weights as external data.", "K-model-onnx-checker")]
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        refused = _popart_refusal(model)  # PopART's ops type what ONNX's schemas refuse
        if refused:
            return refused
        text = clip(str(err).strip(), 600)
        return [_problem("checker", f"ONNX shape and type inference refuses the model: {text}",
                         "correct the node it names (shapes, types and attributes as the "
                         "operator's schema says).", "K-model-onnx-inference")]
    except ValueError as err:  # a value no ONNX type has (a data type number, ...)
        return [_problem("checker", f"onnx cannot read the model: {clip(str(err), 300)}",
                         "correct the value it names.", "K-model-onnx-checker")]
    return _popart_refusal(model, typed=True)  # what PopART's ops refuse and ONNX types


def model_problems(model: onnx.ModelProto) -> list[Problem]:
    """Every problem the kit finds in ``model``; the onnx checker's when the kit finds none."""
    found = _opset_problems(model) + _graph_problems(model)
    return found or _checker_problems(model)


def check_model(model: onnx.ModelProto, title: str = "model") -> None:
    """Raise one :class:`~popart_kit.errors.InvalidModel` listing every problem of ``model``."""
    raise_errors(title, model_problems(model), error=InvalidModel)
