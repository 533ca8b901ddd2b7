"""PopART's optimizers as PopART spells them - ``SGD({"defaultLearningRate": (0.1, False)})``,
``ConstSGD(0.1)``, ``Adam({...}, mode=AdamMode.Lamb)`` - each held as the kit's optimizer
(``pk.SGD`` / ``pk.Adam``), which has the update maths."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._runtime.optimizers import SGD as _KitSGD
from .._runtime.optimizers import Adam as _KitAdam
from ._core import ENUMS, popart_exception

_SGD_DEFAULTS = {"defaultLearningRate": (0.1, True), "defaultWeightDecay": (0.0, True),
                 "defaultMomentum": (0.0, True), "defaultDampening": (0.0, True),
                 "defaultVelocityScaling": (1.0, True), "lossScaling": (1.0, True),
                 "nesterov": (0.0, True)}
_ADAM_DEFAULTS = {"defaultLearningRate": (0.1, True), "defaultWeightDecay": (0.0, True),
                  "defaultBeta1": (0.9, True), "defaultBeta2": (0.999, True),
                  "defaultEps": (1e-6, True), "lossScaling": (1.0, True),
                  "defaultMaxWeightNorm": (10.0, True)}
_ADAM_MODES = {"Adam": "adam", "AdamNoBias": "adam_no_bias", "AdaMax": "adamax",
               "Lamb": "lamb", "LambNoBias": "lamb_no_bias"}
_DECAY_MODES = {"Decay": "decay", "L2Regularization": "l2_regularization"}


class OptimizerValue:
    """popart.OptimizerValue(value=0.0, isConst=True): a hyperparameter and whether it is
    compiled in as a constant."""

    def __init__(self, value: float = 0.0, isConst: bool = True) -> None:
        self._value, self._const = float(value), bool(isConst)

    def val(self) -> float:
        return self._value

    def isConst(self) -> bool:
        return self._const


def _values(cls_name: str, given: Any, defaults: Mapping[str, tuple[float, bool]]
            ) -> dict[str, tuple[float, bool]]:
    """PopART's getOptimizerValueDictionary + getComplete: str keys, (value, isConst) pairs
    (or OptimizerValue), only the keys PopART knows."""
    if not isinstance(given, Mapping):
        raise TypeError(f"popart.{cls_name} takes a dict of str -> (value, isConst), got "
                        f"{given!r}.")
    out = dict(defaults)
    for key, pair in given.items():
        if not isinstance(key, str):
            raise popart_exception("A key in the optimizer map input must be a py::str (in "
                                   "getOptimizerValueDictionary)")
        if isinstance(pair, OptimizerValue):
            pair = (pair.val(), pair.isConst())
        if not isinstance(pair, tuple):
            raise popart_exception("A value in the optimizer map must be a py::tuple (in "
                                   "getOptimizerValueDictionary)")
        key = "defaultMaxWeightNorm" if key == "maxWeightNorm" else key
        if key not in defaults:
            raise popart_exception(f"Invalid {cls_name} key, {key}, the allowed keys are ( "
                                   + "".join(f"{k} " for k in defaults) + ")")
        out[key] = (float(np.float32(pair[0])), bool(pair[1]))
    if out["lossScaling"][0] == 0:
        raise popart_exception("Loss scaling cannot be 0")
    lr, lr_const = out["defaultLearningRate"]
    if lr < 0:
        raise popart_exception(f"Negative learning rate ({lr}) in {cls_name}, bailing as this "
                               f"might be a user error.")
    if lr == 0 and lr_const:
        raise popart_exception(f"Constant, zero learning rate in {cls_name}, bailing as this "
                               f"might be a user error.")
    return out


def _kit(factory: Any, cls_name: str, **kwargs: Any) -> Any:
    try:
        return factory(**kwargs)
    except ValueError as err:
        raise popart_exception(f"popart.{cls_name}: {err}") from None


class Optimizer:
    """What PopART's optimizers share: the (value, isConst) map and the kit optimizer."""

    kit: Any
    values: dict[str, tuple[float, bool]]

    def getLossScalingVal(self) -> float:
        return self.values["lossScaling"][0]

    def insertSpecific(self, weightId: str, values: Mapping[str, Any]) -> None:
        raise popart_exception(f"insertSpecific({weightId!r}): per-weight hyperparameters are "
                               f"not supported by popart_kit's runtime; every weight uses the "
                               f"default values. Fix: use one set of values for all weights.")

    def learningRates(self) -> OptimizerValue:
        return OptimizerValue(*self.values["defaultLearningRate"])

    def weightDecays(self) -> OptimizerValue:
        return OptimizerValue(*self.values["defaultWeightDecay"])


