"""Marks a drawing with the digest of the dot source it was drawn from, so a test can tell
a stale svg or png without running Graphviz (whose bytes differ between its versions).

Rules: the mark is the text ``moriio-fsm diagram source sha256: <hex>``; in an svg an XML
comment right after the XML declaration, in a png a ``tEXt`` chunk (keyword ``Comment``)
right after the header chunk. Anything else is returned unmarked.
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib

DIGEST_MARK = "moriio-fsm diagram source sha256:"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: The signature, then the header chunk: length, type, 13 bytes of data, CRC.
PNG_HEADER_END = len(PNG_SIGNATURE) + 4 + 4 + 13 + 4


def source_digest(dot_source: str) -> str:
    return hashlib.sha256(dot_source.encode()).hexdigest()


def stamp(drawn: bytes, dot_source: str) -> bytes:
    """``drawn`` (svg or png) marked with the digest of ``dot_source``."""
    mark = f"{DIGEST_MARK} {source_digest(dot_source)}"
    if drawn.startswith(PNG_SIGNATURE):
        data = b"Comment\0" + mark.encode()
        chunk = (
            struct.pack(">I", len(data))
            + b"tEXt"
            + data
            + struct.pack(">I", zlib.crc32(b"tEXt" + data))
        )
        return drawn[:PNG_HEADER_END] + chunk + drawn[PNG_HEADER_END:]
    if drawn.lstrip().startswith((b"<?xml", b"<svg", b"<!--")):
        comment = f"<!-- {mark} -->\n".encode()
        head, sep, rest = drawn.partition(b"?>\n")
        return head + sep + comment + rest if sep else comment + drawn
    return drawn


def drawing_digest(drawn: bytes) -> str | None:
    """The source digest a drawing was marked with, or None."""
    found = re.search(rf"{DIGEST_MARK} ([0-9a-f]{{64}})".encode(), drawn)
    return found.group(1).decode() if found else None
