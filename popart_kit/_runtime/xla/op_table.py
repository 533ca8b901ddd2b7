"""The xla backend's whole operator table: :data:`OPS` from :mod:`.ops` with every family module
that registers more operators into it imported. Read the table from here."""

from . import (  # noqa: F401 - they register
    ops_control,
    ops_conv,
    ops_graphcore,
    ops_graphcore_nn,
    ops_print,
    ops_random,
    ops_resize,
    ops_rnn,
)
from .ops import OPS

__all__ = ["OPS"]
