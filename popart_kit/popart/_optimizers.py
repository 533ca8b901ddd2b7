"""PopART's optimizers as PopART spells them - ``SGD({"defaultLearningRate": (0.1, False)})``,
``ConstSGD(0.1)``, ``Adam({...}, mode=AdamMode.Lamb)``, ``Adaptive({...},
mode=AdaptiveMode.RMSProp)``, ``insertSpecific(weight, {...})`` and ``ClipNormSettings`` - each
held as the kit's optimizer (``pk.SGD`` / ``pk.Adam`` / the runtime's Adaptive), which has the
update maths.

The values are checked as PopART checks them (sgd.cpp, adam.cpp, adaptive.cpp
``runValueChecks``, optimizer.cpp), with PopART's messages; the kit's stricter ranges do not
apply here (PopART accepts, e.g., a changeable learning rate of 0)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._runtime.optimizers import SGD as _KitSGD
from .._runtime.optimizers import Adam as _KitAdam
from .._runtime.optimizers import Adaptive as _KitAdaptive
from ._core import ENUMS, _enum, popart_exception

#: popart.AdaptiveMode (adaptive.hpp; popart.cpp binds the four in this order).
AdaptiveMode = _enum("AdaptiveMode", ["AdaGrad", "RMSProp", "CenteredRMSProp", "AdaDelta"])

_SGD_DEFAULTS = {"defaultLearningRate": (0.1, True), "defaultWeightDecay": (0.0, True),
                 "defaultMomentum": (0.0, True), "defaultDampening": (0.0, True),
                 "defaultVelocityScaling": (1.0, True), "lossScaling": (1.0, True),
                 "nesterov": (0.0, True)}
_ADAM_DEFAULTS = {"defaultLearningRate": (0.1, True), "defaultWeightDecay": (0.0, True),
                  "defaultBeta1": (0.9, True), "defaultBeta2": (0.999, True),
                  "defaultEps": (1e-6, True), "lossScaling": (1.0, True),
                  "defaultMaxWeightNorm": (10.0, True)}
_ADAPTIVE_DEFAULTS = {"defaultLearningRate": (0.01, True), "defaultWeightDecay": (0.0, True),
                      "defaultAlpha": (0.99, True), "defaultMomentum": (0.0, True),
                      "defaultEps": (1e-6, True), "lossScaling": (1.0, True)}
# insertSpecific's keys (getSpecificNames) -> the constructor's keys, in PopART's order
_SGD_SPECIFIC = {"learningRate": "defaultLearningRate", "weightDecay": "defaultWeightDecay",
                 "momentum": "defaultMomentum", "dampening": "defaultDampening",
                 "velocityScaling": "defaultVelocityScaling", "nesterov": "nesterov"}
_ADAM_SPECIFIC = {"learningRate": "defaultLearningRate", "weightDecay": "defaultWeightDecay",
                  "beta1": "defaultBeta1", "beta2": "defaultBeta2", "eps": "defaultEps",
                  "maxWeightNorm": "defaultMaxWeightNorm"}
_ADAPTIVE_SPECIFIC = {"learningRate": "defaultLearningRate",
                      "weightDecay": "defaultWeightDecay", "alpha": "defaultAlpha",
                      "momentum": "defaultMomentum", "eps": "defaultEps"}
_ADAM_MODES = {"Adam": "adam", "AdamNoBias": "adam_no_bias", "AdaMax": "adamax",
               "Lamb": "lamb", "LambNoBias": "lamb_no_bias"}
_ADAPTIVE_MODES = {"AdaGrad": "adagrad", "RMSProp": "rmsprop",
                   "CenteredRMSProp": "centered_rmsprop", "AdaDelta": "adadelta"}
_DECAY_MODES = {"Decay": "decay", "L2Regularization": "l2_regularization"}

_log = logging.getLogger("popart.popart")


class OptimizerValue:
    """popart.OptimizerValue(value=0.0, isConst=True): a hyperparameter and whether it is
    compiled in as a constant."""

    def __init__(self, value: float = 0.0, isConst: bool = True) -> None:
        self._value, self._const = float(value), bool(isConst)

    def val(self) -> float:
        return self._value

    def isConst(self) -> bool:
        return self._const

    def __repr__(self) -> str:
        return f"OptimizerValue({self._value}, isConst={self._const})"


class OptimizerValueMap:
    """popart.OptimizerValueMap: one hyperparameter's default value (``getDefault``) and the
    values some weights have of their own (insertSpecific)."""

    def __init__(self, default: tuple[float, bool],
                 specifics: Mapping[str, tuple[float, bool]]) -> None:
        self._default = OptimizerValue(*default)
        self._specifics = {w: OptimizerValue(*p) for w, p in specifics.items()}

    def getDefault(self) -> OptimizerValue:
        return self._default


class ClipNormSettings:
    """popart.ClipNormSettings: clip the global norm of some weights' gradients to ``maxNorm``
    (``clipWeights(weightIds, maxNorm)``) or of every weight's (``clipAllWeights(maxNorm)``).
    ``ClipNormSettings(weightIds, maxNorm)`` is PopART's deprecated form of clipWeights."""

    def __init__(self, weightIds: Sequence[str], maxNorm: float) -> None:
        _log.warning("Using deprecated constructor ClipNormSettings(const "
                     "std::vector<TensorId> &weightIds_, float maxNorm_). The members "
                     "'weightIds' and 'maxNorm' have also been deprecated. These shall all be "
                     "removed from a future release. Please use the static creation methods, "
                     "'clipWeights' and 'clipAllWeights' instead.")
        self._set(weightIds, maxNorm, False)

    def _set(self, weightIds: Sequence[str], maxNorm: float, all_weights: bool) -> None:
        if isinstance(weightIds, str) or not all(isinstance(w, str) for w in weightIds):
            raise TypeError(f"ClipNormSettings: weightIds={weightIds!r}; give a list of weight "
                            f"ids (str).")
        self.weightIds = list(weightIds)
        self.maxNorm = float(np.float32(maxNorm))
        self._all = all_weights

    @staticmethod
    def clipWeights(weightIds: Sequence[str], maxNorm: float) -> ClipNormSettings:
        out = ClipNormSettings.__new__(ClipNormSettings)
        out._set(weightIds, maxNorm, False)
        return out

    @staticmethod
    def clipAllWeights(maxNorm: float) -> ClipNormSettings:
        out = ClipNormSettings.__new__(ClipNormSettings)
        out._set([], maxNorm, True)
        return out

    def _kit(self) -> tuple[tuple[str, ...] | None, float]:
        return (None if self._all else tuple(self.weightIds), float(np.float32(self.maxNorm)))

    def __repr__(self) -> str:
        if self._all:
            return f"ClipNormSettings.clipAllWeights({self.maxNorm})"
        return f"ClipNormSettings.clipWeights({self.weightIds!r}, {self.maxNorm})"


