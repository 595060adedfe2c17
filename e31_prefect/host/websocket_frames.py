"""WebSocket frames (RFC 6455) read and written whole, so the gateway can look inside each message.

Only what Prefect's events websockets use: unfragmented text frames and control frames, with no
extension (the gateway offers none upstream, so none is negotiated). Only the standard library.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

TEXT, CLOSE, PING, PONG = 0x1, 0x8, 0x9, 0xA
MAX_MESSAGE_BYTES = 16 * 2**20  # an event, a filter, a batch: far under this


class FrameError(ValueError):
    """A frame the gateway will not pass: fragmented, extended, or too large."""


@dataclass(frozen=True)
class Frame:
    """One frame: its opcode and (unmasked) payload."""

    opcode: int
    payload: bytes


def _exactly(stream: BinaryIO, count: int) -> bytes | None:
    data = stream.read(count) if count else b""
    if data is None or len(data) < count:
        return None
    return data


def read_frame(stream: BinaryIO) -> Frame | None:
    """The next frame from ``stream`` (None: the stream ended)."""
    head = _exactly(stream, 2)
    if head is None:
        return None
    fin, rsv, opcode = head[0] & 0x80, head[0] & 0x70, head[0] & 0x0F
    if not fin or rsv or opcode == 0:
        raise FrameError("fragmented or extended frames are not passed")
    masked, length = head[1] & 0x80, head[1] & 0x7F
    if length == 126:
        length = struct.unpack("!H", _exactly(stream, 2) or b"\0\0")[0]
    elif length == 127:
        length = struct.unpack("!Q", _exactly(stream, 8) or b"\0" * 8)[0]
    if length > MAX_MESSAGE_BYTES:
        raise FrameError(f"a {length}-byte message is over {MAX_MESSAGE_BYTES}")
    mask = _exactly(stream, 4) if masked else None
    payload = _exactly(stream, length)
    if payload is None or (masked and mask is None):
        return None
    return Frame(opcode, _masked(payload, mask) if mask else payload)


def encode(frame: Frame, masked: bool) -> bytes:
    """The frame as bytes on the wire; a client's frames are masked, a server's are not."""
    length = len(frame.payload)
    if length < 126:
        header = bytes([0x80 | frame.opcode, (0x80 if masked else 0) | length])
    elif length < 2**16:
        header = bytes([0x80 | frame.opcode, (0x80 if masked else 0) | 126]) + struct.pack("!H", length)
    else:
        header = bytes([0x80 | frame.opcode, (0x80 if masked else 0) | 127]) + struct.pack("!Q", length)
    if not masked:
        return header + frame.payload
    mask = os.urandom(4)
    return header + mask + _masked(frame.payload, mask)


def _masked(data: bytes, mask: bytes) -> bytes:
    """``data`` XOR the repeated 4-byte ``mask`` (masking and unmasking are the same)."""
    if not data:
        return data
    key = (mask * (len(data) // 4 + 1))[: len(data)]
    return (int.from_bytes(data, "big") ^ int.from_bytes(key, "big")).to_bytes(len(data), "big")
