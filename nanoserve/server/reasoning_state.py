"""The reasoning a response hands a stateless client to send back with the next turn: what
`include: ["reasoning.encrypted_content"]` asks for (clients that keep no state on the server's
side, `store: false`, as Codex-style agents do).

This server keeps no responses and holds no key, so the blob is the reasoning's own text,
compressed and encoded, not encrypted: it need only come back whole. A blob from elsewhere
(OpenAI's own) cannot be read here; its item's summary or content stands in for it.
"""

from __future__ import annotations

import base64
import binascii
import zlib

from nanoserve.server.errors import APIError

PREFIX = "nanoserve-reasoning-v1."
INCLUDE = "reasoning.encrypted_content"
# text that the blobs of one request may unpack to, together: a request body's default bound (a
# blob of zeros inflates a thousandfold, and 240,000 replayed items may each carry one)
MAX_UNPACKED_BYTES = 32 << 20


def pack(text: str) -> str:
    """The blob of a reasoning's text."""
    # level 1: the blob is written on the event loop once an item closes, and its size matters less
    return PREFIX + base64.urlsafe_b64encode(zlib.compress(text.encode(), 1)).decode("ascii")


def written_here(blob: str | None) -> bool:
    """Whether a reasoning item's encrypted_content is a blob of this server's."""
    return blob is not None and blob.startswith(PREFIX)


class Unpacker:
    """Reads the blobs of one request within MAX_UNPACKED_BYTES between them."""

    def __init__(self, limit: int = MAX_UNPACKED_BYTES) -> None:
        self.limit = self.left = limit

    def text(self, blob: str, param: str) -> str | None:
        """The reasoning a blob of this server's holds; None for a blob written elsewhere."""
        if not written_here(blob):
            return None
        try:
            inflate = zlib.decompressobj()
            raw = inflate.decompress(base64.urlsafe_b64decode(blob[len(PREFIX):]), self.left + 1)
            if len(raw) > self.left:
                raise APIError(f"The replayed reasoning's blobs unpack to more than {self.limit:,} bytes of text "
                               "between them", param=param)
            if not inflate.eof:
                raise ValueError("it ends early")
            text = raw.decode()
        except (binascii.Error, zlib.error, UnicodeDecodeError, ValueError) as exc:
            raise APIError(f"This reasoning's encrypted_content is not one this server wrote whole ({exc}); send "
                           "it back as the response gave it, or leave it out", param=param) from None
        self.left -= len(raw)
        return text
