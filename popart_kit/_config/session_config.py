"""SessionConfig: one typed, validated description of a PopART session.

The fields and sections are :mod:`popart_kit._config.fields`; this class adds the rules over
the whole session (:mod:`popart_kit._config.rules`) and what is derived from it - the plan,
PopART's SessionOptions, poprun's environment, host array shapes and config files - so that
everything below it takes a description as an argument and nothing imports this module back.
Constructing an invalid configuration raises one :class:`~popart_kit.errors.InvalidConfig` (a
``ValueError`` and a pydantic ``ValidationError``) that lists every violated rule with its
field, its numbers and its fix; nothing is compiled or acquired before that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import model_validator

from .._base import shapes
from .._base.atomic import write_atomic
from .._base.problems import emit_warnings, raise_errors
from ..errors import ConfigError, InvalidConfig
from . import files as _config_files
from . import mapping as _mapping
from .cluster import popdist_env
from .fields import Accumulation, Device, Pipeline, Precision, Profiling, Replication, SessionFields
from .plan import Plan
from .rules import check_config

__all__ = [
    "SessionConfig",
    "Replication",
    "Accumulation",
    "Pipeline",
    "Device",
    "Precision",
    "Profiling",
]

_FORMATS = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}


def _format_of(path: Path) -> str:
    try:
        return _FORMATS[path.suffix.lower()]
    except KeyError:
        raise ConfigError(
            f"{path}: unknown configuration format {path.suffix!r}; "
            f"use one of {', '.join(sorted(_FORMATS))}.", rule="K-file-format") from None


class SessionConfig(SessionFields):
    """A whole PopART session: mode, batching, topology, device and extra PopART options."""

    @model_validator(mode="after")
    def _check(self) -> SessionConfig:
        problems = check_config(self)
        raise_errors("SessionConfig", problems)
        self._warnings = tuple(p for p in problems if p.severity == "warning")
        emit_warnings(self._warnings)
        return self

    def plan(self) -> Plan:
        """The derived topology, batch, pipeline and sync-group numbers."""
        return Plan.from_config(self)

    def with_popdist_env(self, env: Mapping[str, str] | None = None) -> SessionConfig:
        """A copy whose replication and ipus_per_replica come from poprun's environment."""
        return popdist_env(env).apply(self)

    # -- PopART mapping ---------------------------------------------------------------------

    def to_popart_dict(self) -> dict[str, Any]:
        """``{SessionOptions attribute: value}`` for every option the kit controls, plus
        ``popart_options``; enum values are PopART member names, map options ``dict[str, str]``."""
        return _mapping.to_popart_dict(self)

    def device_request(self) -> dict[str, Any]:
        """Keyword arguments for ``popart.DeviceManager().acquireAvailableDevice``."""
        return _mapping.device_request(self)

    def to_session_options(self, popart: Any = None) -> Any:
        """A real ``popart.SessionOptions`` (imports the Poplar SDK's popart when not given)."""
        return _mapping.to_session_options(self, popart)

    @classmethod
    def from_session_options(cls, opts: Any, **rest: Any) -> SessionConfig:
        """The config whose ``to_popart_dict`` gives ``opts`` (a SessionOptions or a mapping).

        ``rest`` supplies what SessionOptions does not hold (mode, batches_per_step,
        ipus_per_replica, device, micro_batch_size, pipeline stages); section dicts merge."""
        return _mapping.from_session_options(cls, opts, rest)

    # -- host array shapes ------------------------------------------------------------------

    def input_shape(self, shape: Sequence[int], broadcast: bool = False) -> tuple[int, ...]:
        """This instance's host array for an input of tensor shape ``shape``, per run."""
        return shapes.input_shape(shape, self.batches_per_step, self.accumulation.factor,
                                  self.replication.local_factor, broadcast)

    def anchor_shape(self, shape: Sequence[int], art: Any = "All") -> tuple[int, ...]:
        """This instance's host array for an anchor of tensor shape ``shape``, per run."""
        return shapes.anchor_shape(shape, art, self.batches_per_step,
                                   self.accumulation.factor, self.replication.local_factor)

    # -- files ------------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> SessionConfig:
        """Read a TOML, YAML or JSON file (chosen by suffix). Refuses, naming the file: a file
        that cannot be read, duplicate keys, YAML aliases that expand too far, nesting deeper
        than a configuration needs, and anything but a table at the top level."""
        path = Path(path)
        data = _config_files.read(path, _format_of(path))
        try:
            return cls.model_validate(data)
        except InvalidConfig as err:
            raise InvalidConfig.wrap_titled(err, str(path)) from None

    def to_file(self, path: str | Path) -> Path:
        """Write TOML, YAML or JSON (chosen by suffix); unset optional fields are left out. The
        file is replaced whole or not at all (:class:`~popart_kit.FileWriteError` otherwise)."""
        path = Path(path)
        fmt = _format_of(path)
        data = self.model_dump(mode="json", exclude_none=True)
        if fmt == "toml":
            import tomli_w

            text = tomli_w.dumps(data)
        elif fmt == "yaml":
            import yaml

            text = yaml.safe_dump(data, sort_keys=False)
        else:
            text = json.dumps(data, indent=2) + "\n"
        return write_atomic(path, text)


