"""PopART's SGD, Adam and Adaptive optimizers: typed settings, PopART's update equations in JAX.

Each optimizer is a frozen pydantic model that validates its numbers (every error names the
field, the number and the fix), builds the ``popart.SGD`` / ``popart.Adam`` /
``popart.Adaptive`` object with PopART's own Python constructor (:meth:`to_popart`), and
implements PopART's weight update functionally for the JAX reference runtime::

    hyper = {k: jnp.asarray(v, jnp.float32) for k, v in opt.hyperparameters().items()}
    state = opt.init(weights)
    weights, state = opt.apply(hyper, weights, grads, state)      # pure jnp; jit/scan-safe

Every number PopART treats as a changeable ``OptimizerValue`` is an entry of ``hyper``, a runtime
value: a new learning rate, momentum, ... reaches a compiled program as data, without
recompiling. What changes the program is static and summarised by :attr:`program_key`: two
optimizers with equal keys run the same compiled program with different ``hyper``.

**Per-weight values** (PopART's ``insertSpecific``): ``specific`` maps a weight name to the
values it uses instead of the defaults (the other values stay the defaults); they are
``hyper`` entries named ``"<field>@<weight>"``. **Gradient clipping** (PopART's
``ClipNormSettings``, SGD and Adam): ``clip_norm`` is a tuple of groups ``(weights, max_norm)``
(``weights`` None: every trained weight); each group's tensors are multiplied by
``max_norm / max(max_norm, global_norm)``, the global norm being the square root of the sum of
their squares, at the point of the update PopART clips (see each class), group after group
(transforms/clipweightgradientsbynorm.cpp).

Gradients given to :meth:`apply` are what PopART's VarUpdateOps receive after the session has
reduced them over gradient accumulation and replicas (summed, or divided by A x R for mean
reduction): ``apply`` does not reduce again. They are still scaled by the loss scaling ``ls``
(the session multiplies the loss by ``hyper["loss_scaling"]`` before the backward pass), and
``apply`` unscales them exactly where PopART does. With no accumulation/replication left to
model, PopART's replication factor rf and accumulation factor af are 1 in every equation below.

Sources (graphcore/popart d2f20d78): willow/include/popart/sgd.hpp (SGD notes and class docs),
willow/src/sgd.cpp, willow/include/popart/compoundscalarhelper.hpp,
willow/src/patterns/sgd{1,2}decompose.cpp, willow/include/popart/adam.hpp,
willow/src/adam.cpp, willow/src/patterns/adamdecompose.cpp,
willow/src/popx/op/adam{updater,varupdate}x.cpp, willow/include/popart/adaptive.hpp,
willow/src/adaptive.cpp, willow/src/patterns/adaptivedecompose.cpp,
willow/src/popx/op/{rmsprop,adadelta}updaterx.cpp, scaledvarupdatex.cpp, accumulatex.cpp,
willow/src/transforms/clipweightgradientsbynorm.cpp, python/popart/popart_core/popart.cpp.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from .._base.problems import Problem, raise_errors
from .._config.fields import _Model
from ..errors import ConfigError, ConfigTypeError

if TYPE_CHECKING:  # the update maths imports JAX only when a session runs it
    import jax

__all__ = ["SGD", "Adam", "Adaptive", "SGD_VALUE_KEYS", "ADAM_VALUE_KEYS",
           "ADAPTIVE_VALUE_KEYS"]

#: Keys popart.SGD's dict accepts (willow/src/sgd.cpp SGD::getComplete).
SGD_VALUE_KEYS = ("defaultLearningRate", "defaultWeightDecay", "defaultMomentum",
                  "defaultDampening", "defaultVelocityScaling", "lossScaling", "nesterov")
#: Keys popart.Adam's dict accepts (willow/src/adam.cpp Adam::getComplete; "maxWeightNorm" is a
#: deprecated alias of "defaultMaxWeightNorm").
ADAM_VALUE_KEYS = ("defaultLearningRate", "defaultWeightDecay", "defaultBeta1", "defaultBeta2",
                   "defaultEps", "lossScaling", "defaultMaxWeightNorm", "maxWeightNorm")
#: Keys popart.Adaptive's dict accepts (willow/src/adaptive.cpp Adaptive::getComplete).
ADAPTIVE_VALUE_KEYS = ("defaultLearningRate", "defaultWeightDecay", "defaultAlpha",
                       "defaultMomentum", "defaultEps", "lossScaling")

_ADAM_MODES = {"adam": "Adam", "adam_no_bias": "AdamNoBias", "adamax": "AdaMax",
               "lamb": "Lamb", "lamb_no_bias": "LambNoBias"}
_ADAPTIVE_MODES = {"adagrad": "AdaGrad", "rmsprop": "RMSProp",
                   "centered_rmsprop": "CenteredRMSProp", "adadelta": "AdaDelta"}
_DECAY_MODES = {"decay": "Decay", "l2_regularization": "L2Regularization"}

#: One clipping group: the weights (None: every trained weight) and the maximum global norm.
ClipGroup = tuple[tuple[str, ...] | None, float]


def _compute_dtype(dtype: Any) -> Any:
    """float32 for float16/bfloat16/float32 weights, float64 for float64 ones."""
    import jax.numpy as jnp
    return jnp.promote_types(dtype, jnp.float32)


_FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max


def _label(at: tuple[str, ...], name: str) -> tuple[Any, str]:
    """A problem's location and how its message names the value: ``name`` for a default,
    ``specific['w'].name`` for weight w's own value."""
    if not at:
        return name, name
    return (*at, name), f"specific[{at[-1]!r}].{name}"


def _refusal(message: str) -> ConfigError:
    """A ConfigError that popart_kit.popart raises as PopART's own ``message``."""
    err = ConfigError(message)
    err.popart_text = message  # type: ignore[attr-defined]
    return err


