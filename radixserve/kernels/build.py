"""Build (once) and load the C++ CPU kernels in ``csrc/``: one shared library whose ops register
with torch (``torch.ops.radixserve_attention``, ``_layers``, ``_linear``, ``_quant``).

Contract: :func:`load` compiles at first use (``-O3 -march=native -fopenmp``) into
``$RADIXSERVE_CACHE/ext/<torch, python, CPU, sources>`` (default ``~/.cache/radixserve/ext/...``),
loads the library into this process and returns its path; a later process reuses the build. It
returns None, with one warning, when the build is impossible (no compiler, no ninja, no sources,
``RADIXSERVE_NO_EXT``): callers then take their torch paths. :func:`ops` is one namespace of ops
or None. Why the directory is keyed and locked as it is: docs/KERNELS.md ("Building").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("radixserve")

NAME = "radixserve_cpu_kernels"
SOURCES = ("attention.cpp", "prefill.cpp", "layers.cpp", "linear.cpp", "decode.cpp", "quant.cpp", "quant_int8.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]

_lock = threading.Lock()
_state: dict = {}


def csrc_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "csrc"


def _cpu_tag() -> str:
    flags = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _sources_tag(source: Path | None = None) -> str:
    """A hash of csrc/'s files (or ``source``'s): each version of the kernels builds into a
    directory of its own, so two checkouts or installs sharing one cache never rebuild over each
    other (each rebuild took a minute or more, long enough for a starting worker's first request
    to time out)."""
    digest = hashlib.sha1()
    for path in sorted((source or csrc_dir()).glob("*")):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


def _torch_tag() -> str:
    """A hash of where this torch is installed: torch's include and library paths go into the
    build's ninja file, so two environments (a checkout's venv and a CI clone's, say) sharing one
    cache rebuilt the extension at every switch between them, though torch's version was the same."""
    return hashlib.sha1(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:6]


def build_dir() -> Path:
    root = Path(os.environ.get("RADIXSERVE_CACHE", Path.home() / ".cache" / "radixserve"))
    tag = f"torch{torch.__version__.split('+')[0]}-{_torch_tag()}-py{sys.version_info.major}{sys.version_info.minor}-{_cpu_tag()}-{_sources_tag()}"
    return root / "ext" / tag


def ops(namespace: str, probe: str):
    """``torch.ops.<namespace>`` of the extension's TORCH_LIBRARY ops, or None when the extension
    is unavailable or its build lacks ``probe`` (``hasattr(torch.ops, name)`` is always true, so
    the op itself is looked up)."""
    if load() is None:
        return None
    try:
        ns = getattr(torch.ops, namespace)
        getattr(ns, probe)
    except (AttributeError, RuntimeError):
        return None
    return ns


def load() -> str | None:
    """The path of the loaded library, or None (with one warning) when it cannot be built."""
    with _lock:
        if "library" in _state:
            return _state["library"]
        _state["library"] = library = _build()
        return library


@contextlib.contextmanager
def _build_lock(directory: Path):
    """Hold an flock on the build directory while torch builds or loads the extension.

    torch's own lock is a plain ``lock`` file: a build killed midway (Ctrl-C, a timeout) leaves
    it behind, and every later start would wait on it forever, silently. The kernel drops an
    flock with its holder, so whoever holds this one is the only builder, and a ``lock`` file
    it finds is stale: it is removed, with a warning."""
    with open(directory / "radixserve.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("removing a stale build lock %s (left by a build that was killed)", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _stage_sources(directory: Path, source: Path | None = None) -> Path:
    """Copies of csrc/'s files (or ``source``'s) in ``directory/src``, the paths the build compiles: the same for
    every checkout whose sources hash to this directory. torch writes the source paths into the
    build's ninja file, so building from each checkout's own csrc/ made two checkouts sharing the
    cache rebuild the extension at every switch (a minute or more each), though the sources were
    the same. A copy is written only where it is missing or differs, so ninja sees the same files
    (and times) as at the last build."""
    staged = directory / "src"
    staged.mkdir(exist_ok=True)
    for path in sorted((source or csrc_dir()).glob("*")):
        if not path.is_file():
            continue
        data, copy = path.read_bytes(), staged / path.name
        if not copy.exists() or copy.read_bytes() != data:
            tmp = copy.with_name(copy.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(copy)
    return staged


def _ninja_dir() -> str | None:
    """The directory of the ninja binary of the ``ninja`` package (a dependency of radixserve,
    installed next to it), or None when it is missing."""
    try:
        import ninja
    except ImportError:
        return None
    directory = getattr(ninja, "BIN_DIR", None)
    return directory if directory and (Path(directory) / "ninja").is_file() else None


@contextlib.contextmanager
def _own_ninja_first():
    """PATH with this environment's ninja first, for the build only. torch runs whichever
    ``ninja`` PATH finds: a venv's python run with the venv activated found the venv's ninja
    (1.13), run without it the system's (1.11), and each rebuilt the whole extension (~75 s) after
    the other, every time (neither ninja trusts the other's build log); where the system has no
    ninja, a venv used without activating it got no kernels at all."""
    directory = _ninja_dir()
    if directory is None:
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = directory + (os.pathsep + before if before else "")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _build():
    if os.environ.get("RADIXSERVE_NO_EXT"):
        log.info("CPU kernels disabled by RADIXSERVE_NO_EXT; using the torch backend and torch ops")
        return None
    sources = [csrc_dir() / s for s in SOURCES]
    try:
        missing = [str(s) for s in sources if not s.exists()]
        if missing:
            raise FileNotFoundError(f"sources not found: {', '.join(missing)}")
        from torch.utils import cpp_extension

        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        built = any(directory.glob(f"{NAME}*.so"))
        if not built:
            log.warning("building the CPU kernels in %s (once per machine; 1-2 minutes)...", directory)
        else:
            log.info("loading the CPU kernels from %s", directory)
        start = time.perf_counter()
        with _build_lock(directory), _own_ninja_first():
            cpp_extension.verify_ninja_availability()
            copies = _stage_sources(directory)
            library = cpp_extension.load(
                name=NAME,
                sources=[str(copies / s.name) for s in sources],
                build_directory=str(directory),
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                verbose=False,
                is_python_module=False,
            )
        elapsed = time.perf_counter() - start
        if not built or elapsed > 5:
            log.warning("built the CPU kernels in %.1f s", elapsed)
        return str(library)
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back, once, loudly
        log.warning(
            "CPU kernels unavailable (%s: %s); using the torch attention backend and torch ops",
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
        )
        return None
