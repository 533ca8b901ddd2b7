"""The POPDIST_* environment contract poprun sets for each instance: read it, and write it.

poprun passes every instance its share of the replicas through environment variables
(POPDIST_NUM_TOTAL_REPLICAS, POPDIST_NUM_LOCAL_REPLICAS, POPDIST_REPLICA_INDEX_OFFSET,
POPDIST_NUM_IPUS_PER_REPLICA, ...). Instance count and index are derived from them, as popdist does
for a uniform number of replicas per instance. Values must be ASCII decimal integers; every
missing, malformed or inconsistent variable is named in one :class:`~popart_kit.errors.ConfigError`.

Under another launcher (mpirun, srun, torchrun, a Kubernetes indexed Job) the job-wide
POPDIST_NUM_TOTAL_REPLICAS and POPDIST_NUM_IPUS_PER_REPLICA may be exported for every process
alike: this process's share (local replicas = total / processes, offset = index x local) then
comes from its place in the job (:func:`popart_kit._config.cluster.place`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ..errors import ConfigError, short
from .fields import MAX_COUNT, Replication, SessionFields
from .rules import MAX_GLOBAL_IPUS

__all__ = ["PopdistEnv"]

TOTAL = "POPDIST_NUM_TOTAL_REPLICAS"
LOCAL = "POPDIST_NUM_LOCAL_REPLICAS"
OFFSET = "POPDIST_REPLICA_INDEX_OFFSET"
IPUS = "POPDIST_NUM_IPUS_PER_REPLICA"
UNIFORM = "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE"
LOCAL_INSTANCE = "POPDIST_LOCAL_INSTANCE_INDEX"
# What popart-kit launch adds for the xla backend's instances (read by its distributed module):
COORDINATOR = "POPART_KIT_COORDINATOR"  # where the instances meet
FAULT_TIMEOUT_VARIABLE = "POPART_KIT_FAULT_TIMEOUT"
START_TIMEOUT_VARIABLE = "POPART_KIT_START_TIMEOUT"  # how long instances wait to meet
SECRET = "POPART_KIT_JOB_SECRET"  # the job's secret, proven (never sent) when instances meet
JOINED = "POPART_KIT_JOINED_DIR"  # an instance about to meet the others writes a file there
PEER_FAILED = 3  # exit status of an instance the kit ends because another instance failed
FAULT_TIMEOUT = 30  # seconds: default bound on noticing a stopped or hung instance
START_TIMEOUT = 300  # seconds: default wait for the instances to meet (a slow host may load)
_REQUIRED = (TOTAL, LOCAL, OFFSET, IPUS)
_DECIMAL = re.compile(r"[0-9]{1,10}")  # ASCII digits only: no sign, "_", spaces or other scripts
_FIX = ("Fix: start the program with poprun (or popart-kit launch), which sets all of them "
        "consistently.")


def _integer(raw: object) -> int | None:
    """The value of an ASCII decimal integer of at most 10 digits, else None."""
    if isinstance(raw, str) and _DECIMAL.fullmatch(raw):
        return int(raw)
    return None


def _share(values: dict[str, int], env: Mapping[str, str], place: Callable[..., Any]) -> list[str]:
    """Put this process's local replicas, offset and local instance index into ``values``
    from the job-wide total and its place in the job (``place(env)``: processes, process_id,
    local_rank, source); the problem if the total does not divide."""
    here = place(env)
    if values[TOTAL] % here.processes:
        return [f"{TOTAL}={values[TOTAL]} exported for the whole job is not a multiple of its "
                f"{here.processes} processes ({here.source}): every instance runs the same "
                f"number of replicas"]
    values[LOCAL] = values[TOTAL] // here.processes
    values[OFFSET] = here.process_id * values[LOCAL]
    values.setdefault(LOCAL_INSTANCE, here.local_rank or 0)
    return []


@dataclass(frozen=True)
class PopdistEnv:
    """This instance's view of a poprun launch."""

    total_replicas: int
    local_replicas: int
    replica_index_offset: int
    ipus_per_replica: int
    local_instance_index: int = 0

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None,
             place: Callable[..., Any] | None = None) -> PopdistEnv:
        """Parse the variables; every missing, malformed or inconsistent one is reported at once.

        ``place`` (:func:`popart_kit._config.cluster.place`) tells this process's place in the
        job, which gives its share where only job-wide values (total replicas, IPUs per
        replica) are exported; without it they are refused as incomplete."""
        env = os.environ if env is None else env
        if not isinstance(env, Mapping):
            raise ConfigError(f"env must be a mapping of variable names to strings, got "
                              f"{type(env).__name__}.", rule="K-popdist-env")
        problems: list[str] = []
        # unset, None (a mapping built with os.environ.get) and empty all mean "not given"
        missing = [name for name in _REQUIRED if env.get(name) in (None, "")]
        job_wide = (place is not None and LOCAL in missing and OFFSET in missing
                    and TOTAL not in missing)
        if job_wide:  # exported for the whole job: the share comes from the process's place
            missing = [name for name in missing if name not in (LOCAL, OFFSET)]
        elif len(missing) == len(_REQUIRED):
            raise ConfigError(
                f"not launched by poprun: none of {', '.join(_REQUIRED)} is set. Fix: start the "
                f"program with poprun (see Plan.poprun_command) or `popart-kit launch`.",
                rule="K-popdist-env")
        problems += [f"{name} is {'empty' if env.get(name) == '' else 'missing'}"
                     for name in missing]
        values: dict[str, int] = {}
        for name, least in ((TOTAL, 1), (LOCAL, 1), (OFFSET, 0), (IPUS, 1), (LOCAL_INSTANCE, 0)):
            raw = env.get(name)
            if raw in (None, ""):
                continue
            value = _integer(raw)
            if value is None:
                problems.append(f"{name}={short(raw)} is not an integer (ASCII decimal digits "
                                f"0-9, at most 10)")
            elif value < least:
                problems.append(f"{name}={raw} is below {least}")
            elif value > MAX_COUNT:
                problems.append(f"{name}={raw} is above {MAX_COUNT}")
            else:
                values[name] = value
        uniform = env.get(UNIFORM, "1")
        if uniform != "1":
            problems.append(f"{UNIFORM}={short(uniform)}: popart_kit needs the same number of "
                            f"replicas on every instance")
        if TOTAL in values and IPUS in values and values[TOTAL] * values[IPUS] > MAX_GLOBAL_IPUS:
            problems.append(f"{TOTAL}={values[TOTAL]} × {IPUS}={values[IPUS]} = "
                            f"{values[TOTAL] * values[IPUS]} IPUs, more than the largest IPU "
                            f"system connects ({MAX_GLOBAL_IPUS})")
        if job_wide and TOTAL in values:
            problems += _share(values, env, place)
        if problems:
            raise ConfigError("poprun environment: " + "; ".join(problems) + ". " + _FIX,
                              rule="K-popdist-env")
        found = cls(values[TOTAL], values[LOCAL], values[OFFSET], values[IPUS],
                    values.get(LOCAL_INSTANCE, 0))
        found.replication()  # consistency of the three replica numbers
        return found

    def replication(self) -> Replication:
        """The Replication these variables describe; refuses inconsistent ones."""
        try:
            return Replication(local_factor=self.local_replicas, global_factor=self.total_replicas,
                               global_offset=self.replica_index_offset)
        except ValidationError as err:
            details = "; ".join(e["msg"] for e in err.errors())
            raise ConfigError(
                f"poprun environment {TOTAL}={self.total_replicas}, {LOCAL}="
                f"{self.local_replicas}, {OFFSET}={self.replica_index_offset} is inconsistent: "
                f"{details}", rule="K-popdist-env") from None

    def apply(self, cfg: SessionFields) -> Any:
        """``cfg`` with replication and ipus_per_replica taken from this environment.

        The environment fills what the config leaves at its default; a config value set to
        something else that disagrees with the environment is a conflict, reported (all of
        them at once) naming both values rather than silently replaced."""
        conflicts = []
        if cfg.ipus_per_replica not in (1, self.ipus_per_replica):
            stages = (f" and pipeline.stages={cfg.pipeline.stages}"
                      if cfg.pipeline.stages is not None else "")
            conflicts.append(f"{IPUS}={self.ipus_per_replica} but the config has "
                             f"ipus_per_replica={cfg.ipus_per_replica}{stages}")
        rep, found = cfg.replication, self.replication()
        if rep != Replication() and rep != found:
            conflicts.append(
                f"{TOTAL}={self.total_replicas}, {LOCAL}={self.local_replicas}, {OFFSET}="
                f"{self.replica_index_offset} but the config has replication.local_factor="
                f"{rep.local_factor}, global_factor={rep.global_factor}, global_offset="
                f"{rep.global_offset}")
        if conflicts:
            raise ConfigError(
                "the poprun environment and the config disagree: " + "; ".join(conflicts)
                + ". Fix: leave those settings at their defaults in the config (the environment "
                "then gives them), or launch with matching values (e.g. poprun / popart-kit "
                "launch --ipus-per-replica).", rule="K-popdist-conflict")
        return cfg.updated(replication=found, ipus_per_replica=self.ipus_per_replica)

    @classmethod
    def for_config(cls, cfg: SessionFields) -> PopdistEnv:
        """What poprun sets for the instance ``cfg`` describes (all instances on one host)."""
        rep = cfg.replication
        return cls(rep.global_replicas, rep.local_factor, rep.global_offset,
                   cfg.ipus_per_replica, rep.instance_index)

    def to_env(self) -> dict[str, str]:
        return {TOTAL: str(self.total_replicas), IPUS: str(self.ipus_per_replica),
                LOCAL: str(self.local_replicas), UNIFORM: "1",
                OFFSET: str(self.replica_index_offset),
                LOCAL_INSTANCE: str(self.local_instance_index)}

