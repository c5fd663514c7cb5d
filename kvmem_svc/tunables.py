"""glibc tunables of the kvmem daemon: non-temporal stores for KV block copies.

glibc's `memmove` switches to non-temporal stores (which bypass the caches) only above
`glibc.cpu.x86_non_temporal_threshold`, by default about 3/4 of the last-level cache
(~114 MiB on this machine's CPU). KV blocks are 0.7–4 MiB and land in a pool far larger
than any cache, where they are not read again soon, so cached stores only evict useful
lines and cost write-allocate reads: one 512 MiB memmove ran ~1.5x faster than the same
bytes as 4 MiB blocks (`superinfer bench transfer --nt-threshold default`). kvmem lowers
the threshold to 32 KiB. Measured here (block-first through DuplexEngine against one raw
memmove of the same bytes, each pair of settings in alternating processes, 5-6 runs):
4 MiB blocks (Qwen2.5-32B shape) reach 0.93-0.98 of raw with 32 or 64 KiB and 0.83-0.93
with 256 KiB; 720 KiB blocks (the bundled model) 0.90-0.95 with 32 KiB and 0.85-0.89 with
64 KiB. That fits glibc's memmove taking its 4-page non-temporal loop only for copies of
at least 16x the threshold (after aligning the destination): 32 KiB puts every block of
512 KiB or more there. Smaller copies of 32 KiB or more (a layer-first segment of a
Qwen2.5-32B block) get non-temporal stores too. glibc reads tunables only at process
start, so the daemon re-executes itself once with them set (same pid, same arguments)
before it loads anything.
"""

from __future__ import annotations

import os
import platform
import sys

NT_KEY = "glibc.cpu.x86_non_temporal_threshold"
NT_THRESHOLD = "0x8000"  # 32 KiB: whole blocks of >= 512 KiB take the 4-page loop
_DONE = "SUPERINFER_KVMEM_TUNED"


def nt_threshold_in_effect(env: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        if item.startswith(NT_KEY + "="):
            return item.split("=", 1)[1]
    return None


def with_nt_threshold(env: dict[str, str], value: str = NT_THRESHOLD) -> dict[str, str]:
    """`env` with the threshold added to GLIBC_TUNABLES (other tunables kept)."""
    items = [t for t in env.get("GLIBC_TUNABLES", "").split(":")
             if t and not t.startswith(NT_KEY + "=")]
    return {**env, "GLIBC_TUNABLES": ":".join([*items, f"{NT_KEY}={value}"])}


def applies_here() -> bool:
    """x86-64 Linux with glibc: where the tunable exists."""
    return (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
            and platform.libc_ver()[0] == "glibc")


def reexec_with_copy_tunables() -> None:
    """Re-exec this process with the threshold set, unless it is set or does not apply.

    The user's own setting wins; `SUPERINFER_KVMEM_TUNED` guards against a loop."""
    if not applies_here() or nt_threshold_in_effect() is not None or os.environ.get(_DONE):
        return
    env = with_nt_threshold(dict(os.environ))
    env[_DONE] = "1"
    argv = list(getattr(sys, "orig_argv", [])) or [sys.executable, *sys.argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
