"""Serving: the router (``router/``), worker processes (``worker.py``), routing policies and the
router's mirror of each worker's prefix cache (``routing.py``), worker authentication
(``auth.py``), the supervisor of local workers (``supervisor.py``), the OpenAI HTTP gateway
(``openai/``), metrics through prometheus-client (``metrics.py``).

Processes: ``radixserve serve`` runs the router (asyncio on uvloop) and starts N supervised
workers, each one Engine; ``radixserve worker --router WORKER_ADDR --secret-file F`` joins one
from anywhere. Sockets: the router binds a client ROUTER socket and a CURVE-authenticated worker
ROUTER socket; clients and workers connect DEALER sockets. Messages: msgspec Structs as msgpack
(``radixserve/protocol.py``). See docs/ARCHITECTURE.md.
"""
