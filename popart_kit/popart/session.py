"""``popart.session``: PopART's session module - the sessions and the error prepareDevice
raises when a program does not fit (programs import ``popart.session.OutOfMemoryException``)."""

from ._core import OutOfMemoryException
from ._session import InferenceSession, TrainingSession

__all__ = ["InferenceSession", "TrainingSession", "OutOfMemoryException"]
