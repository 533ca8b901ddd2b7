"""popart-kit: command-line entry points.

Exit codes: 0 success; 2 the input was refused (a bad config, model, file or argument), with every
problem printed and never a traceback.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console

from ._base.problems import PopartKitWarning
from ._base.render import problems_view
from ._config.plan import plan_view
from ._config.session_config import SessionConfig
from .errors import ConfigError, PopartKitError, clip

__all__ = ["main"]

REFUSED = 2  # exit code for input the kit refuses
LISTED = 20  # problems listed at most; the title gives the count of the rest


def _loc(error: dict) -> str:
    return ".".join(str(part) for part in error["loc"]) or "(config)"


def _problems(err: Console, title: str, rows: list[tuple[str, str]]) -> None:
    """Print ``title`` and the first LISTED ``rows``, one problem per line, whole, whatever the
    terminal width."""
    if len(rows) > LISTED:
        title = f"{title} (the first {LISTED} of {len(rows):,} problems)"
    err.print(problems_view(title, rows[:LISTED]), soft_wrap=True)


def _load(path: str, err: Console, as_json: bool = False) -> SessionConfig | None:
    """The config at ``path``, or None after printing every problem it has (as JSON on stdout
    when ``as_json``)."""
    try:
        return SessionConfig.from_file(path)
    except PopartKitError as exc:
        if as_json:
            _json_problems(path, _entries(exc))
        else:
            _report(err, path, exc)
    return None


def _entries(exc: PopartKitError) -> list[dict[str, str]]:
    """Every problem of ``exc`` as ``{"loc", "rule", "message"}``."""
    if isinstance(exc, ValidationError):
        return [{"loc": _loc(e), "rule": e["type"].removeprefix("popart_kit."),
                 "message": clip(e["msg"], 2000)} for e in exc.errors(include_url=False)]
    return [{"loc": "(file)", "rule": exc.rule or "", "message": clip(str(exc), 2000)}]


def _with_docs(problem: dict[str, str]) -> str:
    """A problem's message ending as every refusal's does: ``(see docs/rules.md#<rule>)``."""
    message, rule = problem["message"], problem["rule"]
    if not rule or "(see docs/rules.md#" in message:
        return message
    return f"{message} (see docs/rules.md#{rule})"


def _json_problems(source: str, problems: list[dict[str, str]],
                   warnings: list[dict[str, str]] = ()) -> None:
    """The refusal as JSON on stdout: ``{"ok": false, "source", "problems", "warnings"}``."""
    print(json.dumps({"ok": False, "source": source, "problems": problems,
                      "warnings": list(warnings)}, indent=2))


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
    if args.all_replicas and not args.json:
        _problems(err, "popart-kit plan", [("--all-replicas", (
            "it lists every replica in the JSON plan, and the tables show only this "
            "instance's. Fix: add --json, or leave --all-replicas out."))])
        return REFUSED
    cfg = _load(args.config, err, args.json)
    if cfg is None:
        return REFUSED
    if args.instance is not None:
        rep = cfg.replication
        if not 0 <= args.instance < rep.instances:
            message = (f"instance {args.instance} does not exist: the config describes "
                       f"{rep.instances} instance(s), 0..{rep.instances - 1}.")
            if args.json:
                _json_problems(args.config, [{"loc": "--instance", "rule": "K-cli-instance",
                                              "message": message}])
            else:
                _problems(err, args.config, [("--instance", message)])
            return REFUSED
        cfg = cfg.updated(replication=rep.model_copy(
            update={"global_offset": args.instance * rep.local_factor}))
    plan = cfg.plan()
    if args.json:
        print(json.dumps(plan.to_dict("all" if args.all_replicas else "instance"), indent=2))
    else:
        out.print(plan_view(plan))
    return 0


@_quietly
def _check(args: argparse.Namespace) -> int:
    """The model's device allocation and every problem of the model under the config."""
    from ._model.checks import model_problems
    from ._model.layout import PipelineLayout, allocation_view, load_model

    out, err = Console(), Console(stderr=True)
    as_json = args.json

    def refuse(title: str, problems: list[dict[str, str]], warned: list = ()) -> int:
        if as_json:
            _json_problems(title, problems, warned)
        else:
            _problems(err, title, [(p["loc"], _with_docs(p)) for p in problems])
        return REFUSED

    def rows(found: list) -> list[dict[str, str]]:
        return [{"loc": p.dotted, "rule": p.rule, "message": p.text()} for p in found]

    cfg = _load(args.config, err, as_json) if args.config else None
    if args.config and cfg is None:
        return REFUSED
    try:
        model = load_model(args.model)
    except PopartKitError as exc:
        return refuse(args.model, _entries(exc))
    invalid = [p for p in model_problems(model) if p.severity == "error"]
    if invalid:
        return refuse(f"{args.model} is not a valid ONNX model", rows(invalid))
    try:
        layout = PipelineLayout.from_model(model)
    except PopartKitError as exc:
        return refuse(args.model, _entries(exc))
    # without a config, a model annotated with stages is judged as the pipeline it is for
    found = (layout.problems(cfg) if cfg is not None else
             layout.stage_problems() if any(op.stage is not None for op in layout.ops) else [])
    errors = [p for p in found if p.severity == "error"]
    warned = [p for p in found if p.severity == "warning"]
    if errors:
        return refuse(f"{args.model} under {args.config}", rows(errors), rows(warned))
    if as_json:
        print(json.dumps({"ok": True, "source": args.model, "problems": [],
                          "warnings": rows(warned),
                          "forward_stages": layout.forward_stages,
                          "depth": {"inference": layout.depth(training=False),
                                    "training": layout.depth(training=True)}}, indent=2))
        return 0
    out.print(allocation_view(layout))
    out.print(f"forward stages {layout.forward_stages}; depth {layout.depth(training=False)} "
              f"in inference, {layout.depth(training=True)} in training")
    for p in warned:
        err.print(f"[yellow]warning[/yellow] {p}", soft_wrap=True)
    if cfg is not None:
        out.print(f"[green]{args.model} fits {args.config}[/green]")
    return 0


@_quietly
def _poprun(args: argparse.Namespace) -> int:
    """The setup commands, then the poprun command line, as a shell script."""
    cfg = _load(args.config, Console(stderr=True))
    if cfg is None:
        return REFUSED
    if not args.program:
        raise ConfigError("no program: give it after '--', e.g. popart-kit poprun CONFIG -- "
                          "python3 train.py", rule="K-launch-program")
    command = cfg.plan().poprun_command(args.program, poprun_args=args.poprun_arg or ())
    for line in args.setup or ():
        print(line)
    print(shlex.join(command))
    return 0


@_quietly
def _ipujob(args: argparse.Namespace) -> int:
    """A Kubernetes IPUJob as YAML on stdout, for ``kubectl create -f -``."""
    from ._config.job_artefacts import k8s_name

    cfg = _load(args.config, Console(stderr=True))
    if cfg is None:
        return REFUSED
    if not args.program:
        raise ConfigError("no program: give it after '--', e.g. popart-kit ipujob CONFIG "
                          "--image IMAGE -- python3 train.py", rule="K-launch-program")
    name = args.name if args.name is not None else k8s_name(Path(args.config).stem)
    sys.stdout.write(cfg.plan().ipujob_yaml(
        args.image, args.program, name, setup=args.setup or (),
        poprun_args=args.poprun_arg or (), cpu=args.cpu, memory=args.memory,
        shm_size=args.shm_size))
    return 0


@_quietly
def _slurm(args: argparse.Namespace) -> int:
    """A SLURM batch script on stdout, for ``sbatch``."""
    from ._config.job_artefacts import k8s_name

    cfg = _load(args.config, Console(stderr=True))
    if cfg is None:
        return REFUSED
    name = args.job_name if args.job_name is not None else k8s_name(Path(args.config).stem)
    sys.stdout.write(cfg.plan().slurm_script(
        args.program, job_name=name, nodes=args.nodes, cpus_per_task=args.cpus_per_task,
        time=args.time, port=args.port, setup=args.setup or ()))
    return 0


@_quietly
def _k8sjob(args: argparse.Namespace) -> int:
    """A Kubernetes Indexed Job, its headless Service and Secret as YAML on stdout."""
    import secrets

    from ._config.job_artefacts import SECRET_BYTES, k8s_job_name

    cfg = _load(args.config, Console(stderr=True))
    if cfg is None:
        return REFUSED
    plan = cfg.plan()
    name = args.name if args.name is not None else k8s_job_name(Path(args.config).stem,
                                                                 plan.instances)
    secret = None if args.existing_secret else secrets.token_hex(SECRET_BYTES)
    sys.stdout.write(plan.k8s_job_yaml(
        args.image, args.program, name, port=args.port, setup=args.setup or (), cpu=args.cpu,
        memory=args.memory, secret=secret))
    return 0


def _report_dir(args: argparse.Namespace) -> int:
    """A table of what an xla session wrote to profiling.auto_report_dir."""
    from rich.table import Table

    from ._runtime.xla.profiling import summary

    table = Table(title=f"xla profile: {args.dir}")
    table.add_column("what")
    table.add_column("value", justify="right")
    for what, value in summary(args.dir):
        table.add_row(what, value)
    Console().print(table, soft_wrap=True)
    return 0


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(SessionConfig.model_json_schema(), indent=2))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="popart-kit", description=__doc__)
    parser.add_argument("--version", action="version", version=f"popart-kit {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="validate a config and show its plan")
    plan.add_argument("config", help="a SessionConfig file (.toml, .yaml, .json)")
    plan.add_argument("--json", action="store_true",
                      help="print the plan, or every problem, as JSON on stdout")
    plan.add_argument("--instance", type=int, default=None,
                      help="show the plan of this instance of a distributed config")
    plan.add_argument("--all-replicas", action="store_true",
                      help="with --json, list every replica's placement, not only this "
                           "instance's (the rule for the rest is always there)")
    plan.set_defaults(run=_plan)
    check = commands.add_parser("check", help="show a model's pipeline stages and IPUs, and "
                                              "check them against a config")
    check.add_argument("model", help="an ONNX model (.onnx)")
    check.add_argument("--config", help="a SessionConfig file to check the model against")
    check.add_argument("--json", action="store_true",
                       help="print the result, or every problem, as JSON on stdout")
    check.set_defaults(run=_check)
    launch_note = ("Arguments starting with '-' are given with '=': --setup='cd /app', "
                   "--poprun-arg=--vv, --poprun-arg=--mpi-global-args=--tag-output.")
    poprun = commands.add_parser(
        "poprun", help="print the poprun command of a config (after its setup commands)",
        usage="popart-kit poprun CONFIG [--setup CMD ...] [--poprun-arg ARG ...] -- PROGRAM "
              "ARGS", epilog=launch_note)
    poprun.add_argument("config", help="a SessionConfig file")
    _launch_arguments(poprun)
    poprun.set_defaults(run=_poprun)
    ipujob = commands.add_parser(
        "ipujob", help="print a Kubernetes IPUJob (YAML) that runs the program on the config's "
                       "topology: pipe it to kubectl create -f -",
        usage="popart-kit ipujob CONFIG --image IMAGE [--name NAME] [--setup CMD ...] "
              "[--poprun-arg ARG ...] [--memory 200Gi] [--cpu N] -- PROGRAM ARGS",
        epilog=launch_note)
    ipujob.add_argument("config", help="a SessionConfig file")
    ipujob.add_argument("--image", required=True, help="container image, e.g. "
                                                       "graphcore/pytorch:3.3.0")
    ipujob.add_argument("--name", help="job and container name (a DNS-1123 label); default: "
                                       "from the config file's name")
    ipujob.add_argument("--memory", default="200Gi", help="memory limit (default 200Gi)")
    ipujob.add_argument("--cpu", type=int, default=32, help="CPU limit (default 32)")
    ipujob.add_argument("--shm-size", default="10Gi", help="/dev/shm size (default 10Gi)")
    _launch_arguments(ipujob)
    ipujob.set_defaults(run=_ipujob)
    report = commands.add_parser("report", help="summarise the profile an xla session wrote to "
                                                "profiling.auto_report_dir")
    report.add_argument("dir", help="the profiling.auto_report_dir of a session")
    report.set_defaults(run=_report_dir)
    schema = commands.add_parser("schema", help="print the SessionConfig JSON Schema")
    schema.set_defaults(run=_schema)
    run = commands.add_parser("run", help="run a PopART program unchanged: 'import popart' "
                                          "gives popart_kit.popart (xla runtime, no IPU)")
    run.add_argument("script", help="the Python program")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    run.set_defaults(run=_run_script)
    _add_job_scripts(commands)
    _add_launch(commands)
    _add_bench(commands)
    return parser


def _add_job_scripts(commands: argparse._SubParsersAction) -> None:
    """`popart-kit slurm` and `popart-kit k8sjob`: the embedded runtime's instances over several
    hosts, started by SLURM or Kubernetes."""
    from ._config.cluster import SLURM_BASE_PORT
    from ._config.job_artefacts import PORT

    note = ("Each instance learns its index from the launcher (SLURM_PROCID, "
            "JOB_COMPLETION_INDEX); see docs/hosts.md. Setup commands starting with '-' are "
            "given with '=': --setup='-x'.")
    slurm = commands.add_parser(
        "slurm", help="print a SLURM batch script that runs the program once per instance: "
                      "pipe it to sbatch",
        usage="popart-kit slurm CONFIG [--nodes N] [--cpus-per-task N] [--time T] "
              "[--job-name NAME] [--port P] [--setup CMD ...] -- PROGRAM ARGS", epilog=note)
    slurm.add_argument("config", help="a SessionConfig file")
    slurm.add_argument("--nodes", type=int, default=None,
                       help="hosts the instances are split over (default: one per instance)")
    slurm.add_argument("--cpus-per-task", type=int, default=None,
                       help="cores for each instance (default: SLURM's)")
    slurm.add_argument("--time", default=None, help="time limit, e.g. 2:00:00 (default: the "
                                                    "partition's)")
    slurm.add_argument("--job-name", default=None,
                       help="job name; default: from the config file's name")
    k8sjob = commands.add_parser(
        "k8sjob", help="print a Kubernetes Indexed Job (YAML, with its headless Service and "
                       "Secret) that runs the program once per instance: pipe it to "
                       "kubectl apply -f -",
        usage="popart-kit k8sjob CONFIG --image IMAGE [--name NAME] [--port P] [--cpu N] "
              "[--memory Q] [--existing-secret] [--setup CMD ...] -- PROGRAM ARGS",
        epilog=note)
    k8sjob.add_argument("config", help="a SessionConfig file")
    k8sjob.add_argument("--image", required=True, help="container image with the program and "
                                                       "popart_kit")
    k8sjob.add_argument("--name", help="Job and Service name (a DNS-1035 label); default: from "
                                       "the config file's name")
    k8sjob.add_argument("--cpu", type=int, default=None, help="CPU limit of each pod")
    k8sjob.add_argument("--memory", default=None, help="memory limit of each pod, e.g. 16Gi")
    k8sjob.add_argument("--existing-secret", action="store_true",
                        help="use the Secret NAME-secret made with kubectl create secret "
                             "instead of a new random one in the YAML")
    slurm.add_argument("--port", type=int, default=None, help=f"instance 0's coordinator "
                       f"port (default: {SLURM_BASE_PORT} + SLURM_JOB_ID %% 4096, one per job)")
    k8sjob.add_argument("--port", type=int, default=PORT,
                        help=f"instance 0's coordinator port (default {PORT})")
    for parser, run in ((slurm, _slurm), (k8sjob, _k8sjob)):
        parser.add_argument("--setup", action="append", metavar="CMD",
                            help="a shell command run before the program (repeatable, in order)")
        parser.set_defaults(run=run, program=[])


def _add_bench(commands: argparse._SubParsersAction) -> None:
    """`popart-kit bench`: a sweep, its results (JSON, CSV, PNG), redrawn or compared."""
    bench = commands.add_parser(
        "bench", help="sweep replication, batches per step, accumulation, stages and instances "
                      "over a model; write results.json, results.csv and PNG plots",
        description="Lists are comma-separated: --replication 1,2,4,8 --batches-per-step 1,16,64."
                    " Every combination is a variant.")
    what = bench.add_argument_group("what to run")
    what.add_argument("--model", default="mlp", choices=("mlp", "convnet", "encoder"),
                      help="a built-in model (default mlp)")
    what.add_argument("--onnx", metavar="MODEL.onnx", help="time this ONNX model instead")
    what.add_argument("--loss", help="the loss tensor of --onnx when training")
    what.add_argument("--mode", default="inference", choices=("inference", "training"),
                      help="time inference runs, or training steps (default inference)")
    what.add_argument("--spec", metavar="FILE", help="named variants from a YAML/TOML spec")
    for flag, default in (("--replication", "1"), ("--batches-per-step", "1"),
                          ("--accumulation", "1"), ("--stages", "1"), ("--instances", "1"),
                          ("--micro-batch", "16")):
        what.add_argument(flag, default=default, metavar="N,N,...",
                          help=f"values to sweep (default {default})")
    sizes = bench.add_argument_group("built-in model sizes")
    sizes.add_argument("--width", type=int, default=256, help="features / channels / d_model")
    sizes.add_argument("--layers", type=int, default=2, help="hidden layers, conv or encoder "
                                                             "blocks (>= stages)")
    sizes.add_argument("--seq", type=int, default=32, help="encoder sequence length")
    sizes.add_argument("--heads", type=int, default=4, help="encoder attention heads")
    sizes.add_argument("--image", type=int, default=16, help="convnet image side")
    how = bench.add_argument_group("how")
    how.add_argument("--backend", default="xla", choices=("xla", "popart"),
                     help="xla: the embedded runtime; popart: the Poplar SDK (default xla)")
    how.add_argument("--repeat", type=int, default=5, help="timed runs per variant")
    how.add_argument("--warmup", type=int, default=1, help="uncounted runs after the first")
    how.add_argument("--no-baselines", action="store_true",
                     help="skip the hand-written JAX and onnxruntime baselines")
    how.add_argument("--skip-invalid", action="store_true",
                     help="record invalid combinations as skipped instead of refusing the sweep")
    how.add_argument("--instance-timeout", type=float, default=300.0, metavar="SECONDS",
                     help="bound on each multi-instance variant")
    how.add_argument("--no-progress", action="store_true",
                     help="print no progress line per variant")
    how.add_argument("--out", default=None, metavar="DIR",
                     help="where results.json, results.csv and the plots go (default "
                          "bench-results)")
    saved = bench.add_argument_group("saved results")
    saved.add_argument("--plot", metavar="RESULTS.json",
                       help="redraw the plots of saved results (into --out if given, else "
                            "next to the file)")
    saved.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                       help="compare two saved results variant by variant (B / A)")
    bench.set_defaults(run=_bench, bench_parser=bench)


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    out = Console()
    out = Console(width=max(out.width, 160))  # the table's columns, unclipped in a pipe
    if args.compare:
        a, b = (bench.load(p) for p in args.compare)
        from rich.table import Table

        for label, data, path in (("A", a, args.compare[0]), ("B", b, args.compare[1])):
            machine = data.get("machine") or {}
            out.print(f"{label}: {path}: {bench.describe(machine) if machine else '?'}"
                      f" (commit {machine.get('commit')})", soft_wrap=True)
        table = Table(show_edge=False)
        for col in ("variant", "A samples/s", "B samples/s", "A step ms", "B step ms", "B / A"):
            table.add_column(col, justify="left" if col == "variant" else "right")
        for row in bench.compare(a, b):
            table.add_row(row["name"], f"{row['a_samples_per_s']:,.0f}",
                          f"{row['b_samples_per_s']:,.0f}", f"{row['a_step_ms']:.2f}",
                          f"{row['b_step_ms']:.2f}", f"{row['ratio']:.2f}x")
        out.print(table)
        return 0
    if args.plot:
        for path in bench.redraw(args.plot, args.out):
            out.print(str(path))
        return 0
    results = bench.sweep(
        model=args.model, mode=args.mode, onnx=args.onnx, loss=args.loss,
        replication=args.replication, batches_per_step=args.batches_per_step,
        accumulation=args.accumulation, stages=args.stages, instances=args.instances,
        micro_batch=args.micro_batch, width=args.width, layers=args.layers, seq=args.seq,
        heads=args.heads, image=args.image, spec=args.spec, backend=args.backend,
        repeat=args.repeat, warmup=args.warmup, baselines=not args.no_baselines,
        skip_invalid=args.skip_invalid, progress=not args.no_progress,
        instance_timeout=args.instance_timeout, out=args.out or "bench-results")
    out.print(bench.table(results["variants"]))
    out.print(f"machine: {bench.describe(results['machine'])}", soft_wrap=True)
    for row in results["variants"]:
        if row.get("note"):
            out.print(f"[yellow]{row['status']}[/yellow] {row['name']}: {row['note']}",
                      soft_wrap=True)
    out.print(f"wrote {args.out or 'bench-results'}/results.json, results.csv and plots")
    return 0


