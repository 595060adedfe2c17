"""What a hostile job can make its gateway hold: peak RSS of a Gateway in its own process, per attack.

    python benchmarks/gateway_memory.py [--source CHECKOUT] [--attacks a,b,...] [--guard-gib 4]

Each attack gets a fresh gateway process (``--source``: the checkout whose ``e31_prefect`` it imports,
this one by default), which first imports what a run's supervisor imports, so its baseline is a
supervisor's. Its upstream is a stand-in Prefect API in this process that reads every call and answers
``{}`` (and accepts websockets). Printed per attack: VmHWM (peak RSS) before and after, from
/proc/PID/status, what the attacker was answered, and the longest pause of a 10 ms ticker thread in the
gateway's process (a supervisor's own loop waits as long where parsing holds the interpreter).

The gateway process runs under an address-space limit (``--guard-gib``), so an attack that would take
more of a shared machine ends the gateway instead (reported as "gateway died").
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN, OTHER = "28f7dc00-2d45-4dfd-a501-64c8a03c143f", "43835668-28ca-4623-ab0f-9b7619d5d5a5"
MiB = 2**20

GATEWAY = r'''
import os, resource, socket, sys, threading, time
source, path, upstream, guard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, source)
if guard:
    resource.setrlimit(resource.RLIMIT_AS, (guard, guard))
import e31_prefect.host.supervisor  # noqa: F401  what a supervisor imports: its baseline
from e31_prefect.host.gateway import Gateway
listening = socket.socket(socket.AF_UNIX)
listening.bind(path)
listening.listen(128)
gateway = Gateway(listening, upstream, sys.argv[5], {})
gateway.serve()
longest = 0.0
def tick():
    global longest
    while True:
        started = time.monotonic()
        time.sleep(0.01)
        longest = max(longest, time.monotonic() - started - 0.01)
threading.Thread(target=tick, daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    print(f"{longest:.3f}", flush=True)
    longest = 0.0
'''


class Upstream(BaseHTTPRequestHandler):
    """A stand-in Prefect API: reads each call whole, answers ``{}``; accepts websockets and drops frames."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        return

    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            accept = base64.b64encode(hashlib.sha1(self.headers["Sec-WebSocket-Key"].encode()
                                                   + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()).decode()
            self.wfile.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                              f"Sec-WebSocket-Accept: {accept}\r\nSec-WebSocket-Protocol: prefect\r\n\r\n").encode())
            self.wfile.write(b'\x81\x17{"type":"auth_success"}')
            self.wfile.flush()
            while self.connection.recv(MiB):
                pass
            self.close_connection = True
            return
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            remaining -= len(self.rfile.read(min(remaining, MiB)) or b"x" * remaining)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_POST = do_PATCH = do_PUT = do_DELETE = do_GET


