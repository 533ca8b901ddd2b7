"""The built-in model family, each built with the kit's Builder and written once more by hand
in JAX (the baseline): an MLP, a convnet and transformer encoder blocks, a classifier over
``CLASSES`` classes. Layers are spread evenly over pipeline stages; the head is on the last."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError, short

__all__ = ["MODELS", "CLASSES", "MAX_MODEL_BYTES", "MAX_LAYERS", "Sizes", "Built", "build",
           "check_size", "load_onnx"]

MODELS = ("mlp", "convnet", "encoder")
CLASSES = 10
#: The most bytes a built-in model may need on the host, counted from its sizes before anything
#: is allocated: float32 weights, one step's inputs and one micro-batch's largest activation (a
#: lower bound: compiling and running take more). The built-in models time the kit; past this
#: they would fail to allocate, or be killed, rather than measure anything.
MAX_MODEL_BYTES = 16 * 2**30
#: The most layers (blocks) of a built-in model: the builder infers every op's shape as it adds
#: it, so deeper models take minutes to build before anything is timed.
MAX_LAYERS = 256


@dataclass(frozen=True)
class Sizes:
    """Model sizes: ``width`` (features, channels or model dimension), ``layers`` (hidden
    layers, conv blocks or encoder blocks), ``seq`` and ``heads`` (encoder), ``image``
    (convnet: image side)."""

    width: int = 256
    layers: int = 2
    seq: int = 32
    heads: int = 4
    image: int = 16


@dataclass
class Built:
    """A model to benchmark: its bytes, the names that matter, and (built-in models) its
    weights and a hand-written JAX forward ``forward(weights, x) -> probabilities``."""

    proto: bytes
    x: str
    output: str
    label: str | None = None
    loss: str | None = None
    weights: list[np.ndarray] = field(default_factory=list)
    forward: Callable[[Any, Any], Any] | None = None


def footprint(model: str, sizes: Sizes, micro_batch: int, micro_batches: int) -> int:
    """Bytes of the built-in ``model``'s float32 weights, ``micro_batches`` micro-batches of
    input and one micro-batch's largest activation, from the sizes alone."""
    d, n = sizes.width, sizes.layers
    if model == "mlp":
        weights, sample, activation = n * d * d, d, d
    elif model == "convnet":
        pixels = sizes.image * sizes.image
        weights, sample, activation = 27 * d + (n - 1) * 9 * d * d, 3 * pixels, d * pixels
    else:  # encoder: the attention scores or the feed-forward layer, whichever is larger
        s = sizes.seq
        weights, sample, activation = 12 * n * d * d, s * d, s * max(4 * d, sizes.heads * s)
    return 4 * (weights + d * CLASSES + micro_batch * (micro_batches * sample + activation))


_USED = {"mlp": ("width", "layers"), "convnet": ("width", "layers", "image"),
         "encoder": ("width", "layers", "seq", "heads")}  # the sizes each model reads


def check_size(model: str, sizes: Sizes, micro_batch: int, micro_batches: int) -> None:
    """Refuse a built-in model of more than :data:`MAX_LAYERS` layers, or needing more than
    :data:`MAX_MODEL_BYTES` (:func:`footprint`); a single number past the byte limit is
    refused as is, so the cost does not grow with the numbers."""
    if model not in MODELS:
        return  # build() refuses it, naming the models
    if sizes.layers > MAX_LAYERS:
        raise ConfigError(f"bench: the {model} has {short(sizes.layers)} layers, more than "
                          f"{MAX_LAYERS} a built-in model may have. Fix: layers {MAX_LAYERS} or "
                          f"fewer.", rule="K-bench-model")
    numbers = {**{k: getattr(sizes, k) for k in _USED[model]}, "micro_batch": micro_batch,
               "micro-batches per step": micro_batches}
    need = next((f"its {key} {short(value)} alone is more than" for key, value in numbers.items()
                 if value > MAX_MODEL_BYTES), None)
    if need is None:
        total = footprint(model, sizes, micro_batch, micro_batches)
        if total <= MAX_MODEL_BYTES:
            return
        need = f"it needs at least {total / 2**30:,.1f} GiB, more than"
    shown = ", ".join(f"{k} {short(v)}" for k, v in numbers.items())
    raise ConfigError(f"bench: the {model} of {shown}: {need} the {MAX_MODEL_BYTES / 2**30:.0f} "
                      f"GiB a built-in model may take (weights, a step's inputs, activations). "
                      f"Fix: a smaller {', '.join(_USED[model])}, micro_batch or "
                      f"batches_per_step.", rule="K-bench-model")


