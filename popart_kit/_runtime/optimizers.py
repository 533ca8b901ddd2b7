"""PopART's SGD and Adam optimizers: typed settings, PopART's update equations in pure JAX.

Each optimizer is a frozen pydantic model that validates its numbers (every error names the
field, the number and the fix), builds the ``popart.SGD`` / ``popart.Adam`` object with PopART's
own Python constructor (:meth:`to_popart`), and implements PopART's weight update functionally
for the JAX reference runtime::

    hyper = {k: jnp.asarray(v, jnp.float32) for k, v in opt.hyperparameters().items()}
    state = opt.init(weights)
    weights, state = opt.apply(hyper, weights, grads, state)      # pure jnp; jit/scan-safe

Every number PopART treats as a changeable ``OptimizerValue`` is an entry of ``hyper``, a runtime
value: a new learning rate, momentum, ... reaches a compiled program as data, without
recompiling. What changes the program is static and summarised by :attr:`program_key`: two
optimizers with equal keys run the same compiled program with different ``hyper``.

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
willow/src/popx/op/adam{updater,varupdate}x.cpp, python/popart/popart_core/popart.cpp.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from .._base.problems import Problem, raise_errors
from .._config.fields import _Model
from ..errors import ConfigError, ConfigTypeError

if TYPE_CHECKING:  # the update maths imports JAX only when a session runs it
    import jax

__all__ = ["SGD", "Adam", "SGD_VALUE_KEYS", "ADAM_VALUE_KEYS"]

#: Keys popart.SGD's dict accepts (willow/src/sgd.cpp SGD::getComplete).
SGD_VALUE_KEYS = ("defaultLearningRate", "defaultWeightDecay", "defaultMomentum",
                  "defaultDampening", "defaultVelocityScaling", "lossScaling", "nesterov")
#: Keys popart.Adam's dict accepts (willow/src/adam.cpp Adam::getComplete; "maxWeightNorm" is a
#: deprecated alias of "defaultMaxWeightNorm").
ADAM_VALUE_KEYS = ("defaultLearningRate", "defaultWeightDecay", "defaultBeta1", "defaultBeta2",
                   "defaultEps", "lossScaling", "defaultMaxWeightNorm", "maxWeightNorm")

_ADAM_MODES = {"adam": "Adam", "adam_no_bias": "AdamNoBias", "adamax": "AdaMax",
               "lamb": "Lamb", "lamb_no_bias": "LambNoBias"}
_DECAY_MODES = {"decay": "Decay", "l2_regularization": "L2Regularization"}


def _compute_dtype(dtype: Any) -> Any:
    """float32 for float16/bfloat16/float32 weights, float64 for float64 ones."""
    import jax.numpy as jnp
    return jnp.promote_types(dtype, jnp.float32)


_FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max


class _Optimizer(_Model):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    def __init__(self, learning_rate: Any = None, /, **data: Any) -> None:
        # SGD(0.1, momentum=0.9) as well as SGD(learning_rate=0.1, ...)
        if learning_rate is not None:
            if "learning_rate" in data:
                raise ConfigTypeError(f"{type(self).__name__}: learning_rate given both by "
                                      f"position and by keyword. Fix: give it once.",
                                      rule="K-optimizer-arguments")
            data["learning_rate"] = learning_rate
        super().__init__(**data)

    # -- validation helpers -------------------------------------------------------------------

    @staticmethod
    def _finite(problems: list[Problem], name: str, value: float, prefix: str) -> bool:
        """Whether ``value`` is finite in float32, the dtype the update is computed in."""
        if math.isfinite(value) and abs(value) <= _FLOAT32_MAX:
            return True
        why = ("is not a finite number" if not math.isfinite(value) else
               f"is not finite in float32, the dtype the update is computed in (largest "
               f"{_FLOAT32_MAX:.7g}): it would become {'-' if value < 0 else ''}inf")
        problems.append(Problem(name, f"{name}={value!r} {why}.",
                                f"give {name} a value of magnitude at most {_FLOAT32_MAX:.7g}.",
                                f"K-{prefix}-finite", involved={name: value}))
        return False

    def _problems(self) -> list[Problem]:  # pragma: no cover - overridden
        return []

    @model_validator(mode="after")
    def _check(self) -> _Optimizer:
        raise_errors(type(self).__name__, self._problems())
        return self

    # -- shared API ---------------------------------------------------------------------------

    def hyperparameters(self) -> dict[str, float]:  # pragma: no cover - overridden
        raise NotImplementedError

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

    @staticmethod
    def _check_trees(weights: Mapping[str, Any], grads: Mapping[str, Any]) -> None:
        if set(weights) != set(grads):
            raise ConfigError(f"apply: weights {sorted(weights)} and grads {sorted(grads)} name "
                              f"different tensors. Fix: pass one gradient per weight.",
                              rule="K-optimizer-trees")


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

    Static (part of :attr:`program_key`): whether momentum is 0 (PopART: momentum const 0 means
    SGD0), ``nesterov`` (PopART enables it only with momentum > 0 and dampening 0) and
    ``accumulator_and_momentum``. Runtime (``hyperparameters()``): learning_rate, dampening,
    weight_decay, loss_scaling, plus momentum and velocity_scaling when momentum > 0.
    """

    learning_rate: float = Field(description="lr (PopART defaultLearningRate).")
    momentum: float = Field(0.0, description="mm (defaultMomentum); 0: no velocity tensor.")
    dampening: float = Field(0.0, description="dm (defaultDampening).")
    weight_decay: float = Field(0.0, description="wd (defaultWeightDecay).")
    nesterov: bool = Field(False, description="Nesterov momentum (PopART key 'nesterov').")
    velocity_scaling: float = Field(1.0, description="vs (defaultVelocityScaling).")
    loss_scaling: float = Field(1.0, description="ls (lossScaling).")
    accumulator_and_momentum: Literal["combined", "separate"] = Field(
        "combined", description="popart.SGDAccumulatorAndMomentum; PopART's default: combined.")

    def _problems(self) -> list[Problem]:
        p: list[Problem] = []
        f = self._finite
        if f(p, "learning_rate", self.learning_rate, "sgd") and self.learning_rate <= 0:
            p.append(Problem("learning_rate", f"learning_rate={self.learning_rate!r} is not "
                             f"positive.", "use a learning rate > 0, e.g. 0.01.", "K-sgd-lr",
                             involved={"learning_rate": self.learning_rate}))
        if f(p, "momentum", self.momentum, "sgd") and not 0 <= self.momentum < 1:
            p.append(Problem("momentum", f"momentum={self.momentum!r} is outside [0, 1); "
                             f"the velocity would not decay.", "use a momentum in [0, 1), e.g. "
                             "0.9, or 0 for none.", "K-sgd-momentum",
                             involved={"momentum": self.momentum}))
        if f(p, "dampening", self.dampening, "sgd") and not 0 <= self.dampening <= 1:
            p.append(Problem("dampening", f"dampening={self.dampening!r} is outside [0, 1].",
                             "use a dampening in [0, 1], usually 0.", "K-sgd-dampening",
                             involved={"dampening": self.dampening}))
        if f(p, "weight_decay", self.weight_decay, "sgd") and self.weight_decay < 0:
            p.append(Problem("weight_decay", f"weight_decay={self.weight_decay!r} is negative.",
                             "use a weight decay >= 0, e.g. 1e-4, or 0 for none.",
                             "K-sgd-weight-decay", involved={"weight_decay": self.weight_decay}))
        if f(p, "velocity_scaling", self.velocity_scaling, "sgd") and self.velocity_scaling <= 0:
            p.append(Problem("velocity_scaling", f"velocity_scaling={self.velocity_scaling!r} "
                             f"is not positive (PopART refuses it).", "use a velocity scaling "
                             "> 0, 1 for none.", "K-sgd-velocity-scaling",
                             involved={"velocity_scaling": self.velocity_scaling}))
        if f(p, "loss_scaling", self.loss_scaling, "sgd") and self.loss_scaling <= 0:
            p.append(Problem("loss_scaling", f"loss_scaling={self.loss_scaling!r} is not "
                             f"positive.", "use a loss scaling > 0, 1 for none.",
                             "K-sgd-loss-scaling", involved={"loss_scaling": self.loss_scaling}))
        if self.nesterov and self.momentum == 0:
            p.append(Problem("nesterov", "nesterov=True with momentum=0.0: PopART silently "
                             "ignores Nesterov without momentum.", "set a momentum > 0, e.g. "
                             "0.9, or nesterov=False.", "K-sgd-nesterov-momentum",
                             involved={"nesterov": True, "momentum": self.momentum}))
        if self.nesterov and self.dampening != 0:
            p.append(Problem("nesterov", f"nesterov=True with dampening={self.dampening!r}: "
                             f"PopART requires dampening 0 with Nesterov momentum.",
                             "set dampening=0.0, or nesterov=False.",
                             "K-sgd-nesterov-dampening",
                             involved={"nesterov": True, "dampening": self.dampening}))
        return p

    # -- structure ----------------------------------------------------------------------------

    @property
    def has_velocity(self) -> bool:
        """PopART SGD1/SGD2 (a velocity tensor per weight) rather than SGD0."""
        return self.momentum != 0

    @property
    def program_key(self) -> tuple[Any, ...]:
        """What changes the compiled program; equal keys: only hyperparameters() differ."""
        if not self.has_velocity:
            return ("SGD", "no_momentum")
        return ("SGD", self.accumulator_and_momentum, self.nesterov)

    def hyperparameters(self) -> dict[str, float]:
        h = {"learning_rate": self.learning_rate, "dampening": self.dampening,
             "weight_decay": self.weight_decay, "loss_scaling": self.loss_scaling}
        if self.has_velocity:
            h["momentum"] = self.momentum
            h["velocity_scaling"] = self.velocity_scaling
        return h

    # -- functional update --------------------------------------------------------------------

    def init(self, weights: Mapping[str, jax.Array]) -> dict[str, Any]:
        """{} without momentum, else {"velocity": {name: v}} in each weight's dtype: zeros
        (Separate) or ``(1 - dm) * wd * vs * w0`` (Combined, sgd1decompose.cpp
        addAcclInTensor)."""
        import jax.numpy as jnp
        if not self.has_velocity:
            return {}
        if self.accumulator_and_momentum == "separate":
            return {"velocity": {k: jnp.zeros_like(w) for k, w in weights.items()}}
        swd1 = (1.0 - self.dampening) * self.weight_decay * self.velocity_scaling
        return {"velocity": {k: (jnp.asarray(w, _compute_dtype(jnp.result_type(w))) * swd1)
                             .astype(jnp.result_type(w)) for k, w in weights.items()}}

    def apply(self, hyper: Mapping[str, Any], weights: Mapping[str, jax.Array],
              grads: Mapping[str, jax.Array], state: Mapping[str, Any],
              ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """One PopART SGD weight update (see the class docstring); pure jnp."""
        h = self._hyper(hyper)
        self._check_trees(weights, grads)
        lr, dm, wd, ls = h["learning_rate"], h["dampening"], h["weight_decay"], h["loss_scaling"]
        new_w: dict[str, jax.Array] = {}
        if not self.has_velocity:
            wdsf0 = 1.0 - lr * (1.0 - dm) * wd          # WeightDecayScaleFactor0Helper
            slr0 = lr * (1.0 - dm) / ls                 # ScaledLearningRate0Helper
            for k, w in weights.items():
                ct = _compute_dtype(w.dtype)
                new_w[k] = (w.astype(ct) * wdsf0.astype(ct)
                            - slr0.astype(ct) * grads[k].astype(ct)).astype(w.dtype)
            return new_w, {}

        mm, vs = h["momentum"], h["velocity_scaling"]
        swd1 = (1.0 - dm) * wd * vs                     # ScaledWeightDecay1Helper
        dpsf = (1.0 - dm) * vs / ls                     # DampeningScaleFactor{1,2}Helper
        slr = lr / vs                                   # ScaledLearningRate{1,2}Helper
        combined = self.accumulator_and_momentum == "combined"
        new_v: dict[str, jax.Array] = {}
        for k, w in weights.items():
            ct = _compute_dtype(w.dtype)
            w_ = w.astype(ct)
            g_ = grads[k].astype(ct)
            v_ = state["velocity"][k].astype(ct)
            if combined:   # SGD1: accumulate the gradient into the precomputed velocity
                v_ = v_ + dpsf.astype(ct) * g_
            else:          # SGD2: partial accl update (mm, wd) then accumulate the gradient
                v_ = mm.astype(ct) * v_ + swd1.astype(ct) * w_ + dpsf.astype(ct) * g_
            if self.nesterov:   # SGD1NesterovOp: ngsf * (1/ls * g + wd * w) + mm * v
                upd = vs.astype(ct) * (g_ / ls.astype(ct) + wd.astype(ct) * w_) \
                    + mm.astype(ct) * v_
            else:
                upd = v_
            w_new = (w_ - slr.astype(ct) * upd).astype(w.dtype)
            if combined:   # SGD1AcclUpdateOp, after the weight update: v = smm1*v + swd1*w'
                v_ = mm.astype(ct) * v_ + swd1.astype(ct) * w_new.astype(ct)
            new_w[k] = w_new
            new_v[k] = v_.astype(state["velocity"][k].dtype)
        return new_w, {"velocity": new_v}

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

    def to_popart(self, popart: Any) -> Any:
        """``popart.SGD(values[, accumulatorAndMomentum=Separate])`` (popart.cpp binding)."""
        kwargs = {}
        if self.accumulator_and_momentum == "separate":
            kwargs["accumulatorAndMomentum"] = popart.SGDAccumulatorAndMomentum.Separate
        return popart.SGD(self.popart_values(), **kwargs)


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

    m and v are float32 (popart.Adam's accl1_type/accl2_type defaults), t a float32 counter.
    Static (:attr:`program_key`): mode and weight_decay_mode. Runtime (``hyperparameters()``):
    learning_rate, beta1, beta2, eps, weight_decay, loss_scaling, and max_weight_norm for the
    lamb modes.
    """

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

    def _problems(self) -> list[Problem]:
        p: list[Problem] = []
        f = self._finite
        if f(p, "learning_rate", self.learning_rate, "adam") and self.learning_rate <= 0:
            p.append(Problem("learning_rate", f"learning_rate={self.learning_rate!r} is not "
                             f"positive.", "use a learning rate > 0, e.g. 1e-3.", "K-adam-lr",
                             involved={"learning_rate": self.learning_rate}))
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if f(p, name, value, "adam") and not 0 <= value < 1:
                p.append(Problem(name, f"{name}={value!r} is outside [0, 1); the moment would "
                                 f"not decay (and 1 - {name}^t would be 0).",
                                 f"use a {name} in [0, 1), e.g. "
                                 f"{0.9 if name == 'beta1' else 0.999}.", f"K-adam-{name}",
                                 involved={name: value}))
        if f(p, "eps", self.eps, "adam") and self.eps <= 0:
            p.append(Problem("eps", f"eps={self.eps!r} is not positive (PopART refuses it).",
                             "use an eps > 0, e.g. 1e-6 (PopART's default).", "K-adam-eps",
                             involved={"eps": self.eps}))
        if f(p, "weight_decay", self.weight_decay, "adam") and self.weight_decay < 0:
            p.append(Problem("weight_decay", f"weight_decay={self.weight_decay!r} is negative.",
                             "use a weight decay >= 0, e.g. 0.01, or 0 for none.",
                             "K-adam-weight-decay", involved={"weight_decay": self.weight_decay}))
        if f(p, "loss_scaling", self.loss_scaling, "adam") and self.loss_scaling <= 0:
            p.append(Problem("loss_scaling", f"loss_scaling={self.loss_scaling!r} is not "
                             f"positive.", "use a loss scaling > 0, 1 for none.",
                             "K-adam-loss-scaling", involved={"loss_scaling": self.loss_scaling}))
        if f(p, "max_weight_norm", self.max_weight_norm, "adam") and self.max_weight_norm < 0:
            p.append(Problem("max_weight_norm", f"max_weight_norm={self.max_weight_norm!r} is "
                             f"negative.", "use a max weight norm >= 0 (0 disables Lamb's trust "
                             "ratio), e.g. 10.", "K-adam-max-weight-norm",
                             involved={"max_weight_norm": self.max_weight_norm}))
        return p

    @property
    def is_lamb(self) -> bool:
        return self.mode in ("lamb", "lamb_no_bias")

    @property
    def program_key(self) -> tuple[Any, ...]:
        """What changes the compiled program; equal keys: only hyperparameters() differ."""
        return ("Adam", self.mode, self.weight_decay_mode)

    def hyperparameters(self) -> dict[str, float]:
        h = {"learning_rate": self.learning_rate, "beta1": self.beta1, "beta2": self.beta2,
             "eps": self.eps, "weight_decay": self.weight_decay,
             "loss_scaling": self.loss_scaling}
        if self.is_lamb:
            h["max_weight_norm"] = self.max_weight_norm
        return h

    def init(self, weights: Mapping[str, jax.Array]) -> dict[str, Any]:
        """{"step": float32 0, "m": {name: zeros}, "v": {name: zeros}} (m, v float32)."""
        import jax.numpy as jnp
        def zeros(w: Any) -> jax.Array:
            return jnp.zeros(jnp.shape(w), _compute_dtype(jnp.result_type(w)))
        return {"step": jnp.zeros((), jnp.float32),
                "m": {k: zeros(w) for k, w in weights.items()},
                "v": {k: zeros(w) for k, w in weights.items()}}

    def apply(self, hyper: Mapping[str, Any], weights: Mapping[str, jax.Array],
              grads: Mapping[str, jax.Array], state: Mapping[str, Any],
              ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """One PopART Adam/Lamb/AdaMax weight update (see the class docstring); pure jnp."""
        import jax.numpy as jnp
        h = self._hyper(hyper)
        self._check_trees(weights, grads)
        lr, b1, b2, eps = h["learning_rate"], h["beta1"], h["beta2"], h["eps"]
        wd, ls = h["weight_decay"], h["loss_scaling"]
        t = state["step"] + 1.0
        bias1 = self.mode in ("adam", "lamb", "adamax")
        bias2 = self.mode in ("adam", "lamb")
        l2 = self.weight_decay_mode == "l2_regularization"
        new_w, new_m, new_v = {}, {}, {}
        for k, w in weights.items():
            ct = _compute_dtype(w.dtype)

            def c(x: Any, ct: Any = ct) -> Any:
                return x.astype(ct)

            w_ = c(w)
            s = c(grads[k]) / c(ls)
            if l2:
                s = s + c(wd) * w_
            m = c(b1) * c(state["m"][k]) + (1.0 - c(b1)) * s
            if self.mode == "adamax":
                v = jnp.maximum(c(b2) * c(state["v"][k]), jnp.abs(s))
            else:
                v = c(b2) * c(state["v"][k]) + (1.0 - c(b2)) * s * s
            mc = m / (1.0 - c(b1) ** c(t)) if bias1 else m
            vc = v / (1.0 - c(b2) ** c(t)) if bias2 else v
            x = mc / ((vc if self.mode == "adamax" else jnp.sqrt(vc)) + c(eps))
            if not l2:
                x = x + c(wd) * w_
            step = c(lr)
            if self.is_lamb:
                mwn = c(h["max_weight_norm"])
                r1 = jnp.sqrt(jnp.sum(w_ * w_))
                r2 = jnp.sqrt(jnp.sum(x * x))
                off = (r1 == 0) | (r2 == 0) | (mwn == 0)
                ratio = jnp.where(off, 1.0, jnp.minimum(r1, mwn) / jnp.where(r2 == 0, 1.0, r2))
                step = step * ratio
            new_w[k] = (w_ - step * x).astype(w.dtype)
            new_m[k] = m.astype(state["m"][k].dtype)
            new_v[k] = v.astype(state["v"][k].dtype)
        return new_w, {"step": t.astype(state["step"].dtype), "m": new_m, "v": new_v}

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
        popart.WeightDecayMode.Y)`` (popart.cpp binding; accl1/accl2 stay FLOAT)."""
        return popart.Adam(self.popart_values(),
                           mode=getattr(popart.AdamMode, _ADAM_MODES[self.mode]),
                           weight_decay_mode=getattr(popart.WeightDecayMode,
                                                     _DECAY_MODES[self.weight_decay_mode]))
