"""The rules a SessionConfig must satisfy, judged from the configuration alone.

Each rule is a small function that yields :class:`Problem` objects; :func:`check_config` runs them
all, so every violation is reported at once. Rule ids ``V<n>`` are checks PopART itself makes
(when it builds the session's IR); ``K-...`` rules are popart_kit's stricter ones. Every rule costs
the same whatever the magnitude of the numbers, and quotes values shortened.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._base.arith import (
    bubble_fraction,
    is_power_of_two,
    next_power_of_two,
    pipeline_depth,
    pipeline_fill_micro_batches,
)
from .._base.names import VIRTUAL_GRAPH_MODE
from .._base.problems import Problem
from .._base.schedule import depth_text
from ..errors import short
from . import catalog

if TYPE_CHECKING:
    from .fields import SessionFields

__all__ = ["check_config", "MAX_IPUS_PER_INSTANCE", "MAX_GLOBAL_IPUS",
           "BUBBLE_WARNING"]

MAX_IPUS_PER_INSTANCE = 64
# Graphcore's IPU-Fabric connects at most 64,000 IPUs in one system (IPU-POD64 building blocks).
MAX_GLOBAL_IPUS = 64_000
BUBBLE_WARNING = 0.30

Rule = Callable[["SessionFields"], Iterator[Problem]]
_RULES: list[Rule] = []


def _rule(fn: Rule) -> Rule:
    _RULES.append(fn)
    return fn


def check_config(cfg: SessionFields) -> list[Problem]:
    """Every problem (errors and warnings) of a config whose fields are individually valid."""
    return [p for rule in _RULES for p in rule(cfg)]


def _error(loc: str, message: str, fix: str, rule: str, *, popart: str = "",
           **involved: Any) -> Problem:
    """An error; ``popart`` is PopART's own message, which popart_kit.popart raises."""
    return Problem(loc, message, fix, rule, "error", {k.replace("__", "."): v
                                                    for k, v in involved.items()}, popart)


def _warning(loc: str, message: str, fix: str, rule: str, **involved: Any) -> Problem:
    return Problem(loc, message, fix, rule, "warning", {k.replace("__", "."): v
                                                      for k, v in involved.items()})


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


@_rule
def _replication(cfg: SessionFields) -> Iterator[Problem]:
    for p in cfg.replication.problems():
        yield dataclasses.replace(p, loc=f"replication.{p.loc}")


# -- virtual graphs and pipelining --------------------------------------------------------------


@_rule
def _pipelining_needs_virtual_graphs(cfg: SessionFields) -> Iterator[Problem]:
    if not cfg.pipeline.enabled:
        return
    # ir.cpp:582 Ir::verifyPipelineSettings, PopART's one message for both
    popart = (f"Pipelining requires more than 1 IPU (currently {cfg.ipus_per_replica}) and the "
              f"'virtualGraphMode' session option to not be VirtualGraphMode::Off (currently "
              f"VirtualGraphMode::{VIRTUAL_GRAPH_MODE.get(cfg.virtual_graph_mode, 'Off')}).")
    if cfg.ipus_per_replica < 2:
        yield _error(
            "ipus_per_replica",
            f"pipelining needs at least 2 IPUs per replica, got ipus_per_replica="
            f"{cfg.ipus_per_replica}.",
            "set ipus_per_replica to the number of IPUs the stages run on (>= 2), "
            "or pipeline.enabled=false.", "V1", popart=popart,
            ipus_per_replica=cfg.ipus_per_replica, pipeline__enabled=True)
    if cfg.virtual_graph_mode == "off" and cfg.ipus_per_replica >= 2:
        yield _error(
            "virtual_graph_mode",
            "pipelining needs virtual graphs, got virtual_graph_mode='off'.",
            "leave virtual_graph_mode unset or set 'manual' (stages annotated on the model) "
            "or 'auto'.", "V2", popart=popart, virtual_graph_mode="off", pipeline__enabled=True)


