"""Benchmark sweeps: ``pk.bench.sweep(...)`` and ``popart-kit bench``.

A sweep runs every variant of a product of parameter lists (replication, batches per step,
accumulation, pipeline stages, instances, micro-batch) over a built-in model (``mlp``,
``convnet``, ``encoder``) or an ONNX file, and records per variant the compile time apart,
the median and spread of several timed runs after warm-up, samples/s from the plan, efficiency
against the smallest replication, planned and measured pipeline bubble, memory, and baselines
timed in the same runs: a hand-written JAX program of the same step and, for inference,
onnxruntime. Results go to results.json and results.csv (:data:`COLUMNS`), plots to PNG.

::

    results = pk.bench.sweep(replication=[1, 2, 4], batches_per_step=[1, 16], out="bench/")
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PopartKitError, short
from ._machine import describe, load_average, machine_facts
from ._models import MAX_LAYERS, MAX_MODEL_BYTES
from ._plots import plot
from ._results import COLUMNS, compare, efficiencies, load, table, write
from ._timing import Stats, best_of, interleaved, stats
from ._variants import AXES, MAX_VARIANTS, Variant, from_spec, product

__all__ = ["sweep", "variants", "run", "Variant", "COLUMNS", "from_spec", "plot", "load",
           "compare", "table", "machine_facts", "describe", "interleaved", "best_of", "stats",
           "Stats", "MAX_VARIANTS", "MAX_MODEL_BYTES", "MAX_LAYERS", "MAX_REPEAT"]

#: The most timed runs, and warm-up runs, per variant: every run's time is kept, and a run
#: takes milliseconds to seconds, so ten thousand already take hours.
MAX_REPEAT = 10_000


def variants(benchmark: str = "sweep", **params: Any) -> list[Variant]:
    """The product of the swept ``params`` (lists or ``"1,2,4"`` strings, see ``AXES``) with
    the settings among them (model, mode, sizes, onnx, loss); refuses more than
    :data:`MAX_VARIANTS`, counted before any is made."""
    axes = {k: v for k, v in params.items() if k in AXES and v is not None}
    settings = {k: v for k, v in params.items() if k not in AXES}
    return product(benchmark, axes, settings)


def _validate(found: list[Variant], backend: str, skip_invalid: bool) -> list[dict[str, Any]]:
    """A row per variant: ``ok`` to run, or ``skipped`` with why. Without ``skip_invalid`` any
    invalid variant refuses the whole sweep, every problem listed, before anything runs."""
    from .._model.layout import PipelineLayout
    from ._measure import model_of

    if backend not in ("xla", "popart"):
        raise ConfigError(f"bench: backend {short(backend)} is not one of xla, popart.",
                          rule="K-bench-sweep")
    names = [v.name for v in found]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"bench: variant names repeat ({', '.join(twice)}); give each "
                          f"benchmark its own name.", rule="K-bench-sweep")
    rows, problems = [], []
    for v in found:
        row = {**v.to_dict(), "backend": backend, "status": "ok", "note": ""}
        if v.onnx is not None:
            row["model"] = v.onnx
        try:
            if v.replication % v.instances:
                raise ConfigError(f"{v.instances} instances cannot share {v.replication} "
                                  f"replicas evenly; give replication a multiple of the "
                                  f"instances.", rule="K-bench-sweep")
            cfg = v.config()
            built = model_of(v)
            if v.stages > 1:
                import onnx

                errors = [p for p in PipelineLayout.from_model(onnx.load_from_string(
                    built.proto)).problems(cfg) if p.severity == "error"]
                if errors:
                    raise ConfigError("; ".join(p.text() for p in errors))
        except PopartKitError as exc:
            text = " ".join(str(exc).split())
            row.update(status="skipped", note=text)
            problems.append(f"{v.name}: {text}")
        rows.append(row)
    if problems and not skip_invalid:
        raise ConfigError(f"bench: {len(problems)} of {len(found)} variants are invalid "
                          f"(nothing ran):\n  " + "\n  ".join(problems) + "\nFix: drop those "
                          "values, or skip_invalid=True (--skip-invalid) to run the rest.",
                          rule="K-bench-sweep")
    return rows


def run(found: list[Variant], *, backend: str = "xla", repeat: int = 5, warmup: int = 1,
        baselines: bool = True, skip_invalid: bool = False, progress: bool = True,
        instance_timeout: float = 300.0, out: str | Path | None = None,
        plots: bool = True) -> dict[str, Any]:
    """Run ``found`` variants; the results (``machine``, ``options``, ``columns``,
    ``variants``), written to ``out`` (JSON, CSV, PNG) when given. Refuses options of the
    wrong type or past :data:`MAX_REPEAT` (:func:`_check_options`)."""
    _check_options(repeat, warmup, baselines)
    if not found:
        raise ConfigError("bench: no variants to run.", rule="K-bench-sweep")
    rows = _validate(found, backend, skip_invalid)
    options = {"backend": backend, "repeat": repeat, "warmup": warmup, "baselines": baselines}
    with _no_disk_cache():
        return _run(found, rows, options, instance_timeout, progress, out, plots)


def _check_options(repeat: Any, warmup: Any, baselines: Any) -> None:
    """Refuse a ``repeat`` outside 1 to MAX_REPEAT, a ``warmup`` outside 0 to MAX_REPEAT, or a
    ``baselines`` that is not True or False."""
    for name, value, low in (("repeat", repeat, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_REPEAT:
            raise ConfigError(f"bench: {name} must be a whole number of runs, at least {low} and "
                              f"at most {MAX_REPEAT:,}; got {short(value)}. Fix: e.g. {name} "
                              f"{5 if low else 1}.", rule="K-bench-sweep")
    if not isinstance(baselines, bool):
        raise ConfigError(f"bench: baselines must be true or false; got {short(baselines)}.",
                          rule="K-bench-sweep")


def _run(found: list[Variant], rows: list[dict[str, Any]], options: dict[str, Any],
         instance_timeout: float, progress: bool, out: str | Path | None,
         plots: bool) -> dict[str, Any]:
    backend, repeat, warmup, baselines = (options[k] for k in
                                          ("backend", "repeat", "warmup", "baselines"))
    machine = machine_facts(backend)
    if backend == "xla":
        import jax

        machine["compilation_cache"] = jax.config.jax_compilation_cache_dir or "off"
    todo = [(v, row) for v, row in zip(found, rows, strict=True) if row["status"] == "ok"]
    with _progress(progress, len(todo)) as advance:
        for v, row in todo:
            advance(v.name)
            row.update(_one(v, backend, repeat, warmup, baselines, instance_timeout))
        advance(None)
    efficiencies(rows)
    machine["load_end"] = load_average()
    results = {"machine": machine, "options": options, "columns": COLUMNS, "variants": rows}
    if out is not None:
        write(out, rows, machine, options)
        if plots:
            plot(results, out)
    return results


class _no_disk_cache:
    """Compile times are measured: the kit's persistent compilation cache stays off during a
    sweep (its instances included) unless the user set a cache directory. The hand-written
    baselines compute float32 products in float32, as sessions do, for the sweep only."""

    def __enter__(self) -> None:
        import os

        from .._runtime.xla import placement
        from .._runtime.xla.compilation_cache import CACHE_VARIABLE

        self.before = os.environ.get(CACHE_VARIABLE)
        if self.before is None:
            os.environ[CACHE_VARIABLE] = "off"
        placement.ensure_host_devices()  # before anything starts JAX, as a session would
        import jax

        self.precision = jax.config.jax_default_matmul_precision
        jax.config.update("jax_default_matmul_precision", "float32")

    def __exit__(self, *exc: Any) -> None:
        import os

        import jax

        from .._runtime.xla.compilation_cache import CACHE_VARIABLE

        jax.config.update("jax_default_matmul_precision", self.precision)
        if self.before is None:
            os.environ.pop(CACHE_VARIABLE, None)


def _one(v: Variant, backend: str, repeat: int, warmup: int, baselines: bool,
         timeout: float) -> dict[str, Any]:
    from ._measure import measure, measure_instances

    try:
        if v.instances > 1:
            return measure_instances(v, repeat, warmup, timeout)
        return measure(v, backend, repeat, warmup, baselines)
    except PopartKitError as exc:
        return {"status": "refused", "note": " ".join(str(exc).split())[:2000]}


class _progress:
    """A rich progress bar on stderr (or nothing)."""

    def __init__(self, show: bool, total: int) -> None:
        self.show, self.total, self.bar, self.task = show, total, None, None

    def __enter__(self) -> Any:
        if self.show:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=False)
            self.bar.__enter__()
            self.task = self.bar.add_task("bench", total=self.total)
        started = [False]

        def advance(name: str | None) -> None:
            if self.bar is None:
                return
            if started[0]:
                self.bar.advance(self.task)
            started[0] = True
            self.bar.update(self.task, description=name or "done")

        return advance

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def sweep(*, model: str = "mlp", mode: str = "inference", onnx: str | None = None,
          loss: str | None = None, replication: Sequence[int] | str = (1,),
          batches_per_step: Sequence[int] | str = (1,), accumulation: Sequence[int] | str = (1,),
          stages: Sequence[int] | str = (1,), instances: Sequence[int] | str = (1,),
          micro_batch: Sequence[int] | str = (16,), width: int = 256, layers: int = 2,
          seq: int = 32, heads: int = 4, image: int = 16, spec: str | Path | None = None,
          backend: str = "xla", repeat: int = 5, warmup: int = 1, baselines: bool = True,
          skip_invalid: bool = False, progress: bool = True, instance_timeout: float = 300.0,
          out: str | Path | None = None, plots: bool = True) -> dict[str, Any]:
    """Run a sweep: the product of the lists (or the variants of ``spec``, a YAML/TOML file) and
    return its results (written to ``out`` as results.json, results.csv and PNG plots)."""
    if spec is not None:
        found, options = from_spec(spec)
        backend = options.get("backend", backend)
        repeat = options.get("repeat", repeat)
        warmup = options.get("warmup", warmup)
        baselines = options.get("baselines", baselines)
    else:
        found = variants(
            onnx if onnx else model, model=model, mode=mode, onnx=onnx, loss=loss,
            replication=replication, batches_per_step=batches_per_step,
            accumulation=accumulation, stages=stages, instances=instances,
            micro_batch=micro_batch, width=width, layers=layers, seq=seq, heads=heads,
            image=image)
    return run(found, backend=backend, repeat=repeat, warmup=warmup, baselines=baselines,
               skip_invalid=skip_invalid, progress=progress, instance_timeout=instance_timeout,
               out=out, plots=plots)


def redraw(results_json: str | Path, directory: str | Path | None = None) -> list[Path]:
    """Plots from saved results (next to the JSON unless ``directory``)."""
    path = Path(results_json)
    return plot(load(path), directory if directory is not None else path.parent)


__all__ += ["redraw"]