def _pairs(given: Any, cls_name: str) -> dict[str, tuple[float, bool]]:
    """PopART's getOptimizerValueDictionary: str keys, (value, isConst) pairs (or
    OptimizerValue), values as float32."""
    if not isinstance(given, Mapping):
        raise TypeError(f"popart.{cls_name} takes a dict of str -> (value, isConst), got "
                        f"{given!r}.")
    out = {}
    for key, pair in given.items():
        if not isinstance(key, str):
            raise popart_exception("A key in the optimizer map input must be a py::str (in "
                                   "getOptimizerValueDictionary)")
        if isinstance(pair, OptimizerValue):
            pair = (pair.val(), pair.isConst())
        if not isinstance(pair, tuple):
            raise popart_exception("A value in the optimizer map must be a py::tuple (in "
                                   "getOptimizerValueDictionary)")
        out[key] = (float(np.float32(pair[0])), bool(pair[1]))
    return out


def _values(cls_name: str, given: Any, defaults: Mapping[str, tuple[float, bool]]
            ) -> dict[str, tuple[float, bool]]:
    """PopART's getComplete: the defaults with the given values, only keys PopART knows;
    and the Optimizer constructor's loss scaling check."""
    out = dict(defaults)
    for key, pair in _pairs(given, cls_name).items():
        allowed = [*defaults, "maxWeightNorm"] if cls_name == "Adam" else list(defaults)
        if key not in allowed:
            raise popart_exception(f"Invalid {cls_name} key, {key}, the allowed keys are ( "
                                   + "".join(f"{k} " for k in allowed) + ")")
        out["defaultMaxWeightNorm" if key == "maxWeightNorm" else key] = pair
    if out["lossScaling"][0] == 0:
        raise popart_exception("Loss scaling cannot be 0")
    return out


