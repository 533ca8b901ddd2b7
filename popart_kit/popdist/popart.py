"""Graphcore's ``popdist.popart`` on popart_kit: session options and a device for this instance.

``configureSessionOptions(opts)`` sets the replication poprun's popdist sets - local replicas
(enableReplicatedGraphs, replicatedGraphCount) and, for an instance of several, the global ones
(enableDistributedReplicatedGraphs, globalReplicationFactor, globalReplicaOffset) - so a session
built with those options runs as its instance of the job: its replicas join the others'.
"""

from __future__ import annotations

from typing import Any

from ..popart import DeviceInfo, DeviceManager, SessionOptions, popart_exception
from . import _job, checkNumIpusPerReplica

__all__ = ["configureSessionOptions", "getDevice"]


def configureSessionOptions(opts: SessionOptions) -> None:
    """Set ``opts``' replication to this instance's share of the job's replicas."""
    if not isinstance(opts, SessionOptions):
        raise TypeError(f"opts={opts!r}: give a popart.SessionOptions().")
    job = _job()
    opts.enableReplicatedGraphs = job.local_replicas > 1
    opts.replicatedGraphCount = job.local_replicas
    opts.enableDistributedReplicatedGraphs = job.total_replicas > job.local_replicas
    opts.globalReplicationFactor = job.total_replicas
    opts.globalReplicaOffset = job.replica_index_offset


def getDevice(ipus_per_replica: int | None = None, connectionType: Any = None) -> DeviceInfo:
    """A device with this instance's IPUs: local replicas x IPUs per replica. Refuses an
    ``ipus_per_replica`` other than the launch's."""
    job = _job()
    ipus = job.ipus_per_replica if ipus_per_replica is None else ipus_per_replica
    if not checkNumIpusPerReplica(ipus):
        raise popart_exception(f"popdist.popart.getDevice({ipus}) but the launch gives "
                               f"{job.ipus_per_replica} IPUs per replica. Fix: pass "
                               f"{job.ipus_per_replica}, or launch with --ipus-per-replica "
                               f"{ipus}.")
    return DeviceManager().acquireAvailableDevice(job.local_replicas * ipus,
                                                  connectionType=connectionType)
