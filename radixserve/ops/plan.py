"""KV capacity planning: what fits in a GPU's memory for a given model (``radixserve plan``).

KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element. What is left
of the memory after the weights and an activation/overhead reserve holds KV pages of
``page_size`` tokens; a sequence of N tokens takes ceil(N / page_size) pages. A quantized cache
(int8 / fp8) stores 1 byte per element plus one float32 scale per token, per KV head, per layer,
for K and for V.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from radixserve.errors import BadRequestError
from radixserve.ops.model_shape import ModelShape

KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}
QUANTIZED = ("int8", "fp8")
SCALE_BYTES = 4  # one float32 scale per (token, KV head, layer, K|V) for int8 / fp8
RESERVE_FRACTION = 0.15  # of the memory left after weights: what the engine leaves free on CUDA
COMFORT_CONTEXTS = (2048, 8192, 32768)
COMFORT_CONCURRENCY = (1, 8, 32, 128)
GiB = 2**30


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str) -> int:
    """2 x layers x kv_heads x head_dim x bytes, plus the scales of a quantized cache."""
    elems = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    scales = 2 * shape.num_layers * shape.num_kv_heads * SCALE_BYTES if kv_dtype in QUANTIZED else 0
    return elems * KV_DTYPE_BYTES[kv_dtype] + scales


def kv_formula(shape: ModelShape, kv_dtype: str) -> str:
    s = shape
    text = f"2 x {s.num_layers} layers x {s.num_kv_heads} kv_heads x {s.head_dim} head_dim x {KV_DTYPE_BYTES[kv_dtype]} B ({kv_dtype})"
    if kv_dtype in QUANTIZED:
        text += f" + 2 x {s.num_layers} x {s.num_kv_heads} x {SCALE_BYTES} B scales"
    return f"{text} = {kv_bytes_per_token(shape, kv_dtype):,} B/token"


@dataclass(frozen=True)
class Budget:
    kv_dtype: str
    bytes_per_token: int
    page_bytes: int
    pages: int
    tokens: int  # whole pages only

    def pages_for(self, context: int, page_size: int) -> int:
        return -(-context // page_size)

    def sequences(self, context: int, page_size: int) -> int:
        return self.pages // self.pages_for(context, page_size)


def _budget(shape: ModelShape, kv_dtype: str, kv_bytes: int, page_size: int) -> Budget:
    per = kv_bytes_per_token(shape, kv_dtype)
    page = per * page_size
    pages = max(0, kv_bytes) // page
    return Budget(kv_dtype, per, page, pages, pages * page_size)


def plan(
    shape: ModelShape,
    *,
    context: int | None = None,
    concurrency: int = 1,
    memory_gb: float = 24.0,
    kv_dtype: str | None = None,
    page_size: int = 1,
    reserve_gb: float | None = None,
) -> dict[str, Any]:
    """The capacity plan as a JSON-able dict (every byte figure in bytes, every size in tokens)."""
    kv_dtype = kv_dtype or (shape.weights_dtype if shape.weights_dtype in KV_DTYPE_BYTES else "float16")
    if kv_dtype not in KV_DTYPE_BYTES:
        raise BadRequestError("kv_dtype", f"must be one of {sorted(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    if not memory_gb > 0:
        raise BadRequestError("memory_gb", f"must be > 0, got {memory_gb!r}")
    if page_size < 1 or concurrency < 1:
        raise BadRequestError("page_size" if page_size < 1 else "concurrency", "must be >= 1")
    context = context or shape.max_context
    if context < 1:
        raise BadRequestError("context", f"must be >= 1, got {context!r}")
    memory = int(memory_gb * GiB)
    after_weights = memory - shape.weights_bytes
    reserve = int(reserve_gb * GiB) if reserve_gb is not None else int(max(0, after_weights) * RESERVE_FRACTION)
    kv_bytes = max(0, after_weights - reserve)
    main = _budget(shape, kv_dtype, kv_bytes, page_size)
    pages_per_seq = main.pages_for(context, page_size)
    waste_per_seq = pages_per_seq * page_size - context
    need_tokens = concurrency * pages_per_seq * page_size
    need_bytes = concurrency * pages_per_seq * main.page_bytes
    max_ctx = min(shape.max_context, (main.pages // concurrency) * page_size)

    quantized = {}
    for q in QUANTIZED:
        b = _budget(shape, q, kv_bytes, page_size)
        quantized[q] = {
            "bytes_per_token": b.bytes_per_token,
            "formula": kv_formula(shape, q),
            "scale_bytes_per_token": 2 * shape.num_layers * shape.num_kv_heads * SCALE_BYTES,
            "kv_tokens": b.tokens,
            "sequences_at_context": b.sequences(context, page_size),
            "capacity_gain": (b.tokens / main.tokens) if main.tokens else None,
            "note": (
                "radixserve's --kv-dtype int8 stores exactly this layout"
                if q == "int8"
                else "planning figure: the same layout in fp8 (e4m3); radixserve's engine has int8"
            ),
        }
    int8 = _budget(shape, "int8", kv_bytes, page_size)
    comfort = []
    for ctx in COMFORT_CONTEXTS:
        for c in COMFORT_CONCURRENCY:
            need = c * main.pages_for(ctx, page_size) * main.page_bytes
            comfort.append(
                {
                    "context": ctx,
                    "concurrency": c,
                    "kv_bytes": need,
                    "within_model_context": ctx <= shape.max_context,
                    "share_of_kv_budget": (need / kv_bytes) if kv_bytes else None,
                    "fits": main.sequences(ctx, page_size) >= c if main.pages else False,
                    "fits_int8": int8.sequences(ctx, page_size) >= c if int8.pages else False,
                }
            )
    return {
        "model": asdict(shape),
        "inputs": {
            "context": context,
            "concurrency": concurrency,
            "memory_gb": memory_gb,
            "kv_dtype": kv_dtype,
            "page_size": page_size,
            "reserve_gb": reserve_gb,
        },
        "memory_bytes": memory,
        "weights_bytes": shape.weights_bytes,
        "reserve_bytes": reserve,
        "reserve_rule": (
            f"{reserve_gb} GiB (--reserve-gb)"
            if reserve_gb is not None
            else f"{RESERVE_FRACTION:.0%} of the memory left after weights (activations, allocator, CUDA context; what the engine leaves free on CUDA)"
        ),
        "kv_budget_bytes": kv_bytes,
        "weights_fit": after_weights > 0,
        "kv_bytes_per_token": main.bytes_per_token,
        "kv_formula": kv_formula(shape, kv_dtype),
        "kv_tokens": main.tokens,
        "kv_pages": main.pages,
        "page_bytes": main.page_bytes,
        "context_exceeds_model": context > shape.max_context,
        "sequences_at_context": main.sequences(context, page_size),
        "request": {
            "kv_tokens": need_tokens,
            "kv_bytes": need_bytes,
            "fits": need_tokens <= main.tokens,
            "share_of_kv_budget": (need_bytes / kv_bytes) if kv_bytes else None,
            "max_context_at_concurrency": max_ctx,
        },
        "page_waste": {
            "tokens_per_sequence_at_context": waste_per_seq,
            "bytes_at_concurrency": concurrency * waste_per_seq * main.bytes_per_token,
            "mean_tokens_per_sequence": (page_size - 1) / 2,
            "mean_share": ((page_size - 1) / 2) / (pages_per_seq * page_size),
        },
        "quantized": quantized,
        "comfort": comfort,
    }


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def format_plan(p: dict[str, Any]) -> str:
    """The plan for people (every number with its unit)."""
    m, i, r, w = p["model"], p["inputs"], p["request"], p["page_waste"]
    tensors = f"{m['num_tensors']} tensors" if m["num_tensors"] else "estimated"
    if m.get("num_quantized"):  # a GGUF: most tensors stay in their blocks
        dtype = f"{m['num_quantized']} in quantized blocks, the rest {m['weights_dtype']}"
    else:
        dtype = m["weights_dtype"]
    lines = [
        f"model       {m['name']} ({m['architecture']}; {m['num_layers']} layers, {m['num_heads']} heads, "
        f"{m['num_kv_heads']} KV heads, head_dim {m['head_dim']}, context {m['max_context']:,} tokens)",
        f"            read from the {m['source']}, weights not loaded",
        f"memory      {_size(p['memory_bytes'])} = weights {_size(p['weights_bytes'])} ({tensors}, "
        f"{dtype}) + reserve {_size(p['reserve_bytes'])} + KV {_size(p['kv_budget_bytes'])}",
        f"            reserve: {p['reserve_rule']}",
    ]
    if not p["weights_fit"]:
        lines.append("            the weights alone do not fit: no room for KV; use a larger --memory-gb or a smaller model")
    lines += [
        f"KV / token  {p['kv_formula']}",
        f"KV budget   {p['kv_tokens']:,} tokens in {p['kv_pages']:,} pages of {i['page_size']} token(s) "
        + (f"({_size(p['page_bytes'])} per page)" if i["page_size"] > 1 else "(page size 1: no alignment waste)"),
        f"at {i['context']:,} tokens of context: {p['sequences_at_context']:,} sequences fit"
        + ("  (beyond the model's context!)" if p["context_exceeds_model"] else ""),
        f"{i['concurrency']} x {i['context']:,} tokens needs {r['kv_tokens']:,} tokens = {_size(r['kv_bytes'])}: "
        + (f"fits ({r['share_of_kv_budget']:.1%} of the KV budget)" if r["fits"] else "does NOT fit")
        + f"; longest context at concurrency {i['concurrency']}: {r['max_context_at_concurrency']:,} tokens",
        f"page waste  {w['tokens_per_sequence_at_context']} tokens per sequence at this context "
        f"({_size(w['bytes_at_concurrency'])} over {i['concurrency']} sequences); "
        f"mean {w['mean_tokens_per_sequence']:.1f} tokens per sequence for random lengths ({w['mean_share']:.2%})",
    ]
    for q, d in p["quantized"].items():
        gain = f"{d['capacity_gain']:.2f}x the tokens" if d["capacity_gain"] else "n/a"
        lines.append(
            f"KV {q:<8} {d['formula']} (scales {d['scale_bytes_per_token']} B/token): "
            f"{d['kv_tokens']:,} tokens, {gain}, {d['sequences_at_context']:,} sequences at {i['context']:,}" + ("" if q == "int8" else f" ({d['note']})")
        )
    conc = COMFORT_CONCURRENCY
    lines.append("")
    lines.append(f"comfort table ({i['kv_dtype']} KV; ok = fits, int8 = fits only with --kv-dtype int8, no = does not fit; % of the KV budget)")
    lines.append("context  " + "".join(f"{f'x{c}':>14}" for c in conc))
    for ctx in COMFORT_CONTEXTS:
        cells = []
        for row in p["comfort"]:
            if row["context"] != ctx:
                continue
            tag = "ok" if row["fits"] else ("int8" if row["fits_int8"] else "no")
            share = row["share_of_kv_budget"]
            cells.append(f"{tag} {share:.0%}" if share is not None else tag)
        note = "" if ctx <= m["max_context"] else "  (beyond the model's context)"
        lines.append(f"{_k(ctx):>7}  " + "".join(f"{c:>14}" for c in cells) + note)
    return "\n".join(lines)
