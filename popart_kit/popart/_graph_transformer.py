"""popart.GraphTransformer: PopART's edits of an ONNX model before it is built into a session -
type conversions, initializers made constants, unused inputs removed, BatchNormalization given
its training outputs (graphtransformer_impl.cpp).

Each conversion retypes every tensor of one type: initializers, TENSOR attributes (Constant
values) and the declared types of inputs, outputs and value infos. Like PopART it refuses a model
with subgraph attributes (If, Loop, Scan bodies) and an INT64 value outside INT32's range unless
``clip`` is given.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .._model.layout import load_model, save_popart_external_data
from ._core import popart_exception

__all__ = ["GraphTransformer"]

_COUNTER = itertools.count()  # PopART's counter is shared by every transformer of the process
_FIXED_POINT = {TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
                TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64,
                TensorProto.BOOL}


def _value_infos(graph: onnx.GraphProto) -> Iterator[onnx.ValueInfoProto]:
    yield from graph.input
    yield from graph.output
    yield from graph.value_info


class GraphTransformer:
    """``popart.GraphTransformer(modelProtoOrFilename)``: edit a model, then read it back with
    :meth:`getModelProto` (serialised bytes, as PopART returns)."""

    def __init__(self, modelProtoOrFilename: bytes | str) -> None:
        self._model = onnx.ModelProto()
        self._model.CopyFrom(load_model(modelProtoOrFilename, popart_external=True))
        self._check()

    def _check(self) -> None:
        try:
            onnx.checker.check_model(self._model)
        except onnx.checker.ValidationError as err:
            raise popart_exception(str(err)) from None

    def getModelProto(self) -> bytes:
        return self._model.SerializeToString()

    # -- type conversions -------------------------------------------------------------------

    def _convert(self, method: str, source: int, target: int,
                 values: Callable[[np.ndarray], np.ndarray]) -> None:
        graph = self._model.graph
        for node in graph.node:  # every attribute checked before anything changes
            for attr in node.attribute:
                if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                    raise popart_exception(f"Attributes of type GRAPH and GRAPHS : need impl in "
                                           f"{method}")
        tensors = [t for t in graph.initializer if t.data_type == source]
        tensors += [a.t for n in graph.node for a in n.attribute
                    if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == source]
        converted = [values(numpy_helper.to_array(t)) for t in tensors]
        for tensor, array in zip(tensors, converted, strict=True):
            tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
        for value in _value_infos(graph):
            tensor_type = value.type.tensor_type
            if value.type.HasField("tensor_type") and tensor_type.elem_type == source:
                tensor_type.elem_type = target

    def convertFloatsToHalfs(self) -> None:
        self._convert("convertFloatToHalf", TensorProto.FLOAT, TensorProto.FLOAT16,
                      lambda a: a.astype(np.float16))

    def convertDoublesToHalfs(self) -> None:
        self._convert("convertDoublesToHalfs", TensorProto.DOUBLE, TensorProto.FLOAT16,
                      lambda a: a.astype(np.float16))

    def convertDoublesToFloats(self) -> None:
        self._convert("convertDoublesToFloats", TensorProto.DOUBLE, TensorProto.FLOAT,
                      lambda a: a.astype(np.float32))

    def convertBFloats16ToFloat32(self) -> None:
        self._convert("convertBFloats16ToFloat32", TensorProto.BFLOAT16, TensorProto.FLOAT,
                      lambda a: a.astype(np.float32))

    def convertUINT8ToINT32(self) -> None:
        self._convert("convertUINT8ToINT32", TensorProto.UINT8, TensorProto.INT32,
                      lambda a: a.astype(np.int32))

    def convertUINT16ToINT32(self) -> None:
        self._convert("convertUINT16ToINT32", TensorProto.UINT16, TensorProto.INT32,
                      lambda a: a.astype(np.int32))

    def convertINT8ToINT32(self) -> None:
        self._convert("convertINT8ToINT32", TensorProto.INT8, TensorProto.INT32,
                      lambda a: a.astype(np.int32))

    def convertINT16ToINT32(self) -> None:
        self._convert("convertINT16ToINT32", TensorProto.INT16, TensorProto.INT32,
                      lambda a: a.astype(np.int32))

    def convertINT64ToINT32(self, clip: bool = False) -> None:
        """INT64 to INT32; a value outside INT32's range is refused, or saturated with
        ``clip=True``."""
        limits = np.iinfo(np.int32)

        def narrowed(array: np.ndarray) -> np.ndarray:
            if not clip and array.size and (array.min() < limits.min or array.max() > limits.max):
                raise popart_exception(
                    "In convertINT64TensorToINT32, cannot cast int64 to int32: number is too "
                    "large. If you are sure you want still want to convert your tensor data, you "
                    "can set 'clip' to 'true'.")
            return np.clip(array, limits.min, limits.max).astype(np.int32)

        self._convert("convertINT64ToINT32", TensorProto.INT64, TensorProto.INT32, narrowed)

    # -- graph edits ------------------------------------------------------------------------

    def convertInitializersToConstants(self, ids: Sequence[str]) -> None:
        """Each named initializer becomes a Constant node (first in the graph) and stops being
        an input; every name must be an initializer."""
        graph = self._model.graph
        initializers = {t.name: t for t in graph.initializer}
        for tensor_id in ids:
            if tensor_id not in initializers:
                raise popart_exception(f"TensorId {tensor_id} not in the model initalizers")
        chosen = set(ids)
        constants = [helper.make_node("Constant", [], [i], name=i, value=initializers[i])
                     for i in dict.fromkeys(ids)]
        nodes = constants + list(graph.node)
        del graph.node[:]
        graph.node.extend(nodes)
        kept = [t for t in graph.initializer if t.name not in chosen]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        inputs = [v for v in graph.input if v.name not in chosen]
        del graph.input[:]
        graph.input.extend(inputs)
        self._check()

    def convertAllFixedPointInitializersToConstants(self) -> None:
        self.convertInitializersToConstants(
            [t.name for t in self._model.graph.initializer if t.data_type in _FIXED_POINT])

    def removeUnusedInputs(self) -> None:
        """Graph inputs (and their initializers) that no node reads are removed."""
        graph = self._model.graph
        consumed = {i for node in graph.node for i in node.input}
        inputs = [v for v in graph.input if v.name in consumed]
        initializers = [t for t in graph.initializer if t.name in consumed]
        del graph.input[:]
        graph.input.extend(inputs)
        del graph.initializer[:]
        graph.initializer.extend(initializers)

    def prepareNodesForTraining(self) -> None:
        """BatchNormalization nodes get their five training outputs (PopART names the added
        ones ``BatchNormalization_<node name>_oi<index>_<counter>``)."""
        for node in self._model.graph.node:
            if node.op_type == "BatchNormalization":
                for index in range(len(node.output), 5):
                    node.output.append(f"{node.op_type}_{node.name}_oi{index}_"
                                       f"{next(_COUNTER)}")

    def saveInitializersExternally(self, ids: Sequence[str], fn: str) -> None:
        """onnxutil.cpp:442 saveInitializersExternally: the data of initializers ``ids`` moves
        to the file ``fn`` (replaced whole; one tensor after another) and each refers to it
        (location ``fn`` as given, length, offset). Refuses, in PopART's words and changing
        nothing, a missing parent folder, a tensor that is not an initializer, one already
        external and one without data."""
        problem = save_popart_external_data(self._model.graph, ids, fn)
        if problem:
            raise popart_exception(problem)