def _stage_of(layer: int, layers: int, stages: int) -> int:
    return layer * stages // layers


def build(model: str, sizes: Sizes, micro_batch: int, stages: int = 1,
          training: bool = False) -> Built:
    """The built-in ``model`` (one of MODELS) for one micro-batch of ``micro_batch`` samples,
    its ``sizes.layers`` layers over ``stages`` pipeline stages, with an NLL loss when
    ``training``."""
    if model not in MODELS:
        raise ConfigError(f"bench: unknown model {model!r}; the built-in models are "
                          f"{', '.join(MODELS)} (or give an ONNX file).", rule="K-bench-model")
    if stages > sizes.layers:
        raise ConfigError(f"bench: {stages} pipeline stages need at least {stages} layers, the "
                          f"{model} has {sizes.layers}. Fix: --layers {stages} or more, or fewer "
                          f"stages.", rule="K-bench-model")
    import popart_kit as pk

    b = pk.Builder()
    pb = pk.PipelineBuilder(b) if stages > 1 else None
    rng = np.random.default_rng(0)
    weights: list[np.ndarray] = []

    def weight(shape: tuple[int, ...], scale: float) -> str:
        w = (rng.standard_normal(shape) * scale).astype(np.float32)
        weights.append(w)
        return b.addInitializedInputTensor(w, f"w{len(weights) - 1}")

    def stage(s: int) -> Any:
        import contextlib

        return pb.stage(s) if pb is not None else contextlib.nullcontext()

    layer_fn = {"mlp": _mlp, "convnet": _convnet, "encoder": _encoder}[model]
    x, h, forward = layer_fn(b, weight, stage, sizes, micro_batch, stages)
    with stage(stages - 1):
        probs = b.aiOnnx.softmax([h], axis=1)
        label = loss = None
        if training:
            label = b.addInputTensor(pk.TensorInfo("INT32", [micro_batch]), debugContext="label")
            loss = b.aiGraphcore.nllloss([probs, label], pk.ReductionType.Mean)
    if not training:
        b.addOutputTensor(probs)

    def probabilities(ws: Any, v: Any) -> Any:
        import jax

        return jax.nn.softmax(forward(ws, v), axis=1)

    return Built(b.getModelProto(), x, probs, label, loss, weights, probabilities)


def _mlp(b, weight, stage, sizes, micro, stages):
    import popart_kit as pk

    d, n = sizes.width, sizes.layers
    with stage(0):
        x = b.addInputTensor(pk.TensorInfo("FLOAT", [micro, d]), debugContext="x")
    h = x
    for i in range(n):
        with stage(_stage_of(i, n, stages)):
            h = b.aiOnnx.relu([b.aiOnnx.matmul([h, weight((d, d), d ** -0.5)])])
    with stage(stages - 1):
        h = b.aiOnnx.matmul([h, weight((d, CLASSES), d ** -0.5)])

    def forward(ws, v):
        import jax.numpy as jnp

        for w in ws[:-1]:
            v = jnp.maximum(v @ w, 0)
        return v @ ws[-1]

    return x, h, forward


def _convnet(b, weight, stage, sizes, micro, stages):
    import popart_kit as pk

    c, n, side = sizes.width, sizes.layers, sizes.image
    with stage(0):
        x = b.addInputTensor(pk.TensorInfo("FLOAT", [micro, 3, side, side]), debugContext="x")
    h, cin = x, 3
    for i in range(n):
        with stage(_stage_of(i, n, stages)):
            k = weight((c, cin, 3, 3), (9 * cin) ** -0.5)
            h = b.aiOnnx.relu([b.aiOnnx.conv([h, k], pads=[1, 1, 1, 1])])
            if i == 0:
                h = b.aiOnnx.maxpool([h], 1, [2, 2], strides=[2, 2])[0]
        cin = c
    with stage(stages - 1):
        h = b.aiOnnx.flatten([b.aiOnnx.globalaveragepool([h])], axis=1)
        h = b.aiOnnx.matmul([h, weight((c, CLASSES), c ** -0.5)])

    def forward(ws, v):
        import jax
        import jax.numpy as jnp

        for i, k in enumerate(ws[:-1]):
            v = jnp.maximum(jax.lax.conv_general_dilated(v, k, (1, 1), ((1, 1), (1, 1))), 0)
            if i == 0:
                v = jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2),
                                          "VALID")
        return v.mean((2, 3)) @ ws[-1]

    return x, h, forward


