"""The CPU executor's C++ kernels (worker/csrc): built on first use, cached, optional.

`load()` compiles csrc/*.cpp with torch.utils.cpp_extension (g++ and ninja; -O3
-march=native -fopenmp) into a cache directory the project owns,
``$SUPERINFER_KERNELS_DIR`` or ``$XDG_CACHE_HOME/superinfer/torch_extensions`` (default
``~/.cache/superinfer/torch_extensions``), one subdirectory per CPU feature set, torch and
Python version (-march=native code must never be loaded on another kind of CPU sharing
the same home directory) and checkout. torch rebuilds when a source or flag changes and
holds a file lock while it builds, so of several processes started at once one builds
(~35-60 s here, minutes on a loaded machine) and the others wait and then load it
(~0.1 s); a lock left by a killed build is removed after `STALE_LOCK_S`. A failed build (no compiler, no
ninja, a compile error) logs one warning and returns None: the executor then runs its
pure-torch path. ``SUPERINFER_NO_KERNELS=1`` skips the kernels on purpose (tests of
that path).

`python -m worker.kernels` builds them ahead of time and prints what it did.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger()

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("elementwise.cpp", "attention.cpp", "qgemm.cpp", "model.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
DISABLE_ENV = "SUPERINFER_NO_KERNELS"

_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "ops": None, "error": None, "seconds": None}


def cache_root() -> Path:
    explicit = os.environ.get("SUPERINFER_KERNELS_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "superinfer" / "torch_extensions"


def machine_key() -> str:
    """What a -march=native build depends on: CPU features, torch, Python, architecture."""
    import torch

    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        pass
    text = "|".join((platform.machine(), flags, torch.__version__, sys.version.split()[0]))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _ensure_ninja() -> None:
    """torch looks for `ninja` on PATH; the PyPI package puts it in the venv's bin, which
    is not on PATH when .venv/bin/python is run directly."""
    if shutil.which("ninja"):
        return
    candidates = [Path(sys.executable).parent]
    try:
        import ninja

        candidates.insert(0, Path(ninja.BIN_DIR))
    except ImportError:
        pass
    for d in candidates:
        if (d / "ninja").exists():
            os.environ["PATH"] = f"{d}{os.pathsep}{os.environ.get('PATH', '')}"
            return


STALE_LOCK_S = 900.0  # a build takes ~1 min; a lock this old was left by a killed build


def _clear_stale_lock(lock: Path) -> None:
    """torch's build lock is a file that a killed build leaves behind, and every later
    load would wait on it forever."""
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_LOCK_S:
        log.warning("kernels_stale_lock", path=str(lock), age_s=round(age))
        lock.unlink(missing_ok=True)


def load() -> Any | None:
    """The compiled module, or None (with one logged warning) when it cannot be had."""
    with _lock:
        if _state["tried"]:
            return _state["ops"]
        _state["tried"] = True
        if os.environ.get(DISABLE_ENV):
            _state["error"] = f"{DISABLE_ENV} is set"
            log.info("kernels_disabled", why=_state["error"])
            return None
        try:
            _state["ops"] = _build()
        except Exception as e:  # no compiler, no ninja, a compile error: the torch path
            first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            _state["error"] = first[:300]
            log.warning("kernels_unavailable", error=_state["error"],
                        fallback="pure-torch executor (slower); install g++ and ninja "
                                 "(pip install ninja) to build the C++ kernels")
        return _state["ops"]


def _build() -> Any:
    import torch.utils.cpp_extension as cpp

    _ensure_ninja()
    # one directory per machine kind and per checkout: torch rebuilds when the source
    # paths in its build file change, so two checkouts sharing one would rebuild in turn
    where = hashlib.sha256(str(CSRC).encode()).hexdigest()[:8]
    build_dir = cache_root() / f"cpu-{machine_key()}-{where}"
    build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build_dir / "lock")
    t0 = time.perf_counter()
    ops = cpp.load(
        name="superinfer_cpu_ops",
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=CFLAGS,
        extra_include_paths=[str(CSRC)],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )
    seconds = time.perf_counter() - t0
    _state["seconds"] = seconds
    event = "kernels_built" if seconds > 5 else "kernels_loaded"
    log.info(event, seconds=round(seconds, 2), dir=str(build_dir), qgemm=str(ops.qgemm_isa()))
    return ops


def status() -> dict[str, Any]:
    """What `load()` found: available, the error if not, seconds it took."""
    return {"available": _state["ops"] is not None, "error": _state["error"],
            "seconds": _state["seconds"]}


def main() -> int:
    ops = load()
    st = status()
    if ops is None:
        print(f"C++ kernels unavailable: {st['error']}", file=sys.stderr)
        return 1
    print(f"C++ kernels ready in {st['seconds']:.1f} s (qgemm: {ops.qgemm_isa()}), "
          f"cached under {cache_root()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
