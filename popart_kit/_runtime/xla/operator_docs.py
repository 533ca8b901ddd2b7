"""``docs/operators.md``: every operator, whether the xla backend lowers it, whether PopART's
implementation of it was read, and where PopART's arithmetic departs from the ONNX formula or
from autodiff (and whether the backend reproduces that).

Generated: ``python -m popart_kit._runtime.xla.operator_docs > docs/operators.md``. The account
is data here: :data:`DEPARTURES` (each departure with the PopART source it was read from, a path
under PopART's ``willow/src/`` with its line, and whether the xla backend implements it) and
:data:`AGREES` (operators read whose arithmetic is the ONNX formula, or PopART's documented one,
with the gradient autodiff gives). :data:`POPART_ONNX` lists the ai.onnx operators PopART
implements (its op registrations, its ONNX-to-ONNX passes and its constant folding).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import defs

from ..._model.graphcore import GRAPHCORE_OPS
from .op_table import OPS
from .ops import GRAPHCORE

__all__ = ["AGREES", "DEPARTURES", "IMPLEMENTED", "POPART_ONNX", "REFUSED", "Departure",
           "markdown"]

#: The status of a departure the xla backend reproduces.
IMPLEMENTED = "implemented"


@dataclass(frozen=True)
class Departure:
    """One way PopART's arithmetic for an operator departs from ONNX or from autodiff.

    ``source``: where in PopART's ``willow/src/`` it was read (file:line). ``status``:
    :data:`IMPLEMENTED` when the xla backend computes the same, else ``"left: <why>"``."""

    what: str
    source: str
    status: str = IMPLEMENTED


def _left(why: str) -> str:
    return f"left: {why}"


#: ai.onnx operators PopART implements: op registrations (willow/src/op/*.cpp), the ONNX-level
#: rewrites of onnxpasses/onnxtoonnx.cpp:34-46 (Acos, Acosh, Asinh, Atanh, Tan, Mod, Gemm,
#: DepthToSpace, SpaceToDepth) and the constants folded on the host (ces/onnxconstexpr.cpp:30).
POPART_ONNX: tuple[str, ...] = (
    "Abs", "Acos", "Acosh", "Add", "And", "ArgMax", "ArgMin", "Asin", "Asinh", "Atan", "Atanh",
    "AveragePool", "BatchNormalization", "Cast", "Ceil", "Clip", "Concat", "Constant",
    "ConstantOfShape", "Conv", "ConvTranspose", "Cos", "Cosh", "CumSum", "DepthToSpace", "Div",
    "Dropout", "Elu", "Equal", "Erf", "Exp", "Expand", "Flatten", "Floor", "GRU", "Gather",
    "Gemm", "GlobalAveragePool", "GlobalMaxPool", "Greater", "HardSigmoid", "Identity", "If",
    "InstanceNormalization", "IsInf", "IsNaN", "LRN", "LSTM", "LeakyRelu", "Less", "Log",
    "LogSoftmax", "Loop", "MatMul", "Max", "MaxPool", "Mean", "Min", "Mod", "Mul", "Neg", "Not",
    "OneHot", "Or", "PRelu", "Pad", "Pow", "RNN", "RandomNormal", "RandomNormalLike",
    "RandomUniform", "RandomUniformLike", "Reciprocal", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum",
    "ReduceSumSquare", "Relu", "Reshape", "Resize", "RoiAlign", "Round", "Scan", "Scatter",
    "ScatterElements", "Selu", "Shape", "Shrink", "Sigmoid", "Sign", "Sin", "Sinh", "Slice",
    "Softmax", "Softplus", "Softsign", "SpaceToDepth", "Split", "Sqrt", "Squeeze", "Sub", "Sum",
    "Tan", "Tanh", "ThresholdedRelu", "Tile", "TopK", "Transpose", "Unsqueeze", "Upsample",
    "Where",
)

_TIES = ("every input equal to the output gets the whole incoming gradient (mask sign(x - out)"
         " + 1); autodiff splits it between ties")
_TRIG = "onnxpasses/nodepatterns/trig.cpp"

#: "domain.Op" -> the ways PopART's arithmetic departs from ONNX / autodiff.
DEPARTURES: dict[str, tuple[Departure, ...]] = {
    # -- ai.onnx ----------------------------------------------------------------------------
    "ai.onnx.Relu": (
        Departure("gradient 0 at x = 0 (popnn RELU input gradient); autodiff of max(x, 0) "
                  "gives 0.5 there", "popx/op/relux.cpp:66"),),
    "ai.onnx.Clip": (
        Departure("float16: both bounds, given or defaulted (float lowest/max), clamped to "
                  "+-65504, so +-inf inputs give +-65504", "popx/op/clipx.cpp:41; "
                  "op/clip.cpp:138"),
        Departure("gradient g (out != min)(out != max): 0 where the output equals a bound "
                  "(autodiff of max/min gives 0.5 there)", "popx/op/clipx.cpp:188")),
    "ai.onnx.Elu": (
        Departure("min(alpha (exp(x) - 1), 0) + max(0, x) (exp - 1, not expm1: 0 for "
                  "|x| below ~6e-8 in float32)", "popx/op/elux.cpp:64",
                  _left("in bfloat16 exp(x) - 1 fails ONNX conformance "
                        "(test_celu_bfloat16_expanded); the backend keeps expm1")),
        Departure("gradient (1 - sign x)/2 alpha exp(x) + (1 + sign x)/2: (1 + alpha)/2 at "
                  "x = 0", "popx/op/elux.cpp:103"),
        Departure("that gradient is NaN where exp(x) overflows (0 * inf: x > 88 in float32, "
                  "x > 11 in float16)", "popx/op/elux.cpp:105",
                  _left("a NaN no program wants; the backend gives 1 there"))),
    "ai.onnx.Selu": (
        Departure("gamma (min(alpha (exp(x) - 1), 0) + max(0, x)) (exp - 1, not expm1)",
                  "popx/op/selux.cpp:64", _left("as Elu's: expm1 kept")),
        Departure("gradient gamma ((1 - sign x)/2 alpha exp(x) + (1 + sign x)/2): "
                  "gamma (1 + alpha)/2 at x = 0", "popx/op/selux.cpp:107"),
        Departure("that gradient is NaN where exp(x) overflows, as Elu's",
                  "popx/op/selux.cpp:110", _left("the backend gives gamma there"))),
    "ai.onnx.Shrink": (
        Departure("gradient 0.5 (1 + sign(|x| - lambd)): 0.5 at |x| = lambd (autodiff: 0)",
                  "popx/op/shrinkx.cpp:102"),),
    "ai.onnx.Abs": (
        Departure("gradient sign(x) g: 0 at x = 0 (autodiff: g)",
                  "popx/op/absx.cpp:33; patterns/elementwisegradoppattern.cpp:17"),),
    "ai.onnx.Max": (Departure(f"gradient: {_TIES}", "popx/op/maxx.cpp:100"),),
    "ai.onnx.Min": (Departure(f"gradient: {_TIES}", "popx/op/minx.cpp:99"),),
    "ai.onnx.ReduceMax": (
        Departure("gradient: every element equal to the maximum gets the whole incoming "
                  "gradient; autodiff splits it between ties", "popx/op/reducemaxx.cpp:84"),),
    "ai.onnx.ReduceMin": (
        Departure("gradient: every element equal to the minimum gets the whole incoming "
                  "gradient; autodiff splits it between ties", "popx/op/reduceminx.cpp:84"),),
    "ai.onnx.Sinh": (
        Departure("0.5 (exp(x) - 1/exp(x)) (0 for |x| below ~1e-8 in float32), gradient "
                  "0.5 (exp(x) + 1/exp(x)) (inf, not NaN, where exp overflows)",
                  "popx/op/sinhx.cpp:63, 81"),),
    "ai.onnx.Cosh": (
        Departure("(exp(x) + exp(-x)) * 0.5 (CoshOp pattern), differentiated as that",
                  "patterns/coshoppattern.cpp:32"),),
    "ai.onnx.Softplus": (
        Departure("max(x, 0) + log(1 + exp(-|x|)) (log, not log1p: 0 for x below ~-17 in "
                  "float32), gradient sigmoid(x)", "popx/op/softplusx.cpp:49, 80"),),
    "ai.onnx.Tan": (Departure("sin(x) / cos(x), differentiated as that", f"{_TRIG}:13"),),
    "ai.onnx.Acos": (Departure("pi/2 - asin(x)", f"{_TRIG}:63"),),
    "ai.onnx.Asinh": (
        Departure("log(x + sqrt(x^2 + 1)), differentiated as that (-inf for x below ~-1e4 "
                  "in float32, where the sum cancels)", f"{_TRIG}:27"),),
    "ai.onnx.Acosh": (Departure("log(x + sqrt(x^2 - 1)), differentiated as that",
                                f"{_TRIG}:45"),),
    "ai.onnx.Atanh": (Departure("0.5 log((1 + x) / (1 - x)), differentiated as that",
                                f"{_TRIG}:77"),),
    "ai.onnx.Mod": (
        Departure("fmod 1: C's fmod with a gradient for the dividend only (FmodArg0GradOp; "
                  "the divisor gets none)", "onnxpasses/nodepatterns/binary_ops.cpp:39; "
                  "op/fmod.cpp:26"),
        Departure("fmod 0, floats: fmod(fmod(a, b) + b, b) (e.g. Mod(-1e-8, 1) = 0, not "
                  "1 - 1e-8 rounded to 1; NaN for inf operands), divisor gradient g through "
                  "the Add", "onnxpasses/nodepatterns/binary_ops.cpp:18",
                  _left("NaN for inf operands fails ONNX conformance "
                        "(test_mod_float_edge_cases_fmod_0_*); Mod keeps Python's %, "
                        "aiGraphcore.remainder takes PopART's form")),
        Departure("fmod 0, integers: that same form wraps where fmod(a, b) + b overflows",
                  "onnxpasses/nodepatterns/binary_ops.cpp:18",
                  _left("only at the integer type's edge; the backend gives Python's %"))),
    "ai.onnx.Round": (
        Departure("rounds halves away from zero (popops ROUND); ONNX rounds halves to even",
                  "popx/op/roundx.cpp:37; op/round.cpp:55",
                  _left("ONNX conformance (test_round) holds the half-to-even rule; the "
                        "ai.graphcore Round rounds halves away from zero")),),
    "ai.onnx.Pow": (
        Departure("base gradient where(y == 0, 0, g y x^(y-1)) (PowArg0GradOp pattern), "
                  "computed as written at every point", "patterns/powarg0gradoppattern.cpp:22"),
        Departure("exponent gradient g where(x == 0 and y >= 0 and y not NaN, 0, x^y log x): "
                  "-inf at x = 0, y < 0, where autodiff gives NaN",
                  "patterns/powarg1gradoppattern.cpp:20")),

    "ai.onnx.CumSum": (
        Departure("a matrix product with a triangular 0/1 matrix: an inf or NaN anywhere "
                  "along the axis turns every earlier output into NaN (0 * inf); float16 "
                  "sums accumulate as the matmul's partials", "popx/op/cumsumx.cpp:148",
                  _left("reproducing NaN spread from unrelated elements is not wanted by "
                        "any program; finite values agree")),),
    "ai.onnx.Gather": (
        Departure("indices are read as unsigned: negative indices are not wrapped, and "
                  "out-of-range ones read undefined data (zeros with zeroOutOfRangeIndices)",
                  "popx/op/gatherx.cpp:117-122",
                  _left("undefined on the IPU; the backend wraps negative indices as ONNX "
                        "says")),),
    "ai.onnx.MatMul": (
        Departure("float16 products accumulate in the partials type (float by default, "
                  "half with setPartialsType, which the backend reads)",
                  "popx/op/matmulx.cpp:85"),),
    "ai.onnx.Cast": (
        Departure("float -> int and float -> float16 rounding and saturation are "
                  "popops::cast's, in poplibs, outside PopART's source", "popx/op/castx.cpp:28",
                  _left("poplibs' rules are not in the source read; XLA's conversion kept")),),
    "ai.onnx.Resize": (
        Departure("output size floor(in x scale) in float32; nearest mode 'pytorch' "
                  "(opset 10's default); cubic a = -0.75 always; ResizeGrad is not the "
                  "chain rule (nearest: floor(i / scale) scatter-add; linear: refused in "
                  "training)", "op/resize.cpp; popx/op/resizex.cpp:157"),),
    "ai.onnx.Upsample": (
        Departure("runs as Resize in nearest 'pytorch' mode (UpsampleToResize pattern)",
                  "patterns/upsampletoresizepattern.cpp:84"),),
    "ai.onnx.LSTM": (
        Departure("forward direction only; no clip, peepholes, input_forget or activation "
                  "alpha/beta; PopART's gate order and weight layout inside", "op/lstm.cpp"),),
    "ai.onnx.GRU": (
        Departure("no bidirectional or custom activations; 'backward' keeps Y in processing "
                  "order", "op/gru.cpp"),),
    "ai.onnx.RNN": (Departure("forward direction only, one activation", "op/rnn.cpp"),),
    "ai.onnx.Dropout": (
        Departure("masks from the session's seed (setRandomSeed), the same mask in the "
                  "gradient; the identity in an InferenceSession", "popx/op/dropoutx.cpp:65"),
        Departure("Poplar's random generator", "popx/op/dropoutx.cpp:65",
                  _left("same distribution, other numbers: the IPU's generator is hardware"))),
    "ai.onnx.Loop": (
        Departure("the trip count must be a compile-time value; no gradient (PopART's LoopOp "
                  "has no grad op)", "op/loop.cpp"),),
    "ai.onnx.Scan": (
        Departure("scan outputs concatenated on their axis as PopART's ScanOp lays them; no "
                  "gradient", "op/scan.cpp; patterns/scantolooppattern.cpp:433"),),
    # -- ai.graphcore -----------------------------------------------------------------------
    "ai.graphcore.Nll": (
        Departure("loss -log(max(p, 1e-7)), gradient -1/max(p, 1e-10); float16 eps 6.104e-5 "
                  "for both", "popx/op/nllx.cpp:70, 365"),
        Departure("after a Softmax over the last axis the gradient goes to the logits as "
                  "p - onehot (default pattern NlllWithSoftmaxGradDirect), unless the "
                  "probabilities' gradient is anchored",
                  "patterns/nlllwithsoftmaxgraddirect.cpp:101; popx/op/softmaxx.cpp:220"),
        Departure("when that pattern fires (training) the loss is -log(p + 1e-7), in "
                  "float16 too, not -log(max(p, eps))", "popx/op/softmaxx.cpp:261",
                  _left("the lowering does not tell a training step from inference; the two "
                        "differ only for p below ~1e-6"))),
    "ai.graphcore.Gelu": (
        Departure("popnn's GELU: the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + "
                  "0.044715 x^3))) and its derivative; GeluErf is the erf form",
                  "popx/op/gelux.cpp:50, 70"),),
    "ai.graphcore.Fmod": (
        Departure("gradient for the dividend only (FmodArg0GradOp, ones); the divisor gets "
                  "none", "op/fmod.cpp:26; patterns/fmodarg0gradoppattern.cpp:71"),),
    "ai.graphcore.Remainder": (
        Departure("fmod(fmod(a, b) + b, b) for floats, its divisor gradient g through the Add",
                  "onnxpasses/nodepatterns/binary_ops.cpp:18"),),
    "ai.graphcore.Round": (
        Departure("rounds halves away from zero (popops ROUND)", "popx/op/roundx.cpp:37"),),
    "ai.graphcore.ReduceMedian": (
        Departure("the lower middle value for even counts; (values, int32 indices)",
                  "op/reducemedian.cpp"),),
    "ai.graphcore.Ctc": (
        Departure("PopART's gradient exp(lp) - posterior, scaled by the reduction; "
                  "zeroInfinity zeroes impossible alignments", "op/ctc.cpp; "
                  "popx/op/ctcx.cpp:211"),),
    "ai.graphcore.BatchNormalization": (
        Departure("saved and running variance n/(n-1)(var + eps) - eps; PopART's own "
                  "gradient formula", "popx/op/batchnormx.cpp:226, 243"),),
    "ai.graphcore.GroupNormalization": (
        Departure("outputs y, mean and inverse std dev; the statistics pass no gradient back",
                  "popx/op/groupnormx.cpp:53"),),
    "ai.graphcore.ScatterReduce": (
        Departure("PopART's own gradients for max/min/mul (custom_vjp)",
                  "popx/op/scatterreduceutilx.cpp:766, 920"),),
    "ai.graphcore.SequenceSlice": (
        Departure("no gradient (PopART has no grad op)", "op/sequenceslice.cpp"),),
    "ai.graphcore.MultiConv": (
        Departure("each convolution as Conv; inDilations/outPads other than the defaults "
                  "refused (PopART's op ignores them)", "op/multiconv.cpp"),),
    "ai.graphcore.ShapedDropout": (
        Departure("Poplar's random generator", "popx/op/shapeddropoutx.cpp",
                  _left("same distribution, other numbers")),),
}

#: "domain.Op" -> PopART's implementation read, and found to compute the ONNX formula (or
#: PopART's documented one for ai.graphcore) with the gradient autodiff gives.
AGREES: dict[str, str] = {
    "ai.onnx.Add": "popx/op/addx.cpp:54; grads reduce to the input shape",
    "ai.onnx.And": "popx/op/andx.cpp:33",
    "ai.onnx.ArgMax": "popx/op/argextremax.cpp:67 (int32 out, as the Builder types it)",
    "ai.onnx.ArgMin": "popx/op/argextremax.cpp:67",
    "ai.onnx.Asin": "popx/op/asinx.cpp:61; grad 1/sqrt(1 - x^2) (asinx.cpp:76)",
    "ai.onnx.Atan": "popx/op/atanx.cpp:66; grad 1/(1 + x^2) (atanx.cpp:85)",
    "ai.onnx.AveragePool": "popx/op/poolx.cpp:112 (popnn pooling), grad poolx.cpp:151",
    "ai.onnx.BatchNormalization": "popx/op/batchnormx.cpp:183-282 (popnn batchnorm; "
                                  "running mean/var with ONNX's momentum, biased variance: "
                                  "unbiased_variance is ai.graphcore's only, line 218; "
                                  "spatial=0 as X reshaped to [N, C*D1*...*Dn, 1], line 110)",
    "ai.onnx.Ceil": "popx/op/ceilx.cpp:37; zero gradient",
    "ai.onnx.Concat": "popx/op/concatx.cpp (data movement)",
    "ai.onnx.Constant": "ces/onnxconstexpr.cpp:36 (folded on the host)",
    "ai.onnx.ConstantOfShape": "ces/onnxconstexpr.cpp:40 (folded on the host)",
    "ai.onnx.Conv": "popx/op/convx.cpp (poplin convolution; float16 partials as MatMul's); "
                    "bias added by onnxpasses/nodepatterns/conv.cpp",
    "ai.onnx.ConvTranspose": "patterns/convtransposepattern.cpp:115 (as a Conv)",
    "ai.onnx.Cos": "popx/op/cosx.cpp:30; grad -sin(x) g (patterns/cosgradoppattern.cpp:64)",
    "ai.onnx.DepthToSpace": "onnxpasses/nodepatterns/spacedepth.cpp:52 (reshape/transpose)",
    "ai.onnx.Div": "popx/op/divx.cpp:34 (integers truncate, as C); grads "
                   "patterns/divarg0gradoppattern.cpp:41, divarg1gradoppattern.cpp:59",
    "ai.onnx.Equal": "popx/op/equalx.cpp:37",
    "ai.onnx.Erf": "popx/op/erfx.cpp:30; grad 2/sqrt(pi) exp(-x^2) (erfx.cpp:42)",
    "ai.onnx.Exp": "popx/op/expx.cpp:44; grad g exp(x) (patterns/expgradoppattern.cpp:45)",
    "ai.onnx.Expand": "popx/op/expandx.cpp; grad reduce-add (expandx.cpp:175)",
    "ai.onnx.Flatten": "op/reshape.cpp (a reshape)",
    "ai.onnx.Floor": "popx/op/floorx.cpp:37; zero gradient",
    "ai.onnx.Gemm": "onnxpasses/nodepatterns/gemm.cpp:31 (alpha A B + beta C as MatMul, Scale, "
                    "Add)",
    "ai.onnx.GlobalAveragePool": "popx/op/poolx.cpp (popnn pooling over the spatial axes)",
    "ai.onnx.GlobalMaxPool": "popx/op/poolx.cpp (popnn pooling over the spatial axes)",
    "ai.onnx.Greater": "popx/op/greaterx.cpp:35",
    "ai.onnx.HardSigmoid": "popx/op/hardsigmoidx.cpp:62-72; grad alpha theta+ theta- with "
                           "theta = (1 + sign)/2 (hardsigmoidx.cpp:109-127): alpha/2 at a "
                           "bound, as autodiff of clip gives",
    "ai.onnx.Identity": "popx/op/identityx.cpp",
    "ai.onnx.If": "popx/op/ifx.cpp (subgraphs; gradient through the taken branch)",
    "ai.onnx.InstanceNormalization": "popx/op/instancenormx.cpp:57-68 (popnn, 1/sqrt(var + "
                                     "eps))",
    "ai.onnx.IsInf": "popx/op/isinfx.cpp:32",
    "ai.onnx.IsNaN": "popx/op/isnanx.cpp:30",
    "ai.onnx.LRN": "popx/op/lrnx.cpp:77-133 (bias + alpha/size sum x^2, ^-beta; its grad)",
    "ai.onnx.LeakyRelu": "popx/op/leakyrelux.cpp:52; grad 1 at x = 0 (leakyrelux.cpp:109), "
                         "as autodiff of where(x < 0, ...)",
    "ai.onnx.Less": "popx/op/lessx.cpp:33",
    "ai.onnx.Log": "popx/op/logx.cpp:31; grad g/x (patterns/loggradoppattern.cpp:46)",
    "ai.onnx.LogSoftmax": "popx/op/logsoftmaxx.cpp:163-190 (stable softmax; grad g - "
                          "softmax sum g)",
    "ai.onnx.MaxPool": "popx/op/poolx.cpp:112, 151 (popnn pooling and its gradient)",
    "ai.onnx.Mean": "popx/op/meanx.cpp:79; grad g/n (meanx.cpp:112)",
    "ai.onnx.Mul": "popx/op/mulx.cpp:50; grads patterns/mularggradoppattern.cpp:97",
    "ai.onnx.Neg": "popx/op/negatex.cpp:32",
    "ai.onnx.Not": "popx/op/notx.cpp:31",
    "ai.onnx.OneHot": "popx/op/onehotx.cpp:72-88 (encodeOneHot, on/off values)",
    "ai.onnx.Or": "popx/op/orx.cpp:33",
    "ai.onnx.PRelu": "popx/op/prelux.cpp:37 (select(slope x, x, x < 0))",
    "ai.onnx.Pad": "popx/op/padx.cpp:212, 279 (popops pad: constant, edge, reflect)",
    "ai.onnx.RandomNormal": "popx/op/randomnormalx.cpp (Poplar's generator: other numbers)",
    "ai.onnx.RandomNormalLike": "patterns/likeopspattern.cpp:16",
    "ai.onnx.RandomUniform": "popx/op/randomuniformx.cpp (Poplar's generator: other numbers)",
    "ai.onnx.RandomUniformLike": "patterns/likeopspattern.cpp:22",
    "ai.onnx.Reciprocal": "popx/op/reciprocalx.cpp:34; grad -g/x^2 "
                          "(patterns/reciprocalgradoppattern.cpp:68)",
    "ai.onnx.ReduceL1": "popx/op/reducel1x.cpp:81 (grad g sign(x))",
    "ai.onnx.ReduceL2": "popx/op/reducel2x.cpp:82 (grad g x / out)",
    "ai.onnx.ReduceLogSum": "popx/op/reducelogsumx.cpp:44-50",
    "ai.onnx.ReduceLogSumExp": "popx/op/reducelogsumexpx.cpp:64-124 (max-shifted)",
    "ai.onnx.ReduceMean": "popx/op/reducemeanx.cpp:55, 90",
    "ai.onnx.ReduceProd": "popx/op/reduceprodx.cpp:115-135 (leave-one-out products: exact "
                          "at zeros, as autodiff)",
    "ai.onnx.ReduceSum": "popx/op/reducesumx.cpp:40",
    "ai.onnx.ReduceSumSquare": "popx/op/reducesumsquarex.cpp:83 (grad 2 g x)",
    "ai.onnx.Reshape": "popx/op/reshapex.cpp",
    "ai.onnx.RoiAlign": "popx/op/roialignx.cpp",
    "ai.onnx.Scatter": "popx/op/scatterx.cpp:77 (updates larger than the indices: their "
                       "leading block, as torch's scatter_)",
    "ai.onnx.ScatterElements": "popx/op/scatterx.cpp",
    "ai.onnx.Shape": "ces/onnxconstexpr.cpp:30 (folded on the host)",
    "ai.onnx.Sign": "popx/op/signx.cpp:36",
    "ai.onnx.Sigmoid": "popx/op/sigmoidx.cpp:54, 64 (popnn SIGMOID and its gradient "
                       "out (1 - out); the IPU's transcendental, last bits only)",
    "ai.onnx.Sin": "popx/op/sinx.cpp:32; grad cos(x) g (patterns/elementwisegradoppattern.cpp:25)",
    "ai.onnx.Slice": "popx/op/slicex.cpp",
    "ai.onnx.Softmax": "popx/op/softmaxx.cpp:94-100 (SOFTMAX_STABLE unless "
                       "enableNonStableSoftmax), grad softmaxx.cpp:189",
    "ai.onnx.Softsign": "popx/op/softsignx.cpp:47, 74",
    "ai.onnx.SpaceToDepth": "onnxpasses/nodepatterns/spacedepth.cpp:52 (reshape/transpose)",
    "ai.onnx.Split": "popx/op/splitx.cpp",
    "ai.onnx.Sqrt": "popx/op/sqrtx.cpp:30; grad g/(2 sqrt x) (patterns/sqrtgradoppattern.cpp:58)",
    "ai.onnx.Squeeze": "op/reshape.cpp:355 (a reshape)",
    "ai.onnx.Sub": "popx/op/subtractx.cpp:34; grad patterns/subtractarg1gradoppattern.cpp:45",
    "ai.onnx.Sum": "popx/op/sumx.cpp:81",
    "ai.onnx.Tanh": "popx/op/tanhx.cpp:37, 66 (popnn TANH and its gradient 1 - out^2)",
    "ai.onnx.ThresholdedRelu": "popx/op/thresholdedrelux.cpp:59, 87",
    "ai.onnx.Tile": "popx/op/tilex.cpp:74",
    "ai.onnx.TopK": "popx/op/topkx.cpp:141; grad scatters into zeros (topkx.cpp:69)",
    "ai.onnx.Transpose": "popx/op/transposex.cpp",
    "ai.onnx.Unsqueeze": "op/reshape.cpp (a reshape)",
    "ai.onnx.Where": "popx/op/wherex.cpp:186",
    "ai.graphcore.Atan2": "popx/op/atan2x.cpp:47; grads patterns/atan2arg0gradoppattern.cpp:66, "
                          "atan2arg1gradoppattern.cpp:70",
    "ai.graphcore.BitwiseAnd": "popx/op/bitwisex.cpp:61",
    "ai.graphcore.BitwiseNot": "popx/op/bitwisex.cpp:34",
    "ai.graphcore.BitwiseOr": "popx/op/bitwisex.cpp:64",
    "ai.graphcore.BitwiseXnor": "popx/op/bitwisex.cpp:70",
    "ai.graphcore.BitwiseXor": "popx/op/bitwisex.cpp:67",
    "ai.graphcore.Bucketize": "popx/op/bucketizex.cpp:54-117 (torch.bucketize's rule, right)",
    "ai.graphcore.Call": "popx/op/callx.cpp (a subgraph)",
    "ai.graphcore.CtcBeamSearchDecoder": "popx/op/ctcbeamsearchx.cpp",
    "ai.graphcore.DepthToSpace": "onnxpasses/nodepatterns/spacedepth.cpp:52",
    "ai.graphcore.Detach": "popx/op/detachx.cpp",
    "ai.graphcore.DynamicAdd": "popx/op/dynamic/dynamicaddx.cpp",
    "ai.graphcore.DynamicSlice": "popx/op/dynamic/dynamicslicex.cpp:66 (a third input: the "
                                 "slice copied into its shape)",
    "ai.graphcore.DynamicUpdate": "popx/op/dynamic/dynamicupdatex.cpp (the update reshaped "
                                  "to the slice)",
    "ai.graphcore.DynamicZero": "popx/op/dynamic/dynamiczerox.cpp",
    "ai.graphcore.Expm1": "popx/op/expm1x.cpp:45; grad g (out + 1) "
                          "(patterns/expm1gradoppattern.cpp:70)",
    "ai.graphcore.GeluErf": "popx/op/geluerfx.cpp:50, 74 (popnn GELU_ERF)",
    "ai.graphcore.GroupedGather": "popx/op/gatherx.cpp:125",
    "ai.graphcore.IdentityLoss": "popx/op/identityx.cpp:72-82",
    "ai.graphcore.IncrementMod": "popx/op/incrementmodx.cpp:95",
    "ai.graphcore.Init": "popx/op/initx.cpp",
    "ai.graphcore.L1": "popx/op/l1x.cpp:49-129 (lambda |x|, grad lambda sign(x); the "
                       "reduction accumulated in float32 at least)",
    "ai.graphcore.LSTM": "popx/op/popartlstmx.cpp (popnn LSTM, PopART's layout)",
    "ai.graphcore.Log1p": "popx/op/log1px.cpp:45; grad g/(1 + x) "
                          "(patterns/log1pgradoppattern.cpp:66)",
    "ai.graphcore.NearbyInt": "popx/op/nearbyintx.cpp:37 (halves to even)",
    "ai.graphcore.Nop": "popx/op/nopx.cpp",
    "ai.graphcore.NormalizeImage": "popx/op/normalize_imagex.cpp:87",
    "ai.graphcore.PrintTensor": "popx/op/printtensorx.cpp",
    "ai.graphcore.ReplicatedAllReduce": "popx/op/collectives (over the replicas)",
    "ai.graphcore.ReplicatedReduceScatter": "popx/op/collectives (over the replicas)",
    "ai.graphcore.Reshape": "popx/op/reshapex.cpp; op/reshape.cpp:136 (0: the input's "
                            "size, one -1 inferred)",
    "ai.graphcore.Reverse": "popx/op/reversex.cpp",
    "ai.graphcore.Scale": "popx/op/scalex.cpp:43",
    "ai.graphcore.ScaledAdd": "popx/op/scaledaddx.cpp:59-69",
    "ai.graphcore.Slice": "popx/op/slicex.cpp",
    "ai.graphcore.Sort": "popx/op/basesortx.cpp:46",
    "ai.graphcore.SplineBasis": "popx/op/splinebasisx.cpp:37 (popops::splineBasis)",
    "ai.graphcore.SplineWeighting": "popx/op/splineweightingx.cpp:32",
    "ai.graphcore.Subsample": "popx/op/subsamplex.cpp",
    "ai.graphcore.Swish": "popx/op/swishx.cpp:49, 72 (popnn SWISH, x sigmoid(x))",
    "ai.graphcore.TensorRemap": "popx/op/tensorremapx.cpp (a layout change only)",
    "ai.graphcore.CopyVarUpdate": "op/copyvarupdate.cpp; transforms/mainloops.cpp (in a "
                                  "training session the updater is copied over the weight "
                                  "after each micro-batch, as a training BatchNormalization's "
                                  "running statistics are; an inference session refuses it)",
    "ai.graphcore.PackedDataBlock": "op/packeddatablock.cpp; patterns/packeddatablockpattern"
                                    ".cpp (unpack, callback per batch, pack into zeros)",
}

# PopART's Builder writes a Reduce's axes=[] (before axes became an input) and its ReduceOp
# then reduces nothing, where ONNX reduces every axis: each Reduce departs there
for _name in ("L1", "L2", "LogSum", "LogSumExp", "Max", "Mean", "Min", "Prod", "Sum",
              "SumSquare"):
    _key = f"ai.onnx.Reduce{_name}"
    _read_at = AGREES.pop(_key, None)
    DEPARTURES[_key] = (*DEPARTURES.get(_key, ()), Departure(
        "axes=[] (an attribute) reduces nothing: the elementwise part only (ReduceL1: |x|); "
        "ONNX reduces every axis" + (f" (also read: {_read_at})" if _read_at else ""),
        "op/reduce.cpp:41; builder.gen.cpp:4077"))

#: Operators the table holds only to refuse them, with the reason.
REFUSED: dict[str, str] = {
    "ai.graphcore.Abort": "stops the program from inside the graph; a compiled step cannot.",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _read(key: str, popart_has: bool) -> str:
    """The 'PopART' column: whether PopART's implementation was read and what it found."""
    if key in DEPARTURES:
        return "read: departs"
    if key in REFUSED:
        return "read: refused"
    if key in AGREES:
        return "read: as ONNX" if key.startswith("ai.onnx.") else "read: as documented"
    return "unread" if popart_has else "not in PopART"