def _layer_norm(b, h, axis_size):
    mean = b.aiOnnx.reducemean([h], axes=[-1], keepdims=1)
    centred = b.aiOnnx.sub([h, mean])
    var = b.aiOnnx.reducemean([b.aiOnnx.mul([centred, centred])], axes=[-1], keepdims=1)
    eps = b.aiOnnx.constant(np.array(1e-5, np.float32))
    return b.aiOnnx.div([centred, b.aiOnnx.sqrt([b.aiOnnx.add([var, eps])])])


def _encoder(b, weight, stage, sizes, micro, stages):
    import popart_kit as pk

    d, n, s, heads = sizes.width, sizes.layers, sizes.seq, sizes.heads
    if d % heads:
        raise ConfigError(f"bench: the encoder's width {d} is not a multiple of its {heads} "
                          f"heads. Fix: --width a multiple of {heads}, or --heads dividing "
                          f"{d}.", rule="K-bench-model")
    dh = d // heads
    with stage(0):
        x = b.addInputTensor(pk.TensorInfo("FLOAT", [micro, s, d]), debugContext="x")
    h = x
    split = np.array([micro, s, heads, dh], np.int64)
    merge = np.array([micro, s, d], np.int64)
    for i in range(n):
        with stage(_stage_of(i, n, stages)):
            q, k, v = (b.aiOnnx.transpose([b.aiOnnx.reshape([b.aiOnnx.matmul(
                [h, weight((d, d), d ** -0.5)]), b.aiOnnx.constant(split)])], perm=[0, 2, 1, 3])
                for _ in range(3))
            scores = b.aiOnnx.mul([b.aiOnnx.matmul([q, b.aiOnnx.transpose([k], perm=[0, 1, 3, 2])]),
                                   b.aiOnnx.constant(np.array(dh ** -0.5, np.float32))])
            att = b.aiOnnx.matmul([b.aiOnnx.softmax([scores], axis=3), v])
            att = b.aiOnnx.reshape([b.aiOnnx.transpose([att], perm=[0, 2, 1, 3]),
                                    b.aiOnnx.constant(merge)])
            h = _layer_norm(b, b.aiOnnx.add([h, b.aiOnnx.matmul(
                [att, weight((d, d), d ** -0.5)])]), d)
            f = b.aiOnnx.relu([b.aiOnnx.matmul([h, weight((d, 4 * d), d ** -0.5)])])
            h = _layer_norm(b, b.aiOnnx.add([h, b.aiOnnx.matmul(
                [f, weight((4 * d, d), (4 * d) ** -0.5)])]), d)
    with stage(stages - 1):
        h = b.aiOnnx.reducemean([h], axes=[1], keepdims=0)
        h = b.aiOnnx.matmul([h, weight((d, CLASSES), d ** -0.5)])

    def forward(ws, v):
        import jax
        import jax.numpy as jnp

        def norm(t):
            c = t - t.mean(-1, keepdims=True)
            return c / jnp.sqrt((c * c).mean(-1, keepdims=True) + 1e-5)

        for i in range(n):
            wq, wk, wv, wo, w1, w2 = ws[6 * i:6 * i + 6]
            q, k, u = ((v @ w).reshape(-1, s, heads, dh).transpose(0, 2, 1, 3)
                       for w in (wq, wk, wv))
            att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) * dh ** -0.5, axis=3) @ u
            v = norm(v + att.transpose(0, 2, 1, 3).reshape(-1, s, d) @ wo)
            v = norm(v + jnp.maximum(v @ w1, 0) @ w2)
        return v.mean(1) @ ws[-1]

    return x, h, forward


def load_onnx(path: str, training: bool, loss: str | None) -> Built:
    """A given ONNX model: its first graph input is streamed, its first output anchored (no
    hand-written baseline). Training needs the name of its ``loss`` tensor."""
    from .._model.layout import load_model

    model = load_model(path)
    initialised = {i.name for i in model.graph.initializer}
    streamed = [i.name for i in model.graph.input if i.name not in initialised]
    if not streamed or not model.graph.output:
        raise ConfigError(f"bench: {path} has no streamed input or no output to time; a model "
                          f"needs both.", rule="K-bench-model")
    if training and not loss:
        raise ConfigError(f"bench: training {path} needs the name of its loss tensor. Fix: "
                          f"--loss NAME (a scalar output of the model).", rule="K-bench-model")
    return Built(model.SerializeToString(), streamed[0], model.graph.output[0].name,
                 loss=loss if training else None)
