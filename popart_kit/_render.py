"""Rich tables for plans and problems (what the CLI prints)."""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from .layout import PipelineLayout
    from .plan import Plan

__all__ = ["plan_view", "problems_view", "allocation_view", "render_plan", "to_text"]

_MAX_REPLICA_ROWS = 32


def _n(value: Any) -> str:
    return "—" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def _pairs(title: str, rows: Iterable[tuple[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None,
                  padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in rows:
        table.add_row(key, _n(value))
    return table


def plan_view(plan: Plan) -> Group:
    parts: list[Any] = [Text(f"{plan.mode} session on target {plan.target!r}", style="bold")]
    request = f"{plan.ipus_to_request}" + (
        f" ({plan.idle_ipus} idle: rounded up to a power of two)" if plan.idle_ipus else "")
    parts.append(_pairs("Topology", [
        ("instances", plan.instances),
        ("this instance", plan.instance_index),
        ("replicas per instance", plan.local_replicas),
        ("replicas in all", plan.global_replicas),
        ("IPUs per replica", plan.ipus_per_replica),
        ("IPUs this instance uses", plan.num_ipus),
        ("IPUs this instance requests", request),
        ("IPUs all instances use", plan.global_num_ipus),
    ]))
    parts.append(_pairs("Batches", [
        ("batches per step (device iterations)", plan.batches_per_step),
        ("accumulation factor", plan.accumulation_factor),
        ("micro-batch size", plan.micro_batch_size),
        ("micro-batches per run (per input)", plan.micro_batches_per_step),
        ("samples per run, this instance", plan.samples_per_step),
        ("samples per run, all instances", plan.global_samples_per_step),
        ("global batch size (per weight update)", plan.global_batch_size),
        ("weight updates per run", plan.weight_updates_per_step),
    ]))
    if plan.pipelined:
        bubble = None if plan.bubble_fraction is None else f"{100 * plan.bubble_fraction:.1f}%"
        parts.append(_pairs("Pipeline", [
            ("forward stages", plan.pipeline_stages if plan.pipeline_stages is not None
             else "from the model"),
            ("depth (stages PopART runs)", plan.pipeline_depth),
            ("bubble", bubble),
        ]))
    replicas = Table(title="Replicas", title_justify="left")
    for column in ("instance", "global id", "local id", "device IPUs"):
        replicas.add_column(column, justify="right")
    for r in plan.replicas[:_MAX_REPLICA_ROWS]:
        mark = "bold" if r.instance == plan.instance_index else "dim"
        replicas.add_row(str(r.instance), str(r.global_id), str(r.local_id),
                         ",".join(map(str, r.ipus)), style=mark)
    if len(plan.replicas) > _MAX_REPLICA_ROWS:
        replicas.caption = f"… {len(plan.replicas) - _MAX_REPLICA_ROWS} more replicas"
    parts.append(replicas)
    sync = Table(title=f"Sync groups ({plan.sync_pattern})", title_justify="left")
    sync.add_column("group")
    sync.add_column("IPU sets of this instance")
    for name, groups in plan.sync_groups.items():
        sync.add_row(name, "  ".join("{" + ",".join(map(str, g)) + "}" for g in groups))
    parts.append(sync)
    if plan.warnings:
        parts.append(Text("Warnings", style="bold yellow"))
        parts += [Text(f"  • {w}", style="yellow") for w in plan.warnings]
    return Group(*parts)


def problems_view(title: str, problems: Iterable[tuple[str, str]]) -> Group:
    rows = list(problems)
    parts: list[Any] = [Text(f"{title}: {len(rows)} problem{'s' * (len(rows) != 1)}",
                             style="bold red")]
    parts += [Text.assemble(("  • ", "red"), (loc, "bold"), f": {msg}") for loc, msg in rows]
    return Group(*parts)


def allocation_view(layout: PipelineLayout) -> Table:
    """Which ops sit on which stage and IPU, in model order (as PopART apps print it)."""
    how = " (stages inferred from IPUs)" if layout.inferred else ""
    table = Table(title=f"Device allocation: {layout.forward_stages} forward stages{how}",
                  title_justify="left")
    for column, justify in (("stage", "right"), ("IPU", "right"), ("ops", "right"),
                            ("first … last op", "left")):
        table.add_column(column, justify=justify)
    for stage, ipu, names in layout.allocation():
        span = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
        table.add_row(_n(stage), _n(ipu), str(len(names)), span)
    return table


def to_text(renderable: Any, width: int = 100) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(renderable)
    return buffer.getvalue()


def render_plan(plan: Plan, width: int = 100) -> str:
    return to_text(plan_view(plan), width)
