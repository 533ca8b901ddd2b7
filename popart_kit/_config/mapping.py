"""SessionConfig <-> PopART: SessionOptions values, the device request, and the inverse."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._base import names as _names
from ..errors import ConfigError, short
from . import catalog

if TYPE_CHECKING:
    from .fields import SessionFields

__all__ = ["to_popart_dict", "device_request", "to_session_options", "from_session_options",
           "import_popart"]

_AUTO_REPORT_ALL, _AUTO_REPORT_DIR = "autoReport.all", "autoReport.directory"


def to_popart_dict(cfg: SessionFields) -> dict[str, Any]:
    rep, acc, prec = cfg.replication, cfg.accumulation, cfg.precision
    engine = dict(cfg.popart_options.get("engineOptions", {}))
    if cfg.profiling.auto_report_dir is not None:
        engine |= {_AUTO_REPORT_ALL: "true", _AUTO_REPORT_DIR: cfg.profiling.auto_report_dir}
    convolution = dict(cfg.popart_options.get("convolutionOptions", {}))
    if prec.partials_type is not None:
        convolution["partialsType"] = prec.partials_type
    controlled = {
        "virtualGraphMode": _names.VIRTUAL_GRAPH_MODE[cfg.virtual_graph_mode],
        "enablePipelining": cfg.pipeline.enabled,
        "autoRecomputation": _names.RECOMPUTATION[cfg.pipeline.recomputation],
        "enableGradientAccumulation": acc.factor > 1,
        "accumulationFactor": acc.factor,
        "accumulationAndReplicationReductionType": _names.REDUCTION[acc.reduction],
        "meanAccumulationAndReplicationReductionStrategy": _names.MEAN_STRATEGY[acc.mean_strategy],
        "enableReplicatedGraphs": rep.local_factor > 1,
        "replicatedGraphCount": rep.local_factor,
        "enableDistributedReplicatedGraphs": rep.is_distributed,
        "globalReplicationFactor": rep.global_factor if rep.is_distributed else 1,
        "globalReplicaOffset": rep.global_offset,
        "partialsTypeMatMuls": prec.partials_type or "",
        "enableStochasticRounding": prec.stochastic_rounding,
        "instrumentWithHardwareCycleCounter": cfg.profiling.cycle_counter,
        "engineOptions": engine,
        "convolutionOptions": convolution,
    }
    assert controlled.keys() >= catalog.CONTROLLED_OPTIONS.keys()
    extra = {k: v for k, v in cfg.popart_options.items() if k not in controlled}
    return controlled | extra


def device_request(cfg: SessionFields) -> dict[str, Any]:
    if cfg.device.target != "ipu":
        raise ConfigError(
            f"device.target={cfg.device.target!r}: only IPU hardware is acquired with "
            f"acquireAvailableDevice (ipu_model: createIpuModelDevice, cpu: createCpuDevice, "
            f"offline: createOfflineIPUDevice). Fix: set device.target='ipu' to request hardware.")
    return {
        "numIpus": cfg.plan().ipus_to_request,
        "tilesPerIpu": cfg.device.tiles_per_ipu,
        "pattern": _names.SYNC_PATTERN[cfg.device.sync_pattern],
        "connectionType": _names.CONNECTION[cfg.device.connection],
        "selectionCriterion": _names.SELECTION[cfg.device.selection],
    }


def import_popart() -> Any:
    """Graphcore's popart module from the Poplar SDK, with a clear error where it is missing."""
    try:
        popart = importlib.import_module("popart")
    except ImportError as err:
        raise ImportError(
            "Graphcore's popart module is not importable: it ships only inside the Poplar SDK "
            "(enable it with the SDK's enable.sh). The xla backend of popart_kit needs no SDK."
        ) from err
    if getattr(popart, "IS_POPART_KIT", False):
        raise ImportError(
            "the module named popart is popart_kit.popart (PopART's API on popart_kit's xla "
            "runtime, aliased by popart-kit run), not the Poplar SDK's PopART.")
    if not hasattr(popart, "SessionOptions"):
        raise ImportError(
            f"the module named popart at {getattr(popart, '__file__', '?')} is not Graphcore's "
            f"PopART (it has no SessionOptions); the PyPI package called popart is unrelated. "
            f"Uninstall it and enable the Poplar SDK.")
    return popart


def to_session_options(cfg: SessionFields, popart: Any = None) -> Any:
    popart = import_popart() if popart is None else popart
    opts = popart.SessionOptions()
    for name, value in to_popart_dict(cfg).items():
        catalog.assign(opts, popart, name, value)
    return opts


# -- the inverse --------------------------------------------------------------------------------


