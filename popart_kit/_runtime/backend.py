"""The backend protocol, and how a session picks one."""

from __future__ import annotations

import pkgutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import onnx

from ..errors import ConfigError

if TYPE_CHECKING:
    from .._base.shapes import AnchorReturnType
    from .._config.session_config import SessionConfig
    from .._host.stepio import StepIOFactory

__all__ = ["Backend", "TrainingBackend", "make_backend", "resolved", "check_weights", "BACKENDS",
           "IMPLEMENTATIONS"]

BACKENDS = ("auto", "xla", "popart")
#: Where each backend's class lives ("module:class"), imported only once chosen: importing
#: popart_kit imports neither JAX nor the SDK. The xla backend trains with a class of its own.
IMPLEMENTATIONS = {
    "popart": f"{__package__}.popart_sdk:PopartBackend",
    "xla": f"{__package__}.xla.runtime:XlaBackend",
    "xla training": f"{__package__}.xla.training:XlaTrainingBackend",
}


class Backend(Protocol):
    """What a session needs from a backend: the host-array shapes (``io``), one compiled step
    per ``run``, and the weights."""

    name: str
    io: StepIOFactory

    def prepare(self) -> None: ...

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def weights(self) -> dict[str, np.ndarray]: ...

    def write_weights(self, mapping: Mapping[str, np.ndarray]) -> None: ...

    def model_proto(self) -> onnx.ModelProto: ...


class TrainingBackend(Backend, Protocol):
    """A backend that also trains: new hyperparameters and seeds between runs."""

    def set_optimizer(self, optimizer: Any) -> None: ...

    def set_random_seed(self, seed: int) -> None: ...


def check_weights(current: Mapping[str, np.ndarray], mapping: Mapping[str, Any]) -> None:
    """Refuse (one ValueError, every problem) weights a backend cannot take as they are:
    unknown names, other shapes or dtypes, 64-bit integers outside the 32 bits the device
    computes them in - nothing is converted silently."""
    from .._base.problems import Problem, raise_errors
    from .._model.index_check import narrowing_problems

    problems, fitting = [], {}
    for name, value in mapping.items():
        if name not in current:
            problems.append(Problem(("weights", name), f"{name!r} is not a weight of the model.",
                                    f"use one of {', '.join(current)}.", "K-weight-unknown"))
            continue
        old, value = current[name], np.asarray(value)
        if value.shape != old.shape or value.dtype != old.dtype:
            problems.append(Problem(("weights", name),
                                    f"weight {name!r} is {value.dtype}{list(value.shape)}, "
                                    f"expected {old.dtype}{list(old.shape)}.",
                                    "write an array of the weight's shape and dtype.",
                                    "K-weight-shape"))
        else:
            fitting[name] = value
    raise_errors("write_weights", problems + narrowing_problems("weights", fitting))


def _sdk_importable() -> bool:
    from .._config.mapping import import_popart

    try:
        import_popart()
    except ImportError:
        return False
    return True


def _implementation(kind: str) -> Any:
    """The backend class of ``kind``, imported on first use (JAX then). The program's numpy
    random state is kept: importing JAX draws from it (jax._src.clusters, JAX 0.10), and a
    program that seeds numpy, opens a session and then draws its data must get the data it
    gets on PopART."""
    state = np.random.get_state()
    try:
        return pkgutil.resolve_name(IMPLEMENTATIONS[kind])
    finally:
        np.random.set_state(state)


def resolved(name: str, popart: Any = None) -> str:
    """The backend a session named ``name`` runs on: ``auto`` is ``popart`` where the Poplar SDK
    imports (or a module is given), else ``xla``."""
    if name == "auto":
        return "popart" if popart is not None or _sdk_importable() else "xla"
    return name


def make_backend(name: str, model: onnx.ModelProto, config: SessionConfig,
                 anchors: Mapping[str, AnchorReturnType], popart: Any = None,
                 loss: str | None = None, optimizer: Any = None,
                 **xla_options: Any) -> Backend:
    """``auto`` is ``popart`` where the Poplar SDK imports (or a module is given) and ``xla``
    elsewhere; a ``loss`` makes a training backend. ``xla_options`` (those not None) are for
    the xla backend only: the popart backend refuses them."""
    xla_options = {k: v for k, v in xla_options.items() if v is not None}
    if name not in BACKENDS:
        raise ConfigError(f"backend={name!r}: use one of {', '.join(BACKENDS)}.",
                          rule="K-session-type")
    name = resolved(name, popart)
    if name == "popart":
        if xla_options:
            raise ConfigError(f"{', '.join(f'{k}={v!r}' for k, v in xla_options.items())}: "
                             f"only the xla backend takes these (PopART has no equivalent). "
                             f"Fix: leave them out with backend={name!r}.",
                              rule="K-xla-only")
        return _implementation("popart")(
            model, config, anchors, popart, loss=loss, optimizer=optimizer)
    if loss is not None:
        return _implementation("xla training")(
            model, config, anchors, loss, optimizer, **xla_options)
    return _implementation("xla")(model, config, anchors, **xla_options)
