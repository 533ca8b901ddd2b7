"""popart.Builder: the kit's Builder with PopART's constructor keywords, and ``aiOnnx``
behind the checks of PopART's Python binding: arguments of the wrong type or number are a
TypeError in pybind11's words, and a second ai.onnx opset a RuntimeError in PopART's."""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Sequence
from numbers import Real
from typing import Any

import onnx

from .._model.builder import Builder as _KitBuilder
from .._model.layout import load_model
from .._model.onnx_ops import OpSignature
from ._core import popart_exception, popart_text

_A = onnx.AttributeProto
#: How pybind11 names each attribute's C++ type in a signature (popart_core's AiOnnxOpsetN).
_TYPE_NAMES = {_A.INT: "int", _A.FLOAT: "float", _A.STRING: "str", _A.INTS: "List[int]",
               _A.FLOATS: "List[float]", _A.STRINGS: "List[str]", _A.TENSOR: "numpy.ndarray"}


def _is_int(value: Any) -> bool:
    """pybind11's int64 caster: an int or an object with __index__, never a float."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _is_float(value: Any) -> bool:
    """pybind11's float caster (converting): any real number."""
    return isinstance(value, Real) or (hasattr(value, "__float__") and not isinstance(value, str))


def _is_list(value: Any, item: Any) -> bool:
    """pybind11's list caster: a sequence (not text) whose items each convert."""
    return (isinstance(value, Sequence) and not isinstance(value, str | bytes)
            and all(item(v) for v in value))


def _is_str(value: Any) -> bool:
    return isinstance(value, str | bytes)


_CHECKS = {_A.INT: _is_int, _A.FLOAT: _is_float, _A.STRING: _is_str,
           _A.INTS: lambda v: _is_list(v, _is_int), _A.FLOATS: lambda v: _is_list(v, _is_float),
           _A.STRINGS: lambda v: _is_list(v, _is_str)}


def _pybind_signature(op: OpSignature, version: int) -> str:
    """The one overload pybind11 lists for ``op``: (self: ..., name: type = default) -> ret."""
    params = [f"self: popart_core.AiOnnxOpset{version}"]
    types = {name: (kind, required) for name, kind, required, _ in op.attributes}
    for p in op.signature.parameters.values():
        if p.name == "debugContext":
            text = "debugContext: popart_core.DebugContext = ''"
        elif p.name == "args":
            text = "args: List[str]"
        elif p.name == "num_outputs":
            text = "num_outputs: int"
        elif p.name == "value":
            text = "value: numpy.ndarray"
        elif p.name == "is_value_sparse":
            text = "is_value_sparse: bool = False"
        elif (op.op_type, p.name) == ("Cast", "to"):
            text = "to: str"
        else:
            kind, _ = types.get(p.name, (None, True))
            type_ = _TYPE_NAMES.get(kind, "object")
            if p.default is p.empty:
                text = f"{p.name}: {type_}"
            elif p.default is None:
                text = f"{p.name}: Optional[{type_}] = None"
            else:
                text = f"{p.name}: {type_} = {p.default!r}"
        params.append(text)
    returns = "List[str]" if op.returns_list else "str"
    return f"({', '.join(params)}) -> {returns}"


def _incompatible(name: str, op: OpSignature, version: int, args: tuple, kwargs: dict) -> str:
    """pybind11's TypeError text for a call no overload takes."""
    given = [f"<popart_core.AiOnnxOpset{version} object>", *map(repr, args),
             *(f"{k}={v!r}" for k, v in kwargs.items())]
    return (f"{name}(): incompatible function arguments. The following argument types are "
            f"supported:\n    1. {_pybind_signature(op, version)}\n\nInvoked with: "
            f"{', '.join(given)}")


def _binds(op: OpSignature, args: tuple, kwargs: dict) -> bool:
    """Whether pybind11 would take these arguments: their number and each one's type."""
    try:
        bound = op.signature.bind(*args, **kwargs)
    except TypeError:
        return False
    kinds = {name: kind for name, kind, _, _ in op.attributes}
    for name, value in bound.arguments.items():
        if name == "args":
            ok = _is_list(value, _is_str)
        elif name == "debugContext":
            ok = isinstance(value, str)
        elif name in ("num_outputs",):
            ok = _is_int(value)
        elif name == "is_value_sparse":
            ok = isinstance(value, bool)
        elif (op.op_type, name) == ("Cast", "to"):  # PopART takes the DataType's name
            ok = isinstance(value, str)
        elif name in kinds:
            check = _CHECKS.get(kinds[name])
            default = op.signature.parameters[name].default
            ok = check is None or check(value) or (value is None and default is None)
        else:
            ok = True
        if not ok:
            return False
    return True


