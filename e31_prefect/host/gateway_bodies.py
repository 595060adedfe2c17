"""A job's bodies as its gateway holds them: one byte budget for all its connections, JSON read only as far as
the judge looks.

The gateway runs in the run's supervisor, outside the job's memory limit. So what a job sends it is bounded
three ways: each route's body has a cap (:mod:`e31_prefect.host.gateway_rules`), everything held at once, all
connections together, comes out of one :class:`Budget`, and a body is judged by :func:`read_json`, which
keeps only the parts its route's judge reads (the rest of it is scanned, never built into objects) and
stops at :data:`KEPT_BYTES` of what it keeps. A megabyte of ``[{},{},...]`` or of small keys is then a
megabyte, not the few hundred Python's ``json`` would make of it.

Only the standard library: it runs in the supervisor.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

MiB = 2**20
MAX_DEPTH = 64  # arrays and objects inside each other: Prefect's calls nest a few levels
MAX_NAME = 256  # a key a judge reads is a field's name: a longer key is passed over unread
KEPT_BYTES = 1 * MiB  # what a judge keeps of one body (ids, keys, states, tags); its bulk (messages, data) is not kept
JUDGE_BYTES = 2 * KEPT_BYTES  # what judging one body may build at once: what it keeps, and small pieces built then cut
BUDGET_WAIT_SECONDS = 30.0  # a call waits this long for room in the budget, then is refused (503: Prefect tries again)

WHOLE = "whole"  # a read: the value whole (within KEPT_BYTES)
EVERY_KEY = ...  # in an object's read: every key is kept, its value NOT_READ unless named


class _NotRead:
    """A value the judge does not read: it is there, and equal to nothing a judge allows."""

    def __repr__(self) -> str:
        return "<not read>"


NOT_READ = _NotRead()


class BodyRefused(Exception):
    """A body the gateway will not judge: the status to answer and a reason the job can read."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


class Budget:
    """The bytes a gateway holds at once, over all its connections (bodies, answers, websocket messages)."""

    def __init__(self, total: int):
        self.total = total
        self.held = 0
        self.peak = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def hold(self, size: int, wait: float) -> Iterator[bool]:
        """Hold ``size`` bytes while the block runs; yields False (holding nothing) if there is no room
        within ``wait`` seconds. A size over the whole budget never fits: callers cap sizes below it."""
        with self._changed:
            held = size <= self.total and self._changed.wait_for(lambda: self.held + size <= self.total, wait)
            if held:
                self.held += size
                self.peak = max(self.peak, self.held)
        try:
            yield held
        finally:
            if held:
                with self._changed:
                    self.held -= size
                    self._changed.notify_all()


_WS = rb"[ \t\n\r]*"
_STRING = rb'"(?:[^"\\]++|\\.)*+"'
_OTHER = rb"-?(?:0|[1-9][0-9]*+)(?:\.[0-9]++)?(?:[eE][+-]?[0-9]++)?|true|false|null|NaN|-?Infinity"
_SCALAR = re.compile(_WS + rb"(?:(" + _STRING + rb")|(" + _OTHER + rb"))", re.S)
# One member of an object: its key, then its value's scalar and the comma or brace after it, or its opening bracket.
_MEMBER = re.compile(_WS + rb'"((?:[^"\\]++|\\.)*+)"' + _WS + rb":" + _WS + rb"(?:(?:(" + _STRING + rb")|(" + _OTHER
                     + rb"))" + _WS + rb"([,}])|([\[{]))", re.S)
_NEXT = re.compile(_WS + rb"([,\]}])")
_OPEN = re.compile(_WS + rb"([\[{])")
_END = re.compile(_WS + rb"\Z")
_PLAIN = rb'(?:[^"\[\]{}]++|' + _STRING + rb")"


_LEVELS = (0, 1, 2, 4, 8, 16, 32, MAX_DEPTH - 1)


