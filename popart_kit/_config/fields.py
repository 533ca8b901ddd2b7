"""The fields of a PopART session's description: SessionConfig's sections and values.

Every model is immutable and rejects unknown keys. A section checks its own fields; the rules
over the whole session, and everything derived from it, sit in the layers above and take these
models as arguments. Counts are bounded (:data:`MAX_COUNT`), so every check costs the same
whatever the numbers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .._base import names as _names
from .._base.problems import Problem, raise_errors
from ..errors import InvalidConfig, short
from . import catalog
from .unknown_keys import split_unknown

__all__ = ["MAX_COUNT", "SessionFields", "Replication", "Accumulation", "Pipeline", "Device",
           "Precision", "Profiling", "read_popdist_with"]


# The largest count a field accepts: PopART passes batches, factors and IPU counts as 32-bit
# ints, and bounded numbers keep every check's cost independent of their magnitude.
MAX_COUNT = 2**31 - 1


def _bounded(value: int) -> int:
    if value > MAX_COUNT:
        raise PydanticCustomError(
            "popart_kit.K-count-range",
            "{value} is above {limit} (2**31 - 1): PopART takes counts as 32-bit ints, and no "
            "session has that many. Fix: use a number up to {limit}.",
            {"value": _shortint(value), "limit": MAX_COUNT})
    return value


def _shortint(value: int) -> str:
    return short(value)


PositiveInt = Annotated[int, Field(ge=1), AfterValidator(_bounded)]
NonNegativeInt = Annotated[int, Field(ge=0), AfterValidator(_bounded)]


class _Model(BaseModel):
    """A pydantic model whose refusals are :class:`~popart_kit.errors.InvalidConfig`, and whose
    unknown keys are reported with every other problem, each with a "did you mean"."""

    _ACCEPTED_ALIASES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, /, **data: Any) -> None:
        data, unknown = _split(type(self), data)
        try:
            super().__init__(**data)
        except ValidationError as err:
            _refuse(type(self), unknown, err)
        _refuse(type(self), unknown)

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Any:
        obj, unknown = _split(cls, obj)
        try:
            out = super().model_validate(obj, *args, **kwargs)
        except ValidationError as err:
            _refuse(cls, unknown, err)
        _refuse(cls, unknown)
        return out

    @classmethod
    def model_validate_json(cls, json_data: Any, *args: Any, **kwargs: Any) -> Any:
        return cls.model_validate(json.loads(json_data), *args, **kwargs)

    @classmethod
    def model_validate_strings(cls, obj: Any, *args: Any, **kwargs: Any) -> Any:
        obj, unknown = _split(cls, obj)
        try:
            out = super().model_validate_strings(obj, *args, **kwargs)
        except ValidationError as err:
            _refuse(cls, unknown, err)
        _refuse(cls, unknown)
        return out


def _split(cls: type[BaseModel], data: Any) -> tuple[Any, list[Problem]]:
    """``data`` without its unknown keys (nested sections too), and those keys as problems."""
    if not isinstance(data, Mapping) or cls.model_config.get("extra") != "forbid":
        return data, []
    return split_unknown(cls, data)


def _refuse(cls: type[BaseModel], unknown: list[Problem],
            err: ValidationError | None = None) -> None:
    """Raise the unknown keys with pydantic's other errors; with neither, do nothing."""
    if err is None:
        raise_errors(cls.__name__, unknown, error=InvalidConfig)
        return
    if unknown:
        raise_errors(err.title, unknown, also=err, error=InvalidConfig)
    raise InvalidConfig.wrap(err) from None


class _Section(_Model):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


# True while a SessionConfig validates its sections: a section's own rules are then reported by
# the config together with every other rule, instead of hiding them.
_INSIDE_SESSION_CONFIG: ContextVar[bool] = ContextVar("inside_session_config", default=False)


