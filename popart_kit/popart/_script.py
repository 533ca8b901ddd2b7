"""Run a PopART program unchanged: ``import popart`` resolves to popart_kit.popart, and
``import popdist`` / ``import popdist.popart`` to popart_kit.popdist."""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Sequence


def install_alias() -> None:
    """Make ``import popart`` give popart_kit.popart and ``import popdist`` (with
    ``popdist.popart``) popart_kit.popdist in this process (a test suite's conftest can call
    this; backend "auto" still never takes the alias for the Poplar SDK)."""
    from .. import popart
    from ..popdist import popart as popdist_popart
    from . import session

    sys.modules["popart"] = popart
    sys.modules["popart.session"] = session   # PopART's own submodule, as it names it
    sys.modules["popdist"] = sys.modules[popdist_popart.__package__]
    sys.modules["popdist.popart"] = popdist_popart


def run_script(script: str, args: Sequence[str] = ()) -> int:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *args]`` and the alias; the
    script's directory comes first on sys.path, as ``python SCRIPT`` would put it."""
    if not os.path.isfile(script):
        print(f"popart-kit run: no such script {script!r}", file=sys.stderr)
        return 2
    install_alias()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        return exit_status(done.code)
    except BaseException as error:  # noqa: BLE001 - reported as python SCRIPT reports it
        _print_from_script(error, script)
        return 130 if isinstance(error, KeyboardInterrupt) else 1
    return 0


def _print_from_script(error: BaseException, script: str) -> None:
    """The traceback ``python SCRIPT`` prints: from the script's first frame (the launcher's
    own frames - this module, runpy, the command line - left out)."""
    path = os.path.abspath(script)
    tb = error.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != path:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb or error.__traceback__)


def exit_status(code: object) -> int:
    """The status ``python SCRIPT`` exits with after ``sys.exit(code)``: 0 for None, an integer
    as is, else 1 after printing ``code`` to stderr (``sys.exit("message")``)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
