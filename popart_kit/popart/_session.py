"""popart.InferenceSession and popart.TrainingSession over the kit's sessions (xla backend).

A PopART session is made from (model, DataFlow, DeviceInfo, SessionOptions); here those become
one SessionConfig (every configuration problem reported at once, as a popart_exception) and a
``pk.InferenceSession`` / ``pk.TrainingSession``. PyStepIO arrays are read by element count in
PopART's order ([bps, A, R, *S]) and anchors written back in place; PyStepIOCallback is asked
for one micro-batch per replica at a time, micro-batch major and replica minor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging as _logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from .._base import names as _names
from .._base.atomic import write_atomic
from .._base.problems import popart_rules
from .._config.session_config import SessionConfig
from .._model.layout import ExternalInfo, PipelineLayout, load_model
from .._model.tensors import as_popart_stores, to_array
from .._runtime.session import InferenceSession as _KitInference
from .._runtime.session import TrainingSession as _KitTraining
from ..errors import FileWriteError, ModelError, short
from ._core import (
    RESERVED_PREFIXES,
    AnchorReturnType,
    DataFlow,
    OutOfMemoryException,
    Patterns,
    PyStepIO,
    PyStepIOCallback,
    PyWeightsIO,
    TensorInfo,
    _contiguous,
    popart_exception,
    popart_text,
    poplar_exception,
)
from ._devices import DeviceInfo
from ._ir_json import ir_json
from ._optimizers import Optimizer
from ._options import SessionOptions
from ._refusals import check_program

GRADIENT = RESERVED_PREFIXES["Gradient"]
#: Automatic loss scaling's variables in a checkpoint (automaticlossscaling.cpp).
LOSS_SCALE_UPDATE_FACTOR = "lossScaleUpdateFactor"
_HISTOGRAM, _LOSS_SCALE_UPDATE = "ai.graphcore.Histogram:1", "ai.graphcore.LossScaleUpdate:1"
#: Operators that make a PopART session need a random seed (Ir::getRequiresRandomSeed).
_RANDOM_OPS = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform",
                         "RandomUniformLike", "Multinomial", "Bernoulli", "ShapedDropout"})


def _has_random_ops(model: onnx.ModelProto) -> bool:
    """Whether a node of the model, its subgraphs or its functions is a random operator."""
    def random(nodes: Any) -> bool:
        return any(n.op_type in _RANDOM_OPS or any(
            random(g.node) for a in n.attribute for g in ([a.g] if a.HasField("g") else a.graphs))
            for n in nodes)

    return random(model.graph.node) or any(random(f.node) for f in model.functions)


def _load(fnModel: Any, external: dict[str, ExternalInfo] | None = None) -> onnx.ModelProto:
    """The model PopART's ``fnModel`` names: a ModelProto, its bytes, a path, or the bytes as
    a str (as PopART's bindings take them); everything the kit's loader refuses is a
    popart_exception. Where its initializers' external data came from goes into
    ``external``."""
    if isinstance(fnModel, str) and not os.path.exists(fnModel):
        try:
            fnModel = fnModel.encode("latin-1")
        except UnicodeEncodeError:
            raise popart_exception(f"Failed to load a ModelProto from {short(fnModel, 80)}: not "
                                   f"an existing file nor a serialised model.") from None
    if not isinstance(fnModel, onnx.ModelProto | bytes | str | os.PathLike):
        raise TypeError(f"fnModel={short(fnModel)}: give the bytes of builder.getModelProto(), "
                        f"a path to an .onnx file or an onnx.ModelProto.")
    try:
        return load_model(fnModel, popart_external=True,  # PopART's external data
                          external_info=external)
    except ModelError as err:
        raise popart_exception(getattr(err, "popart_text", None)
                               or f"Failed to load a ModelProto: {err}") from None


def _device_ipus(device: DeviceInfo, replicas: int, model: onnx.ModelProto,
                 virtual: bool) -> int:
    """IPUs per replica: the device's IPUs over the replicas (PopART's rule); host devices (CPU,
    IPU Model) stretch to what the model's annotations use."""
    needed = max(PipelineLayout.from_model(model).ipus_used, default=0) + 1
    host = device.type.name in ("Cpu", "IpuModel")
    if not virtual:
        return 1
    if not host and device.numIpus % replicas:
        raise popart_exception(f"The device has {device.numIpus} IPUs, not a multiple of the "
                               f"replication factor {replicas}. Fix: acquire replicas x IPUs "
                               f"per replica ({replicas} x {needed} = {replicas * needed}) IPUs.")
    per_replica = max(device.numIpus // replicas, 1)
    if host:
        return max(per_replica, needed)
    if per_replica < needed:
        raise popart_exception(f"The model places ops on {needed} IPUs per replica but the "
                               f"device has {device.numIpus} IPUs for {replicas} replica(s). "
                               f"Fix: acquire {replicas * needed} IPUs.")
    return per_replica


def _config(mode: str, opts: SessionOptions, flow: DataFlow, device: DeviceInfo,
            model: onnx.ModelProto) -> SessionConfig:
    if mode == "inference" and opts.enableGradientAccumulation:
        raise popart_exception("Gradient Accumulation only available when training.")
    replicas = opts.replicatedGraphCount if opts.enableReplicatedGraphs else 1
    virtual = opts.virtualGraphMode.name != "Off" or opts.enablePipelining
    try:
        return SessionConfig.from_session_options(
            opts.changed(), mode=mode, batches_per_step=flow.batchesPerStep(),
            ipus_per_replica=_device_ipus(device, replicas, model, virtual),
            device={"target": "offline",
                    "sync_pattern": _names.kit_name(_names.SYNC_PATTERN,
                                                    device.syncPattern.name)})
    except popart_exception:
        raise
    except ValueError as err:
        raise popart_exception(popart_text(err)) from None


def _tensor_types(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    with contextlib.suppress(Exception):  # custom ops: keep what the model records
        model = onnx.shape_inference.infer_shapes(model)
    out: dict[str, TensorInfo] = {}
    for value in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        t = value.type.tensor_type
        if t.elem_type and t.HasField("shape"):
            out[value.name] = TensorInfo(onnx.TensorProto.DataType.Name(t.elem_type),
                                         [d.dim_value for d in t.shape.dim])
    for init in model.graph.initializer:
        out[init.name] = TensorInfo(onnx.TensorProto.DataType.Name(init.data_type),
                                    list(init.dims))
    return out


def _flat_into(name: str, target: Any, values: np.ndarray, kind: str, who: str) -> None:
    """Copy ``values`` into the user's ``target`` in place, refusing (as PopART does) a target
    whose memory cannot take them as one flat block: a copy would be written and lost."""
    _check_into(name, target, values.size, values.dtype, kind, who)
    target.reshape(-1)[...] = values.reshape(-1)


def _check_into(name: str, target: Any, size: int, dtype: Any, kind: str, who: str) -> None:
    """Refuse a ``target`` that cannot take ``size`` values of ``dtype`` in place (see
    :func:`_flat_into`)."""
    _contiguous(kind, name, target, who)
    if not target.flags.writeable:
        raise popart_exception(f"Unable to write the {kind} array for tensor '{name}': it is "
                               f"read-only. Fix: pass a writeable array.")
    if target.size != size:
        raise popart_exception(f"Unexpected number of {kind} elements for Tensor {name}. "
                               f"Expected {size}, but received {target.size}.")
    if target.dtype != dtype:
        raise popart_exception(f"Type discrepancy for tensor {name}. User provided : "
                               f"{target.dtype}, and expected : {dtype}")


class _Session:
    """What both sessions share; ``self._kit`` is the kit session that runs the program."""

    _kit: Any

    def __init__(self, mode: str, fnModel: Any, dataFlow: DataFlow, deviceInfo: DeviceInfo,
                 userOptions: SessionOptions | None, loss: str | None = None,
                 optimizer: Optimizer | None = None, inputShapeInfo: Any = None) -> None:
        if not isinstance(dataFlow, DataFlow):
            raise TypeError(f"dataFlow={dataFlow!r}: give popart.DataFlow(batchesPerStep, "
                            f"anchors).")
        if not isinstance(deviceInfo, DeviceInfo):
            raise popart_exception(f"deviceInfo={deviceInfo!r}: a session needs a device. Fix: "
                                   f"popart.DeviceManager().createCpuDevice() or "
                                   f"acquireAvailableDevice(n).")
        opts = userOptions if userOptions is not None else SessionOptions()
        if not isinstance(opts, SessionOptions):
            raise TypeError(f"userOptions={opts!r}: give a popart.SessionOptions().")
        #: where each externally saved initializer (and its optimizer state) lives on disk,
        #: in the model's order (PopART's Ir keeps it in its ModelProto: session.cpp:684)
        self._external: dict[str, ExternalInfo] = {}
        self.model = _load(fnModel, self._external)
        if inputShapeInfo is not None:
            self.model = inputShapeInfo.shaped(self.model)
        self.dataFlow, self.deviceInfo, self.options = dataFlow, deviceInfo, opts
        self.config = _config(mode, opts, dataFlow, deviceInfo, self.model)
        check_program(self.model, training=mode == "training", options=opts,
                      patterns=getattr(self, "patterns", None), loss=loss,
                      anchors=list(dataFlow.returnTypes()))  # PopART's refusals: V6, V54-V66
        if opts.automaticLossScalingSettings.enabled:  # automaticlossscaling.cpp, apply()
            if mode != "training":
                raise popart_exception("[AutomaticLossScale transform] Only compatible when "
                                       "doing training")
            if getattr(optimizer, "_scaled", False):  # adam.cpp, setFactorsFromOptions
                raise popart_exception("scaledOptimizerState and automaticLossScaling are not "
                                       "compatible.")
            if optimizer is not None and optimizer.values["lossScaling"][1]:
                raise popart_exception("[AutomaticLossScale transform] The optimizer must "
                                       "have non-const loss scaling")
        anchors = {name: art.kit for name, art in dataFlow.returnTypes().items()}
        try:
            # PopART's refusals only: the kit's stricter rules warn; and a run whose loss or
            # update is not finite completes, as on PopART
            with popart_rules():
                if mode == "training":
                    self._kit = _KitTraining(self.model, self.config, loss=loss,
                                             optimizer=optimizer.kit, anchors=anchors,
                                             backend="xla", check_finite=False)
                else:
                    self._kit = _KitInference(self.model, self.config, anchors=anchors,
                                              backend="xla")
        except ValueError as err:
            raise popart_exception(popart_text(err)) from None
        self._types = _tensor_types(self.model)
        self._save_state_externally()
        self._pending: dict[str, np.ndarray] = {}
        self._seed: int | None = None
        self._prepared = False  # prepareDevice called (PopART's Devicex::prepareHasBeenCalled)
        self._weights_sent = False  # weightsFromHost called

    # -- numbers ----------------------------------------------------------------------------

    @property
    def replicationFactor(self) -> int:
        return self.config.replication.local_factor

    @property
    def accumulationFactor(self) -> int:
        return self.config.accumulation.factor

    def getInfo(self, id: str) -> TensorInfo:  # noqa: A002
        base = id[len(GRADIENT):] if id.startswith(GRADIENT) else id
        if base not in self._types:
            raise popart_exception(f"No tensor {id!r} in the model; known tensors include "
                                   f"{sorted(self._types)[:8]}.")
        return self._types[base]

    def getAllTensorIds(self) -> set[str]:
        return set(self._types)

    getTensorIds = getAllTensorIds

    # -- the device ---------------------------------------------------------------------------

    def _check_virtual_graphs(self) -> None:
        """V67, popx/irlowering.cpp:2979: on a device with a known number of IPUs (an IPU Model;
        a CPU device stretches to what the model uses), an op placed on a virtual graph the
        device does not have is refused when the device is prepared. The op is named as
        PopART names it then: inputs from another IPU arrive through copies (``t_c<ipu>``)."""
        opts = self.options
        if self.deviceInfo.type.name != "IpuModel" or (
                opts.virtualGraphMode.name == "Off" and not opts.enablePipelining):
            return
        replicas = opts.replicatedGraphCount if opts.enableReplicatedGraphs else 1
        ipus = max(self.deviceInfo.numIpus // replicas, 1)
        layout = PipelineLayout.from_model(self.model)
        made_on = {t: op.ipu for op in layout.ops for t in op.outputs}
        for op in layout.ops:
            if op.ipu is not None and not 0 <= op.ipu < ipus:
                copied = tuple(f"{t}_c{op.ipu}" if t in made_on and made_on[t] != op.ipu else t
                               for t in op.inputs)
                raise popart_exception(
                    f"{dataclasses.replace(op, inputs=copied).debug_name} has been assigned to "
                    f"an invalid virtual graph {op.ipu}. numIPUs = {ipus}.")

    def prepareDevice(self, loadEngine: bool = True) -> None:
        self._check_virtual_graphs()
        try:
            self._kit.prepare()
        except ValueError as err:
            if "K-memory" in getattr(err, "rules", ()):  # the step does not fit the device
                raise OutOfMemoryException(err) from None
            raise popart_exception(popart_text(err)) from None
        self._prepared = True

    def _require_prepared(self, what: str) -> None:
        """PopART's Devicex refuses these before prepareDevice (willow/src/popx/devicex.cpp,
        willow/src/session.cpp)."""
        if not self._prepared:
            raise popart_exception(f"Devicex::prepare() must be called before {what} is "
                                   f"called.")

    def loadEngineAndConnectStreams(self) -> None:
        """Nothing to load on the xla runtime."""

    def _random(self, what: str) -> bool:
        """PopART's Ir::getRequiresRandomSeed: random operators or stochastic rounding; a
        session without them warns that ``what`` does nothing."""
        random = self.options.enableStochasticRounding or _has_random_ops(self.model)
        if not random:
            _logging.getLogger("popart.session").warning(
                f"Trying to {what}, but this session has no random behaviour. Doing nothing.")
        return random

    def setRandomSeed(self, seedValue: int) -> None:
        """Seed the session's random operators: the runs from here on draw the same values
        for the same seed (each step and replica its own; not Poplar's numbers, see
        popart_kit._runtime.xla.ops_random). PopART's Session::setRandomSeed: a session
        without random behaviour ignores it (with a warning); one with it needs
        prepareDevice first."""
        if isinstance(seedValue, bool) or not isinstance(seedValue, int) or \
                not 0 <= seedValue < 2**64:
            raise TypeError(f"setRandomSeed({seedValue!r}): the seed is a uint64.")
        if not self._random("set the random seed"):
            return
        self._require_prepared("Devicex::setRandomSeedFromHost(uint64_t)")
        self._seed = seedValue
        self._kit.set_random_seed(seedValue)

    def getRandomSeed(self) -> int:
        """The seed the next run continues from (moved on by every step since it was set:
        setRandomSeed(getRandomSeed()) continues the same sequence); 0, with a warning, for a
        session without random behaviour."""
        if not self._random("get the random seed"):
            return 0
        self._require_prepared("Devicex::getRandomSeedToHost()")
        runtime = self._kit.runtime
        if hasattr(runtime, "random_seed"):
            return int(runtime.random_seed())
        return self._seed or 0

    def initAnchorArrays(self) -> dict[str, np.ndarray]:
        io = self._kit.io
        return {name: np.zeros(io.anchor_shape(name), io.anchors[name][0].dtype)
                for name in io.anchors}

    # -- a run ----------------------------------------------------------------------------------

    def run(self, stepio: PyStepIO | PyStepIOCallback, debugName: str = "") -> None:
        # PopART's Session::run (willow/src/session.cpp): a training session with weights
        # runs only after weightsFromHost; any session only after prepareDevice
        if (isinstance(self, TrainingSession) and not self._weights_sent
                and len(self.model.graph.initializer)):
            raise popart_exception("Must call weightsFromHost before run as the model has "
                                   "initializers and the session has been created in "
                                   "training mode")
        self._require_prepared("Devicex::run(const IStepIO &)")
        if isinstance(stepio, PyStepIOCallback):
            inputs = self._pull(stepio)
        elif isinstance(stepio, PyStepIO):
            inputs = self._arrays(stepio)
            self._check_outputs(stepio)  # before the run: a refused buffer changes nothing
        else:
            raise TypeError(f"run({stepio!r}): give a popart.PyStepIO or PyStepIOCallback.")
        try:
            # the anchors as views of the run's results, copied once, into the user's arrays
            out = self._kit._run(inputs, copy=False)
        except ValueError as err:
            raise popart_exception(popart_text(err)) from None
        if isinstance(stepio, PyStepIOCallback):
            self._push(stepio, out)
        else:  # every output array was checked before the run (_check_outputs)
            for name, values in out.items():
                stepio.outputs[name].reshape(-1)[...] = values.reshape(-1)

    @functools.cached_property
    def _host_layout(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Each input's and anchor's host shape and element count, worked out on the first run
        (they are the session's, fixed)."""
        io = self._kit.io
        return tuple(
            {name: (tuple(shape(name)), int(np.prod(shape(name)))) for name in names}
            for names, shape in ((io.inputs, io.input_shape), (io.anchors, io.anchor_shape)))

    def _check_outputs(self, stepio: PyStepIO) -> None:
        """PyStepIO's output arrays, checked as the run will write them (see _flat_into)."""
        io, sizes = self._kit.io, self._host_layout[1]
        for name, (spec, _) in io.anchors.items():
            if name not in stepio.outputs:
                raise popart_exception(f"No tensor {name} provided in PyStepIO's outputs")
            _check_into(name, stepio.outputs[name], sizes[name][1], spec.dtype, "output",
                        "PyStepIO")

    def _arrays(self, stepio: PyStepIO) -> dict[str, np.ndarray]:
        io, inputs = self._kit.io, {}
        if stepio.runtime_asserts:
            for name in stepio.inputs:
                if name not in io.inputs:
                    raise popart_exception(
                        f"The tensor '{name}' has been provided as one of the inputs to the "
                        f"stepIO, but it is not registered as one of the inputs to the model. "
                        f"Inputs of the model: {sorted(io.inputs)}.")
        layout = self._host_layout[0]
        for name, spec in io.inputs.items():
            if name not in stepio.inputs:
                raise popart_exception(f"No tensor {name} provided in PyStepIO's inputs")
            array, (shape, size) = stepio.inputs[name], layout[name]
            if array.size != size:
                raise popart_exception(
                    f"Unexpected number of input elements for Tensor {name}. Expected "
                    f"{size}, but received {array.size}.\nhost shape "
                    f"[bps, A, R, *S] = {list(shape)} (replication factor = "
                    f"{self.replicationFactor}, accumulation factor = "
                    f"{self.accumulationFactor}, batches per step = "
                    f"{self.dataFlow.batchesPerStep()}, Tensor nelms = {spec.nelms})")
            inputs[name] = self._typed(name, array, spec.dtype).reshape(shape)
        return inputs

    @staticmethod
    def _typed(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
        if array.dtype == dtype:
            return array
        if array.dtype == np.int64 and dtype == np.int32:
            return array.astype(np.int32)
        raise popart_exception(f"Type discrepancy for tensor {name}. User provided : "
                               f"{array.dtype}, and expected : {dtype}")

    def _pull(self, stepio: PyStepIOCallback) -> dict[str, np.ndarray]:
        io, c = self._kit.io, self.config
        micro = c.batches_per_step * c.accumulation.factor
        chunks: dict[str, list[np.ndarray]] = {name: [] for name in io.inputs}
        for _ in range(micro):
            for name, spec in io.inputs.items():
                for _ in range(1 if spec.broadcast else self.replicationFactor):
                    array = stepio.input_callback(name, False)
                    if array is None or np.ndim(array) == 0:
                        raise popart_exception(f"[StepIOSplitter] IStepIO unexpectedly did not "
                                               f"provide input data for tensor {name}")
                    array = _contiguous("input", name, np.asarray(array), "PyStepIOCallback")
                    if array.size != spec.nelms:
                        raise popart_exception(
                            f"PyStepIOCallback: input_callback({name!r}) gave {array.size} "
                            f"elements, one micro-batch of one replica has {spec.nelms} "
                            f"(shape {list(spec.shape)}).")
                    chunks[name].append(self._typed(name, array, spec.dtype).reshape(spec.shape))
                    stepio.input_complete_callback(name)
        return {name: np.stack(chunks[name]).reshape(io.input_shape(name)) for name in chunks}

    def _push(self, stepio: PyStepIOCallback, out: Mapping[str, np.ndarray]) -> None:
        io = self._kit.io
        for name, values in out.items():
            spec = io.anchors[name][0]
            for piece in values.reshape(-1, *spec.shape):
                _flat_into(name, stepio.output_callback(name), piece, "output",
                           "PyStepIOCallback")
                stepio.output_complete_callback(name)

    # -- weights --------------------------------------------------------------------------------

    def _weights(self) -> dict[str, np.ndarray]:
        return self._kit.weights()

    @property
    def _groupings(self) -> dict[str, Any]:
        """The weights of more than one group of replicas (VariableSettings), by name."""
        return getattr(self._kit.runtime, "groupings", {})

    def _host_view(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Weights (and their optimizer state, PopART's reserved prefix + the weight's name)
        as PopART's readWeights returns them: a grouped weight [groups, *shape], or
        [replicas, *shape] with VariableRetrievalMode.AllReplicas."""
        groupings = self._groupings
        if not groupings:
            return tensors
        prefixes = set(RESERVED_PREFIXES.values())
        out = dict(tensors)
        for name, value in tensors.items():
            weight = name if name in groupings else next(
                (w for w in groupings if name.endswith(w) and name[:-len(w)] in prefixes), None)
            if weight is not None:
                out[name] = groupings[weight].to_host(value)
        return out

    def weightsFromHost(self) -> None:
        """Copy the host weights (writeWeights, resetHostWeights) to the device."""
        self._weights_sent = True
        if self._pending:
            current = self._weights()
            update = {k: np.asarray(v, current[k].dtype).reshape(current[k].shape)
                      for k, v in self._pending.items()}
            try:
                self._kit.write_weights(update)
            except ValueError as err:
                raise popart_exception(popart_text(err)) from None
            self._pending = {}

    def weightsToHost(self) -> None:
        """The device's weights are read fresh by readWeights and modelToHost."""
        self._require_prepared("Devicex::weightsToHost(const std::map<TensorId, "
                               "MutableVoidData> &)")

    def writeWeights(self, weightsIo: PyWeightsIO) -> None:
        if isinstance(self, InferenceSession) and self.options.constantWeights:
            raise popart_exception("Cannot call writeWeights when constantWeights is set. Set "
                                   "`constantWeights` to False in the `SessionOption`s when "
                                   "initialising the session to enable this behaviour.")
        current = self._weights()
        for name, array in weightsIo.weights.items():
            if name not in current:
                raise popart_exception(f"writeWeights: {name!r} is not a weight of the model "
                                       f"({', '.join(sorted(current))}).")
            grouping = self._groupings.get(name)
            expected = grouping.host_shape() if grouping else current[name].shape
            if array.size != int(np.prod(expected)):
                raise popart_exception(f"writeWeights: {name!r} has {array.size} elements, the "
                                       f"weight {list(expected)} has "
                                       f"{int(np.prod(expected))}.")
            self._pending[name] = grouping.from_host(np.array(array)) if grouping else \
                np.array(array)

    def readWeights(self, weightsIo: PyWeightsIO) -> None:
        tensors = self._host_view(self._weights() | self._optimizer_tensors())
        for name, target in weightsIo.weights.items():
            if name not in tensors:
                raise popart_exception(f"readWeights: no weight or optimizer state named "
                                       f"{name!r}; weights: {', '.join(sorted(tensors))}.")
            _flat_into(name, target, np.asarray(tensors[name]), "weight", "PyWeightsIO")

    def resetHostWeights(self, modelProtoOrFilename: Any,
                         ignoreWeightsInModelWithoutCorrespondingHostWeight: bool = False
                         ) -> None:
        """PopART's Session::resetHostWeights (session.cpp:787): refused for an inference
        session with constantWeights (its weights are compiled in)."""
        if isinstance(self, InferenceSession) and self.options.constantWeights:
            raise popart_exception("Cannot call resetHostWeights when constantWeights is set")
        current = self._weights()
        for init in _load(modelProtoOrFilename).graph.initializer:
            if init.name in current:
                self._pending[init.name] = to_array(init)
            elif not ignoreWeightsInModelWithoutCorrespondingHostWeight:
                # popx/executablex.cpp:263 (skipped with
                # ignoreWeightsInModelWithoutCorrespondingHostWeight=True)
                raise popart_exception(f"resetWeights, no tensor '{init.name}' in tensors")

    def _optimizer_tensors(self) -> dict[str, np.ndarray]:
        return {}

    def _save_state_externally(self) -> None:
        """PopART's Ir::addAdditionalModelProtoTensors (ir.cpp:1872), when the session is
        made: the optimizer state of a weight saved externally is appended to the weight's
        file (state prefix by prefix, weights in the model's order), and modelToHost writes
        it there from then on."""
        if not self._external:
            return
        prefixes = [v for k, v in RESERVED_PREFIXES.items() if k in
                    ("Accl", "Accl1", "Accl2", "Accl3", "Step")]
        state = self._optimizer_tensors()
        weights = list(self._external)
        for prefix in prefixes:
            for weight in weights:
                name = prefix + weight
                if name not in state or name in self._external:
                    continue  # a model's own state (a checkpoint) is an initializer already
                location = self._external[weight].location
                data = np.ascontiguousarray(state[name]).tobytes()
                if not os.path.exists(location):  # onnxutil.cpp:465
                    raise popart_exception(f"TensorIds '{name} ' to be saved externally to "
                                           f"existing file {location}, but file doesn't exist")
                with open(location, "ab") as f:
                    offset = f.tell()
                    f.write(data)
                self._external[name] = ExternalInfo(location, offset, len(data))

    def _write_external(self, values: Mapping[str, np.ndarray]) -> None:
        """Session::modelToHost's write-back (session.cpp:716): each externally saved tensor's
        bytes go to its file at its offset, the file otherwise kept. Refused, in PopART's
        words, before anything is written: a location that no longer exists from the working
        directory (onnxutil.cpp:187)."""
        for name, where in self._external.items():
            problem = where.problem(name)
            if problem:
                raise popart_exception(problem)
        for name, where in self._external.items():
            if name not in values:
                continue
            data = np.ascontiguousarray(values[name]).tobytes()
            if len(data) != where.length:
                raise popart_exception(
                    f"Trying to update initializer {name}, stored in file {where.location}, "
                    f"when writing modelToHost: it has {len(data)} bytes, the file holds "
                    f"{where.length} for it. Fix: save the model's initializers externally "
                    f"again (Builder.saveInitializersExternally).")
            try:
                with open(where.location, "r+b") as f:
                    f.seek(where.offset)
                    f.write(data)
            except OSError as err:
                raise popart_exception(
                    f"Trying to update initializer {name}, stored in file {where.location}, "
                    f"when writing modelToHost. Failed to open file ({err.strerror})") from None

    def modelToHost(self, fn: str) -> None:
        """Write the model with the device's weights (and optimizer state under PopART's
        reserved names) to ``fn``. As PopART (session.cpp:684), a tensor the model keeps in
        an external file stays there: its new values are written into that file, where it
        was read from (see :meth:`updateExternallySavedTensorLocations` to move it)."""
        self.weightsToHost()
        proto = self._kit.model_proto()
        state = self._optimizer_tensors()
        known = {t.name: t for t in proto.graph.initializer}
        for name, array in state.items():  # the state now, also over a checkpoint's
            array = np.asarray(array)
            tensor = onnx.helper.make_tensor(  # INT32 in int32_data, as PopART writes it
                name, onnx.TensorProto.INT32, array.shape, array.reshape(-1).tolist()) \
                if array.dtype == np.int32 else numpy_helper.from_array(array, name)
            if name in known:
                known[name].CopyFrom(tensor)
            else:
                proto.graph.initializer.append(tensor)
        if self._external:
            self._write_external(self._host_view(self._weights() | state))
        for tensor in proto.graph.initializer:
            where = self._external.get(tensor.name)
            if where is None:
                tensor.CopyFrom(as_popart_stores(tensor))
                continue
            kept = onnx.TensorProto(name=tensor.name, dims=tensor.dims,
                                    data_type=tensor.data_type,
                                    data_location=onnx.TensorProto.EXTERNAL)
            kept.external_data.extend(where.entries())
            tensor.CopyFrom(kept)
        try:
            write_atomic(fn, proto.SerializeToString())
        except FileWriteError as err:
            raise popart_exception(popart_text(err)) from None

    def updateExternallySavedTensorLocations(self, fromLocation: str, toLocation: str) -> None:
        """PopART's Session::updateExternallySavedTensorLocations (session.cpp:621): the
        tensors whose data the file ``fromLocation`` holds (the location as the model names
        it) are copied, as that file holds them now, into the new file ``toLocation`` (one
        after another), and modelToHost writes them there from then on. Refuses, in PopART's
        words: an existing ``toLocation``, a missing ``fromLocation``, no tensor stored in
        it, and a missing parent folder of ``toLocation`` (onnxutil.cpp:449)."""
        start = (f"Updating externally saved tensor location from file '{fromLocation}' to "
                 f"file '{toLocation}', but file")
        if os.path.exists(toLocation):
            raise popart_exception(f"{start} '{toLocation}' already exists")
        if not os.path.exists(fromLocation):
            raise popart_exception(f"{start} '{fromLocation}' does not exist")
        moved = [n for n, w in self._external.items() if w.location == fromLocation]
        if not moved:
            raise popart_exception(f"No ONNX model initializers have external location set "
                                   f"to '{fromLocation}'")
        folder = os.path.dirname(toLocation)
        if folder and not os.path.isdir(folder):
            raise popart_exception(f"Saving tensor data to file {toLocation}, but its parent "
                                   f"directory does not exist")
        blob, placed = bytearray(), {}
        with open(fromLocation, "rb") as f:
            for name in moved:
                where = self._external[name]
                f.seek(where.offset)
                data = f.read(where.length)
                if len(data) != where.length:
                    raise popart_exception(
                        f"External data of tensor '{name}' in {fromLocation}: {where.length} "
                        f"bytes from offset {where.offset} asked, {len(data)} there. Fix: "
                        f"save the model's initializers externally again.")
                placed[name] = ExternalInfo(toLocation, len(blob), len(data))
                blob += data
        try:
            write_atomic(toLocation, bytes(blob))
        except FileWriteError as err:
            raise popart_exception(popart_text(err)) from None
        self._external.update(placed)

    # -- what the xla runtime does not have -----------------------------------------------------

    def _absent(self, what: str) -> Any:
        raise popart_exception(f"{what} is not available on popart_kit's xla runtime (no "
                               f"Poplar executable, report or cycle counter). Fix: run this "
                               f"program with the Poplar SDK's popart for it.")

    def getCycleCount(self, id: str = "") -> int:  # noqa: A002
        return self._absent("getCycleCount")

    def compileAndExport(self, filename: str) -> None:
        self._absent("compileAndExport")

    def saveExecutable(self, path: str, savePrng: bool = True, saveVariables: bool = True
                       ) -> None:
        self._absent("saveExecutable")

    def loadExecutable(self, filename: str) -> None:
        self._absent("loadExecutable")

    def getSummaryReport(self, resetProfile: bool = True) -> str:
        """No Poplar report exists here. On a CPU device PopART has none either: Poplar
        refuses to profile it (poplar_exception, in Poplar's words)."""
        if self.deviceInfo.type.name == "Cpu":
            raise poplar_exception("getSummaryReport: Profiling is disabled for current "
                                   "device type.")
        return self._absent("getSummaryReport")

    def getReport(self) -> Any:
        return self._absent("getReport")

    def getSerializedGraph(self) -> bytes:
        return self._absent("getSerializedGraph")

    def _serializeIr(self, format: Any = None) -> str:  # noqa: A002 - PopART's name
        """The graph this session runs as PopART's JSON IR (the only format PopART writes):
        the model's nodes, not PopART's IR after its patterns (see popart._ir_json)."""
        return ir_json(self._kit.model)


def _patterns(patterns: Any) -> Patterns:
    """The session's patterns (PopART's default ones when None), checked as PopART checks
    them when it applies them: every mandatory pattern enabled, unless runtime asserts are
    off."""
    if patterns is None:
        return Patterns()
    if not isinstance(patterns, Patterns):
        raise TypeError(f"patterns={patterns!r}: give a popart.Patterns.")
    patterns.check()
    return patterns


class InferenceSession(_Session):
    """popart.InferenceSession(fnModel, dataFlow, deviceInfo, inputShapeInfo=InputShapeInfo(),
    patterns=None, userOptions=SessionOptions(), name="inference")."""

    def __init__(self, fnModel: Any, dataFlow: DataFlow, deviceInfo: DeviceInfo,
                 inputShapeInfo: Any = None, patterns: Any = None,
                 userOptions: SessionOptions | None = None, name: str = "inference") -> None:
        self.name, self.patterns = name, _patterns(patterns)
        super().__init__("inference", fnModel, dataFlow, deviceInfo, userOptions,
                         inputShapeInfo=inputShapeInfo)


class TrainingSession(_Session):
    """popart.TrainingSession(fnModel, dataFlow, loss, optimizer, deviceInfo,
    inputShapeInfo=InputShapeInfo(), patterns=None, userOptions=SessionOptions(),
    name="training")."""

    def __init__(self, fnModel: Any, dataFlow: DataFlow, loss: str, optimizer: Optimizer,
                 deviceInfo: DeviceInfo, inputShapeInfo: Any = None, patterns: Any = None,
                 userOptions: SessionOptions | None = None, name: str = "training") -> None:
        if not isinstance(loss, str):
            raise TypeError(f"loss={loss!r}: give the loss tensor's id (a str).")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer={optimizer!r}: give popart.SGD, popart.ConstSGD or "
                            f"popart.Adam.")
        self.name, self.patterns, self.optimizer = name, _patterns(patterns), optimizer
        super().__init__("training", fnModel, dataFlow, deviceInfo, userOptions, loss, optimizer,
                         inputShapeInfo)
        self._load_optimizer_state()
        self._load_loss_scaling_state()

    def updateOptimizerFromHost(self, optimizer: Optimizer) -> None:
        """New optimizer values for the next runs; PopART's rules: same optimizer type, and a
        constant value may not change or become non-constant."""
        if type(optimizer.kit) is not type(self.optimizer.kit):
            raise popart_exception(f"Can not replace optimizer of type "
                                   f"{type(self.optimizer).__name__} with one of type "
                                   f"{type(optimizer).__name__}.")
        for key, (value, const) in self.optimizer.values.items():
            new_value, new_const = optimizer.values[key]
            why = ("Can not replace a constant value with a non constant value."
                   if const != new_const else
                   "Values are constant but do not match." if const and value != new_value
                   else None)
            if why:
                raise popart_exception(f"Problem with {key}. Default value is not a valid "
                                       f"replacement. {why}")
        try:
            self._kit.set_optimizer(optimizer.kit)
        except ValueError as err:
            raise popart_exception(popart_text(err)) from None
        self.optimizer = optimizer

    def _state_names(self, state: Mapping[str, Any]) -> dict[str, tuple[str, str | None]]:
        """{PopART's reserved name: (key, weight)} of the kit's optimizer ``state``
        (``state[key][weight]``; weight None: ``state[key]``, Adam's step, which PopART keeps
        per weight): SGD velocity Accl___w (Combined) or Accl1___w (Separate); Adam
        Accl1___w (m), Accl2___w (v), Step___w; Adaptive Accl1___w, Accl2___w, Accl3___w."""
        p, out = RESERVED_PREFIXES, {}
        separate = getattr(self.optimizer.kit, "accumulator_and_momentum", "") == "separate"
        for weight in state.get("velocity", {}):
            out[(p["Accl1"] if separate else p["Accl"]) + weight] = ("velocity", weight)
        for key, prefix in (("m", p["Accl1"]), ("v", p["Accl2"]), ("accl1", p["Accl1"]),
                            ("accl2", p["Accl2"]), ("accl3", p["Accl3"])):  # Adam, Adaptive
            for weight in state.get(key, {}):
                out[prefix + weight] = (key, weight)
                if "step" in state:
                    out[p["Step"] + weight] = ("step", None)
        return out

    def _optimizer_tensors(self) -> dict[str, np.ndarray]:
        """The kit's optimizer state under PopART's reserved names (:meth:`_state_names`),
        and automatic loss scaling's variables (:meth:`_loss_scaling_tensors`)."""
        state = getattr(self._kit, "optimizer_state", None)
        if state is None:
            return {}
        state, out = state(), self._loss_scaling_tensors()
        for name, (key, weight) in self._state_names(state).items():
            if weight is not None:
                out[name] = np.asarray(state[key][weight])
                continue
            # a grouped weight's step: one per group (as PopART keeps it)
            step = np.asarray(state["step"], np.float32).reshape(())
            grouping = self._groupings.get(name[len(RESERVED_PREFIXES["Step"]):])
            out[name] = np.full((grouping.groups,), step) if grouping else step
        return out

    def _load_optimizer_state(self) -> None:
        """PopART's OptimizerDecompose::addStateTensor (optimizerdecompose.cpp,
        sgd1decompose.cpp): a state tensor the model has as an initializer (a checkpoint
        written by modelToHost) starts the optimizer from its values instead of zeros; each
        is checked against the state's shape (refused with both shapes)."""
        state = self._kit.optimizer_state()
        given = {t.name for t in self.model.graph.initializer}
        found = {n: k for n, k in self._state_names(state).items() if n in given}
        if not found:
            return
        values, kept = self._weights(), {}
        for name, (key, weight) in found.items():
            value = np.asarray(values[name])
            if weight is None:  # Adam's step: one for every weight (per group: the first)
                kept.setdefault(key, value.reshape(-1)[0])
                continue
            if value.size != np.size(state[key][weight]):
                raise popart_exception(
                    f"optimizer state {name!r} in the model has shape {list(value.shape)}, "
                    f"the optimizer's for weight {weight!r} has "
                    f"{list(np.shape(state[key][weight]))}. Fix: load the model the session "
                    f"with this optimizer wrote, or remove the initializer {name!r}.")
            kept.setdefault(key, {})[weight] = value.reshape(np.shape(state[key][weight]))
        try:
            self._kit.runtime.set_optimizer_state(kept)
        except ValueError as err:
            raise popart_exception(popart_text(err)) from None

    def _loss_scaling_tensors(self) -> dict[str, np.ndarray]:
        """Automatic loss scaling's variables as PopART's AutomaticLossScale transform adds
        them to the model (automaticlossscaling.cpp: addOnesTensor, addOneTensor):
        ``lossScaleUpdateFactor`` (the loss scale's dtype: float32) and, with updatePeriod
        P > 1, an INT32 counter ``"<op id> (<op type>)_counter"`` per Histogram op (one per
        tracked gradient; PopART's op ids, numbered here from 0) and one of the
        LossScaleUpdate op (numbered after them). A counter starts at -1 and steps modulo
        its M where its op could run: a Histogram's every micro-batch (M = A x P), the
        LossScaleUpdate's every weight update (M = P). ``{}`` without loss scaling."""
        runtime = self._kit.runtime
        state = getattr(runtime, "loss_scaling_state", dict)()
        if not state:
            return {}
        out = {LOSS_SCALE_UPDATE_FACTOR: state["factor"]}
        period, acc, done = runtime.als.period, runtime.shape.accumulation, state["updates"]
        if period > 1:
            histogram = np.int32((done * acc - 1) % (acc * period) if done else -1)
            for i in range(state["tracked"]):
                out[f"{i} ({_HISTOGRAM})_counter"] = histogram
            out[f"{state['tracked']} ({_LOSS_SCALE_UPDATE})_counter"] = np.int32(
                (done - 1) % period if done else -1)
        return out

    def _load_loss_scaling_state(self) -> None:
        """A checkpoint's automatic loss scaling variables (:meth:`_loss_scaling_tensors`,
        found as PopART finds them: initializers of the model) start the session: the
        factor from ``lossScaleUpdateFactor``, the period's phase from the LossScaleUpdate's
        counter (or else a Histogram's). Without loss scaling they are left alone."""
        runtime = self._kit.runtime
        if not getattr(runtime, "loss_scaling_state", dict)():
            return
        given = {t.name: t for t in self.model.graph.initializer}
        values = self._weights()

        def value(name: str) -> np.ndarray:
            return np.asarray(values[name] if name in values else to_array(given[name]))

        factor = value(LOSS_SCALE_UPDATE_FACTOR) if LOSS_SCALE_UPDATE_FACTOR in given else None
        acc, updates = runtime.shape.accumulation, None
        for op_type, per_update in ((_LOSS_SCALE_UPDATE, 1), (_HISTOGRAM, acc)):
            names = [n for n in given if n.endswith(f" ({op_type})_counter")]
            if names:
                updates = (int(value(names[0]).reshape(-1)[0]) + 1) // per_update
                break
        if factor is None and updates is None:
            return
        try:
            runtime.set_loss_scaling_state(factor, updates)
        except ValueError as err:
            raise popart_exception(popart_text(err)) from None

    def getAllTensorIds(self) -> set[str]:
        return set(self._types) | set(self._optimizer_tensors())

    getTensorIds = getAllTensorIds


__all__ = ["InferenceSession", "TrainingSession", "AnchorReturnType"]
