"""How a step's micro-batches are looped over: in chunks, inside one program or from the host.

A step of M micro-batches runs in chunks of ``c`` (a chunk is evaluated vectorised, so only its
activations are alive at once). The chunks are looped over in one of two ways, chosen by
measurement (``benchmarks/runtime_bench.py``):

* **in the program** (``lax.fori_loop``): one compiled program per run. The default; on GPUs
  and for models XLA runs well inside a loop.
* **from the host**: one call of a compiled chunk program per chunk, its results staying on the
  device between calls. XLA on CPU runs a convolution's gradient inside a loop body through a
  slow path (jax-ml/jax#12868; a 3x3 64-channel layer's gradient over 4 micro-batches: 30-44 s
  in a loop, 0.4-0.5 s from the host), so on CPU a step of several chunks of a model with
  convolutions is driven from the host, where each call costs a few tens of microseconds of
  dispatch instead. The forward pass, lowered channels-last (:mod:`.ops_conv`), is as fast
  inside a loop; inference is driven from the host too, as it measured the same to 10%
  faster at bps 8. A step of one chunk has no loop and is one program either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import onnx
from jax import lax

__all__ = ["vmap", "loop", "loops_on_host", "chunk_bytes", "LOOP_UNFRIENDLY_ON_CPU",
           "LOCAL_REPLICA"]

#: Operators whose gradient XLA:CPU runs many times slower inside a loop body than outside one.
LOOP_UNFRIENDLY_ON_CPU = frozenset({"Conv", "ConvTranspose", "ConvInteger", "QLinearConv",
                                    "DeformConv"})
#: A chunk's activations (all replicas of a device) are kept under this many bytes by default:
#: on CPU about a cache's worth (beyond it, vectorising more micro-batches ran slower), on an
#: accelerator enough to keep it busy.
CHUNK_BYTES = {"cpu": 8 << 20}
ACCELERATOR_CHUNK_BYTES = 1 << 30


def chunk_bytes(platform: str) -> int:
    return CHUNK_BYTES.get(platform, ACCELERATOR_CHUNK_BYTES)


def loops_on_host(model: onnx.ModelProto, platform: str, several_devices: bool,
                  trips: int) -> bool:
    """Whether a step's chunks are driven from the host (see the module docs); ``trips``: how
    many chunks the step evaluates (a step of one has no loop, so it stays one program)."""
    if platform != "cpu" or several_devices or trips == 1:
        return False
    return any(node.op_type in LOOP_UNFRIENDLY_ON_CPU for node in model.graph.node)


def loop(count: int, body: Callable[[Any, Any], Any], carry: Any) -> Any:
    """``body(i, carry)`` for i in 0 .. count - 1 inside a program (no loop for one trip)."""
    if count == 1:
        return body(jnp.int32(0), carry)
    return lax.fori_loop(0, count, body, carry)


#: The axis name of a device's vectorised replicas (bound when it runs more than one): the
#: replicated collectives (ReplicatedAllReduce ...) reduce over it and the mesh's replica axes.
LOCAL_REPLICA = "local_replica"


def vmap(fn: Any, size: int, in_axes: Sequence[int | None], axis_name: str | None = None) -> Any:
    """``jax.vmap`` over a new leading axis of ``size`` in every result (named ``axis_name``),
    except that a size of 1 is squeezed away: XLA on CPU runs a matrix product with a batch
    dimension of 1 markedly slower than the plain one (a training step at bps 16: 1.47x the
    hand-written program with the batch dimension, 1.10x without)."""
    if size != 1:
        return jax.vmap(fn, in_axes=tuple(in_axes), axis_size=size, axis_name=axis_name)

    def call(*args: Any) -> Any:
        squeezed = [arg if axis is None else jax.tree.map(lambda a, ax=axis: jnp.squeeze(a, ax),
                                                            arg)
                    for arg, axis in zip(args, in_axes, strict=True)]
        return jax.tree.map(lambda o: jnp.expand_dims(o, 0), fn(*squeezed))

    return call
