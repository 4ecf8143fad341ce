"""OpenAI-compatible HTTP gateway in front of the router (``radixserve serve --http-port 8000``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true``:
server-sent events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` and ``GET /metrics`` (Prometheus text of the router's stats plus the gateway's
own request counters; with API keys configured it needs a key, as ``/v1/*`` does).

Modules: :mod:`.schema` (request bodies as msgspec Structs -> SamplingParams), :mod:`.responses`
(response bodies), :mod:`.prompts` (prompts, chat templates), :mod:`.tenants` (API keys ->
cache namespaces), :mod:`.errors` (OpenAI's error shape), :mod:`.app` (the Starlette app),
:mod:`.streaming` (server-sent events), :mod:`.server` (uvicorn on its own thread).

Decisions (see the README's "HTTP API" section):

- Unknown top-level fields are ignored, like vLLM (the OpenAI API itself rejects them; tools that
  speak to many providers send extras) — each ignored name is logged once and listed in the
  ``X-Radixserve-Ignored-Fields`` response header (so their names must be printable ASCII: else
  400). Known OpenAI fields this server cannot honour
  (``logit_bias``, ``suffix``, ``echo``, ``best_of > n``, ...) are refused with 400
  naming the field rather than silently dropped.
- Tool calling: chat ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (and the deprecated
  ``functions`` / ``function_call``), checked, rendered, constrained and parsed by
  :mod:`radixserve.tools` (shared with the SDK); responses carry ``tool_calls``, streams OpenAI's
  tool-call deltas.
- Structured output: chat's ``response_format`` (``json_object``, ``json_schema``) and vLLM's
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` (both endpoints) become
  ``SamplingParams.structured`` (xgrammar token masks in the worker's sampler).
- Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 bad field
  (the prompt, or the prompt plus ``max_tokens``, longer than the context: 400
  ``context_length_exceeded`` with the numbers, as OpenAI and vLLM do), 401
  missing/wrong key, 404 unknown model or route, 405, 413 body over ``max_body_bytes``, 503 with
  ``Retry-After`` when the fleet is overloaded, shutting down or has no live worker, 500 else.
- Tenants (:mod:`.tenants`): each API key maps to a tenant whose requests carry a namespace derived
  on the server, so tenants never share cached prefixes. The client cannot choose its namespace
  (``user`` is accepted and ignored).
- ``n > 1`` runs n requests; with a ``seed``, choice i uses ``seed + i`` (reproducible, yet the
  choices differ). Usage counts each prompt once (``cached_tokens``: the smallest over its choices).
"""

from radixserve.serve.openai.app import MAX_CHOICES, Gateway, GatewayConfig
from radixserve.serve.openai.errors import APIError, api_error_from, bad
from radixserve.serve.openai.server import GatewayServer, start_gateway
from radixserve.serve.openai.tenants import DEFAULT_TENANT, Tenants, load_keys_file, tenant_for_key

__all__ = [
    "APIError",
    "DEFAULT_TENANT",
    "Gateway",
    "GatewayConfig",
    "GatewayServer",
    "MAX_CHOICES",
    "Tenants",
    "api_error_from",
    "bad",
    "load_keys_file",
    "start_gateway",
    "tenant_for_key",
]