class AiOnnx:
    """``builder.aiOnnx`` of popart.Builder (PopART's AiOnnxN, which prints as ``AiOnnxN``):
    the kit's operators of the builder's opset, each call checked as pybind11 checks it."""

    def __init__(self, opset: Any) -> None:
        self._opset = opset
        self.version = opset.version

    def __str__(self) -> str:
        return f"AiOnnx{self.version}"

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._opset, name)
        op = self._opset._ops.get(name)
        if op is None:  # If, Loop, Scan: their own checks
            return method
        return functools.partial(self._call, name, op, method)

    def _call(self, name: str, op: OpSignature, method: Any, *args: Any, **kwargs: Any) -> Any:
        if not _binds(op, args, kwargs):
            raise TypeError(_incompatible(name, op, self.version, args, kwargs))
        return method(*args, **kwargs)

    def __dir__(self) -> list[str]:
        return dir(self._opset)


def _check_external_files(source: Any) -> None:
    """BuilderImpl::loadModelProto runs onnx's checker on the parsed model, which looks for
    each external data file at its location from the working directory: a missing one is
    the checker's ValidationError, a RuntimeError in PopART's binding."""
    try:
        if isinstance(source, bytes | bytearray):
            model = onnx.load_from_string(bytes(source))
        elif isinstance(source, str | os.PathLike) and os.path.isfile(source):
            model = onnx.load(os.fspath(source), load_external_data=False)
        else:
            return
    except Exception:  # noqa: BLE001 - load_model reports what cannot be read
        return
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if location and not os.path.isfile(location):
            raise RuntimeError(f"Data of TensorProto ( tensor name: {tensor.name}) should be "
                               f"stored in {location}, but it doesn't exist or is not "
                               f"accessible.")


class Builder(_KitBuilder):
    """popart.Builder(modelProtoOrFilename=None, opsets=None, builderCore=None): a new model,
    or an existing one (its bytes or a path) to extend. ``builderCore`` (PopART's C++ object)
    has no meaning here and is refused."""

    def __init__(self, modelProtoOrFilename: Any = None, opsets: dict[str, int] | None = None,
                 builderCore: Any = None) -> None:
        if builderCore is not None:
            raise popart_exception("popart.Builder(builderCore=...): there is no C++ builder "
                                   "core in popart_kit. Fix: leave builderCore out.")
        #: the ai.onnx opset comes from a loaded model, not from Python (``opsets=``)
        self._opset_of_model = modelProtoOrFilename is not None and not opsets
        try:
            super().__init__(opsets)
            if modelProtoOrFilename is not None:
                _check_external_files(modelProtoOrFilename)
                model = load_model(modelProtoOrFilename, popart_external=True)
                onnx.checker.check_model(model)   # PopART's loadModelProto checks it
                self._load(model)
        except (ValueError, onnx.checker.ValidationError) as err:
            raise popart_exception(popart_text(err)) from None

    def _choose_onnx(self, version: int) -> Any:
        """python/popart/python_files/builder.py Builder.__getattr__: once an ai.onnx opset is
        chosen, another one is a RuntimeError; where a loaded model's opset_import chose it,
        BuilderImpl::addOp refuses the op (builder_impl.cpp:705, a popart_exception)."""
        if self._chosen_onnx is not None and version != self._chosen_onnx:
            if self._opset_of_model:
                raise popart_exception(f"Invalid opset {version} used to add an operation. "
                                       f"Opset for domain ai.onnx already defined as "
                                       f"{self._chosen_onnx}")
            raise RuntimeError(f"Invalid opset 'aiOnnxOpset{version}' selected. Opset for "
                               f"domain ai.onnx already defined as {self._chosen_onnx}")
        return AiOnnx(super()._choose_onnx(version))
