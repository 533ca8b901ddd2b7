"""Sessions: one facade over the popart and xla backends, with PopART's run semantics.

A ``run`` executes bps × A micro-batches on every local replica and returns the anchors as PopART
returns them. Before anything compiles, the arguments' types, the model (a valid ONNX graph:
onnx.checker and the kit's graph checks) and its pipeline annotations under the config
(PipelineLayout) are checked; on run, the inputs against the host layout (StepIOFactory) and,
unless ``check_indices=False``, index inputs against the sizes they index and int64 values
against int32's range, on the host, before compute.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from pydantic import ValidationError

from .._base.shapes import AnchorReturnType
from .._config.plan import Plan
from .._config.session_config import SessionConfig
from .._config.unknown_keys import checked_keywords
from .._host.stepio import StepIOFactory
from .._model.auto_virtual_graph import auto_placed
from .._model.checks import check_model
from .._model.execution_phases import phase_placed
from .._model.index_check import IndexChecks
from .._model.layout import PipelineLayout, load_model
from ..errors import (
    ConfigError,
    ConfigTypeError,
    DataTypeError,
    InvalidConfig,
    SessionClosedError,
    clip,
)
from .backend import BACKENDS, Backend, make_backend, resolved
from .optimizers import SGD, Adam, Adaptive

__all__ = ["InferenceSession", "TrainingSession"]


class _Session:
    """What both sessions share: model loading, the pipeline check, anchors, the backend."""

    _mode = ""
    _live: Backend | None = None  # None once closed (or before the backend is made)

    def _open(self, model: onnx.ModelProto | bytes | str | os.PathLike, config: SessionConfig,
              anchors: Any, backend: Any, check_indices: Any, popart: Any = None) -> None:
        _check_arguments(type(self).__name__, config, anchors, backend, check_indices)
        if config.mode != self._mode:
            other = "TrainingSession" if config.mode == "training" else "InferenceSession"
            raise ConfigError(f"{type(self).__name__} needs a config with mode={self._mode!r}, "
                              f"got mode={config.mode!r}. Fix: use {other}, or set "
                              f"mode={self._mode!r}.", rule="K-session-mode")
        self.config = config
        self.model = load_model(model)
        check_model(self.model)
        # on the xla backend the kit places the ops as PopART would; PopART places its own
        if resolved(backend, popart) == "xla":  # _check_arguments refused other names
            if config.virtual_graph_mode == "auto":
                self.model = auto_placed(self.model, config)
            elif config.virtual_graph_mode == "execution_phases":
                self.model = phase_placed(self.model, config)
        self.layout = PipelineLayout.from_model(self.model)
        self.micro_batch_size = _micro_batch_size(self.model, config)
        if config.pipeline.enabled or self.layout.is_annotated:
            self.layout.check(config)
        self.anchors = {name: AnchorReturnType.of(art) for name, art in anchors.items()}
        self.check_indices = check_indices
        # a model whose runs' values cannot fail them (no index input, no integer input)
        # skips them
        checks = IndexChecks.from_model(self.model) if check_indices else None
        self._indices = checks if checks is not None and checks.needed else None

    def _share_index_sizes(self) -> None:
        """Let the host-array factory draw random index inputs within the sizes they index."""
        found = self._indices or IndexChecks.from_model(self.model)
        sizes = self.io.index_sizes
        for r in found.ranges:
            sizes[r.tensor] = min(sizes.get(r.tensor, r.size), r.size)

    @property
    def plan(self) -> Plan:
        """The config's plan, with the micro-batch size read from the model's streamed inputs
        when the config leaves it unset: samples per step are what a run processes."""
        return Plan.from_config(self.config, micro_batch_size=self.micro_batch_size)

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def runtime(self) -> Any:
        """The backend that runs this session, for tests, benchmarks and profiling that look
        inside it. On the xla backend its documented attributes are ``executor`` (and
        ``pipeline`` when pipelined), ``programs`` (compiled), ``placement``, ``memory`` (the
        step's bytes by part), ``chunk``, ``on_host``, ``state`` and ``close()`` (stops a
        pipeline's worker processes; the next run starts new ones). Not part of PopART's API.
        """
        return self._backend

    @property
    def io(self) -> StepIOFactory:
        """The shapes of this session's host arrays, and helpers to make and check them."""
        return self._backend.io

    @property
    def schedule(self) -> Any:
        """The PipelineSchedule a pipelined xla session runs (None when it runs unpipelined)."""
        executor = getattr(self._backend, "pipeline", None)
        return None if executor is None else executor.schedule

    @property
    def placement(self) -> dict[tuple[int, int], Any] | None:
        """(replica, stage) -> the device it runs on, for a pipelined xla session (else None)."""
        executor = getattr(self._backend, "pipeline", None)
        if executor is None:
            return None
        self._backend.prepare()  # the memory check first; worker processes start then
        return executor.placement

    def prepare(self) -> None:
        """Compile (and, on an IPU, load) the program; ``run`` does it when needed."""
        self._backend.prepare()

    def set_random_seed(self, seed: int) -> None:
        """Seed the model's random operators (Dropout when training, RandomNormal, ...): the
        runs from here on draw the same values for the same seed, each micro-batch and
        replica its own (PopART's setRandomSeed; until it is called, a seed from the clock)."""
        self._backend.set_random_seed(seed)

    def close(self) -> None:
        """Release the session now rather than when it is collected: a pipelined xla session's
        stage worker processes stop. Every method but ``close`` then raises
        :class:`~popart_kit.SessionClosedError`; closing again does nothing. ``with`` a
        session closes it at the end of the block."""
        live, self._live = self._live, None
        close = getattr(live, "close", None)
        if close is not None:
            close()

    @property
    def _backend(self) -> Any:
        """The backend that runs the session; refuses a closed session."""
        if self._live is None:
            raise SessionClosedError(
                f"this {type(self).__name__} is closed (close() or the end of its with-block "
                f"released it), so it cannot run, prepare or give its weights any more. Fix: "
                f"read what you need (weights(), model_proto()) before closing, or create a new "
                f"session.")
        return self._live

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step: canonical host arrays in (checked first), anchors out (fresh arrays of
        their own every run)."""
        return self._run(inputs)

    def _run(self, inputs: Mapping[str, np.ndarray], copy: bool = True) -> dict[str, np.ndarray]:
        """``run``; ``copy=False`` (xla backend) may give read-only views of the run's device
        buffers, for a caller that copies them into arrays of its own (PopART's PyStepIO)."""
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            raise DataTypeError(f"run: inputs must map input names to numpy arrays, got "
                                f"{type(inputs).__name__}.", rule="K-stepio-type")
        backend = self._backend
        backend.io.check_inputs(inputs)  # the layout (in full once per layout), the one check
        if self._indices is not None:  # then the values
            self._indices.check(inputs)
        return backend.run(inputs) if copy else backend.run(inputs, copy=False)

    def weights(self) -> dict[str, np.ndarray]:
        return self._backend.weights()

    def write_weights(self, mapping: Mapping[str, np.ndarray]) -> None:
        if not isinstance(mapping, Mapping):
            raise DataTypeError(f"write_weights: expected a mapping of weight names to numpy "
                                f"arrays, got {type(mapping).__name__}.", rule="K-stepio-type")
        self._backend.write_weights(mapping)

    def model_proto(self) -> onnx.ModelProto:
        """The model with the session's current weights."""
        return self._backend.model_proto()



class InferenceSession(_Session):
    """``InferenceSession(model, config, anchors={"y": "All"}, backend="auto")``.

    ``model`` is a ModelProto, serialised bytes (Builder.getModelProto) or a path; ``anchors``
    maps any tensor of the model (inputs, weights, activations, outputs) to a return type and
    defaults to every graph output with ``All``. ``backend`` is ``"auto"`` (popart where the
    Poplar SDK imports, else xla), ``"xla"`` or ``"popart"``. ``micro_batches_per_chunk`` (xla
    only) sets how many micro-batches are evaluated at once; by default as many as keep their
    activations small. ``pipeline_workers`` (xla only) runs a pipelined model's stages on this
    process's devices (``"threads"``, the default) or in a worker process each
    (``"processes"``: on CPU, the only way stages compute side by side).
    """

    _mode = "inference"

    @checked_keywords
    def __init__(self, model: onnx.ModelProto | bytes | str | os.PathLike,
                 config: SessionConfig, anchors: Mapping[str, Any] | None = None,
                 backend: str = "auto", *, popart: Any = None,
                 micro_batches_per_chunk: int | None = None,
                 check_indices: bool = True, pipeline_workers: str | None = None) -> None:
        proto = load_model(model)
        self._open(proto, config, anchors if anchors is not None else {
            o.name: "All" for o in proto.graph.output}, backend, check_indices, popart)
        if not self.anchors:
            raise ConfigError("an inference session needs at least one anchor (PopART: 'User "
                             "must specify an anchor tensor when doing inference'). Fix: pass "
                             "anchors={tensor: 'All'} or add outputs to the model.",
                              rule="K-session-anchors")
        self._live = make_backend(backend, self.model, config, self.anchors, popart,
                                  micro_batches_per_chunk=micro_batches_per_chunk,
                                  pipeline_workers=pipeline_workers)
        self._share_index_sizes()


class TrainingSession(_Session):
    """``TrainingSession(model, config, loss=loss, optimizer=pk.SGD(...), anchors=...)``.

    Each ``run`` makes batches_per_step weight updates, each from the gradients of ``loss`` over
    A micro-batches on every local replica, reduced as ``config.accumulation.reduction`` says.
    ``anchors`` default to the loss with ``Final``. A run is atomic: it applies all its updates
    or none. On the xla backend, a run whose loss or gradients are not finite raises and
    applies nothing (``check_finite=False`` skips the check), ``micro_batches_per_chunk``
    sets how many micro-batches are evaluated at once, and ``pipeline_workers`` where a
    pipelined model's stages run (as for InferenceSession).
    """

    _mode = "training"

    @checked_keywords
    def __init__(self, model: onnx.ModelProto | bytes | str | os.PathLike,
                 config: SessionConfig, loss: str, optimizer: Any,
                 anchors: Mapping[str, Any] | None = None, backend: str = "auto", *,
                 popart: Any = None, micro_batches_per_chunk: int | None = None,
                 check_finite: bool | None = None, check_indices: bool = True,
                 pipeline_workers: str | None = None) -> None:
        if not isinstance(optimizer, SGD | Adam | Adaptive):
            raise ConfigTypeError(f"optimizer={clip(repr(optimizer), 80)}: give pk.SGD(...), "
                                  f"pk.Adam(...) or pk.Adaptive(...).", rule="K-session-type")
        if not isinstance(loss, str):
            raise ConfigTypeError(f"loss must be the name of the loss tensor (a str), got "
                                  f"{type(loss).__name__}.", rule="K-session-type")
        self._open(model, config, anchors if anchors is not None else {loss: "Final"}, backend,
                   check_indices, popart)
        self._live = make_backend(
            backend, self.model, config, self.anchors, popart, loss=loss, optimizer=optimizer,
            micro_batches_per_chunk=micro_batches_per_chunk, check_finite=check_finite,
            pipeline_workers=pipeline_workers)
        self._share_index_sizes()
        self.loss, self.optimizer = loss, optimizer

    def set_optimizer(self, optimizer: Any) -> None:
        """New hyperparameters (learning rate, ...) for the next runs, without recompiling;
        the optimizer must be of the same kind (type and program_key), as PopART requires."""
        if type(optimizer) is not type(self.optimizer) or (
                optimizer.program_key != self.optimizer.program_key):
            raise ConfigError(f"set_optimizer: {clip(repr(optimizer), 200)} is not the same kind "
                              f"of optimizer as {self.optimizer!r}. Fix: change only its numbers "
                              f"(learning rate, momentum, ...), or make a new session.",
                              rule="K-session-optimizer")
        self._backend.set_optimizer(optimizer)
        self.optimizer = optimizer

    def set_learning_rate(self, learning_rate: float) -> None:
        """The optimizer's learning rate for the next runs (refused unless finite in float32)."""
        try:
            optimizer = self.optimizer.with_learning_rate(learning_rate)
        except ValidationError as err:
            raise InvalidConfig.wrap(err) from None
        self.set_optimizer(optimizer)

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state as host arrays: ``{}`` for SGD without momentum,
        ``{"velocity": {weight: array}}`` with momentum (kept as PopART keeps it: scaled by the
        velocity scaling, and with Combined already holding the next step's terms), and
        ``{"step": array, "m": {weight: array}, "v": {weight: array}}`` for Adam."""
        state = getattr(self._backend, "optimizer_state", None)
        if state is None:
            raise ConfigError(f"the {self.backend} backend does not hand out the optimizer "
                              f"state. Fix: read it with PopART's own readWeights/modelToHost "
                              f"under its reserved names (Accl___, Accl1___, ...).",
                              rule="K-optimizer-state")
        return state()

    def set_optimizer_state(self, state: Mapping[str, Any]) -> None:
        """Start the next runs from an optimizer state (a checkpoint's): ``state`` as
        :meth:`optimizer_state` returns it, or part of it (the keys and weights left out keep
        their values), each array of the state's shape (cast to its dtype); the weights
        themselves go through :meth:`write_weights`. Refused, before anything changes: a key
        or weight the state lacks, another shape, a backend that takes no state."""
        setter = getattr(self._backend, "set_optimizer_state", None)
        if setter is None:
            raise ConfigError(f"the {self.backend} backend does not take an optimizer state. "
                              f"Fix: load a model holding it under PopART's reserved names "
                              f"(Accl___, Accl1___, ...), as modelToHost writes it.",
                              rule="K-optimizer-state")
        if not isinstance(state, Mapping):
            raise DataTypeError(f"set_optimizer_state: expected the mapping optimizer_state() "
                                f"returns, got {type(state).__name__}.", rule="K-stepio-type")
        setter(state)



def _micro_batch_size(model: onnx.ModelProto, config: SessionConfig) -> int | None:
    """The samples in one micro-batch: ``config.micro_batch_size``, checked against the leading
    dimension of every streamed input (all disagreeing inputs refused at once), or, unset, that
    dimension when the inputs agree on it."""
    weights = {t.name for t in model.graph.initializer}
    leading = {}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name not in weights and dims and dims[0].HasField("dim_value"):
            leading[value.name] = dims[0].dim_value
    mbs = config.micro_batch_size
    if mbs is None:
        sizes = set(leading.values())
        return sizes.pop() if len(sizes) == 1 else None
    wrong = {name: size for name, size in leading.items() if size != mbs}
    if wrong:
        listed = ", ".join(f"{name!r} has {size}" for name, size in wrong.items())
        sizes = sorted(set(wrong.values()))
        raise ConfigError(
            f"micro_batch_size={mbs}, but the model's streamed inputs disagree: the leading "
            f"dimension of an input is the micro-batch, and {listed}. A plan would count "
            f"{mbs} samples per micro-batch where a run processes {sizes[0]}. Fix: set "
            f"micro_batch_size={sizes[0]}" + (" (the inputs also disagree among themselves)"
                                               if len(sizes) > 1 else "")
            + ", or build the model's inputs with a leading dimension of "
            f"{mbs}. See docs/rules.md#K-micro-batch-size.", rule="K-micro-batch-size")
    return mbs


def _check_arguments(session: str, config: Any, anchors: Any, backend: Any,
                     check_indices: Any) -> None:
    """Refuse arguments of the wrong type, all at once, before anything is loaded."""
    wrong = []
    if not isinstance(config, SessionConfig):
        hint = (" (a dict: pass pk.SessionConfig(**it) or pk.SessionConfig.model_validate(it))"
                if isinstance(config, Mapping) else "")
        wrong.append(f"config must be a pk.SessionConfig, got {type(config).__name__}{hint}")
    if not isinstance(anchors, Mapping) or not all(isinstance(k, str) for k in anchors):
        wrong.append(f"anchors must map tensor names (str) to return types, got "
                     f"{clip(repr(anchors), 80)}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        wrong.append(f"backend={clip(repr(backend), 60)}: use one of {', '.join(BACKENDS)}")
    if not isinstance(check_indices, bool):
        wrong.append(f"check_indices must be True or False, got {type(check_indices).__name__}")
    if wrong:
        raise ConfigTypeError(f"{session}: " + "; ".join(wrong) + ".", rule="K-session-type")
