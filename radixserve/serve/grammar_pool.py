"""A worker's grammar compiles, in a child process that can be killed.

Compiling a grammar (xgrammar) can take seconds to minutes (a 65 KB nested JSON schema ran past
90 s) and cannot be interrupted in-process: an aborted request's compile kept running, and 48
big choice grammars made another tenant's tiny one wait 32 s. Here every grammar the engine has
not compiled yet is compiled in one child process (``python -m radixserve.serve.grammar_pool``,
started at the first one), one at a time:

- **bounded**: a compile that uses more than ``timeout_s`` seconds of the child's CPU time (or
  ``WALL_LIMIT_FACTOR`` times that in wall time) kills the child (the next compile starts a
  fresh one) and its requests get ``bad_request`` naming the limit; the grammar is remembered as
  too slow, so a repeat is refused at once. CPU time, not wall time, because the child runs at the
  lowest priority: on a busy machine it gets little CPU, and a wall-clock limit would refuse
  grammars for the machine's load rather than for their own cost;
- **fair**: waiting compiles are queued per namespace (tenant) and taken in turn, and one
  compile serves every request waiting for the same grammar;
- **cancellable**: when every request waiting for a compile is aborted, it leaves the queue, or
  the child is killed if it is running;
- **below the decodes**: the child runs at the lowest priority (``COMPILE_NICENESS`` below its
  worker, at most 19), so a tenant's grammars take CPU only where the workers leave some.

The compiled grammar comes back serialized (xgrammar's JSON) and is rebuilt against the
worker's own TokenizerInfo. Frames on the child's stdin/stdout: a 4-byte big-endian length,
then msgpack.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import struct
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from radixserve.errors import BadRequestError
from radixserve.sampling_params import StructuredOutput

log = logging.getLogger("radixserve.grammar")

COMPILE_TIMEOUT_S = 10.0  # CPU-seconds of the compile process per grammar
WALL_LIMIT_FACTOR = 3.0  # ... and at most this many times that in wall time
COMPILE_NICENESS = 19  # the compile process runs this much below its worker (os.nice; the kernel caps at 19)
CHECK_S = 0.1  # how often a running compile's CPU time is read
START_TIMEOUT_S = 120.0  # the compile process's start (it imports xgrammar, which imports torch)
_LEN = struct.Struct(">I")


class CompileAborted(Exception):
    """Every request waiting for this compile was aborted."""


@dataclass(eq=False)
class _Compile:
    spec: StructuredOutput
    namespace: str
    future: asyncio.Future
    waiters: set[str] = field(default_factory=set)  # work ids


class GrammarPool:
    """Compiles grammars for one engine in a killable child process; see the module docstring."""

    def __init__(self, tokenizer_info, *, timeout_s: float = COMPILE_TIMEOUT_S, remember: int = 256):
        self._info = tokenizer_info
        self.timeout_s = timeout_s
        self._by_key: dict[tuple[str, str], _Compile] = {}
        self._queues: dict[str, collections.deque[_Compile]] = {}  # namespace -> its compiles, in turn
        self._served: dict[str, int] = {}  # namespace -> when it was last served (while it has compiles queued)
        self._clock = 0
        self._of_work: dict[str, _Compile] = {}
        self._running: _Compile | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._runner: asyncio.Task | None = None
        self._too_slow: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._remember = remember
        self.stats = {"grammar_compiles": 0, "grammar_timeouts": 0, "grammar_kills": 0}

    async def compile(self, spec: StructuredOutput, namespace: str | None, work_id: str):
        """The compiled grammar of ``spec`` for request ``work_id``; raises
        :class:`BadRequestError` (it does not compile, or not in time) or :class:`CompileAborted`."""
        key = spec.key
        if key in self._too_slow:
            raise self._timeout_error(spec)
        job = self._by_key.get(key)
        if job is None:
            job = self._by_key[key] = _Compile(spec, namespace or "", asyncio.get_running_loop().create_future())
            self._queues.setdefault(job.namespace, collections.deque()).append(job)
            if self._runner is None or self._runner.done():
                self._runner = asyncio.ensure_future(self._run())
        job.waiters.add(work_id)
        self._of_work[work_id] = job
        try:
            return await asyncio.shield(job.future)
        finally:
            self._of_work.pop(work_id, None)

    def abandon(self, work_id: str) -> None:
        """Request ``work_id`` was aborted: it stops waiting; a compile nobody waits for any more
        leaves the queue, or is stopped (the child killed) if it is running."""
        job = self._of_work.pop(work_id, None)
        if job is None:
            return
        job.waiters.discard(work_id)
        if job.waiters or job.future.done():
            return
        job.future.set_exception(CompileAborted())
        job.future.exception()  # retrieved: nobody else waits for it
        if self._by_key.get(job.spec.key) is job:
            del self._by_key[job.spec.key]
        if job is self._running:
            self._kill("its requests were aborted")

    def _next(self) -> _Compile | None:
        """The head of the queue of the namespace served the longest ago (one that had nothing
        queued counts as never served: it goes before the one just served)."""
        while self._queues:
            ns = min(self._queues, key=lambda n: self._served.get(n, -1))
            jobs = self._queues[ns]
            job = jobs.popleft()
            self._clock += 1
            self._served[ns] = self._clock
            if not jobs:
                del self._queues[ns]
                del self._served[ns]
            if not job.future.done():
                return job
        return None

    async def _run(self) -> None:
        while (job := self._next()) is not None:
            self._running = job
            try:
                compiled = await self._compile_in_child(job)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if not job.future.done():
                    job.future.set_exception(exc)
            else:
                if not job.future.done():
                    job.future.set_result(compiled)
            finally:
                self._running = None
                if self._by_key.get(job.spec.key) is job:
                    del self._by_key[job.spec.key]

    async def _compile_in_child(self, job: _Compile):
        proc = await self._child()
        assert proc.stdin is not None and proc.stdout is not None
        frame = msgspec.msgpack.encode(job.spec)
        proc.stdin.write(_LEN.pack(len(frame)) + frame)
        t0 = time.monotonic()
        read = asyncio.ensure_future(_read_frame(proc.stdout))
        cpu0 = _cpu_seconds(proc.pid)
        try:
            while not (await asyncio.wait({read}, timeout=CHECK_S))[0]:
                wall = time.monotonic() - t0
                cpu = _cpu_seconds(proc.pid)
                used = wall if cpu is None or cpu0 is None else cpu - cpu0
                if used > self.timeout_s or wall > WALL_LIMIT_FACTOR * self.timeout_s:
                    raise asyncio.TimeoutError
            reply = read.result()
        except asyncio.TimeoutError:
            self.stats["grammar_timeouts"] += 1
            self._too_slow[job.spec.key] = None
            while len(self._too_slow) > self._remember:
                self._too_slow.popitem(last=False)
            self._kill(f"a grammar took longer than {self.timeout_s:g} CPU-seconds to compile")
            raise self._timeout_error(job.spec) from None
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self._kill("it stopped answering")
            if job.future.done():  # killed because its requests were aborted
                raise CompileAborted() from None
            raise RuntimeError(f"the grammar compile process ended ({type(exc).__name__})") from None
        finally:
            if not read.done():
                read.cancel()
        self.stats["grammar_compiles"] += 1
        ok, payload = msgspec.msgpack.decode(reply)
        if not ok:
            raise BadRequestError(f"structured.{job.spec.kind}", f"cannot be compiled into a grammar: {payload}")
        log.debug("compiled a %s grammar in %.2f s", job.spec.kind, time.monotonic() - t0)
        import xgrammar as xgr

        return await asyncio.get_running_loop().run_in_executor(None, xgr.CompiledGrammar.deserialize_json, payload, self._info)

    def _timeout_error(self, spec: StructuredOutput) -> BadRequestError:
        return BadRequestError(
            f"structured.{spec.kind}",
            f"did not compile into a grammar within {self.timeout_s:g} s of CPU time (the worker's grammar compile limit); "
            "simplify it: fewer alternatives, less nesting",
        )

    async def _child(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-P", "-m", "radixserve.serve.grammar_pool", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
            assert self._proc.stdin is not None and self._proc.stdout is not None
            info = self._info.serialize_json().encode()
            self._proc.stdin.write(_LEN.pack(len(info)) + info)
            try:  # it says when it is ready (imports take seconds): that is not compile time
                await asyncio.wait_for(_read_frame(self._proc.stdout), START_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
                self._kill("it did not start")
                raise RuntimeError(f"the grammar compile process did not start ({type(exc).__name__})") from None
        return self._proc

    def _kill(self, why: str) -> None:
        if self._proc is not None and self._proc.returncode is None:
            log.warning("killing the grammar compile process: %s", why)
            self.stats["grammar_kills"] += 1
            self._proc.kill()
        self._proc = None

    async def aclose(self) -> None:
        """Stop the compile process (and wait for it, so its pipes close on this loop)."""
        if self._runner is not None:
            self._runner.cancel()
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return await reader.readexactly(n)


# ------------------------------------------------------------------------------ the child process
class WorkerGrammars:
    """A worker's side of the grammars: which requests wait for a compile (and whether they were
    aborted meanwhile), and the compile process, started at the first grammar the engine lacks.
    ``grammars``: the engine's GrammarCache (None: no structured output); ``timeout_s`` None
    compiles in the engine's own thread, unbounded."""

    def __init__(self, grammars: Any, timeout_s: float | None):
        self.grammars = grammars
        self.timeout_s = timeout_s
        self.waiting: dict[str, bool] = {}  # work id -> aborted while its grammar compiles
        self._pool: GrammarPool | None = None

    def prepare(self) -> None:
        """Build the tokenizer table now (before the worker registers): at the first grammar, a
        Python loop over the vocabulary holding the GIL for seconds starved the worker's loop of
        its heartbeats under load, and the router declared the worker dead."""
        if self.grammars is not None and self.timeout_s is not None:
            from radixserve.engine.structured import xgrammar_available

            if xgrammar_available():
                self.grammars.tokenizer_info()

    def begin(self, work_id: str) -> None:
        self.waiting[work_id] = False

    def abort(self, work_id: str) -> bool:
        """Mark ``work_id`` aborted if it waits for a compile (its compile stops when no other
        request waits for it); False when it does not wait."""
        if work_id not in self.waiting:
            return False
        self.waiting[work_id] = True
        if self._pool is not None:
            self._pool.abandon(work_id)
        return True

    def end(self, work_id: str) -> bool:
        """``work_id`` no longer waits; whether it was aborted meanwhile."""
        return self.waiting.pop(work_id, False)

    async def compile(self, spec: StructuredOutput | None, namespace: str | None, work_id: str) -> None:
        """Compile ``spec`` in the killable compile process (bounded in time, fair between
        namespaces) unless the engine has it; raises :class:`CompileAborted` or the refusal."""
        grammars = self.grammars
        if spec is None or grammars is None or self.timeout_s is None:
            return
        spec.validate()  # shape, size and depth before any work
        if grammars.cached(spec):
            return
        from radixserve.engine.structured import xgrammar_available

        if not xgrammar_available():
            return  # make_request refuses it, saying how to install xgrammar
        if self._pool is None:
            info = await asyncio.get_running_loop().run_in_executor(None, grammars.tokenizer_info)
            self._pool = GrammarPool(info, timeout_s=self.timeout_s)
        grammars.put(spec, await self._pool.compile(spec, namespace, work_id))

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux's /proc), or None where that
    cannot be read (the limit is then wall time)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _read_exactly(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError
    return data


def main() -> int:
    """The compile process: TokenizerInfo first, then StructuredOutput specs; answers
    ``[True, compiled grammar as JSON]`` or ``[False, why]`` for each."""
    import xgrammar as xgr

    from radixserve.engine.structured import GrammarCache

    # Below the workers: a tenant's slow grammars took 30 of 80 CPU-seconds from the decodes of
    # every other tenant (bench/RESULTS.md section 43). A compile's limit is its CPU time.
    os.nice(COMPILE_NICENESS)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        (n,) = _LEN.unpack(_read_exactly(inp, _LEN.size))
        info = xgr.TokenizerInfo.deserialize_json(_read_exactly(inp, n).decode())
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        ready = msgspec.msgpack.encode([True, "ready"])
        out.write(_LEN.pack(len(ready)) + ready)
        out.flush()
        while True:
            (n,) = _LEN.unpack(_read_exactly(inp, _LEN.size))
            spec = msgspec.msgpack.decode(_read_exactly(inp, n), type=StructuredOutput)
            reply: Any
            try:
                reply = [True, GrammarCache._compile(compiler, spec).serialize_json()]
            except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
                reply = [False, f"{type(exc).__name__}: {exc}"]
            frame = msgspec.msgpack.encode(reply)
            out.write(_LEN.pack(len(frame)) + frame)
            out.flush()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return 0


if __name__ == "__main__":
    sys.exit(main())
