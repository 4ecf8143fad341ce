"""The gateway's fast refusal: a completion that the in-process router would refuse ``overloaded``
is answered 503 at once, before routing, body and checks.

A burst drained at the gateway's cost per request, one request after another, and its 503s left
only once the whole burst had been taken in (issue 49; bench/RESULTS.md section 43). The router
publishes what it would answer a new job (:class:`~radixserve.serve.router.admission.AdmissionView`);
:class:`Shedder` reads it per request's tenant. The httptools protocol asks it as soon as a request
head is in (:mod:`~radixserve.serve.openai.protocols`); :meth:`Shedder.wrap` asks it in front of the
ASGI app for the h11 protocol. A request without a valid key is never shed: the app answers 401.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from radixserve.errors import OverloadedError
from radixserve.serve.openai.errors import APIError, api_error_from
from radixserve.serve.openai.tenants import Tenants
from radixserve.serve.router.admission import http_tenant

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # the routes shed: path -> metrics route


class Shedder:
    """``admission(tenant)``: True when the router would certainly refuse a new job of that queue
    share (serve passes its router's ``AdmissionView.refuses``); ``count(route, status)`` counts a
    request answered (the gateway's metrics)."""

    def __init__(self, admission: Callable[[str], bool], tenants: Tenants, count: Callable[[str, int], None]):
        self.admission, self.tenants, self.count = admission, tenants, count

    def response(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """(status, headers, body) of the fast refusal: 503 ``overloaded`` with Retry-After."""
        err = api_error_from(OverloadedError("all workers are at their in-flight cap and the router queue is full; retry later or add workers"))
        body = msgspec.json.encode(err.body())
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        return err.status, headers + [(k.lower().encode(), v.encode()) for k, v in err.headers.items()], body

    def shed(self, path: str, headers) -> bool:
        """Whether a POST to ``path`` with ``headers`` (lower-case names) is a completion the router
        would refuse now: then it is counted as answered 503, and the caller (:meth:`wrap`'s app, or
        the HTTP protocol as soon as the head is in) answers :meth:`response`."""
        route = ROUTES.get(path)
        if route is None or not self._refused(headers):
            return False
        self.count(route, 503)
        return True

    def _refused(self, headers) -> bool:
        auth = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), None)
        try:
            tenant = self.tenants.authenticate(auth)
        except APIError:
            return False
        return self.admission(http_tenant(self.tenants.namespace(tenant)))

    def wrap(self, app):
        """``app`` (ASGI) behind the fast refusal."""
        status, headers, body = self.response()
        start = {"type": "http.response.start", "status": status, "headers": headers}
        done = {"type": "http.response.body", "body": body}

        async def shedding(scope, receive, send):
            if scope["type"] == "http" and scope["method"] == "POST" and self.shed(scope["path"], scope["headers"]):
                await send(start)
                await send(done)
                return
            await app(scope, receive, send)

        return shedding