def _num(value: float) -> str:
    """A float32 value as PopART's messages print it (fmt: 0.5, -1, 1e-06)."""
    text = str(np.float32(value))
    return text[:-2] if text.endswith(".0") else text


def _check_lr(cls_name: str, lr: tuple[float, bool]) -> None:
    if lr[0] < 0:
        raise popart_exception(f"Negative learning rate ({_num(lr[0])}) in {cls_name}, bailing "
                               f"as this might be a user error.")
    if lr[0] == 0 and lr[1]:
        raise popart_exception(f"Constant, zero learning rate in {cls_name}, bailing as this "
                               f"might be a user error.")


def _check_negative(cls_name: str, what: str, value: float) -> None:
    if value < 0:
        raise popart_exception(f"Negative {what} ({_num(value)}) in {cls_name}, bailing as this "
                               f"might be a user error")


def _enum_arg(value: Any, enum: str, default: str, arg: str, cls_name: str) -> Any:
    kind = ENUMS.get(enum, AdaptiveMode)
    if value is None:
        return kind[default]
    if not isinstance(value, kind):
        raise TypeError(f"popart.{cls_name}: {arg}={value!r}; give a popart.{enum} member.")
    return value


def _clip_settings(settings: Sequence[Any], cls_name: str) -> list[ClipNormSettings]:
    settings = list(settings)
    for s in settings:
        if not isinstance(s, ClipNormSettings):
            raise TypeError(f"popart.{cls_name}: clip_norm_settings holds {s!r}; give a list of "
                            f"popart.ClipNormSettings.")
    return settings


class _Values(dict):
    """An optimizer's values as the session compares them on updateOptimizerFromHost: the
    defaults by their keys, and each specific value as ``"<key> for <weight>"``; a replacement
    without one of them is refused in PopART's words."""

    def __missing__(self, key: str) -> Any:
        name, _, weight = key.partition(" for ")
        raise popart_exception(f"Problem with {name}. Could not find tensor {weight} in "
                               f"replacement OptimizerValueMap.")


