"""Results: one row per variant, the documented columns, JSON and CSV files, and comparing two
runs."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._base.atomic import write_atomic
from .._runtime.xla.profiling import Utf8Text as _Text
from ..errors import ConfigError, InvalidConfig

__all__ = ["COLUMNS", "efficiencies", "write", "load", "check", "compare"]

#: The CSV's columns, in order, with what each holds.
COLUMNS: dict[str, str] = {
    "name": "the variant: benchmark then _<axis><value> for each swept axis",
    "benchmark": "the benchmark (spec entry) the variant belongs to",
    "model": "mlp, convnet, encoder, or the ONNX file",
    "mode": "inference or training",
    "backend": "xla or popart",
    "replication": "replicas over all instances (global replication factor)",
    "instances": "processes (pk.launch); 1 = this process",
    "batches_per_step": "device iterations per run",
    "accumulation": "gradient accumulation factor",
    "stages": "pipeline stages (1 = not pipelined)",
    "micro_batch": "samples per micro-batch",
    "status": "ok, skipped (an invalid combination) or refused (the kit refused the variant)",
    "note": "why a variant was skipped or refused",
    "samples_per_step": "samples a run processes over all instances (micro x bps x A x R)",
    "compile_s": "seconds to build, compile and do the first run, less one step",
    "runs": "timed runs (after the warm-up runs, which are not counted)",
    "step_ms": "median milliseconds per run",
    "step_ms_p25": "25th percentile of the runs",
    "step_ms_p75": "75th percentile of the runs",
    "step_ms_min": "fastest run",
    "step_ms_max": "slowest run",
    "spread": "(p75 - p25) / median",
    "samples_per_s": "samples_per_step / step time, summed over instances",
    "efficiency": "samples/s per replica against the same variant at the smallest replication",
    "bubble_planned": "the schedule's idle fraction (K-1)/(M+K-1), pipelined variants",
    "bubble_measured": "the idle fraction measured from the pipeline executor's trace",
    "step_memory_mib": "the step's memory XLA reports (inputs, anchors, weights, temporaries)",
    "rss_mib": "resident memory of the process(es) after the variant ran",
    "jax_step_ms": "median ms of the hand-written JAX program of the same step",
    "overhead_vs_jax": "step_ms / jax_step_ms (interleaved runs)",
    "onnxruntime_step_ms": "median ms of onnxruntime running the step's micro-batches",
    "overhead_vs_onnxruntime": "step_ms / onnxruntime_step_ms (below 1: the kit is faster)",
}
_PARAMS = ("benchmark", "model", "mode", "backend", "batches_per_step", "accumulation", "stages",
           "micro_batch", "instances")


def efficiencies(rows: list[dict[str, Any]]) -> None:
    """Fill ``efficiency``: per-replica samples/s against the smallest replication of the same
    variant otherwise (same benchmark, model, bps, A, stages, ...)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("status") == "ok":
            groups.setdefault(tuple(row.get(k) for k in _PARAMS), []).append(row)
    for group in groups.values():
        base = min(group, key=lambda r: r["replication"])
        per = base["samples_per_s"] / base["replication"]
        for row in group:
            row["efficiency"] = row["samples_per_s"] / row["replication"] / per


def write(directory: str | Path, rows: list[dict[str, Any]], machine: dict[str, Any],
          options: dict[str, Any]) -> tuple[Path, Path]:
    """results.json (machine, options, columns, rows) and results.csv (the rows) in
    ``directory``, each replaced whole or not at all (FileWriteError)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = directory / "results.json", directory / "results.csv"
    write_atomic(json_path, json.dumps({"machine": machine, "options": options,
                                        "columns": COLUMNS, "variants": rows},
                                       indent=2, default=str) + "\n")
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(COLUMNS), extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(row.get(k)) for k in COLUMNS})
    write_atomic(csv_path, text.getvalue())
    return json_path, csv_path


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


_Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
_Positive = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0)]
_Count = Annotated[int, Field(strict=True, ge=1)]


class _Machine(BaseModel):
    """What :func:`describe` reads of the machine facts."""

    model_config = ConfigDict(extra="allow")
    cpu: _Text | None = None
    cores_usable: _Count | None = None
    backend: _Text | None = None
    commit: _Text | None = None
    libraries: dict[_Text, _Text | None] = {}
    devices: dict[_Text, _Text | int | None] | None = None
    load_start: _Number | None = None
    load_end: _Number | None = None


class _Results(BaseModel):
    """A results file's top level: the rows are checked one by one (:class:`_Row`)."""

    model_config = ConfigDict(extra="allow")
    variants: list[dict[str, Any]]
    machine: _Machine | None = None


