"""The engine thread: sleeps on the inbox while there is no work, else applies the queued
commands and runs steps; a failed step fails the requests in flight, never the thread."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from radixserve.engine.commands import Call, Command

log = logging.getLogger("radixserve")

IDLE_POLL_S = 0.5


class EngineThread:
    """Owns the inbox (any thread may :meth:`put`) and the background thread that drives
    ``step``. ``apply`` runs one command; ``has_work`` says whether a step has anything to do;
    ``on_error`` is called (on the thread) after a step raised."""

    def __init__(self, step: Callable[[], object], apply: Callable[[Command], None], has_work: Callable[[], bool], on_error: Callable[[], None]):
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._step, self._apply, self._has_work, self._on_error = step, apply, has_work, on_error
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def put(self, command: Command) -> None:
        self.inbox.put(command)

    def drain(self) -> None:
        """Apply every queued command now, in arrival order."""
        while True:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._apply(command)

    def call(self, command: Command) -> None:
        """Apply ``command`` on the engine thread and wait for it (at once when none runs)."""
        if self._thread is None:
            self.drain()
            self._apply(command)
            return
        done = threading.Event()
        self.inbox.put(command)
        self.inbox.put(Call(done.set))
        done.wait()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the engine thread between steps, without waiting (at once when none runs)."""
        if self._thread is None:
            self.drain()
            fn()
            return
        self.inbox.put(Call(fn))

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop and join the thread; then apply what is left in the inbox here."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping.set()
            self.inbox.put(Call(lambda: None))  # wake it up
            thread.join()
        self.drain()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self._has_work():
                    try:
                        command = self.inbox.get(timeout=IDLE_POLL_S)  # sleep until something arrives
                    except queue.Empty:
                        continue
                    # Apply it now, before what came after it: putting it back at the tail let an
                    # abort that arrived meanwhile run before its own add (and be lost).
                    self._apply(command)
                self._step()
            except Exception:  # never leave a request without a final message
                log.exception("engine step failed; failing the requests in flight")
                self._on_error()
