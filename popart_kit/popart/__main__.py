"""``python -m popart_kit.popart SCRIPT [ARGS]``: run a PopART program on popart_kit."""

import sys

from ._script import run_script

if len(sys.argv) < 2:
    print("usage: python -m popart_kit.popart SCRIPT [ARGS...]", file=sys.stderr)
    sys.exit(2)
sys.exit(run_script(sys.argv[1], sys.argv[2:]))