@_rule
def _virtual_graphs_off_means_one_ipu(cfg: SessionFields) -> Iterator[Problem]:
    if cfg.virtual_graph_mode == "off" and cfg.ipus_per_replica > 1 and not cfg.pipeline.enabled:
        yield _error(
            "virtual_graph_mode",
            f"virtual_graph_mode='off' with ipus_per_replica={cfg.ipus_per_replica}: without "
            f"virtual graphs each replica runs on one IPU, and PopART rejects a "
            f"{cfg.ipus_per_replica}-IPU replica.",
            "set virtual_graph_mode='manual' (ops annotated with IPUs) or 'auto', "
            "or ipus_per_replica=1.", "V23",
            virtual_graph_mode="off", ipus_per_replica=cfg.ipus_per_replica)


@_rule
def _pipeline_depth(cfg: SessionFields) -> Iterator[Problem]:
    acc, bps, stages = cfg.accumulation.factor, cfg.batches_per_step, cfg.pipeline.stages
    if not cfg.is_training and acc > 1:
        yield _error(
            "accumulation.factor",
            f"accumulation.factor={acc} in an inference session: gradient accumulation only "
            f"exists when training.",
            "set accumulation.factor=1 (raise batches_per_step to run more micro-batches per "
            "call), or mode='training'.", "V18", mode=cfg.mode, accumulation__factor=acc)
    if not cfg.pipeline.enabled or stages is None:
        return
    depth = pipeline_depth(stages, cfg.is_training)
    why = (f"{stages} forward stages train as 2×{stages}−1 = {depth} stages"
           if cfg.is_training else f"{stages} stages")
    if cfg.is_training and acc > 1:
        if acc < depth:
            yield _error(
                "accumulation.factor",
                f"accumulation.factor={acc} is below the pipeline depth {depth} ({why}): each "
                f"stage needs a micro-batch between two weight updates.",
                f"set accumulation.factor >= {depth}; the bubble shrinks as it grows "
                f"({_suggest_fill(depth)} keeps it under {_pct(BUBBLE_WARNING)}).", "V6",
                popart=depth_text("gradient accumulation factor", depth),
                accumulation__factor=acc, pipeline__stages=stages, mode=cfg.mode)
    elif bps < depth:
        yield _error(
            "batches_per_step",
            f"batches_per_step={bps} is below the pipeline depth {depth} ({why}): the pipeline "
            f"cannot fill.",
            f"set batches_per_step >= {depth}"
            + (" or use gradient accumulation (accumulation.factor >= "
               f"{depth})." if cfg.is_training else "."), "V7",
            popart=depth_text("batchesPerStep", depth),
            batches_per_step=bps, pipeline__stages=stages, mode=cfg.mode)


def _suggest_fill(depth: int) -> int:
    """Smallest number of micro-batches that keeps the bubble at or below BUBBLE_WARNING."""
    return max(depth, math.ceil((depth - 1) * (1 - BUBBLE_WARNING) / BUBBLE_WARNING))