def _nested(levels: int) -> bytes:
    """A pattern for anything but a bracket, strings whole, and arrays and objects nested ``levels`` deep."""
    pattern = _PLAIN + rb"*+"
    for _ in range(levels):
        pattern = rb"(?:" + _PLAIN + rb"|[\[{]" + pattern + rb"[\]}])*+"
    return pattern


@functools.cache
def _skipper(room: int) -> re.Pattern[bytes]:
    """What passes over arrays and objects nested no deeper than ``room`` allows (and all else) in one match:
    deeper ones stop it at their bracket. One of eight patterns, each compiled when first needed (a few
    hundred kB in all)."""
    levels = max(level for level in _LEVELS if level <= room)
    return _skipper(levels) if levels != room else re.compile(_nested(levels), re.S)


@functools.cache
def _items(room: int) -> re.Pattern[bytes]:
    """Whole items of an array, each with its comma, nested no deeper than ``room`` allows (as :func:`_skipper`)."""
    levels = max(level for level in _LEVELS if level < room) if room > 0 else -1
    if levels < 0:
        return re.compile(rb"(?:" + _WS + rb"(?:" + _STRING + rb"|" + _OTHER + rb")" + _WS + rb",)*+", re.S)
    if levels != room - 1:
        return _items(levels + 1)
    item = rb"[\[{]" + _nested(levels) + rb"[\]}]|" + _STRING + rb"|" + _OTHER
    return re.compile(rb"(?:" + _WS + rb"(?:" + item + rb")" + _WS + rb",)*+", re.S)


WINDOW = 256 * 1024  # what one match of a skipper looks at: the interpreter is let go between windows
SMALL_BYTES = 4096  # an array or object this small is read by Python's json, then cut to its read
BATCH_BYTES = 16 * 1024  # an array's small items read by Python's json at once (what it builds of them: < 1 MiB)


class _NotJSON(Exception):
    pass


_scan = json.JSONDecoder().scan_once  # one value from a str (C), as json.loads reads it


def _size(value: Any) -> int:
    """The bytes a value built by Python's json takes, what it holds included."""
    if isinstance(value, dict):
        return sys.getsizeof(value) + sum(_size(k) + _size(v) for k, v in value.items())
    if isinstance(value, list):
        return sys.getsizeof(value) + sum(_size(v) for v in value)
    return sys.getsizeof(value)


