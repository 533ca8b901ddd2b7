"""``aiGraphcore.packedDataBlock`` (PopART's PackedDataBlockOp, op/packeddatablock.cpp and
patterns/packeddatablockpattern.cpp): sequences packed end to end are unpacked into padded
batches, a callback graph runs on each batch, and its padded results are packed back.

Inputs: for each data input ``data_i`` (tokens packed on axis 0), its ``offsets_i`` and
``lengths_i`` (one per sequence); then the result's offsets and lengths. Attributes:
``maxSequenceLengths`` (the padded length of each data input), ``resultSize`` (the packed
result's axis 0), ``callbackBatchSize`` (sequences per call) and the ``callback`` graph, which
takes each data input as [callbackBatchSize, maxSequenceLength, ...] and gives
[callbackBatchSize, length, ...]. The output is [resultSize, *callback output[2:]], zero where
no sequence is written."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx
from onnx import helper

AI_GRAPHCORE = "ai.graphcore"


def packed_data_block(builder: Any, args: Sequence[str], maxSequenceLengths: Sequence[int],
                      resultSize: int, callbackBatchSize: int, callback: Any,
                      debugName: str = "") -> str:
    """Add a PackedDataBlock node; refuses inputs not in groups of three plus two, a count of
    maxSequenceLengths that is not one per data input, or a callback without outputs."""
    from ..builder_base import BuilderError
    from ..builder_subgraphs import _add, _graph_of, _ids, _shape, _typed_graph

    args = _ids(args)
    graph = _graph_of(callback, "packedDataBlock: callback")
    lengths = [int(n) for n in maxSequenceLengths]
    if len(args) < 5 or (len(args) - 2) % 3:
        raise BuilderError(f"packedDataBlock: {len(args)} inputs. Fix: give [data, offsets, "
                           f"lengths] for each data input, then the result's offsets and "
                           f"lengths.")
    count = (len(args) - 2) // 3
    if len(lengths) != count:
        raise BuilderError(f"packedDataBlock: {len(lengths)} maxSequenceLengths for {count} "
                           f"data inputs. Fix: give one per data input.")
    if int(callbackBatchSize) < 1 or not graph.output:
        raise BuilderError(f"packedDataBlock: callbackBatchSize {callbackBatchSize}, callback "
                           f"outputs {len(graph.output)}. Fix: a callbackBatchSize of at least "
                           f"1 and a callback with an output (addOutputTensor).")
    inputs = []
    for i in range(count):  # what the callback sees: [batch, maxSequenceLength, rest...]
        given = builder._types.get(args[3 * i])
        shape = _shape(given)
        inputs.append(None if shape is None else helper.make_tensor_type_proto(
            given.tensor_type.elem_type, [int(callbackBatchSize), lengths[i], *shape[1:]]))
    typed, found = _typed_graph(builder, graph, inputs)
    out = found[0] if found else None
    shape = _shape(out)
    out_type = (helper.make_tensor_type_proto(out.tensor_type.elem_type,
                                              [int(resultSize), *shape[2:]])
                if shape is not None else onnx.TypeProto())
    attrs = {"maxSequenceLengths": lengths, "resultSize": int(resultSize),
             "callbackBatchSize": int(callbackBatchSize), "callback": typed}
    return _add(builder, "PackedDataBlock", args, 1, attrs, debugName, [callback], [out_type],
                domain=AI_GRAPHCORE)[0]
