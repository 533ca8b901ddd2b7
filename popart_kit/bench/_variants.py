"""Variants: named points of a sweep, made as a product of parameter lists (the convention of
Graphcore's examples-utils benchmark harness), from arguments or a YAML/TOML spec."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["AXES", "Variant", "product", "from_spec", "parse_list"]

#: The swept parameters (each a list of positive integers), and their short names in a
#: variant's name.
AXES = {"replication": "r", "batches_per_step": "bps", "accumulation": "a", "stages": "s",
        "instances": "i", "micro_batch": "mb"}
#: Per-benchmark settings a spec may give (the rest are sweep-wide).
SETTINGS = ("model", "onnx", "loss", "mode", "width", "layers", "seq", "heads", "image")


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


def parse_list(text: str | int | Sequence[int], what: str) -> list[int]:
    """``"1,2,4"`` (or an int, or a list) as positive integers; refused with the offender."""
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
                              f"(e.g. 1,2,4,8); got {item!r} in {text!r}.", rule="K-bench-sweep")
        out.append(value)
    if len(set(out)) != len(out):
        raise ConfigError(f"bench: {what} lists {text!r} with a repeated value; give each once.",
                          rule="K-bench-sweep")
    return out


def product(benchmark: str, axes: Mapping[str, Sequence[int]],
            settings: Mapping[str, Any]) -> list[Variant]:
    """Every combination of ``axes`` values, named ``benchmark`` then ``_<axis><value>`` for
    each axis with more than one value (``scaling_r2_bps16``)."""
    unknown = sorted(set(axes) - set(AXES)) + sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"bench: {benchmark}: unknown parameter(s) {', '.join(unknown)}; "
                          f"sweepable: {', '.join(AXES)}; settings: {', '.join(SETTINGS)}.",
                          rule="K-bench-sweep")
    names = [a for a in AXES if a in axes]
    lists = [parse_list(axes[a], f"{benchmark}.{a}") for a in names]
    known = {f.name for f in fields(Variant)}
    base = Variant(name=benchmark, benchmark=benchmark,
                   **{k: v for k, v in settings.items() if k in known and v is not None})
    out = []
    for values in itertools.product(*lists):
        point = dict(zip(names, values, strict=True))
        suffix = "_".join(f"{AXES[a]}{point[a]}" for a, values in zip(names, lists, strict=True)
                          if len(values) > 1)
        out.append(replace(base, name=f"{benchmark}_{suffix}" if suffix else benchmark, **point))
    return out


def from_spec(path: str | Path, overrides: Mapping[str, Any] | None = None
              ) -> tuple[list[Variant], dict[str, Any]]:
    """Variants of a YAML or TOML spec, and its sweep-wide options (``repeat``, ``warmup``,
    ``backend``, ...)::

        defaults: {model: mlp, mode: inference, repeat: 5}
        benchmarks:
          scaling: {replication: [1, 2, 4, 8], batches_per_step: "1,16,64"}
          pipelined: {model: encoder, layers: 4, stages: [2, 4], batches_per_step: [16]}

    Each benchmark's lists form a product; its settings override ``defaults``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"bench: cannot read the spec {path}: {exc.strerror}.",
                          rule="K-bench-spec") from None
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"bench: the spec {path} must be .yaml, .yml or .toml.",
                              rule="K-bench-spec")
    except (ValueError, ImportError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"bench: the spec {path} does not parse: {exc}",
                          rule="K-bench-spec") from None
    except Exception as exc:  # yaml.YAMLError
        raise ConfigError(f"bench: the spec {path} does not parse: {exc}",
                          rule="K-bench-spec") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), dict) \
            or not data["benchmarks"]:
        raise ConfigError(f"bench: the spec {path} needs a 'benchmarks' table of named "
                          f"benchmarks, e.g. benchmarks: {{scaling: {{replication: [1, 2]}}}}.",
                          rule="K-bench-spec")
    defaults = dict(data.get("defaults") or {})
    defaults.update(overrides or {})
    options = {k: defaults.pop(k) for k in list(defaults) if k not in SETTINGS and k not in AXES}
    variants: list[Variant] = []
    for name, body in data["benchmarks"].items():
        if not isinstance(body, dict):
            raise ConfigError(f"bench: benchmark {name!r} in {path} must be a table of "
                              f"parameters, got {body!r}.", rule="K-bench-spec")
        merged = {**defaults, **body}
        axes = {k: v for k, v in merged.items() if k in AXES}
        settings = {k: v for k, v in merged.items() if k not in AXES}
        variants += product(str(name), axes, settings)
    return variants, options
