"""The POPDIST_* environment contract poprun sets for each instance: read it, and write it.

poprun passes every instance its share of the replicas through environment variables
(shared/reference/popart-session-options.md §4.2). Instance count and index are derived from them,
as popdist does for a uniform number of replicas per instance.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

if TYPE_CHECKING:
    from .config import Replication, SessionConfig

__all__ = ["PopdistEnv"]

TOTAL = "POPDIST_NUM_TOTAL_REPLICAS"
LOCAL = "POPDIST_NUM_LOCAL_REPLICAS"
OFFSET = "POPDIST_REPLICA_INDEX_OFFSET"
IPUS = "POPDIST_NUM_IPUS_PER_REPLICA"
UNIFORM = "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE"
LOCAL_INSTANCE = "POPDIST_LOCAL_INSTANCE_INDEX"
_REQUIRED = (TOTAL, LOCAL, OFFSET, IPUS)


@dataclass(frozen=True)
class PopdistEnv:
    """This instance's view of a poprun launch."""

    total_replicas: int
    local_replicas: int
    replica_index_offset: int
    ipus_per_replica: int
    local_instance_index: int = 0

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> PopdistEnv:
        """Parse the variables; every missing, malformed or inconsistent one is reported at once."""
        env = os.environ if env is None else env
        problems: list[str] = []
        missing = [name for name in _REQUIRED if name not in env]
        if len(missing) == len(_REQUIRED):
            raise ValueError(
                f"not launched by poprun: none of {', '.join(_REQUIRED)} is set. Fix: start the "
                f"program with poprun (see Plan.poprun_command) or `popart-kit launch`.")
        problems += [f"{name} is missing" for name in missing]
        values: dict[str, int] = {}
        for name, least in ((TOTAL, 1), (LOCAL, 1), (OFFSET, 0), (IPUS, 1), (LOCAL_INSTANCE, 0)):
            raw = env.get(name)
            if raw is None:
                continue
            try:
                values[name] = int(raw)
            except ValueError:
                problems.append(f"{name}={raw!r} is not an integer")
                continue
            if values[name] < least:
                problems.append(f"{name}={raw} is below {least}")
        if env.get(UNIFORM, "1") != "1":
            problems.append(f"{UNIFORM}={env[UNIFORM]!r}: popart_kit needs the same number of "
                            f"replicas on every instance")
        if problems:
            raise ValueError("poprun environment: " + "; ".join(problems)
                             + ". Fix: start the program with poprun (or popart-kit launch), "
                               "which sets all of them consistently.")
        found = cls(values[TOTAL], values[LOCAL], values[OFFSET], values[IPUS],
                    values.get(LOCAL_INSTANCE, 0))
        found.replication()  # consistency of the three replica numbers
        return found

    def replication(self) -> Replication:
        from .config import Replication

        try:
            return Replication(local_factor=self.local_replicas, global_factor=self.total_replicas,
                               global_offset=self.replica_index_offset)
        except ValidationError as err:
            details = "; ".join(e["msg"] for e in err.errors())
            raise ValueError(
                f"poprun environment {TOTAL}={self.total_replicas}, {LOCAL}="
                f"{self.local_replicas}, {OFFSET}={self.replica_index_offset} is inconsistent: "
                f"{details}") from None

    def apply(self, cfg: SessionConfig) -> SessionConfig:
        """``cfg`` with replication and ipus_per_replica taken from this environment."""
        return cfg.updated(replication=self.replication(), ipus_per_replica=self.ipus_per_replica)

    @classmethod
    def for_config(cls, cfg: SessionConfig) -> PopdistEnv:
        """What poprun sets for the instance ``cfg`` describes (all instances on one host)."""
        rep = cfg.replication
        return cls(rep.global_replicas, rep.local_factor, rep.global_offset,
                   cfg.ipus_per_replica, rep.instance_index)

    def to_env(self) -> dict[str, str]:
        return {TOTAL: str(self.total_replicas), IPUS: str(self.ipus_per_replica),
                LOCAL: str(self.local_replicas), UNIFORM: "1",
                OFFSET: str(self.replica_index_offset),
                LOCAL_INSTANCE: str(self.local_instance_index)}