class _Optimizer(_Model):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    #: The values a weight may have of its own (``specific``): field -> "float" or "bool".
    _PER_WEIGHT: ClassVar[dict[str, str]] = {}
    #: The rule-id prefix of the class's checks.
    _PREFIX: ClassVar[str] = ""

    specific: dict[str, dict[str, float | bool]] = Field(
        default_factory=dict, description="Per-weight values (PopART's insertSpecific): "
                                          "weight -> {field: value}.")

    def __init__(self, learning_rate: Any = None, /, **data: Any) -> None:
        # SGD(0.1, momentum=0.9) as well as SGD(learning_rate=0.1, ...)
        if learning_rate is not None:
            if "learning_rate" in data:
                raise ConfigTypeError(f"{type(self).__name__}: learning_rate given both by "
                                      f"position and by keyword. Fix: give it once.",
                                      rule="K-optimizer-arguments")
            data["learning_rate"] = learning_rate
        super().__init__(**data)

    @classmethod
    def with_popart_checks(cls, **fields: Any) -> Any:
        """The optimizer built without the kit's range rules, for ``popart_kit.popart``, which
        has checked the values as PopART does (PopART accepts, e.g., a changeable learning rate
        of 0 or a momentum of 1). ``fields`` must have the field types (floats as floats)."""
        return cls.model_construct(**fields)

    # -- validation helpers -------------------------------------------------------------------

    @staticmethod
    def _finite(problems: list[Problem], name: str, value: float, prefix: str,
                at: tuple[str, ...] = ()) -> bool:
        """Whether ``value`` is finite in float32, the dtype the update is computed in."""
        if math.isfinite(value) and abs(value) <= _FLOAT32_MAX:
            return True
        loc, label = _label(at, name)
        why = ("is not a finite number" if not math.isfinite(value) else
               f"is not finite in float32, the dtype the update is computed in (largest "
               f"{_FLOAT32_MAX:.7g}): it would become {'-' if value < 0 else ''}inf")
        problems.append(Problem(loc, f"{label}={value!r} {why}.",
                                f"give {label} a value of magnitude at most {_FLOAT32_MAX:.7g}.",
                                f"K-{prefix}-finite", involved={label: value}))
        return False

    def _value_problems(self, v: Mapping[str, Any], at: tuple[str, ...]) -> list[Problem]:
        """The problems of one weight's values ``v`` (the defaults when ``at`` is empty)."""
        return []  # pragma: no cover - overridden

    def _global_problems(self) -> list[Problem]:
        """The problems of the values every weight shares (loss scaling, ...)."""
        return []  # pragma: no cover - overridden

    def _specific_problems(self) -> list[Problem]:
        """Each weight's own values: known fields of the right type, checked as defaults."""
        p: list[Problem] = []
        for weight, over in self.specific.items():
            keys: list[Problem] = []
            for key, value in over.items():
                kind = self._PER_WEIGHT.get(key)
                loc = ("specific", weight, key)
                if kind is None:
                    keys.append(Problem(loc, f"specific[{weight!r}] has {key!r}, which is not a "
                                     f"per-weight value of {type(self).__name__}.",
                                     f"use one of {', '.join(self._PER_WEIGHT)}.",
                                     "K-unknown-key", involved={key: value}))
                elif (kind == "bool") != isinstance(value, bool):
                    keys.append(Problem(loc, f"specific[{weight!r}][{key!r}]={value!r} is not a "
                                     f"{kind}.", f"give {key} a {kind}.", "K-unknown-key",
                                     involved={key: value}))
            p += keys or self._value_problems(self._weight(weight), ("specific", weight))
        return p

    def _clip_problems(self) -> list[Problem]:
        p: list[Problem] = []
        for i, (_, max_norm) in enumerate(getattr(self, "clip_norm", ())):
            self._finite(p, f"clip_norm[{i}].max_norm", max_norm, self._PREFIX)
        return p

    def _problems(self) -> list[Problem]:
        return (self._value_problems(self._defaults(), ())
                + self._global_problems() + self._specific_problems() + self._clip_problems())

    @model_validator(mode="after")
    def _check(self) -> _Optimizer:
        raise_errors(type(self).__name__, self._problems())
        return self

    # -- per-weight values --------------------------------------------------------------------

    def _defaults(self) -> dict[str, Any]:
        """The values of the weights without specific ones."""
        return {f: getattr(self, f) for f in self._PER_WEIGHT}

    def _weight(self, name: str) -> dict[str, Any]:
        """Weight ``name``'s values: its specific ones, else the defaults."""
        return {**self._defaults(), **self.specific.get(name, {})}

    def _reads(self, v: Mapping[str, Any]) -> tuple[str, ...]:
        """The per-weight runtime values the update of a weight with values ``v`` reads."""
        raise NotImplementedError  # pragma: no cover - overridden

    def _structure(self, v: Mapping[str, Any]) -> tuple[Any, ...]:
        """What the update of a weight with values ``v`` compiles to (beyond the class's)."""
        return ()

    def _default_hyperparameters(self) -> dict[str, float]:
        raise NotImplementedError  # pragma: no cover - overridden

    def _key_extras(self) -> tuple[Any, ...]:
        """The program_key's part for specific values and clipping (empty without them)."""
        extra: tuple[Any, ...] = ()
        if self.specific:
            extra += (("specific", tuple((w, self._structure(self._weight(w)))
                                         for w in sorted(self.specific))),)
        if getattr(self, "clip_norm", ()):
            extra += (("clip_norm", self.clip_norm),)
        return extra

    # -- shared API ---------------------------------------------------------------------------

    def hyperparameters(self) -> dict[str, float]:
        """The runtime values: the defaults, then ``"<field>@<weight>"`` for each weight with
        specific values."""
        h = self._default_hyperparameters()
        for weight in sorted(self.specific):
            v = self._weight(weight)
            for f in self._reads(v):
                h[f"{f}@{weight}"] = float(v[f])
        return h

    def replace(self, **changes: Any) -> Any:
        """A validated copy with ``changes`` applied (the original is unchanged)."""
        return type(self).model_validate({**self.model_dump(), **changes})

    def with_learning_rate(self, learning_rate: float) -> Any:
        """A validated copy with a new learning rate; same :attr:`program_key`."""
        return self.replace(learning_rate=learning_rate)

    def _hyper(self, hyper: Mapping[str, Any]) -> dict[str, jax.Array]:
        """The runtime values, checked against the keys this program reads (a static check)."""
        import jax.numpy as jnp

        expected = set(self.hyperparameters())
        given = set(hyper)
        if given != expected:
            missing, extra = sorted(expected - given), sorted(given - expected)
            raise ConfigError(
                f"{type(self).__name__}.apply: hyper has keys {sorted(given)}; this program "
                f"reads {sorted(expected)} (missing {missing}, unexpected {extra}). Fix: pass "
                f"{{k: jnp.float32(v) for k, v in opt.hyperparameters().items()}} of an optimizer "
                f"with the same program_key.", rule="K-optimizer-hyper")
        return {k: jnp.asarray(v, jnp.float32) for k, v in hyper.items()}

    def _weight_hyper(self, h: Mapping[str, Any], name: str) -> tuple[dict[str, Any], dict]:
        """Weight ``name``'s runtime values (from ``h``) and its static values."""
        v = self._weight(name)
        at = f"@{name}" if name in self.specific else ""
        return {f: h[f + at] for f in self._reads(v)}, v

    @staticmethod
    def _check_trees(weights: Mapping[str, Any], grads: Mapping[str, Any]) -> None:
        if set(weights) != set(grads):
            raise ConfigError(f"apply: weights {sorted(weights)} and grads {sorted(grads)} name "
                              f"different tensors. Fix: pass one gradient per weight.",
                              rule="K-optimizer-trees")

    # -- gradient clipping --------------------------------------------------------------------

    def _check_clip(self, weights: Mapping[str, Any]) -> None:
        """PopART's refusals of clipping groups (clipweightgradientsbynorm.cpp), for the
        weights this optimizer updates."""
        groups = getattr(self, "clip_norm", ())
        if len(groups) > 1 and any(names is None for names, _ in groups):
            raise _refusal("Multiple clip groups specified, but one has the mode "
                           "'ClipAllWeights'. When using ClipNormSettings.clipAllWeights(...), "
                           "only one group should be specified.")
        for i, (names, _) in enumerate(groups):
            if names is not None and not names:
                raise _refusal(f"clip group {i} names no weight: PopART has no norm to compute "
                               f"(its transform fails). Fix: name the weights to clip, or use "
                               f"ClipNormSettings.clipAllWeights.")
            for name in names or ():
                if name not in weights:
                    raise _refusal(f"Could not find a varupdate op for tensor {name}")

    def _clip(self, targets: dict[str, Any]) -> dict[str, Any]:
        """``targets`` with each clipping group, in order, scaled by
        max_norm / max(max_norm, sqrt(sum of squares of the group's tensors))."""
        import jax.numpy as jnp
        for names, max_norm in getattr(self, "clip_norm", ()):
            group = list(dict.fromkeys(sorted(targets) if names is None else names))
            total = sum(jnp.sum(jnp.square(targets[n].astype(jnp.float32))) for n in group)
            clip = jnp.float32(max_norm)
            factor = clip / jnp.maximum(clip, jnp.sqrt(total))
            for n in group:
                targets[n] = targets[n] * factor.astype(targets[n].dtype)
        return targets

    def _apply_split(self, weights: Mapping[str, Any],
                     step: Callable[[str, Any], tuple[Any, Callable[[Any], Any]]]
                     ) -> dict[str, Any]:
        """Each weight's update in two parts, with the clipping groups between them:
        ``step(name, w)`` gives the tensor PopART clips and the rest of the update (a function
        of that tensor, clipped or not)."""
        targets, finish = {}, {}
        for k, w in weights.items():
            targets[k], finish[k] = step(k, w)
        targets = self._clip(targets)
        return {k: finish[k](targets[k]) for k in weights}

    # -- PopART -------------------------------------------------------------------------------

    def _clip_to_popart(self, popart: Any) -> list[Any]:
        return [popart.ClipNormSettings.clipAllWeights(float(m)) if names is None else
                popart.ClipNormSettings.clipWeights(list(names), float(m))
                for names, m in getattr(self, "clip_norm", ())]


