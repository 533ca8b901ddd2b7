"""Checks and text for launch artefacts: poprun programs, SLURM batch scripts, Kubernetes names,
quantities and Indexed Jobs, YAML.

Pure string work: what :meth:`Plan.poprun_command`, :meth:`Plan.ipujob_manifest`,
:meth:`Plan.slurm_script` and :meth:`Plan.k8s_job_manifests` refuse before a job reaches a
cluster, the script ``sbatch`` runs and the YAML that ``kubectl create -f -`` or
``kubectl apply -f -`` reads. Each instance of a SLURM or Kubernetes job learns the job-wide facts
(:func:`job_environment`) from the artefact and its index from the launcher (``SLURM_PROCID``,
``JOB_COMPLETION_INDEX``).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, short
from .cluster import NUM_INSTANCES, SLURM_BASE_PORT
from .popdist import COORDINATOR, IPUS, SECRET, TOTAL

# The functions below read a Plan (``plan``: instances, replicas, IPUs, sizes) without importing
# its module, which sits above this one and calls them.
Plan = Any

__all__ = ["program_args", "check_poprun_args", "check_k8s", "k8s_name", "k8s_job_name", "to_yaml",
           "job_environment", "slurm_script", "k8s_job_manifests", "PORT", "JOB_NAME",
           "SECRET_BYTES"]

PORT = 29500  # instance 0's coordinator port in a Kubernetes job (torchrun's default)
JOB_NAME = "popart-kit-job"  # a job's name when nothing else gives one
SECRET_BYTES = 32  # random bytes of a job secret the kit makes (written as hex)

# a launcher starts one program; these split a shell line into several commands
_SHELL_OPERATORS = {";", "&&", "||", "|", "&", ";;", "\n"}
# a Kubernetes DNS-1123 label: lower-case alphanumerics and '-', alphanumeric at both ends
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# a DNS-1035 label (a Service's name): the same, starting with a letter
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL = 63  # characters in a DNS label
# generateName appends 5 characters after the name and '-', and the name is a 63-char label
MAX_NAME = _LABEL - 6
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_KIT_POPRUN = {"--num-instances": "replication (instances)",
               "--num-replicas": "replication.global_factor",
               "--ipus-per-replica": "ipus_per_replica"}
# sbatch's --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit
_SLURM_TIME = re.compile(r"([0-9]+-)?[0-9]+(:[0-9]+){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)
_SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def program_args(program: str | Sequence[str], launcher: str = "poprun") -> list[str]:
    """The program's argv; a string is split as a shell would, and refused when it holds more
    than one command (``launcher`` would start the first word, ``cd``, and hand it the rest)
    or none."""
    if isinstance(program, str):
        lexer = shlex.shlex(program, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        operators = sorted({w for w in lexer if w in _SHELL_OPERATORS} |
                           ({"\n"} if "\n" in program.strip() else set()))
        if operators:
            raise ConfigError(
                f"program {short(program, 100)} holds several shell commands (separated by "
                f"{' '.join(map(repr, operators))}); {launcher} starts one program and would "
                f"pass the rest to it. Fix: give the commands that prepare the job as setup "
                f"commands (setup=[...], or --setup on the command line) and the program alone. "
                f"See docs/rules.md#K-launch-program.", rule="K-launch-program")
        argv = shlex.split(program)
    else:
        argv = [str(a) for a in program]
    if not argv:
        raise ConfigError(f"no program for {launcher} to start. Fix: give one, e.g. 'python3 "
                          f"train.py' (on the command line after '--'). See "
                          f"docs/rules.md#K-launch-program.", rule="K-launch-program")
    return argv


def check_poprun_args(args: Sequence[str]) -> list[str]:
    """Extra poprun arguments, refused where they set what the config decides."""
    args = [str(a) for a in args]
    clash = [a for a in args if a.split("=", 1)[0] in _KIT_POPRUN]
    if clash:
        fields = ", ".join(f"{a} ({_KIT_POPRUN[a.split('=', 1)[0]]})" for a in clash)
        raise ConfigError(f"poprun arguments {clash} are set from the config: {fields}. Fix: "
                          f"change the config, not the arguments. See "
                          f"docs/rules.md#K-launch-poprun-args.", rule="K-launch-poprun-args")
    return args


def k8s_name(text: str, limit: int = MAX_NAME) -> str:
    """``text`` made a valid Kubernetes name of at most ``limit`` characters: lower case, '-'
    for anything else, starting with a letter (so a Service may have it too)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if name and not name[0].isalpha():
        name = f"job-{name}"
    return name[:limit].strip("-") or JOB_NAME


def k8s_job_name(text: str, instances: int) -> str:
    """``text`` made a valid name of an Indexed Job of ``instances`` pods."""
    return k8s_name(text, _job_name_limit(instances))


def _job_name_limit(instances: int) -> int:
    """The longest name of an Indexed Job whose pods' host names append '-<index>'."""
    return _LABEL - len(f"-{instances - 1}")


