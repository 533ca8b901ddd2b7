"""popart.Builder: the kit's Builder with PopART's constructor keywords."""

from __future__ import annotations

from typing import Any

from .._model.builder import Builder as _KitBuilder
from ._core import popart_exception, popart_text


class Builder(_KitBuilder):
    """popart.Builder(modelProtoOrFilename=None, opsets=None, builderCore=None). Loading an
    existing model into a Builder is not offered: build it here, or give the model to a
    session directly."""

    def __init__(self, modelProtoOrFilename: Any = None, opsets: dict[str, int] | None = None,
                 builderCore: Any = None) -> None:
        if modelProtoOrFilename is not None or builderCore is not None:
            raise popart_exception("popart.Builder(modelProtoOrFilename): popart_kit's Builder "
                                   "cannot edit an existing model. Fix: pass the model to the "
                                   "session as fnModel, or rebuild it with Builder().")
        try:
            super().__init__(opsets)
        except ValueError as err:
            raise popart_exception(popart_text(err)) from None