def _multiples(step: int, last: int, limit: int = 6) -> str:
    """``0, step, 2·step, …, last`` with at most ``limit`` numbers shown (closed form)."""
    count = last // step + 1
    shown = [i * step for i in range(min(count, limit - 1 if count > limit else count))]
    return ", ".join(map(str, shown)) + (f", …, {last}" if count > limit else "")


class Replication(_Section):
    """Local replicas of this instance and, when distributed, all replicas over all instances."""

    local_factor: PositiveInt = Field(
        1, description="Replicas run by this instance (PopART replicatedGraphCount).")
    global_factor: PositiveInt | None = Field(
        None, description="Replicas over all instances, including this one's "
                          "(PopART globalReplicationFactor); None: not distributed.")
    global_offset: NonNegativeInt = Field(
        0, description="Global id of this instance's first replica (PopART globalReplicaOffset).")

    @model_validator(mode="before")
    @classmethod
    def _one_instance_is_not_distributed(cls, data: Any) -> Any:
        # global_factor == local_factor describes a single instance: store it as "not distributed"
        # so that a config and its PopART options map one to one.
        if isinstance(data, Mapping):
            local = data.get("local_factor", 1)
            if data.get("global_factor") == local and not data.get("global_offset"):
                data = {k: v for k, v in data.items() if k != "global_factor"}
        return data

    @model_validator(mode="after")
    def _check(self) -> Replication:
        if not _INSIDE_SESSION_CONFIG.get():
            raise_errors("Replication", self.problems())
        return self

    def problems(self) -> list[Problem]:
        """Violations of the replication rules (locations relative to this section)."""
        local, glob, offset = self.local_factor, self.global_factor, self.global_offset
        involved = {"replication.local_factor": local, "replication.global_factor": glob,
                    "replication.global_offset": offset}
        out: list[Problem] = []

        def add(loc: str, message: str, fix: str, rule: str) -> None:
            out.append(Problem(loc, message, fix, rule, involved=involved))

        if glob is None:
            if offset:
                add("global_offset",
                    f"global_offset={offset} is set but global_factor is not: an offset only "
                    f"exists when replicas are spread over several instances.",
                    "set global_factor to the number of replicas over all instances, "
                    "or remove global_offset.", "K-replication-offset-without-global")
            return out
        if glob < local:
            add("global_factor",
                f"global_factor={glob} is smaller than local_factor={local}; the global factor "
                f"counts every replica of every instance, this instance's included.",
                f"set global_factor to a multiple of {local} that is at least {local} "
                f"(e.g. {2 * local}), or lower local_factor.", "K-replication-global-below-local")
        elif glob % local:
            lower, upper = glob // local * local, (glob // local + 1) * local
            add("global_factor",
                f"global_factor={glob} is not a multiple of local_factor={local}: every instance "
                f"runs the same number of replicas, so the total must be instances × {local}.",
                f"use global_factor={lower} or {upper}, or a local_factor that divides {glob}.",
                "K-replication-global-multiple")
        if offset % local:
            last = (max(glob, local) - 1) // local * local
            add("global_offset",
                f"global_offset={offset} is not a multiple of local_factor={local}: instance i "
                f"starts at replica i × {local}.",
                f"use one of {_multiples(local, last)}.", "K-replication-offset-multiple")
        elif glob >= local and offset + local > glob:
            last = (glob - local) // local * local
            add("global_offset",
                f"global_offset={offset} + local_factor={local} = {offset + local} exceeds "
                f"global_factor={glob}: this instance would run replicas "
                f"{offset}..{offset + local - 1} but only 0..{glob - 1} exist.",
                f"use an offset from 0 to {last} in steps of {local}.",
                "K-replication-offset-range")
        return out

    @property
    def is_distributed(self) -> bool:
        """True when replicas are spread over several instances (global_factor > local_factor)."""
        return self.global_factor is not None

    @property
    def global_replicas(self) -> int:
        return self.global_factor if self.global_factor is not None else self.local_factor

    @property
    def instances(self) -> int:
        return self.global_replicas // self.local_factor

    @property
    def instance_index(self) -> int:
        return self.global_offset // self.local_factor

    @property
    def replica_ids(self) -> range:
        """Global ids of the replicas this instance runs."""
        return range(self.global_offset, self.global_offset + self.local_factor)

    @classmethod
    def from_popdist_env(cls, env: Mapping[str, str] | None = None) -> Replication:
        """The replication poprun gave this process (reads ``os.environ`` when ``env`` is None;
        see :class:`popart_kit.PopdistEnv`)."""
        return _POPDIST_READER[0](env)


