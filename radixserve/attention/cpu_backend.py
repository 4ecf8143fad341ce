"""CPU attention through the C++ kernels of ``csrc/`` (the ops of :mod:`radixserve.kernels.attention`).

The kernels read K/V pages in place from the pool, driven by the batch's FlashInfer-format
metadata, so nothing is gathered per layer:

* decodes and short extends (fewer than ``dense_min_tokens`` new tokens) that are not in a
  cascade group: one ``paged_attention`` call (bottom-right causal);
* prefill/extend chunks of many new tokens: one ``prefill_attention`` call for all of them
  (csrc/prefill.cpp: GEMM-shaped, cached prefix and own tokens together, bottom-right causal);
  or, with ``dense_path = "flash"``, torch's flash kernel per sequence (:mod:`cpu_dense`);
* cascade groups (decodes and extend chunks over a shared cached prefix): every new token of a
  group against the shared prefix (one multi-query "sequence" per group, not causal: one
  ``prefill_attention`` call, so the prefix's K/V are packed once per group and KV head, not once
  per member) and each member's tokens against its own suffix (the decode kernel when all are
  decodes, else the GEMM kernel, bottom-right causal; with enough decodes next to the extends,
  see ``suffix_split_min_decodes``, the decodes on the decode kernel and the extends on the GEMM kernel),
  both returning base-2 LSEs, then one fused merge.

Supports float32, bfloat16 and float16 KV pools with head_dim a multiple of 16 (up to 256);
:func:`supports` says whether a pool qualifies, and the runner falls back to the torch backend
when it does not (for example a quantised KV cache).
"""

from __future__ import annotations

import torch

from radixserve.attention.base import AttentionBackend, DecodeKernelArgs
from radixserve.attention.cpu_dense import attend_dense, attend_prefix, plan_dense, plan_prefixes
from radixserve.attention.metadata import AttentionMetadata
from radixserve.errors import InvariantError
from radixserve.kv.pool import KVPool

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Fewest new tokens of a chunk that goes to torch's flash kernel, by KV dtype (python -m bench
# kernels, one thread, 16 chunks over 2200 keys: fp32 ties at 17-32 tokens, flash wins above;
# bf16 the kernel wins at 17 tokens, 42 vs 63 ms, flash from 32, 51 vs 69 ms).
DENSE_MIN_TOKENS = {torch.float32: 16, torch.float16: 16, torch.bfloat16: 32}
# ... and to the csrc/ GEMM prefill kernel, any dtype: it beats the decode kernel from 2 new tokens
# (one thread, 16 chunks over 2200 keys, 2 tokens: fp32 16.5 vs 44 ms, bf16 7.9 vs 17.8 ms).
GEMM_MIN_TOKENS = 2


def dense_min_tokens_for(dtype: torch.dtype, path: str = "gemm") -> int:
    return GEMM_MIN_TOKENS if path == "gemm" else DENSE_MIN_TOKENS.get(dtype, 16)


def supports(pool: KVPool, num_qo_heads: int) -> str | None:
    """None when the kernels can serve this pool, else why not."""
    k0 = pool.k[0]
    if k0.device.type != "cpu":
        return f"the KV pool is on {k0.device.type}, not the CPU"
    if k0.dtype not in DTYPES:
        return f"KV dtype {k0.dtype} is not one of float32, bfloat16, float16"
    head_dim, num_kv = k0.shape[3], k0.shape[2]
    if head_dim % 16 or head_dim > 256:
        return f"head_dim {head_dim} is not a multiple of 16 up to 256"
    if num_qo_heads % num_kv:
        return f"{num_qo_heads} query heads are not a multiple of {num_kv} KV heads"
    return None


