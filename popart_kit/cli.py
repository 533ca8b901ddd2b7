"""popart-kit: command-line entry points.

Exit codes: 0 success; 2 the input was refused (a bad config, model, file or argument), with every
problem printed and never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable, Sequence

from pydantic import ValidationError
from rich.console import Console

from ._problems import PopartKitWarning
from .errors import PopartKitError, clip
from ._render import allocation_view, plan_view, problems_view
from .config import SessionConfig

__all__ = ["main"]

REFUSED = 2  # exit code for input the kit refuses


def _loc(error: dict) -> str:
    return ".".join(str(part) for part in error["loc"]) or "(config)"


def _problems(err: Console, title: str, rows: list[tuple[str, str]]) -> None:
    # soft_wrap: one problem per line, whole, whatever the terminal width
    err.print(problems_view(title, rows), soft_wrap=True)


def _load(path: str, err: Console) -> SessionConfig | None:
    """The config at ``path``, or None after printing every problem it has."""
    try:
        return SessionConfig.from_file(path)
    except PopartKitError as exc:
        _report(err, path, exc)
    return None


def _report(err: Console, title: str, exc: PopartKitError) -> None:
    if isinstance(exc, ValidationError):
        _problems(err, title, [(_loc(e), clip(e["msg"], 2000)) for e in exc.errors()])
    else:
        _problems(err, title, [("(file)", clip(str(exc), 2000))])


def _quietly(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run a command with PopartKitWarnings silenced: the command prints them itself."""

    def run(args: argparse.Namespace) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PopartKitWarning)
            return command(args)

    return run


@_quietly
def _plan(args: argparse.Namespace) -> int:
    return _show_plan(args)


def _show_plan(args: argparse.Namespace) -> int:
    out, err = Console(), Console(stderr=True)
    cfg = _load(args.config, err)
    if cfg is None:
        return REFUSED
    if args.instance is not None:
        rep = cfg.replication
        if not 0 <= args.instance < rep.instances:
            _problems(err, args.config, [(
                "--instance", f"instance {args.instance} does not exist: the config describes "
                              f"{rep.instances} instance(s), 0..{rep.instances - 1}.")])
            return REFUSED
        cfg = cfg.updated(replication=rep.model_copy(
            update={"global_offset": args.instance * rep.local_factor}))
    plan = cfg.plan()
    if args.json:
        out.print_json(json.dumps(plan.to_dict()))
    else:
        out.print(plan_view(plan))
    return 0


@_quietly
def _check(args: argparse.Namespace) -> int:
    """The model's device allocation and every problem of the model under the config."""
    from ._model_check import model_problems
    from .layout import PipelineLayout, load_model

    out, err = Console(), Console(stderr=True)
    cfg = _load(args.config, err) if args.config else None
    if args.config and cfg is None:
        return REFUSED
    try:
        model = load_model(args.model)
    except PopartKitError as exc:
        _report(err, args.model, exc)
        return REFUSED
    invalid = [(p.dotted, f"{p.text()} [{p.rule}]") for p in model_problems(model)
               if p.severity == "error"]
    if invalid:
        _problems(err, f"{args.model} is not a valid ONNX model", invalid)
        return REFUSED
    try:
        layout = PipelineLayout.from_model(model)
    except PopartKitError as exc:
        _report(err, args.model, exc)
        return REFUSED
    out.print(allocation_view(layout))
    out.print(f"forward stages {layout.forward_stages}; depth {layout.depth(training=False)} "
              f"in inference, {layout.depth(training=True)} in training")
    if cfg is None:
        return 0
    found = layout.problems(cfg)
    errors = [(p.dotted, p.text()) for p in found if p.severity == "error"]
    for p in found:
        if p.severity == "warning":
            err.print(f"[yellow]warning[/yellow] {p}", soft_wrap=True)
    if errors:
        _problems(err, f"{args.model} under {args.config}", errors)
        return REFUSED
    out.print(f"[green]{args.model} fits {args.config}[/green]")
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
    check = commands.add_parser("check", help="show a model's pipeline stages and IPUs, and "
                                              "check them against a config")
    check.add_argument("model", help="an ONNX model (.onnx)")
    check.add_argument("--config", help="a SessionConfig file to check the model against")
    check.set_defaults(run=_check)
    schema = commands.add_parser("schema", help="print the SessionConfig JSON Schema")
    schema.set_defaults(run=_schema)
    run = commands.add_parser("run", help="run a PopART program unchanged: 'import popart' "
                                          "gives popart_kit.popart (xla runtime, no IPU)")
    run.add_argument("script", help="the Python program")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    run.set_defaults(run=_run_script)
    _add_launch(commands)
    return parser


def _add_launch(commands: argparse._SubParsersAction) -> None:
    """`popart-kit launch`: poprun's option names, the xla backend's instances on this host."""
    from .launcher import FAULT_TIMEOUT

    launch = commands.add_parser(
        "launch", help="start the instances of a distributed session as poprun would "
                       "(POPDIST_* environment, one process per instance)")
    launch.add_argument("--num-instances", type=int, required=True, help="instances (processes)")
    launch.add_argument("--num-replicas", type=int, required=True,
                        help="replicas over all instances")
    launch.add_argument("--ipus-per-replica", type=int, default=1)
    launch.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                        help="where instance 0 listens (default: a free port on 127.0.0.1)")
    launch.add_argument("--host", default=None, metavar="HOST,HOST,...",
                        help="hosts the instances are split over (run one launch per host)")
    launch.add_argument("--host-index", type=int, default=0,
                        help="which of --host this launch starts the instances of")
    launch.add_argument("--fault-timeout", type=float, default=FAULT_TIMEOUT, metavar="SECONDS",
                        help="how long instances take to notice a failed or missing one, and "
                             "the others get to stop before they are stopped")
    launch.add_argument("--print-topology", choices=("yes", "no"), default="no", nargs="?",
                        const="yes")
    launch.add_argument("--only-output-from-instance", type=int, default=None)
    launch.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="stop every instance and fail after this long (default: none)")
    launch.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
    launch.set_defaults(run=_launch)


def _launch(args: argparse.Namespace) -> int:
    from .launcher import LaunchError, launch

    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    try:
        return launch(program, num_instances=args.num_instances, num_replicas=args.num_replicas,
                      ipus_per_replica=args.ipus_per_replica, coordinator=args.coordinator,
                      hosts=args.host.split(",") if args.host else (),
                      host_index=args.host_index, fault_timeout=args.fault_timeout,
                      print_topology=args.print_topology == "yes",
                      only_output_from_instance=args.only_output_from_instance,
                      timeout=args.timeout)
    except LaunchError as exc:
        print(str(exc), file=sys.stderr)
        return REFUSED


def _run_script(args: argparse.Namespace) -> int:
    from .popart._script import run_script

    return run_script(args.script, args.script_args)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except PopartKitError as exc:  # a refusal a command did not report itself
        _problems(Console(stderr=True), "refused", [("(input)", clip(str(exc), 2000))])
        return REFUSED


if __name__ == "__main__":
    sys.exit(main())