class Accumulation(_Section):
    """Gradient accumulation: micro-batches per weight update and how gradients are reduced."""

    factor: PositiveInt = Field(
        1, description="Micro-batches per weight update (accumulationFactor).")
    reduction: _names.choice(_names.REDUCTION) = Field(
        "sum", description="Reduction over accumulation steps and replicas "
                           "(accumulationAndReplicationReductionType); PopART's default is sum.")
    mean_strategy: _names.choice(_names.MEAN_STRATEGY) = Field(
        "post", description="With mean reduction: divide once at the end (post) or keep a "
                            "running mean (running).")


class Pipeline(_Section):
    """Pipelined execution over the IPUs of a replica."""

    enabled: bool = Field(False, description="PopART enablePipelining.")
    stages: PositiveInt | None = Field(
        None, description="Forward pipeline stages; None: read them from the model's annotations.")
    recomputation: _names.choice(_names.RECOMPUTATION) = Field(
        "none", description="PopART autoRecomputation.")


class Device(_Section):
    """Which device is acquired and how (DeviceManager arguments)."""

    target: _names.choice(_names.TARGET) = Field(
        "ipu", description="ipu (hardware), ipu_model, cpu, or offline (compile only).")
    sync_pattern: _names.choice(_names.SYNC_PATTERN) = "full"
    connection: _names.choice(_names.CONNECTION) = "always"
    selection: _names.choice(_names.SELECTION) = "first"
    tiles_per_ipu: NonNegativeInt = Field(0, description="0: any (hardware default).")
    round_to_power_of_two: bool = Field(
        False, description="Request the next power of two IPUs when the model needs another count.")


class Precision(_Section):
    partials_type: _names.choice(_names.PARTIALS) | None = Field(
        None, description="Matmul and convolution partials type; None: PopART's default.")
    stochastic_rounding: bool = False


class Profiling(_Section):
    auto_report_dir: str | None = Field(
        None, description="Write Poplar auto-reports here (engineOptions autoReport.*).")
    cycle_counter: bool = Field(False, description="instrumentWithHardwareCycleCounter.")


_MERGED_MAPS = ("engineOptions", "convolutionOptions")


