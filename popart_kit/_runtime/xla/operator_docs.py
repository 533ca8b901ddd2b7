"""``docs/operators.md``: every operator, whether the xla backend lowers it, and where PopART's
arithmetic departs from the ONNX formula or from autodiff (and so the backend's does too).

Generated: ``python -m popart_kit._runtime.xla.operator_docs > docs/operators.md``. The
departures are data here, each with the PopART source it was read from.
"""

from __future__ import annotations

import onnx
from onnx import defs

from ..._model.graphcore import GRAPHCORE_OPS
from .op_table import OPS
from .ops import GRAPHCORE

__all__ = ["DEPARTURES", "REFUSED", "markdown"]

#: "domain.Op" -> how PopART's arithmetic departs from ONNX / autodiff (its source file).
DEPARTURES: dict[str, str] = {
    "ai.graphcore.Nll": "loss -log(max(p, 1e-7)), gradient -1/max(p, 1e-10); float16 eps "
                        "6.104e-5 (popx/op/nllx.cpp). After a Softmax over the last axis the "
                        "gradient goes to the logits as p - onehot (the default pattern "
                        "NlllWithSoftmaxGradDirect), unless the probabilities' gradient is "
                        "anchored.",
    "ai.onnx.Resize": "output size floor(in x scale) in float32; nearest mode 'pytorch' "
                      "(opset 10's default); cubic a = -0.75 always; ResizeGrad is not the "
                      "chain rule (nearest: floor(i / scale) scatter-add; linear: refused in "
                      "training) (op/resize.cpp, popx/op/resizex.cpp).",
    "ai.onnx.Upsample": "runs as Resize in nearest 'pytorch' mode (UpsampleToResize pattern).",
    "ai.onnx.LSTM": "forward direction only; no clip, peepholes, input_forget or activation "
                    "alpha/beta (op/lstm.cpp); PopART's gate order and weight layout inside.",
    "ai.onnx.GRU": "no bidirectional or custom activations (op/gru.cpp); 'backward' keeps Y in "
                   "processing order.",
    "ai.onnx.RNN": "forward direction only, one activation (op/rnn.cpp).",
    "ai.onnx.Dropout": "masks from the session's seed (setRandomSeed), the same mask in the "
                       "gradient; the identity in an InferenceSession (popx/op/dropoutx.cpp). "
                       "Not Poplar's generator: same distribution, other numbers.",
    "ai.onnx.Loop": "the trip count must be a compile-time value; no gradient (PopART's LoopOp "
                    "has no grad op).",
    "ai.onnx.Scan": "scan outputs concatenated on their axis as PopART's ScanOp lays them; no "
                    "gradient.",
    "ai.graphcore.Round": "rounds halves away from zero.",
    "ai.graphcore.ReduceMedian": "the lower middle value for even counts; (values, int32 "
                                 "indices) (op/reducemedian.cpp).",
    "ai.graphcore.Ctc": "PopART's gradient exp(lp) - posterior, scaled by the reduction; "
                        "zeroInfinity zeroes impossible alignments (op/ctc.cpp).",
    "ai.graphcore.BatchNormalization": "saved and running variance n/(n-1)(var + eps) - eps; "
                                       "PopART's own gradient formula.",
    "ai.graphcore.GroupNormalization": "outputs y, mean and inverse std dev; the statistics "
                                       "pass no gradient back.",
    "ai.graphcore.ScatterReduce": "PopART's own gradients for max/min/mul (custom_vjp).",
    "ai.graphcore.SequenceSlice": "no gradient (PopART has no grad op).",
    "ai.graphcore.Gelu": "popnn's GELU (tanh approximation); GeluErf is the erf form.",
    "ai.graphcore.MultiConv": "each convolution as Conv; inDilations/outPads other than the "
                              "defaults refused (PopART's op ignores them).",
}

#: Operators the table holds only to refuse them, with the reason.
REFUSED: dict[str, str] = {
    "ai.graphcore.CopyVarUpdate": "writes a weight from inside the graph, which a compiled "
                                  "step cannot do.",
    "ai.graphcore.Abort": "stops the program from inside the graph; a compiled step cannot.",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The operators reference, ``docs/operators.md``."""
    newest = onnx.defs.onnx_opset_version()
    onnx_ops: dict[str, list[int]] = {}
    for schema in defs.get_all_schemas_with_history():
        if schema.domain in ("", "ai.onnx") and not schema.deprecated:
            onnx_ops.setdefault(schema.name, []).append(schema.since_version)
    lines = ["# Operators", "",
             "Every ai.onnx operator (opsets up to "
             f"{newest}) and every ai.graphcore operator of PopART's Builder: whether the xla "
             "backend lowers it, and where PopART's arithmetic departs from the ONNX formula or "
             "from autodiff (the backend follows PopART). Operators it does not lower are "
             "refused before anything compiles, naming the node. Generated from "
             "`popart_kit/_runtime/xla/operator_docs.py` "
             "(`python -m popart_kit._runtime.xla.operator_docs > docs/operators.md`).", "",
             "## ai.onnx", "", "| operator | versions | xla backend | PopART's departures |",
             "|---|---|---|---|"]
    for name in sorted(onnx_ops):
        key = f"ai.onnx.{name}"
        status = "lowers" if ("", name) in OPS else "refused"
        versions = ", ".join(map(str, sorted(set(onnx_ops[name]))))
        lines.append(f"| {name} | {versions} | {status} | {_cell(DEPARTURES.get(key, ''))} |")
    lines += ["", "## ai.graphcore", "",
              "| Builder method | operator | xla backend | PopART's departures |",
              "|---|---|---|---|"]
    methods = {m: e.op_type for m, e in GRAPHCORE_OPS.items()}
    methods |= {"l1loss": "L1", "nllloss": "Nll", "identityloss": "IdentityLoss",
                "gelu": "Gelu", "call": "Call"}
    for method, op_type in sorted(methods.items()):
        key = f"ai.graphcore.{op_type}"
        if key in REFUSED:
            status, note = "refused", REFUSED[key]
        else:
            status = "lowers" if (GRAPHCORE, op_type) in OPS else "refused"
            note = DEPARTURES.get(key, "")
        lines.append(f"| {method} | {op_type} | {status} | {_cell(note)} |")
    lines.append("| packedDataBlock | PackedDataBlock | refused | unpacks sequences for a "
                 "callback graph the xla backend does not reproduce. |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
