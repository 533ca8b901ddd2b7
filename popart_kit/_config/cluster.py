"""Where this process stands in a job, from the variables whichever launcher started it sets.

One pure resolution (environment in, a :class:`Place` out; no JAX, no I/O) of the number of
processes, this process's index, its local rank and the coordinator, from every source present:

================  =================================================  ==========================
source            process count / index (local rank)                 coordinator
================  =================================================  ==========================
poprun,           POPDIST_NUM_TOTAL_REPLICAS / NUM_LOCAL_REPLICAS,   POPART_KIT_COORDINATOR
popart-kit launch POPDIST_REPLICA_INDEX_OFFSET / NUM_LOCAL_REPLICAS
                  (POPDIST_LOCAL_INSTANCE_INDEX)
Open MPI          OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_RANK        JAX finds it from
                  (OMPI_COMM_WORLD_LOCAL_RANK)                       OMPI_MCA_orte_hnp_uri
PMIx              - / PMIX_RANK
SLURM (srun)      SLURM_NTASKS / SLURM_PROCID (SLURM_LOCALID)        first host of
                                                                     SLURM_STEP_NODELIST (or
                                                                     SLURM_NODELIST), port
                                                                     61440 + SLURM_JOB_ID % 4096
torchrun          WORLD_SIZE / RANK (LOCAL_RANK)                     MASTER_ADDR:MASTER_PORT
Kubernetes        POPART_KIT_NUM_INSTANCES / JOB_COMPLETION_INDEX    POPART_KIT_COORDINATOR
indexed Job                                                          (e.g. JOB-0.SERVICE:PORT)
JAX               JAX_NUM_PROCESSES / JAX_PROCESS_ID                 JAX_COORDINATOR_ADDRESS
================  =================================================  ==========================

``POPART_KIT_COORDINATOR`` (HOST:PORT of process 0) overrides every other coordinator and
``POPART_KIT_NUM_INSTANCES`` gives the process count to a launcher that only gives an index.
A source that says one process only (``srun -n 1``, ``mpirun -np 1`` around ``popart-kit
launch``) launched this process alone and is set aside: what runs inside it may start more.
Every other disagreement - two counts, two indices, two local ranks, two coordinators - is
reported in one :class:`~popart_kit.errors.ConfigError` naming each source and value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import ConfigError, short
from .fields import read_popdist_with
from .popdist import COORDINATOR, LOCAL, LOCAL_INSTANCE, OFFSET, TOTAL, PopdistEnv

__all__ = ["Place", "place", "popdist_env", "NUM_INSTANCES", "SLURM_BASE_PORT", "PER_PROCESS"]

NUM_INSTANCES = "POPART_KIT_NUM_INSTANCES"
OMPI_URI = "OMPI_MCA_orte_hnp_uri"  # set by Open MPI's mpirun: JAX finds the coordinator from it
SLURM_BASE_PORT = 61440  # + SLURM_JOB_ID % 4096: the port JAX's SLURM detection picks
#: What other launchers set per process: a launcher that starts its own instances (popart-kit
#: launch inside an srun step or an mpirun rank) drops these, so its instances are placed by it.
PER_PROCESS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
               "PMIX_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "RANK",
               "WORLD_SIZE", "LOCAL_RANK", "JOB_COMPLETION_INDEX", "JAX_PROCESS_ID",
               "JAX_NUM_PROCESSES", "JAX_COORDINATOR_ADDRESS")
_RULE = "K-cluster-env"
_DECIMAL = re.compile(r"[0-9]{1,10}")


@dataclass(frozen=True)
class Place:
    """This process's place in the job: ``processes`` in all, this one's ``process_id``, its
    ``local_rank`` on its host (None: no launcher said), the ``coordinator`` HOST:PORT (None:
    none given; ``jax_finds_coordinator`` when JAX's Open MPI detection finds it), ``source``
    the launchers that said so (empty for a process alone), and ``count_from`` /
    ``index_from`` the variables that gave the count and the index, for messages."""

    processes: int = 1
    process_id: int = 0
    local_rank: int | None = None
    coordinator: str | None = None
    jax_finds_coordinator: bool = False
    source: str = ""
    count_from: str = ""
    index_from: str = ""


@dataclass(frozen=True)
class _Claim:
    """What one source says; each value with the variable that gave it, for messages."""

    source: str
    processes: tuple[int, str] | None = None
    process_id: tuple[int, str] | None = None
    local_rank: tuple[int, str] | None = None
    coordinator: tuple[str, str] | None = None


class _Reader:
    """Reads variables of ``env`` as integers, collecting every malformed one."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env, self.problems = env, []

    def int(self, name: str, least: int = 0) -> tuple[int, str] | None:
        raw = self.env.get(name)
        if raw in (None, ""):
            return None
        if not isinstance(raw, str) or not _DECIMAL.fullmatch(raw) or int(raw) < least:
            self.problems.append(f"{name}={short(raw)} is not a whole number of at least {least}")
            return None
        return int(raw), f"{name}={raw}"


def _popdist(r: _Reader) -> _Claim | None:
    if r.env.get(LOCAL) in (None, "") and r.env.get(OFFSET) in (None, ""):
        return None  # job-wide values only (or none): they do not say which process this is
    try:
        found = PopdistEnv.read(r.env)
    except ConfigError as err:
        r.problems.append(str(err))
        return None
    count = found.total_replicas // found.local_replicas
    index = found.replica_index_offset // found.local_replicas
    return _Claim("poprun",
                  (count, f"{TOTAL}={found.total_replicas} / {LOCAL}={found.local_replicas} "
                          f"= {count}"),
                  (index, f"{OFFSET}={found.replica_index_offset} / {LOCAL}="
                          f"{found.local_replicas} = {index}"),
                  r.int(LOCAL_INSTANCE))


def _ompi(r: _Reader) -> _Claim:
    return _Claim("Open MPI", r.int("OMPI_COMM_WORLD_SIZE", 1), r.int("OMPI_COMM_WORLD_RANK"),
                  r.int("OMPI_COMM_WORLD_LOCAL_RANK"))


def _pmix(r: _Reader) -> _Claim:
    return _Claim("PMIx", process_id=r.int("PMIX_RANK"))


def _slurm(r: _Reader) -> _Claim | None:
    if "SLURM_PROCID" not in r.env:  # salloc/sbatch shells set SLURM_NTASKS too; srun sets this
        return None
    nodes = r.env.get("SLURM_STEP_NODELIST") or r.env.get("SLURM_NODELIST")
    job = r.int("SLURM_JOB_ID")
    coordinator = None
    if nodes:
        port = SLURM_BASE_PORT + (job[0] if job else 0) % 4096
        coordinator = (f"{first_host(nodes)}:{port}", f"first host of {short(nodes)}")
    return _Claim("SLURM", r.int("SLURM_NTASKS", 1), r.int("SLURM_PROCID"),
                  r.int("SLURM_LOCALID"), coordinator)


def _torchrun(r: _Reader) -> _Claim | None:
    if "RANK" not in r.env or "WORLD_SIZE" not in r.env:
        return None
    addr, port = r.env.get("MASTER_ADDR"), r.env.get("MASTER_PORT")
    coordinator = (f"{addr}:{port}", "MASTER_ADDR:MASTER_PORT") if addr and port else None
    return _Claim("torchrun", r.int("WORLD_SIZE", 1), r.int("RANK"), r.int("LOCAL_RANK"),
                  coordinator)


def _kubernetes(r: _Reader) -> _Claim:
    return _Claim("Kubernetes", process_id=r.int("JOB_COMPLETION_INDEX"))


def _kit(r: _Reader) -> _Claim:
    address = r.env.get(COORDINATOR) or None
    return _Claim("POPART_KIT_*", r.int(NUM_INSTANCES, 1),
                  coordinator=(address, COORDINATOR) if address else None)


def _jax(r: _Reader) -> _Claim:
    address = r.env.get("JAX_COORDINATOR_ADDRESS") or None
    return _Claim("JAX", r.int("JAX_NUM_PROCESSES", 1), r.int("JAX_PROCESS_ID"),
                  coordinator=(address, "JAX_COORDINATOR_ADDRESS") if address else None)


_SOURCES: tuple[Callable[[_Reader], _Claim | None], ...] = (
    _popdist, _ompi, _pmix, _slurm, _torchrun, _kubernetes, _kit, _jax)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[01-04,07],gpu2`` -> ``node01``."""
    head = re.match(r"([^,\[]*)(?:\[([^\],\-]*))?", nodelist)
    return head.group(1) + (head.group(2) or "")


def place(env: Mapping[str, str] | None = None) -> Place:
    """This process's place in the job, from ``env`` (``os.environ``). Raises one ConfigError
    naming every malformed variable and every disagreement between sources."""
    env = os.environ if env is None else env
    reader = _Reader(env)
    claims = [c for c in (source(reader) for source in _SOURCES) if c is not None]
    claims = [c for c in claims  # a launcher of this process alone says nothing of the job
              if not (c.processes and c.processes[0] == 1 and c.source != "POPART_KIT_*")]
    problems = reader.problems
    found = {}
    for field, label in (("processes", "number of processes"), ("process_id", "process index"),
                         ("local_rank", "local rank")):
        said = {(getattr(c, field)[0], f"{c.source} {getattr(c, field)[1]}")
                for c in claims if getattr(c, field) is not None}
        if len({value for value, _ in said}) > 1:
            problems.append(f"the {label} differs: "
                            + ", ".join(who for _, who in sorted(said, key=lambda s: s[1])))
        found[field] = min(said)[0] if said else None
    coordinator = _coordinator(claims, problems)
    processes, process_id = found["processes"], found["process_id"]
    if processes == 1 and process_id is None:
        process_id = 0
    if processes is None and process_id:
        problems.append(f"{_who(claims, 'process_id')} names process {process_id} but no "
                        f"variable gives the number of processes (set {NUM_INSTANCES})")
    elif processes is not None and process_id is None:
        problems.append(f"{_who(claims, 'processes')} names {processes} processes but no "
                        f"variable says which one this is")
    elif processes is not None and process_id >= processes:
        problems.append(f"process {process_id} ({_who(claims, 'process_id')}) is not one of "
                        f"0..{processes - 1} ({_who(claims, 'processes')})")
    if problems:
        raise ConfigError("the launch environment: " + "; ".join(problems) + ". Fix: start the "
                          "processes with one launcher, or set the variables of each source "
                          "to the same job (see popart_kit._config.cluster).", rule=_RULE)
    if processes is None:
        return Place(coordinator=coordinator)
    return Place(processes, process_id, found["local_rank"], coordinator,
                 coordinator is None and OMPI_URI in env,
                 ", ".join(dict.fromkeys(c.source for c in claims
                                         if c.processes or c.process_id)),
                 _who(claims, "processes"), _who(claims, "process_id"))


def _coordinator(claims: list[_Claim], problems: list[str]) -> str | None:
    """POPART_KIT_COORDINATOR, else the one address the other sources agree on; validated."""
    given = [c for c in claims if c.coordinator is not None]
    kit = [c for c in given if c.source == "POPART_KIT_*"]
    chosen = kit or given
    if len({c.coordinator[0] for c in chosen}) > 1:
        problems.append("the coordinator differs: " + ", ".join(
            f"{c.source} {c.coordinator[1]}={c.coordinator[0]}" for c in chosen))
        return None
    if not chosen:
        return None
    address, name = chosen[0].coordinator
    host, _, port = address.rpartition(":")
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        problems.append(f"{name}={short(address)} is not HOST:PORT (give process 0's address "
                        f"and a free port, e.g. 127.0.0.1:29500)")
        return None
    return address


def _who(claims: list[_Claim], field: str) -> str:
    return ", ".join(f"{c.source} {getattr(c, field)[1]}" for c in claims
                     if getattr(c, field) is not None)


def popdist_env(env: Mapping[str, str] | None = None) -> PopdistEnv:
    """poprun's variables for this process (``os.environ`` when ``env`` is None), its share
    worked out from its place where only job-wide values are exported."""
    return PopdistEnv.read(env, place=place)


read_popdist_with(lambda env: popdist_env(env).replication())