def check_k8s(name: str, image: str, cpu: Any, memory: str, shm_size: str) -> None:
    """Every problem of an IPUJob's name, image and resources, in one error."""
    problems = _name_problems(name, _DNS1123_LABEL, MAX_NAME, "DNS-1123 label", (
        "starting and ending with a letter or digit", "generateName appends 6"))
    problems += _image_problems(image) + _cpu_problems(cpu)
    problems += _quantity_problems("memory", memory) + _quantity_problems("shm_size", shm_size)
    _refuse("IPUJob", problems, "K-launch-k8s")


def to_yaml(manifest: dict[str, Any] | Sequence[dict[str, Any]]) -> str:
    """``manifest`` as YAML (a sequence as one document each), a multi-line script as a literal
    block (``|``) as people write it."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    documents = [manifest] if isinstance(manifest, dict) else list(manifest)
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                         width=100)


def job_environment(plan: Plan) -> dict[str, str]:
    """What every instance of a job is told alike: the POPDIST_* job-wide facts (each instance's
    local replicas and offset follow from the number of instances and its index)."""
    return {TOTAL: str(plan.global_replicas), IPUS: str(plan.ipus_per_replica)}


def slurm_script(plan: Plan, program: str | Sequence[str], *, job_name: str = JOB_NAME,
                 nodes: int | None = None, cpus_per_task: int | None = None,
                 time: str | None = None, port: int | None = None,
                 setup: Sequence[str] = ()) -> str:
    """A SLURM batch script that runs ``program`` once per instance (one task each) over
    ``nodes`` hosts (default: one instance per host); see :meth:`Plan.slurm_script`."""
    nodes = plan.instances if nodes is None else nodes
    problems = _slurm_problems(plan.instances, job_name, nodes, cpus_per_task, time)
    problems += [] if port is None else _port_problems(port)
    _refuse("SLURM job", problems, "K-launch-slurm")
    argv = program_args(program, "srun")
    directives = {"job-name": job_name, "nodes": nodes, "ntasks": plan.instances,
                  "ntasks-per-node": plan.instances // nodes, "cpus-per-task": cpus_per_task,
                  "time": time}
    cpus = [] if cpus_per_task is None else [f"--cpus-per-task={cpus_per_task}"]
    # by default the port JAX's and the kit's SLURM detection pick, distinct for each job
    port_text = f"$(({SLURM_BASE_PORT} + SLURM_JOB_ID % 4096))" if port is None else port
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH --{key}={value}" for key, value in directives.items() if value is not None),
        f"# popart_kit: {_topology(plan)}; instance = SLURM_PROCID",
        "set -e",
        *_setup_lines(setup),
        *(f"export {key}={value}" for key, value in job_environment(plan).items()),
        'coordinator_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'export {COORDINATOR}="${{coordinator_host:?no host in SLURM_JOB_NODELIST}}:'
        f'{port_text}"',
        f"{SECRET}=$(od -An -N{SECRET_BYTES} -tx1 /dev/urandom | tr -d ' \\n')",
        f"export {SECRET}",
        shlex.join(["srun", "--kill-on-bad-exit=1", *cpus, *argv]),
    ]
    return "\n".join(lines) + "\n"


def k8s_job_manifests(plan: Plan, image: str, command: str | Sequence[str], name: str, *,
                      port: int = PORT, setup: Sequence[str] = (), cpu: int | None = None,
                      memory: str | None = None,
                      secret: str | None = None) -> list[dict[str, Any]]:
    """A headless Service, the job's Secret (when ``secret`` is given) and an Indexed Job of one
    pod per instance; see :meth:`Plan.k8s_job_manifests`."""
    _refuse("Indexed Job", _k8s_job_problems(plan.instances, name, image, port, cpu, memory,
                                             secret), "K-launch-k8s")
    argv = program_args(command, "the pod")
    script = "\n".join([*_setup_lines(setup), "exec " + shlex.join(argv)]) + "\n"
    secret_name = f"{name}-secret"
    env = [{"name": key, "value": value} for key, value in job_environment(plan).items()]
    env += [{"name": NUM_INSTANCES, "value": str(plan.instances)},
            {"name": COORDINATOR, "value": f"{name}-0.{name}:{port}"},
            {"name": SECRET, "valueFrom": {"secretKeyRef": {"name": secret_name,
                                                            "key": SECRET}}}]
    container: dict[str, Any] = {
        "name": name, "image": image, "command": ["/bin/bash", "-c", "--"], "args": [script],
        "env": env, "ports": [{"name": "coordinator", "containerPort": port}]}
    limits = {key: value for key, value in (("cpu", cpu), ("memory", memory)) if value is not None}
    if limits:
        container["resources"] = {"limits": limits}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
               "spec": {"clusterIP": "None", "selector": {"job-name": name},
                        "publishNotReadyAddresses": True,
                        "ports": [{"name": "coordinator", "port": port}]}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
           "spec": {"completionMode": "Indexed", "completions": plan.instances,
                    "parallelism": plan.instances, "backoffLimit": 0,
                    "template": {"spec": {"subdomain": name, "restartPolicy": "Never",
                                          "containers": [container]}}}}
    stored = [] if secret is None else [{
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret_name},
        "type": "Opaque", "stringData": {SECRET: secret}}]
    return [service, *stored, job]


def _k8s_job_problems(instances: int, name: Any, image: Any, port: Any, cpu: Any, memory: Any,
                      secret: Any) -> list[str]:
    """Every problem of an Indexed Job's name, image, port, resources and secret."""
    problems = _name_problems(name, _DNS1035_LABEL, _job_name_limit(instances), "DNS-1035 label",
                              ("starting with a letter and ending with a letter or digit",
                               f"the pods' host names append '-{instances - 1}'"))
    problems += _image_problems(image) + _port_problems(port)
    problems += [] if cpu is None else _cpu_problems(cpu)
    problems += [] if memory is None else _quantity_problems("memory", memory)
    if secret is not None and not (isinstance(secret, str) and secret.isascii() and
                                   secret.isprintable() and secret.strip() == secret != ""):
        problems.append("secret is not a printable ASCII word. Fix: leave it out to use a "
                        "Secret made with kubectl create secret, or give e.g. "
                        f"secrets.token_hex({SECRET_BYTES})")
    return problems


