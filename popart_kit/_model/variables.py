"""Grouped variables (PopART's VariableSettings): which replicas share one value of a weight.

A weight made with ``Builder.addInitializedInputTensor(data, variableSettings)`` has one value
per *group* of replicas: the replicas of a group compute with the same value and train it with
their own gradients, summed inside the group. How replicas are grouped is a
:class:`ReplicaGrouping` of the session's replicas (numReplicas, stride, groupSize: group ``g``
holds ``stride`` apart replicas, PopART's replicagrouping.cpp), made from a CommGroup:

* ``All``: one group of every replica (a plain weight);
* ``Consecutive`` of size k: ``{0 .. k-1}, {k .. 2k-1}, ...`` (stride 1);
* ``Orthogonal`` of size k: with m = replicas / k groups, ``{0, m, 2m ..}, {1, m+1 ..}, ...``
  (stride m);
* ``Ungrouped``: each replica alone.

The model records it as PopART's Builder does (builder_impl.cpp, read back by ir.cpp), so it
survives getModelProto and a model saved to a file: the initializer holds ``[groups, *shape]``
when there is more than one group (the data as given), and three ``metadata_props`` entries
name the grouping - ``__comm_group_type/<id>`` (CommGroupType as an int), ``__comm_group_size/
<id>`` and ``__variable_settings/<id>`` (the VariableRetrievalMode as an int).

This module is the arithmetic, PopART's checks (their messages are PopART's) and the model
records; it imports no JAX. ``popart.VariableSettings`` (:mod:`popart_kit.popart._variables`)
is :class:`VariableSettings` with PopART's enums.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from ..errors import PopartException

__all__ = ["ReplicaGrouping", "VariableSettings", "WeightGrouping", "GROUP_TYPES",
           "RETRIEVAL_MODES", "COMM_GROUP_TYPE_KEY", "COMM_GROUP_SIZE_KEY", "RETRIEVAL_MODE_KEY",
           "record_settings", "weight_groupings"]

#: CommGroupType's members in their C++ order (commgroup.hpp; Python names Ungrouped "None").
GROUP_TYPES = ("All", "Consecutive", "Orthogonal", "Ungrouped")
ALL, CONSECUTIVE, ORTHOGONAL, UNGROUPED = range(4)
#: VariableRetrievalMode's members in their C++ order (variablesettings.hpp).
RETRIEVAL_MODES = ("OnePerGroup", "AllReduceReplicas", "AllReplicas")
ONE_PER_GROUP, ALL_REDUCE_REPLICAS, ALL_REPLICAS = range(3)

#: metadata_props key prefixes (willow/include/popart/names.hpp, sCommGroupType ... + "/")
COMM_GROUP_TYPE_KEY = "__comm_group_type/"
COMM_GROUP_SIZE_KEY = "__comm_group_size/"
RETRIEVAL_MODE_KEY = "__variable_settings/"


def _check(failed: bool, expression: str, message: str, lhs: Any, opposite: str,
           rhs: Any) -> None:
    """PopART's POPART_CHECK_*: a popart_exception with its message when ``failed``."""
    if failed:
        raise PopartException(f"Check {expression} has failed. {message} [{lhs} {opposite} "
                              f"{rhs}]")