@_rule
def _pipeline_warnings(cfg: SessionFields) -> Iterator[Problem]:
    pipe, acc = cfg.pipeline, cfg.accumulation.factor
    if not pipe.enabled:
        if pipe.stages is not None:
            yield _warning(
                "pipeline.stages",
                f"pipeline.stages={pipe.stages} but pipelining is off: PopART clears every "
                f"pipeline-stage annotation of the model.",
                "set pipeline.enabled=true, or remove pipeline.stages.", "V3",
                pipeline__stages=pipe.stages, pipeline__enabled=False)
        if pipe.recomputation == "pipeline":
            yield _warning(
                "pipeline.recomputation",
                "recomputation='pipeline' recomputes pipeline stages, but pipelining is off.",
                "enable pipelining or choose another recomputation.", "K-recompute-pipeline",
                pipeline__recomputation="pipeline", pipeline__enabled=False)
        return
    if not cfg.is_training:
        if pipe.recomputation != "none":
            yield _warning(
                "pipeline.recomputation",
                f"recomputation={pipe.recomputation!r} has no effect in inference.",
                "remove it, or use mode='training'.", "K-recompute-inference",
                pipeline__recomputation=pipe.recomputation, mode=cfg.mode)
    elif acc == 1:
        yield _warning(
            "accumulation.factor",
            "pipelined training without gradient accumulation updates weights while other "
            "micro-batches are in flight ('stale weights', Zhang et al. arXiv:1912.12675).",
            "set accumulation.factor >= the pipeline depth so PopART flushes the pipeline before "
            "each update.", "K-stale-weights", accumulation__factor=1, pipeline__enabled=True)
    if pipe.stages is None:
        return
    if pipe.stages == 1:
        yield _warning(
            "pipeline.stages", "a one-stage pipeline has nothing to overlap.",
            "annotate at least two stages or set pipeline.enabled=false.", "K-one-stage",
            pipeline__stages=1)
        return
    depth = pipeline_depth(pipe.stages, cfg.is_training)
    fill = pipeline_fill_micro_batches(cfg.is_training, cfg.batches_per_step, acc)
    if fill < depth:
        return  # an error already
    bubble = bubble_fraction(depth, fill)
    if bubble > BUBBLE_WARNING:
        knob = "accumulation.factor" if cfg.is_training and acc > 1 else "batches_per_step"
        yield _warning(
            "pipeline.stages",
            f"pipeline bubble {_pct(bubble)}: {depth} stages over {fill} micro-batches between "
            f"flushes leave IPUs idle (K−1)/(M+K−1) of the time.",
            f"raise {knob} to {_suggest_fill(depth)} or more for a bubble under "
            f"{_pct(BUBBLE_WARNING)}.", "K-bubble",
            pipeline__stages=pipe.stages, micro_batches_between_flushes=fill)


@_rule
def _mean_strategy_needs_mean(cfg: SessionFields) -> Iterator[Problem]:
    acc = cfg.accumulation
    if acc.reduction == "sum" and acc.mean_strategy != "post":
        yield _warning(
            "accumulation.mean_strategy",
            f"mean_strategy={acc.mean_strategy!r} only applies to reduction='mean', "
            f"got reduction='sum'.",
            "remove mean_strategy, or set reduction='mean'.", "K-mean-strategy",
            accumulation__reduction="sum", accumulation__mean_strategy=acc.mean_strategy)


# -- devices ------------------------------------------------------------------------------------


@_rule
def _host_targets(cfg: SessionFields) -> Iterator[Problem]:
    target, rep = cfg.device.target, cfg.replication
    if target in ("ipu_model", "cpu") and (rep.local_factor > 1 or rep.is_distributed):
        loc = "replication.local_factor" if rep.local_factor > 1 else "replication.global_factor"
        yield _error(
            loc,
            f"target={target!r} cannot run replicated graphs (local_factor={rep.local_factor}, "
            f"global_factor={rep.global_factor}): PopART replicates only on IPU hardware.",
            "use target='ipu' (or 'offline' to compile only), or no replication; popart_kit's "
            "xla backend runs replicas without an IPU.", "K-replication-target",
            device__target=target, replication__local_factor=rep.local_factor,
            replication__global_factor=rep.global_factor)
    if target in ("ipu_model", "cpu") and cfg.device.sync_pattern != "full":
        yield _error(
            "device.sync_pattern",
            f"sync_pattern={cfg.device.sync_pattern!r} on target={target!r}: host devices only "
            f"support the full sync pattern.",
            "use sync_pattern='full', or target='ipu'.", "K-sync-pattern-host",
            device__target=target, device__sync_pattern=cfg.device.sync_pattern)
    if target == "cpu" and cfg.ipus_per_replica > 1:
        yield _error(
            "ipus_per_replica",
            f"target='cpu' is a single device, got ipus_per_replica={cfg.ipus_per_replica}.",
            f"use target='ipu_model' to simulate {cfg.ipus_per_replica} IPUs, or "
            f"ipus_per_replica=1.", "K-cpu-one-ipu",
            device__target="cpu", ipus_per_replica=cfg.ipus_per_replica)
    if target == "ipu" and cfg.device.connection == "never":
        yield _error(
            "device.connection",
            "connection='never' with target='ipu': PopART refuses to acquire a hardware device "
            "that never attaches.",
            "use target='offline' to compile without hardware, or connection='always' or "
            "'on_demand'.", "K-connection-never", device__target="ipu", device__connection="never")


