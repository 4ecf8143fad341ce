"""Serving: the router (``router.py``), worker processes (``worker.py``), routing policies and the
router's mirror of each worker's prefix cache (``routing.py``), metrics (``metrics.py``).

Processes: ``radixserve serve`` runs the router (asyncio on uvloop) and starts N workers, each
one Engine; ``radixserve worker --router ADDR`` joins one from anywhere. Sockets: the router
binds one ZMQ ROUTER socket; clients and workers connect DEALER sockets. Messages: msgspec
Structs as msgpack (``radixserve/protocol.py``).
"""