def _launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--setup", action="append", metavar="CMD",
                        help="a shell command run before poprun (repeatable, in order)")
    parser.add_argument("--poprun-arg", action="append", metavar="ARG",
                        help="an extra poprun argument (repeatable)")
    parser.set_defaults(program=[])


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("popart-kit")
    except PackageNotFoundError:  # run from a source tree
        from . import __version__

        return __version__


def _add_launch(commands: argparse._SubParsersAction) -> None:
    """`popart-kit launch`: poprun's option names, the xla backend's instances on this host."""
    from ._config.popdist import FAULT_TIMEOUT, START_TIMEOUT

    launch = commands.add_parser(
        "launch", help="start the instances of a distributed session as poprun would "
                       "(POPDIST_* environment, one process per instance)")
    launch.add_argument("--num-instances", type=int, required=True, help="instances (processes)")
    launch.add_argument("--num-replicas", type=int, required=True,
                        help="replicas over all instances")
    launch.add_argument("--ipus-per-replica", type=int, default=1,
                        help="IPUs each replica spans (default 1); with --num-replicas it "
                             "sizes each instance's device")
    launch.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                        help="where instance 0 listens (default: a free port on 127.0.0.1)")
    launch.add_argument("--host", default=None, metavar="HOST,HOST,...",
                        help="hosts the instances are split over (run one launch per host)")
    launch.add_argument("--host-index", type=int, default=0,
                        help="which of --host this launch starts the instances of")
    launch.add_argument("--fault-timeout", type=float, default=FAULT_TIMEOUT, metavar="SECONDS",
                        help="how long instances take to notice a stopped or hung one (they "
                             "end with status 3), and the others get to stop before they are "
                             "stopped")
    launch.add_argument("--start-timeout", type=float, default=START_TIMEOUT, metavar="SECONDS",
                        help="how long the instances wait for each other to start (default "
                             f"{START_TIMEOUT:g}; a slow host may load for minutes)")
    launch.add_argument("--secret-file", metavar="FILE", default=None,
                        help="the job's secret, which every instance proves to join: the same "
                             "file on each host (default: POPART_KIT_JOB_SECRET, else a random "
                             "one per launch; several hosts need one)")
    launch.add_argument("--print-topology", choices=("yes", "no"), default="no", nargs="?",
                        const="yes", help="print a table of hosts, instances, replicas and "
                                          "their IPUs before starting (as poprun does)")
    launch.add_argument("--only-output-from-instance", type=int, default=None, metavar="N",
                        help="show only instance N's output (the others' is dropped; errors "
                             "still end the launch)")
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
                      start_timeout=args.start_timeout, secret_file=args.secret_file,
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
    argv = list(sys.argv[1:] if argv is None else argv)
    program: list[str] = []
    if argv[:1] in (["poprun"], ["ipujob"], ["slurm"], ["k8sjob"]) and "--" in argv:
        cut = argv.index("--")
        argv, program = argv[:cut], argv[cut + 1:]
    args = _parser().parse_args(argv)
    if program:
        args.program = program
    try:
        return args.run(args)
    except PopartKitError as exc:  # a refusal a command did not report itself
        if isinstance(exc, ValidationError):  # every problem, under the title naming the file
            _report(Console(stderr=True), clip(exc.title, 2000), exc)
        else:
            _problems(Console(stderr=True), "refused", [("(input)", clip(str(exc), 2000))])
        return REFUSED


if __name__ == "__main__":
    sys.exit(main())