def status(pid: int) -> dict[str, int]:
    """VmHWM and VmRSS of a process, in bytes (empty once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in lines)
            if k in ("VmHWM", "VmRSS")}


def connect(path: str) -> socket.socket:
    client = socket.socket(socket.AF_UNIX)
    client.connect(path)
    return client


def answer_of(client: socket.socket) -> str:
    """The status line the gateway answered (or how the connection ended)."""
    client.settimeout(120)
    try:
        data = client.recv(4096)
    except OSError as error:
        return type(error).__name__
    return data.split(b"\r\n", 1)[0].decode(errors="replace") if data else "closed"


def post(path: str, route: str, chunks, length: int, method: str = "POST") -> str:
    """One call with a body sent in ``chunks`` (an iterable of bytes) of ``length`` bytes in all."""
    client = connect(path)
    try:
        client.sendall(f"{method} /api{route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {length}\r\n\r\n".encode())
        for chunk in chunks:
            client.sendall(chunk)
    except OSError as error:
        answer = answer_of(client)
        return answer if answer.startswith("HTTP") else type(error).__name__
    answer = answer_of(client)
    client.close()
    return answer


def json_body(size: int, item: bytes, head: bytes = b"[", tail: bytes = b"]", sep: bytes = b","):
    """(chunks, length): ``head item sep item ... tail`` of about ``size`` bytes, made 1 MiB at a time."""
    per = max(1, MiB // (len(item) + len(sep)))
    block = (item + sep) * per
    blocks = max(1, (size - len(head) - len(tail)) // len(block))
    length = len(head) + blocks * len(block) - len(sep) + len(tail)

    def chunks():
        yield head
        for i in range(blocks):
            yield block if i < blocks - 1 else block[: len(block) - len(sep)]
        yield tail
    return chunks(), length


def many_keys(size: int, around: bytes = b""):
    """(chunks, length): one object of at most ``size`` bytes of distinct small keys, ``{"k0":0,"k1":0,...}``
    (in a list with ``around=b"["``)."""
    def block(i: int) -> bytes:
        return b"".join(b'"k%d_%d":0,' % (i, j) for j in range(MiB // 16))
    per = len(block(10**6))  # every block the same length
    blocks = max(1, (size - 2 - 2 * len(around)) // per)
    made = [block(10**6 + i) for i in range(blocks)]
    made[-1] = made[-1][:-1]
    chunks = [around + b"{", *made, b"}" + (b"]" if around else b"")]
    return chunks, sum(map(len, chunks))


def logs_of_another_run(size: int):
    return json_body(size, b'{"flow_run_id": "' + OTHER.encode() + b'", "name": "x", "level": 20, "message": "'
                     + b"y" * 200 + b'", "timestamp": "2024-01-01T00:00:00Z"}')


def together(count: int, call) -> list[str]:
    answers: list[str] = [""] * count

    def one(i: int) -> None:
        answers[i] = call(i)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def summary(answers: list[str]) -> str:
    counts: dict[str, int] = {}
    for answer in answers:
        counts[answer] = counts.get(answer, 0) + 1
    return ", ".join(f"{n} x {a!r}" for a, n in counts.items())


def slow_head(path: str) -> list[str]:
    """64 connections at once, each sending 98 header lines of 64 KiB (under http.server's limits of 100
    lines of 64 KiB) and never ending its head; then they close."""
    line = b"X-Pad: " + b"p" * (64 * 1024 - 10) + b"\r\n"
    clients = [connect(path) for _ in range(64)]

    def send(i: int) -> str:
        try:
            clients[i].sendall(b"POST /api/logs/ HTTP/1.1\r\nHost: x\r\n" + line * 98)
            return "sent"
        except OSError as error:
            return type(error).__name__
    outcomes = together(64, send)
    time.sleep(2)  # what the gateway reads of them, it reads now
    for client in clients:
        client.close()
    return outcomes


def slow_body(path: str) -> list[str]:
    """64 connections at once, each announcing an 8 MiB log batch and sending half of it, then waiting."""
    clients = [connect(path) for _ in range(64)]

    def send(i: int) -> str:
        try:
            clients[i].sendall(f"POST /api/logs/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               f"Content-Length: {8 * MiB}\r\n\r\n".encode() + b"[" + b" " * (4 * MiB))
            return "half sent"
        except OSError as error:
            return answer_of(clients[i]) or type(error).__name__
    outcomes = together(64, send)
    time.sleep(2)
    for client in clients:
        client.close()
    return outcomes


def websocket(path: str, payload_size: int, opcode: int = 0x1) -> str:
    """Open the events websocket, authenticate, send one frame of ``payload_size`` bytes; how it ended."""
    client = connect(path)
    key = base64.b64encode(os.urandom(16)).decode()
    client.sendall(f"GET /api/events/in HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: prefect\r\n"
                   "\r\n".encode())
    reader = client.makefile("rb")
    while reader.readline() not in (b"\r\n", b""):
        pass
    client.sendall(frame(0x1, b'{"type": "auth", "token": null}'))
    header = bytes([0x80 | opcode, 0x80 | 127]) + struct.pack("!Q", payload_size) + b"\0\0\0\0"  # mask 0
    try:
        client.sendall(header)
        block = b"[" + b"{}," * (MiB // 3)
        sent = 0
        while sent < payload_size:
            piece = block[: payload_size - sent]
            client.sendall(piece)
            sent += len(piece)
    except OSError as error:
        ended = type(error).__name__
    else:
        ended = "sent"
    client.settimeout(60)
    rest = b""
    with contextlib.suppress(OSError):
        while len(rest) < 65536 and (more := reader.read1(4096)):
            rest += more
    closes = [rest[i + 2: i + 4] for i in range(len(rest) - 3) if rest[i] == 0x88]
    ended += f", close {struct.unpack('!H', closes[0])[0]}" if closes and len(closes[0]) == 2 else ""
    client.close()
    return ended


def frame(opcode: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    size = len(payload)
    head = bytes([0x80 | opcode]) + (bytes([0x80 | size]) if size < 126 else
                                      bytes([0x80 | 126]) + struct.pack("!H", size))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


ATTACKS = {
    "refused-16MiB": lambda p: [post(p, "/logs/", *logs_of_another_run(16 * MiB))],
    "two-32MiB": lambda p: together(2, lambda i: post(p, "/logs/", *logs_of_another_run(32 * MiB))),
    "64x64MiB": lambda p: together(64, lambda i: post(p, "/logs/", *logs_of_another_run(64 * MiB))),
    "empty-objects-16MiB": lambda p: [post(p, "/logs/", *json_body(16 * MiB, b"{}"))],
    "64x8MiB-nested": lambda p: together(64, lambda i: post(p, "/logs/", [b"[" * (4 * MiB), b"]" * (4 * MiB)],
                                                           8 * MiB)),
    "64x8MiB-small-keys": lambda p: together(64, lambda i: post(p, "/logs/", *many_keys(8 * MiB - 2, b"["))),
    "64x8MiB-empty-objects": lambda p: together(64, lambda i: post(p, "/logs/", *json_body(8 * MiB, b"{}"))),
    "slowloris-head": slow_head,
    "slowloris-body": slow_body,
    "64x-websocket-16MiB": lambda p: together(64, lambda i: websocket(p, 16 * MiB)),
    "websocket-binary": lambda p: [websocket(p, 100, opcode=0x2)],
    "64x-logs-at-cap": lambda p: together(64, lambda i: post(p, "/logs/", *json_body(
        4_000_000, b'{"flow_run_id":"' + RUN.encode() + b'","level":20,"message":"m","name":"n"}'))),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=str(REPO), help="the checkout whose e31_prefect the gateway runs")
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--guard-gib", type=float, default=4.0)
    args = parser.parse_args()
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{upstream.server_address[1]}/api"
    source = Path(args.source).resolve()
    print(f"gateway from {source} ({subprocess.run(['git', '-C', str(source), 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()})")  # noqa: E501
    print(f"{'attack':<22} {'VmHWM before':>13} {'VmHWM after':>12} {'longest pause':>14}  answered")  # noqa
    for name in args.attacks.split(","):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "gw.sock")
            gateway = subprocess.Popen([sys.executable, "-c", GATEWAY, str(source), path, url,
                                        str(int(args.guard_gib * 2**30)), RUN],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert gateway.stdout.readline().strip() == "ready"
            before = status(gateway.pid)["VmHWM"]
            answers = ATTACKS[name](path)
            time.sleep(0.5)  # the last connections' threads end
            after = status(gateway.pid)
            pause = "-"
            if gateway.poll() is None:
                gateway.stdin.write("report\n")
                gateway.stdin.flush()
                pause = gateway.stdout.readline().strip() + " s"
            gateway.kill()
            gateway.wait()
            peak = f"{after['VmHWM'] / MiB:.1f} MiB" if after else "gateway died"
            print(f"{name:<22} {before / MiB:>9.1f} MiB {peak:>12} {pause:>14}  {summary(answers)}", flush=True)
    upstream.shutdown()


if __name__ == "__main__":
    main()
