"""Process-wide settings that radixserve's own processes (the CLI, its workers, the benchmarks)
choose, and a library import does not impose on its host."""

from __future__ import annotations

import ctypes
import os
import platform

OMP_SPIN_COUNT = 10000
"""libgomp's spin count at barriers (``GOMP_SPINCOUNT``) that :func:`default_omp_wait` sets."""


def default_omp_wait() -> None:
    """Make OpenMP threads spin only briefly at barriers, then sleep, unless the user chose.

    Sets ``GOMP_SPINCOUNT`` to :data:`OMP_SPIN_COUNT` when neither ``OMP_WAIT_POLICY`` nor
    ``GOMP_SPINCOUNT`` is set (libgomp then spins that many times, well under a millisecond, before
    sleeping). A step runs dozens of short parallel regions a few microseconds apart: with passive
    waits (no spin) each one woke the second thread with a futex, with an unbounded spin the
    threads never yield. Measured on a 2-core machine (``python -m bench peers --engines
    radixserve --dtype bfloat16``, fleet / GSP wall): passive 2.69 / 3.51 s, spin 10,000 2.44 /
    2.97 s, 30,000 2.38 / 2.96 s, 100,000 2.44 / 3.04 s; next to one busy process, passive
    7.21-7.34 / 8.99-9.37 s against 7.83-8.06 / 9.92-10.50 s for 10,000. libgomp's default spin
    (300,000) collapsed there: a 2-thread fleet run took 39-45 s against 10-13 s passive. So on
    cores shared with other busy work set ``OMP_WAIT_POLICY=PASSIVE`` (no spin at all).
    libgomp reads these once, when torch loads, so call this before importing torch. An
    application that embeds :class:`~radixserve.Engine` sets them itself.
    """
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = _DEFAULTED["GOMP_SPINCOUNT"] = str(OMP_SPIN_COUNT)


_DEFAULTED: dict[str, str] = {}


def defaulted_env() -> dict[str, str]:
    """The variables :func:`default_omp_wait` set in this process (not the user's): what a child
    that should run with its own defaults (another engine, in a side-by-side benchmark) drops."""
    return dict(_DEFAULTED)


MALLOC_MMAP_THRESHOLD = 32 << 20
"""glibc's ``M_MMAP_THRESHOLD`` that :func:`default_malloc` sets: blocks below it (every
activation of a 2,048-token step of the bench model) come from the heap, and are reused there."""
MALLOC_TRIM_THRESHOLD = 1 << 30
"""glibc's ``M_TRIM_THRESHOLD`` that :func:`default_malloc` sets: freed memory at the heap's top
stays mapped up to this much."""
MALLOC_TOP_PAD = 64 << 20
"""glibc's ``M_TOP_PAD`` that :func:`default_malloc` sets: the heap grows by at least this much."""
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # mallopt parameters (malloc.h)
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def default_malloc() -> bool:
    """Keep glibc's malloc from returning the engine's freed activations to the kernel between
    steps, unless the user chose; True when the settings were applied.

    A forward allocates its activations afresh (a 2,048-row fp32 step: tens of MB) and frees
    them. With glibc's defaults, blocks over the (adaptive) mmap threshold are mapped and unmapped
    per call, and a freed heap top is trimmed, so every step faults its memory back in page by
    page and the kernel zeroes it again. Setting :data:`MALLOC_MMAP_THRESHOLD`,
    :data:`MALLOC_TRIM_THRESHOLD` and :data:`MALLOC_TOP_PAD` keeps those pages mapped: the resident
    size stays at the step loop's peak instead of shrinking between steps. Measured on a 2-core
    AVX-512 EPYC, ``python -m bench peers --engines radixserve`` (fp32) with and without these
    settings (``GLIBC_TUNABLES=`` turns them off), interleaved: GSP wall 13.95 / 14.10 / 13.96 ->
    13.05 / 13.29 / 13.17 s, its minor page faults 129-165k -> 28-30k and system CPU 0.8-1.4 ->
    0.2-0.5 s; the fleet faults 22-155k -> 19-26k, its wall unchanged within the noise (seven
    runs each, 8.3-9.4 s against 7.7-9.6 s).
    The same effect as vLLM's advice to preload tcmalloc, without a preload. Does nothing off
    glibc, or when any of ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
    ``MALLOC_TOP_PAD_`` or ``GLIBC_TUNABLES`` is set (the user's settings stand)."""
    if any(key in os.environ for key in _MALLOC_ENV) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD), (_M_TOP_PAD, MALLOC_TOP_PAD))
    return all([mallopt(param, value) == 1 for param, value in settings])


def open_files_limit() -> int:
    """This process's soft limit on open files (2**20 where unlimited, 2**16 off POSIX)."""
    try:
        import resource
    except ImportError:
        return 1 << 16
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (at most 2**20), and
    return the soft limit. A router holds one file descriptor per client connection and needs a
    few more to restart a worker: the common soft limit of 1,024 is soon spent, while the hard
    limit is often far higher."""
    try:
        import resource
    except ImportError:
        return open_files_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass
    return open_files_limit()
