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

import onnx

from .._base.problems import Problem, raise_errors
from ..errors import InvalidModel, clip
from .builder_subgraphs import without_branch_inputs

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
            elif int(spec.type) != int(attr.type):
                given = onnx.AttributeProto.AttributeType.Name(attr.type)
                want = onnx.AttributeProto.AttributeType.Name(int(spec.type))
                out.append(_problem(f"nodes.{_name(node, i)}",
                                    f"{_label(node, i)} attribute {attr.name} is {given}; "
                                    f"{node.op_type} defines it as {want}.",
                                    f"write {attr.name} as {want}.", "K-model-attribute-type"))
    return out


def _checker_problems(model: onnx.ModelProto) -> list[Problem]:
    """onnx.checker's structural check (PopART's), then ONNX's strict shape and type inference
    (the kit's: PopART infers leniently, so under popart_kit.popart it only warns)."""
    model = without_branch_inputs(_without_popart_extras(model))
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
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
        text = clip(str(err).strip(), 600)
        return [_problem("checker", f"ONNX shape and type inference refuses the model: {text}",
                         "correct the node it names (shapes, types and attributes as the "
                         "operator's schema says).", "K-model-onnx-inference")]
    except ValueError as err:  # a value no ONNX type has (a data type number, ...)
        return [_problem("checker", f"onnx cannot read the model: {clip(str(err), 300)}",
                         "correct the value it names.", "K-model-onnx-checker")]
    return []


def model_problems(model: onnx.ModelProto) -> list[Problem]:
    """Every problem the kit finds in ``model``; the onnx checker's when the kit finds none."""
    found = _opset_problems(model) + _graph_problems(model)
    return found or _checker_problems(model)


def check_model(model: onnx.ModelProto, title: str = "model") -> None:
    """Raise one :class:`~popart_kit.errors.InvalidModel` listing every problem of ``model``."""
    raise_errors(title, model_problems(model), error=InvalidModel)
