"""popart-kit: command-line entry points."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence

from pydantic import ValidationError
from rich.console import Console

from ._problems import PopartKitWarning
from ._render import plan_view, problems_view
from .config import SessionConfig

__all__ = ["main"]


def _loc(error: dict) -> str:
    return ".".join(str(part) for part in error["loc"]) or "(config)"


def _problems(err: Console, title: str, rows: list[tuple[str, str]]) -> None:
    # soft_wrap: one problem per line, whole, whatever the terminal width
    err.print(problems_view(title, rows), soft_wrap=True)


def _load(path: str, err: Console) -> SessionConfig | None:
    """The config at ``path``, or None after printing every problem it has."""
    try:
        return SessionConfig.from_file(path)
    except ValidationError as exc:
        _problems(err, path, [(_loc(e), e["msg"]) for e in exc.errors()])
    except (ValueError, OSError) as exc:
        _problems(err, path, [("(file)", str(exc))])
    return None


def _plan(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PopartKitWarning)  # the plan lists them
        return _show_plan(args)


def _show_plan(args: argparse.Namespace) -> int:
    out, err = Console(), Console(stderr=True)
    cfg = _load(args.config, err)
    if cfg is None:
        return 1
    if args.instance is not None:
        rep = cfg.replication
        if not 0 <= args.instance < rep.instances:
            _problems(err, args.config, [(
                "--instance", f"instance {args.instance} does not exist: the config describes "
                              f"{rep.instances} instance(s), 0..{rep.instances - 1}.")])
            return 1
        cfg = cfg.updated(replication=rep.model_copy(
            update={"global_offset": args.instance * rep.local_factor}))
    plan = cfg.plan()
    if args.json:
        out.print_json(json.dumps(plan.to_dict()))
    else:
        out.print(plan_view(plan))
    return 0


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(SessionConfig.model_json_schema(), indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="popart-kit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="validate a config and show its plan")
    plan.add_argument("config", help="a SessionConfig file (.toml, .yaml, .json)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--instance", type=int, default=None,
                      help="show the plan of this instance of a distributed config")
    plan.set_defaults(run=_plan)
    schema = commands.add_parser("schema", help="print the SessionConfig JSON Schema")
    schema.set_defaults(run=_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
