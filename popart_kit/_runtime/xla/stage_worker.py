"""What a pipeline stage's worker, a thread or a process (``stage_processes.py``), shares with
the executor: the board stages pass values on, and whether this process is a stage worker."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Board", "STAGE_WORKER"]

#: Set in a stage worker process: its one device stands for every stage.
STAGE_WORKER = False


class Board:
    """Values passed between the workers: put once, taken once."""

    def __init__(self) -> None:
        self._values: dict[Any, Any] = {}
        self._ready = threading.Condition()
        self.failed: BaseException | None = None

    def put(self, key: Any, value: Any) -> None:
        with self._ready:
            self._values[key] = value
            self._ready.notify_all()

    def take(self, key: Any) -> Any:
        with self._ready:
            while key not in self._values:
                if self.failed is not None:
                    raise RuntimeError("another stage failed") from self.failed
                self._ready.wait(0.5)
            return self._values.pop(key)

    def fail(self, error: BaseException) -> None:
        """Stop the run: every take raises from now on. The first failure is the one kept."""
        with self._ready:
            if self.failed is None:
                self.failed = error
            self._ready.notify_all()
