"""Host data for PopART runs: arrays per step, per replica and per instance.

:class:`StepIOFactory` knows, from a SessionConfig and the tensors' specs, the exact host array
of every input and anchor (shapes.py), makes them, checks them (stricter than PopART, which only
counts elements on the first run), reshapes sample streams into them without copying, takes one
instance's share of globally laid-out data, and hands them to PopART's PyStepIO or, one
micro-batch per replica at a time, to PyStepIOCallback.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base.problems import Problem, raise_errors, warn
from .._base.shapes import (
    AnchorReturnType,
    anchor_leading_factors,
    anchor_shape,
    input_shape,
    leading_factors,
)
from ..errors import DataError, DataTypeError, short

if TYPE_CHECKING:
    from .._config.session_config import SessionConfig

__all__ = ["TensorSpec", "StepIOFactory", "RunBatches", "CallbackFeeder"]

# PopART data type names (TensorInfo strings) for the dtypes host arrays may have.
_POPART_DTYPES = {"FLOAT": "float32", "FLOAT16": "float16", "DOUBLE": "float64",
                  "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
                  "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
                  "BOOL": "bool"}


def _dtype(value: Any) -> np.dtype:
    if isinstance(value, str) and value.upper() in _POPART_DTYPES:
        return np.dtype(_POPART_DTYPES[value.upper()])
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biuf":
        raise DataError(f"unknown dtype {short(value)}: host tensors are numbers or booleans. Fix: "
                         f"a numpy dtype ('float32', np.int32) or a PopART type name "
                         f"({', '.join(_POPART_DTYPES)}).")
    return dtype


@dataclass(frozen=True, init=False)
class TensorSpec:
    """One tensor's shape per micro-batch and replica (``S``), its dtype, and whether it is a
    Broadcast input (one host value for every replica)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    broadcast: bool

    def __init__(self, shape: Sequence[int], dtype: Any = "float32",
                 broadcast: bool = False) -> None:
        if not isinstance(shape, Sequence) or isinstance(shape, str):
            raise DataTypeError(f"TensorSpec shape {short(shape)} must be a sequence of "
                                f"non-negative integers.", rule="K-stepio-spec")
        dims = tuple(shape)
        if any(isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 0 for d in dims):
            raise DataError(f"TensorSpec shape {short(shape)} must hold non-negative integers.",
                            rule="K-stepio-spec")
        object.__setattr__(self, "shape", tuple(int(d) for d in dims))
        object.__setattr__(self, "dtype", _dtype(dtype))
        object.__setattr__(self, "broadcast", bool(broadcast))

    @property
    def nelms(self) -> int:
        return math.prod(self.shape)


def _spec(value: Any) -> TensorSpec:
    """A TensorSpec from itself, a ``(shape, dtype)`` pair or a bare shape (float32)."""
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Sequence):
        return TensorSpec(*value)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return TensorSpec(value)
    raise DataError(f"expected a TensorSpec, (shape, dtype) or a shape, got {short(value)}.")


def _problem(kind: str, name: str, message: str, fix: str, rule: str, popart: str = "",
             **involved: Any) -> Problem:
    """A problem with input or anchor ``name``; the message is completed with that name
    (``popart``: PopART's own words for it, which popart_kit.popart raises)."""
    noun = {"inputs": "input", "anchors": "anchor", "out": "out"}[kind]
    return Problem((kind, name), f"{noun} {name!r} {message}", fix, rule, involved=involved,
                   popart=popart)


_AXIS_NAMES = {"batches_per_step": "bps", "batches_per_step/N": "bps/N",
               "accumulation_factor": "A", "replication_factor": "R"}


def _layout(factors: Sequence[tuple[str, int]], shape: Sequence[int]) -> str:
    lead = ", ".join(f"{_AXIS_NAMES[k]}={v}" for k, v in factors)
    full = tuple(v for _, v in factors) + tuple(shape)
    return f"[{lead}] + S={tuple(shape)} = {full}" if factors else f"S={tuple(shape)}"