def _topology(plan: Plan) -> str:
    return (f"{plan.instances} instance(s) x {plan.local_replicas} replica(s) x "
            f"{plan.ipus_per_replica} IPU(s) per replica")


def _setup_lines(setup: Sequence[str]) -> list[str]:
    return [line for line in (str(c).strip() for c in setup) if line]


def _refuse(what: str, problems: list[str], rule: str) -> None:
    if problems:
        raise ConfigError(f"{what}: " + "; ".join(problems) + f". See docs/rules.md#{rule}.",
                          rule=rule)


def _name_problems(name: Any, label: re.Pattern[str], limit: int, kind: str,
                   why: tuple[str, str]) -> list[str]:
    """``name`` against a DNS ``label`` pattern of at most ``limit`` characters; ``why`` says
    how the label ends and what Kubernetes appends."""
    if isinstance(name, str) and label.fullmatch(name) and len(name) <= limit:
        return []
    return [f"name={short(name)} is not a valid Kubernetes name: it must be a {kind} (lower-case "
            f"letters, digits and '-', {why[0]}) of at most {limit} characters ({why[1]}). "
            f"Fix: use name={k8s_name(str(name), limit)!r}"]


def _image_problems(image: Any) -> list[str]:
    if isinstance(image, str) and image and not any(c.isspace() for c in image):
        return []
    return [f"image={short(image)} is not a container image reference. Fix: give one such as "
            f"'graphcore/pytorch:3.3.0'"]


def _cpu_problems(cpu: Any) -> list[str]:
    if not isinstance(cpu, bool) and isinstance(cpu, int) and cpu >= 1:
        return []
    return [f"cpu={short(cpu)} is not a positive whole number of CPUs. Fix: e.g. 32"]


def _quantity_problems(field: str, value: Any) -> list[str]:
    if isinstance(value, str) and _QUANTITY.fullmatch(value):
        return []
    return [f"{field}={short(value)} is not a Kubernetes quantity. Fix: e.g. '200Gi'"]


def _port_problems(port: Any) -> list[str]:
    if not isinstance(port, bool) and isinstance(port, int) and 1 <= port <= 65535:
        return []
    return [f"port={short(port)} is not a TCP port (1 to 65535). Fix: e.g. {PORT}"]


def _slurm_problems(instances: int, job_name: Any, nodes: Any, cpus_per_task: Any,
                    time: Any) -> list[str]:
    """Every problem of a SLURM job's name, node count, CPUs per task and time limit."""
    problems = []
    if not isinstance(job_name, str) or not _SLURM_NAME.fullmatch(job_name):
        problems.append(f"job_name={short(job_name)} is not a plain job name (letters, digits, "
                        f"'.', '_' and '-', at most 128, starting with a letter or digit). Fix: "
                        f"use {k8s_name(str(job_name))!r}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= instances \
            or instances % nodes:
        fits = [n for n in range(1, instances + 1) if instances % n == 0]
        problems.append(f"nodes={short(nodes)} does not split the {instances} instance(s) "
                        f"evenly over hosts. Fix: one of {', '.join(map(str, fits[:12]))}"
                        f"{', ...' if len(fits) > 12 else ''}")
    if cpus_per_task is not None and (isinstance(cpus_per_task, bool) or
                                      not isinstance(cpus_per_task, int) or cpus_per_task < 1):
        problems.append(f"cpus_per_task={short(cpus_per_task)} is not a positive whole number. "
                        f"Fix: the cores each instance may use, e.g. 16")
    if time is not None and (not isinstance(time, str) or not _SLURM_TIME.fullmatch(time)):
        problems.append(f"time={short(time)} is not a SLURM time limit. Fix: minutes, "
                        f"'HH:MM:SS' or 'D-HH:MM:SS', e.g. '2:00:00'")
    return problems
