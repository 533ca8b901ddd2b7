"""The persistent compilation cache: entries prove what they are for, untrusted directories are
refused, and the cache is bounded. Each test runs fresh processes on a cache of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from popart_kit._runtime.xla.compilation_cache import (
    CACHE_VARIABLE,
    MAX_BYTES_VARIABLE,
    MIN_SECONDS_VARIABLE,
    VerifiedCache,
)

# Runs programs p<n>(x) = 3x + n for the numbers given as arguments, each printing its result.
PROGRAMS = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("always")
    from popart_kit._runtime.xla.placement import ensure_host_devices
    ensure_host_devices()
    ensure_host_devices()  # as a second session would: a warning comes once
    import jax, jax.numpy as jnp
    for n in map(int, sys.argv[1:]):
        def program(x, n=n):
            return x * 3 + n
        program.__name__ = f"p{n}"
        print(n, jax.jit(program)(jnp.arange(3.0)).tolist())
""")


def expected(*numbers: int) -> str:
    return "".join(f"{n} {[3.0 * i + n for i in range(3)]}\n" for n in numbers)


def run(cache, *numbers: int, script: str = PROGRAMS, named: bool = True, **settings: str):
    """Run ``script`` on ``numbers`` in a fresh process, with ``cache`` as the cache directory
    (not ``named``: the default one, under ``XDG_CACHE_HOME`` = ``cache``'s sibling xdg);
    ``settings``: MAX and MIN (the bound, the minimum compile time). Returns the result."""
    env = {k: v for k, v in os.environ.items()
           if k not in (CACHE_VARIABLE, MAX_BYTES_VARIABLE, MIN_SECONDS_VARIABLE)}
    env["XDG_CACHE_HOME"] = str(cache.parent / "xdg")  # never the user's cache
    if named:
        env[CACHE_VARIABLE] = str(cache)
    names = {"MAX": MAX_BYTES_VARIABLE, "MIN": MIN_SECONDS_VARIABLE}
    env.update({names[k]: v for k, v in settings.items()})
    result = subprocess.run([sys.executable, "-c", script, *map(str, numbers)],
                            capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected(*numbers), result.stderr
    return result


def entry(cache, name: str):
    """The one cache file of program ``name``."""
    (found,) = cache.glob(f"jit_{name}-*")
    return found


def test_swapped_entries_give_the_right_results_and_are_rewritten(tmp_path):
    cache = tmp_path / "cache"
    run(cache, 1, 2, MIN="0")
    one, two = entry(cache, "p1"), entry(cache, "p2")
    first, second = one.read_bytes(), two.read_bytes()
    one.write_bytes(second)
    two.write_bytes(first)
    result = run(cache, 1, 2, MIN="0")  # p1 from p2's executable would print p2's numbers
    assert one.read_bytes() != second and two.read_bytes() != first
    assert "Warning" not in result.stderr


@pytest.mark.parametrize("damage", [lambda data: b"", lambda data: data[:len(data) // 2]],
                         ids=["empty", "truncated"])
def test_a_broken_entry_is_rewritten(tmp_path, damage):
    cache = tmp_path / "cache"
    run(cache, 1, MIN="0")
    file = entry(cache, "p1")
    broken = damage(file.read_bytes())
    file.write_bytes(broken)
    result = run(cache, 1, MIN="0")
    assert file.stat().st_size > len(broken)
    assert "Warning" not in result.stderr  # JAX's "Error reading ... cache entry" included
    assert "Warning" not in run(cache, 1, MIN="0").stderr  # and the next process finds it whole


def chmod(mode):
    return lambda path: path.chmod(mode)


def foreign(path):
    os.chown(path, 12345, -1)


@pytest.mark.parametrize("what, change, found", [
    ("directory", chmod(0o777), "mode 0o777"),
    ("directory", chmod(0o770), "mode 0o770"),
    ("directory", foreign, "owned by uid 12345"),
    ("entry", chmod(0o666), "mode 0o666"),
    ("entry", foreign, "owned by uid 12345"),
], ids=["world-writable", "group-writable", "foreign", "entry-writable", "entry-foreign"])
def test_a_cache_others_can_write_is_refused(tmp_path, what, change, found):
    if change is foreign and os.geteuid() != 0:
        pytest.skip("only root gives a file away")
    cache = tmp_path / "cache"
    run(cache, 1, MIN="0")
    change(cache if what == "directory" else entry(cache, "p1"))
    before = {f.name: f.read_bytes() for f in cache.iterdir()}
    result = run(cache, 1, 2, MIN="0")  # the session runs, compiling p1 and p2
    assert result.stderr.count("PopartKitWarning") == 1, result.stderr
    assert str(cache) in result.stderr and found in result.stderr and "Fix:" in result.stderr
    assert {f.name: f.read_bytes() for f in cache.iterdir()} == before  # neither read nor written


def test_an_entry_made_writable_by_others_is_not_read(tmp_path):
    cache, file = VerifiedCache(tmp_path, max_bytes=-1), tmp_path / "jit_p-1-cache"
    cache.put("jit_p-1", b"program")
    assert cache.get("jit_p-1") == b"program"
    file.chmod(0o666)
    assert cache.get("jit_p-1") is None and not file.exists()


def test_the_default_directory_is_the_users_alone(tmp_path):
    run(tmp_path / "cache", 1, named=False)
    assert (tmp_path / "xdg" / "popart_kit" / "xla").stat().st_mode & 0o777 == 0o700


def test_the_size_bound_evicts_the_least_recently_used(tmp_path):
    cache = tmp_path / "cache"
    run(cache, 1, 2, 3, MIN="0", MAX="-1")
    files = [entry(cache, f"p{n}") for n in (1, 2, 3)]
    for age, file in enumerate(files):  # p1 written first, p3 last
        os.utime(file, ns=(age * 10**9, age * 10**9))
    bound = sum(f.stat().st_size for f in files) + 100
    run(cache, 1, 4, MIN="0", MAX=str(bound))  # p1 read back: the most recently used now
    assert files[0].exists() and entry(cache, "p4").exists() and not files[1].exists()
    assert sum(f.stat().st_size for f in cache.iterdir()) <= bound


def test_programs_compiling_faster_than_the_minimum_are_not_kept(tmp_path):
    cache = tmp_path / "cache"
    run(cache, 1, MIN="30")  # p1 compiles in milliseconds
    assert not list(cache.glob("jit_p1-*"))
    run(cache, 1, MIN="0")
    assert entry(cache, "p1").exists()


def test_processes_share_a_small_cache_concurrently(tmp_path):
    cache, numbers = tmp_path / "cache", range(1, 6)
    env = {**os.environ, CACHE_VARIABLE: str(cache), MIN_SECONDS_VARIABLE: "0",
           MAX_BYTES_VARIABLE: "8000"}  # a few entries: the processes evict each other's
    processes = [subprocess.Popen([sys.executable, "-c", PROGRAMS, *map(str, numbers)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for _ in range(4)]
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0 and out == expected(*numbers), err
        assert "Warning" not in err


def test_without_jaxs_hook_the_cache_is_off_with_a_warning(tmp_path):
    cache = tmp_path / "cache"
    script = "from jax._src import compilation_cache\ndel compilation_cache.get_file_cache\n"
    result = run(cache, 1, script=script + PROGRAMS, MIN="0")
    assert result.stderr.count("PopartKitWarning") == 1, result.stderr
    assert "get_file_cache" in result.stderr and not list(cache.glob("*-cache"))