class Optimizer:
    """What PopART's optimizers share: the (value, isConst) maps (defaults, and per weight
    from insertSpecific), the clipping settings and the kit optimizer built from them."""

    _NAME = "Optimizer"
    _DEFAULTS: dict[str, tuple[float, bool]] = {}
    _SPECIFIC: dict[str, str] = {}
    kit: Any
    values: dict[str, tuple[float, bool]]

    def _init(self, values: Any, clip: Sequence[Any]) -> None:
        self._defaults = _values(self._NAME, values if values is not None else {},
                                 self._DEFAULTS)
        self._specific: dict[str, dict[str, tuple[float, bool]]] = {}
        self._clip = _clip_settings(clip, self._NAME)
        self._check(self._defaults)
        self._build()

    def _check(self, v: Mapping[str, tuple[float, bool]]) -> None:
        """PopART's runValueChecks of one weight's values (keyed as the constructor's)."""

    def _make_kit(self) -> Any:
        raise NotImplementedError  # pragma: no cover - overridden

    def _build(self) -> None:
        self.values = _Values(self._defaults)
        for weight, v in self._specific.items():
            for key, default_key in self._SPECIFIC.items():
                self.values[f"{key} for {weight}"] = v[default_key]
        self.kit = self._make_kit()

    def getLossScalingVal(self) -> float:
        return self._defaults["lossScaling"][0]

    def insertSpecific(self, weightId: str, values: Mapping[str, Any]) -> None:
        """Values of weight ``weightId`` of its own (keys as PopART's insertSpecific: e.g.
        "learningRate"); the values not given are the defaults."""
        pairs = _pairs(values, self._NAME)
        for key in pairs:
            if key not in self._SPECIFIC:
                raise popart_exception(f"Invalid key {key} in {self._NAME}::insertSpecific. "
                                       f"Permitted keys are ( "
                                       + "".join(f"{k} " for k in self._SPECIFIC) + ")")
        if weightId in self._specific:
            raise popart_exception(f"Attempt to insert specific value for optimization Tensor "
                                   f"{weightId}failed as there is already a specific value for "
                                   f"{weightId} present. Bailing, in case this is an error.")
        v = {**self._defaults, **{self._SPECIFIC[k]: p for k, p in pairs.items()}}
        self._check(v)
        self._specific[weightId] = {d: v[d] for d in self._SPECIFIC.values()}
        self._build()

    def _map(self, key: str) -> OptimizerValueMap:
        return OptimizerValueMap(self._defaults[key],
                                 {w: v[key] for w, v in self._specific.items()})

    def learningRates(self) -> OptimizerValueMap:
        return self._map("defaultLearningRate")

    def weightDecays(self) -> OptimizerValueMap:
        return self._map("defaultWeightDecay")

    def _kit_specific(self, fields: Any) -> dict[str, dict[str, Any]]:
        return {w: fields(v) for w, v in self._specific.items()}

    def _kit_clip(self) -> tuple[Any, ...]:
        return tuple(c._kit() for c in self._clip)


def _sgd_fields(v: Mapping[str, tuple[float, bool]]) -> dict[str, Any]:
    """One weight's kit SGD values: PopART's hasMomentum (``!isConst || mm != 0``) and
    enableNesterov (``nesterov != 0 && mm > 0``)."""
    mm, mm_const = v["defaultMomentum"]
    return {"learning_rate": v["defaultLearningRate"][0], "momentum": mm,
            "dampening": v["defaultDampening"][0], "weight_decay": v["defaultWeightDecay"][0],
            "velocity_scaling": v["defaultVelocityScaling"][0],
            "nesterov": v["nesterov"][0] != 0 and mm > 0, "velocity": not mm_const}


class SGD(Optimizer):
    """popart.SGD(pyd, clip_norm_settings=[], accumulatorAndMomentum=Combined, accumType,
    accl1Type, debugContext): accumType and accl1Type are accepted; the velocity keeps the
    weight's dtype."""

    _NAME = "SGD"
    _DEFAULTS = _SGD_DEFAULTS
    _SPECIFIC = _SGD_SPECIFIC

    def __init__(self, pyd: Mapping[str, Any] | None = None,
                 clip_norm_settings: Sequence[Any] = (), accumulatorAndMomentum: Any = None,
                 accumType: Any = None, accl1Type: Any = None, debugContext: str = "sgd"
                 ) -> None:
        self._mode = _enum_arg(accumulatorAndMomentum, "SGDAccumulatorAndMomentum", "Combined",
                               "accumulatorAndMomentum", "SGD")
        self._init(pyd, clip_norm_settings)

    def _check(self, v: Mapping[str, tuple[float, bool]]) -> None:
        _check_lr("SGD", v["defaultLearningRate"])
        _check_negative("SGD", "weight decay", v["defaultWeightDecay"][0])
        _check_negative("SGD", "momentum", v["defaultMomentum"][0])
        _check_negative("SGD", "dampening", v["defaultDampening"][0])
        if v["defaultVelocityScaling"][0] <= 0:
            raise popart_exception(f"Non-positive velocity scaling "
                                   f"({_num(v['defaultVelocityScaling'][0])}) in SGD is not "
                                   f"supported")
        if v["nesterov"][0] != 0 and v["defaultDampening"][0] > 0:
            raise popart_exception(f"When enable nesterov momentum, dampening "
                                   f"({_num(v['defaultDampening'][0])}) in SGD shouled be zero")

    def _make_kit(self) -> Any:
        return _KitSGD.with_popart_checks(
            **_sgd_fields(self._defaults), loss_scaling=self._defaults["lossScaling"][0],
            accumulator_and_momentum=self._mode.name.lower(),
            specific=self._kit_specific(_sgd_fields), clip_norm=self._kit_clip())

    def momentums(self) -> OptimizerValueMap:
        return self._map("defaultMomentum")

    def dampenings(self) -> OptimizerValueMap:
        return self._map("defaultDampening")

    def velocityScalings(self) -> OptimizerValueMap:
        return self._map("defaultVelocityScaling")

    def nesterov(self) -> OptimizerValueMap:
        return self._map("nesterov")


