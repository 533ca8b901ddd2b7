"""The xla backend's whole operator table: :data:`OPS` from :mod:`.ops` with every family module
that registers more operators into it imported. Read the table from here."""

from .ops import OPS

__all__ = ["OPS"]
