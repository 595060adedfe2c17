"""The Prefect API as a running job reaches it: only its own flow run's calls, with the worker's credentials.

A job's code is not trusted, and Prefect's open-source API answers anyone who reaches it with
everything it holds (every block document's secrets, every variable, every other run). So a job
never reaches it: its supervisor serves this gateway on a Unix socket in the run's ledger folder,
the job's entry forwards its loopback Prefect URL to that socket from inside the job's own network
namespace (or its container with no network), and the gateway forwards only what Prefect's engine
needs for the job's own flow run: its state, its task runs and subflows, logs, artifacts and events
(so the UI shows them all). It refuses everything else with 403 and a line saying why.

Which runs are the job's own is learned as it goes: its flow run, the task runs and subflow runs it
creates, the deployment its flow run names, the artifacts it creates.

Work and bills come from the worker alone: a job's subflows run in its own process (no deployment,
pool, queue, job variables or schedulable state, now or later), its own run ends only when its work
does, and nothing it writes (tags, artifacts, events) can look like the worker's (``e31`` tags,
``e31-*`` artifacts, ``e31.*`` or Prefect's worker and pool events).

What a job sends is held in the supervisor, outside the job's memory limit, so no job can make it hold
much: a call's request line and headers (:data:`MAX_HEAD_BYTES`), each route's body (its cap, refused with
413 before any of it is read), everything held at once over all the job's connections (:data:`BUDGET_BYTES`),
and what is built of a body to judge it (:mod:`e31_prefect.host.gateway_bodies`). An answer the gateway learns
nothing from goes to the job as it comes. On the events websockets, a frame the gateway cannot judge (binary,
fragmented, a reserved opcode, a control frame over 125 bytes) ends the socket with close 1003, one too big
with 1009, and a message the server could not read is dropped: none reaches the server.

Only the standard library: it runs in the supervisor.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import ctypes
import http.client
import io
import json
import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from socketserver import ThreadingMixIn, UnixStreamServer
from typing import Any
from urllib.parse import unquote, urlsplit

from e31_prefect.host.gateway_bodies import BUDGET_WAIT_SECONDS, JUDGE_BYTES, BodyRefused, Budget, MiB, read_json
from e31_prefect.host.gateway_rules import (
    FINAL_STATES,
    LOCAL_ANSWERS,
    MESSAGE_READS,
    OWN_RUN_READS,
    SUBSCRIBED_READS,
    Owned,
    answer_reads,
    event_for_job,
    event_from_job,
    event_shape_refusal,
    learn,
    refusal,
    route_for,
)
from e31_prefect.host.websocket_frames import Relay

END_HOLD_SECONDS = 20.0  # how long a final state of the job's run waits for the supervisor to see the work end
JOB_API_PATH = "/api"  # the job's PREFECT_API_URL is http://127.0.0.1:PORT/api, whatever the real one is
MAX_CONNECTIONS = 64  # at once, from one job
MAX_HEAD_BYTES = 32 * 1024  # a call's request line and headers: Prefect's client sends under 1 kB
# Bodies, answers and websocket messages the gateway holds at once, all of a job's connections together: two of
# the biggest bodies a route takes (gateway_rules.LOGS_BYTES), each with what is kept of it to judge it.
BUDGET_BYTES = 20 * MiB
BODY_SECONDS = 60.0  # a body comes whole within this (from the job's own loopback relay, at memory speed)
ANSWER_BYTES = 8 * MiB  # an answer learned from: a created subflow, task run or artifact, as the server has it
CLOSING_SECONDS = 10.0  # a websocket's closing handshake, once the job has closed its side
CHUNK_BYTES = 64 * 1024  # an answer the gateway learns nothing from passes a piece at a time
LOGGED_REFUSALS = 1000  # refusals each written to the supervisor's log; after these, one in a thousand
LOGGED_CHARACTERS = 500  # of each refusal's line (a refused path is the job's to make long)
M_MMAP_THRESHOLD = -3  # glibc's mallopt(3) parameter
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "host", "content-length", "accept-encoding",
              "authorization"}


def _big_buffers_given_back() -> None:
    """Each buffer of 128 KiB or more in pages of its own, given back to the system once freed. glibc's own way
    raises that threshold to the biggest buffer freed, then keeps freed buffers in the arena of the thread that
    made them: 64 connections' threads kept 82 MiB of 4 MB bodies, though the budget held 20 at a time."""
    with contextlib.suppress(Exception):  # another C library: its own allocator's ways
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def auth_header(api_key: str | None, auth_string: str | None) -> dict[str, str]:
    """The worker's credentials for the Prefect API, as the gateway adds them to each forwarded call."""
    if api_key:
        return {"Authorization": f"Bearer {api_key}"}
    if auth_string:
        return {"Authorization": "Basic " + base64.b64encode(auth_string.encode()).decode()}
    return {}