class ConstSGD(SGD):
    """popart.ConstSGD(learning_rate, weight_decay=0, loss_scaling=1, clip_norm_settings=[]):
    SGD with constants."""

    def __init__(self, learning_rate: float, weight_decay: float = 0.0,
                 loss_scaling: float = 1.0, clip_norm_settings: Sequence[Any] = ()) -> None:
        super().__init__({"defaultLearningRate": (learning_rate, True),
                          "defaultWeightDecay": (weight_decay, True),
                          "lossScaling": (loss_scaling, True)}, clip_norm_settings)


def _adam_fields(v: Mapping[str, tuple[float, bool]]) -> dict[str, Any]:
    return {"learning_rate": v["defaultLearningRate"][0], "beta1": v["defaultBeta1"][0],
            "beta2": v["defaultBeta2"][0], "eps": v["defaultEps"][0],
            "weight_decay": v["defaultWeightDecay"][0],
            "max_weight_norm": v["defaultMaxWeightNorm"][0]}


class Adam(Optimizer):
    """popart.Adam(values, mode=AdamMode.Adam, weight_decay_mode=WeightDecayMode.Decay,
    accum_type, accl1_type, accl2_type, clip_norm_settings=[], scaled_optimizer_state=False,
    debugContext): the moments are float32 (accl1_type/accl2_type are accepted)."""

    _NAME = "Adam"
    _DEFAULTS = _ADAM_DEFAULTS
    _SPECIFIC = _ADAM_SPECIFIC

    def __init__(self, values: Mapping[str, Any] | None = None, mode: Any = None,
                 weight_decay_mode: Any = None, accum_type: Any = None, accl1_type: Any = None,
                 accl2_type: Any = None, clip_norm_settings: Sequence[Any] = (),
                 scaled_optimizer_state: bool = False, debugContext: str = "adam") -> None:
        self._mode = _enum_arg(mode, "AdamMode", "Adam", "mode", "Adam")
        self._decay = _enum_arg(weight_decay_mode, "WeightDecayMode", "Decay",
                                "weight_decay_mode", "Adam")
        self._scaled = bool(scaled_optimizer_state)
        self._init(values, clip_norm_settings)

    def _check(self, v: Mapping[str, tuple[float, bool]]) -> None:
        _check_lr("Adam", v["defaultLearningRate"])
        _check_negative("Adam", "weight decay", v["defaultWeightDecay"][0])
        _check_negative("Adam", "beta1", v["defaultBeta1"][0])
        _check_negative("Adam", "beta2", v["defaultBeta2"][0])
        if v["defaultEps"][0] <= 0:
            raise popart_exception(f"Non-positive eps ({_num(v['defaultEps'][0])}) in Adam is "
                                   f"not supported")

    def _make_kit(self) -> Any:
        return _KitAdam.with_popart_checks(
            **_adam_fields(self._defaults), loss_scaling=self._defaults["lossScaling"][0],
            mode=_ADAM_MODES[self._mode.name], weight_decay_mode=_DECAY_MODES[self._decay.name],
            scaled_optimizer_state=self._scaled, specific=self._kit_specific(_adam_fields),
            clip_norm=self._kit_clip())

    def beta1s(self) -> OptimizerValueMap:
        return self._map("defaultBeta1")

    def beta2s(self) -> OptimizerValueMap:
        # PopART's binding defines beta2s as Adam::beta1s (popart.cpp); kept for a drop-in
        return self._map("defaultBeta1")

    def epss(self) -> OptimizerValueMap:
        return self._map("defaultEps")

    def maxWeightNorms(self) -> OptimizerValueMap:
        return self._map("defaultMaxWeightNorm")


