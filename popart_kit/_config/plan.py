"""Plan: the numbers a SessionConfig implies, and the launch artefacts derived from them.

Everything here is derived arithmetic over a validated config (no I/O): topology (instances,
replicas, IPU ids), batch sizes, pipeline depth and bubble, sync groups, the poprun command line
and the Kubernetes IPUJob resource.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args, overload

from .._base.arith import (
    bubble_fraction,
    next_power_of_two,
    pipeline_depth,
    pipeline_fill_micro_batches,
)
from ..errors import ConfigError

if TYPE_CHECKING:
    from .fields import SessionFields

__all__ = ["Plan", "ReplicaPlacement", "ReplicaTable", "plan_view", "sync_groups"]

#: Rows of the plan's replica table: every replica when there are this many or fewer, else the
#: first of this instance's (the caption gives the rule for the rest).
MAX_REPLICA_ROWS = 32

#: Which placements :meth:`Plan.to_dict` lists: this instance's (at most 64) or every replica's.
Listed = Literal["instance", "all"]

#: How a global replica id maps to its instance, local id and device IPUs: Python expressions
#: over the keys of :meth:`ReplicaTable.to_dict` ("global_ids" gives the ids an instance runs;
#: ``ipu_stride`` exceeds ``ipus_per_replica`` when the device is rounded up to a power of two).
REPLICA_RULE = {
    "instance": "global_id // per_instance",
    "local_id": "global_id % per_instance",
    "ipus": "range(local_id * ipu_stride, local_id * ipu_stride + ipus_per_replica)",
    "global_ids": "range(instance * per_instance, (instance + 1) * per_instance)",
}


@dataclass(frozen=True)
class ReplicaPlacement:
    """One replica: its instance, global and local ids, and the device IPUs it runs on."""

    instance: int
    global_id: int
    local_id: int
    ipus: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """The placement as plain data (``ipus`` a list)."""
        return {"instance": self.instance, "global_id": self.global_id,
                "local_id": self.local_id, "ipus": list(self.ipus)}


class ReplicaTable(Sequence[ReplicaPlacement]):
    """Every global replica's placement, computed when asked for: a table of a million replicas
    costs what a table of one does until it is read."""

    def __init__(self, global_replicas: int, local_replicas: int, stride: int,
                 ipus_per_replica: int) -> None:
        self._key = (global_replicas, local_replicas, stride, ipus_per_replica)

    def __len__(self) -> int:
        return self._key[0]

    def _row(self, g: int) -> ReplicaPlacement:
        _, local, stride, ipus = self._key
        first = g % local * stride
        return ReplicaPlacement(g // local, g, g % local, tuple(range(first, first + ipus)))

    @overload
    def __getitem__(self, index: int) -> ReplicaPlacement: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[ReplicaPlacement, ...]: ...

    def __getitem__(self, index: int | slice) -> ReplicaPlacement | tuple[ReplicaPlacement, ...]:
        if isinstance(index, slice):
            return tuple(self._row(g) for g in range(*index.indices(len(self))))
        g = index + len(self) if index < 0 else index
        if not 0 <= g < len(self):
            raise IndexError(f"replica {index} does not exist: there are {len(self)}.")
        return self._row(g)

    def instance(self, i: int) -> tuple[ReplicaPlacement, ...]:
        """The replicas instance ``i`` runs."""
        local = self._key[1]
        return self[i * local:(i + 1) * local]

    def to_dict(self, instance: int, replicas: Listed = "instance") -> dict[str, Any]:
        """The table in closed form (:data:`REPLICA_RULE` and its numbers), with the placements
        of instance ``instance``, or of every replica when ``replicas`` is ``"all"``."""
        if replicas not in get_args(Listed):
            raise ValueError(f"replicas={replicas!r} is not a listing: use 'instance' (this "
                             f"instance's replicas, the default) or 'all' (every replica).")
        count, local, stride, ipus = self._key
        rows = self if replicas == "all" else self.instance(instance)
        return {
            "count": count, "per_instance": local, "ipus_per_replica": ipus,
            "ipu_stride": stride, "rule": dict(REPLICA_RULE),
            "this_instance": {"first_global_id": instance * local,
                              "last_global_id": (instance + 1) * local - 1},
            "listed": replicas,
            "placements": [r.to_dict() for r in rows],
        }

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReplicaTable):
            return self._key == other._key
        return isinstance(other, Sequence) and len(other) == len(self) and tuple(self) == tuple(
            other)

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"ReplicaTable({len(self)} replicas, {self._key[1]} per instance)"


def sync_groups(pattern: str, num_ipus: int) -> dict[str, list[list[int]]]:
    """How the two sync groups partition a device's IPUs (PopART docs, "Sync patterns").

    full: every IPU is in both groups. single_pipeline: GS2 holds all IPUs, GS1 one group per
    IPU. replica_and_ladder: GS2 holds all IPUs, GS1 the two ladder rails (even and odd IPUs,
    A+C and B+D in the figure), which alternate host I/O and compute.
    """
    everyone = [list(range(num_ipus))]
    if pattern == "full":
        return {"GS1": everyone, "GS2": everyone}
    if pattern == "single_pipeline":
        return {"GS1": [[i] for i in range(num_ipus)], "GS2": everyone}
    if pattern == "replica_and_ladder":
        rails = [list(range(0, num_ipus, 2)), list(range(1, num_ipus, 2))]
        return {"GS1": [r for r in rails if r], "GS2": everyone}
    raise ConfigError(f"unknown sync pattern {pattern!r}; use full, single_pipeline or "
                     f"replica_and_ladder")


@dataclass(frozen=True)
class Plan:
    """Derived numbers of one instance of a session: topology, batches, pipeline, placement."""

    mode: str
    target: str
    # topology
    ipus_per_replica: int
    local_replicas: int
    global_replicas: int
    instances: int
    instance_index: int
    num_ipus: int
    ipus_to_request: int
    global_num_ipus: int
    # batches
    batches_per_step: int
    accumulation_factor: int
    micro_batch_size: int | None
    micro_batches_per_step: int
    samples_per_step: int | None
    global_samples_per_step: int | None
    global_batch_size: int | None
    weight_updates_per_step: int
    # pipeline
    pipelined: bool
    pipeline_stages: int | None
    pipeline_depth: int | None
    bubble_fraction: float | None
    # placement
    replicas: ReplicaTable
    sync_pattern: str
    sync_groups: dict[str, list[list[int]]]
    warnings: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg: SessionFields, micro_batch_size: int | None = None) -> Plan:
        """The plan of ``cfg``; ``micro_batch_size`` stands in where the config leaves it
        unset (a session passes the one its model's inputs have)."""
        rep, acc, bps = cfg.replication, cfg.accumulation.factor, cfg.batches_per_step
        training, ipus = cfg.is_training, cfg.ipus_per_replica
        num_ipus = rep.local_factor * ipus
        rounded = cfg.device.target == "ipu" and cfg.device.round_to_power_of_two
        request = next_power_of_two(num_ipus) if rounded else num_ipus
        stride = request // rep.local_factor  # device IPUs per replica, idle ones included
        micro_batches = bps * acc * rep.local_factor
        mbs = cfg.micro_batch_size if cfg.micro_batch_size is not None else micro_batch_size
        stages = (cfg.pipeline.stages if cfg.pipeline.enabled else 1)
        depth = pipeline_depth(stages, training) if stages is not None else None
        fill = pipeline_fill_micro_batches(training, bps, acc)
        return cls(
            mode=cfg.mode,
            target=cfg.device.target,
            ipus_per_replica=ipus,
            local_replicas=rep.local_factor,
            global_replicas=rep.global_replicas,
            instances=rep.instances,
            instance_index=rep.instance_index,
            num_ipus=num_ipus,
            ipus_to_request=request,
            global_num_ipus=rep.global_replicas * ipus,
            batches_per_step=bps,
            accumulation_factor=acc,
            micro_batch_size=mbs,
            micro_batches_per_step=micro_batches,
            samples_per_step=None if mbs is None else micro_batches * mbs,
            global_samples_per_step=None if mbs is None else micro_batches * mbs * rep.instances,
            global_batch_size=None if mbs is None else mbs * acc * rep.global_replicas,
            weight_updates_per_step=bps if training else 0,
            pipelined=cfg.pipeline.enabled,
            pipeline_stages=stages,
            pipeline_depth=depth,
            bubble_fraction=None if depth is None or not cfg.pipeline.enabled
            else bubble_fraction(depth, fill),
            replicas=ReplicaTable(rep.global_replicas, rep.local_factor, stride, ipus),
            sync_pattern=cfg.device.sync_pattern,
            sync_groups=sync_groups(cfg.device.sync_pattern, request),
            warnings=cfg.warnings,
        )

    @property
    def idle_ipus(self) -> int:
        """IPUs requested only to reach a power of two."""
        return self.ipus_to_request - self.num_ipus

    @property
    def local_replica_placements(self) -> tuple[ReplicaPlacement, ...]:
        return self.replicas.instance(self.instance_index)

    def to_dict(self, replicas: Listed = "instance") -> dict[str, Any]:
        """The plan as plain data (what ``popart-kit plan --json`` prints). ``"replicas"`` gives
        the placement rule and this instance's placements, whatever the replica count;
        ``replicas="all"`` lists every replica's (``--all-replicas``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["replicas"] = self.replicas.to_dict(self.instance_index, replicas)
        out["warnings"] = list(self.warnings)
        out["idle_ipus"] = self.idle_ipus
        return out

    # -- launch artefacts -------------------------------------------------------------------

    def poprun_command(self, program: str | Sequence[str], *, vipu_partition: str | None = None,
                       hosts: Sequence[str] = (), allow_run_as_root: bool = False,
                       poprun_args: Sequence[str] = ()) -> list[str]:
        """The poprun invocation that starts every instance of this session.

        ``program`` is one command (a string is split as a shell would; one holding ``;``,
        ``&&``, ``|`` ... is refused: setup goes before poprun, see :meth:`ipujob_manifest`).
        ``poprun_args`` (e.g. ``["--vv", "--mpi-global-args=--tag-output"]``) go after the
        kit's first arguments; those the config decides (``--num-replicas``, ...) are refused.
        The kit adds ``--print-topology yes`` so that the log shows which IPUs each instance got.
        """
        from .job_artefacts import check_poprun_args, program_args

        argv = program_args(program)
        args = ["poprun"] + (["--allow-run-as-root", "1"] if allow_run_as_root else [])
        args += check_poprun_args(poprun_args)
        args += ["--num-instances", str(self.instances),
                 "--num-replicas", str(self.global_replicas),
                 "--ipus-per-replica", str(self.ipus_per_replica)]
        if vipu_partition:
            args += ["--vipu-partition", vipu_partition]
        if hosts:
            args += ["--host", ",".join(hosts)]
        args += ["--print-topology", "yes"]
        return args + argv

    def ipujob_manifest(self, image: str, command: str | Sequence[str], name: str, *,
                        setup: Sequence[str] = (), poprun_args: Sequence[str] = (),
                        cpu: int = 32, memory: str = "200Gi",
                        shm_size: str = "10Gi") -> dict[str, Any]:
        """A Graphcore IPUJob resource for Kubernetes that runs ``command`` on this topology.

        The container's script runs the ``setup`` shell commands (one per line, as in Graphcore's
        examples) and then ``command``: under poprun when replicated (the job asks for the IPUs
        of all instances), else directly. ``memory`` is the container's limit (Kubernetes
        requests as much when no request is given); 200Gi as in Graphcore's POD examples.
        ``name`` must be a Kubernetes DNS-1123 label. :meth:`ipujob_yaml` gives the YAML.
        """
        from .job_artefacts import check_k8s, program_args

        check_k8s(name, image, cpu, memory, shm_size)
        argv = program_args(command)
        if self.global_replicas > 1:
            poprun = shlex.join(self.poprun_command(argv, allow_run_as_root=True,
                                                    poprun_args=poprun_args))
            program = f"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_ALLOW_RUN_AS_ROOT=1 {poprun}"
        else:
            if poprun_args:
                raise ConfigError(f"poprun_args={list(poprun_args)} given, but this session has "
                                  f"one replica and runs without poprun. Fix: leave them out, "
                                  f"or replicate.", rule="K-launch-poprun-args")
            program = shlex.join(argv)
        setup = [str(c).strip() for c in setup if str(c).strip()]
        script = "\n".join([*setup, program]) + ("\n" if setup else "")
        spec: dict[str, Any] = {"jobInstances": 1}
        if self.global_replicas > 1:
            spec["modelReplicasPerWorker"] = str(self.global_replicas)
        spec["ipusPerJobInstance"] = str(self.ipus_to_request * self.instances)
        spec["workers"] = {"template": {"spec": {
            "containers": [{
                "name": name,
                "image": image,
                "command": ["/bin/bash", "-c", "--"],
                "args": [script],
                "resources": {"limits": {"cpu": cpu, "memory": memory}},
                "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                "volumeMounts": [{"mountPath": "/dev/shm", "name": "devshm"}],
            }],
            "restartPolicy": "Never",
            "hostIPC": True,
            "volumes": [{"emptyDir": {"medium": "Memory", "sizeLimit": shm_size},
                         "name": "devshm"}],
        }}}
        return {"apiVersion": "graphcore.ai/v1alpha1", "kind": "IPUJob",
                "metadata": {"generateName": f"{name}-"}, "spec": spec}

    def ipujob_yaml(self, image: str, command: str | Sequence[str], name: str,
                    **options: Any) -> str:
        """:meth:`ipujob_manifest` as the YAML ``kubectl create -f -`` reads."""
        from .job_artefacts import to_yaml

        return to_yaml(self.ipujob_manifest(image, command, name, **options))

    def slurm_script(self, program: str | Sequence[str], **options: Any) -> str:
        """A SLURM batch script (for ``sbatch``) that starts every instance of this session as
        one task, on the embedded runtime.

        The ``#SBATCH`` lines ask for ``nodes`` hosts (default: one instance per host) with the
        instances split evenly, ``cpus_per_task`` cores and ``time`` when given, under
        ``job_name``. The script runs the ``setup`` shell commands, exports the POPDIST_*
        job-wide facts, ``POPART_KIT_COORDINATOR`` (the allocation's first host and ``port``)
        and a fresh random ``POPART_KIT_JOB_SECRET``, and ``srun``s ``program``; each task finds
        its index in ``SLURM_PROCID``.
        """
        from .job_artefacts import slurm_script

        return slurm_script(self, program, **options)

    def k8s_job_manifests(self, image: str, command: str | Sequence[str], name: str,
                          **options: Any) -> list[dict[str, Any]]:
        """Kubernetes objects that start every instance of this session as one pod, on the
        embedded runtime: a headless Service ``name``, a Secret ``<name>-secret`` holding
        ``secret`` (left out when ``secret`` is None: create it with ``kubectl create secret``)
        and an Indexed Job ``name`` of one pod per instance.

        Each pod runs the ``setup`` shell commands, then ``command``, with the POPDIST_*
        job-wide facts, ``POPART_KIT_NUM_INSTANCES``, ``POPART_KIT_COORDINATOR`` (pod 0,
        ``<name>-0.<name>:<port>``) and ``POPART_KIT_JOB_SECRET`` from the Secret; Kubernetes
        gives its index in ``JOB_COMPLETION_INDEX``. ``cpu`` and ``memory`` are the container's
        limits when given. ``name`` must be a DNS-1035 label.
        """
        from .job_artefacts import k8s_job_manifests

        return k8s_job_manifests(self, image, command, name, **options)

    def k8s_job_yaml(self, image: str, command: str | Sequence[str], name: str,
                     **options: Any) -> str:
        """:meth:`k8s_job_manifests` as the YAML ``kubectl apply -f -`` reads."""
        from .job_artefacts import to_yaml

        return to_yaml(self.k8s_job_manifests(image, command, name, **options))

    def render(self, width: int = 100) -> str:
        """Readable tables of the plan (what ``popart-kit plan`` prints)."""
        from .._base.render import to_text

        return to_text(plan_view(self), width)


def plan_view(plan: Plan) -> Any:
    """The plan as rich tables: topology, batches, pipeline, replicas, sync groups, warnings."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from .._base.render import pairs

    parts: list[Any] = [Text(f"{plan.mode} session on target {plan.target!r}", style="bold")]
    request = f"{plan.ipus_to_request}" + (
        f" ({plan.idle_ipus} idle: rounded up to a power of two)" if plan.idle_ipus else "")
    parts.append(pairs("Topology", [
        ("instances", plan.instances),
        ("this instance", plan.instance_index),
        ("replicas per instance", plan.local_replicas),
        ("replicas in all", plan.global_replicas),
        ("IPUs per replica", plan.ipus_per_replica),
        ("IPUs this instance uses", plan.num_ipus),
        ("IPUs this instance requests", request),
        ("IPUs all instances use", plan.global_num_ipus),
    ]))
    parts.append(pairs("Batches", [
        ("batches per step (device iterations)", plan.batches_per_step),
        ("accumulation factor", plan.accumulation_factor),
        ("micro-batch size", plan.micro_batch_size),
        ("micro-batches per run (per input)", plan.micro_batches_per_step),
        ("samples per run, this instance", plan.samples_per_step),
        ("samples per run, all instances", plan.global_samples_per_step),
        ("global batch size (per weight update)", plan.global_batch_size),
        ("weight updates per run", plan.weight_updates_per_step),
    ]))
    if plan.pipelined:
        bubble = None if plan.bubble_fraction is None else f"{100 * plan.bubble_fraction:.1f}%"
        parts.append(pairs("Pipeline", [
            ("forward stages", plan.pipeline_stages if plan.pipeline_stages is not None
             else "from the model"),
            ("depth (stages PopART runs)", plan.pipeline_depth),
            ("bubble", bubble),
        ]))
    replicas = Table(title="Replicas", title_justify="left")
    for column in ("instance", "global id", "local id", "device IPUs"):
        replicas.add_column(column, justify="right")
    few = len(plan.replicas) <= MAX_REPLICA_ROWS
    shown = plan.replicas if few else plan.local_replica_placements[:MAX_REPLICA_ROWS]
    for r in shown:
        mark = "bold" if r.instance == plan.instance_index else "dim"
        replicas.add_row(str(r.instance), str(r.global_id), str(r.local_id),
                         ",".join(map(str, r.ipus)), style=mark)
    if not few:
        replicas.caption = _replica_caption(plan, len(shown))
    parts.append(replicas)
    sync = Table(title=f"Sync groups ({plan.sync_pattern})", title_justify="left")
    sync.add_column("group")
    sync.add_column("IPU sets of this instance")
    for name, groups in plan.sync_groups.items():
        sync.add_row(name, "  ".join("{" + ",".join(map(str, g)) + "}" for g in groups))
    parts.append(sync)
    if plan.warnings:
        parts.append(Text("Warnings", style="bold yellow"))
        parts += [Text(f"  • {w}", style="yellow") for w in plan.warnings]
    return Group(*parts)


def _replica_caption(plan: Plan, shown: int) -> str:
    """What a table of ``shown`` of this instance's replicas leaves out, and the rule for them."""
    per = plan.local_replicas
    text = (f"this instance's {per} replicas" if shown == per
            else f"the first {shown} of this instance's {per} replicas")
    if plan.instances == 1:
        return text
    ids = "global id i" if per == 1 else f"global ids {per}·i … {per}·i+{per - 1}"
    return f"{text} ({len(plan.replicas):,} in all); instance i runs {ids}"