def _shape_mismatch(factors: Sequence[tuple[str, int]], spec_shape: Sequence[int],
                    given: tuple[int, ...]) -> str:
    """Which leading factor or tensor dimension of ``given`` is wrong, and what each should be."""
    expected = tuple(v for _, v in factors) + tuple(spec_shape)
    names = [k for k, _ in factors] + [f"tensor dim {i}" for i in range(len(spec_shape))]
    if len(given) == len(expected):
        wrong = [f"axis {i} ({names[i]}) is {g}, expected {e}"
                 for i, (g, e) in enumerate(zip(given, expected, strict=True)) if g != e]
        why = "; ".join(wrong)
    elif len(given) < len(expected):
        missing = [f"{names[i]} ({expected[i]})" for i in range(len(expected))
                   if expected[:i] + expected[i + 1:] == given]
        why = (f"the {' or the '.join(missing)} axis is missing"
               if missing else f"rank {len(given)}, expected {len(expected)}")
    else:
        lead = given[:len(given) - len(spec_shape)]
        stripped = tuple(d for d in lead if d != 1) + given[len(lead):]
        why = ("leading factors equal to 1 are left out of PopART's layout"
               if stripped == expected else f"rank {len(given)}, expected {len(expected)}")
    same_size = math.prod(given) == math.prod(expected)
    return (f"has shape {given}: {why}; expected {_layout(factors, spec_shape)}"
            + (" (same number of elements: PopART would read it in that layout, so reshape it "
               "if that is what it holds)" if same_size and given != expected else ""))


def _array_problems(kind: str, name: str, array: Any, spec: TensorSpec,
                    factors: Sequence[tuple[str, int]], *, check_shape: bool = True,
                    writable: bool = False, exact_dtype: bool = False) -> list[Problem]:
    if not isinstance(array, np.ndarray):
        return [_problem(kind, name, f"is a {type(array).__name__}, not a numpy array.",
                         "pass np.ndarray values.", "K-stepio-type")]
    out = []
    expected = tuple(v for _, v in factors) + spec.shape
    if check_shape and array.shape != expected:
        out.append(_problem(kind, name, _shape_mismatch(factors, spec.shape, array.shape) + ".",
                            f"give an array of shape {expected}.", "K-stepio-shape",
                            shape=array.shape))
    # PyStepIO converts host int64 into an int32 tensor; nothing else converts, and the
    # callback path copies raw bytes, so there the dtype must match exactly.
    converts = kind == "inputs" and spec.dtype == np.int32 and not exact_dtype
    if array.dtype != spec.dtype and not (converts and array.dtype == np.int64):
        out.append(_problem(
            kind, name, f"has dtype {array.dtype}, expected {spec.dtype} (PopART accepts only the "
                        f"tensor's own dtype" + (", or int64 for int32" if converts else "")
                        + ").", f"array.astype(np.{spec.dtype}).", "K-stepio-dtype",
            dtype=str(array.dtype)))
    if not array.flags.c_contiguous:
        out.append(_problem(kind, name, "is not C-contiguous: PopART's PyStepIO refuses it.",
                            "np.ascontiguousarray(array) (copies it).", "K-stepio-contiguous"))
    if writable and not array.flags.writeable:
        out.append(_problem(kind, name, "is read-only: PopART writes anchors in place.",
                            "pass a writable array (allocate_anchors() makes them).",
                            "K-stepio-readonly"))
    return out


def _name_problems(kind: str, given: Iterable[str], known: Mapping[str, Any]) -> list[Problem]:
    if not isinstance(given, Mapping):
        return [Problem(kind, f"{kind} must map tensor names to numpy arrays, got "
                              f"{type(given).__name__}.", "pass a dict.", "K-stepio-type")]
    given = list(given)
    wrong = [n for n in given if not isinstance(n, str)]
    if wrong:
        return [Problem(kind, f"{kind} names must be str, got {short(wrong)}.",
                        "key the arrays by tensor name.", "K-stepio-type")]
    out = [_problem(kind, n, "is missing.", f"provide every one of {', '.join(known)}.",
                    "K-stepio-missing") for n in known if n not in given]
    out += [_problem(kind, n, f"is not one of this session's {kind} ({', '.join(known)}).",
                     "remove it, or declare it when building the StepIOFactory.",
                     "K-stepio-unknown") for n in given if n not in known]
    return out


