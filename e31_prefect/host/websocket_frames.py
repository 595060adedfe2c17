"""WebSocket frames (RFC 6455) read and written whole, so the gateway can look inside each message, and the
:class:`Relay` that passes them between a job and the server.

Only what Prefect's events websockets use: unfragmented text frames and control frames, with no
extension (the gateway offers none upstream, so none is negotiated). Any other frame is one the gateway
cannot judge: :func:`read_head` refuses it (:class:`FrameError`, with the close code that says why) before
its payload is read, so it never reaches the server. Only the standard library.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO

from e31_prefect.host.gateway_bodies import BUDGET_WAIT_SECONDS, JUDGE_BYTES

TEXT, BINARY, CLOSE, PING, PONG = 0x1, 0x2, 0x8, 0x9, 0xA
CONTROL = (CLOSE, PING, PONG)
NORMAL, UNSUPPORTED, TOO_BIG = 1000, 1003, 1009  # close codes (RFC 6455 7.4.1)
MAX_CONTROL_BYTES = 125  # RFC 6455 5.5
# An event: Prefect's client sends none over 1,500,000 bytes (PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES); an auth
# message or a filter: a few kB. The server's events are as big.
MAX_MESSAGE_BYTES = 2 * 2**20


class FrameError(ValueError):
    """A frame the gateway will not pass: ``code`` is the close code saying why (1003: it cannot judge it,
    1009: too big)."""

    def __init__(self, reason: str, code: int = UNSUPPORTED):
        super().__init__(reason)
        self.code = code


@dataclass(frozen=True)
class Frame:
    """One frame: its opcode and (unmasked) payload."""

    opcode: int
    payload: bytes | bytearray


@dataclass(frozen=True)
class Head:
    """A frame's header: its opcode, its payload's length, and its mask (None: unmasked)."""

    opcode: int
    length: int
    mask: bytes | None


def _exactly(stream: BinaryIO, count: int) -> bytes | None:
    data = stream.read(count) if count else b""
    if data is None or len(data) < count:
        return None
    return data


def read_head(stream: BinaryIO, max_bytes: int = MAX_MESSAGE_BYTES) -> Head | None:
    """The next frame's header (None: the stream ended); a frame the gateway cannot judge, or one with
    a payload over ``max_bytes``, raises :class:`FrameError`."""
    head = _exactly(stream, 2)
    if head is None:
        return None
    fin, rsv, opcode = head[0] & 0x80, head[0] & 0x70, head[0] & 0x0F
    masked, length = head[1] & 0x80, head[1] & 0x7F
    if length == 126:
        length = struct.unpack("!H", _exactly(stream, 2) or b"\0\0")[0]
    elif length == 127:
        length = struct.unpack("!Q", _exactly(stream, 8) or b"\0" * 8)[0]
    if rsv:
        raise FrameError("a frame with extension bits (none was negotiated)")
    if opcode == BINARY:
        raise FrameError("a binary frame: Prefect's events are text")
    if opcode == 0 or opcode not in (TEXT, *CONTROL):
        raise FrameError("a continuation frame: a message comes in one frame" if opcode == 0
                         else f"a frame of reserved opcode {opcode:#x}")
    if not fin:
        raise FrameError(f"a fragmented {'control frame' if opcode in CONTROL else 'message'}: each comes whole")
    if opcode in CONTROL and length > MAX_CONTROL_BYTES:
        raise FrameError(f"a control frame of {length} bytes (at most {MAX_CONTROL_BYTES})")
    if length > max_bytes:
        raise FrameError(f"a {length}-byte message (at most {max_bytes})", TOO_BIG)
    mask = _exactly(stream, 4) if masked else None
    if masked and mask is None:
        return None
    return Head(opcode, length, mask)


def read_payload(stream: BinaryIO, head: Head) -> bytes | bytearray | None:
    """The payload of the frame ``head`` began, unmasked (None: the stream ended first); a text frame's must be
    UTF-8 (:class:`FrameError`)."""
    payload = _exactly(stream, head.length)
    if payload is None:
        return None
    payload = _masked(payload, head.mask) if head.mask else payload
    if head.opcode == TEXT and not _utf8(payload):
        del payload  # not kept by the error's traceback
        raise FrameError("a text frame that is not UTF-8")
    return payload


def read_frame(stream: BinaryIO, max_bytes: int = MAX_MESSAGE_BYTES) -> Frame | None:
    """The next frame from ``stream`` (None: the stream ended); see :func:`read_head`."""
    head = read_head(stream, max_bytes)
    payload = read_payload(stream, head) if head is not None else None
    return Frame(head.opcode, payload) if head is not None and payload is not None else None


def header(frame: Frame, mask: bytes | None) -> bytes:
    """A frame's header on the wire, its mask included."""
    length = len(frame.payload)
    first, bit = bytes([0x80 | frame.opcode]), 0x80 if mask else 0
    if length < 126:
        size = bytes([bit | length])
    elif length < 2**16:
        size = bytes([bit | 126]) + struct.pack("!H", length)
    else:
        size = bytes([bit | 127]) + struct.pack("!Q", length)
    return first + size + (mask or b"")


def send(sink: socket.socket, frame: Frame, masked: bool) -> None:
    """Send a frame on a socket; a client's frames are masked, a server's are not. Its payload is sent as it
    is (unmasked) or once masked, never joined to its header."""
    mask = os.urandom(4) if masked else None
    payload = _masked(frame.payload, mask) if mask else frame.payload
    if len(payload) < 4096:
        sink.sendall(header(frame, mask) + payload)
        return
    sink.sendall(header(frame, mask))
    sink.sendall(payload)


