"""Process-wide settings that radixserve's own processes (the CLI, its workers, the benchmarks)
choose, and a library import does not impose on its host."""

from __future__ import annotations

import os


def prefer_passive_omp() -> None:
    """Make OpenMP threads sleep at barriers instead of spinning, unless the user chose.

    Spinning barriers collapse when the cores are shared with other work: on this project's
    2-core machine under load, a 2-thread fleet run took 39-45 s spinning vs 10-13 s with passive
    waits (``python -m bench peers --engines radixserve --workloads fleet --agents 16 --turns 2``).
    libgomp reads the variable once, when torch loads, so call this before importing torch. An
    application that embeds :class:`~radixserve.Engine` sets ``OMP_WAIT_POLICY`` itself.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