class _Server(ThreadingMixIn, UnixStreamServer):
    daemon_threads = True
    gateway: Gateway

    # A thread and a descriptor each: a job opening connections without end would take the supervisor's
    # descriptors (and with them its watch of the work). Prefect's client keeps a handful open.
    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self.gateway.connections_lock:
            if len(self.gateway.open_connections) < MAX_CONNECTIONS:
                self.gateway.open_connections.add(request)
                return True
        self.gateway._refuse(f"more than {MAX_CONNECTIONS} connections at once")
        return False

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line, counted with the refusals (a traceback each time would let a job fill the log)."""
        error = sys.exc_info()[1]
        self.gateway._log(f"gateway error: {type(error).__name__}: {error}")

    def shutdown_request(self, request: Any) -> None:
        with self.gateway.connections_lock:
            self.gateway.open_connections.discard(request)
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:  # one line per refusal is logged instead
        return

    def address_string(self) -> str:
        return "job"

    def handle_one_request(self) -> None:
        """One call, its request line and headers read within :data:`MAX_HEAD_BYTES` (http.server's own
        limits, 100 lines of 64 KiB, would let each connection hold 6.4 MB)."""
        try:
            head = self._read_head()
            if head is None:
                self.close_connection = True
                return
            self.raw_requestline, headers = head
            connection, self.rfile = self.rfile, io.BytesIO(headers)
            try:
                parsed = self.parse_request()
            finally:
                self.rfile = connection
            if not parsed:
                return
            method = getattr(self, f"do_{self.command}", None)
            if method is None:
                self.send_error(501, f"Unsupported method ({self.command!r})")
                return
            method()
            self.wfile.flush()
        except OSError:  # the job closed its end, or its body did not come in time: no traceback to log
            self.close_connection = True

    def _read_head(self) -> tuple[bytes, bytes] | None:
        """The request line and the header lines (None: the connection ended, or its head was too long)."""
        lines: list[bytes] = []
        size = 0
        while True:
            line = self.rfile.readline(MAX_HEAD_BYTES + 1 - size)
            size += len(line)
            if size > MAX_HEAD_BYTES:
                detail = json.dumps({"detail": f"e31: a call's request line and headers take at most "
                                               f"{MAX_HEAD_BYTES} bytes"}).encode()
                self.wfile.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
                                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(detail), detail))
                self.server.gateway._refuse(f"a head of more than {MAX_HEAD_BYTES} bytes")
                return None
            if not line:
                return None
            if lines or line.strip():  # blank lines before a request are passed over (RFC 9112 2.2)
                lines.append(line)
            if lines and not line.strip():
                return lines[0], b"".join(lines[1:])

    def do_GET(self) -> None:
        self._forward()

    do_POST = do_PATCH = do_PUT = do_DELETE = do_GET

    def _forward(self) -> None:
        gateway = self.server.gateway
        route = gateway.route(self.path)
        found = route_for(self.command, route) if route is not None else None
        length = self.headers.get("Content-Length") or "0"
        if self.headers.get("Transfer-Encoding") or not length.isdigit():
            self.close_connection = True
            return self._answer(413, "a Prefect call's body has a length")
        size = int(length)
        if (self.command, route) in LOCAL_ANSWERS:
            self.close_connection = self.close_connection or size > 0  # its body, if any, is not read
            return self._send_json(200, LOCAL_ANSWERS[(self.command, route)])
        if found is None:  # refused on its route alone: its body is not read
            why = refusal(self.command, route, None, gateway.owned) if route is not None else "not the Prefect API"
            self.close_connection = self.close_connection or size > 0
            gateway._refuse(why)
            return self._answer(403, f"e31: {why}; a running job reaches only its own flow run")
        rule = found[0]
        if size > rule.cap:
            self.close_connection = True
            why = (f"{self.command} {route} takes a body of at most {rule.cap} bytes (more than Prefect's engine "
                   f"sends there), not {size}")
            gateway._refuse(why)
            return self._answer(413, f"e31: {why}")
        with gateway.budget.hold(size + (JUDGE_BYTES if size else 0), BUDGET_WAIT_SECONDS) as held:
            if not held:
                self.close_connection = True
                gateway._refuse(f"no room for a {size}-byte body: the job's other calls hold the gateway's "
                                f"{BUDGET_BYTES} bytes")
                return self._answer(503, f"e31: the job's other calls hold all the gateway may hold "
                                         f"({BUDGET_BYTES} bytes); try again")
            try:
                response = self._judge_and_call(route, rule.reads, self._read_body(size))
            except OSError:  # the job's connection broke: its traceback, and the body it holds, go before its room
                self.close_connection = True
                return
        if response is not None:
            self._pass_answer(route, response)

    def _judge_and_call(self, route: str, reads: Any, body: bytearray | None) -> http.client.HTTPResponse | None:
        """Judge the call and send it upstream; its answer, unread (None: answered here)."""
        gateway = self.server.gateway
        if body is None:
            self.close_connection = True
            self._answer(408, f"e31: a call's body comes whole within {BODY_SECONDS:.0f} s")
            return None
        try:
            parsed = read_json(body, reads)
        except BodyRefused as refused:
            gateway._refuse(f"{self.command} {route}: {refused}")
            self._answer(refused.status, f"e31: {self.command} {route}: {refused}")
            return None
        why = refusal(self.command, route, parsed, gateway.owned)
        own_run = route.lower().startswith(f"/flow_runs/{gateway.owned.run}")
        if why is not None:
            gateway._refuse(why)
            self._answer(403, f"e31: {why}; a running job reaches only its own flow run")
            return None
        if self.headers.get("Upgrade", "").lower() == "websocket":
            self._relay_websocket()
            return None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers.update(gateway.headers)
        headers["Host"] = gateway.netloc
        # Its own run's changes one at a time, judged and sent together: a FAILED judged to have retries
        # left is not raced by a PATCH of those retries.
        with gateway.own_run_lock if own_run else contextlib.nullcontext():
            if own_run and (why := gateway.end_refusal(parsed) if route.endswith("/set_state")
                            else gateway.policy_refusal(parsed) if self.command == "PATCH" else None) is not None:
                gateway._refuse(why)
                self._answer(403, f"e31: {why}; a running job reaches only its own flow run")
                return None
            response = gateway.call(self.command, gateway.upstream_path(self.path), body, headers, self)
        if response is None:
            self._answer(502, "the Prefect API did not answer")
        return response

    def _read_body(self, size: int) -> bytearray | None:
        """The call's body, read whole within :data:`BODY_SECONDS` (None: it did not come)."""
        body = bytearray(size)
        got, deadline = 0, time.monotonic() + BODY_SECONDS
        try:
            with memoryview(body) as view:
                while got < size:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self.connection.settimeout(left)
                    read = self.rfile.readinto(view[got:got + CHUNK_BYTES])
                    if not read:
                        return None
                    got += read
        except OSError:
            return None
        finally:
            with contextlib.suppress(OSError):
                self.connection.settimeout(None)
        return body

    def _pass_answer(self, route: str, response: http.client.HTTPResponse) -> None:
        """The server's answer to the job: read whole and learned from where :func:`answer_reads` says so,
        else passed on as it comes."""
        gateway = self.server.gateway
        reads = answer_reads(self.command, route)
        try:
            if reads is not None and response.length is not None and response.length <= ANSWER_BYTES:
                with gateway.budget.hold(response.length + JUDGE_BYTES, BUDGET_WAIT_SECONDS) as held:
                    if held:
                        answer = response.read()
                        try:
                            with contextlib.suppress(BodyRefused):
                                learn(self.command, route, read_json(answer, reads), gateway.owned)
                            self._answer_head(response, len(answer))
                            self.wfile.write(answer)
                            return
                        finally:  # not kept past its room by a broken connection's traceback
                            answer = None
            self._answer_head(response, response.length)
            while chunk := response.read(CHUNK_BYTES):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if response.length is None else chunk)
            if response.length is None:
                self.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException):  # either side went: the answer is not whole
            self.close_connection = True
            if self.upstream is not None:
                self.upstream.close()
                self.upstream = None

    def _answer_head(self, response: http.client.HTTPResponse, length: int | None) -> None:
        self.send_response(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header(*(("Transfer-Encoding", "chunked") if length is None else ("Content-Length", str(length))))
        self.end_headers()

    def _answer(self, status: int, detail: str) -> None:
        self._send_json(status, {"detail": detail})

    def _send_json(self, status: int, answer: Any) -> None:
        payload = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if status == 503:
            self.send_header("Retry-After", "1")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _relay_websocket(self) -> None:
        """Prefect's events websockets, message by message: the handshake goes upstream with no
        extension and Prefect's subprotocol, the job's auth message carries the worker's token instead, the
        events it sends must be about its own runs, and of the events it subscribed to it receives its own
        runs' only."""
        gateway = self.server.gateway
        route = gateway.route(self.path)
        offered = {p.strip() for p in self.headers.get("Sec-WebSocket-Protocol", "").split(",")}
        if "prefect" not in offered:  # the server would read the auth message as an event, and fail on it
            why = f"an events websocket speaks Prefect's 'prefect' subprotocol, as Prefect's client does ({route})"
            gateway._refuse(why)
            return self._answer(403, f"e31: {why}")
        upstream = gateway.connect_raw()
        lines = [f"GET {gateway.upstream_path(self.path)} HTTP/1.1", f"Host: {gateway.netloc}"]
        lines += [f"{k}: {v}" for k, v in self.headers.items()
                  if k.lower() not in ("host", "authorization", "sec-websocket-extensions")]
        lines += [f"{k}: {v}" for k, v in gateway.headers.items()]
        upstream.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self.close_connection = True
        from_upstream = upstream.makefile("rb")
        handshake = b""
        while not handshake.endswith(b"\r\n\r\n") and len(handshake) <= MAX_HEAD_BYTES:
            line = from_upstream.readline(MAX_HEAD_BYTES)
            if not line:
                break
            handshake += line
        self.connection.sendall(handshake)
        if not handshake.startswith((b"HTTP/1.1 101", b"HTTP/1.0 101")):
            upstream.close()
            return
        relay = Relay(gateway, route, self.connection, upstream)
        sender = threading.Thread(target=relay.to_job, args=(from_upstream,), daemon=True)
        sender.start()
        relay.from_job(self.rfile)
        sender.join(CLOSING_SECONDS)  # the server's answer to the job's close (or its own end) reaches the job
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_RDWR)
        sender.join()
        upstream.close()


