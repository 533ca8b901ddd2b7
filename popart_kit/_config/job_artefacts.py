"""Checks and text for launch artefacts: poprun programs, Kubernetes names and quantities, YAML.

Pure string work: what :meth:`Plan.poprun_command` and :meth:`Plan.ipujob_manifest` refuse before
a job reaches a cluster, and the YAML that ``kubectl create -f -`` reads.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, short

__all__ = ["program_args", "check_poprun_args", "check_k8s", "k8s_name", "to_yaml"]

# poprun launches one program; these split a shell line into several commands
_SHELL_OPERATORS = {";", "&&", "||", "|", "&", ";;", "\n"}
# a Kubernetes DNS-1123 label: lower-case alphanumerics and '-', alphanumeric at both ends
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# generateName appends 5 characters after the name and '-', and the name is a 63-char label
MAX_NAME = 63 - 6
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_KIT_POPRUN = {"--num-instances": "replication (instances)",
               "--num-replicas": "replication.global_factor",
               "--ipus-per-replica": "ipus_per_replica"}


def program_args(program: str | Sequence[str]) -> list[str]:
    """The program's argv; a string is split as a shell would, and refused when it holds more
    than one command (poprun would launch the first word, ``cd``, and hand it the rest)."""
    if not isinstance(program, str):
        return [str(a) for a in program]
    lexer = shlex.shlex(program, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    words = list(lexer)
    operators = sorted({w for w in words if w in _SHELL_OPERATORS} |
                       ({"\n"} if "\n" in program.strip() else set()))
    if operators:
        raise ConfigError(
            f"program {short(program, 100)} holds several shell commands (separated by "
            f"{' '.join(map(repr, operators))}); poprun launches one program and would pass the "
            f"rest to it. Fix: give the commands that prepare the job as setup commands "
            f"(setup=[...], or --setup on the command line) and the program alone. See "
            f"docs/rules.md#K-launch-program.", rule="K-launch-program")
    return shlex.split(program)


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


def k8s_name(text: str) -> str:
    """``text`` made a valid job name (lower case, '-' for anything else, at most 57 chars)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:MAX_NAME].strip("-")
    return name or "popart-kit-job"


def check_k8s(name: str, image: str, cpu: Any, memory: str, shm_size: str) -> None:
    """Every problem of an IPUJob's name, image and resources, in one error."""
    problems = []
    if not isinstance(name, str) or not _DNS1123_LABEL.fullmatch(name) or len(name) > MAX_NAME:
        problems.append(
            f"name={short(name)} is not a valid Kubernetes name: it must be a DNS-1123 label "
            f"(lower-case letters, digits and '-', starting and ending with a letter or digit) "
            f"of at most {MAX_NAME} characters (generateName appends 6). Fix: use "
            f"name={k8s_name(str(name))!r}")
    if not isinstance(image, str) or not image or any(c.isspace() for c in image):
        problems.append(f"image={short(image)} is not a container image reference. Fix: give "
                        f"one such as 'graphcore/pytorch:3.3.0'")
    if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 1:
        problems.append(f"cpu={short(cpu)} is not a positive whole number of CPUs. Fix: e.g. 32")
    for field, value in (("memory", memory), ("shm_size", shm_size)):
        if not isinstance(value, str) or not _QUANTITY.fullmatch(value):
            problems.append(f"{field}={short(value)} is not a Kubernetes quantity. Fix: e.g. "
                            f"'200Gi'")
    if problems:
        raise ConfigError("IPUJob: " + "; ".join(problems) + ". See docs/rules.md#K-launch-k8s.",
                          rule="K-launch-k8s")


def to_yaml(manifest: dict[str, Any]) -> str:
    """``manifest`` as YAML, a multi-line script as a literal block (``|``) as people write it."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    return yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     width=100)
