import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests/strategies.py

# The suite's compiled programs go to a cache of its own, shared by the processes it starts and
# removed at the end, never to the user's cache.
if "POPART_KIT_COMPILATION_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="popart_kit_test_cache_")
    os.environ["POPART_KIT_COMPILATION_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# The suite runs on CPU, whatever accelerator the host has: its tests of devices, delegation
# and memory are about JAX's 8 virtual CPU devices. JAX_PLATFORMS=cuda (say) runs it on a GPU,
# where those tests fail by design.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Give JAX its virtual CPU devices before any test initialises it, as a session would.
from popart_kit._runtime.xla.placement import ensure_host_devices

ensure_host_devices()
