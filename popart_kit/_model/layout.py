"""PipelineLayout: the pipeline-stage and IPU annotations of any ONNX model, and PopART's rules.

PopART reads ``__pipeline_stage`` and ``__ipu_number`` node attributes (INT) and checks them only
after the model is loaded, one rule at a time.
This module reads them from a ModelProto, bytes or a path, checks every rule at once, computes
the forward stages and the depth PopART runs, and renders the device allocation.

Rule ids: ``V<n>`` is a session-option check PopART makes, ``P<n>`` a check PopART makes on
pipeline annotations, ``K-...`` popart_kit's own. Checks cost the same whatever the stage and IPU
numbers are.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from .._base.atomic import write_atomic
from .._base.problems import Problem, emit_warnings, popart_vector, raise_errors
from .._base.schedule import depth_text
from ..errors import ModelError, ModelTypeError, short
from .builder_settings import EXECUTION_PHASE
from .builder_subgraphs import node_reads
from .popart_types import popart_opid
from .tensors import in_onnx_form

if TYPE_CHECKING:
    from .._config.fields import SessionFields

__all__ = ["PipelineLayout", "StagedOp", "PIPELINE_STAGE", "VIRTUAL_GRAPH", "allocation_view",
           "load_model", "opid", "save_popart_external_data"]

PIPELINE_STAGE = "__pipeline_stage"
VIRTUAL_GRAPH = "__ipu_number"
# Nodes PopART turns into tensors rather than ops: they carry no placement.
_NOT_OPS = frozenset({"Constant"})
_SHOW = 4  # names listed in an error before "…"
_STAGE_LOC, _IPU_LOC = f"model.{PIPELINE_STAGE}", f"model.{VIRTUAL_GRAPH}"
#: The largest model read, file or bytes: protobuf's limit on one serialised message (2 GiB).
#: Larger weights go in external data files beside the model.
MAX_MODEL_BYTES = 2**31 - 1


def load_model(model: onnx.ModelProto | bytes | str | os.PathLike, *,
               popart_external: bool = False,
               external_info: dict[str, ExternalInfo] | None = None) -> onnx.ModelProto:
    """A ModelProto from itself, serialised bytes (as Builder.getModelProto returns) or a path.

    Refuses, before reading anything: a path that is not a regular file (a device, a FIFO, a
    directory) and more than :data:`MAX_MODEL_BYTES`. External data is read only for a model
    loaded from a path, from files inside the model's folder (onnx refuses ``..`` and links out
    of it); a model given as bytes or a ModelProto has no folder, so external data is refused.
    With ``popart_external`` (popart_kit.popart's sessions and Builder) external data is read
    as PopART reads it, from any model (see :func:`read_popart_external_data`; a model file
    also finds it in its own folder), and where
    each initializer's data came from is recorded in ``external_info`` when given.
    FLOAT16 weights PopART packed two to an int32 are read in ONNX's form."""
    if isinstance(model, onnx.ModelProto):
        if popart_external:
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
            return in_onnx_form(read_popart_external_data(copy, external_info))
        _refuse_external_data(model, "this ModelProto")
        return in_onnx_form(model)
    if not isinstance(model, bytes | bytearray | str | os.PathLike):
        raise ModelTypeError(f"expected an onnx.ModelProto, bytes or a path, got "
                             f"{type(model).__name__}.", rule="K-model-type")
    where = "these bytes" if isinstance(model, bytes | bytearray) else short(os.fspath(model))
    try:
        if isinstance(model, bytes | bytearray):
            _refuse_size(where, len(model))
            proto = onnx.load_from_string(bytes(model))
            if not popart_external:
                _refuse_external_data(proto, where)
        else:
            _refuse_special_file(where, os.fspath(model))
            proto = onnx.load(os.fspath(model), load_external_data=not popart_external)
        _refuse_invalid_text(proto, where)
        if popart_external:
            folder = None if isinstance(model, bytes | bytearray) else os.path.dirname(
                os.path.abspath(os.fspath(model)))
            read_popart_external_data(proto, external_info, folder)
        return in_onnx_form(proto)   # PopART's packed FLOAT16 weights read as ONNX's
    except ModelError:
        raise
    except DecodeError as err:
        failure = ModelError(f"{where} is not an ONNX model ({err}).", rule="K-model-decode")
        failure.popart_text = (  # type: ignore[attr-defined]  # filereader.cpp:285 and :265
            f"Failed to load a ModelProto from the string '{_popart_bytes(bytes(model))}'.\n"
            f"Check that it is either a valid path to an existing onnx model file, or is a "
            f"valid onnx ModelProto string." if isinstance(model, bytes | bytearray) else
            f"Failed to parse ModelProto from file {os.fspath(model)}")
        raise failure from None
    except FileNotFoundError as err:
        raise ModelError(f"{where}: no such file ({short(err.filename or '')}). Fix: check the "
                         f"path, and that external data files sit beside the model.",
                         rule="K-model-file") from None
    except IsADirectoryError:
        raise ModelError(f"{where} is a directory, not an ONNX model.",
                         rule="K-model-file") from None
    except Exception as err:  # onnx's ValidationError for bad external data, OSError, ...
        raise ModelError(f"{where} cannot be loaded: {short(str(err), 300)}",
                         rule="K-model-file") from None


@dataclass(frozen=True)
class ExternalInfo:
    """Where an externally stored tensor's data is (PopART's ExternalTensorProtoInfo):
    ``length`` bytes from ``offset`` of the file ``location`` (relative to the working
    directory)."""

    location: str
    offset: int
    length: int

    @classmethod
    def of(cls, tensor: onnx.TensorProto, folder: str | None = None) -> ExternalInfo:
        """The tensor's external_data entries (not checked: see :meth:`problem`). With
        ``folder`` (the folder of a model read from a file), a relative location that is not
        there from the working directory, as PopART reads it, but is in ``folder`` (where
        ONNX's exporters put it) is taken from ``folder``."""
        info = {e.key: e.value for e in tensor.external_data}
        try:
            offset, length = int(info.get("offset") or 0), int(info.get("length") or 0)
        except ValueError:
            offset, length = -1, 0
        location = info.get("location", "")
        if folder and location and not os.path.isabs(location) and \
                not os.path.exists(location) and ".." not in location.replace("\\", "/").split("/"):
            beside = os.path.join(folder, location)
            if os.path.isfile(beside):
                location = beside
        return cls(location, offset, length)

    def problem(self, name: str) -> str:
        """PopART's refusal of this information for tensor ``name`` (onnxutil.cpp:179-200:
        no location, a location that does not exist, a length <= 0, a negative offset), or
        ""."""
        return (
            f"No location information for externally stored tensor '{name}'"
            if not self.location else
            f"Unrecognised file name '{self.location}' for externally stored tensor '{name}'"
            if not os.path.exists(self.location) else
            f"Invalid 'length' information ({self.length}) for externally stored tensor "
            f"'{name}'" if self.length <= 0 else
            f"Invalid 'offset' information ({self.offset}) for externally stored tensor "
            f"'{name}'" if self.offset < 0 else "")

    def entries(self) -> list[onnx.StringStringEntryProto]:
        """The tensor's external_data as PopART writes it (onnxutil.cpp:507): location,
        length, offset."""
        return [onnx.StringStringEntryProto(key=k, value=str(v)) for k, v in
                (("location", self.location), ("length", self.length),
                 ("offset", self.offset))]


def _popart_bytes(data: bytes, most: int = 100) -> str:
    """The start of a model's bytes as PopART's filereader.cpp:42 formatModelProtoString shows
    them (printable ASCII as is, ``\\`` and ``'`` escaped, \\n \\t \\r, other bytes \\xNN; ``...``
    after ``most`` + 1 bytes)."""
    out = []
    for count, byte in enumerate(data, 1):
        c = chr(byte)
        out.append(("\\" + c if c in "\\'" else c) if " " <= c <= "~" else
                   {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c, f"\\x{byte:02x}"))
        if count > most:
            out.append("...")
            break
    return "".join(out)


def read_popart_external_data(model: onnx.ModelProto,
                              found: dict[str, ExternalInfo] | None = None,
                              folder: str | None = None) -> onnx.ModelProto:
    """Read into ``model`` (in place) the data of its tensors kept in external files, as PopART
    does (onnxutil.cpp:162 ExternalTensorProtoInfo, :260 getConstData): ``location`` is a path,
    absolute or relative to the working directory (not to the model's folder), ``length``
    bytes from ``offset``. Refuses, with PopART's messages, a tensor without a location, a
    location that does not exist, a length <= 0 and a negative offset. Each initializer's
    information is recorded in ``found`` when given (PopART's Ir keeps it: modelToHost writes
    the trained values back there). A model read from a file also finds a relative location in
    its own ``folder`` when it is not in the working directory (:meth:`ExternalInfo.of`)."""
    if found is not None:
        found.update((t.name, ExternalInfo.of(t, folder)) for t in model.graph.initializer
                     if t.data_location == onnx.TensorProto.EXTERNAL)
    for tensor in _tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        where = ExternalInfo.of(tensor, folder)
        location, offset, length = where.location, where.offset, where.length
        problem = where.problem(tensor.name)
        data = b""
        if not problem:
            try:
                with open(location, "rb") as f:
                    f.seek(offset)
                    data = f.read(length)
            except OSError as err:
                problem = f"Failed to open file {location} ({err.strerror})"
            else:
                if len(data) != length:
                    problem = (f"External data of tensor '{tensor.name}' in {location}: "
                               f"{length} bytes from offset {offset} asked, {len(data)} there")
        if problem:
            err = ModelError(f"{problem}. Fix: keep the file the model names where it names "
                             f"it (PopART reads a relative location from the working "
                             f"directory).", rule="K-model-external-data")
            err.popart_text = problem  # type: ignore[attr-defined]
            raise err
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = data
    return model


def save_popart_external_data(graph: onnx.GraphProto, ids: Sequence[str], fn: str) -> str:
    """PopART's saveInitializersExternally (onnxutil.cpp:442), all or nothing: the data of
    the initializers ``ids`` moves to the file ``fn`` (replaced whole, one tensor after
    another) and each refers to it (:meth:`ExternalInfo.entries`, location ``fn`` as given).
    Returns PopART's refusal, the graph and the file left as they were - a missing parent
    folder, a tensor that is not an initializer, one already external (or named twice), one
    without data - or "" when done."""
    folder = os.path.dirname(fn)
    if folder and not os.path.isdir(folder):
        return f"Saving tensor data to file {fn}, but its parent directory does not exist"
    found = {t.name: t for t in graph.initializer}
    blob, moved = bytearray(), {}
    for tensor_id in ids:
        tensor = found.get(tensor_id)
        if tensor is None:
            return f"Tensor '{tensor_id}' is not an initializer"
        if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor_id in moved:
            return f"Tensor '{tensor_id}' already has an external data_location"
        raw = numpy_helper.to_array(tensor).tobytes()
        if not raw:
            return f"Tensor '{tensor_id}' has no data to save externally"
        moved[tensor_id] = ExternalInfo(fn, len(blob), len(raw))
        blob += raw
    write_atomic(fn, bytes(blob))
    for tensor_id, info in moved.items():
        tensor = found[tensor_id]
        kept = onnx.TensorProto(name=tensor.name, dims=tensor.dims, data_type=tensor.data_type,
                                data_location=onnx.TensorProto.EXTERNAL)
        kept.external_data.extend(info.entries())
        tensor.CopyFrom(kept)
    return ""


def _refuse_size(where: str, size: int) -> None:
    if size > MAX_MODEL_BYTES:
        raise ModelError(f"{where}: {size} bytes, more than an ONNX model can hold "
                         f"({MAX_MODEL_BYTES} bytes, protobuf's limit). Fix: save large weights "
                         f"as external data beside the model file.", rule="K-model-file")


def _refuse_special_file(where: str, path: str) -> None:
    """A path must name a regular file of at most MAX_MODEL_BYTES (checked before reading)."""
    info = os.stat(path)  # FileNotFoundError and others are reported by the caller
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(path)
    if not stat.S_ISREG(info.st_mode):
        raise ModelError(f"{where} is not a regular file (a device, FIFO or socket): a model "
                         f"is read from a file. Fix: save the model to a file and give its "
                         f"path.", rule="K-model-file")
    _refuse_size(where, info.st_size)


def _refuse_external_data(model: onnx.ModelProto, where: str) -> None:
    """External data is resolved against a model's folder; bytes and protos have none."""
    external = [t.name for t in _tensors(model.graph)
                if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise ModelError(
            f"{where}: the data of {len(external)} tensor(s) ({short(external[:_SHOW])}) is "
            f"kept in external files, but without a path there is no folder to read them "
            f"from (the working directory is not trusted for it). Fix: give the model's path, "
            f"or load it with onnx.load(path), which reads its external data.",
            rule="K-model-external-data")


def _refuse_invalid_text(model: onnx.ModelProto, where: str) -> None:
    """ONNX's string fields are UTF-8; protobuf hands invalid ones over as bytes, which no
    name check expects. Refused like any undecodable model (one pass over the fields)."""
    found = _invalid_text(model)
    if found:
        raise ModelError(f"{where} is not an ONNX model: its field {found} is not UTF-8 text.",
                         rule="K-model-decode")


def _invalid_text(message: Any, path: str = "model") -> str | None:
    """The path of the first string field of ``message`` that is not text (None: all are)."""
    for field, value in message.ListFields():
        if field.type not in (field.TYPE_STRING, field.TYPE_MESSAGE):
            continue  # numbers and bytes (tensor data, string tensors): nothing to decode
        repeated = _is_repeated(field)
        items = list(enumerate(value)) if repeated else [(None, value)]
        for i, item in items:
            here = f"{path}.{field.name}" + (f"[{i}]" if repeated else "")
            if field.type == field.TYPE_STRING and isinstance(item, bytes):
                return here
            if field.type == field.TYPE_MESSAGE:
                found = _invalid_text(item, here)
                if found:
                    return found
    return None


def _is_repeated(field: Any) -> bool:
    """protobuf 5.29+ says ``is_repeated``; earlier versions only have ``label``."""
    repeated = getattr(field, "is_repeated", None)
    return repeated if repeated is not None else field.label == field.LABEL_REPEATED


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor stored in ``graph``: initializers and node attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                yield from _tensors(sub)


@dataclass(frozen=True)
class StagedOp:
    """One node: its name (else its first output), tensors, stage and IPU when annotated."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    stage: int | None
    ipu: int | None
    phase: int | None = None   # its execution phase (__execution_phase), when annotated
    opid: str = ""             # domain.type:version, as PopART names the operator
    label: str = ""            # the node's own name ("" when it has none)

    @property
    def debug_name(self) -> str:
        """PopART's Op::debugName (op.cpp:1108): Op(name (opid), inputs=[..], outputs=[..])."""
        opid = self.opid or self.op_type
        head = f"{self.label} ({opid})" if self.label else opid
        return (f"Op({head}, inputs=[{', '.join(t for t in self.inputs if t)}], "
                f"outputs=[{', '.join(t for t in self.outputs if t)}])")


def opid(node: onnx.NodeProto, model: onnx.ModelProto) -> str:
    """PopART's text for an operator identifier, domain.type:version (opmanager.cpp:70): ONNX's
    operators at the version of their schema the model's opset selects, ai.graphcore's at 1."""
    domain = node.domain or "ai.onnx"
    opset = next((int(o.version) for o in model.opset_import
                  if (o.domain or "ai.onnx") == domain), 0)
    return popart_opid(node.op_type, opset, domain)



def _int_attribute(node: onnx.NodeProto, name: str) -> int | None:
    for attr in node.attribute:
        if attr.name == name:
            if attr.type != onnx.AttributeProto.INT:
                kind = onnx.AttributeProto.AttributeType.Name(attr.type)
                label = short(node.name or (node.output[0] if node.output else node.op_type))
                raise ModelError(f"node {label}: {name} is a {kind} attribute; PopART reads an "
                                 f"INT. Fix: write one integer.", rule="P-attribute-type")
            return int(attr.i)
    return None


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_SHOW])
    return shown + (f" and {len(items) - _SHOW} more" if len(items) > _SHOW else "")