class _Row(BaseModel):
    """Any row: a name, and the parameters the plots group rows by, of their types."""

    model_config = ConfigDict(extra="allow")
    name: _Text
    status: _Text | None = None
    benchmark: _Text | None = None
    model: _Text | None = None
    mode: _Text | None = None
    replication: _Count | None = None
    batches_per_step: _Count | None = None
    accumulation: _Count | None = None
    stages: _Count | None = None
    instances: _Count | None = None
    micro_batch: _Count | None = None


class _RunRow(_Row):
    """A row that ran (status ok): the numbers compared and plotted."""

    replication: _Count
    batches_per_step: _Count
    samples_per_s: _Positive
    step_ms: _Positive
    efficiency: _Number | None = None
    bubble_planned: _Number | None = None
    bubble_measured: _Number | None = None


def load(path: str | Path) -> dict[str, Any]:
    """A results.json as written by :func:`write`; refuses a file that is not JSON, and every
    problem of its structure at once (:func:`check`)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"bench: cannot read results {path}: {exc.strerror}.",
                          rule="K-bench-results") from None
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ConfigError(f"bench: {path} is not JSON ({why}); give a results.json written "
                          f"by popart-kit bench.", rule="K-bench-results") from None
    check(data, str(path))
    return data


def check(data: Any, source: str) -> None:
    """Refuse ``data`` that is not results as :func:`write` makes them: a ``variants`` list of
    rows, each named, those that ran with positive samples/s and step time, every key of its
    type; :class:`~popart_kit.errors.InvalidConfig` listing every problem."""
    entries = _problems(_Results, data, ())
    if not entries:
        for i, row in enumerate(data["variants"]):
            model = _RunRow if row.get("status") == "ok" else _Row
            entries += _problems(model, row, ("variants", i))
    if entries:
        raise InvalidConfig.of(f"bench: {source} is not a results.json written by popart-kit "
                               f"bench; give one it wrote", entries)


_RULE = "popart_kit.K-bench-results"  # the type of the Invalid entries


def _problems(model: type[BaseModel], data: Any, loc: tuple) -> list[tuple]:
    """``model``'s complaints about ``data`` as Invalid entries under ``loc``."""
    if not isinstance(data, dict):
        return [(_RULE, loc, f"expected an object, got {type(data).__name__}", data)]
    try:
        model.model_validate(data)
    except ValidationError as err:
        return [(_RULE, loc + tuple(e["loc"]), e["msg"], e.get("input"))
                for e in err.errors(include_url=False)]
    return []


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Variants of two results (as :func:`load` gives them) matched by name: samples/s and
    step time of each, and b / a."""
    rows_b = {r["name"]: r for r in b["variants"] if r.get("status") == "ok"}
    out = []
    for ra in a["variants"]:
        rb = rows_b.get(ra["name"])
        if ra.get("status") != "ok" or rb is None:
            continue
        out.append({"name": ra["name"], "a_samples_per_s": ra["samples_per_s"],
                    "b_samples_per_s": rb["samples_per_s"], "a_step_ms": ra["step_ms"],
                    "b_step_ms": rb["step_ms"],
                    "ratio": rb["samples_per_s"] / ra["samples_per_s"]})
    if not out:
        raise ConfigError("bench: the two results share no variant (names differ); compare "
                          "runs of the same sweep.", rule="K-bench-results")
    return out


def table(rows: Sequence[dict[str, Any]]) -> Any:
    """A rich table of the main columns."""
    from rich.table import Table

    t = Table(show_edge=False)
    cols = [("variant", "name", "{}"), ("samples", "samples_per_step", "{}"),
            ("compile s", "compile_s", "{:.2f}"), ("step ms", "step_ms", "{:.2f}"),
            ("spread", "spread", "{:.0%}"), ("samples/s", "samples_per_s", "{:,.0f}"),
            ("eff.", "efficiency", "{:.2f}"), ("bubble plan/meas", None, None),
            ("memory MiB", "step_memory_mib", "{:.1f}"), ("vs jax", "overhead_vs_jax", "{:.2f}x"),
            ("vs ort", "overhead_vs_onnxruntime", "{:.2f}x")]
    for title, *_ in cols:
        t.add_column(title, justify="left" if title == "variant" else "right")
    for row in rows:
        cells = []
        for _, key, fmt in cols:
            if key is None:
                p, m = row.get("bubble_planned"), row.get("bubble_measured")
                cells.append("" if p is None else f"{p:.0%}/{m:.0%}")
            elif row.get("status") != "ok" and key != "name":
                cells.append(row.get("status", "") if key == "samples_per_step" else "")
            else:
                value = row.get(key)
                cells.append("" if value is None else fmt.format(value))
        t.add_row(*cells)
    return t