def _require_mapping(title: str, kind: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise DataTypeError(f"{title}: {kind} must map tensor names to numpy arrays, got "
                            f"{type(value).__name__}. Fix: pass a dict.", rule="K-stepio-type")


# The factors are asked for on every check of every run: keep the few combinations computed.
_leading_factors = functools.lru_cache(maxsize=256)(leading_factors)

_LAYOUTS_KEPT = 64  # input layouts a factory remembers as accepted (then it starts again)


def _layout_key(arrays: Mapping[str, Any], *flags: bool) -> tuple | None:
    """Everything :meth:`StepIOFactory.check_inputs` looks at, as a hashable key: each
    name with its array's shape, dtype and strides (which say whether it is C-contiguous);
    None where a value is not exactly a numpy array: such values are checked in full every
    time."""
    key: list[Any] = list(flags)
    for name, array in arrays.items():
        if type(array) is not np.ndarray:
            return None
        key.append((name, array.shape, array.dtype, array.strides))
    return tuple(key)


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary (numpy's own start on 16;
    XLA on CPU copies an input that is not aligned to 64 before a run reads it)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class StepIOFactory:
    """Host arrays of a session's inputs and anchors, shaped for one run of this instance."""

    def __init__(self, config: SessionConfig,
                 inputs: Mapping[str, TensorSpec | tuple] | None = None,
                 anchors: Mapping[str, tuple[TensorSpec | tuple, Any]] | None = None) -> None:
        from .._config.session_config import SessionConfig

        wrong = []
        if not isinstance(config, SessionConfig):
            wrong.append(f"config must be a pk.SessionConfig, got {type(config).__name__}")
        for what, table in (("inputs", inputs), ("anchors", anchors)):
            if table is not None and not isinstance(table, Mapping):
                wrong.append(f"{what} must map tensor names to specs, got {type(table).__name__}")
            elif table and not all(isinstance(n, str) for n in table):
                bad = [n for n in table if not isinstance(n, str)]
                wrong.append(f"{what} names must be str, got {short(bad)}")
        if wrong:
            raise DataTypeError("StepIOFactory: " + "; ".join(wrong) + ".",
                                rule="K-stepio-type")
        self.config = config
        self._accepted: set[tuple] = set()  # input layouts check_inputs accepted
        # inputs used as indices: {name: size indexed}; random inputs stay below it
        self.index_sizes: dict[str, int] = {}
        problems: list[Problem] = []
        self.inputs: dict[str, TensorSpec] = {}
        for name, spec in (inputs or {}).items():
            try:
                self.inputs[name] = _spec(spec)
            except (ValueError, TypeError) as err:
                problems.append(_problem("inputs", name, str(err), "give TensorSpec(shape, dtype).",
                                         "K-stepio-spec"))
        self.anchors: dict[str, tuple[TensorSpec, AnchorReturnType]] = {}
        bps = config.batches_per_step
        for name, entry in (anchors or {}).items():
            try:
                spec, art = entry
                spec, art = _spec(spec), AnchorReturnType.of(art)
            except (ValueError, TypeError) as err:
                problems.append(_problem("anchors", name, str(err),
                                         "give (TensorSpec, return type).", "K-stepio-spec"))
                continue
            if (why := art.batches_per_step_problem(bps)) is not None:
                problems.append(_problem("anchors", name, *why, "V46", period=art.period))
            elif art.name == "EveryN" and config.pipeline.enabled:
                problems.append(_problem("anchors", name,
                                         "is EveryN, which is not valid for pipelined models.",
                                         "use All, Final or Sum, or disable pipelining.", "V14",
                                         "AnchorReturnType::EVERYN is not valid for pipelined "
                                         "models"))
            elif art.name == "EveryN" and config.popart_options.get("enableExplicitMainLoops"):
                problems.append(_problem("anchors", name,
                                         "is EveryN, which explicit main loops do not support.",
                                         "use All, Final or Sum, or drop "
                                         "enableExplicitMainLoops.", "V13"))
            else:
                self.anchors[name] = (spec, art)
        raise_errors("StepIOFactory", problems)

    # -- numbers ------------------------------------------------------------------------------

    @property
    def _bps(self) -> int:
        return self.config.batches_per_step

    @property
    def _accumulation(self) -> int:
        return self.config.accumulation.factor

    @property
    def _replicas(self) -> int:
        return self.config.replication.local_factor

    def _input_factors(self, spec: TensorSpec, replicas: int | None = None
                       ) -> tuple[tuple[str, int], ...]:
        """Named leading factors of an input's arrays (R, or G when ``replicas`` is given)."""
        return _leading_factors(self._bps, self._accumulation,
                                self._replicas if replicas is None else replicas, spec.broadcast)

    def _anchor_factors(self, art: AnchorReturnType) -> tuple[tuple[str, int], ...]:
        return anchor_leading_factors(art, self._bps, self._accumulation, self._replicas)

    def _known_input(self, name: str) -> TensorSpec:
        try:
            return self.inputs[name]
        except KeyError:
            raise KeyError(f"{name!r} is not an input of this session "
                           f"({', '.join(self.inputs) or 'none'}).") from None

    def input_shape(self, name: str) -> tuple[int, ...]:
        spec = self._known_input(name)
        return input_shape(spec.shape, self._bps, self._accumulation, self._replicas,
                           spec.broadcast)

    def anchor_shape(self, name: str) -> tuple[int, ...]:
        if name not in self.anchors:
            raise KeyError(f"{name!r} is not an anchor of this session "
                           f"({', '.join(self.anchors) or 'none'}).")
        spec, art = self.anchors[name]
        return anchor_shape(spec.shape, art, self._bps, self._accumulation, self._replicas)

    # -- making arrays --------------------------------------------------------------------------

    def allocate_inputs(self, fill: str = "zeros", seed: int = 0) -> dict[str, np.ndarray]:
        """One run's input arrays, zeros or random: standard-normal floats, random bools, and
        integers in ``0 .. n-1`` where ``n`` is ``index_sizes[name]`` when the input is an index
        (a session fills ``index_sizes`` from the model: class labels of Nll,
        NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss, indices of Gather,
        GatherElements and ScatterElements), else ``0 .. 9``. Each array's data starts on a
        64-byte boundary, where XLA on CPU reads an input without copying it first."""
        if fill not in ("zeros", "random"):
            raise DataError(f"fill={fill!r}: use 'zeros' or 'random'.")
        rng = np.random.default_rng(seed)
        out = {}
        for name, spec in self.inputs.items():
            shape = self.input_shape(name)
            out[name] = array = _aligned_empty(shape, spec.dtype)
            if fill == "zeros":
                array[...] = 0
            elif spec.dtype == np.bool_:
                array[...] = rng.integers(0, 2, shape).astype(np.bool_)
            elif np.issubdtype(spec.dtype, np.integer):
                high = min(10, self.index_sizes.get(name, 10))
                array[...] = rng.integers(0, max(high, 1), shape).astype(spec.dtype)
            else:
                array[...] = rng.standard_normal(shape).astype(spec.dtype)
        return out

    def allocate_anchors(self) -> dict[str, np.ndarray]:
        """Zeroed anchor arrays, as PopART's initAnchorArrays shapes them."""
        return {name: np.zeros(self.anchor_shape(name), spec.dtype)
                for name, (spec, _) in self.anchors.items()}

    def from_samples(self, samples: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Arrays of one run's micro-batches in PopART's order (batch, then accumulation step,
        then replica, then the tensor) as canonical arrays: views, never copies."""
        _require_mapping("StepIOFactory.from_samples", "inputs", samples)
        problems = _name_problems("inputs", samples, self.inputs)
        out = {}
        for name, array in samples.items():
            spec = self.inputs.get(name)
            if spec is None:
                continue
            factors = self._input_factors(spec)
            found = _array_problems("inputs", name, array, spec, factors, check_shape=False)
            if not found:
                micro_batches = math.prod(v for _, v in factors)
                need = micro_batches * spec.nelms
                row = spec.shape[1:]  # one sample: trailing axes must match S without its first
                if array.size != need or (row and array.shape[-len(row):] != row):
                    product = " × ".join(f"{_AXIS_NAMES[k]}={v}" for k, v in factors)
                    found.append(_problem(
                        "inputs", name,
                        f"has shape {array.shape} ({array.size} elements); one run needs "
                        f"{product + ' × ' if product else ''}nelms(S={spec.shape})={spec.nelms}"
                        f" = {need} elements" + (f", ending in axes {row}" if row else "") + ".",
                        f"pass exactly {micro_batches} micro-batches of {spec.shape} (e.g. "
                        f"shape {self._samples_shape(spec, micro_batches)}).",
                        "K-stepio-size", size=array.size))
            problems += found
            if not found:
                out[name] = array.reshape(self.input_shape(name))
        raise_errors("StepIOFactory.from_samples", problems)
        return out

    @staticmethod
    def _samples_shape(spec: TensorSpec, micro_batches: int) -> tuple[int, ...]:
        """The shape of one run's samples stacked along the micro-batch axis."""
        if not spec.shape:
            return (micro_batches,)
        return (micro_batches * spec.shape[0],) + spec.shape[1:]

    # -- checking -----------------------------------------------------------------------------

    def check_inputs(self, arrays: Mapping[str, Any], *, exact_dtype: bool = False,
                     require_all: bool = True) -> None:
        """Refuse (one ValueError listing every problem) inputs PopART would misread or reject:
        missing or unknown names, wrong shape (which axis, and each factor), dtype, layout.

        What is checked depends only on the arrays' layout - names, shapes, dtypes,
        contiguity - so a layout accepted once is remembered and a later run with the same
        layout costs a lookup; a layout that was refused is never remembered, so it is refused
        again, with the same error, every time."""
        if type(arrays) is not dict:
            _require_mapping("StepIOFactory.check_inputs", "inputs", arrays)
        key = _layout_key(arrays, exact_dtype, require_all)
        if key is not None and key in self._accepted:
            return
        problems = _name_problems("inputs", arrays, self.inputs if require_all else {
            n: s for n, s in self.inputs.items() if n in arrays})
        for name, array in arrays.items():
            if name in self.inputs:
                spec = self.inputs[name]
                problems += _array_problems("inputs", name, array, spec,
                                            self._input_factors(spec), exact_dtype=exact_dtype)
        raise_errors("StepIOFactory.check_inputs", problems)
        if key is not None:
            if len(self._accepted) >= _LAYOUTS_KEPT:
                self._accepted.clear()
            self._accepted.add(key)

    def check_anchors(self, arrays: Mapping[str, Any]) -> None:
        """The same for anchor arrays, which must also be writable."""
        _require_mapping("StepIOFactory.check_anchors", "anchors", arrays)
        problems = _name_problems("anchors", arrays, self.anchors)
        for name, array in arrays.items():
            if name in self.anchors:
                spec, art = self.anchors[name]
                problems += _array_problems("anchors", name, array, spec,
                                            self._anchor_factors(art), writable=True)
        raise_errors("StepIOFactory.check_anchors", problems)

    # -- replicas and instances ---------------------------------------------------------------

    def _replica_axis(self, spec: TensorSpec, replicas: int | None = None) -> int | None:
        """Axis of R (or of G, given ``replicas``) in an input's arrays; None when there is none
        (that factor is 1, or a Broadcast input)."""
        names = [k for k, _ in self._input_factors(spec, replicas)]
        return names.index("replication_factor") if "replication_factor" in names else None

    def shard(self, global_arrays: Mapping[str, np.ndarray],
              out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """This instance's C-contiguous share of inputs laid out for all G global replicas
        (``[bps, A, G, *S]``): replicas global_offset .. global_offset + R - 1.

        A share is copied into fresh memory, or into ``out`` (this instance's arrays, e.g. from
        allocate_inputs) to reuse buffers run after run; a share that is already contiguous is
        returned as a view when no ``out`` is given."""
        _require_mapping("StepIOFactory.shard", "inputs", global_arrays)
        if out is not None:
            _require_mapping("StepIOFactory.shard", "out", out)
        rep = self.config.replication
        total = rep.global_replicas
        problems = _name_problems("inputs", global_arrays, self.inputs)
        for name, array in global_arrays.items():
            if name in self.inputs:
                spec = self.inputs[name]
                problems += _array_problems("inputs", name, array, spec,
                                            self._input_factors(spec, total))
        if out is not None:
            problems += _name_problems("out", out, {n: s for n, s in self.inputs.items()
                                                    if n in global_arrays})
            problems += [p for name, array in out.items() if name in self.inputs
                         for p in _array_problems("out", name, array, self.inputs[name],
                                                  self._input_factors(self.inputs[name]),
                                                  writable=True, exact_dtype=True)]
        raise_errors("StepIOFactory.shard", problems)
        shares = {}
        for name, array in global_arrays.items():
            spec = self.inputs[name]
            share = array
            if not (spec.broadcast or total == rep.local_factor):
                axis = self._replica_axis(spec, total)
                index: Any = (slice(rep.global_offset, rep.global_offset + rep.local_factor)
                              if rep.local_factor > 1 else rep.global_offset)
                share = array[(slice(None),) * axis + (index, Ellipsis)]  # Ellipsis: 0-d stays
            if out is not None:
                np.copyto(out[name], share)
                shares[name] = out[name]
            else:
                shares[name] = share if share.flags.c_contiguous else share.copy(order="C")
        return shares

    def replica(self, arrays: Mapping[str, np.ndarray], r: int) -> dict[str, np.ndarray]:
        """Views of what local replica ``r`` receives at each (batch, accumulation step)."""
        try:
            index = None if isinstance(r, bool) else operator.index(r)
        except TypeError:
            index = None
        if index is None or not 0 <= index < self._replicas:
            raise DataError(f"replica {short(r)} does not exist: this instance runs "
                             f"{self._replicas} local replica(s), 0..{self._replicas - 1}.")
        r = index
        self.check_inputs(arrays, require_all=False)
        out = {}
        for name, array in arrays.items():
            axis = self._replica_axis(self.inputs[name])
            out[name] = array if axis is None else array[(slice(None),) * axis + (r, Ellipsis)]
        return out

    def batches(self, dataset: Iterable[Any] | Mapping[str, Any]) -> RunBatches:
        """Group a stream of samples into per-run input dicts for this instance.

        Each sample is ``{input name: array of shape S[1:]}`` (or, with one input, the array);
        ``S[0]`` is the micro-batch size. ``dataset`` may also be columns, ``{input name: array
        of samples along axis 0}``, which runs slice instead of stacking sample by sample. A run
        takes bps × A × G × micro-batch samples, laid out in PopART's order over all G global
        replicas, of which this instance keeps its share.
        Samples that do not fill a last run are dropped and counted in ``.dropped``.
        """
        return RunBatches(self, dataset)

    # -- PopART -------------------------------------------------------------------------------

    def stepio(self, inputs: Mapping[str, np.ndarray], anchors: Mapping[str, np.ndarray],
               popart: Any = None) -> Any:
        """A ``popart.PyStepIO`` over checked arrays (needs the Poplar SDK)."""
        from .._config.mapping import import_popart

        self.check_inputs(inputs)
        self.check_anchors(anchors)
        popart = import_popart() if popart is None else popart
        return popart.PyStepIO(inputs=dict(inputs), outputs=dict(anchors))

    def stepio_callback(self, inputs: Mapping[str, np.ndarray],
                        anchors: Mapping[str, np.ndarray], popart: Any = None) -> Any:
        """A ``popart.PyStepIOCallback`` that feeds one micro-batch per replica per call."""
        from .._config.mapping import import_popart

        feeder = self.feeder(inputs, anchors)
        popart = import_popart() if popart is None else popart
        return popart.PyStepIOCallback(
            input_callback=feeder.input, input_complete_callback=feeder.input_complete,
            output_callback=feeder.output, output_complete_callback=feeder.output_complete)

    def feeder(self, inputs: Mapping[str, np.ndarray],
               anchors: Mapping[str, np.ndarray]) -> CallbackFeeder:
        """The callbacks behind :meth:`stepio_callback`, over checked arrays (the callback path
        copies raw bytes, so dtypes must match exactly)."""
        self.check_inputs(inputs, exact_dtype=True)
        self.check_anchors(anchors)
        feeds = {name: _blocks(array, self.inputs[name].shape,
                               self._input_factors(self.inputs[name]))
                 for name, array in inputs.items()}
        slots = {name: _blocks(array, self.anchors[name][0].shape,
                               self._anchor_factors(self.anchors[name][1]))
                 for name, array in anchors.items()}
        return CallbackFeeder(feeds, slots)


def _blocks(array: np.ndarray, shape: tuple[int, ...],
            factors: Sequence[tuple[str, int]]) -> list[np.ndarray]:
    """Views of each (micro-batch, replica) block in PopART's order; scalars as shape (1,),
    because PopART reads a 0-d array from a callback as "no data"."""
    count = math.prod(v for _, v in factors)
    return list(array.reshape((count,) + (shape or (1,))))


class CallbackFeeder:
    """PopART's callback protocol over host arrays: inputs are handed out micro-batch-major,
    replica-minor, one C-contiguous view per call; anchors are written into views likewise.
    Like PyStepIO it wraps around at the end, so the same arrays serve run after run."""

    def __init__(self, feeds: Mapping[str, list[np.ndarray]],
                 slots: Mapping[str, list[np.ndarray]]) -> None:
        self._feeds, self._slots = dict(feeds), dict(slots)
        self._next_in = dict.fromkeys(self._feeds, 0)
        self._next_out = dict.fromkeys(self._slots, 0)

    def _lookup(self, table: Mapping[str, list[np.ndarray]], name: str, kind: str
                ) -> list[np.ndarray]:
        try:
            return table[name]
        except KeyError:
            raise KeyError(f"PopART asked for {kind} {name!r}, which this StepIO does not hold "
                           f"({', '.join(table) or 'none'}).") from None

    def input(self, name: str, prefetch: bool) -> np.ndarray | None:
        blocks = self._lookup(self._feeds, name, "input")
        return blocks[self._next_in[name] % len(blocks)]

    def input_complete(self, name: str) -> None:
        self._lookup(self._feeds, name, "input")
        self._next_in[name] += 1

    def output(self, name: str) -> np.ndarray:
        slots = self._lookup(self._slots, name, "anchor")
        return slots[self._next_out[name] % len(slots)]

    def output_complete(self, name: str) -> None:
        self._lookup(self._slots, name, "anchor")
        self._next_out[name] += 1

    @property
    def remaining(self) -> dict[str, int]:
        """Blocks of the current run not yet consumed (inputs) or written (anchors); after
        whole runs every count is back to its full size."""
        return ({n: len(b) - self._next_in[n] % len(b) for n, b in self._feeds.items()}
                | {n: len(s) - self._next_out[n] % len(s) for n, s in self._slots.items()})


class RunBatches(Iterator[dict[str, np.ndarray]]):
    """Per-run input dicts made from a stream of samples; ``dropped`` counts the samples left
    over at the end (a warning says so too)."""

    def __init__(self, factory: StepIOFactory,
                 dataset: Iterable[Any] | Mapping[str, Any]) -> None:
        problems = [_problem("inputs", n, "is a Broadcast input, which one sample per replica "
                                          "cannot feed.", "build its arrays yourself.",
                             "K-stepio-broadcast-batches")
                    for n, s in factory.inputs.items() if s.broadcast]
        problems += [_problem("inputs", n, f"has shape {s.shape} without a micro-batch axis.",
                              "give every input a leading micro-batch dimension.",
                              "K-stepio-no-batch-axis")
                     for n, s in factory.inputs.items() if not s.shape]
        raise_errors("StepIOFactory.batches", problems)
        sizes = {s.shape[0] for s in factory.inputs.values()}
        if len(sizes) > 1:
            raise DataError(f"inputs disagree on the micro-batch size (first dimension): "
                             f"{ {n: s.shape[0] for n, s in factory.inputs.items()} }. Fix: give "
                             f"every input the same leading dimension.")
        cfg = factory.config
        self.micro_batch_size = sizes.pop() if sizes else 0
        if self.micro_batch_size < 1:
            raise DataError("batches() needs at least one input, each with a micro-batch axis "
                             "of at least 1 sample (S[0]).")
        self.samples_per_run = (cfg.batches_per_step * cfg.accumulation.factor
                                * cfg.replication.global_replicas * self.micro_batch_size)
        self._factory = factory
        self._columns: dict[str, np.ndarray] | None = None
        if isinstance(dataset, Mapping):  # columns: {input name: samples along axis 0}
            self._columns = _columns(dataset, factory.inputs)
            self._samples = iter(())
        else:
            try:
                self._samples = iter(dataset)
            except TypeError:
                raise DataTypeError(f"batches() takes an iterable of samples or a mapping of "
                                    f"columns, got a {type(dataset).__name__} "
                                    f"({short(dataset)}). Fix: pass a list, generator or "
                                    f"dataset that yields one sample at a time, or "
                                    f"{{input name: array of samples}}.",
                                    rule="K-stepio-sample") from None
        self.runs = 0
        self.dropped = 0
        self._done = False

    def _sample(self, index: int, raw: Any) -> Mapping[str, Any]:
        names = self._factory.inputs
        if not isinstance(raw, Mapping):
            if len(names) == 1:
                return {next(iter(names)): raw}
            raise DataTypeError(f"sample {index} of this run is a {type(raw).__name__}; a sample "
                                f"must map input names ({', '.join(names)}) to arrays.",
                                rule="K-stepio-sample")
        missing = [n for n in names if n not in raw]
        if missing:
            raise DataError(f"sample {index} of this run has no {', '.join(map(repr, missing))} "
                            f"(it has {short(list(raw))}). Fix: give every sample every input "
                            f"({', '.join(names)}).", rule="K-stepio-sample")
        return raw

    def _drop(self, count: int, why: str) -> None:
        self.dropped += count
        if count:
            warn(f"{count} samples {why} and were dropped ({self.dropped} in all).")

    def _next_columns(self, columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = self.runs * self.samples_per_run
        left = len(next(iter(columns.values()))) - start
        if left < self.samples_per_run:
            self._done = True
            self._drop(left, f"at the end of the dataset do not fill a run of "
                             f"{self.samples_per_run}")
            raise StopIteration
        run = self._finish({name: column[start:start + self.samples_per_run]
                            for name, column in columns.items()})
        self.runs += 1
        return run

    def __next__(self) -> dict[str, np.ndarray]:
        if self._done:
            raise StopIteration
        if self._columns is not None:
            return self._next_columns(self._columns)
        taken: list[Any] = []
        try:
            for raw in self._samples:
                taken.append(raw)
                if len(taken) == self.samples_per_run:
                    break
        except Exception:
            self._done = True
            self._drop(len(taken), "taken before the dataset raised an error")
            raise
        if len(taken) < self.samples_per_run:
            self._done = True
            self._drop(len(taken), f"at the end of the dataset do not fill a run of "
                                   f"{self.samples_per_run}")
            raise StopIteration
        try:
            run = self._assemble(taken)
        except Exception:
            self._drop(len(taken), "could not be made into a run")
            raise
        self.runs += 1
        return run

    def _assemble(self, taken: list[Any]) -> dict[str, np.ndarray]:
        samples = [self._sample(i, raw) for i, raw in enumerate(taken)]
        blocks = {}
        for name, spec in self._factory.inputs.items():
            try:
                arrays = [np.asarray(s[name]) for s in samples]
                _refuse_non_numbers(name, arrays)
                blocks[name] = np.stack(arrays)
            except ValueError as err:
                if isinstance(err, DataError):
                    raise
                shapes = sorted({_shape_of(s[name]) for s in samples}, key=str)
                raise DataError(f"input {name!r}: samples of different shapes {short(shapes)}, "
                                f"expected {spec.shape[1:]}. Fix: yield one sample at a time, "
                                f"each of shape S[1:].", rule="K-stepio-sample") from None
        return self._finish(blocks)

    def _finish(self, blocks: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A run's samples per input (``[samples, *S[1:]]``) checked, cast and laid out in
        PopART's order, this instance's share."""
        factory = self._factory
        stacked = {}
        for name, spec in factory.inputs.items():
            block = blocks[name]
            if block.shape[1:] != spec.shape[1:]:
                raise DataError(f"input {name!r}: samples of shape {block.shape[1:]}, expected "
                                f"{spec.shape[1:]} (S={spec.shape} without its micro-batch "
                                f"axis). Fix: yield one sample at a time.",
                                rule="K-stepio-sample")
            block = _cast_exactly(name, block, spec.dtype)
            stacked[name] = block.reshape(input_shape(
                spec.shape, factory._bps, factory._accumulation,
                factory.config.replication.global_replicas))
        return factory.shard(stacked)


def _columns(dataset: Mapping[str, Any], inputs: Mapping[str, TensorSpec]
             ) -> dict[str, np.ndarray]:
    """A columnar dataset, ``{input name: array of samples along axis 0}``, checked: every
    input present, numbers, the same number of samples in each."""
    missing = [n for n in inputs if n not in dataset]
    if missing:
        raise DataError(f"the dataset has no column {', '.join(map(repr, missing))} (it has "
                        f"{short(list(dataset))}). Fix: give every input its column.",
                        rule="K-stepio-sample")
    columns = {name: np.asarray(dataset[name]) for name in inputs}
    for name, column in columns.items():
        _refuse_non_numbers(name, [column])
        if column.ndim == 0:
            raise DataError(f"column {name!r} is a scalar. Fix: give an array of samples "
                            f"(samples along axis 0).", rule="K-stepio-sample")
    lengths = {name: len(column) for name, column in columns.items()}
    if len(set(lengths.values())) > 1:
        raise DataError(f"the dataset's columns hold different numbers of samples: "
                        f"{short(lengths)}. Fix: one row per sample in every column.",
                        rule="K-stepio-sample")
    return columns


def _refuse_non_numbers(name: str, arrays: list[np.ndarray]) -> None:
    """Samples are numbers (bool, integer, float, complex): the first that is not - text,
    records, objects, dates - is refused, naming its index and dtype."""
    for i, array in enumerate(arrays):
        if array.dtype.kind not in "biufc":
            raise DataTypeError(f"input {name!r}: sample {i} of this run is of dtype "
                                f"{short(str(array.dtype))}, not numbers. Fix: yield numeric "
                                f"arrays (e.g. float32) for every sample.",
                                rule="K-stepio-sample")


def _shape_of(value: Any) -> tuple[int, ...] | str:
    """``value``'s array shape, or "ragged" where its nested sequences differ in length."""
    try:
        return np.shape(value)
    except ValueError:
        return "ragged"


def _cast_exactly(name: str, block: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``block`` as ``dtype`` when no value changes kind or leaves the range of ``dtype``:
    float -> int never, integers only when every value is kept, floats only when no finite
    value overflows to infinity (rounding to the nearest ``dtype`` value is kept)."""
    if block.dtype == dtype:
        return block
    if not np.can_cast(block.dtype, dtype, "same_kind"):
        raise DataError(f"input {name!r}: samples of dtype {block.dtype} do not fit {dtype} "
                        f"without changing values (a change of kind). Fix: yield samples of "
                        f"dtype {dtype}.",
                        rule="K-stepio-cast")
    with np.errstate(over="ignore", invalid="ignore"):
        converted = block.astype(dtype)
    if dtype.kind in "biu":
        changed = converted != block
    else:
        changed = np.isfinite(block) & ~np.isfinite(converted)
    if np.any(changed):
        bad = block[changed]
        raise DataError(f"input {name!r}: samples of dtype {block.dtype} do not fit {dtype} "
                        f"without changing values: {bad.size} would change "
                        f"({short(bad.ravel()[:5].tolist())}). Fix: yield samples of dtype "
                        f"{dtype} within its range.",
                        rule="K-stepio-cast")
    return converted
