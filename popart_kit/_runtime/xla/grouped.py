"""Grouped weights on the xla backend (PopART's VariableSettings, :mod:`...._model.variables`).

A weight of G > 1 groups is kept as one array ``[G, *shape]`` in the session state (its
optimizer state follows: every optimizer state of a weight is shaped like it). The model is
lowered with the weight's replica shape (:func:`replica_model`), and each replica computes
with its group's row (:func:`replica_rows`, a gather by the replica's global index). The
gradient of the gather is each group's sum over its own replicas, so the all-reduce over
replicas that every weight gets leaves each group with its own replicas' gradients only -
PopART's ReplicatedAllReduce within the weight's ReplicaGrouping (optimizerdecompose.cpp
gradReduce). Mean reduction divides as PopART does: by A x the global replica count with the
Post strategy (the optimizer's replicatedGraphCount is the global replication factor,
optimizer.cpp), by A x the group size with Running (a Mean all-reduce inside the group).

Refused before compiling, naming the weight and its grouping: pipelining (stages are lowered
with the model's weights), several instances (each instance would need its replicas' groups),
LAMB (its norms would be over every group's values at once) and gradient clipping (PopART
computes each replica's norm from its own group's values).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
import onnx
from jax import lax
from onnx import numpy_helper

from ..._base.shapes import StepShape
from ..._model.tensors import to_array
from ..._model.variables import WeightGrouping, weight_groupings
from ...errors import ConfigError, ModelError, PopartException

__all__ = ["groupings_for", "check_grouped_weights", "replica_model", "full_values",
           "replica_rows", "group_divisors", "optimizer_problems"]

RULE = "K-variable-settings"


def groupings_for(model: onnx.ModelProto, config: Any) -> dict[str, WeightGrouping]:
    """The model's weights of more than one group in this session, or a refusal (a grouping
    that does not divide the replicas, an initializer without the group dimension, or a
    combination the xla backend cannot run)."""
    shape = StepShape.of(config)
    try:
        found = weight_groupings(model, shape.global_replicas)
    except PopartException as err:
        raise ModelError(str(err), rule=RULE) from None
    if not found:
        return found
    first = next(iter(found.values())).describe()
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    if config.pipeline.enabled:
        raise ConfigError(f"{first}{more} has one value per group of replicas, which the xla "
                          f"backend does not run pipelined (its stages are lowered with one "
                          f"value per weight). Fix: turn pipelining off, or make the weight "
                          f"ungrouped (no VariableSettings).", rule=RULE)
    if shape.instances > 1:
        raise ConfigError(f"{first}{more} has one value per group of replicas, which the xla "
                          f"backend does not run over several instances ({shape.instances}). "
                          f"Fix: run the {shape.global_replicas} replicas in one instance, or "
                          f"make the weight ungrouped.", rule=RULE)
    return found


def check_grouped_weights(groupings: Mapping[str, WeightGrouping], graph: Any) -> None:
    """Refuse a grouped weight the lowering folded into a compile-time value (it feeds a
    shape, starts or pads input, which cannot differ between replicas)."""
    folded = [n for n in groupings if n in graph.constants]
    if folded:
        raise ModelError(f"{groupings[folded[0]].describe()} feeds an input that must be known "
                         f"before running (a shape, starts, pads ...), which cannot take one "
                         f"value per group of replicas. Fix: make it ungrouped.", rule=RULE)


def full_values(model: onnx.ModelProto, groupings: Mapping[str, WeightGrouping]
                ) -> dict[str, np.ndarray]:
    """The grouped weights' initial values, [groups, *shape] each."""
    return {init.name: to_array(init) for init in model.graph.initializer
            if init.name in groupings}


def replica_model(model: onnx.ModelProto, groupings: Mapping[str, WeightGrouping]
                  ) -> onnx.ModelProto:
    """``model`` with each grouped weight's initializer (and graph input) of its replica shape
    - group 0's value - as the lowering and shape inference see it, without the value_info
    the Builder inferred from the grouped shape; ``model`` itself unchanged."""
    if not groupings:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name in groupings:
            init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(to_array(init)[0]),
                                                  init.name))
    del out.graph.value_info[:]  # shapes the Builder inferred from the [groups, ...] values
    for value in out.graph.input:
        if value.name in groupings and value.type.tensor_type.HasField("shape"):
            dims = value.type.tensor_type.shape.dim
            if len(dims) == len(groupings[value.name].shape) + 1:
                del dims[0]
    return out


def replica_rows(weights: Mapping[str, Any], groupings: Mapping[str, WeightGrouping],
                 per_device: int, axes: tuple[str, ...] | None) -> dict[str, Any]:
    """Inside a program: each grouped weight's rows for this device's ``per_device``
    replicas, [per_device, *shape] (``axes``: the mesh axes when replicas span devices, whose
    index gives the device's first replica; None on one device)."""
    if not groupings:
        return {}
    out = {}
    for name, grouping in groupings.items():
        table = np.asarray(grouping.group_of, np.int32)
        if axes is None:
            rows: Any = table[:per_device]
        else:
            start = lax.axis_index(axes) * per_device
            rows = lax.dynamic_slice_in_dim(jnp.asarray(table), start, per_device)
        out[name] = jnp.take(jnp.asarray(weights[name]), rows, axis=0)
    return out


def group_divisors(groupings: Mapping[str, WeightGrouping], config: Any) -> dict[str, int]:
    """{weight: divisor} where a grouped weight's Mean reduction divides otherwise than a
    plain weight's: with the Running strategy, by A x its group size."""
    if config.accumulation.reduction != "mean" or config.accumulation.mean_strategy == "post":
        return {}
    accumulation = StepShape.of(config).accumulation
    return {name: accumulation * g.group_size for name, g in groupings.items()}


def optimizer_problems(groupings: Mapping[str, WeightGrouping], trained: list[str],
                       optimizer: Any) -> list[str]:
    """Why ``optimizer`` cannot train the grouped weights among ``trained`` (empty: it can)."""
    grouped = [n for n in trained if n in groupings]
    if not grouped:
        return []
    first = groupings[grouped[0]].describe()
    out = []
    if getattr(optimizer, "is_lamb", False):
        out.append(f"{first} has one value per group of replicas: LAMB's weight and update "
                   f"norms would be taken over every group's values at once, where PopART "
                   f"takes each replica's. Fix: use Adam or AdamNoBias, or make the weight "
                   f"ungrouped.")
    for names, _ in getattr(optimizer, "clip_norm", ()) or ():
        clipped = grouped if names is None else [n for n in grouped if n in names]
        if clipped:
            out.append(f"{groupings[clipped[0]].describe()} has one value per group of "
                       f"replicas and is in a gradient clipping group: PopART takes each "
                       f"replica's norm from its own group's values, which the xla backend "
                       f"does not. Fix: leave it out of ClipNormSettings, or make it "
                       f"ungrouped.")
            break
    return out
