"""PopART's ``aiGraphcore.lstm(args, outputFullSequence=1, debugContext="")``: the ai.graphcore LSTM
(willow/src/op/lstm.cpp PopartLSTMOp). Inputs X [seq, batch, input], Weights [4, input + hidden,
hidden], optional Bias [4, hidden], InitState [2, batch, hidden] and SeqLengths; it returns
[output, cell state]: the hidden state of every step ([seq, batch, hidden], or the last one,
[batch, hidden], with ``outputFullSequence=0``) and the last cell state [batch, hidden]."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._registry import GraphcoreOp, TensorType, register


def _lstm_types(inputs: Sequence[TensorType], attrs: Mapping[str, Any]) -> list[TensorType]:
    """PopartLSTMOp::setup: hidden size from the weights' last dimension."""
    dtype, x = inputs[0]
    weights = inputs[1][1] if len(inputs) > 1 else None
    if x is None or weights is None or len(x) != 3 or len(weights) != 3:
        return [(dtype, None), (dtype, None)]
    steps, batch, hidden = x[0], x[1], weights[2]
    full = attrs.get("output_full_sequence", 1)
    return [(dtype, [steps, batch, hidden] if full else [batch, hidden]), (dtype, [batch, hidden])]


register("lstm", GraphcoreOp("LSTM", (("outputFullSequence", "int", 1),), _lstm_types,
                             outputs=2, returns_list=True,
                             renamed=(("outputFullSequence", "output_full_sequence"),)))