@_rule
def _ipu_count(cfg: SessionFields) -> Iterator[Problem]:
    local, ipus = cfg.replication.local_factor, cfg.ipus_per_replica
    need = local * ipus
    involved = {"replication__local_factor": local, "ipus_per_replica": ipus}
    loc = "replication.local_factor" if local > 1 else "ipus_per_replica"
    request = need
    if cfg.device.target == "ipu" and not is_power_of_two(need):
        request = next_power_of_two(need)
        if not cfg.device.round_to_power_of_two:
            yield _error(
                "device.round_to_power_of_two",
                f"this instance needs local_factor={local} × ipus_per_replica={ipus} = {need} "
                f"IPUs, but IPU hardware is acquired in powers of two.",
                f"set device.round_to_power_of_two=true to request {request} "
                f"({request - need} left idle), or choose factors whose product is a power of "
                f"two.", "K-power-of-two", **involved)
        elif request % local:
            yield _error(
                "replication.local_factor",
                f"rounding {need} IPUs up to {request} with local_factor={local}: PopART splits "
                f"the device evenly over replicas, and {request} is not divisible by {local}.",
                "use a power-of-two local_factor, or an IPU count that needs no rounding.",
                "V22", **involved)
    if ipus > MAX_IPUS_PER_INSTANCE:
        yield _error(
            "ipus_per_replica",
            f"one replica needs ipus_per_replica={ipus} IPUs; one PopART instance drives at most "
            f"{MAX_IPUS_PER_INSTANCE}.", f"split the model over {MAX_IPUS_PER_INSTANCE} or fewer "
            f"IPUs per replica.", "K-max-ipus", ipus_per_replica=ipus)
    elif request > MAX_IPUS_PER_INSTANCE:
        total = cfg.replication.global_replicas
        # a local factor that fits is at most MAX_IPUS_PER_INSTANCE // ipus: a bounded search
        fits = [d for d in range(1, min(total, MAX_IPUS_PER_INSTANCE // ipus) + 1)
                if total % d == 0 and _instance_ipus(cfg, d * ipus) <= MAX_IPUS_PER_INSTANCE]
        rounded = f", {request} after rounding to a power of two" if request != need else ""
        yield _error(
            loc,
            f"this instance needs local_factor={local} × ipus_per_replica={ipus} = {need} IPUs"
            f"{rounded}; one PopART instance drives at most {MAX_IPUS_PER_INSTANCE}.",
            f"spread the {total} replicas over instances: local_factor={fits[-1]} with "
            f"global_factor={total} is {total // fits[-1]} instances (launched with poprun)."
            if fits else "use fewer IPUs per replica.", "K-max-ipus", **involved)


@_rule
def _global_ipu_count(cfg: SessionFields) -> Iterator[Problem]:
    total, ipus = cfg.replication.global_replicas, cfg.ipus_per_replica
    if total * ipus > MAX_GLOBAL_IPUS:
        loc = ("replication.global_factor" if cfg.replication.is_distributed
               else "replication.local_factor")
        yield _error(
            loc,
            f"{total} replicas × ipus_per_replica={ipus} = {total * ipus} IPUs; the largest "
            f"IPU system (IPU-Fabric) connects {MAX_GLOBAL_IPUS}.",
            f"use at most {MAX_GLOBAL_IPUS // ipus} replicas of {ipus} IPUs.",
            "K-max-global-ipus", replication__global_replicas=total, ipus_per_replica=ipus)


def _instance_ipus(cfg: SessionFields, need: int) -> int:
    """IPUs an instance that needs ``need`` would request, or a huge number if it cannot."""
    if cfg.device.target != "ipu" or is_power_of_two(need):
        return need
    return next_power_of_two(need) if cfg.device.round_to_power_of_two else 1 << 62


@_rule
def _rounding_needs_hardware(cfg: SessionFields) -> Iterator[Problem]:
    if cfg.device.round_to_power_of_two and cfg.device.target != "ipu":
        yield _warning(
            "device.round_to_power_of_two",
            f"round_to_power_of_two only applies to IPU hardware; target={cfg.device.target!r} "
            f"gets exactly the IPUs it needs.", "remove it, or use target='ipu'.",
            "K-rounding-target", device__target=cfg.device.target)


# -- popart_options -----------------------------------------------------------------------------

VALID_GCL_OPTIONS = ("useSynclessCollectives", "maxBytesPerTile")


def _option_loc(name: str, key: str | None = None) -> str:
    return f"popart_options.{name}" + (f".{key}" if key else "")


@_rule
def _known_options(cfg: SessionFields) -> Iterator[Problem]:
    for name, value in cfg.popart_options.items():
        loc = _option_loc(name)
        if name in catalog.CONTROLLED_OPTIONS:
            field = catalog.CONTROLLED_OPTIONS[name]
            yield _error(loc, f"{name} is set by the typed field {field}.",
                         f"remove {short(name)} from popart_options and set {field} instead.",
                         "K-option-controlled", **{name: value})
        elif name in catalog.ELSEWHERE:
            yield _error(loc, f"{name} is not a SessionOptions attribute.",
                         f"set {catalog.ELSEWHERE[name]} instead.", "K-option-elsewhere",
                         **{name: value})
        elif name not in catalog.OPTIONS:
            close = difflib.get_close_matches(name, catalog.OPTIONS, n=3, cutoff=0.6) if len(
                name) <= 100 else []  # no option name is that long; matching would cost more
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else (
                "see `popart-kit schema` and PopART's SessionOptions reference for valid names.")
            yield _error(loc, f"{short(name)} is not an attribute of popart.SessionOptions.", hint,
                         "K-option-unknown", **{name: value})
        else:
            reason = catalog.type_problem(name, value)
            if reason:
                yield _error(loc, f"{name}={short(value)}: {reason}.",
                             f"give a value of type {catalog.OPTIONS[name]}.",
                             "K-option-type", **{name: value})
            elif name in catalog.DEPRECATED:
                yield _warning(loc, f"{name} is a deprecated alias of {catalog.DEPRECATED[name]}.",
                               f"use {catalog.DEPRECATED[name]}.", "K-option-deprecated")
            if isinstance(value, dict):
                for key in value:
                    if (name, key) in catalog.CONTROLLED_MAP_KEYS:
                        field = catalog.CONTROLLED_MAP_KEYS[(name, key)]
                        yield _error(_option_loc(name, key),
                                     f"{name}[{short(key)}] is set by the typed field {field}.",
                                     f"remove it and set {field} instead.",
                                     "K-option-controlled", **{f"{name}.{key}": value[key]})


def _opt(cfg: SessionFields, name: str) -> Any:
    """A popart_options value if it is present and well typed, else PopART's default."""
    value = cfg.popart_options.get(name)
    if value is None or catalog.type_problem(name, value):
        return catalog.DEFAULTS.get(name)
    return value


def _struct_field(cfg: SessionFields, name: str, field: str) -> Any:
    given = cfg.popart_options.get(name)
    if isinstance(given, dict) and field in given and not catalog.type_problem(name, given):
        return given[field]
    return catalog.DEFAULTS[name][field]


@_rule
def _option_rules(cfg: SessionFields) -> Iterator[Problem]:
    """PopART's checks on options set through popart_options (V11-V17, V28-V30, V38-V44)."""
    o = lambda name: _opt(cfg, name)  # noqa: E731
    vgm, ipus, acc = cfg.virtual_graph_mode, cfg.ipus_per_replica, cfg.accumulation.factor
    host_copy, main_loops = o("useHostCopyOps"), o("enableExplicitMainLoops")
    explicit_recompute = o("explicitRecomputation")
    explicit_pipelining = cfg.pipeline.enabled and host_copy and main_loops
    implicit_pipelining = cfg.pipeline.enabled and not (host_copy and main_loops)

    if main_loops and not host_copy:
        yield _error(_option_loc("enableExplicitMainLoops"),
                     "enableExplicitMainLoops requires useHostCopyOps.",
                     "set useHostCopyOps=true too.", "V12",
                     enableExplicitMainLoops=True, useHostCopyOps=host_copy)
    if explicit_pipelining and not explicit_recompute:
        yield _error(_option_loc("explicitRecomputation"),
                     "explicit pipelining (useHostCopyOps and enableExplicitMainLoops) requires "
                     "explicitRecomputation.", "set explicitRecomputation=true.", "V11",
                     explicitRecomputation=explicit_recompute)
    if o("aliasZeroCopy"):
        if implicit_pipelining:
            yield _error(_option_loc("aliasZeroCopy"),
                         "aliasZeroCopy is not supported with implicit pipelining.",
                         "set useHostCopyOps, enableExplicitMainLoops and explicitRecomputation "
                         "(explicit IR), or aliasZeroCopy=false.", "V17", aliasZeroCopy=True)
        elif not explicit_recompute:
            yield _error(_option_loc("aliasZeroCopy"),
                         "aliasZeroCopy is not supported with implicit recomputation.",
                         "set explicitRecomputation=true, or aliasZeroCopy=false.", "V17",
                         aliasZeroCopy=True, explicitRecomputation=False)
    if o("createImplicitPipeliningFwdOnlyProgram") and (not implicit_pipelining or acc <= 1):
        # ir.cpp:674-687 Ir::verifyPipelineSettings, in PopART's order
        why = ("with explicit pipelining" if explicit_pipelining else
               "without implicit pipelining" if not implicit_pipelining else
               "without gradient accumulation")
        yield _error(_option_loc("createImplicitPipeliningFwdOnlyProgram"),
                     f"createImplicitPipeliningFwdOnlyProgram needs implicit pipelining with "
                     f"gradient accumulation (pipeline.enabled={cfg.pipeline.enabled}, "
                     f"accumulation.factor={acc}).",
                     "remove it (it is deprecated), or enable pipelining and accumulation.", "V44",
                     popart=f"Implicit pipelining forward-only program is not supported {why}.",
                     pipeline__enabled=cfg.pipeline.enabled, accumulation__factor=acc)

    ratios = o("virtualGraphSplitRatios")
    if vgm == "auto" and ratios:
        bad = [r for r in ratios if not 0 < r < 1]
        if len(ratios) != ipus:
            yield _error(_option_loc("virtualGraphSplitRatios"),
                         f"virtualGraphSplitRatios has {len(ratios)} entries but "
                         f"ipus_per_replica={ipus}.", f"give one ratio per IPU ({ipus}).", "V28",
                         virtualGraphSplitRatios=ratios, ipus_per_replica=ipus)
        if bad:
            yield _error(_option_loc("virtualGraphSplitRatios"),
                         f"virtualGraphSplitRatios {short(bad)} are outside (0, 1).",
                         "give each IPU a share strictly between 0 and 1.", "V28",
                         virtualGraphSplitRatios=ratios)
        if not math.isclose(sum(ratios), 1.0, abs_tol=1e-6):
            yield _error(_option_loc("virtualGraphSplitRatios"),
                         f"virtualGraphSplitRatios sum to {sum(ratios):g}, not 1.",
                         "scale the ratios so they sum to 1.", "V28",
                         virtualGraphSplitRatios=ratios)

    phases = _struct_field(cfg, "executionPhaseSettings", "phases")
    if isinstance(phases, int):
        if phases > 1 and vgm != "execution_phases":
            yield _error("virtual_graph_mode",
                         f"executionPhaseSettings.phases={phases} needs virtual_graph_mode="
                         f"'execution_phases', got {vgm!r}.",
                         "set virtual_graph_mode='execution_phases', or phases to 0.", "V29",
                         virtual_graph_mode=vgm, executionPhaseSettings__phases=phases)
        elif phases == 1 or (vgm == "execution_phases" and phases < 2):
            yield _warning(_option_loc("executionPhaseSettings", "phases"),
                           f"virtual_graph_mode='execution_phases' with phases={phases}: PopART "
                           f"disables phased execution below 2 phases.",
                           "set popart_options.executionPhaseSettings.phases >= 2.", "V30",
                           executionPhaseSettings__phases=phases)

    if cfg.is_training and (_struct_field(cfg, "batchSerializationSettings", "method") == "Loop"
                            and _struct_field(cfg, "batchSerializationSettings",
                                              "transformContext") == "Fwd"):
        yield _error(_option_loc("batchSerializationSettings", "method"),
                     "Loop batch serialization in the forward context is not supported when "
                     "training.", "set transformContext='Bwd', or another method.", "V38")

    io_tiles, tiles = o("numIOTiles"), cfg.device.tiles_per_ipu
    if isinstance(io_tiles, int) and io_tiles > 0 and vgm != "off":
        if io_tiles < 32 or io_tiles % 2:
            yield _error(_option_loc("numIOTiles"),
                         f"numIOTiles={io_tiles}: IO tiles must be an even number >= 32.",
                         "use an even number from 32 (or 0 for none).", "V40",
                         numIOTiles=io_tiles)
        if tiles and io_tiles >= tiles:
            yield _error(_option_loc("numIOTiles"),
                         f"numIOTiles={io_tiles} is not below device.tiles_per_ipu={tiles}.",
                         "leave compute tiles: use fewer IO tiles.", "V40",
                         numIOTiles=io_tiles, device__tiles_per_ipu=tiles)

    gcl = cfg.popart_options.get("gclOptions")
    if isinstance(gcl, dict):
        for key in gcl:
            if key not in VALID_GCL_OPTIONS:
                yield _error(_option_loc("gclOptions", key),
                             f"{short(key)} is not a valid gcl option.",
                             f"use one of {', '.join(VALID_GCL_OPTIONS)}.", "V41")

    if o("opxModifyChecking") and cfg.replication.local_factor > 1:
        yield _error(_option_loc("opxModifyChecking"),
                     f"opxModifyChecking cannot run with replicated graphs (local_factor="
                     f"{cfg.replication.local_factor}).", "set opxModifyChecking=false.", "V42")

    rearranged = o("rearrangeStreamsOnHost")
    for name in ("defaultBufferingDepth", "defaultPrefetchBufferingDepth"):
        yield from _buffering_depth(_option_loc(name), name, o(name), rearranged)
    for name in ("bufferingDepthMap", "prefetchBufferingDepthMap"):
        for tensor, d in (o(name) or {}).items():
            yield from _buffering_depth(_option_loc(name, tensor), f"{name}[{short(tensor)}]", d,
                                        rearranged)

    conv_partials = (o("matmulOptions") or {}).get("partialsType")
    if conv_partials and cfg.precision.partials_type and (
            conv_partials.lower() != cfg.precision.partials_type):
        yield _error(_option_loc("matmulOptions", "partialsType"),
                     f"matmulOptions['partialsType']={short(conv_partials)} contradicts "
                     f"precision.partials_type={cfg.precision.partials_type!r}.",
                     "keep one of them.", "K-partials-conflict")

    if o("enableEngineCaching") and cfg.device.target not in ("ipu", "offline"):
        yield _warning(_option_loc("enableEngineCaching"),
                       f"engine caching only applies to IPU hardware and offline targets, got "
                       f"target={cfg.device.target!r}.", "remove enableEngineCaching.",
                       "K-caching-target")


def _buffering_depth(loc: str, what: str, depth: Any, rearranged: bool) -> Iterator[Problem]:
    if not isinstance(depth, int):
        return
    if depth < 1:
        yield _error(loc, f"{what}={depth}: a stream needs at least one buffer.",
                     "use 1 or more.", "V43")
    elif depth > 1 and rearranged:
        yield _error(loc, f"{what}={depth} with rearrangeStreamsOnHost: host-rearranged streams "
                          f"support a buffering depth of 1 only.",
                     "set rearrangeStreamsOnHost=false, or a depth of 1.", "V43")
