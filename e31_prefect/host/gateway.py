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

Only the standard library: it runs in the supervisor.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler
from socketserver import ThreadingMixIn, UnixStreamServer
from typing import Any
from urllib.parse import unquote, urlsplit

from e31_prefect.host.gateway_rules import (
    FINAL_STATES,
    Owned,
    _body_json,
    event_for_job,
    event_from_job,
    learn,
    refusal,
)
from e31_prefect.host.websocket_frames import CLOSE, TEXT, Frame, FrameError, encode, read_frame

END_HOLD_SECONDS = 20.0  # how long a final state of the job's run waits for the supervisor to see the work end
JOB_API_PATH = "/api"  # the job's PREFECT_API_URL is http://127.0.0.1:PORT/api, whatever the real one is
MAX_BODY_BYTES = 64 * 2**20  # a batch of logs or an artifact; more is not a Prefect call
MAX_CONNECTIONS = 64  # at once, from one job
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "host", "content-length", "accept-encoding",
              "authorization"}


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

    def do_GET(self) -> None:
        self._forward()

    do_POST = do_PATCH = do_PUT = do_DELETE = do_GET

    def _forward(self) -> None:
        gateway = self.server.gateway
        route = gateway.route(self.path)
        length = self.headers.get("Content-Length") or "0"
        if self.headers.get("Transfer-Encoding") or not length.isdigit() or int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            return self._answer(413, "a Prefect call's body has a length, under 64 MiB")
        body = self.rfile.read(int(length))
        parsed = _body_json(body)
        why = refusal(self.command, route, parsed, gateway.owned) if route is not None else "not the Prefect API"
        own_run = route is not None and route.lower().startswith(f"/flow_runs/{gateway.owned.run}")
        if why is not None:
            gateway._refuse(why)
            return self._answer(403, f"e31: {why}; a running job reaches only its own flow run")
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return self._relay_websocket()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers.update(gateway.headers)
        headers["Host"] = gateway.netloc
        # Its own run's changes one at a time, judged and sent together: a FAILED judged to have retries
        # left is not raced by a PATCH of those retries.
        with gateway.own_run_lock if own_run else contextlib.nullcontext():
            if own_run and (why := gateway.end_refusal(parsed) if route.endswith("/set_state")
                            else gateway.policy_refusal(parsed) if self.command == "PATCH" else None) is not None:
                gateway._refuse(why)
                return self._answer(403, f"e31: {why}; a running job reaches only its own flow run")
            status, reason, answer_headers, answer = gateway.call(self.command, gateway.upstream_path(self.path),
                                                                  body, headers, self)
        with contextlib.suppress(Exception):
            learn(self.command, route, json.loads(answer) if answer else None, gateway.owned)
        self.send_response(status, reason)
        for name, value in answer_headers:
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def _answer(self, status: int, detail: str) -> None:
        payload = json.dumps({"detail": detail}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _relay_websocket(self) -> None:
        """Prefect's events websockets, message by message: the handshake goes upstream with no
        extension, the job's auth message carries the worker's token instead, the events it sends
        must be about its own runs, and of the events it subscribed to it receives its own runs' only."""
        gateway = self.server.gateway
        route = gateway.route(self.path)
        upstream = gateway.connect_raw()
        lines = [f"GET {gateway.upstream_path(self.path)} HTTP/1.1", f"Host: {gateway.netloc}"]
        lines += [f"{k}: {v}" for k, v in self.headers.items()
                  if k.lower() not in ("host", "authorization", "sec-websocket-extensions")]
        lines += [f"{k}: {v}" for k, v in gateway.headers.items()]
        upstream.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self.close_connection = True
        from_upstream = upstream.makefile("rb")
        handshake = b""
        while not handshake.endswith(b"\r\n\r\n"):
            line = from_upstream.readline(65536)
            if not line:
                break
            handshake += line
        self.connection.sendall(handshake)
        if not handshake.startswith((b"HTTP/1.1 101", b"HTTP/1.0 101")):
            upstream.close()
            return
        sender = threading.Thread(target=_pass_frames, daemon=True, args=(
            from_upstream, self.connection, False, lambda text: gateway.to_job(route, text)))
        sender.start()
        _pass_frames(self.rfile, upstream, True, lambda text: gateway.from_job(route, text))
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_RDWR)
        sender.join()
        upstream.close()


def _pass_frames(source: Any, sink: socket.socket, masked: bool, judge: Any) -> None:
    """Copy frames from ``source`` to ``sink`` until either ends; each text message passes through
    ``judge`` (its replacement, or None: dropped). A frame the gateway cannot read ends the relay."""
    with contextlib.suppress(OSError, FrameError):
        while (frame := read_frame(source)) is not None:
            if frame.opcode == TEXT:
                text = judge(frame.payload.decode("utf-8", "replace"))
                if text is None:
                    continue
                frame = Frame(TEXT, text.encode())
            sink.sendall(encode(frame, masked))
            if frame.opcode == CLOSE:
                break
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


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
        self.refused: list[str] = []
        self.work_ending = threading.Event()  # set by the supervisor: the work said it ended, or is being stopped
        self.own_run_lock = threading.Lock()
        self._local = threading.local()
        self.server = _Server(listening.getsockname(), _Handler, bind_and_activate=False)
        self.server.socket.close()
        self.server.socket = listening
        self.server.gateway = self

    def from_job(self, route: str | None, text: str) -> str | None:
        """A message the job sends on an events websocket, as it goes upstream (None: dropped)."""
        try:
            message = json.loads(text)
        except ValueError:
            return None
        if isinstance(message, dict) and message.get("type") == "auth":
            return json.dumps({"type": "auth", "token": self.token})
        if route == "/events/out" and isinstance(message, dict) and message.get("type") == "filter":
            return text  # what comes back is judged event by event
        if route == "/events/in" and event_from_job(message, self.owned):
            return text
        self._refuse(f"an event naming another run on {route}")
        return None

    def to_job(self, route: str | None, text: str) -> str | None:
        """A message the server sends on an events websocket, as the job receives it (None: dropped)."""
        if route != "/events/out":
            return text
        try:
            message = json.loads(text)
        except ValueError:
            return None
        if isinstance(message, dict) and message.get("type") == "event":
            return text if event_for_job(message.get("event"), self.owned) else None
        return text

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
                run = json.loads(connection.getresponse().read())
            finally:
                connection.close()
            return run if isinstance(run, dict) else None
        return None

    def _refuse(self, why: str) -> None:
        self.refused.append(why)
        print(f"gateway refused: {why}", file=sys.stderr, flush=True)

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

    def call(self, method: str, path: str, body: bytes, headers: dict[str, str],
             handler: _Handler) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Forward one call on the handler's own upstream connection (reconnecting once if it closed)."""
        for attempt in (1, 2):
            if handler.upstream is None:
                cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
                handler.upstream = cls(self.host, self.port, timeout=300)
            try:
                handler.upstream.request(method, path, body=body or None, headers=headers)
                response = handler.upstream.getresponse()
                return response.status, response.reason, response.getheaders(), response.read()
            except (OSError, http.client.HTTPException):
                handler.upstream.close()
                handler.upstream = None
                if attempt == 2:
                    return 502, "Bad Gateway", [], b'{"detail": "the Prefect API did not answer"}'
        raise AssertionError("unreachable")

    def serve(self) -> threading.Thread:
        """Serve in a thread of its own until :meth:`close`."""
        thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