def _adaptive_fields(v: Mapping[str, tuple[float, bool]]) -> dict[str, Any]:
    """One weight's kit Adaptive values: PopART keeps the momentum tensor when the momentum
    is changeable or not 0 (adaptivedecompose.cpp useMomentum)."""
    return {"learning_rate": v["defaultLearningRate"][0],
            "weight_decay": v["defaultWeightDecay"][0], "alpha": v["defaultAlpha"][0],
            "momentum": v["defaultMomentum"][0], "eps": v["defaultEps"][0],
            "velocity": not v["defaultMomentum"][1]}


class Adaptive(Optimizer):
    """popart.Adaptive(values, mode=AdaptiveMode.RMSProp, weight_decay_mode=Decay,
    accum_type, accl1_type, accl2_type, accl3_type, rmsprop_tf_variant=False, debugContext):
    AdaGrad, RMSProp, CenteredRMSProp and AdaDelta (and TensorFlow's RMSProp); the
    accumulators are float32 and the momentum has the weight's dtype (the *_type arguments are
    accepted)."""

    _NAME = "Adaptive"
    _DEFAULTS = _ADAPTIVE_DEFAULTS
    _SPECIFIC = _ADAPTIVE_SPECIFIC

    def __init__(self, values: Mapping[str, Any] | None = None, mode: Any = None,
                 weight_decay_mode: Any = None, accum_type: Any = None, accl1_type: Any = None,
                 accl2_type: Any = None, accl3_type: Any = None,
                 rmsprop_tf_variant: bool = False, debugContext: str = "adaptive") -> None:
        self._mode = _enum_arg(mode, "AdaptiveMode", "RMSProp", "mode", "Adaptive")
        self._decay = _enum_arg(weight_decay_mode, "WeightDecayMode", "Decay",
                                "weight_decay_mode", "Adaptive")
        self._tf = bool(rmsprop_tf_variant)
        self._init(values, ())

    def _check(self, v: Mapping[str, tuple[float, bool]]) -> None:
        if self._tf and self._mode.name not in ("RMSProp", "CenteredRMSProp"):
            raise popart_exception("The rmspropTFVariant parameter is only valid with the "
                                   "RMSProp and CenteredRMSProp optimizers.")
        _check_lr("Adaptive", v["defaultLearningRate"])
        _check_negative("Adaptive", "weight decay", v["defaultWeightDecay"][0])
        _check_negative("Adaptive", "alpha", v["defaultAlpha"][0])
        _check_negative("Adaptive", "momentum", v["defaultMomentum"][0])
        if v["defaultEps"][0] <= 0:
            raise popart_exception(f"Non-positive eps ({_num(v['defaultEps'][0])}) in Adaptive "
                                   f"is not supported")

    def _make_kit(self) -> Any:
        return _KitAdaptive.with_popart_checks(
            **_adaptive_fields(self._defaults), loss_scaling=self._defaults["lossScaling"][0],
            mode=_ADAPTIVE_MODES[self._mode.name],
            weight_decay_mode=_DECAY_MODES[self._decay.name], rmsprop_tf_variant=self._tf,
            specific=self._kit_specific(_adaptive_fields))

    def alphas(self) -> OptimizerValueMap:
        return self._map("defaultAlpha")

    def momentums(self) -> OptimizerValueMap:
        return self._map("defaultMomentum")

    def epss(self) -> OptimizerValueMap:
        return self._map("defaultEps")
