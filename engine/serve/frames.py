"""Looking into a client frame without decoding it: an oversized frame is refused
before msgspec touches it, but its answer should still name the request it carried.

A client body is a msgpack array `[tag, request_id, ...]`; `peek_request_id` reads
only the array header and the first two strings (a few dozen bytes), so a frame of
megabytes costs nothing more to answer than a small one.
"""
from __future__ import annotations

from engine.protocol import MAX_REQUEST_ID_LEN


def _str_at(body: bytes, pos: int) -> tuple[str, int] | None:
    """The msgpack str at `pos` and the position after it; None if there is none."""
    if pos >= len(body):
        return None
    head = body[pos]
    if 0xA0 <= head <= 0xBF:
        length, pos = head & 0x1F, pos + 1
    elif head == 0xD9 and pos + 2 <= len(body):
        length, pos = body[pos + 1], pos + 2
    elif head == 0xDA and pos + 3 <= len(body):
        length, pos = int.from_bytes(body[pos + 1:pos + 3], "big"), pos + 3
    elif head == 0xDB and pos + 5 <= len(body):
        length, pos = int.from_bytes(body[pos + 1:pos + 5], "big"), pos + 5
    else:
        return None
    if length > 256 or pos + length > len(body):  # tags and ids are short
        return None
    try:
        return body[pos:pos + length].decode(), pos + length
    except UnicodeDecodeError:
        return None


def peek_request_id(body: bytes) -> str:
    """The request id of a `[tag, request_id, ...]` body, or "" if it has none."""
    if not body:
        return ""
    head = body[0]
    if 0x92 <= head <= 0x9F:
        pos = 1
    elif head == 0xDC and len(body) >= 3 and int.from_bytes(body[1:3], "big") >= 2:
        pos = 3
    elif head == 0xDD and len(body) >= 5 and int.from_bytes(body[1:5], "big") >= 2:
        pos = 5
    else:
        return ""
    tag = _str_at(body, pos)
    if tag is None or tag[0] not in ("submit", "cancel", "delivered"):
        return ""
    request_id = _str_at(body, tag[1])
    if request_id is None or not 0 < len(request_id[0]) <= MAX_REQUEST_ID_LEN:
        return ""
    return request_id[0]