class Gateway:
    """One run's gateway to the Prefect API at ``upstream`` (``http(s)://host:port/api``)."""

    def __init__(self, listening: socket.socket, upstream: str, flow_run_id: str, headers: dict[str, str],
                 token: str | None = None):
        split = urlsplit(upstream)
        self.https = split.scheme == "https"
        self.host, self.port = split.hostname or "127.0.0.1", split.port or (443 if self.https else 80)
        self.netloc = split.netloc
        self.base_path = split.path.rstrip("/")
        self.headers = headers
        self.token = token  # the API key or auth string, for the events websockets' own auth message
        self.owned = Owned(flow_runs={flow_run_id.lower()})
        self.connections_lock = threading.Lock()
        self.open_connections: set[Any] = set()
        self.budget = Budget(BUDGET_BYTES)
        _big_buffers_given_back()
        self.refused: collections.deque[str] = collections.deque(maxlen=100)  # the last ones
        self.refusals = 0
        self.work_ending = threading.Event()  # set by the supervisor: the work said it ended, or is being stopped
        self.own_run_lock = threading.Lock()
        self._local = threading.local()
        self.server = _Server(listening.getsockname(), _Handler, bind_and_activate=False)
        self.server.socket.close()
        self.server.socket = listening
        self.server.gateway = self

    def from_job(self, route: str | None, message: bytes | bytearray | str, position: int = 0) -> Any:
        """A message the job sends on an events websocket (its ``position``-th, from 0), as it goes upstream
        (None: dropped): first Prefect's auth message, with the worker's token; then a subscription's filter
        (``/events/out``) or events about its own runs that the server can read (``/events/in``)."""
        try:
            parsed = read_json(message.encode() if isinstance(message, str) else message, MESSAGE_READS)
        except BodyRefused as refused:
            self._refuse(f"a message on {route}: {refused}")
            return None
        kind = parsed.get("type") if isinstance(parsed, dict) else None
        if position == 0 and kind == "auth":
            return json.dumps({"type": "auth", "token": self.token})
        if position == 0 or kind == "auth":
            why = "Prefect's auth message comes first, once"
        elif route == "/events/out":
            if position == 1 and kind == "filter":
                return message  # what comes back is judged event by event
            why = "a subscription sends its filter once, after its auth message"
        elif (why := event_shape_refusal(parsed) if route == "/events/in" else "no message") is None:
            if event_from_job(parsed, self.owned):
                return message
            why = "an event naming another run"
        self._refuse(f"{why}, on {route}")
        return None

    def to_job(self, route: str | None, message: bytes | bytearray | str) -> Any:
        """A message the server sends on an events websocket, as the job receives it (None: dropped)."""
        if route != "/events/out":
            return message
        try:
            parsed = read_json(message.encode() if isinstance(message, str) else message, SUBSCRIBED_READS)
        except BodyRefused:
            return None
        if isinstance(parsed, dict) and parsed.get("type") == "event":
            return message if event_for_job(parsed.get("event"), self.owned) else None
        return message if parsed is not None else None

    def end_refusal(self, body: Any) -> str | None:
        """Why a state for the job's own run may not pass yet (None: it may).

        A final state (or Cancelling) passes only once the supervisor knows the work is ending: the job's
        entry says so just before its engine reports the final state, and a stop sets it too. Before
        that, a Completed or Cancelled run whose work goes on could no longer be cancelled from the UI,
        and would keep its GPUs to its time limit. The call is held a moment for the supervisor to read
        the work's word. One exception: a FAILED while the run has retries left, which the server turns
        into a retry (AwaitingRetry), not an end (core_policy.RetryFailedFlows).
        """
        state = body.get("state") if isinstance(body, dict) else None
        kind = state.get("type") if isinstance(state, dict) else None
        if kind not in FINAL_STATES or self.work_ending.is_set():
            return None
        if kind == "FAILED" and body.get("force") in (False, None) and self._retries_left():
            return None
        if self.work_ending.wait(END_HOLD_SECONDS):
            return None
        return (f"its own run goes {kind} only when its work ends (the engine reports it as the flow returns); "
                "the worker reports how the work ended")

    def policy_refusal(self, body: Any) -> str | None:
        """Why a change of the job's own run's retry policy may not pass (None: it may).

        The engine sends its run's policy back once, with the flow's retries, as it starts (its run still
        Scheduled or Pending). Later, more retries would let a job end its run as a retry; and a run that
        failed with retries left waits for its retry in Scheduled, marked ``retry_type: in_process`` so that
        no worker takes it (Prefect's worker endpoint, and e31's backlog, skip it): a job that cleared that
        mark (a policy sent without it is cleared too) would hand a worker of its pool its run to start again.
        """
        policy = body.get("empirical_policy") if isinstance(body, dict) else None
        if policy is None:
            return None
        run = self._read_own_run()
        if not isinstance(policy, dict) or run is None:
            return "its run's retry policy could not be checked against the server's"
        kept = (run.get("empirical_policy") or {}).get("retry_type")
        if policy.get("retry_type") != kept:
            return f"a job may not change its run's retry_type ({kept!r}): a worker would pick the run up"
        if (run.get("state") or {}).get("type") not in ("SCHEDULED", "PENDING"):
            return "a job sets its run's retries as it starts, not once it runs"
        return None

    def _retries_left(self) -> bool:
        """Whether the job's run has a retry left, as the server will judge a FAILED (read upstream)."""
        with contextlib.suppress(Exception):
            run = self._read_own_run()
            if run is not None and (run.get("state") or {}).get("type") == "RUNNING":  # as RetryFailedFlows
                retries = (run.get("empirical_policy") or {}).get("retries")
                return retries is not None and int(run.get("run_count") or 0) <= int(retries)
        return False

    def _read_own_run(self) -> dict[str, Any] | None:
        """The job's own flow run as the API has it now, read with the worker's credentials (None: unread)."""
        with contextlib.suppress(Exception):
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            connection = cls(self.host, self.port, timeout=30)
            try:
                connection.request("GET", f"{self.base_path}/flow_runs/{self.owned.run}",
                                   headers={**self.headers, "Host": self.netloc})
                response = connection.getresponse()
                if response.length is None or response.length > ANSWER_BYTES:
                    return None
                with self.budget.hold(response.length + JUDGE_BYTES, BUDGET_WAIT_SECONDS) as held:
                    run = read_json(response.read(), OWN_RUN_READS) if held else None
            finally:
                connection.close()
            return run if isinstance(run, dict) else None
        return None

    def _refuse(self, why: str) -> None:
        """Keep the last refusals, and log each (see :meth:`_log`)."""
        self.refused.append(why[:LOGGED_CHARACTERS])
        self._log(f"gateway refused: {why}")

    def _log(self, line: str) -> None:
        """A line in the supervisor's log (on the host's disk, outside the job's): the first thousand, then one
        in a thousand, each cut short; a job makes as many refusals as it likes."""
        self.refusals += 1
        if self.refusals <= LOGGED_REFUSALS or self.refusals % 1000 == 0:
            count = f" (line {self.refusals} of the gateway's)" if self.refusals > LOGGED_REFUSALS else ""
            sys.stderr.write(f"{line[:LOGGED_CHARACTERS]}{count}\n")  # one write: threads' lines stay whole
            sys.stderr.flush()

    def route(self, path: str) -> str | None:
        """The path under the API root the job asked for (None: not under it, or not plainly written).

        A segment that decodes to a slash, a dot or two, or a backslash is refused: a proxy before the API
        that decodes the path would send the call somewhere other than the route judged here.
        """
        asked = urlsplit(path).path
        if path.startswith("//") or asked != JOB_API_PATH and not asked.startswith(JOB_API_PATH + "/"):
            return None
        if any(unquote(segment) in (".", "..") or any(c in unquote(segment) for c in "/\\")
               for segment in asked.split("/")):
            return None
        return asked.removeprefix(JOB_API_PATH).rstrip("/") or "/"

    def upstream_path(self, path: str) -> str:
        """The same call's path (as judged) and query on the real API."""
        split = urlsplit(path)
        return self.base_path + split.path.removeprefix(JOB_API_PATH) + (f"?{split.query}" if split.query else "")

    def connect_raw(self) -> socket.socket:
        """A new connection to the Prefect API's host."""
        raw = socket.create_connection((self.host, self.port), timeout=None)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as http.client does: no frame waits
        if self.https:
            return ssl.create_default_context().wrap_socket(raw, server_hostname=self.host)
        return raw

    def call(self, method: str, path: str, body: bytes | bytearray, headers: dict[str, str],
             handler: _Handler) -> http.client.HTTPResponse | None:
        """Send one call on the handler's own upstream connection (reconnecting once if it closed); its answer,
        not yet read (None: the API did not answer). The body is sent as it is, never copied."""
        for _ in (1, 2):
            if handler.upstream is None:
                cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
                handler.upstream = cls(self.host, self.port, timeout=300)
            try:
                handler.upstream.putrequest(method, path, skip_host=True)
                for name, value in headers.items():
                    handler.upstream.putheader(name, value)
                if body or method in ("POST", "PUT", "PATCH"):
                    handler.upstream.putheader("Content-Length", str(len(body)))
                handler.upstream.endheaders()
                if body:
                    handler.upstream.send(body)
                return handler.upstream.getresponse()
            except (OSError, http.client.HTTPException):
                handler.upstream.close()
                handler.upstream = None
        return None

    def serve(self) -> threading.Thread:
        """Serve in a thread of its own until :meth:`close`."""
        thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
