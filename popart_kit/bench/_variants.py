"""Variants: named points of a sweep, made as a product of parameter lists (the convention of
Graphcore's examples-utils benchmark harness), from arguments or a YAML/TOML spec."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .._config.files import read
from ..errors import ConfigError, clip, short

__all__ = ["AXES", "SIZES", "MAX_VARIANTS", "Variant", "product", "count", "from_spec",
           "parse_list"]

#: The swept parameters (each a list of positive integers), and their short names in a
#: variant's name.
AXES = {"replication": "r", "batches_per_step": "bps", "accumulation": "a", "stages": "s",
        "instances": "i", "micro_batch": "mb"}
#: Per-benchmark settings a spec may give (the rest are sweep-wide).
SETTINGS = ("model", "onnx", "loss", "mode", "width", "layers", "seq", "heads", "image")
#: The settings that size a built-in model (positive integers).
SIZES = ("width", "layers", "seq", "heads", "image")
#: The most variants one sweep or spec may describe: each compiles and times its own session
#: (seconds to minutes), so a thousand already take hours; more is a slip or a hostile file,
#: refused after counting, before any variant is made.
MAX_VARIANTS = 1000
#: What a spec's ``defaults`` may hold besides settings and axes: the sweep-wide options.
OPTIONS = ("backend", "repeat", "warmup", "baselines")


@dataclass(frozen=True)
class Variant:
    """One point of a sweep: what to build and how to run it."""

    name: str
    benchmark: str = "sweep"
    model: str = "mlp"
    mode: str = "inference"
    replication: int = 1
    batches_per_step: int = 1
    accumulation: int = 1
    stages: int = 1
    instances: int = 1
    micro_batch: int = 16
    width: int = 256
    layers: int = 2
    seq: int = 32
    heads: int = 4
    image: int = 16
    onnx: str | None = None
    loss: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def config(self, target: str = "offline", popdist: bool = False) -> Any:
        """The SessionConfig of instance 0 (validated: a bad combination raises); with
        ``popdist``, replication is left to the environment (``with_popdist_env``)."""
        import popart_kit as pk

        local = self.replication // self.instances
        replication: dict[str, int] = {"local_factor": local}
        if self.instances > 1:
            replication.update(global_factor=self.replication, global_offset=0)
        if popdist:
            replication = {}
        return pk.SessionConfig(
            mode=self.mode, batches_per_step=self.batches_per_step,
            accumulation={"factor": self.accumulation}, replication=replication,
            ipus_per_replica=self.stages, pipeline={"enabled": self.stages > 1},
            micro_batch_size=self.micro_batch if self.onnx is None else None,
            device={"target": target})


def _length(value: Any, what: str) -> int:
    """How many values an axis gives, counted without listing them; refuses what is not a
    list, an integer or a ``"1,2,4"`` string, and an empty list."""
    if isinstance(value, str):
        return value.count(",") + 1
    if isinstance(value, int):
        return 1
    if isinstance(value, list | tuple | range) and len(value):
        return len(value)
    raise ConfigError(f"bench: {what} must be a non-empty list of positive integers or a string "
                      f"like \"1,2,4\"; got {short(value)}. Fix: e.g. {what.rsplit('.', 1)[-1]}"
                      f": [1, 2, 4].", rule="K-bench-sweep")


def parse_list(text: str | int | Sequence[int], what: str) -> list[int]:
    """``"1,2,4"`` (or an int, or a list) as distinct positive integers; refused with the
    offender."""
    _length(text, what)  # refuses what is not a list, an integer or a string
    items = (text.split(",") if isinstance(text, str)
             else [text] if isinstance(text, int) else list(text))
    out = []
    for item in items:
        try:
            value = int(str(item).strip())
        except ValueError:
            value = 0
        if value < 1 or str(item).strip() in ("", "True", "False"):
            raise ConfigError(f"bench: {what} must be positive integers separated by commas "
                              f"(e.g. 1,2,4,8); got {short(item)} in {short(text)}.",
                              rule="K-bench-sweep")
        out.append(value)
    if len(set(out)) != len(out):
        raise ConfigError(f"bench: {what} lists {short(text)} with a repeated value; give each "
                          f"once.", rule="K-bench-sweep")
    return out


def count(benchmark: str, axes: Mapping[str, Any]) -> tuple[int, dict[str, int]]:
    """How many variants ``axes`` make (the product of their lengths, nothing listed), and
    each axis's length."""
    lengths = {a: _length(axes[a], f"{benchmark}.{a}") for a in AXES if a in axes}
    return math.prod(lengths.values()), lengths


