"""PNG plots of a sweep's results: throughput and efficiency against replication with the ideal
line, throughput against device iterations, measured against planned pipeline bubble."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from .._base.atomic import write_atomic

__all__ = ["plot"]


def _series(rows: list[dict[str, Any]], x: str, keep: tuple[str, ...]) -> dict[str, list]:
    """Rows grouped by everything but ``x`` (labelled by the ``keep`` axes that vary),
    each sorted by ``x``."""
    axes = ("benchmark", "model", "mode", "replication", "batches_per_step", "accumulation",
            "stages", "instances", "micro_batch")
    others = [a for a in axes if a != x]
    varying = [a for a in keep if a != x and len({r.get(a) for r in rows}) > 1]
    groups: dict[tuple, list] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(a) for a in others), []).append(row)
    short = {"replication": "R", "batches_per_step": "bps", "accumulation": "A", "stages": "S",
             "instances": "I", "micro_batch": "mb"}
    out = {}
    for key, group in groups.items():
        label = " ".join(f"{short.get(a, '')}={dict(zip(others, key, strict=True))[a]}"
                         if a in short else str(dict(zip(others, key, strict=True))[a])
                         for a in varying) or str(group[0].get("model"))
        out[label] = sorted(group, key=lambda r: r[x])
    return out


def _log2_ticks(ax: Any, values: list[int]) -> None:
    """A log-2 x axis labelled with the swept values themselves."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.minorticks_off()


def plot(results: dict[str, Any], directory: str | Path) -> list[Path]:
    """Write the plots that the results (checked ones: see ``_results.check``) have data for
    into ``directory``, each replaced whole or not at all; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ._machine import describe

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows = [r for r in results["variants"] if r.get("status") == "ok"]
    machine = describe(results.get("machine") or {}) if results.get("machine") else ""
    keep = ("benchmark", "model", "mode", "batches_per_step", "accumulation", "stages",
            "instances", "micro_batch", "replication")
    written = []

    def save(fig: Any, name: str, title: str) -> None:
        fig.suptitle(title, fontsize=10)
        fig.text(0.5, 0.005, machine, ha="center", va="bottom", fontsize=7, color="0.4")
        fig.tight_layout(rect=(0, 0.03, 1, 0.95))
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=80)
        plt.close(fig)
        written.append(write_atomic(directory / name, png.getvalue()))

    if rows:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for label, series in _series(rows, "replication", keep).items():
            xs = [r["replication"] for r in series]
            line, = left.plot(xs, [r["samples_per_s"] for r in series], "o-", label=label)
            base = series[0]
            left.plot(xs, [base["samples_per_s"] * x / base["replication"] for x in xs], ":",
                      color=line.get_color())
            right.plot(xs, [r.get("efficiency") or float("nan") for r in series], "o-",
                       color=line.get_color(), label=label)
        right.axhline(1.0, color="0.5", ls=":", label="ideal")
        left.plot([], [], ":", color="0.5", label="ideal (linear from the smallest R)")
        for ax in (left, right):
            _log2_ticks(ax, sorted({r["replication"] for r in rows}))
            ax.set_xlabel("replication factor")
            ax.grid(alpha=0.3)
        left.set_yscale("log")
        left.set_ylabel("samples/s")
        right.set_ylabel("efficiency (per replica vs smallest R)")
        right.set_ylim(bottom=0)
        left.legend(fontsize=7)
        save(fig, "replication.png", "throughput and efficiency against replication")

    if len({r["batches_per_step"] for r in rows}) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, series in _series(rows, "batches_per_step", keep).items():
            ax.plot([r["batches_per_step"] for r in series],
                    [r["samples_per_s"] for r in series], "o-", label=label)
        _log2_ticks(ax, sorted({r["batches_per_step"] for r in rows}))
        ax.set_yscale("log")
        ax.set_xlabel("batches per step (device iterations)")
        ax.set_ylabel("samples/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "device_iterations.png", "throughput against device iterations")

    piped = [r for r in rows if r.get("bubble_planned") is not None
             and r.get("bubble_measured") is not None]
    if piped:
        fig, ax = plt.subplots(figsize=(5, 4.5))
        top = max(max(r["bubble_planned"], r["bubble_measured"]) for r in piped) * 1.1 or 1
        ax.plot([0, top], [0, top], ":", color="0.5", label="measured = planned")
        for r in piped:
            ax.plot(r["bubble_planned"], r["bubble_measured"], "o")
            ax.annotate(r["name"], (r["bubble_planned"], r["bubble_measured"]), fontsize=6)
        ax.set_xlabel("planned bubble (K-1)/(M+K-1)")
        ax.set_ylabel("measured bubble (executor trace)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "bubble.png", "pipeline bubble: measured against planned")
    return written