def _account(key: str) -> str:
    """The departures column: each departure, its source in ``willow/src/`` and its status."""
    if key in DEPARTURES:
        return "; ".join(f"{d.what} ({d.source}; {d.status})" for d in DEPARTURES[key])
    return AGREES.get(key, "")


def markdown() -> str:
    """The operators reference, ``docs/operators.md``."""
    newest = onnx.defs.onnx_opset_version()
    onnx_ops: dict[str, list[int]] = {}
    for schema in defs.get_all_schemas_with_history():
        if schema.domain in ("", "ai.onnx") and not schema.deprecated:
            onnx_ops.setdefault(schema.name, []).append(schema.since_version)
    popart_onnx = set(POPART_ONNX)
    read_onnx = sum(f"ai.onnx.{n}" in DEPARTURES or f"ai.onnx.{n}" in AGREES
                    for n in popart_onnx)
    lines = ["# Operators", "",
             "Every ai.onnx operator (opsets up to "
             f"{newest}) and every ai.graphcore operator of PopART's Builder: whether the xla "
             "backend lowers it, whether PopART's implementation of it was read (op, opx, grad "
             "op and the default patterns, in PopART's `willow/src/`), and where PopART's "
             "arithmetic departs from the ONNX formula or from autodiff, with the source line "
             "and whether the backend reproduces it (it follows PopART where it can). For "
             "operators read that agree the column gives the source read. Operators it does "
             "not lower are refused before anything compiles, naming the node. Generated from "
             "`popart_kit/_runtime/xla/operator_docs.py` "
             "(`python -m popart_kit._runtime.xla.operator_docs > docs/operators.md`).", "",
             f"PopART implements {len(popart_onnx)} ai.onnx operators; {read_onnx} of them "
             "are read here.", "",
             "## ai.onnx", "",
             "| operator | versions | xla backend | PopART | PopART's arithmetic (source; "
             "status) |", "|---|---|---|---|---|"]
    for name in sorted(onnx_ops):
        key = f"ai.onnx.{name}"
        status = "lowers" if ("", name) in OPS else "refused"
        versions = ", ".join(map(str, sorted(set(onnx_ops[name]))))
        lines.append(f"| {name} | {versions} | {status} | {_read(key, name in popart_onnx)} "
                     f"| {_cell(_account(key))} |")
    lines += ["", "## ai.graphcore", "",
              "| Builder method | operator | xla backend | PopART | PopART's arithmetic "
              "(source; status) |", "|---|---|---|---|---|"]
    methods = {m: e.op_type for m, e in GRAPHCORE_OPS.items()}
    methods |= {"l1loss": "L1", "nllloss": "Nll", "identityloss": "IdentityLoss",
                "gelu": "Gelu", "call": "Call"}
    for method, op_type in sorted(methods.items()):
        key = f"ai.graphcore.{op_type}"
        if key in REFUSED:
            status, note = "refused", REFUSED[key]
        else:
            status = "lowers" if (GRAPHCORE, op_type) in OPS else "refused"
            note = _account(key)
        lines.append(f"| {method} | {op_type} | {status} | {_read(key, True)} "
                     f"| {_cell(note)} |")
    key = "ai.graphcore.PackedDataBlock"
    lines.append(f"| packedDataBlock | PackedDataBlock | lowers | {_read(key, True)} "
                 f"| {_cell(_account(key))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
