import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests/strategies.py

# Give JAX its virtual CPU devices before any test initialises it, as a session would.
from popart_kit.backends.xla.placement import ensure_host_devices  # noqa: E402

ensure_host_devices()
