"""Tensor parallelism, the engine side: rank 0's runner and the follower ranks' loop.

Rank 0 is the engine's own process: it loads the whole model, keeps its shard
(:func:`radixserve.model.parallel.shard_model`) and runs the scheduler. Ranks 1..N-1 are spawned
processes that load the same checkpoint, keep their shard and a KV pool of their own KV heads
(same page count, so page ids mean the same on every rank), and run
:meth:`ModelRunner.forward` on each batch rank 0 sends them.

The batch goes to the followers over a local pipe per follower (our own processes, no network),
not a collective: a follower idles there for as long as the engine has nothing to do, with no
collective timeout to trip. Gloo talks over 127.0.0.1 only, rendezvous through a FileStore in a
temporary directory. A follower whose pipe closes (engine gone) exits; :meth:`close` stops and
joins them, and kills one that does not stop in time.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from radixserve.engine.model_runner import ModelRunner
from radixserve.errors import BadRequestError
from radixserve.kv.pool import KVPool
from radixserve.model.llama import head_dim_of
from radixserve.model.loader import load_model
from radixserve.model.parallel import attach_all_reduce, check_divisible, make_group, shard_model

if TYPE_CHECKING:
    from radixserve.engine.scheduler import ScheduledItem

log = logging.getLogger("radixserve")

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0


@dataclass
class _Window:
    """The tokens ``[start, start + len(tokens))`` of a request, indexed by absolute position."""

    start: int
    tokens: list[int]

    def __getitem__(self, s: slice) -> list[int]:
        return self.tokens[s.start - self.start : s.stop - self.start]


@dataclass
class _KV:
    pages: list[int]


@dataclass
class _Req:
    """What the runner reads of a Request: its tokens and its KV's pages."""

    tokens: _Window
    kv: _KV


@dataclass
class _Item:
    """What a follower needs of a ScheduledItem: no sampling or scoring (rank 0 does those)."""

    req: _Req
    start: int
    num_tokens: int
    samples: bool = False
    score_positions: range = field(default_factory=lambda: range(0))


@dataclass
class FollowerSpec:
    model_path: str
    dtype: str
    max_model_len: int
    num_pages: int
    page_size: int
    kv_dtype: str | None
    attention: str
    threads: int


def _follower(rank: int, world: int, store_path: str, spec: FollowerSpec, conn) -> None:
    try:
        torch.set_num_threads(spec.threads)
        device = torch.device("cpu")
        loaded = load_model(
            spec.model_path, device=device, dtype=spec.dtype, max_model_len=spec.max_model_len, weights="dequantize"
        )  # (rank 0 too: setup.weights_mode)
        cfg = loaded.config
        row_parallel = shard_model(loaded.model, rank, world)
        pool = KVPool(
            num_layers=cfg.num_hidden_layers,
            num_pages=spec.num_pages,
            page_size=spec.page_size,
            num_kv_heads=cfg.num_key_value_heads // world,
            head_dim=head_dim_of(cfg),
            dtype=loaded.dtype,
            device=device,
            kv_dtype=spec.kv_dtype,
        )
        runner = ModelRunner(loaded.model, pool, device, spec.attention)
        conn.send(("ready", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    attach_all_reduce(row_parallel, make_group(store_path, rank, world))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the engine is gone
            return
        if message is None:
            return
        wire, groups = message
        items = [_Item(_Req(_Window(start, toks), _KV(pages)), start, n) for toks, pages, start, n in wire]
        runner.forward(cast("list[ScheduledItem]", items), groups)  # _Item has what forward reads of a ScheduledItem


class TensorParallelRunner:
    """Rank 0's ModelRunner: sends each batch to the followers, then runs its own shard."""

    def __init__(self, loaded, pool, device: torch.device, attention: str, world: int):
        if device.type != "cpu":
            raise BadRequestError("tensor_parallel", f"tensor parallel runs on the CPU (gloo) only, not {device}")
        check_divisible(loaded.config, world)
        self.world = world
        self._dir = tempfile.mkdtemp(prefix="radixserve-tp-")
        store_path = os.path.join(self._dir, "store")
        spec = FollowerSpec(
            model_path=str(loaded.path),
            dtype=str(loaded.dtype).removeprefix("torch."),
            max_model_len=loaded.max_model_len,
            num_pages=pool.num_pages,
            page_size=pool.page_size,
            kv_dtype=pool.kv_dtype,
            attention=attention,
            threads=max(1, torch.get_num_threads() // world),
        )
        ctx = mp.get_context("spawn")
        self._procs, self._conns = [], []
        try:
            for rank in range(1, world):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_follower, args=(rank, world, store_path, spec, child), name=f"radixserve-tp{rank}", daemon=True)
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            for rank, conn in enumerate(self._conns, start=1):
                if not conn.poll(START_TIMEOUT_S):
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start within {START_TIMEOUT_S:.0f} s")
                status, detail = conn.recv()
                if status != "ready":
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{detail}")
            self.group = make_group(store_path, 0, world)
            attach_all_reduce(shard_model(loaded.model, 0, world), self.group)
            self.local = ModelRunner(loaded.model, pool, device, attention)
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks (gloo over 127.0.0.1), follower pids %s", world, [p.pid for p in self._procs])

    @property
    def attention(self):
        return self.local.attention

    @property
    def pool(self):
        return self.local.pool

    @property
    def model(self):
        return self.local.model

    def forward(self, items, groups=()):
        wire = []
        for item in items:
            end = item.start + item.num_tokens
            wire.append((item.req.tokens[item.start : end], list(item.req.kv.pages), item.start, item.num_tokens))
        message = (wire, list(groups))
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send(message)
            except (BrokenPipeError, OSError) as e:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone ({e})") from e
        return self.local.forward(items, groups)

    def close(self) -> None:
        """Stop the followers (join, then kill one that hangs) and remove the rendezvous files."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                log.warning("tensor-parallel follower %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.join(STOP_TIMEOUT_S)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]  # all started
