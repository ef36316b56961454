"""Request bodies of every HTTP endpoint that takes one (the scheduler verbs, the admission webhook): read with a
size limit, then decoded as JSON, with a typed error naming what is wrong.

Kept apart from extender.wire (the scheduler verbs' shapes) so the webhook reads its body the same way without
importing anything that talks to the API server.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request


class BadRequest(ValueError):
    """The body is not JSON or not the shape expected; answered with HTTP 400."""


class BodyTooLarge(ValueError):
    """The body exceeds the configured limit; answered with HTTP 413."""


GZIP_MAGIC = b"\x1f\x8b"


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused as soon as it is known to exceed `limit` bytes (by Content-Length, else while
    streaming), so a client cannot make the process hold more than `limit` for it."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(f"body of {length} bytes exceeds the limit of {limit} bytes")
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # the client went away or broke the framing mid-body: its fault, not an internal error
        raise BadRequest(f"the body ended early after {size} bytes (client disconnected)") from None
    return b"".join(chunks)


def decode(body: bytes) -> Any:
    """The body's JSON value. Raises BadRequest: empty, compressed, not UTF-8, not JSON."""
    if not body:
        raise BadRequest("empty body: expected a JSON object")
    if body.startswith(GZIP_MAGIC):
        raise BadRequest("body is gzip-compressed; kube-scheduler and kube-apiserver send plain JSON and so must any "
                         "other client (Content-Encoding is not supported)")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if "UTF-8" in str(e) or "surrogates" in str(e):
            raise BadRequest("body is not UTF-8 text, so not JSON (is it compressed or binary?)") from None
        raise BadRequest(f"body is not valid JSON: {e}") from None
