"""Sessions: one facade over the popart and xla backends, with PopART's run semantics.

A ``run`` executes bps × A micro-batches on every local replica and returns the anchors as PopART
returns them. Before anything compiles the model's pipeline annotations are checked against the
config (PipelineLayout) and, on run, the inputs against the host layout (StepIOFactory).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from .backends.base import Backend, make_backend
from .config import SessionConfig
from .layout import PipelineLayout, load_model
from .shapes import AnchorReturnType
from .stepio import StepIOFactory

__all__ = ["InferenceSession"]


class InferenceSession:
    """``InferenceSession(model, config, anchors={"y": "All"}, backend="auto")``.

    ``model`` is a ModelProto, serialised bytes (Builder.getModelProto) or a path; ``anchors``
    maps any tensor of the model (inputs, weights, activations, outputs) to a return type and
    defaults to every graph output with ``All``. ``backend`` is ``"auto"`` (popart where the
    Poplar SDK imports, else xla), ``"xla"`` or ``"popart"``.
    """

    def __init__(self, model: onnx.ModelProto | bytes | str | os.PathLike,
                 config: SessionConfig, anchors: Mapping[str, Any] | None = None,
                 backend: str = "auto", *, popart: Any = None) -> None:
        if config.mode != "inference":
            raise ValueError(f"InferenceSession needs a config with mode='inference', got "
                             f"mode={config.mode!r}. Fix: use TrainingSession, or set "
                             f"mode='inference'.")
        self.config = config
        self.model = load_model(model)
        self.layout = PipelineLayout.from_model(self.model)
        if config.pipeline.enabled or self.layout.is_annotated:
            self.layout.check(config)
        if anchors is None:
            anchors = {o.name: "All" for o in self.model.graph.output}
        self.anchors = {name: AnchorReturnType.of(art) for name, art in anchors.items()}
        if not self.anchors:
            raise ValueError("an inference session needs at least one anchor (PopART: 'User "
                             "must specify an anchor tensor when doing inference'). Fix: pass "
                             "anchors={tensor: 'All'} or add outputs to the model.")
        self._backend: Backend = make_backend(backend, self.model, config, self.anchors, popart)

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def io(self) -> StepIOFactory:
        """The shapes of this session's host arrays, and helpers to make and check them."""
        return self._backend.io

    def prepare(self) -> None:
        """Compile (and, on an IPU, load) the program; ``run`` does it when needed."""
        self._backend.prepare()

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step: canonical host arrays in (checked first), anchors out."""
        return self._backend.run(inputs)

    def weights(self) -> dict[str, np.ndarray]:
        return self._backend.weights()

    def write_weights(self, mapping: Mapping[str, np.ndarray]) -> None:
        self._backend.write_weights(mapping)

    def model_proto(self) -> onnx.ModelProto:
        """The model with the session's current weights."""
        return self._backend.model_proto()
