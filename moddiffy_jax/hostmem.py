"""Host memory: keep freed memory in the process instead of returning it.

On CPU, XLA allocates each execution's temporary arena (344 MB for a
MiniLM fine-tuning step at batch 32 x 32, about 1 GB for a MoDDiffy-par
step) from the thread that runs the program. glibc serves an allocation
that large from a worker thread by a fresh ``mmap`` (a thread's own heap is
at most 64 MB) and unmaps it when it is freed, so every step faults all of
its pages in again: about 86,000 minor page faults and 0.17 CPU-seconds of
kernel time per fine-tuning step, 258,000 and 0.5 s per MoDDiffy-par step
on the project's 2-core machine (docs/speed.md, "Host memory", stop 34).

:func:`keep_freed_memory` asks glibc (``mallopt``) to serve every thread
from the main heap (``M_ARENA_MAX`` 1), never by ``mmap`` (``M_MMAP_MAX``
0), and to keep freed memory (``M_TRIM_THRESHOLD`` 2**31 - 1): the next
step reuses the same pages. It changes where memory comes from, never a
number computed. The process's resident memory then stays at its peak
instead of falling between steps.

Importing :mod:`moddiffy_jax` calls it (Linux with glibc only) unless the
environment sets ``MODDIFFY_JAX_KEEP_FREED_MEMORY=0``. It acts on the
threads that allocate for the first time after it: import ``moddiffy_jax``
before running any JAX computation (a notebook that has already run some
can set the environment variable ``GLIBC_TUNABLES`` to :data:`GLIBC_TUNABLES`
before starting Python instead). Measured only on the training steps'
temporary arenas: a lone jitted function's fresh 32 MB outputs, allocated
on the calling thread, still faulted every call with the settings made at
import (and less with the same settings as ``GLIBC_TUNABLES``); why is not
known.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

ENV = "MODDIFFY_JAX_KEEP_FREED_MEMORY"

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_KEEP = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
#: The same settings as glibc tunables, for a process that does not import
#: moddiffy_jax (set before it starts; benchmarks/bench_vs_reference.py gives
#: them to the official code with ``--ref_keep_freed_memory``).
GLIBC_TUNABLES = (
    "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
    "glibc.malloc.trim_threshold=2147483647"
)

_applied: bool | None = None


def enabled_by_env(environ=None) -> bool:
    """False when ``MODDIFFY_JAX_KEEP_FREED_MEMORY`` says no (0, false, no,
    off); true otherwise."""
    value = (os.environ if environ is None else environ).get(ENV, "1")
    return value.strip().lower() not in ("0", "false", "no", "off")


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep and reuse freed memory (see the module
    doc); True if it did (now or at an earlier call), False where the C
    library is not glibc or refused a setting."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only (not musl)
            return False
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _applied = all(mallopt(param, value) == 1 for param, value in _KEEP)
    return _applied
