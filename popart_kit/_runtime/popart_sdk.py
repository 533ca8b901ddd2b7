"""The popart backend: the same session on Graphcore's PopART (the Poplar SDK, imported lazily).

Everything PopART needs is made from the kit's objects: SessionOptions from the config, a
DataFlow of the anchors, the device the config asks for, PyStepIO over checked arrays, and
PyWeightsIO to read and write weights.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from .._base import names as _names
from .._base.problems import Problem, raise_errors
from .._base.shapes import AnchorReturnType
from .._config.mapping import import_popart
from .._host.stepio import StepIOFactory, TensorSpec
from .._model.builder import broadcast_inputs
from ..errors import ConfigError
from .backend import check_weights

__all__ = ["PopartBackend", "create_device", "tensor_types"]


def tensor_types(model: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of every tensor ONNX shape inference can type."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    out = {t.name: (tuple(t.dims), onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
           for t in model.graph.initializer}
    for value in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        tensor = value.type.tensor_type
        if tensor.elem_type and tensor.HasField("shape") and all(
                d.HasField("dim_value") for d in tensor.shape.dim):
            out[value.name] = (tuple(d.dim_value for d in tensor.shape.dim),
                               onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    return out


def create_device(popart: Any, config: Any) -> Any:
    """The DeviceManager call for the configured target."""
    manager = popart.DeviceManager()
    plan = config.plan()
    device = config.device
    if device.target == "ipu":
        request = config.device_request()
        enums = {"pattern": "SyncPattern", "connectionType": "DeviceConnectionType",
                 "selectionCriterion": "DeviceSelectionCriterion"}
        return manager.acquireAvailableDevice(**{
            k: getattr(getattr(popart, enums[k]), v) if k in enums else v
            for k, v in request.items()})
    if device.target == "ipu_model":
        return manager.createIpuModelDevice({"numIPUs": str(plan.ipus_to_request),
                                             "tilesPerIPU": str(device.tiles_per_ipu or 4)})
    if device.target == "cpu":
        return manager.createCpuDevice()
    sync = _names.SYNC_PATTERN[device.sync_pattern]
    return manager.createOfflineIPUDevice({
        "numIPUs": str(plan.ipus_to_request), "tilesPerIPU": str(device.tiles_per_ipu),
        "syncPattern": sync[0].lower() + sync[1:]})


class PopartBackend:
    """A PopART InferenceSession, or TrainingSession given a loss and an optimizer, driven from
    the kit's config, anchors and host arrays."""

    name = "popart"

    def __init__(self, model: onnx.ModelProto, config: Any,
                 anchors: Mapping[str, AnchorReturnType], popart: Any = None,
                 loss: str | None = None, optimizer: Any = None) -> None:
        self.popart = import_popart() if popart is None else popart
        self.model, self.config, self.anchors = model, config, dict(anchors)
        types = tensor_types(model)
        initializers = {t.name for t in model.graph.initializer}
        broadcast = broadcast_inputs(model)
        problems = [Problem(("anchors", a), f"anchor {a!r} has no shape ONNX can infer.",
                            "anchor a tensor whose shape is known.", "K-anchor-unknown")
                    for a in self.anchors if a not in types]
        raise_errors("PopartBackend", problems)
        self.io = StepIOFactory(
            config,
            inputs={i.name: TensorSpec(*types[i.name], i.name in broadcast)
                    for i in model.graph.input if i.name not in initializers},
            anchors={a: (TensorSpec(*types[a]), art) for a, art in self.anchors.items()})
        self._initializers = {t.name: onnx.numpy_helper.to_array(t)
                              for t in model.graph.initializer}
        popart_ = self.popart
        dataflow = popart_.DataFlow(config.batches_per_step, {
            a: (popart_.AnchorReturnType(art.name, art.period) if art.period
                else popart_.AnchorReturnType(art.name)) for a, art in self.anchors.items()})
        options = config.to_session_options(popart_)
        # PopART folds weights into constants by default; sessions read and write them.
        self._weights_are_variables = not config.popart_options.get("constantWeights", False)
        if "constantWeights" not in config.popart_options:
            options.constantWeights = False
        self._offline = config.device.target == "offline"
        common = {"fnModel": model.SerializeToString(), "dataFlow": dataflow,
                  "deviceInfo": create_device(popart_, config), "userOptions": options}
        if loss is None:
            self.session = popart_.InferenceSession(**common)
        else:
            self.session = popart_.TrainingSession(
                loss=loss, optimizer=optimizer.to_popart(popart_), **common)
        self._prepared = False

    def prepare(self) -> None:
        """Compile; on a device that runs, load the engine and the weights too."""
        if self._prepared:
            return
        if self._offline:
            self.session.prepareDevice(loadEngine=False)  # compile only
        else:
            self.session.prepareDevice()
            self.session.weightsFromHost()
        self._prepared = True

    def _refuse_offline(self, what: str) -> None:
        if self._offline:
            raise ConfigError(f"device.target='offline' compiles without an IPU and cannot "
                              f"{what}. Fix: use target='ipu' to run, or backend='xla'.",
                              rule="K-offline-run")

    def _need_variables(self) -> None:
        if not self._weights_are_variables:
            raise ConfigError("popart_options sets constantWeights=True, so PopART folded the "
                              "weights into constants. Fix: remove constantWeights to read or "
                              "write weights.", rule="K-constant-weights")

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._refuse_offline("run")
        self.prepare()
        anchors = self.io.allocate_anchors()
        self.session.run(self.io.stepio(inputs, anchors, self.popart))
        return anchors

    def set_optimizer(self, optimizer: Any) -> None:
        """New hyperparameters (the session checked it is the same kind of optimizer)."""
        self._refuse_offline("take a new optimizer")
        self.prepare()
        self.session.updateOptimizerFromHost(optimizer.to_popart(self.popart))

    def set_random_seed(self, seed: int) -> None:
        self._refuse_offline("seed its device")
        self.prepare()
        self.session.setRandomSeed(seed)

    def weights(self) -> dict[str, np.ndarray]:
        self._need_variables()
        self._refuse_offline("read weights back")
        self.prepare()
        self.session.weightsToHost()
        arrays = {name: np.empty_like(value) for name, value in self._initializers.items()}
        self.session.readWeights(self.popart.PyWeightsIO(arrays))
        return arrays

    def write_weights(self, mapping: Mapping[str, np.ndarray]) -> None:
        check_weights(self._initializers, mapping)
        self._need_variables()
        self._refuse_offline("take weights")
        self.prepare()
        # weightsFromHost streams every weight: refresh the host copies of the others first
        self.session.weightsToHost()
        self.session.writeWeights(self.popart.PyWeightsIO(
            {k: np.ascontiguousarray(v) for k, v in mapping.items()}))
        self.session.weightsFromHost()

    def model_proto(self) -> onnx.ModelProto:
        self._refuse_offline("give its weights back")
        self.prepare()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.onnx")
            self.session.modelToHost(path)
            return onnx.load(path)