def _refuse_too_many(where: str, counts: Sequence[tuple[str, int, dict[str, int]]]) -> None:
    """Refuse ``counts`` (benchmark, variants, axis lengths) adding up to more than
    :data:`MAX_VARIANTS`, naming the largest benchmarks and their axes."""
    total = sum(n for _, n, _ in counts)
    if total <= MAX_VARIANTS:
        return
    largest = sorted(counts, key=lambda c: -c[1])[:3]
    shown = "; ".join(f"{clip(name, 60)}: {n:,} ("
                      + " × ".join(f"{a} {k:,}" for a, k in lengths.items()) + ")"
                      for name, n, lengths in largest)
    more = f"; and {len(counts) - 3} more benchmarks" if len(counts) > 3 else ""
    raise ConfigError(f"bench: {where} describes {total:,} variants, more than {MAX_VARIANTS:,} "
                      f"(each compiles and runs its own session): {shown}{more}. Fix: give fewer "
                      f"values per axis, or split the sweep into several runs.",
                      rule="K-bench-sweep")


def _settings(benchmark: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` without the None ones, each checked (:func:`_setting_problem`); refuses
    unknown names."""
    unknown = sorted(map(str, set(settings) - set(SETTINGS)))
    if unknown:
        raise ConfigError(f"bench: {benchmark}: unknown parameter(s) {short(', '.join(unknown))};"
                          f" sweepable: {', '.join(AXES)}; settings: {', '.join(SETTINGS)}.",
                          rule="K-bench-sweep")
    given = {k: v for k, v in settings.items() if v is not None}
    for key, value in given.items():
        problem = _setting_problem(key, value)
        if problem:
            raise ConfigError(f"bench: {benchmark}.{key} {problem}.", rule="K-bench-sweep")
    return given


def _setting_problem(key: str, value: Any) -> str | None:
    """What is wrong with one setting (sizes are positive integers, the mode inference or
    training, the rest text), else None."""
    if key in SIZES:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return None
        return (f"must be a positive integer; got {short(value)}. Fix: e.g. {key}: "
                f"{getattr(Variant, key)}")
    if key == "mode":
        if value in ("inference", "training"):
            return None
        return f"must be inference or training; got {short(value)}. Fix: e.g. mode: training"
    if isinstance(value, str):
        return None
    return f"must be text; got {short(value)}. Fix: give the {key} in quotes"


def product(benchmark: str, axes: Mapping[str, Any],
            settings: Mapping[str, Any]) -> list[Variant]:
    """Every combination of ``axes`` values, named ``benchmark`` then ``_<axis><value>`` for
    each axis with more than one value (``scaling_r2_bps16``); refuses more than
    :data:`MAX_VARIANTS`, counted before any is made."""
    _check_axes(benchmark, axes)
    total, lengths = count(benchmark, axes)
    _refuse_too_many(f"the sweep {short(benchmark)}", [(benchmark, total, lengths)])
    return _expand(benchmark, axes, settings)


def _check_axes(benchmark: str, axes: Mapping[str, Any]) -> None:
    """Refuse axes that are not in AXES."""
    unknown = sorted(map(str, set(axes) - set(AXES)))
    if unknown:
        raise ConfigError(f"bench: {benchmark}: unknown axis(es) {short(', '.join(unknown))}; "
                          f"sweepable: {', '.join(AXES)}.", rule="K-bench-sweep")


def _expand(benchmark: str, axes: Mapping[str, Any],
            settings: Mapping[str, Any]) -> list[Variant]:
    """The variants of ``axes`` (already counted) with ``settings``."""
    base = Variant(name=benchmark, benchmark=benchmark, **_settings(benchmark, settings))
    names = [a for a in AXES if a in axes]
    lists = [parse_list(axes[a], f"{benchmark}.{a}") for a in names]
    out = []
    for values in itertools.product(*lists):
        point = dict(zip(names, values, strict=True))
        suffix = "_".join(f"{AXES[a]}{point[a]}" for a, values in zip(names, lists, strict=True)
                          if len(values) > 1)
        out.append(replace(base, name=f"{benchmark}_{suffix}" if suffix else benchmark, **point))
    return out


def from_spec(path: str | Path, overrides: Mapping[str, Any] | None = None
              ) -> tuple[list[Variant], dict[str, Any]]:
    """Variants of a YAML or TOML spec, and its sweep-wide options (:data:`OPTIONS`)::

        defaults: {model: mlp, mode: inference, repeat: 5}
        benchmarks:
          scaling: {replication: [1, 2, 4, 8], batches_per_step: "1,16,64"}
          pipelined: {model: encoder, layers: 4, stages: [2, 4], batches_per_step: [16]}

    Each benchmark's lists form a product; its settings override ``defaults``. The file is read
    as a config file is (size, depth and YAML aliases bounded); refuses unknown options and
    more than :data:`MAX_VARIANTS` variants in all, counted before any is made."""
    path = Path(path)
    benchmarks, defaults = _spec_tables(path)
    defaults.update(overrides or {})
    options = {k: defaults.pop(k) for k in list(defaults) if k not in SETTINGS and k not in AXES}
    unknown = sorted(map(str, set(options) - set(OPTIONS)))
    if unknown:
        raise ConfigError(f"bench: the spec {path}: unknown option(s) {short(', '.join(unknown))}"
                          f" in defaults. Fix: options are {', '.join(OPTIONS)}; settings "
                          f"{', '.join(SETTINGS)}; axes {', '.join(AXES)}.", rule="K-bench-spec")
    parts, counts = [], []
    for key, body in benchmarks.items():
        name = str(key)
        if not isinstance(body, Mapping):
            raise ConfigError(f"bench: benchmark {short(name)} in {path} must be a table of "
                              f"parameters, got {short(body)}.", rule="K-bench-spec")
        merged = {**defaults, **body}
        axes = {k: v for k, v in merged.items() if k in AXES}
        parts.append((name, axes, {k: v for k, v in merged.items() if k not in AXES}))
        counts.append((name, *count(name, axes)))
    _refuse_too_many(f"the spec {path}", counts)
    return [v for part in parts for v in _expand(*part)], options


_FORMATS = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}


def _spec_tables(path: Path) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """The spec's ``benchmarks`` (a non-empty table) and a copy of its ``defaults`` (a table,
    or none)."""
    if path.suffix not in _FORMATS:
        raise ConfigError(f"bench: the spec {path} must be .yaml, .yml or .toml.",
                          rule="K-bench-spec")
    data = read(path, _FORMATS[path.suffix])
    benchmarks, defaults = data.get("benchmarks"), data.get("defaults") or {}
    if not isinstance(benchmarks, Mapping) or not benchmarks:
        raise ConfigError(f"bench: the spec {path} needs a 'benchmarks' table of named "
                          f"benchmarks, e.g. benchmarks: {{scaling: {{replication: [1, 2]}}}}.",
                          rule="K-bench-spec")
    if not isinstance(defaults, Mapping):
        raise ConfigError(f"bench: the spec {path}: defaults must be a table of settings and "
                          f"options, got {short(defaults)}. Fix: e.g. defaults: {{model: mlp, "
                          f"repeat: 5}}.", rule="K-bench-spec")
    return benchmarks, dict(defaults)
