"""Graphcore's ``popdist`` on popart_kit: where this instance stands, from any launcher.

PopART programs ask popdist for their instance and replicas (``popart-kit run`` and ``python -m
popart_kit.popart`` make ``import popdist`` resolve here). The answers come from the one
resolution of the launch environment: the instance count and index from whichever launcher
started the process (poprun / ``popart-kit launch``, mpirun, srun, torchrun, a Kubernetes
indexed Job; see :mod:`popart_kit._config.cluster`), the replicas from POPDIST_* - per instance
as poprun sets them, or POPDIST_NUM_TOTAL_REPLICAS and POPDIST_NUM_IPUS_PER_REPLICA exported for
the whole job. The replica questions refuse, naming the variables to set, when no replicas are
given (check ``isPopdistEnvSet()`` first, as Graphcore's examples do).
"""

from __future__ import annotations

import os

from .._config.cluster import place, popdist_env
from .._config.popdist import TOTAL, PopdistEnv
from ..errors import ConfigError

__all__ = ["isPopdistEnvSet", "getNumInstances", "getInstanceIndex", "getNumTotalReplicas",
           "getNumLocalReplicas", "getReplicaIndexOffset", "getNumIpusPerReplica",
           "checkNumIpusPerReplica", "getDeviceId"]


def _job() -> PopdistEnv:
    return popdist_env(os.environ)


def isPopdistEnvSet() -> bool:
    """Whether the launch gives the job's replicas (POPDIST_NUM_TOTAL_REPLICAS is set)."""
    return os.environ.get(TOTAL, "") != ""


def getNumInstances() -> int:
    """Processes in the job (1 for a process no launcher started)."""
    return place().processes


def getInstanceIndex() -> int:
    """This process's index in the job, 0..getNumInstances()-1."""
    return place().process_id


def getNumTotalReplicas() -> int:
    """Replicas over all instances."""
    return _job().total_replicas


def getNumLocalReplicas() -> int:
    """Replicas this instance runs."""
    return _job().local_replicas


def getReplicaIndexOffset() -> int:
    """Global index of this instance's first replica."""
    return _job().replica_index_offset


def getNumIpusPerReplica() -> int:
    """IPUs each replica uses."""
    return _job().ipus_per_replica


def checkNumIpusPerReplica(numIpusPerReplica: int) -> bool:
    """Whether the launch gave ``numIpusPerReplica`` IPUs per replica."""
    return getNumIpusPerReplica() == numIpusPerReplica


def getDeviceId(numIpusPerReplica: int | None = None) -> int:
    """The id of this instance's first IPU, counting the job's IPUs replica by replica
    (``popart.DeviceManager().acquireDeviceById`` takes it); ``numIpusPerReplica`` defaults to
    the launch's and must match it."""
    job = _job()
    ipus = job.ipus_per_replica if numIpusPerReplica is None else numIpusPerReplica
    if ipus != job.ipus_per_replica:
        raise ConfigError(f"getDeviceId({ipus}) but the launch gives {job.ipus_per_replica} "
                          f"IPUs per replica (POPDIST_NUM_IPUS_PER_REPLICA). Fix: pass "
                          f"{job.ipus_per_replica}, or launch with --ipus-per-replica {ipus}.",
                          rule="K-popdist-env")
    return job.replica_index_offset * ipus