class SGD(Optimizer):
    """popart.SGD(pyd, clip_norm_settings=[], accumulatorAndMomentum=Combined, ...)."""

    def __init__(self, pyd: Mapping[str, Any] | None = None,
                 clip_norm_settings: Sequence[Any] = (), accumulatorAndMomentum: Any = None,
                 accumType: Any = None, accl1Type: Any = None, debugContext: str = "sgd"
                 ) -> None:
        if clip_norm_settings:
            raise popart_exception("SGD: clip_norm_settings (gradient clipping) is not "
                                   "supported by popart_kit's runtime. Fix: pass [].")
        mode = accumulatorAndMomentum or ENUMS["SGDAccumulatorAndMomentum"].Combined
        v = self.values = _values("SGD", pyd or {}, _SGD_DEFAULTS)
        if v["nesterov"][0] and v["defaultDampening"][0] > 0:
            raise popart_exception(f"When enable nesterov momentum, dampening "
                                   f"({v['defaultDampening'][0]}) in SGD shouled be zero")
        self.kit = _kit(_KitSGD, "SGD", learning_rate=v["defaultLearningRate"][0],
                        momentum=v["defaultMomentum"][0], dampening=v["defaultDampening"][0],
                        weight_decay=v["defaultWeightDecay"][0],
                        nesterov=bool(v["nesterov"][0]) and v["defaultMomentum"][0] != 0,
                        velocity_scaling=v["defaultVelocityScaling"][0],
                        loss_scaling=v["lossScaling"][0],
                        accumulator_and_momentum=mode.name.lower())

    def momentums(self) -> OptimizerValue:
        return OptimizerValue(*self.values["defaultMomentum"])

    def dampenings(self) -> OptimizerValue:
        return OptimizerValue(*self.values["defaultDampening"])

    def velocityScalings(self) -> OptimizerValue:
        return OptimizerValue(*self.values["defaultVelocityScaling"])


class ConstSGD(SGD):
    """popart.ConstSGD(learning_rate, weight_decay=0, loss_scaling=1): SGD with constants."""

    def __init__(self, learning_rate: float, weight_decay: float = 0.0,
                 loss_scaling: float = 1.0, clip_norm_settings: Sequence[Any] = ()) -> None:
        super().__init__({"defaultLearningRate": (learning_rate, True),
                          "defaultWeightDecay": (weight_decay, True),
                          "lossScaling": (loss_scaling, True)}, clip_norm_settings)


class Adam(Optimizer):
    """popart.Adam(values, mode=AdamMode.Adam, weight_decay_mode=WeightDecayMode.Decay, ...)."""

    def __init__(self, values: Mapping[str, Any] | None = None, mode: Any = None,
                 weight_decay_mode: Any = None, accum_type: Any = None, accl1_type: Any = None,
                 accl2_type: Any = None, clip_norm_settings: Sequence[Any] = (),
                 scaled_optimizer_state: bool = False, debugContext: str = "adam") -> None:
        if clip_norm_settings:
            raise popart_exception("Adam: clip_norm_settings (gradient clipping) is not "
                                   "supported by popart_kit's runtime. Fix: pass [].")
        if scaled_optimizer_state:
            raise popart_exception("Adam: scaled_optimizer_state is not supported by "
                                   "popart_kit's runtime. Fix: leave it False.")
        mode = mode or ENUMS["AdamMode"].Adam
        decay = weight_decay_mode or ENUMS["WeightDecayMode"].Decay
        v = self.values = _values("Adam", values or {}, _ADAM_DEFAULTS)
        self.kit = _kit(_KitAdam, "Adam", learning_rate=v["defaultLearningRate"][0],
                        beta1=v["defaultBeta1"][0], beta2=v["defaultBeta2"][0],
                        eps=v["defaultEps"][0], weight_decay=v["defaultWeightDecay"][0],
                        weight_decay_mode=_DECAY_MODES[decay.name], mode=_ADAM_MODES[mode.name],
                        loss_scaling=v["lossScaling"][0],
                        max_weight_norm=v["defaultMaxWeightNorm"][0])
