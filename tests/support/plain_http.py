"""One-off HTTP requests for tests, as httpx's functions (``httpx.get`` ...) make them, without their cost: each of
those builds a Client and with it an SSL context, about 47 ms of CPU a call here, so a loop polling a starting
process every 0.1 s spent half a core on it. These share one client that keeps no connection open (each request
gets a fresh one, as with ``httpx.get``), with httpx's defaults otherwise (5 s timeout, no redirects followed)."""

from __future__ import annotations

import httpx

_client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))

get = _client.get
post = _client.post
put = _client.put
delete = _client.delete
stream = _client.stream