class _Reader:
    """One body, read once from the start: only what its read asks for is built."""

    def __init__(self, data: bytes | bytearray, kept_bytes: int):
        self.data = data
        self.left = kept_bytes
        self.names: dict[str, str] = {}  # each key's text once per body
        self.seen: dict[tuple[Any, ...], dict[str, Any]] = {}  # equal small objects (a batch's logs) kept once

    def keep(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            raise BodyRefused(413, f"more of it than the gateway reads to judge a call ({KEPT_BYTES} bytes of ids, "
                                   "keys, states and tags)")

    def value(self, at: int, read: Any, depth: int) -> tuple[Any, int]:
        opened = _OPEN.match(self.data, at)
        if opened is None:
            scalar = _SCALAR.match(self.data, at)
            if scalar is None:
                raise _NotJSON
            group = 1 if scalar.start(1) >= 0 else 2
            return (self.scalar(scalar, group) if read is not None else NOT_READ), scalar.end()
        if depth >= MAX_DEPTH:
            raise BodyRefused(413, f"nested deeper than {MAX_DEPTH}")
        start, inside = opened.start(1), opened.end()
        kind = dict if opened.group(1) == b"{" else list
        if read is None or read is not WHOLE and not isinstance(read, kind):
            return NOT_READ, self.skip(inside, depth + 1)
        end = self.skip(inside, depth + 1, within=SMALL_BYTES)
        if end is not None:  # small: Python's json builds it (a few kB at most), only its read is kept
            try:
                built, length = _scan(self.data[start:end].decode(), 0)
            except (StopIteration, ValueError, RecursionError):
                raise _NotJSON from None
            if length != end - start:  # not the same end: not the same value
                raise _NotJSON
            return self.cut(built, read), end
        if kind is dict:
            return self.object(inside, read, depth + 1)
        return self.array(inside, WHOLE if read is WHOLE else read[0], depth + 1)

    def room(self, match: re.Match[bytes], group: int) -> None:
        """Refuse a string before it is copied or built if it may not fit: one character past Latin-1 makes
        each of its characters 4 bytes."""
        if 4 * (match.end(group) - match.start(group)) + 64 > self.left:
            self.keep(4 * (match.end(group) - match.start(group)) + 64)

    def scalar(self, match: re.Match[bytes], group: int) -> Any:
        """A string or other scalar that is kept."""
        self.room(match, group)
        raw = match.group(group)
        value = self.text(raw, quoted=True) if raw[:1] == b'"' else self.number(raw)
        self.keep(sys.getsizeof(value))
        return value

    @staticmethod
    def text(raw: bytes | bytearray, quoted: bool) -> str:
        try:
            if b"\\" not in raw:
                return bytes(raw[1:-1] if quoted else raw).decode()
            return json.loads(raw if quoted else b'"' + raw + b'"')
        except ValueError:  # not UTF-8, or a bad escape
            raise _NotJSON from None

    @staticmethod
    def number(raw: bytes | bytearray) -> Any:
        try:
            return json.loads(raw)
        except ValueError:  # an integer of more than 4,300 digits
            raise _NotJSON from None

    def name(self, text: str) -> str:
        known = self.names.get(text)
        if known is None:
            self.keep(sys.getsizeof(text))
            known = self.names[text] = text
        return known

    def skip(self, at: int, depth: int, within: int | None = None) -> int | None:
        """Past the array or object opened just before ``at``, building nothing (its nesting still counts).
        With ``within``: None if it goes on for more bytes than that."""
        opened, size = depth, len(self.data)
        stop = size if within is None else min(size, at + within)
        while True:
            at = _skipper(MAX_DEPTH - depth).match(self.data, at, min(stop, at + WINDOW)).end()
            if at >= stop:
                if at >= size:
                    raise _NotJSON
                if within is not None:
                    return None
                continue
            char = self.data[at]
            if char == 0x22:  # a string longer than the window (or never closed)
                string = _SCALAR.match(self.data, at, stop)
                if string is None or string.group(1) is None:
                    if within is not None:
                        return None
                    raise _NotJSON
                at = string.end()
                continue
            if char in b"[{":
                depth += 1
                if depth > MAX_DEPTH:
                    raise BodyRefused(413, f"nested deeper than {MAX_DEPTH}")
            elif char in b"]}":
                depth -= 1
                if depth < opened:
                    return at + 1
            at += 1

    def cut(self, value: Any, read: Any) -> Any:
        """A value Python's json built, cut to its read (as :meth:`object` and :meth:`array` would read it)."""
        if read is WHOLE:
            self.keep(_size(value))
            return value
        if isinstance(value, dict):
            if not isinstance(read, dict):
                return NOT_READ
            left, found = self.left, {}
            # Its keys in its order where every key is kept; else only the keys read (most objects have more).
            for key in value if EVERY_KEY in read else [key for key in read if key in value]:
                wanted = read.get(key)
                self.keep(64)  # its place in the object
                found[self.name(key)] = NOT_READ if wanted is None else self.cut(value[key], wanted)
            return self.shared(found, left)
        if isinstance(value, list):
            if not isinstance(read, list):
                return NOT_READ
            found_items = []
            for inner in value:
                self.keep(16)  # its place in the list, and the time to read it
                found_items.append(self.cut(inner, read[0]))
            return found_items
        self.keep(sys.getsizeof(value))
        return value

    def object(self, at: int, read: Any, depth: int) -> tuple[Any, int]:
        found: dict[str, Any] = {}
        left, every = self.left, read is WHOLE or EVERY_KEY in read
        closed = _NEXT.match(self.data, at)
        if closed is not None and closed.group(1) == b"}":
            return self.shared(found, left), closed.end()
        while True:
            member = _MEMBER.match(self.data, at)
            if member is None:
                raise _NotJSON
            if every or member.end(1) - member.start(1) <= MAX_NAME:
                self.room(member, 1)
                key = self.text(member.group(1), quoted=False)
                wanted = WHOLE if read is WHOLE else read.get(key)
            else:  # longer than any key a judge reads: neither copied nor decoded
                key, wanted = "", None
            kept = every or wanted is not None
            self.keep(64 if kept else 16)  # its place in the object; one passed over counts too (its time)
            if member.group(5) is None:  # a scalar, and the comma or brace after it
                value = self.scalar(member, 2 if member.start(2) >= 0 else 3) if wanted is not None else NOT_READ
                at, after = member.end(), member.group(4)
            else:
                value, at = self.value(member.start(5), wanted, depth)
                closing = _NEXT.match(self.data, at)
                if closing is None or closing.group(1) == b"]":
                    raise _NotJSON
                at, after = closing.end(), closing.group(1)
            if kept:
                found[self.name(key)] = value  # the last of a key given twice, as Python's json (the server) has it
            if after == b"}":
                return self.shared(found, left), at

    def shared(self, found: dict[str, Any], left: int) -> dict[str, Any]:
        """The object, or an equal one kept before (``left``: the room there was before it was read): a batch
        of logs of a few runs keeps a few objects."""
        if len(found) > 8 or not all(isinstance(v, (str, int, float, type(None), _NotRead)) for v in found.values()):
            self.keep(sys.getsizeof(found))
            return found
        same = tuple((k, type(v), v) for k, v in found.items())  # True and 1 are equal, yet not the same
        kept = self.seen.get(same)
        if kept is not None:
            self.left = left  # its values and places were counted while read: only the one kept counts
            return kept
        self.keep(sys.getsizeof(found) + sys.getsizeof(same))
        self.seen[same] = found
        return found

    def array(self, at: int, read: Any, depth: int) -> tuple[Any, int]:
        found: list[Any] = []
        closed = _NEXT.match(self.data, at)
        if closed is not None and closed.group(1) == b"]":
            return found, closed.end()
        while True:
            # Its next whole items, up to BATCH_BYTES of them, built by Python's json at once and cut to their read
            # (a batch of logs is thousands of small objects); a bigger or deeper one, or the last, alone.
            items = _items(MAX_DEPTH - depth).match(self.data, at, min(len(self.data), at + BATCH_BYTES)).end()
            if items > at:
                try:
                    built = _scan("[" + bytes(self.data[at:items - 1]).decode() + "]", 0)[0]
                except (StopIteration, ValueError, RecursionError):
                    raise _NotJSON from None
                for item in built:
                    self.keep(16)  # its place in the list, and the time to read it
                    found.append(self.cut(item, read))
                at = items
                continue
            value, at = self.value(at, read, depth)
            self.keep(16)  # its place in the list, and the time to read it
            found.append(value)
            after = _NEXT.match(self.data, at)
            if after is None or after.group(1) == b"}":
                raise _NotJSON
            at = after.end()
            if after.group(1) == b"]":
                return found, at


def read_json(data: bytes | bytearray, read: Any, kept_bytes: int = KEPT_BYTES) -> Any:
    """``data`` as JSON, as far as ``read`` looks (None: empty, or not JSON).

    ``read`` is what the judge reads: None (nothing: the value is :data:`NOT_READ`), :data:`WHOLE`, an
    object's ``{key: read}`` (only those keys; with :data:`EVERY_KEY`, every key, the others NOT_READ) or an
    array's ``[read]`` (each item). A value of another kind than its read is NOT_READ (a scalar is kept).
    Raises :class:`BodyRefused` (413) for a body nested deeper than :data:`MAX_DEPTH` or one of which more
    than ``kept_bytes`` would be kept.
    """
    if not data:
        return None
    reader = _Reader(data, kept_bytes)
    try:
        value, at = reader.value(0, read, 0)
        if _END.match(data, at) is None:
            raise _NotJSON
    except _NotJSON:
        return None
    return value