class CpuAttention(AttentionBackend):
    cascade_min_shared_tokens = 2048  # bench cascade --backend cpu: cascade wins from 8 x 256 (1.17x)
    cascade_extends = True
    suffix_split_min_decodes = 8
    suffix_split_tokens_per_decode = 64
    """A cascade level 1 that mixes decodes and extend chunks sends its decodes to the decode kernel
    and the extends to the GEMM kernel when it holds at least ``suffix_split_min_decodes`` decodes
    and ``decodes x suffix_split_tokens_per_decode`` reaches the extends' new tokens. On AMX each
    decode member is a work item that packs its whole suffix for two rows; the second call costs
    copies of the extends' rows. Level 1 alone, bf16, 2 threads, bench model (bench/RESULTS.md
    section 35), split against one call: 48 decodes over ~230 keys + 16 turns of 17 tokens 0.80x,
    63 + 1 0.56-0.66x (fp32 0.81-0.87x, 0.60-0.76x), 8 + 1 x 17 0.69-0.84x, 15 + 1 x 128
    0.78-0.80x, 16 + 4 x 128 0.90x, 16 + 6 x 128 0.97x; but 16 + 10 x 128 1.01-1.08x and GSP's
    9 + 7 x 128 1.02-1.07x (fp32 1.08-1.15x)."""
    dense_min_tokens: int | None = None
    """Ungrouped sequences with at least this many new tokens go to the many-row path; fewer
    (decodes, short extends) to the csrc/ decode kernel. None: :func:`dense_min_tokens_for` the
    pool's dtype and the path."""
    dense_path: str | None = None
    """The many-row path: "gemm" (csrc/prefill.cpp, one call per batch; the default for every
    dtype: bf16 runs on AMX tiles, else on vdpbf16ps, else widened to fp32 on the fp32 path,
    oneDNN's brgemm with AVX-512 (sgemm without); widened, on the AVX-512 micro-kernels before
    brgemm: 108 vs 55 GFLOP/s for torch's flash kernel, one thread, ``python -m bench kernels
    --dtype bfloat16 --modes gemm,flash``, 16 x 128 over 2176 keys) or "flash" (torch's
    flash kernel per sequence, :mod:`~radixserve.attention.cpu_dense`)."""

    def __init__(self, pool: KVPool, scale: float, ext):
        self.pool = pool
        self.scale = scale
        self.ext = ext
        self._meta: AttentionMetadata | None = None
        self._flat: tuple | None = None  # (rows or None: all, qo_indptr, kv_indptr, kv_indices, last_page_len)
        self._grouped: tuple | None = None  # (rows, every member a decode, plan_prefixes)
        self._in_order = False  # the grouped sequences are the batch's, in order (rows need no gather)
        # Decodes in cascade groups first, then decodes in no group: one decode-kernel call covers
        # the members' suffixes and the others' whole contexts (qo_indptr, kv_indptr, kv_indices,
        # last_page_len), and the prefix level and merge take the first rows only.
        self._combined: tuple | None = None
        # Level 1 of a mixed cascade batch in two calls: (decode members, extend members), each
        # (rows of the grouped rows, qo_indptr, kv_indptr, kv_indices, kv_last_page_len); or None.
        self._suffix_split: tuple[tuple, tuple] | None = None
        self._path = "gemm"  # the many-row path of the planned batch (see dense_path)

    def plan(self, metadata: AttentionMetadata) -> None:
        self._meta = metadata
        self._path = self.dense_path or "gemm"
        cascade = metadata.cascade
        self._flat = None
        self._grouped = None
        self._in_order = False
        self._combined = None
        self._suffix_split = None
        members: set[int] = set()
        grouped_first = False  # the grouped sequences are 0..len-1, in order
        if cascade is not None:
            grouped = [i for first, count, _ in cascade.groups for i in range(first, first + count)]
            members = set(grouped)
            grouped_first = grouped == list(range(len(grouped)))
            self._in_order = grouped_first and len(grouped) == metadata.num_seqs
            qo = metadata.qo_indptr.tolist()
            self._grouped = (
                _rows([r for i in grouped for r in range(qo[i], qo[i + 1])]),
                cascade.decodes_only,  # level 1 on the decode kernel, else on the GEMM kernel (causal)
                plan_prefixes(metadata) if self._path == "flash" else [],
            )
            if not cascade.decodes_only:
                self._suffix_split = self._split_suffix(metadata, grouped)
        least = self.dense_min_tokens or dense_min_tokens_for(self.pool.k[0].dtype, self._path)
        dense = [i for i, n in enumerate(metadata.qo_lens) if n >= least and i not in members]
        self._dense = []
        self._gemm: tuple | None = None  # _subset of the many-row sequences on the gemm path
        if dense and self._path == "flash":
            self._dense = plan_dense(metadata, dense)
        elif dense:
            self._gemm = _subset(metadata, dense)
            if len(dense) == metadata.num_seqs:  # every row: no gather of q, no scatter of out
                self._gemm = (None, *self._gemm[1:])
        if cascade is None and not dense:
            self._flat = (None, metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len)
            return
        skip = members.union(dense)
        flat = [i for i in range(metadata.num_seqs) if i not in skip]
        flat_meta = _subset(metadata, flat) if flat else None
        self._flat = flat_meta
        if (
            flat_meta is not None
            and cascade is not None
            and grouped_first
            and not dense
            and self._path != "flash"
            and cascade.decodes_only
            and all(metadata.qo_lens[i] == 1 for i in flat)
        ):
            # (the scheduler puts groups first: the ungrouped decodes are then the rows after them)
            self._combined = _concat(
                (cascade.suffix_qo_indptr, cascade.suffix_kv_indptr, cascade.suffix_kv_indices, cascade.suffix_kv_last_page_len), flat_meta[1:]
            )

    def _split_suffix(self, metadata: AttentionMetadata, grouped: list[int]) -> tuple[tuple, tuple] | None:
        """Level 1's decode members and extend members apart, when the decodes next to the
        extends are enough (see suffix_split_min_decodes)."""
        lens = [metadata.qo_lens[i] for i in grouped]
        decodes = [j for j, n in enumerate(lens) if n == 1]
        extend_tokens = sum(lens) - len(decodes)
        if len(decodes) < self.suffix_split_min_decodes or not extend_tokens or len(decodes) * self.suffix_split_tokens_per_decode < extend_tokens:
            return None
        c = metadata.cascade
        assert c is not None
        suffix = (c.suffix_qo_indptr, c.suffix_kv_indptr, c.suffix_kv_indices, c.suffix_kv_last_page_len)
        return _subset_of(*suffix, decodes), _subset_of(*suffix, [j for j, n in enumerate(lens) if n > 1])

    def suffix_level(self, qo_indptr: torch.Tensor) -> bool:
        """Whether a kernel call with this ``qo_indptr`` is (part of) the planned batch's cascade
        level 1 (for timers: ``python -m bench peers --breakdown``)."""
        c = self._meta.cascade if self._meta is not None else None
        parts = self._suffix_split or ()
        return c is not None and (qo_indptr is c.suffix_qo_indptr or any(qo_indptr is p[1] for p in parts))

    def decode_kernel_args(self) -> DecodeKernelArgs | None:
        """The batch's attention arguments when every sequence of it is on the decode kernel (no
        many-row chunk): with no cascade group, or with every row a decode and the grouped ones
        first, in row order (then with the groups' prefix metadata). Else None."""
        meta = self._meta
        if meta is None or self._gemm is not None or self._dense:
            return None
        if self._grouped is None:
            if self._flat is None or self._flat[0] is not None:
                return None
            _, qo_indptr, kv_indptr, kv_indices, last = self._flat
            return DecodeKernelArgs(self.pool.k, self.pool.v, meta.out_slots, qo_indptr, kv_indptr, kv_indices, last, self.scale)
        c = meta.cascade
        if c is None or self._path == "flash" or not self._grouped[1]:
            return None
        prefix = (c.prefix_qo_indptr, c.prefix_kv_indptr, c.prefix_kv_indices, c.prefix_kv_last_page_len)
        if self._combined is not None:  # groups first, then decodes in no group
            qo_indptr, kv_indptr, kv_indices, last = self._combined
            return DecodeKernelArgs(self.pool.k, self.pool.v, meta.out_slots, qo_indptr, kv_indptr, kv_indices, last, self.scale, prefix)
        if self._flat is not None or not self._in_order:
            return None
        return DecodeKernelArgs(
            self.pool.k, self.pool.v, meta.out_slots, c.suffix_qo_indptr, c.suffix_kv_indptr, c.suffix_kv_indices, c.suffix_kv_last_page_len, self.scale, prefix
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "plan() must be called before forward()"
        k_slots, v_slots = self.pool.k_slots(layer), self.pool.v_slots(layer)
        if not isinstance(k_slots, torch.Tensor) or not isinstance(v_slots, torch.Tensor):
            raise InvariantError("the cpu backend got an int8 KV pool (make_attention picks torch for it)")
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        self.ext.store_kv(k_cache, v_cache, meta.out_slots, k, v)
        # q may be a strided view of the fused qkv output: the kernels read it in place (rows
        # with a contiguous last dimension), so only torch's flash path needs a copy
        if q.stride(-1) != 1 or self._dense:
            q = q.contiguous()
        attend = self.ext.paged_attention
        if self._combined is not None:  # decodes in groups (first), then decodes in none
            c = meta.cascade
            assert c is not None
            out, lse = attend(q, k_cache, v_cache, *self._combined, self.scale, True)
            g = int(c.prefix_qo_indptr[-1])  # the grouped rows
            out_p, lse_p = self.ext.prefill_attention(
                q[:g], k_cache, v_cache, c.prefix_qo_indptr, c.prefix_kv_indptr, c.prefix_kv_indices, c.prefix_kv_last_page_len, self.scale, False
            )
            out[:g] = self.ext.merge_state(out_p, lse_p, out[:g], lse[:g])
            return out
        if self._flat is not None and self._flat[0] is None:  # every sequence on the decode kernel
            _, qo_indptr, kv_indptr, kv_indices, last = self._flat
            return attend(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last, self.scale, True)[0]
        if self._gemm is not None and self._gemm[0] is None:  # all rows are many-row chunks
            return self.ext.prefill_attention(q, k_cache, v_cache, *self._gemm[1:], self.scale, True)[0]
        out = torch.empty(q.shape, dtype=q.dtype)  # (contiguous, whatever q's strides)
        if self._gemm is not None:
            rows, *index = self._gemm
            _put(out, rows, self.ext.prefill_attention(_take(q, rows), k_cache, v_cache, *index, self.scale, True)[0])
        if self._flat is not None:
            rows, qo_indptr, kv_indptr, kv_indices, last = self._flat
            flat_out = attend(_take(q, rows), k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last, self.scale, True)[0]
            _put(out, rows, flat_out)
        for seq in self._dense:
            first, end = seq.rows
            out[first:end] = attend_dense(seq, q, k, v, k_slots, v_slots, self.scale, self.ext.merge_state)
        if self._grouped is None:
            return out
        rows, decodes_only, prefixes = self._grouped
        c = meta.cascade
        if c is None:
            raise InvariantError("cascade groups planned without cascade metadata")
        qg = _take(q, rows)
        # Level 1: each member's new tokens against its own suffix, bottom-right causal.
        if self._suffix_split is not None:
            out_s, lse_s = self._suffix_in_two(qg, k_cache, v_cache)
        else:
            suffix = attend if decodes_only else self.ext.prefill_attention
            out_s, lse_s = suffix(
                qg, k_cache, v_cache, c.suffix_qo_indptr, c.suffix_kv_indptr, c.suffix_kv_indices, c.suffix_kv_last_page_len, self.scale, True
            )
        # Level 0: each group's queries against its shared prefix, GEMM-shaped, not causal.
        if self._path == "flash":
            out_p = torch.zeros_like(qg)
            lse_p = torch.full(qg.shape[:2], float("-inf"))
            for first, end, slots in prefixes:
                if slots is not None:
                    out_p[first:end], lse_p[first:end] = attend_prefix(qg[first:end], k_slots, v_slots, slots, self.scale)
        else:
            out_p, lse_p = self.ext.prefill_attention(
                qg, k_cache, v_cache, c.prefix_qo_indptr, c.prefix_kv_indptr, c.prefix_kv_indices, c.prefix_kv_last_page_len, self.scale, False
            )
        _put(out, rows, self.ext.merge_state(out_p, lse_p, out_s, lse_s))
        return out

    def _suffix_in_two(self, qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """Level 1 of the grouped rows ``qg``: the decode members on the decode kernel, the extend
        members on the GEMM kernel; (out, base-2 LSE) of every grouped row."""
        assert self._suffix_split is not None
        out = torch.empty(qg.shape, dtype=qg.dtype)
        lse = torch.empty(qg.shape[:2], dtype=torch.float32)
        for (rows, *index), kernel in zip(self._suffix_split, (self.ext.paged_attention, self.ext.prefill_attention)):
            o, lse_part = kernel(_take(qg, rows), k_cache, v_cache, *index, self.scale, True)
            _put(out, rows, o)
            _put(lse, rows, lse_part)
        return out, lse


def _concat(a: tuple, b: tuple) -> tuple:
    """Two batches' (qo_indptr, kv_indptr, kv_indices, kv_last_page_len) as one, a's sequences first."""
    qo = torch.cat([a[0], b[0][1:] + a[0][-1]])
    kv = torch.cat([a[1], b[1][1:] + a[1][-1]])
    return qo.to(torch.int32), kv.to(torch.int32), torch.cat([a[2], b[2]]), torch.cat([a[3], b[3]]).contiguous()


def _subset(metadata: AttentionMetadata, seqs: list[int]) -> tuple:
    """(rows, qo_indptr, kv_indptr, kv_indices, kv_last_page_len) of some of a batch's sequences."""
    return _subset_of(metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len, seqs)


def _subset_of(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, seqs: list[int]) -> tuple:
    """(rows, qo_indptr, kv_indptr, kv_indices, kv_last_page_len) of some sequences of one paged
    metadata set (a batch's, or its cascade level 1's); rows index that set's query rows."""
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    rows = _rows([r for i in seqs for r in range(qo[i], qo[i + 1])])
    sub_qo, sub_kv, parts = [0], [0], []
    for i in seqs:
        sub_qo.append(sub_qo[-1] + qo[i + 1] - qo[i])
        sub_kv.append(sub_kv[-1] + kv[i + 1] - kv[i])
        parts.append(kv_indices[kv[i] : kv[i + 1]])
    return (
        rows,
        torch.tensor(sub_qo, dtype=torch.int32),
        torch.tensor(sub_kv, dtype=torch.int32),
        torch.cat(parts),
        kv_last_page_len[torch.tensor(seqs)].contiguous(),
    )


def _rows(rows: list[int]) -> torch.Tensor | slice:
    """Some of a batch's rows: a slice when they are one run (the scheduler puts a step's cascade
    groups first and its sequences in order, so they mostly are): a view of q and a plain copy
    into the output then replace index_select and index_copy_. In one bf16 GSP run of ``bench
    peers`` (3.1-3.6 s) under torch.profiler, those two took 93 ms; the slices' copies 18 ms."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, dtype=torch.long)


def _take(x: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _put(out: torch.Tensor, rows: torch.Tensor | slice, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = value
    else:
        out.index_copy_(0, rows, value)