def encode(frame: Frame, masked: bool) -> bytes:
    """The frame as bytes on the wire; a client's frames are masked, a server's are not."""
    mask = os.urandom(4) if masked else None
    return header(frame, mask) + bytes(_masked(frame.payload, mask) if mask else frame.payload)


def close_frame(code: int, reason: str = "") -> Frame:
    """A close frame with its code and (cut to fit a control frame) reason."""
    return Frame(CLOSE, struct.pack("!H", code) + reason.encode()[: MAX_CONTROL_BYTES - 2])


def valid_close(payload: bytes | bytearray) -> bool:
    """Whether a close frame's payload is one a server reads: none, or a code it may receive and UTF-8 text."""
    if not payload:
        return True
    if len(payload) < 2:
        return False
    code = struct.unpack("!H", payload[:2])[0]
    try:
        bytes(payload[2:]).decode()
    except UnicodeDecodeError:
        return False
    return code in (1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011) or 3000 <= code <= 4999


class Relay:
    """One events websocket between a job and the server: each text message judged (the gateway's
    ``from_job`` and ``to_job``), each frame the gateway cannot judge refused (both sides closed, the job's
    with the frame's close code), everything held counted in the gateway's ``budget``."""

    def __init__(self, gateway: Any, route: str | None, job: socket.socket, upstream: socket.socket):
        self.gateway, self.route = gateway, route
        self.sides = {True: (upstream, threading.Lock()), False: (job, threading.Lock())}  # by "to the server"
        self.sent = 0  # the job's text messages so far: its first is its auth message

    def from_job(self, source: Any) -> None:
        """Pass the job's frames to the server until either side ends."""
        self._pass(source, to_server=True)

    def to_job(self, source: Any) -> None:
        """Pass the server's frames to the job until either side ends."""
        self._pass(source, to_server=False)

    def _judge(self, payload: bytes | bytearray, to_server: bool) -> bytes | bytearray | str | None:
        if not to_server:
            return self.gateway.to_job(self.route, payload)
        self.sent += 1
        return self.gateway.from_job(self.route, payload, self.sent - 1)

    def _pass(self, source: Any, to_server: bool) -> None:
        refused: tuple[int, str] | None = None
        with contextlib.suppress(OSError):
            while refused is None:
                try:
                    head = read_head(source)
                except FrameError as error:  # refused on its header: its payload is never read
                    refused = (error.code, str(error))
                    break
                if head is None:
                    break
                # The payload, unmasked, and masked again on its way: twice its size at most, and what is kept of it.
                with self.gateway.budget.hold(2 * head.length + JUDGE_BYTES, BUDGET_WAIT_SECONDS) as held:
                    try:  # within the budget's hold: an error's traceback, and the payload it keeps, go first
                        if not held:
                            raise FrameError("the job's other calls hold all the gateway may hold", TOO_BIG)
                        if not self._pass_one(source, head, to_server):
                            break
                    except FrameError as error:
                        refused = (error.code, str(error))
                    except OSError:  # either side went
                        break
        if refused is not None:
            self.gateway._refuse(f"a websocket frame {'from the job' if to_server else 'from the server'} on "
                                 f"{self.route}: {refused[1]}")
            with contextlib.suppress(OSError):
                self._send(close_frame(refused[0], f"e31: {refused[1]}"), to_server=False)
            with contextlib.suppress(OSError):
                self._send(close_frame(NORMAL), to_server=True)
        with contextlib.suppress(OSError):
            self.sides[to_server][0].shutdown(socket.SHUT_WR)

    def _pass_one(self, source: Any, head: Head, to_server: bool) -> bool:
        """Pass the frame ``head`` began, judged (False: the stream ended, or closed)."""
        payload = frame = None
        try:
            payload = read_payload(source, head)
            if payload is None:
                return False
            if head.opcode == TEXT:
                text = self._judge(payload, to_server)
                if text is None:
                    return True
                frame = Frame(TEXT, text.encode() if isinstance(text, str) else text)
            elif head.opcode == CLOSE:
                frame = Frame(CLOSE, payload) if valid_close(payload) else close_frame(NORMAL)
            else:
                frame = Frame(head.opcode, payload)
            self._send(frame, to_server)
            return head.opcode != CLOSE
        finally:  # a traceback keeps this frame: not what it held
            payload = frame = text = None

    def _send(self, frame: Frame, to_server: bool) -> None:
        sink, lock = self.sides[to_server]
        with lock:
            send(sink, frame, masked=to_server)


def _utf8(data: bytes | bytearray) -> bool:
    """Whether ``data`` is UTF-8, read a piece at a time (decoded whole, it could take four times its size)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with memoryview(data) as view:
            for at in range(0, len(data), 65536):
                decoder.decode(view[at:at + 65536])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


@functools.lru_cache(maxsize=256)
def _xor(key: int) -> bytes:
    return bytes(b ^ key for b in range(256))


def _masked(data: bytes | bytearray, mask: bytes) -> bytearray:
    """``data`` XOR the repeated 4-byte ``mask`` (masking and unmasking are the same), a quarter at a time:
    no more than the data's size again is made."""
    out = bytearray(len(data))
    for i in range(4):
        out[i::4] = data[i::4].translate(_xor(mask[i]))
    return out