def _unsigned(value: Any, name: str) -> int:
    """An unsigned int argument as pybind11 takes it (TypeError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise TypeError(f"{name} must be a non-negative int (C++ unsigned), got {value!r}.")
    return int(value)


class ReplicaGrouping:
    """PopART's ReplicaGrouping(numReplicas, stride=1, groupSize=numReplicas): ``numReplicas``
    split into groups of ``groupSize`` replicas ``stride`` apart. Refuses a zero argument and
    a replica count not divisible by stride x groupSize (PopART's checks)."""

    def __init__(self, numReplicas: int, stride: int | None = None,
                 groupSize: int | None = None) -> None:
        replicas = _unsigned(numReplicas, "numReplicas")
        stride = 1 if stride is None else _unsigned(stride, "stride")
        size = replicas if groupSize is None else _unsigned(groupSize, "groupSize")
        _check(replicas == 0, "numReplicas != 0", "The number of replicas in a "
               "`popart::ReplicaGrouping` must be a positive integer.", replicas, "==", 0)
        _check(stride == 0, "stride != 0", "The stride in a `popart::ReplicaGrouping` must be "
               "a positive integer.", stride, "==", 0)
        _check(size == 0, "groupSize != 0", "The group size in a `popart::ReplicaGrouping` "
               "must be a positive integer.", size, "==", 0)
        _check(replicas % (stride * size) != 0, "numReplicas % (stride * groupSize) == 0",
               "The number of replicas in a `popart::ReplicaGrouping` must be divisible by "
               "the product of the stride and the group size.",
               replicas % (stride * size), "!=", 0)
        self._replicas, self._stride, self._size = replicas, 1 if size == 1 else stride, size

    def getNumReplicas(self) -> int:
        return self._replicas

    def getStride(self) -> int:
        return self._stride

    def getGroupSize(self) -> int:
        return self._size

    def getNumGroups(self) -> int:
        return self._replicas // self._size

    def _valid(self, value: int, limit: int, what: str) -> None:
        _check(not value < limit, f"{what} < {limit}", f"The requested {what} is outside the "
               f"valid range for '{self.str()}'.", value, ">=", limit)

    def getGroupAt(self, replica: int) -> int:
        """The group replica ``replica`` is in."""
        self._valid(replica, self._replicas, "replica index")
        return replica % self._stride + self._stride * (replica // (self._stride * self._size))

    def getIndexInGroupAt(self, replica: int) -> int:
        """``replica``'s position in its group."""
        self._valid(replica, self._replicas, "replica index")
        return (replica - self.getReplicaAt(self.getGroupAt(replica))) // self._stride

    def getReplicaAt(self, group: int, index: int = 0) -> int:
        """Member ``index`` of ``group``."""
        self._valid(group, self.getNumGroups(), "group index")
        self._valid(index, self._size, "index")
        first = (group // self._stride) * (self._stride * self._size) + group % self._stride
        return first + index * self._stride

    def getReplicasAt(self, group: int) -> list[int]:
        """The members of ``group``, in order."""
        first = self.getReplicaAt(group)
        return [first + i * self._stride for i in range(self._size)]

    def getTranspose(self) -> ReplicaGrouping:
        """The grouping whose groups take one member of each of these groups."""
        if self._stride == 1:
            return ReplicaGrouping(self._replicas, self._size, self.getNumGroups())
        if self._size * self._stride == self._replicas:
            return ReplicaGrouping(self._replicas, 1, self._stride)
        raise PopartException(f"The transpose of '{self.str()}' cannot be represented as a "
                              f"`popart::ReplicaGrouping`.")

    def groups(self) -> np.ndarray:
        """[replicas] int32: the group of each replica."""
        return np.array([self.getGroupAt(r) for r in range(self._replicas)], np.int32)

    def str(self) -> str:  # noqa: A003 - PopART's name
        return (f"ReplicaGrouping(numReplicas={self._replicas}, stride={self._stride}, "
                f"groupSize={self._size})")

    __repr__ = str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplicaGrouping) and (
            self._replicas, self._stride, self._size) == (
            other._replicas, other._stride, other._size)

    def __hash__(self) -> int:
        return hash((self._replicas, self._stride, self._size))


def comm_group_grouping(kind: int, size: int, replicas: int) -> ReplicaGrouping:
    """CommGroup(kind, size).toReplicaGrouping(replicas) (commgroup.cpp)."""
    if kind == ALL:
        return ReplicaGrouping(replicas, 1, replicas)
    if kind == CONSECUTIVE:
        return ReplicaGrouping(replicas, 1, size)
    if kind == ORTHOGONAL:
        _check(size == 0, "replicaGroupSize != 0", "An Orthogonal CommGroup needs a group "
               "size.", size, "==", 0)
        return ReplicaGrouping(replicas, replicas // size, size)
    if kind == UNGROUPED:
        return ReplicaGrouping(replicas, 1, 1)
    raise PopartException(f"Invalid type '{kind}' for a CommGroup.")


class VariableSettings:
    """The grouping of a weight's values over replicas and how the host reads them back
    (PopART's VariableSettings, variablesettings.cpp), on plain ints: ``kind`` a CommGroupType
    (0 All .. 3 Ungrouped) with its replica group ``size``, or a ``stride`` and ``size``
    (``use_comm_group`` False); ``mode`` a VariableRetrievalMode (0 OnePerGroup, 1
    AllReduceReplicas, 2 AllReplicas). Refuses what PopART's ``verify`` refuses."""

    def __init__(self, kind: int = ALL, size: int = 0, mode: int = ONE_PER_GROUP, *,
                 stride: int | None = None) -> None:
        self._comm = stride is None
        self._kind, self._size, self._mode = int(kind), int(size), int(mode)
        self._stride = 0 if stride is None else int(stride)
        self.verify()

    def verify(self) -> None:
        """PopART's checks: a known CommGroupType with a group size >= 1 for Consecutive and
        Orthogonal, a stride and group size > 0, a known retrieval mode."""
        errors = 0
        if self._comm:
            errors += not 0 <= self._kind < len(GROUP_TYPES)
            errors += self._kind in (CONSECUTIVE, ORTHOGONAL) and self._size < 1
        else:
            _check(self._stride == 0, "stride != 0", "The stride in a `popart::"
                   "VariableSettings` must be a positive integer.", self._stride, "==", 0)
            _check(self._size == 0, "groupSize != 0", "The group size in a `popart::"
                   "VariableSettings` must be a positive integer.", self._size, "==", 0)
            if self._size == 1:
                self._stride = 1
        errors += not 0 <= self._mode < len(RETRIEVAL_MODES)
        if errors:
            raise PopartException(f"VariableSettings had {errors} errors!")

    # -- what it was made of ---------------------------------------------------------------

    def isUsingCommGroup(self) -> bool:
        return self._comm

    def comm_group(self) -> tuple[int, int]:
        """(CommGroupType, replica group size); refused for a stride-made one (PopART's
        getSharedVariableDomain)."""
        if not self._comm:
            raise PopartException("The variable settings were not initialised using a "
                                  "`popart::CommGroup` instance.")
        return self._kind, self._size

    def getStride(self) -> int:
        return self._stride

    def getGroupSize(self) -> int:
        return self._size

    @property
    def mode(self) -> int:
        return self._mode

    # -- the arithmetic --------------------------------------------------------------------

    def getReplicaGrouping(self, numReplicas: int) -> ReplicaGrouping:
        if self._comm:
            return comm_group_grouping(self._kind, self._size, numReplicas)
        return ReplicaGrouping(numReplicas, self._stride, self._size)

    def getGroupCount(self, replicaCount: int) -> int:
        """How many values the weight has (PopART: replicas / size, not checked to divide)."""
        if not self._comm:
            return self.getReplicaGrouping(replicaCount).getNumGroups()
        if self._kind == UNGROUPED or self._size == 1:
            return replicaCount
        if self._kind == ALL:
            return 1
        return replicaCount // self._size

    def numReplicasReturningVariable(self, replicaCount: int) -> int:
        """How many values the host reads back: one per group, or every replica's."""
        if self._mode == ALL_REPLICAS:
            return replicaCount if self._comm else \
                self.getReplicaGrouping(replicaCount).getNumReplicas()
        return self.getGroupCount(replicaCount)

    def getRealGroupSize(self, replicaCount: int) -> int:
        if not self._comm:
            return self.getReplicaGrouping(replicaCount).getGroupSize()
        return {ALL: replicaCount, UNGROUPED: 1}.get(self._kind, self._size)

    def getStrideOf(self, replicaCount: int) -> int:
        """The stride between the members of a group (PopART's getStride(replicaCount))."""
        if not self._comm:
            return self.getReplicaGrouping(replicaCount).getStride()
        return replicaCount // self._size if self._kind == ORTHOGONAL else 1

    def getGroupRepresentative(self, group: int) -> int:
        """The first (lowest) replica of ``group``."""
        if not self._comm:
            replicas = self._size * self._stride * (group + 1)
            return self.getReplicaGrouping(replicas).getReplicaAt(group)
        if self._kind == ALL:
            return 0
        if self._kind == CONSECUTIVE:
            return self._size * group
        return group

    def groups(self, replicaCount: int) -> list[list[int]]:
        """The members of each group."""
        if not self._comm:
            grouping = self.getReplicaGrouping(replicaCount)
            return [grouping.getReplicasAt(g) for g in range(grouping.getNumGroups())]
        if self._kind == ALL:
            return [list(range(replicaCount))]
        if self._kind == UNGROUPED:
            return [[r] for r in range(replicaCount)]
        step, size = self.getStrideOf(replicaCount), self.getRealGroupSize(replicaCount)
        return [[self.getGroupRepresentative(g) + i * step for i in range(size)]
                for g in range(self.getGroupCount(replicaCount))]

    def shapeOnReplica(self, full_shape: list[int], replicaCount: int,
                       name: str) -> list[int]:
        """A host shape without its leading group dimension (refused unless it is the group
        count)."""
        groups = self.getGroupCount(replicaCount)
        if groups == 1:
            return list(full_shape)
        if not full_shape or full_shape[0] != groups:
            raise PopartException(
                f"Return mismatch with possibly appended outer dimension "
                f"({full_shape[0] if full_shape else 'none'}) of Tensor: \"{name}\". should "
                f"match numGroups: {groups}")
        return list(full_shape[1:])

    def shapeOnHost(self, replica_shape: list[int], replicaCount: int) -> list[int]:
        """A replica's shape with the group count in front (when there is more than one)."""
        groups = self.getGroupCount(replicaCount)
        return list(replica_shape) if groups == 1 else [groups, *replica_shape]

    def key(self) -> tuple[Any, ...]:
        return (self._comm, self._kind if self._comm else self._stride, self._size, self._mode)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VariableSettings) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        made = (f"commGroupType={GROUP_TYPES[self._kind] if 0 <= self._kind < 4 else self._kind}"
                if self._comm else f"stride={self._stride}")
        return (f"VariableSettings({made}, groupSize={self._size}, "
                f"retrievalMode={RETRIEVAL_MODES[self._mode]})")


def record_settings(metadata: dict[str, str], tensor_id: str, settings: VariableSettings
                    ) -> None:
    """Write ``settings`` of weight ``tensor_id`` into a model's metadata_props, as PopART's
    Builder does (a stride-made one is refused: PopART records a CommGroup)."""
    kind, size = settings.comm_group()
    metadata[COMM_GROUP_TYPE_KEY + tensor_id] = str(kind)
    metadata[COMM_GROUP_SIZE_KEY + tensor_id] = str(size)
    metadata[RETRIEVAL_MODE_KEY + tensor_id] = str(settings.mode)


@dataclass(frozen=True)
class WeightGrouping:
    """A grouped weight in a session of ``replicas`` (global) replicas: its settings, its
    value's shape on a replica (``shape``) and ``groups`` x that on the host; ``group_of``:
    each global replica's group."""

    name: str
    settings: VariableSettings
    replicas: int
    shape: tuple[int, ...]
    groups: int
    group_of: tuple[int, ...]

    @property
    def mode(self) -> int:
        return self.settings.mode

    @property
    def group_size(self) -> int:
        return self.replicas // self.groups

    def describe(self) -> str:
        kind, size = self.settings.comm_group()
        return (f"weight {self.name!r} (CommGroup({GROUP_TYPES[kind]}, {size}): {self.groups} "
                f"groups of {self.group_size} of {self.replicas} replicas)")

    def host_shape(self) -> tuple[int, ...]:
        """What the host reads back: [groups, *shape] (OnePerGroup) or [replicas, *shape]
        (AllReplicas)."""
        lead = self.replicas if self.mode == ALL_REPLICAS else self.groups
        return (lead, *self.shape)

    def to_host(self, value: np.ndarray) -> np.ndarray:
        """The weight's [groups, *shape] values as the retrieval mode returns them."""
        value = np.asarray(value)
        if self.mode == ALL_REPLICAS:
            return value[np.asarray(self.group_of)]
        return value

    def from_host(self, value: np.ndarray) -> np.ndarray:
        """Host values in the retrieval mode's shape as [groups, *shape]: with AllReplicas,
        each group takes its first replica's row (the row PopART returns for the group)."""
        value = np.asarray(value)
        if self.mode != ALL_REPLICAS:
            return value.reshape((self.groups, *self.shape))
        rows = value.reshape((self.replicas, *self.shape))
        first = [self.group_of.index(g) for g in range(self.groups)]
        return rows[first]


def settings_in(model: onnx.ModelProto) -> dict[str, VariableSettings]:
    """{initializer: VariableSettings} of the weights whose grouping the model records."""
    props = {p.key: p.value for p in model.metadata_props}
    out = {}
    for init in model.graph.initializer:
        kind = props.get(COMM_GROUP_TYPE_KEY + init.name)
        if kind is None:
            continue
        size = props.get(COMM_GROUP_SIZE_KEY + init.name, "0")
        mode = props.get(RETRIEVAL_MODE_KEY + init.name, "0")
        try:
            out[init.name] = VariableSettings(int(kind), int(size), int(mode))
        except ValueError as err:
            raise PopartException(f"weight {init.name!r}: the model's grouping metadata "
                                  f"({COMM_GROUP_TYPE_KEY}{init.name}={kind!r}, size {size!r}, "
                                  f"mode {mode!r}) is not a VariableSettings: {err}") from None
    return out


def weight_groupings(model: onnx.ModelProto, replicas: int) -> dict[str, WeightGrouping]:
    """The weights that have more than one group in a session of ``replicas`` global replicas
    (a weight of one group is a plain weight: its initializer is its value). Refuses a
    grouping that does not divide the replicas and an initializer whose leading dimension is
    not the group count (PopART's addVarInit check)."""
    shapes: Mapping[str, tuple[int, ...]] = {i.name: tuple(i.dims)
                                             for i in model.graph.initializer}
    out = {}
    for name, settings in settings_in(model).items():
        try:
            grouping = settings.getReplicaGrouping(replicas)
        except PopartException as err:
            kind, size = settings.comm_group()
            raise PopartException(
                f"weight {name!r}: its VariableSettings' CommGroup({GROUP_TYPES[kind]}, "
                f"{size}) does not divide the session's {replicas} replicas into groups: "
                f"{err} Fix: use a group size that divides the replication factor.") from None
        groups = grouping.getNumGroups()
        if groups == 1:
            continue
        full = shapes[name]
        if not full or full[0] != groups:
            raise PopartException(
                f"Incorrect size of tensor {name}. Tensor shape at index 0 "
                f"({full[0] if full else 'none: a scalar'}) should be == group_size = {groups} "
                f"(its VariableSettings make {groups} groups of the session's {replicas} "
                f"replicas). Fix: give addInitializedInputTensor one value per group, "
                f"[{groups}, *shape], or change the grouping or the replication factor.")
        out[name] = WeightGrouping(name, settings, replicas, tuple(full[1:]), groups,
                                   tuple(int(g) for g in grouping.groups()))
    return out