def _reader(opts: Any) -> tuple[Any, list[str]]:
    """A getter over a SessionOptions or a mapping, and the names it carries beyond defaults."""
    if isinstance(opts, Mapping):
        unknown = [k for k in opts if k not in catalog.OPTIONS]
        if unknown:
            raise ConfigError(f"from_session_options: {short(unknown)} are not SessionOptions "
                              f"attributes.", rule="K-option-unknown")
        return (lambda name: catalog.plain(name, opts.get(name, catalog.DEFAULTS.get(name))),
                list(opts))
    get = lambda name: catalog.plain(name, getattr(opts, name))  # noqa: E731
    changed = [n for n in catalog.OPTIONS if n not in catalog.CONTROLLED_OPTIONS
               and catalog.readable(opts, n) and get(n) != catalog.DEFAULTS.get(n)]
    return get, changed


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        elif hasattr(value, "model_dump"):
            out[key] = _merge(out.get(key, {}), value.model_dump(exclude_none=True))
        else:
            out[key] = value
    return out


def from_session_options(cls: type[SessionFields], opts: Any,
                         rest: Mapping[str, Any]) -> SessionFields:
    get, names = _reader(opts)
    problems, popart = [], []  # popart: PopART's messages, where it has them
    if not get("enableGradientAccumulation") and get("accumulationFactor") > 1:
        problems.append(f"enableGradientAccumulation is false but accumulationFactor="
                        f"{get('accumulationFactor')} (PopART rejects this, V19)")
        popart.append("enableGradientAccumulation is false, but accumulationFactor > 1. Either "
                      "enable gradient accumulation, or set the accumulation factor to 1")
    if not get("enableReplicatedGraphs") and get("replicatedGraphCount") > 1:
        problems.append(f"enableReplicatedGraphs is false but replicatedGraphCount="
                        f"{get('replicatedGraphCount')} (PopART rejects this, V21)")
    conv = dict(get("convolutionOptions"))
    matmul_partials = get("partialsTypeMatMuls").lower() or None
    conv_partials = conv.pop("partialsType", None)
    conv_partials = conv_partials.lower() if conv_partials else None
    if matmul_partials and conv_partials and matmul_partials != conv_partials:
        problems.append(f"partialsTypeMatMuls={matmul_partials!r} differs from convolutionOptions"
                        f"['partialsType']={conv_partials!r}; precision.partials_type sets both")
    local = get("replicatedGraphCount") if get("enableReplicatedGraphs") else 1
    distributed = get("enableDistributedReplicatedGraphs")
    engine = dict(get("engineOptions"))
    report_all = engine.pop(_AUTO_REPORT_ALL, "false").lower() == "true"
    report_dir = engine.pop(_AUTO_REPORT_DIR, "." if report_all else None)
    if report_dir is not None and not report_all:
        problems.append(f"engineOptions sets autoReport.directory={report_dir!r} without "
                        f"autoReport.all='true'; profiling.auto_report_dir sets both")
    accumulation = get("accumulationFactor") if get("enableGradientAccumulation") else 1
    if get("accumulationAndReplicationReductionType") not in _names.REDUCTION.values():
        problems.append(f"accumulationAndReplicationReductionType="
                        f"{get('accumulationAndReplicationReductionType')!r} leaves gradients "
                        f"unreduced; popart_kit supports Sum and Mean (as PopTorch does)")
    if problems:
        err = ConfigError("from_session_options: " + "; ".join(problems)
                          + ". Fix: make the options consistent first.")
        if len(popart) == len(problems):  # sessionoptions.cpp:257 getAccumulationFactor
            err.popart_text = "\n".join(popart)
        raise err
    data: dict[str, Any] = {
        "virtual_graph_mode": _names.kit_name(_names.VIRTUAL_GRAPH_MODE, get("virtualGraphMode")),
        "pipeline": {"enabled": get("enablePipelining"),
                     "recomputation": _names.kit_name(_names.RECOMPUTATION,
                                                      get("autoRecomputation"))},
        "accumulation": {
            "factor": accumulation,
            "reduction": _names.kit_name(_names.REDUCTION,
                                         get("accumulationAndReplicationReductionType")),
            "mean_strategy": _names.kit_name(
                _names.MEAN_STRATEGY, get("meanAccumulationAndReplicationReductionStrategy")),
        },
        "replication": {"local_factor": local,
                        "global_factor": get("globalReplicationFactor") if distributed else None,
                        "global_offset": get("globalReplicaOffset") if distributed else 0},
        "precision": {"partials_type": matmul_partials or conv_partials,
                      "stochastic_rounding": get("enableStochasticRounding")},
        "profiling": {"auto_report_dir": report_dir,
                      "cycle_counter": get("instrumentWithHardwareCycleCounter")},
    }
    if data["accumulation"]["mean_strategy"] == "post":
        del data["accumulation"]["mean_strategy"]  # PopART always holds one; record a change only
    extra = {}
    for name in names:
        if name in catalog.CONTROLLED_OPTIONS:
            continue
        value = {"engineOptions": engine, "convolutionOptions": conv}.get(name)
        if value is None:
            extra[name] = get(name)
        elif value:
            extra[name] = value
    data["popart_options"] = extra
    data = _merge(data, rest)
    return cls.model_validate(_drop_none(data))


def _drop_none(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _drop_none(v) if isinstance(v, dict) and k != "popart_options" else v
            for k, v in data.items() if v is not None}


assert set(k for k, _ in catalog.CONTROLLED_MAP_KEYS) <= {"engineOptions", "convolutionOptions"}
