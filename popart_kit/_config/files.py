"""Reading configuration files safely: TOML, YAML and JSON into plain data.

Every refusal is a :class:`~popart_kit.errors.ConfigError` that names the file: a file that cannot
be read (missing, a directory, not UTF-8, too large), text the format cannot parse, a key given
twice in one table, YAML aliases that would expand past :data:`MAX_NODES` values, nesting deeper
than :data:`MAX_DEPTH`, and a top level that is not a table. Cost is bounded by the file's size.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError, short

__all__ = ["read", "MAX_BYTES", "MAX_DEPTH", "MAX_NODES"]

MAX_BYTES = 4 * 2**20  # a configuration is a few kilobytes
MAX_DEPTH = 32  # sections, option maps and structs nest three or four levels
MAX_NODES = 100_000  # values after YAML aliases are expanded


def _refuse(path: Path, message: str, rule: str) -> ConfigError:
    return ConfigError(f"{path}: {message}", rule=rule)


def read(path: Path, fmt: str) -> dict[str, Any]:
    """The table of settings in ``path``, a file of format ``fmt`` ("toml", "yaml", "json")."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise _refuse(path, "no such file. Fix: check the path.", "K-file-missing") from None
    except IsADirectoryError:
        raise _refuse(path, "is a directory, not a configuration file. Fix: name a .toml, "
                            ".yaml or .json file.", "K-file-unreadable") from None
    except OSError as err:
        raise _refuse(path, f"cannot be read ({err.strerror or err}). Fix: check the path and "
                            f"its permissions.", "K-file-unreadable") from None
    if len(raw) > MAX_BYTES:
        raise _refuse(path, f"is larger than {MAX_BYTES} bytes, far more than any configuration."
                            f" Fix: name the configuration file.", "K-file-size")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        bad = short(raw[err.start:err.start + 4])
        raise _refuse(path, f"is not UTF-8 text (byte {err.start}: {bad}). Fix: save it as "
                            f"UTF-8.", "K-file-encoding") from None
    try:
        data = {"toml": _toml, "yaml": _yaml, "json": _json}[fmt](text)
    except ConfigError as err:
        raise _refuse(path, str(err), err.rule or "K-file-syntax") from None
    except RecursionError:
        raise _refuse(path, f"nested deeper than {MAX_DEPTH} levels. Fix: a configuration "
                            f"needs a few levels of tables.", "K-file-depth") from None
    except Exception as err:  # each parser has its own error type
        raise _refuse(path, f"not valid {fmt.upper()}: {short(str(err), 300)}",
                      "K-file-syntax") from None
    if not isinstance(data, Mapping):
        raise _refuse(path, f"expected a table of settings at the top level, found "
                            f"{type(data).__name__}.", "K-file-top-level")
    try:
        _check_shape(data)
    except ConfigError as err:
        raise _refuse(path, str(err), err.rule or "K-file-depth") from None
    return dict(data)


def _check_shape(data: Any) -> None:
    """Refuse nesting deeper than MAX_DEPTH or more than MAX_NODES values (shared values counted
    each time they appear), walking at most MAX_NODES values."""
    stack, seen = [(data, 1)], 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise ConfigError(f"holds more than {MAX_NODES} values (YAML aliases expanded). Fix: "
                              f"a configuration needs a few hundred; remove repeated aliases.",
                              rule="K-file-size")
        if depth > MAX_DEPTH:
            raise ConfigError(f"nested deeper than {MAX_DEPTH} levels. Fix: a configuration "
                              f"needs a few levels of tables.", rule="K-file-depth")
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list | tuple):
            stack.extend((v, depth + 1) for v in value)


def _toml(text: str) -> Any:
    import tomllib

    return tomllib.loads(text)  # TOML itself refuses duplicate keys


def _json(text: str) -> Any:
    def table(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ConfigError(f"key {short(key)} is given twice in one table. Fix: keep "
                                  f"one of them.", rule="K-file-duplicate-key")
            out[key] = value
        return out

    return json.loads(text, object_pairs_hook=table)


def _yaml(text: str) -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        """Stops scanning at the first flow collection nested deeper than MAX_DEPTH."""

        def fetch_flow_collection_start(self, token_class: Any) -> None:
            if self.flow_level >= MAX_DEPTH:
                raise ConfigError(f"nested deeper than {MAX_DEPTH} levels (line "
                                  f"{self.line + 1}). Fix: a configuration needs a few levels "
                                  f"of tables.", rule="K-file-depth")
            super().fetch_flow_collection_start(token_class)

    loader = Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_node(node, yaml)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_yaml_node(root: Any, yaml: Any) -> None:
    """Duplicate keys, and the size and depth the document expands to, before constructing it."""
    stack, seen = [(root, 1)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise ConfigError(f"expands to more than {MAX_NODES} values (YAML aliases repeat "
                              f"what they name). Fix: a configuration needs a few hundred; "
                              f"remove repeated aliases.", rule="K-file-size")
        if depth > MAX_DEPTH:
            raise ConfigError(f"nested deeper than {MAX_DEPTH} levels. Fix: a configuration "
                              f"needs a few levels of tables.", rule="K-file-depth")
        if isinstance(node, yaml.MappingNode):
            keys: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    ident = (key.tag, key.value)
                    if ident in keys:
                        raise ConfigError(
                            f"key {short(key.value)} is given twice in one table (line "
                            f"{keys[ident] + 1} and line {key.start_mark.line + 1}). Fix: keep "
                            f"one of them.", rule="K-file-duplicate-key")
                    keys[ident] = key.start_mark.line
                stack.append((key, depth + 1))
                stack.append((value, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, depth + 1) for v in node.value)
