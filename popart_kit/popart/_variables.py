"""popart.VariableSettings: grouped weights, as PopART binds them
(python/popart/popart_core/popart.cpp; the arithmetic is :mod:`popart_kit._model.variables`).
``popart.CommGroup`` / ``popart.CommGroupType`` are the session options' (a VariableSettings
takes any CommGroup). ``getReplicaGrouping`` returns a
:class:`~popart_kit._model.variables.ReplicaGrouping` (PopART's popart._internal.ir one)."""

from __future__ import annotations

from typing import Any

from .._model.variables import VariableSettings as _KitSettings
from ._core import ENUMS
from ._options import STRUCTS

__all__ = ["VariableSettings"]

_FORMS = ("VariableSettings(), VariableSettings(sharedVariableDomain_: CommGroup), "
          "VariableSettings(retrievalMode_: VariableRetrievalMode), "
          "VariableSettings(sharedVariableDomain_, retrievalMode_), "
          "VariableSettings(stride: int, groupSize: int, mode: VariableRetrievalMode)")


def _is_count(value: Any) -> bool:
    return not isinstance(value, bool) and hasattr(value, "__index__") and int(value) >= 0


class VariableSettings(_KitSettings):
    """popart.VariableSettings: how a weight's values are shared between replicas (its
    CommGroup, default All) and read back (its VariableRetrievalMode, default OnePerGroup);
    PopART's constructors (see ``_FORMS``), methods and checks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        comm, mode = ENUMS["CommGroupType"], ENUMS["VariableRetrievalMode"]
        group_cls = STRUCTS["CommGroup"]
        given = dict(zip(_names(args, kwargs), args, strict=False)) | kwargs
        group = given.pop("sharedVariableDomain_", None)
        retrieval = given.pop("retrievalMode_", given.pop("mode", mode.OnePerGroup))
        stride, size = given.pop("stride", None), given.pop("groupSize", None)
        bad = (given or (group is not None and not isinstance(group, group_cls))
               or not isinstance(retrieval, mode)
               or (stride is None) != (size is None) or (stride is not None and group is not None)
               or (stride is not None and not (_is_count(stride) and _is_count(size)))
               or (stride is not None and "mode" not in kwargs and len(args) < 3))
        if bad:
            raise TypeError(f"VariableSettings(): no constructor takes {args!r}, {kwargs!r}. "
                            f"PopART's: {_FORMS}.")
        if stride is not None:
            super().__init__(0, int(size), int(retrieval), stride=int(stride))
            return
        kind = group.type if group is not None else comm.All
        super().__init__(int(kind), int(group.replicaGroupSize) if group is not None else 0,
                         int(retrieval))

    def getSharedVariableDomain(self) -> Any:
        """The CommGroup (refused for one made from a stride and group size)."""
        kind, size = self.comm_group()
        return STRUCTS["CommGroup"](ENUMS["CommGroupType"](kind), size)

    def getCommGroupType(self) -> Any:
        return ENUMS["CommGroupType"](self._kind)

    def getRetrievalMode(self) -> Any:
        return ENUMS["VariableRetrievalMode"](self.mode)


def _names(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The parameter names of the positional ``args`` in the constructor form they fit."""
    if len(args) == 3 or "stride" in kwargs or (args and _is_count(args[0])
                                                 and not hasattr(args[0], "name")):
        return ["stride", "groupSize", "mode"]
    if len(args) == 1 and isinstance(args[0], ENUMS["VariableRetrievalMode"]):
        return ["retrievalMode_"]
    return ["sharedVariableDomain_", "retrievalMode_"]