class SGD(_Optimizer):
    """PopART's SGD (``popart.SGD``) with momentum, dampening, weight decay, Nesterov momentum,
    velocity scaling and loss scaling.

    Atomic scalars: lr learning rate, mm momentum, dm dampening, wd weight decay, vs velocity
    scaling, ls loss scaling; g is the gradient as the optimizer receives it (scaled by ls).

    **No momentum** (``momentum == 0``; PopART's SGD0, no velocity tensor; sgd.hpp "The compound
    scalars of SGD", SGD0VarUpdateOp)::

        w <- w * (1 - lr * (1 - dm) * wd) - (lr * (1 - dm) / ls) * g

    (dampening applies even without momentum, unlike PyTorch; vs plays no part).

    **Momentum, accumulator_and_momentum="separate"** (SGDAccumulatorAndMomentum::Separate,
    SGD2; sgd2decompose.cpp). The velocity v is kept vs times larger and starts at 0::

        v <- mm * v + (1 - dm) * wd * vs * w + (1 - dm) * vs / ls * g
        nesterov:  w <- w - lr / vs * (vs * (g / ls + wd * w) + mm * v)
        else:      w <- w - lr / vs * v

    **Momentum, accumulator_and_momentum="combined"** (PopART's default,
    SGDAccumulatorAndMomentum::Combined, SGD1; sgd1decompose.cpp). The stored velocity already
    holds the momentum and weight-decay terms of the next step, computed with the values of the
    step that produced it; it starts at ``(1 - dm) * wd * vs * w0`` with this object's values::

        v <- v + (1 - dm) * vs / ls * g
        nesterov:  w <- w - lr / vs * (vs * (g / ls + wd * w) + mm * v)
        else:      w <- w - lr / vs * v
        v <- mm * v + (1 - dm) * wd * vs * w        (w: the updated weight)

    With constant hyperparameters both strategies give the same weights (PyTorch's
    ``v = mm*v + (1-dm)*(g/ls + wd*w); w -= lr*v`` for vs = 1). When hyperparameters change
    between steps, Combined applies the new mm and wd one step late ("lagged", sgd.hpp caveat 1)
    and Separate applies them at once; ``apply`` reproduces each exactly.

    A weight has a velocity when its momentum is not 0, or when ``velocity`` is True (PopART
    keeps one for a changeable momentum, even 0: SGD::hasMomentum). Weights with specific values
    may differ in this, each taking its own of the three updates. Clipping scales what PopART's
    SGD0/SGD1VarUpdateOp receives: g (still scaled by ls) without a velocity; with one, the
    term the weight update multiplies by lr / vs (v, or Nesterov's vs * (...) + mm * v), the
    stored velocity staying unclipped.

    Static (part of :attr:`program_key`): whether each weight has a velocity, ``nesterov``
    (PopART enables it only with momentum > 0 and dampening 0), ``accumulator_and_momentum``
    and the clipping groups. Runtime (``hyperparameters()``): learning_rate, dampening,
    weight_decay, loss_scaling, plus momentum and velocity_scaling with a velocity.
    """

    _PER_WEIGHT: ClassVar[dict[str, str]] = {
        "learning_rate": "float", "momentum": "float", "dampening": "float",
        "weight_decay": "float", "nesterov": "bool", "velocity_scaling": "float",
        "velocity": "bool"}
    _PREFIX: ClassVar[str] = "sgd"

    learning_rate: float = Field(description="lr (PopART defaultLearningRate).")
    momentum: float = Field(0.0, description="mm (defaultMomentum); 0: no velocity tensor.")
    dampening: float = Field(0.0, description="dm (defaultDampening).")
    weight_decay: float = Field(0.0, description="wd (defaultWeightDecay).")
    nesterov: bool = Field(False, description="Nesterov momentum (PopART key 'nesterov').")
    velocity_scaling: float = Field(1.0, description="vs (defaultVelocityScaling).")
    loss_scaling: float = Field(1.0, description="ls (lossScaling).")
    accumulator_and_momentum: Literal["combined", "separate"] = Field(
        "combined", description="popart.SGDAccumulatorAndMomentum; PopART's default: combined.")
    velocity: bool = Field(False, description="Keep a velocity tensor even with momentum 0, as "
                                              "PopART does for a changeable momentum.")
    clip_norm: tuple[ClipGroup, ...] = Field(
        (), description="Gradient clipping groups (PopART's ClipNormSettings): "
                        "((weights or None for all, max_norm), ...).")

    def _value_problems(self, v: Mapping[str, Any], at: tuple[str, ...]) -> list[Problem]:
        p: list[Problem] = []

        def f(name: str) -> bool:
            return self._finite(p, name, v[name], "sgd", at)

        def add(name: str, text: str, fix: str, rule: str, **involved: Any) -> None:
            loc, label = _label(at, name)
            p.append(Problem(loc, text.format(label=label), fix, rule,
                             involved=involved or {label: v[name]}))

        lr, mm, dm, wd, vs = (v[k] for k in ("learning_rate", "momentum", "dampening",
                                             "weight_decay", "velocity_scaling"))
        if f("learning_rate") and lr <= 0:
            add("learning_rate", f"{{label}}={lr!r} is not positive.",
                "use a learning rate > 0, e.g. 0.01.", "K-sgd-lr")
        if f("momentum") and not 0 <= mm < 1:
            add("momentum", f"{{label}}={mm!r} is outside [0, 1); the velocity would not "
                f"decay.", "use a momentum in [0, 1), e.g. 0.9, or 0 for none.",
                "K-sgd-momentum")
        if f("dampening") and not 0 <= dm <= 1:
            add("dampening", f"{{label}}={dm!r} is outside [0, 1].",
                "use a dampening in [0, 1], usually 0.", "K-sgd-dampening")
        if f("weight_decay") and wd < 0:
            add("weight_decay", f"{{label}}={wd!r} is negative.",
                "use a weight decay >= 0, e.g. 1e-4, or 0 for none.", "K-sgd-weight-decay")
        if f("velocity_scaling") and vs <= 0:
            add("velocity_scaling", f"{{label}}={vs!r} is not positive (PopART refuses it).",
                "use a velocity scaling > 0, 1 for none.", "K-sgd-velocity-scaling")
        if v["nesterov"] and mm == 0:
            add("nesterov", "nesterov=True with momentum=0.0: PopART silently ignores Nesterov "
                "without momentum.", "set a momentum > 0, e.g. 0.9, or nesterov=False.",
                "K-sgd-nesterov-momentum", nesterov=True, momentum=mm)
        if v["nesterov"] and dm != 0:
            add("nesterov", f"nesterov=True with dampening={dm!r}: PopART requires dampening 0 "
                f"with Nesterov momentum.", "set dampening=0.0, or nesterov=False.",
                "K-sgd-nesterov-dampening", nesterov=True, dampening=dm)
        return p

    def _global_problems(self) -> list[Problem]:
        p: list[Problem] = []
        if self._finite(p, "loss_scaling", self.loss_scaling, "sgd") and self.loss_scaling <= 0:
            p.append(Problem("loss_scaling", f"loss_scaling={self.loss_scaling!r} is not "
                             f"positive.", "use a loss scaling > 0, 1 for none.",
                             "K-sgd-loss-scaling", involved={"loss_scaling": self.loss_scaling}))
        return p

    # -- structure ----------------------------------------------------------------------------

    @staticmethod
    def _has_velocity(v: Mapping[str, Any]) -> bool:
        return v["momentum"] != 0 or v["velocity"]

    @property
    def has_velocity(self) -> bool:
        """PopART SGD1/SGD2 (a velocity tensor per weight) rather than SGD0, for the weights
        without specific values."""
        return self._has_velocity(self._defaults())

    def _structure(self, v: Mapping[str, Any]) -> tuple[Any, ...]:
        return (self._has_velocity(v), bool(v["nesterov"]) and self._has_velocity(v))

    def _reads(self, v: Mapping[str, Any]) -> tuple[str, ...]:
        base = ("learning_rate", "dampening", "weight_decay")
        return base + ("momentum", "velocity_scaling") if self._has_velocity(v) else base

    @property
    def program_key(self) -> tuple[Any, ...]:
        """What changes the compiled program; equal keys: only hyperparameters() differ."""
        if not self.has_velocity and not any(self._has_velocity(self._weight(w))
                                             for w in self.specific):
            return ("SGD", "no_momentum") + self._key_extras()
        return ("SGD", self.accumulator_and_momentum, self.nesterov) + self._key_extras()

    def _default_hyperparameters(self) -> dict[str, float]:
        h = {"learning_rate": self.learning_rate, "dampening": self.dampening,
             "weight_decay": self.weight_decay, "loss_scaling": self.loss_scaling}
        if self.has_velocity:
            h["momentum"] = self.momentum
            h["velocity_scaling"] = self.velocity_scaling
        return h

    # -- functional update --------------------------------------------------------------------

    def init(self, weights: Mapping[str, jax.Array]) -> dict[str, Any]:
        """{} without a velocity, else {"velocity": {name: v}} for the weights with one, in
        each weight's dtype: zeros (Separate) or ``(1 - dm) * wd * vs * w0`` (Combined,
        sgd1decompose.cpp addAcclInTensor). Refuses clipping groups PopART refuses."""
        import jax.numpy as jnp
        self._check_clip(weights)
        velocity = {}
        for k, w in weights.items():
            v = self._weight(k)
            if not self._has_velocity(v):
                continue
            if self.accumulator_and_momentum == "separate":
                velocity[k] = jnp.zeros_like(w)
            else:
                swd1 = (1.0 - v["dampening"]) * v["weight_decay"] * v["velocity_scaling"]
                velocity[k] = (jnp.asarray(w, _compute_dtype(jnp.result_type(w))) * swd1
                               ).astype(jnp.result_type(w))
        return {"velocity": velocity} if velocity else {}

    def apply(self, hyper: Mapping[str, Any], weights: Mapping[str, jax.Array],
              grads: Mapping[str, jax.Array], state: Mapping[str, Any],
              ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """One PopART SGD weight update (see the class docstring); pure jnp."""
        h = self._hyper(hyper)
        self._check_trees(weights, grads)
        ls = h["loss_scaling"]
        combined = self.accumulator_and_momentum == "combined"

        def step(k: str, w: Any) -> tuple[Any, Callable[[Any], Any]]:
            hk, v = self._weight_hyper(h, k)
            lr, dm, wd = hk["learning_rate"], hk["dampening"], hk["weight_decay"]
            ct = _compute_dtype(w.dtype)
            g_ = grads[k].astype(ct)
            if not self._has_velocity(v):
                wdsf0 = 1.0 - lr * (1.0 - dm) * wd          # WeightDecayScaleFactor0Helper
                slr0 = lr * (1.0 - dm) / ls                 # ScaledLearningRate0Helper
                return g_, lambda t: ((w.astype(ct) * wdsf0.astype(ct)
                                       - slr0.astype(ct) * t).astype(w.dtype), None)
            mm, vs = hk["momentum"], hk["velocity_scaling"]
            swd1 = (1.0 - dm) * wd * vs                     # ScaledWeightDecay1Helper
            dpsf = (1.0 - dm) * vs / ls                     # DampeningScaleFactor{1,2}Helper
            slr = lr / vs                                   # ScaledLearningRate{1,2}Helper
            w_ = w.astype(ct)
            v_ = state["velocity"][k].astype(ct)
            if combined:   # SGD1: accumulate the gradient into the precomputed velocity
                v_ = v_ + dpsf.astype(ct) * g_
            else:          # SGD2: partial accl update (mm, wd) then accumulate the gradient
                v_ = mm.astype(ct) * v_ + swd1.astype(ct) * w_ + dpsf.astype(ct) * g_
            if v["nesterov"]:   # SGD1NesterovOp: ngsf * (1/ls * g + wd * w) + mm * v
                upd = vs.astype(ct) * (g_ / ls.astype(ct) + wd.astype(ct) * w_) \
                    + mm.astype(ct) * v_
            else:
                upd = v_

            def finish(t: Any) -> Any:
                w_new = (w_ - slr.astype(ct) * t).astype(w.dtype)
                v_new = v_
                if combined:   # SGD1AcclUpdateOp, after the weight update: v = smm1*v + swd1*w'
                    v_new = mm.astype(ct) * v_ + swd1.astype(ct) * w_new.astype(ct)
                return w_new, v_new.astype(state["velocity"][k].dtype)
            return upd, finish

        done = self._apply_split(weights, step)
        new_w = {k: out[0] for k, out in done.items()}
        new_v = {k: out[1] for k, out in done.items() if out[1] is not None}
        return new_w, ({"velocity": new_v} if new_v else {})

    # -- PopART -------------------------------------------------------------------------------

    def popart_values(self) -> dict[str, tuple[float, bool]]:
        """The dict popart.SGD receives: {key: (value, isConst)}.

        Every number is (value, False), changeable by updateOptimizerFromHost, except what is
        static here: momentum 0 is (0.0, True) - PopART's hasMomentum is ``!isConst || mm != 0``,
        so only a const 0 builds the same velocity-free program - and nesterov, present only
        when enabled, is (1.0, True).
        """
        values = {
            "defaultLearningRate": (float(self.learning_rate), False),
            "defaultWeightDecay": (float(self.weight_decay), False),
            "defaultMomentum": ((float(self.momentum), False) if self.has_velocity
                                else (0.0, True)),
            "defaultDampening": (float(self.dampening), False),
            "defaultVelocityScaling": (float(self.velocity_scaling), False),
            "lossScaling": (float(self.loss_scaling), False),
        }
        if self.nesterov:
            values["nesterov"] = (1.0, True)
        return values

    def _popart_specific(self, weight: str) -> dict[str, tuple[float, bool]]:
        v = self._weight(weight)
        return {"learningRate": (float(v["learning_rate"]), False),
                "weightDecay": (float(v["weight_decay"]), False),
                "momentum": ((float(v["momentum"]), False) if self._has_velocity(v)
                             else (0.0, True)),
                "dampening": (float(v["dampening"]), False),
                "velocityScaling": (float(v["velocity_scaling"]), False),
                "nesterov": (float(v["nesterov"]), True)}

    def to_popart(self, popart: Any) -> Any:
        """``popart.SGD(values[, clip_norm_settings][, accumulatorAndMomentum=Separate])``,
        then ``insertSpecific`` per weight with specific values (popart.cpp binding)."""
        kwargs: dict[str, Any] = {}
        if self.clip_norm:
            kwargs["clip_norm_settings"] = self._clip_to_popart(popart)
        if self.accumulator_and_momentum == "separate":
            kwargs["accumulatorAndMomentum"] = popart.SGDAccumulatorAndMomentum.Separate
        opt = popart.SGD(self.popart_values(), **kwargs)
        for weight in sorted(self.specific):
            opt.insertSpecific(weight, self._popart_specific(weight))
        return opt


class Adam(_Optimizer):
    """PopART's Adam family (``popart.Adam``): modes adam, adam_no_bias, adamax, lamb,
    lamb_no_bias (popart.AdamMode) and weight decay modes decay (AdamW) and l2_regularization
    (popart.WeightDecayMode). Defaults are PopART's (adam.hpp getUnset*): beta1 0.9, beta2
    0.999, eps 1e-6, weight decay 0, loss scaling 1, max weight norm 10.

    Per weight, with g scaled by ls (adam.hpp, adamdecompose.cpp, adamupdaterx.cpp,
    adamvarupdatex.cpp; m, v start at 0, t at 0)::

        s  = g / ls
        s  = s + wd * w                          (l2_regularization only)
        m  = b1 * m + (1 - b1) * s
        v  = b2 * v + (1 - b2) * s^2             (adam, adam_no_bias, lamb, lamb_no_bias)
        v  = max(b2 * v, |s|)                    (adamax)
        t  = t + 1
        mc = m / (1 - b1^t)                      (adam, lamb, adamax; else mc = m)
        vc = v / (1 - b2^t)                      (adam, lamb; else vc = v - adamax included,
                                                  as adamupdaterx.cpp does)
        x  = mc / (sqrt(vc) + eps)               (adamax: mc / (vc + eps))
        x  = x + wd * w                          (decay only)
        r  = min(||w||, mwn) / ||x||             (lamb, lamb_no_bias; r = 1 when ||w||, ||x||
                                                  or mwn is 0; else r = 1)
        w  = w - r * lr * x

    **scaled_optimizer_state** (PopART's scaledOptimizerState): m and v are kept ls (and ls)
    times larger - s = g (not unscaled), the L2 term is ``wd * ls * w``, eps is ``eps * ls``
    (AdamWeightDecayHelper, AdamEpsHelper, AdamGradientScalingHelper) - and when the loss
    scaling changes between steps the moments are rescaled by ``ls / previous ls`` as they
    accumulate (``m = b1 * ratio * m + ...``; v too, by the same ratio, as
    RescaleAccumulateOpx does; adamdecompose.cpp rescaleRatio).

    Clipping scales s, before both moments (PopART clips the AccumulateOps' input).
    m and v are float32 (popart.Adam's accl1_type/accl2_type defaults), t a float32 counter.
    Static (:attr:`program_key`): mode, weight_decay_mode, scaled_optimizer_state and the
    clipping groups. Runtime (``hyperparameters()``): learning_rate, beta1, beta2, eps,
    weight_decay, loss_scaling, and max_weight_norm for the lamb modes.
    """

    _PER_WEIGHT: ClassVar[dict[str, str]] = {
        "learning_rate": "float", "beta1": "float", "beta2": "float", "eps": "float",
        "weight_decay": "float", "max_weight_norm": "float"}
    _PREFIX: ClassVar[str] = "adam"

    learning_rate: float = Field(description="lr (PopART defaultLearningRate).")
    beta1: float = Field(0.9, description="b1 (defaultBeta1).")
    beta2: float = Field(0.999, description="b2 (defaultBeta2).")
    eps: float = Field(1e-6, description="eps (defaultEps).")
    weight_decay: float = Field(0.0, description="wd (defaultWeightDecay).")
    weight_decay_mode: Literal["decay", "l2_regularization"] = Field(
        "decay", description="popart.WeightDecayMode: Decay (AdamW) or L2Regularization.")
    mode: Literal["adam", "adam_no_bias", "adamax", "lamb", "lamb_no_bias"] = Field(
        "adam", description="popart.AdamMode.")
    loss_scaling: float = Field(1.0, description="ls (lossScaling).")
    max_weight_norm: float = Field(
        10.0, description="mwn (defaultMaxWeightNorm), Lamb's phi; 0 disables the trust ratio.")
    scaled_optimizer_state: bool = Field(
        False, description="Keep m and v scaled by the loss scaling (PopART's "
                           "scaled_optimizer_state).")
    clip_norm: tuple[ClipGroup, ...] = Field(
        (), description="Gradient clipping groups (PopART's ClipNormSettings): "
                        "((weights or None for all, max_norm), ...).")

    def _value_problems(self, v: Mapping[str, Any], at: tuple[str, ...]) -> list[Problem]:
        p: list[Problem] = []

        def f(name: str) -> bool:
            return self._finite(p, name, v[name], "adam", at)

        def add(name: str, text: str, fix: str, rule: str) -> None:
            loc, label = _label(at, name)
            p.append(Problem(loc, text.format(label=label), fix, rule,
                             involved={label: v[name]}))

        if f("learning_rate") and v["learning_rate"] <= 0:
            add("learning_rate", f"{{label}}={v['learning_rate']!r} is not positive.",
                "use a learning rate > 0, e.g. 1e-3.", "K-adam-lr")
        for name in ("beta1", "beta2"):
            value = v[name]
            if f(name) and not 0 <= value < 1:
                add(name, f"{{label}}={value!r} is outside [0, 1); the moment would not decay "
                    f"(and 1 - {name}^t would be 0).",
                    f"use a {name} in [0, 1), e.g. {0.9 if name == 'beta1' else 0.999}.",
                    f"K-adam-{name}")
        if f("eps") and v["eps"] <= 0:
            add("eps", f"{{label}}={v['eps']!r} is not positive (PopART refuses it).",
                "use an eps > 0, e.g. 1e-6 (PopART's default).", "K-adam-eps")
        if f("weight_decay") and v["weight_decay"] < 0:
            add("weight_decay", f"{{label}}={v['weight_decay']!r} is negative.",
                "use a weight decay >= 0, e.g. 0.01, or 0 for none.", "K-adam-weight-decay")
        if f("max_weight_norm") and v["max_weight_norm"] < 0:
            add("max_weight_norm", f"{{label}}={v['max_weight_norm']!r} is negative.",
                "use a max weight norm >= 0 (0 disables Lamb's trust ratio), e.g. 10.",
                "K-adam-max-weight-norm")
        return p

    def _global_problems(self) -> list[Problem]:
        p: list[Problem] = []
        if self._finite(p, "loss_scaling", self.loss_scaling, "adam") and self.loss_scaling <= 0:
            p.append(Problem("loss_scaling", f"loss_scaling={self.loss_scaling!r} is not "
                             f"positive.", "use a loss scaling > 0, 1 for none.",
                             "K-adam-loss-scaling", involved={"loss_scaling": self.loss_scaling}))
        return p

    @property
    def is_lamb(self) -> bool:
        return self.mode in ("lamb", "lamb_no_bias")

    @property
    def program_key(self) -> tuple[Any, ...]:
        """What changes the compiled program; equal keys: only hyperparameters() differ."""
        key = ("Adam", self.mode, self.weight_decay_mode)
        return key + (("scaled",) if self.scaled_optimizer_state else ()) + self._key_extras()

    def _reads(self, v: Mapping[str, Any]) -> tuple[str, ...]:
        base = ("learning_rate", "beta1", "beta2", "eps", "weight_decay")
        return base + ("max_weight_norm",) if self.is_lamb else base

    def _default_hyperparameters(self) -> dict[str, float]:
        h = {"learning_rate": self.learning_rate, "beta1": self.beta1, "beta2": self.beta2,
             "eps": self.eps, "weight_decay": self.weight_decay,
             "loss_scaling": self.loss_scaling}
        if self.is_lamb:
            h["max_weight_norm"] = self.max_weight_norm
        return h

    def init(self, weights: Mapping[str, jax.Array]) -> dict[str, Any]:
        """{"step": float32 0, "m": {name: zeros}, "v": {name: zeros}} (m, v float32), and
        "prev_loss_scaling" (the constructor's, float32) with scaled_optimizer_state. Refuses
        clipping groups PopART refuses."""
        import jax.numpy as jnp
        self._check_clip(weights)

        def zeros(w: Any) -> jax.Array:
            return jnp.zeros(jnp.shape(w), _compute_dtype(jnp.result_type(w)))
        state = {"step": jnp.zeros((), jnp.float32),
                 "m": {k: zeros(w) for k, w in weights.items()},
                 "v": {k: zeros(w) for k, w in weights.items()}}
        if self.scaled_optimizer_state:
            state["prev_loss_scaling"] = jnp.asarray(self.loss_scaling, jnp.float32)
        return state

    def apply(self, hyper: Mapping[str, Any], weights: Mapping[str, jax.Array],
              grads: Mapping[str, jax.Array], state: Mapping[str, Any],
              ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """One PopART Adam/Lamb/AdaMax weight update (see the class docstring); pure jnp."""
        import jax.numpy as jnp
        h = self._hyper(hyper)
        self._check_trees(weights, grads)
        ls = h["loss_scaling"]
        t = state["step"] + 1.0
        bias1 = self.mode in ("adam", "lamb", "adamax")
        bias2 = self.mode in ("adam", "lamb")
        l2 = self.weight_decay_mode == "l2_regularization"
        scaled = self.scaled_optimizer_state
        ratio = ls / state["prev_loss_scaling"] if scaled else None

        def step(k: str, w: Any) -> tuple[Any, Callable[[Any], Any]]:
            hk, _ = self._weight_hyper(h, k)
            lr, b1, b2, eps, wd = (hk[n] for n in ("learning_rate", "beta1", "beta2", "eps",
                                                   "weight_decay"))
            ct = _compute_dtype(w.dtype)

            def c(x: Any) -> Any:
                return x.astype(ct)

            w_ = c(w)
            if scaled:  # gradient scaling 1 (no 1/ls), L2 term and eps scaled by ls
                s = c(grads[k])
                if l2:
                    s = s + c(wd * ls) * w_
                eps_ = eps * ls
            else:
                s = c(grads[k]) / c(ls)
                if l2:
                    s = s + c(wd) * w_
                eps_ = eps

            def finish(s: Any) -> Any:
                m_old, v_old = c(state["m"][k]), c(state["v"][k])
                d1, d2 = (c(b1 * ratio), c(b2 * ratio)) if scaled else (c(b1), c(b2))
                m = d1 * m_old + (1.0 - c(b1)) * s
                if self.mode == "adamax":
                    v = jnp.maximum(d2 * v_old, jnp.abs(s))
                else:
                    v = d2 * v_old + (1.0 - c(b2)) * s * s
                mc = m / (1.0 - c(b1) ** c(t)) if bias1 else m
                vc = v / (1.0 - c(b2) ** c(t)) if bias2 else v
                x = mc / ((vc if self.mode == "adamax" else jnp.sqrt(vc)) + c(eps_))
                if not l2:
                    x = x + c(wd) * w_
                rate = c(lr)
                if self.is_lamb:
                    mwn = c(hk["max_weight_norm"])
                    r1 = jnp.sqrt(jnp.sum(w_ * w_))
                    r2 = jnp.sqrt(jnp.sum(x * x))
                    off = (r1 == 0) | (r2 == 0) | (mwn == 0)
                    r = jnp.where(off, 1.0, jnp.minimum(r1, mwn) / jnp.where(r2 == 0, 1.0, r2))
                    rate = rate * r
                return ((w_ - rate * x).astype(w.dtype), m.astype(state["m"][k].dtype),
                        v.astype(state["v"][k].dtype))
            return s, finish

        done = self._apply_split(weights, step)
        new_state = {"step": t.astype(state["step"].dtype),
                     "m": {k: out[1] for k, out in done.items()},
                     "v": {k: out[2] for k, out in done.items()}}
        if scaled:
            new_state["prev_loss_scaling"] = ls.astype(state["prev_loss_scaling"].dtype)
        return {k: out[0] for k, out in done.items()}, new_state

    def popart_values(self) -> dict[str, tuple[float, bool]]:
        """The dict popart.Adam receives: every number as (value, False), changeable by
        updateOptimizerFromHost; defaultMaxWeightNorm only for the lamb modes."""
        values = {
            "defaultLearningRate": (float(self.learning_rate), False),
            "defaultWeightDecay": (float(self.weight_decay), False),
            "defaultBeta1": (float(self.beta1), False),
            "defaultBeta2": (float(self.beta2), False),
            "defaultEps": (float(self.eps), False),
            "lossScaling": (float(self.loss_scaling), False),
        }
        if self.is_lamb:
            values["defaultMaxWeightNorm"] = (float(self.max_weight_norm), False)
        return values

    def to_popart(self, popart: Any) -> Any:
        """``popart.Adam(values, mode=popart.AdamMode.X, weight_decay_mode=
        popart.WeightDecayMode.Y[, clip_norm_settings][, scaled_optimizer_state])``, then
        ``insertSpecific`` per weight with specific values (popart.cpp binding; accl1/accl2
        stay FLOAT)."""
        kwargs: dict[str, Any] = {}
        if self.clip_norm:
            kwargs["clip_norm_settings"] = self._clip_to_popart(popart)
        if self.scaled_optimizer_state:
            kwargs["scaled_optimizer_state"] = True
        opt = popart.Adam(self.popart_values(),
                          mode=getattr(popart.AdamMode, _ADAM_MODES[self.mode]),
                          weight_decay_mode=getattr(popart.WeightDecayMode,
                                                    _DECAY_MODES[self.weight_decay_mode]),
                          **kwargs)
        keys = {"learning_rate": "learningRate", "weight_decay": "weightDecay",
                "beta1": "beta1", "beta2": "beta2", "eps": "eps",
                "max_weight_norm": "maxWeightNorm"}
        for weight in sorted(self.specific):
            v = self._weight(weight)
            opt.insertSpecific(weight, {keys[f]: (float(v[f]), False) for f in keys})
        return opt


class Adaptive(_Optimizer):
    """PopART's adaptive optimizers (``popart.Adaptive``): modes adagrad, rmsprop,
    centered_rmsprop, adadelta (popart.AdaptiveMode), weight decay modes decay and
    l2_regularization, and TensorFlow's RMSProp variant (``rmsprop_tf_variant``, rmsprop and
    centered_rmsprop only). Defaults are PopART's (adaptive.hpp getUnset*): alpha 0.99,
    momentum 0, eps 1e-6, weight decay 0, loss scaling 1.

    Per weight, with g scaled by ls (adaptive.hpp, adaptivedecompose.cpp,
    rmspropupdaterx.cpp, adadeltaupdaterx.cpp, accumulatex.cpp, scaledvarupdatex.cpp)::

        s  = g * (1 / ls)
        s  = s + wd * w                            (l2_regularization only)
        v1 = v1 + s^2                              (adagrad)
        v1 = a * v1 + (1 - a) * s^2                (the others)
        v2 = a * v2 + (1 - a) * s                  (centered_rmsprop)
        x  = s / (sqrt(v1) + eps)                  (adagrad, rmsprop)
        x  = s / (sqrt(v1 - v2^2) + eps)           (centered_rmsprop)
        x  = s / sqrt(v1 + eps)                    (rmsprop, TF variant)
        x  = s / sqrt(v1 - v2^2 + eps)             (centered_rmsprop, TF variant)
        x  = s * sqrt(v2 + eps) / sqrt(v1 + eps)   (adadelta; v2 before its update)
        v2 = a * v2 + (1 - a) * x^2                (adadelta)
        v3 = m * v3 + x                            (with a velocity; TF variant: m * v3 + lr * x)
        w  = w - lr * (wd * w + u)                 (u: v3 with a velocity, else x; wd: decay
                                                    mode only, else 0)
        w  = w - (wd * w + v3)                     (TF variant with a velocity)

    v1 starts at 0 (1 with the TF variant), v2 and v3 at 0. v1 and v2 are float32 (popart's
    accl1_type/accl2_type defaults), x and v3 in the weight's dtype (accl3_type's default).
    A weight has a velocity v3 when its momentum is not 0, or when ``velocity`` is True (PopART
    keeps one for a changeable momentum, even 0). PopART does not clip the gradients of this
    optimizer. Static (:attr:`program_key`): mode, weight_decay_mode, rmsprop_tf_variant and
    each weight's velocity. Runtime (``hyperparameters()``): learning_rate, weight_decay, alpha,
    eps, loss_scaling, and momentum with a velocity.

    The values are taken as given: ``popart.Adaptive`` checks them as PopART does
    (Adaptive::runValueChecks) before it builds this object.
    """

    _PER_WEIGHT: ClassVar[dict[str, str]] = {
        "learning_rate": "float", "weight_decay": "float", "alpha": "float",
        "momentum": "float", "eps": "float", "velocity": "bool"}
    _PREFIX: ClassVar[str] = "adaptive"

    learning_rate: float = Field(description="lr (PopART defaultLearningRate).")
    weight_decay: float = Field(0.0, description="wd (defaultWeightDecay).")
    alpha: float = Field(0.99, description="a (defaultAlpha).")
    momentum: float = Field(0.0, description="m (defaultMomentum); 0: no velocity tensor.")
    eps: float = Field(1e-6, description="eps (defaultEps).")
    loss_scaling: float = Field(1.0, description="ls (lossScaling).")
    mode: Literal["adagrad", "rmsprop", "centered_rmsprop", "adadelta"] = Field(
        "rmsprop", description="popart.AdaptiveMode.")
    weight_decay_mode: Literal["decay", "l2_regularization"] = Field(
        "decay", description="popart.WeightDecayMode.")
    rmsprop_tf_variant: bool = Field(False, description="TensorFlow's RMSProp (eps inside the "
                                                        "square root, v1 from 1, lr in v3).")
    velocity: bool = Field(False, description="Keep a velocity tensor even with momentum 0, as "
                                              "PopART does for a changeable momentum.")

    def _problems(self) -> list[Problem]:
        return self._specific_problems()

    def _value_problems(self, v: Mapping[str, Any], at: tuple[str, ...]) -> list[Problem]:
        return []

    @staticmethod
    def _has_velocity(v: Mapping[str, Any]) -> bool:
        return v["momentum"] != 0 or v["velocity"]

    def _structure(self, v: Mapping[str, Any]) -> tuple[Any, ...]:
        return (self._has_velocity(v),)

    def _reads(self, v: Mapping[str, Any]) -> tuple[str, ...]:
        base = ("learning_rate", "weight_decay", "alpha", "eps")
        return base + ("momentum",) if self._has_velocity(v) else base

    @property
    def program_key(self) -> tuple[Any, ...]:
        """What changes the compiled program; equal keys: only hyperparameters() differ."""
        return ("Adaptive", self.mode, self.weight_decay_mode, self.rmsprop_tf_variant,
                self._has_velocity(self._defaults())) + self._key_extras()

    def _default_hyperparameters(self) -> dict[str, float]:
        v = self._defaults()
        h = {f: float(v[f]) for f in self._reads(v)}
        h["loss_scaling"] = self.loss_scaling
        return h

    def init(self, weights: Mapping[str, jax.Array]) -> dict[str, Any]:
        """{"accl1": {name: v1}} (float32; ones with the TF variant, else zeros), "accl2"
        (float32 zeros, centered_rmsprop and adadelta) and "accl3" (zeros in the weight's dtype,
        for the weights with a velocity)."""
        import jax.numpy as jnp

        def f32(w: Any, fill: float = 0.0) -> jax.Array:
            return jnp.full(jnp.shape(w), fill, _compute_dtype(jnp.result_type(w)))
        state: dict[str, Any] = {"accl1": {k: f32(w, 1.0 if self.rmsprop_tf_variant else 0.0)
                                           for k, w in weights.items()}}
        if self.mode in ("centered_rmsprop", "adadelta"):
            state["accl2"] = {k: f32(w) for k, w in weights.items()}
        state["accl3"] = {k: jnp.zeros_like(w) for k, w in weights.items()
                          if self._has_velocity(self._weight(k))}
        return state

    def apply(self, hyper: Mapping[str, Any], weights: Mapping[str, jax.Array],
              grads: Mapping[str, jax.Array], state: Mapping[str, Any],
              ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """One PopART Adaptive weight update (see the class docstring); pure jnp."""
        import jax.numpy as jnp
        h = self._hyper(hyper)
        self._check_trees(weights, grads)
        ls = h["loss_scaling"]
        tf = self.rmsprop_tf_variant
        decay = self.weight_decay_mode == "decay"
        new_w: dict[str, Any] = {}
        new_state: dict[str, Any] = {key: {} for key in state}
        for k, w in weights.items():
            hk, v = self._weight_hyper(h, k)
            lr, wd, a, eps = hk["learning_rate"], hk["weight_decay"], hk["alpha"], hk["eps"]
            ct = _compute_dtype(w.dtype)

            def c(x: Any, ct: Any = ct) -> Any:
                return x.astype(ct)

            w_ = c(w)
            s = c(grads[k]) * (1.0 / c(ls))                 # gradUnscale: g * gs
            if not decay:
                s = s + c(wd) * w_                           # regularizeL2
            v1 = c(state["accl1"][k])
            v1 = v1 + s * s if self.mode == "adagrad" else c(a) * v1 + (1.0 - c(a)) * s * s
            if self.mode == "adadelta":
                v2_old = c(state["accl2"][k])
                x = s * jnp.sqrt(v2_old + c(eps)) / jnp.sqrt(v1 + c(eps))
            else:
                rms = v1
                if self.mode == "centered_rmsprop":
                    v2 = c(a) * c(state["accl2"][k]) + (1.0 - c(a)) * s
                    rms = v1 - v2 * v2
                x = s / (jnp.sqrt(rms + c(eps)) if tf else jnp.sqrt(rms) + c(eps))
            x = c(x.astype(w.dtype))                          # the updater has the grad's dtype
            if self.mode == "adadelta":
                v2 = c(a) * v2_old + (1.0 - c(a)) * x * x
            if "accl2" in state:
                new_state["accl2"][k] = v2.astype(state["accl2"][k].dtype)
            new_state["accl1"][k] = v1.astype(state["accl1"][k].dtype)
            wd_var = c(wd) if decay else c(jnp.float32(0.0))
            if self._has_velocity(v):
                if tf:                                       # the TF variant's lr * x
                    x = c((c(lr) * x).astype(w.dtype))
                v3 = (c(hk["momentum"]) * c(state["accl3"][k]) + x).astype(
                    state["accl3"][k].dtype)
                new_state["accl3"][k] = v3
                u = c(v3)
            else:
                u = x
            if tf and self._has_velocity(v):                 # ScaledVarUpdate, lr in updater
                new_w[k] = (w_ * (1.0 - wd_var) - u).astype(w.dtype)
            else:
                new_w[k] = (w_ * (1.0 - c(lr) * wd_var) - c(lr) * u).astype(w.dtype)
        return new_w, new_state

    def popart_values(self) -> dict[str, tuple[float, bool]]:
        """The dict popart.Adaptive receives: every number as (value, False), except momentum
        0 without a velocity, (0.0, True)."""
        return {"defaultLearningRate": (float(self.learning_rate), False),
                "defaultWeightDecay": (float(self.weight_decay), False),
                "defaultAlpha": (float(self.alpha), False),
                "defaultMomentum": ((float(self.momentum), False)
                                    if self._has_velocity(self._defaults()) else (0.0, True)),
                "defaultEps": (float(self.eps), False),
                "lossScaling": (float(self.loss_scaling), False)}

    def to_popart(self, popart: Any) -> Any:
        """``popart.Adaptive(values, mode=popart.AdaptiveMode.X, weight_decay_mode=...,
        rmsprop_tf_variant=...)``, then ``insertSpecific`` per weight with specific values."""
        opt = popart.Adaptive(self.popart_values(),
                              mode=getattr(popart.AdaptiveMode, _ADAPTIVE_MODES[self.mode]),
                              weight_decay_mode=getattr(popart.WeightDecayMode,
                                                        _DECAY_MODES[self.weight_decay_mode]),
                              rmsprop_tf_variant=self.rmsprop_tf_variant)
        for weight in sorted(self.specific):
            v = self._weight(weight)
            opt.insertSpecific(weight, {
                "learningRate": (float(v["learning_rate"]), False),
                "weightDecay": (float(v["weight_decay"]), False),
                "alpha": (float(v["alpha"]), False),
                "momentum": ((float(v["momentum"]), False) if self._has_velocity(v)
                             else (0.0, True)),
                "eps": (float(v["eps"]), False)})
        return opt