class SessionFields(_Model):
    """The fields of a whole PopART session - mode, batching, topology, device and extra PopART
    options - and the spellings they accept; :class:`~popart_kit.SessionConfig` adds the rules
    they must satisfy and what is derived from them."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True,
                              json_schema_extra=lambda schema: _document_aliases(schema))

    mode: Literal["training", "inference"]
    batches_per_step: PositiveInt = Field(
        1, description="PopART DataFlow batchesPerStep; also accepted as device_iterations.")
    micro_batch_size: PositiveInt | None = Field(
        None, description="Samples per micro-batch, for batch arithmetic.")
    ipus_per_replica: PositiveInt = 1
    virtual_graph_mode: _names.choice(_names.VIRTUAL_GRAPH_MODE) | None = Field(
        None, description="None (default): manual when ipus_per_replica > 1, else off.",
        validate_default=True)
    replication: Replication = Replication()
    accumulation: Accumulation = Accumulation()
    pipeline: Pipeline = Pipeline()
    device: Device = Device()
    precision: Precision = Precision()
    profiling: Profiling = Profiling()
    popart_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other popart.SessionOptions attribute, by its PopART name.")

    _warnings: tuple[Problem, ...] = PrivateAttr(default=())
    _ACCEPTED_ALIASES: ClassVar[tuple[str, ...]] = ("device_iterations",)

    @model_validator(mode="before")
    @classmethod
    def _resolve_aliases_and_defaults(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if "device_iterations" in data:
            if "batches_per_step" in data:
                raise ValueError(
                    f"device_iterations={data['device_iterations']!r} and batches_per_step="
                    f"{data['batches_per_step']!r} are both given but name the same thing. "
                    f"Fix: keep one of them.")
            data["batches_per_step"] = data.pop("device_iterations")
        options = data.get("popart_options")
        if isinstance(options, Mapping):
            # The kit merges into these maps; an empty one is the same as none.
            data["popart_options"] = {k: _canonical_option(k, v) for k, v in options.items()
                                      if not (k in _MERGED_MAPS and v == {})}
        if data.get("virtual_graph_mode") is None:
            ipus = data.get("ipus_per_replica", 1)
            if isinstance(ipus, int):
                data["virtual_graph_mode"] = _default_vgm(ipus)
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _sections_report_here(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        token = _INSIDE_SESSION_CONFIG.set(True)
        try:
            return handler(data)
        except ValidationError as err:
            # Other fields failed, so the config's rules did not run; the replication rules
            # need only their own section, so report them as well.
            section = data.get("replication") if isinstance(data, Mapping) else None
            if section is None or any(e["loc"][:1] == ("replication",) for e in err.errors()):
                raise
            rep = Replication.model_validate(section)  # fields are valid; rules do not raise
            extra = [dataclasses.replace(p, loc=f"replication.{p.loc}") for p in rep.problems()]
            raise_errors(cls.__name__, extra, also=err)
            raise
        finally:
            _INSIDE_SESSION_CONFIG.reset(token)

    # -- derived ----------------------------------------------------------------------------

    @property
    def warnings(self) -> tuple[str, ...]:
        """What PopART would silently do that is rarely wanted, one line each."""
        return tuple(str(p) for p in self._warnings)

    @property
    def is_training(self) -> bool:
        return self.mode == "training"

    def updated(self, **changes: Any) -> Any:
        """A validated copy with top-level fields replaced (sections as models or dicts)."""
        data = self.model_dump(exclude_none=True)
        if "ipus_per_replica" in changes and self.virtual_graph_mode == _default_vgm(
                self.ipus_per_replica) and "virtual_graph_mode" not in changes:
            data.pop("virtual_graph_mode")  # it was derived: derive it again
        data.update({k: v.model_dump(exclude_none=True) if isinstance(v, BaseModel) else v
                     for k, v in changes.items()})
        return type(self).model_validate(data)

def _document_aliases(schema: dict[str, Any]) -> None:
    """Accepted spellings the model normalises before validation, so the schema allows them."""
    schema["properties"]["device_iterations"] = {
        **schema["properties"]["batches_per_step"],
        "description": "Alias of batches_per_step (PopTorch's and Lightning's name)."}


def _canonical_option(name: str, value: Any) -> Any:
    """Sets are order-free: hold them sorted and without repeats, as PopART reads them back."""
    if catalog.OPTIONS.get(name, "").startswith("set[") and isinstance(value, list) and all(
            isinstance(v, str) for v in value):
        return sorted(set(value))
    return value


def _default_vgm(ipus_per_replica: int) -> str:
    return "manual" if ipus_per_replica > 1 else "off"


def _popdist_not_loaded(env: Mapping[str, str] | None) -> Replication:
    raise RuntimeError("popart_kit._config.popdist is not loaded; import popart_kit (or "
                       "popart_kit._config.popdist) before Replication.from_popdist_env.")


# Replication.from_popdist_env's reader: popart_kit._config.popdist, a layer above, reads poprun's
# variables into a Replication and installs itself here (read_popdist_with) when it loads.
_POPDIST_READER: list[Callable[[Mapping[str, str] | None], Replication]] = [_popdist_not_loaded]


def read_popdist_with(reader: Callable[[Mapping[str, str] | None], Replication]) -> None:
    """Make ``reader`` the one :meth:`Replication.from_popdist_env` calls."""
    _POPDIST_READER[0] = reader