def _count(items: Sequence[str]) -> str:
    return f"{len(items)} {'has' if len(items) == 1 else 'have'}"


def _merged_depth(ipus: Sequence[int]) -> int:
    """Stages left after PopART merges consecutive stages that sit on the same IPU."""
    return sum(1 for i, ipu in enumerate(ipus) if i == 0 or ipu != ipus[i - 1])


class PipelineLayout:
    """Stages and IPUs of a model's ops; construction reports every rule the model breaks."""

    def __init__(self, ops: Sequence[StagedOp], weights: Sequence[str] = ()) -> None:
        self.ops = tuple(ops)
        self.weights = frozenset(weights)  # the model's initializers: PopART's variables
        self.inferred = False
        raise_errors("PipelineLayout", self._model_problems())

    @classmethod
    def from_model(cls, model: onnx.ModelProto | bytes | str | os.PathLike) -> PipelineLayout:
        proto = load_model(model)
        ops = []
        for index, node in enumerate(proto.graph.node):
            if node.op_type in _NOT_OPS:
                continue
            label = node.name or (node.output[0] if node.output else f"{node.op_type}#{index}")
            ops.append(StagedOp(label, node.op_type,
                                tuple(node_reads(node)), tuple(node.output),
                                _int_attribute(node, PIPELINE_STAGE),
                                _int_attribute(node, VIRTUAL_GRAPH),
                                _int_attribute(node, EXECUTION_PHASE),
                                opid(node, proto), node.name))
        return cls(ops, [t.name for t in proto.graph.initializer])

    # -- the model's own rules ----------------------------------------------------------------

    def _model_problems(self) -> list[Problem]:
        """What no session could run: negative stages or IPUs. The rules on how stages and
        IPUs are annotated apply only where PopART applies them: :meth:`problems`."""
        out: list[Problem] = []
        staged = [op for op in self.ops if op.stage is not None]
        placed = [op for op in self.ops if op.ipu is not None]
        negative = [op for op in staged if op.stage < 0] + [op for op in placed if op.ipu < 0]
        if negative:
            out.append(Problem(_STAGE_LOC, f"negative stage or IPU on "
                                                 f"{_names([op.name for op in negative])}.",
                               "number stages and IPUs from 0.", "P11"))
        if not staged and placed:
            self.inferred = True  # PopART sets each op's stage to its virtual graph id
        return out

    def _ipu_problems(self) -> list[Problem]:
        """With virtual graphs on: every op has an IPU, or none does (PopART's
        Ir::verifyVirtualGraphIds)."""
        placed = [op for op in self.ops if op.ipu is not None]
        if placed and len(placed) < len(self.ops):
            missing = [op.name for op in self.ops if op.ipu is None]
            counts: dict[int, int] = {}
            for op in self.ops:
                counts[-1 if op.ipu is None else op.ipu] = \
                    counts.get(-1 if op.ipu is None else op.ipu, 0) + 1
            # ir.cpp:1974 (PopART's op ids: here each op's place in the graph)
            text = ("Either all Ops must have their virtual graph ids set, or none must. Op "
                    "count per virtual graph id\n" + "".join(
                        f"  {ipu} : {n}\n" for ipu, n in sorted(counts.items()))
                    + "Ops with no virtual graph id :  \n" + "".join(
                        f"  {i} ({op.opid or op.op_type})\n"
                        for i, op in enumerate(self.ops) if op.ipu is None))
            return [Problem(_IPU_LOC, f"only some ops have an IPU; {_count(missing)} "
                                      f"none: {_names(missing)}.",
                            "annotate every op with an IPU, or none.", "V26", popart=text)]
        return []

    def stage_problems(self) -> list[Problem]:
        """With pipelining: PopART's Ir::verifyPipelineSettings and the pipeline transform's
        rules on the model's stages (without pipelining PopART clears the stages)."""
        out: list[Problem] = []
        staged = [op for op in self.ops if op.stage is not None]
        if staged and len(staged) < len(self.ops):
            missing = [op.name for op in self.ops if op.stage is None]
            out.append(Problem(_STAGE_LOC, f"only some ops have a pipeline stage; "
                                                 f"{_count(missing)} none: {_names(missing)}.",
                               "annotate every op (PipelineBuilder.stage covers a whole block).",
                               "V4", popart="Only some ops have had their pipeline stage set. "
                               "Ops missing the pipeline stage:" + "".join(
                                   f"\n  {op.debug_name}" for op in self.ops
                                   if op.stage is None)))  # ir.cpp:617
            return out
        stages = sorted({self._stage(op) for op in self.ops if self._stage(op) is not None})
        if stages and stages[-1] != len(stages) - 1:  # sorted and unique: a gap somewhere
            gap = next(i for i, s in enumerate(stages) if s != i)
            what = "IPUs (the stages PopART infers)" if self.inferred else "stages"
            out.append(Problem(_STAGE_LOC,
                               f"the {what} used are {short(stages)}: stage {gap} is missing "
                               f"(PopART needs stages 0..{len(stages) - 1}).",
                               "renumber the IPUs without gaps, or annotate stages explicitly."
                               if self.inferred else "renumber the stages without gaps.",
                               "V8"))
        for stage, ipus in sorted(self._ipus_per_stage().items()):
            if len(ipus) > 1:
                ops = [op for op in self.ops if self._stage(op) == stage]
                out.append(Problem(_STAGE_LOC,
                                   f"stage {stage} has ops on IPUs {sorted(ipus)} "
                                   f"({_names([op.name for op in ops])}); a stage runs on "
                                   f"exactly one IPU.",
                                   f"put all of stage {stage} on one IPU, or split it into "
                                   f"stages.", "V5",
                                   popart=f"Ops {popart_vector([op.debug_name for op in ops])} "
                                   f"have the same pipeline stage {stage}, but different "
                                   f"virtual graph ids {popart_vector(sorted(ipus))}. All ops "
                                   f"with the same pipeline stage must also have the same "
                                   f"virtual graph id"))  # ir.cpp:660
        out += list(self._flow_problems())
        return out

    def _stage(self, op: StagedOp) -> int | None:
        return op.ipu if self.inferred else op.stage

    def _ipus_per_stage(self) -> dict[int, set[int]]:
        found: dict[int, set[int]] = {}
        for op in self.ops:
            stage = self._stage(op)
            if stage is not None and op.ipu is not None:
                found.setdefault(stage, set()).add(op.ipu)
        return found

    def _weights_across_ipus(self) -> dict[str, set[int]]:
        used: dict[str, set[int]] = {}
        for op in self.ops:
            for tensor in op.inputs:
                if tensor in self.weights and op.ipu is not None:
                    used.setdefault(tensor, set()).add(op.ipu)
        return {w: ipus for w, ipus in used.items() if len(ipus) > 1}

    def _flow_problems(self) -> Iterator[Problem]:
        producer = {t: op for op in self.ops for t in op.outputs}
        for op in self.ops:
            for tensor in op.inputs:
                source = producer.get(tensor)
                if source is None:
                    continue
                made, used = self._stage(source), self._stage(op)
                if made is not None and used is not None and used < made:
                    how = "IPU" if self.inferred else "stage"
                    yield Problem(
                        _STAGE_LOC,
                        f"tensor {tensor!r} is made by {source.name} on {how} {made} but "
                        f"consumed by {op.name} on {how} {used}, earlier in the pipeline"
                        + (" (the model has no stages, so PopART takes each op's IPU as its "
                           "stage)." if self.inferred else "."),
                        "data must flow to the same or a later stage: move the consumer later "
                        "or the producer earlier" + (" (or annotate stages explicitly)"
                                                     if self.inferred else "") + ".",
                        "P9" if self.inferred else "P10",
                        # transforms/inferpipelinestages.cpp:54 checkOrder
                        popart=f"Tensor {tensor} is consumed in an earlier pipeline stage than "
                        f"it is produced\nProducer {source.debug_name} has pipeline stage "
                        f"{made}\nConsumer {op.debug_name} has pipeline stage {used}")

    # -- derived ------------------------------------------------------------------------------

    @property
    def is_annotated(self) -> bool:
        return any(op.stage is not None or op.ipu is not None for op in self.ops)

    @property
    def forward_stages(self) -> int:
        """F: the model's forward pipeline stages (0 when it carries no annotation)."""
        return len({self._stage(op) for op in self.ops} - {None})

    @property
    def tensor_stages(self) -> dict[str, int]:
        """The stage of each tensor an annotated op makes (its pipeline stage; where the model
        has none, its IPU, as PopART infers stages)."""
        return {t: stage for op in self.ops if (stage := self._stage(op)) is not None
                for t in op.outputs if t}

    @property
    def stage_ipu(self) -> dict[int, int | None]:
        """Each stage's IPU (None where the model names no IPU)."""
        ipus = self._ipus_per_stage()
        return {s: next(iter(ipus[s])) if s in ipus else None for s in range(self.forward_stages)}

    @property
    def ipus_used(self) -> set[int]:
        return {op.ipu for op in self.ops if op.ipu is not None}

    def depth(self, training: bool) -> int:
        """Stages PopART runs: training adds backward stages (2F - 1, the backward of stage s
        on the IPU of s), then consecutive stages on the same IPU merge into one."""
        f = self.forward_stages
        if f == 0:
            return 0
        stage_ipu = self.stage_ipu
        ipus = [stage_ipu[s] for s in range(f)]
        if any(ipu is None for ipu in ipus):
            return 2 * f - 1 if training else f
        sequence = ipus + ipus[-2::-1] if training else ipus
        return _merged_depth(sequence)

    # -- against a session ------------------------------------------------------------------

    def problems(self, cfg: SessionFields) -> list[Problem]:
        """Every way this model and ``cfg`` disagree (errors and warnings)."""
        out: list[Problem] = []
        ipus, vgm, pipe = cfg.ipus_per_replica, cfg.virtual_graph_mode, cfg.pipeline
        outside = sorted(i for i in self.ipus_used if i >= ipus)
        if outside and vgm != "off":
            out.append(Problem("ipus_per_replica",
                               f"the model places ops on IPU(s) {outside} but ipus_per_replica="
                               f"{ipus} (IPUs 0..{ipus - 1}).",
                               f"set ipus_per_replica to at least {max(outside) + 1}, or move "
                               f"those ops.", "V24"))
        if vgm == "manual" and not self.ipus_used:
            out.append(Problem("virtual_graph_mode",
                               "virtual_graph_mode='manual' but no op carries an IPU "
                               "(__ipu_number).",
                               "annotate the ops (PipelineBuilder.stage sets stage and IPU), "
                               "or use virtual_graph_mode='auto'.", "V25"))
        if vgm == "off" and self.ipus_used:
            out.append(Problem("virtual_graph_mode",
                               "virtual_graph_mode='off': PopART ignores the model's IPU "
                               "annotations.", "set virtual_graph_mode='manual' to use them.",
                               "V27", "warning"))
        if vgm != "off":
            out += self._ipu_problems()
        f = self.forward_stages
        if not pipe.enabled:
            if any(op.stage is not None for op in self.ops):
                out.append(Problem("pipeline.enabled",
                                   f"the model has {f} pipeline stages but pipelining is off: "
                                   f"PopART clears them.", "set pipeline.enabled=true to "
                                                           "pipeline.", "V3", "warning"))
            return out
        if f == 0:
            out.append(Problem("pipeline.enabled",
                               "pipelining is on but the model has no pipeline stages or IPUs.",
                               "annotate stages (PipelineBuilder), or disable pipelining.",
                               "K-layout-unstaged"))
            return out
        staging = self.stage_problems()
        if staging:  # the stages themselves are wrong: nothing below can be judged
            return out + staging
        for weight, ipus in sorted(self._weights_across_ipus().items()):
            out.append(Problem(_IPU_LOC,
                               f"weight {weight!r} is used on IPUs {sorted(ipus)}: PopART cannot "
                               f"copy a variable between IPUs when pipelining.",
                               "keep every op that reads a weight on one IPU (its stages may "
                               "differ).", "P20"))
        if pipe.stages is not None and pipe.stages != f:
            out.append(Problem("pipeline.stages",
                               f"pipeline.stages={pipe.stages} but the model has {f} forward "
                               f"stages.", f"set pipeline.stages={f} or leave it unset.",
                               "K-layout-stages"))
        depth = self.depth(cfg.is_training)
        acc, bps = cfg.accumulation.factor, cfg.batches_per_step
        if cfg.is_training and acc > 1:
            if acc < depth:
                out.append(Problem("accumulation.factor",
                                   f"accumulation.factor={acc} is below the pipeline depth "
                                   f"{depth} of this model.",
                                   f"set accumulation.factor >= {depth}.", "V6",
                                   popart=depth_text("gradient accumulation factor", depth)))
        elif bps < depth:
            out.append(Problem("batches_per_step",
                               f"batches_per_step={bps} is below the pipeline depth {depth} of "
                               f"this model.", f"set batches_per_step >= {depth}.", "V7",
                               popart=depth_text("batchesPerStep", depth)))
        return out

    def check(self, cfg: SessionFields) -> None:
        """Raise one ValueError listing every error of this model under ``cfg``; warn the rest."""
        found = self.problems(cfg)
        raise_errors("PipelineLayout.check", found)
        emit_warnings(found)

    # -- display ------------------------------------------------------------------------------

    def allocation(self) -> list[tuple[int | None, int | None, list[str]]]:
        """Runs of consecutive ops on the same stage and IPU: (stage, ipu, op names)."""
        runs: list[tuple[int | None, int | None, list[str]]] = []
        for op in self.ops:
            key = (self._stage(op), op.ipu)
            if runs and runs[-1][:2] == key:
                runs[-1][2].append(op.name)
            else:
                runs.append((*key, [op.name]))
        return runs

    @property
    def phases(self) -> list[tuple[int, int | None, list[str]]]:
        """The execution phases in order: (phase, IPU, op names); empty without phases."""
        found: dict[int, tuple[int | None, list[str]]] = {}
        for op in self.ops:
            if op.phase is not None:
                found.setdefault(op.phase, (op.ipu, []))[1].append(op.name)
        return [(phase, ipu, names) for phase, (ipu, names) in sorted(found.items())]

    def allocation_table(self) -> str:
        """The device allocation as text: which ops sit on which stage and IPU."""
        from .._base.render import to_text

        return to_text(allocation_view(self))

    def __repr__(self) -> str:
        return (f"PipelineLayout(forward_stages={self.forward_stages}, "
                f"stage_ipu={self.stage_ipu}, ops={len(self.ops)})")


def allocation_view(layout: PipelineLayout) -> Any:
    """Which ops sit on which stage and IPU, in model order (as PopART apps print it), as a
    rich table."""
    from rich.table import Table

    from .._base.render import cell

    if layout.phases:  # a phased model: each phase on its IPU, in order
        table = Table(title=f"Device allocation: {len(layout.phases)} execution phases",
                      title_justify="left")
        for column, justify in (("phase", "right"), ("IPU", "right"), ("ops", "right"),
                                ("first … last op", "left")):
            table.add_column(column, justify=justify)
        for phase, ipu, names in layout.phases:
            span = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
            table.add_row(cell(phase), cell(ipu), str(len(names)), span)
        return table
    how = " (stages inferred from IPUs)" if layout.inferred else ""
    table = Table(title=f"Device allocation: {layout.forward_stages} forward stages{how}",
                  title_justify="left")
    for column, justify in (("stage", "right"), ("IPU", "right"), ("ops", "right"),
                            ("first … last op", "left")):
        table.add_column(column, justify=justify)
    for stage, ipu, names in layout.allocation():
        span = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
        table.add_row(cell(stage), cell(ipu), str(len(names)), span)
    return table
