"""popart.Builder: the kit's Builder with PopART's constructor keywords."""

from __future__ import annotations

from typing import Any

import onnx

from .._model.builder import Builder as _KitBuilder
from .._model.layout import load_model
from ._core import popart_exception, popart_text


class Builder(_KitBuilder):
    """popart.Builder(modelProtoOrFilename=None, opsets=None, builderCore=None): a new model,
    or an existing one (its bytes or a path) to extend. ``builderCore`` (PopART's C++ object)
    has no meaning here and is refused."""

    def __init__(self, modelProtoOrFilename: Any = None, opsets: dict[str, int] | None = None,
                 builderCore: Any = None) -> None:
        if builderCore is not None:
            raise popart_exception("popart.Builder(builderCore=...): there is no C++ builder "
                                   "core in popart_kit. Fix: leave builderCore out.")
        try:
            super().__init__(opsets)
            if modelProtoOrFilename is not None:
                model = load_model(modelProtoOrFilename)
                onnx.checker.check_model(model)   # PopART's loadModelProto checks it
                self._load(model)
        except (ValueError, onnx.checker.ValidationError) as err:
            raise popart_exception(popart_text(err)) from None
