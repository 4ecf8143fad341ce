"""Process-wide settings that radixserve's own processes (the CLI, its workers, the benchmarks)
choose, and a library import does not impose on its host."""

from __future__ import annotations

import os


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
