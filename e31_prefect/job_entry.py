"""A job's entry point: Prefect's own engine for the flow run, loaded before its devices are handed over.

    python -m e31_prefect.job_entry          # the process runtime
    python /e31/bin/job_entry.py             # a container: mounted read-only, so any image with Prefect runs it

Loading Prefect and its engine takes seconds. The entry does it first, with no
device visible and nothing of the job's: it starts with e31's own environment
(the host's paths, Prefect's settings for the run as the worker sets them, its
pipes), imports the engine, opens the engine's API client and checks the
server's version (:func:`prepare_api`). Then it says ``ready`` on the pipe
named by ``E31_WORK_ENDED`` and waits
on the pipe named by ``E31_HAND_OVER``; the worker rents the run's devices only
then, and its supervisor hands them over there with the job's own environment
(``CUDA_VISIBLE_DEVICES`` and the other device variables, the job's and its
deployment's variables, set here before any of the job's own code or the flow's
module is imported; where they act only as an interpreter starts, the entry
starts again with them: :func:`start_again_with`). The meter starts at the
hand-over, so no team pays for Prefect's start-up.

Then it runs ``prefect.engine`` exactly as ``python -m prefect.engine`` does, with
two additions at the top flow run's last state. Just before the engine reports it,
the entry names the outcome on the ``E31_WORK_ENDED`` pipe (the flow returned); the
report is bounded (``E31_REPORT_SECONDS``: an API that does not answer leaves it to
the worker, and the entry says ``unreported``). Once it is reported (and the flow's
hooks ran), the entry sends the logs and events still queued and leaves at once:
Prefect's teardown after the final state (its heartbeat thread's join, about a
second) and anything the job left running (threads, ``atexit`` handlers) would
otherwise hold the run's devices. The supervisor stops the meter when the last
process is gone, whatever the job says on the pipe.

A sharded command's shards start at the hand-over, before the engine loads the
flow, where the worker said what they run (:func:`start_shards`). A flow run's first
heartbeat comes one interval after its start, not at it (:func:`first_heartbeat_after_an_interval`).

Only the standard library and Prefect (e31's shard runner where it is
installed): this file must run in images that do not have e31-prefect installed.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import json
import os
import runpy
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from typing import Any

WORK_ENDED_VARIABLE = "E31_WORK_ENDED"
HAND_OVER_VARIABLE = "E31_HAND_OVER"  # the pipe the supervisor hands the run's devices over on
SHARDS_VARIABLE = "E31_SHARDS"  # a sharded job's settings (e31_prefect.model.shards)
API_SOCKET_VARIABLE = "E31_API_SOCKET"  # the run's gateway to the Prefect API (see e31_prefect.host.gateway)
# The folder the flow runs in, where the deployment's pull steps would only move there: the entry moves there at
# the hand-over and its engine loads the flow from PREFECT__FLOW_ENTRYPOINT (e31_prefect.runtimes.process).
FLOW_FOLDER_VARIABLE = "E31_FLOW_FOLDER"
READY = "ready"  # the entry's first word to its supervisor: Prefect is loaded, hand the devices over
OUTCOMES = ("completed", "failed", "crashed", "cancelled")  # its word as the flow returns: the state it reports
UNREPORTED = "unreported"  # its last word where the API did not take that state in time: the worker reports it
REPORT_SECONDS_VARIABLE = "E31_REPORT_SECONDS"  # how long the last state's report may take (set by the worker)
REPORT_SECONDS = 5.0
LEAVE_SECONDS = 2.0  # how long the logs and events still queued may take to send as the entry leaves
# Variables that act only as an interpreter, or a library it loads, starts: Python's own, the dynamic loader's,
# Prefect's settings (read as Prefect is imported), OpenSSL's configuration, glibc's, the locale and time zone.
# Where the hand-over gives any a new value, the entry starts again with them (its Prefect load then billed), so
# the job's variable takes effect. This list is for fidelity, not for safety: the process that waits for the
# hand-over is started with none of the job's variables, so nothing of the job acts before the hand-over,
# whatever this list misses.
START_VARIABLES = ("PYTHON", "LD_", "PREFECT_", "OPENSSL_", "SSL_CERT_", "GCONV_PATH", "GLIBC_TUNABLES",
                   "MALLOC_", "LANG", "LC_", "TZ")
# What Prefect's engine imports to run a flow run, loaded before the hand-over (none of it is the job's code):
# found by listing the modules first imported after the hand-over of a run of the README's example.
ENGINE_MODULES = ("prefect.engine", "prefect.flow_engine", "prefect._internal.metrics", "prefect.flows",
                  "prefect.deployments.steps.core", "prefect.client.orchestration", "prefect.results",
                  "prefect.task_engine", "prefect.logging.handlers", "prefect.utilities.visualization",
                  "pydantic.v1", "anyio._backends._asyncio", "rich._emoji_codes", "e31_prefect",
                  "prefect.deployments.steps.pull", "prefect.deployments.steps.utility")
_pipe: list[str] = []  # where to say it; taken out of the environment, so the flow's own code never sees it
_said: list[str] = []  # the outcome said, once
_reporting_last: list[bool] = []  # set while the engine reports the top flow run's last state
_report_seconds: list[float] = []  # how long that report may take; taken out of the environment like the pipe


def say(word: str) -> None:
    """One word to the supervisor on the work-ended pipe (no supervisor listening is fine)."""
    if not _pipe:
        return
    try:
        fd = os.open(_pipe[0], os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        os.write(fd, f"{word}\n".encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def say_work_ended(outcome: str) -> None:
    """Tell the supervisor the flow returned, with its outcome (once)."""
    if not _said:
        say(outcome)
        _said.append(outcome)


def prepare_engine() -> None:
    """Import what Prefect's engine needs to run a flow run (the seconds of a job's start-up), before the rent."""
    for name in ENGINE_MODULES:
        with contextlib.suppress(ImportError):  # another Prefect release may have moved one: loaded later then
            importlib.import_module(name)


def share_tls_context() -> None:
    """Build the TLS context Prefect's API clients verify the server with once, here, and give it to each.

    Prefect builds one for every client it creates (reading a CA bundle: about 25 ms of CPU each), and
    a flow run's start creates about six, all after the hand-over, most on a URL that is plain HTTP
    (the run's gateway relay). The context is built from the same settings, so what is verified is
    unchanged; a client given its own context keeps it.
    """
    import ssl

    import certifi
    from prefect.client import orchestration
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

    if PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value():
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context = ssl.create_default_context(cafile=PREFECT_API_SSL_CERT_FILE.value() or certifi.where())
    for client_class in (orchestration.PrefectClient, orchestration.SyncPrefectClient):
        create = client_class.__init__

        def __init__(self: Any, *args: Any, httpx_settings: dict[str, Any] | None = None, _create: Any = create,
                     **kwargs: Any) -> None:
            _create(self, *args, httpx_settings={"verify": context, **(httpx_settings or {})}, **kwargs)

        client_class.__init__ = __init__


def open_api_client(stack: contextlib.ExitStack) -> None:
    """Open the synchronous API client the engine runs the flow run with, and check the server's version,
    before the hand-over (Prefect's engine takes a client already open in its context, and each kind of
    client checks the version once per process: its events client by the URL as it is set)."""
    import asyncio
    import logging

    from prefect._internal.version_checking import check_server_version
    from prefect.context import SyncClientContext
    from prefect.settings import PREFECT_API_URL

    stack.enter_context(SyncClientContext.get_or_create())
    asyncio.run(check_server_version(PREFECT_API_URL.value(), logging.getLogger(__name__), raise_on_error=False))


def prepare_api(stack: contextlib.ExitStack) -> None:
    """What Prefect's engine does first with its API, done before the hand-over (about 0.2 s of a flow
    run's start): whatever fails here (another Prefect release, an API answering with an error) is
    left to the engine, after the hand-over, as it would be without this."""
    try:
        share_tls_context()
        open_api_client(stack)
    except Exception:  # noqa: BLE001 -- the engine meets the same error after the hand-over, and reports it
        pass


def wait_for_hand_over(path: str) -> list[str]:
    """Say ``ready``, then wait for the run's devices and the job's own environment; their variables are set
    in this process's environment (a null unsets one), and the names whose value changed are returned.

    The supervisor holds the pipe open from before this process starts, so opening it never waits, and
    a supervisor that dies leaves an end of file here: the entry then ends, having run nothing.
    """
    with open(path, "rb") as gate:
        say(READY)
        line = gate.readline()
    if not line:
        raise SystemExit("e31: the run's supervisor ended before handing over its devices; nothing ran")
    given: dict[str, str | None] = json.loads(line)["env"]
    changed = [name for name, value in given.items() if os.environ.get(name) != value]
    for name, value in given.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return changed


def entry_arguments(user_site: bool = True) -> list[str]:
    """The interpreter's arguments that run this entry as ``python -m`` does, but with no working folder on
    ``sys.path`` (it is the run's workspace: a file there must not stand in for a module Prefect imports)
    and, without ``user_site``, no user's site folder either."""
    if __spec__ is None:  # run as a file (a container's mounted copy): its folder is e31's own, first on sys.path
        return [os.path.abspath(__file__)]
    flags = [] if user_site else ["-s"]
    if sys.version_info >= (3, 11):
        return [*flags, "-P", "-m", __spec__.name]
    # Python 3.10 has no -P: the '' that -c puts first on sys.path goes before anything is imported (site and
    # its .pth files are read before it is put there).
    return [*flags, "-c", "import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; import runpy; "
            f"runpy.run_module({__spec__.name!r}, run_name='__main__', alter_sys=True)"]


def start_again_with(changed: list[str], control: dict[str, str]) -> None:
    """Where the hand-over changed variables that act only as an interpreter starts (the job's PYTHONPATH,
    LD_PRELOAD, its Prefect settings ...), start this entry again with them, past the gate (its Prefect load
    is then billed). An interpreter that would read only what it read already goes on."""
    acting = sorted(name for name in changed if name.startswith(START_VARIABLES))
    if not acting:
        return
    print(f"e31: the job's {', '.join(acting)} act as an interpreter starts: its entry starts again with them "
          "(billed)", file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable, *entry_arguments()], {**os.environ, **control})  # no gate this time


def is_last_state(engine: Any, state: Any) -> bool:
    """Whether the engine is about to report the top flow run's last state (no retry comes after it)."""
    flow_run = getattr(engine, "flow_run", None)
    if flow_run is None or str(flow_run.id) != os.environ.get("PREFECT__FLOW_RUN_ID"):
        return False  # a subflow's end is not the job's
    if not state.is_final():
        return False
    if state.is_failed():
        retries = getattr(getattr(engine, "flow", None), "retries", None) or 0
        return (flow_run.run_count or 0) > retries  # the server sends a failed run with retries left back
    return True


def take_report_seconds() -> None:
    """Take how long the last state's report may take, as the worker set it, out of the environment: the
    job's own code has no use for it."""
    try:
        _report_seconds.append(max(0.0, float(os.environ.pop(REPORT_SECONDS_VARIABLE, REPORT_SECONDS))))
    except ValueError:
        _report_seconds.append(REPORT_SECONDS)


def report_seconds() -> float:
    """How long the last state's report may take."""
    return _report_seconds[-1] if _report_seconds else REPORT_SECONDS


def unanswered(error: BaseException) -> bool:
    """Whether a report failed for want of an API (unreachable, overloaded), not for what it said."""
    import httpx

    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code >= 500 or error.response.status_code == 429
    return isinstance(error, (httpx.TransportError, TimeoutError))


def leave(state: Any, logger: Any = None, unreported: bool = False) -> None:
    """End this process now, the flow's last state reported (or given up on): what Prefect still has
    queued (logs, events) is sent, for at most ``LEAVE_SECONDS``, and nothing else of the job goes on."""
    if unreported:
        say(UNREPORTED)
    elif logger is not None:
        with contextlib.suppress(Exception):
            logger.info(f"Finished in state {state}")  # what Prefect's teardown would have said
    send_queued(LEAVE_SECONDS)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    completed = getattr(getattr(state, "type", None), "value", "") == "COMPLETED"
    os._exit(0 if completed else 1)


def send_queued(seconds: float) -> bool:
    """Send what Prefect still has queued in this process (logs, events), as the interpreter's exit would,
    for at most ``seconds``: True where all of it went. Prefect's client retries a request the API does not
    answer for about a minute; a process leaving on a bound must not wait for that."""
    deadline = time.monotonic() + seconds
    sent: dict[str, bool] = {}
    sending = [threading.Thread(target=_send_queued, args=(kind, seconds, sent), daemon=True)
               for kind in ("logs", "events")]
    for thread in sending:
        thread.start()
    for thread in sending:
        thread.join(max(0.0, deadline - time.monotonic()))
    return len(sent) == len(sending) and all(sent.values())


def _send_queued(kind: str, seconds: float, sent: dict[str, bool]) -> None:
    """Drain Prefect's log or event worker; ``sent[kind]`` says whether it finished within ``seconds``."""
    with contextlib.suppress(Exception):
        if kind == "logs":
            from prefect.logging.handlers import APILogWorker as service
        else:
            from prefect.events.worker import EventsWorker as service
        _done, not_done = service.drain_all(timeout=seconds)
        sent[kind] = not not_done


def _report_last_state_bounded() -> None:
    """Bound the report of the top flow run's last state: where the API does not take it within
    :func:`report_seconds`, the entry leaves, saying so (the worker reports that outcome once it answers)."""
    import asyncio

    from prefect import flow_engine

    propose_sync = getattr(flow_engine, "propose_state_sync", None)
    propose_async = getattr(flow_engine, "propose_state", None)
    if propose_sync is not None:
        def propose_state_sync(client: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
            if not _reporting_last:
                return propose_sync(client, state, *args, **kwargs)
            done: dict[str, Any] = {}

            def report() -> None:
                try:
                    done["state"] = propose_sync(client, state, *args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 -- handed to the engine's thread below
                    done["error"] = exc

            reporting = threading.Thread(target=contextvars.copy_context().run, args=(report,), daemon=True)
            reporting.start()
            reporting.join(report_seconds())
            if "state" in done:
                return done["state"]
            error = done.get("error", TimeoutError())
            if unanswered(error):
                leave(state, unreported=True)
            raise error

        flow_engine.propose_state_sync = propose_state_sync
    if propose_async is not None:
        async def propose_state(client: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
            if not _reporting_last:
                return await propose_async(client, state, *args, **kwargs)
            try:
                return await asyncio.wait_for(propose_async(client, state, *args, **kwargs), report_seconds())
            except Exception as exc:
                if unanswered(exc):
                    leave(state, unreported=True)
                raise

        flow_engine.propose_state = propose_state


def _say_before_reporting() -> None:
    """Make both of Prefect's flow engines say the flow returned before they report its last state,
    bound that report, and leave once it is reported (and the flow's hooks ran)."""
    try:
        from prefect import flow_engine
    except ImportError:
        return
    _report_last_state_bounded()
    sync_engine = getattr(flow_engine, "FlowRunEngine", None)
    async_engine = getattr(flow_engine, "AsyncFlowRunEngine", None)
    if sync_engine is not None and hasattr(sync_engine, "set_state"):
        reporting = sync_engine.set_state

        def set_state(self: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
            if not is_last_state(self, state):
                return reporting(self, state, *args, **kwargs)
            say_work_ended(state.type.value.lower())
            _reporting_last.append(True)
            try:
                reported = reporting(self, state, *args, **kwargs)
            finally:
                _reporting_last.clear()
            if reported.is_final():
                leave(reported, self.logger)
            return reported

        sync_engine.set_state = set_state
    if async_engine is not None and hasattr(async_engine, "set_state"):
        reporting_async = async_engine.set_state

        async def set_state_async(self: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
            if not is_last_state(self, state):
                return await reporting_async(self, state, *args, **kwargs)
            say_work_ended(state.type.value.lower())
            _reporting_last.append(True)
            try:
                reported = await reporting_async(self, state, *args, **kwargs)
            finally:
                _reporting_last.clear()
            if reported.is_final():
                leave(reported, self.logger)
            return reported

        async_engine.set_state = set_state_async


def first_heartbeat_after_an_interval() -> None:
    """Make Prefect's flow engines send a flow run's first heartbeat one interval after its start, not at it.

    The engine beats at the flow's start and then every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds. The first
    beat is a run's only event from its own process where its flow has no task: it starts Prefect's events client
    (a websocket) and reads four objects to relate the event (the flow, deployment, work queue and work pool),
    about a tenth of a host CPU-second a run. It says nothing the run's Running state has not said, and its
    supervisor watches the process itself. Prefect's check for unresponsive runs (an automation expecting a
    heartbeat within some time *after* a heartbeat) starts at the first beat, so it works as before: a run shorter
    than an interval sends no beat, a longer one beats at the same interval as ever."""
    try:
        from prefect import flow_engine
    except ImportError:
        return
    engine = getattr(flow_engine, "BaseFlowRunEngine", None)
    beat = getattr(engine, "_emit_flow_run_heartbeat", None)
    if beat is None:  # a Prefect without flow run heartbeats (a container's image may hold an older one)
        return

    def beat_from_the_second(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.__dict__.get("_e31_first_beat_skipped"):
            self.__dict__["_e31_first_beat_skipped"] = True
            return None
        return beat(self, *args, **kwargs)

    engine._emit_flow_run_heartbeat = beat_from_the_second


def start_shards() -> None:
    """Start a sharded command's shards now, where the worker said what they run: loading Prefect and
    its engine takes seconds, every rented GPU idle meanwhile. The command flow then follows them."""
    if SHARDS_VARIABLE not in os.environ:
        return
    try:
        from e31_prefect.flows.shard_runner import start_early
    except ImportError:  # an image without e31 installed: the flow starts the shards
        return
    start_early(os.environ)


def wait_for_api(api_url: str | None, seconds: float = 60.0) -> None:
    """Wait (at most ``seconds``) while the Prefect API cannot be reached at all.

    Prefect's engine gives up at once if its first call finds no server (it retries only once it
    has connected), so a job started during a server restart would die before its flow began.
    Any answer, even an error, ends the wait: only an unreachable API is waited for.
    """
    if not api_url:
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=5).close()
            return
        except urllib.error.HTTPError:
            return
        except (OSError, ValueError):
            time.sleep(0.5)


def forward_api(socket_path: str) -> str:
    """Serve the job's Prefect URL on this network's loopback, each connection relayed to the run's
    gateway socket (Prefect's client speaks TCP only). Returns the URL the job's Prefect uses."""
    # A socket's path may be at most 107 bytes: a longer one is reached through its folder's descriptor.
    folder, name = os.path.split(socket_path)
    short_path = socket_path if len(socket_path) < 100 else f"/proc/self/fd/{os.open(folder, os.O_PATH)}/{name}"
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listening.bind(("127.0.0.1", 0))
    listening.listen(64)

    def pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def relay(client: socket.socket) -> None:
        with client, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gateway:
            try:
                gateway.connect(short_path)
            except OSError:
                return
            back = threading.Thread(target=pump, args=(gateway, client), daemon=True)
            back.start()
            pump(client, gateway)
            back.join()

    def accept() -> None:
        while True:
            client, _ = listening.accept()
            # Each chunk goes on at once: a reply relayed in pieces would otherwise wait for the client's
            # delayed acknowledgement of the piece before (40 ms on Linux) at every websocket handshake.
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=relay, args=(client,), daemon=True).start()

    threading.Thread(target=accept, daemon=True, name="e31-api-forward").start()
    return f"http://127.0.0.1:{listening.getsockname()[1]}/api"


_logging_as_loaded: list[tuple[Any, ...] | None] = []  # what the warm interpreter's logging was set up from


def logging_inputs() -> tuple[Any, ...] | None:
    """What Prefect's logging setup reads from the current settings and environment with its own default
    configuration: the three settings its file names, the extra loggers, every ``PREFECT_LOGGING_*`` variable.
    None where a logging file of someone's (``PREFECT_LOGGING_SETTINGS_PATH``) would be read instead."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.logging.config_path.exists():
        return None
    return (settings.logging.level, settings.internal.logging_level, settings.server.logging_level,
            tuple(settings.logging.extra_loggers),
            tuple(sorted((name, value) for name, value in os.environ.items() if name.startswith("PREFECT_LOGGING_"))))


def remember_logging() -> None:
    """In the warm interpreter, once Prefect is loaded: what its logging was set up from."""
    _logging_as_loaded[:] = [logging_inputs()]


def read_settings_again() -> None:
    """Prefect's settings and logging read again from this process's environment: Prefect was loaded by
    the host's warm interpreter (:mod:`e31_prefect.host.warm_interpreter`), in an environment of its own."""
    from prefect import context
    from prefect.logging.configuration import setup_logging

    # Without a global context, Prefect reads its settings (its home, its profiles) from the environment alone,
    # not through the interpreter's, whose home the job's user may not even look into.
    del context.GLOBAL_SETTINGS_CONTEXT
    context.GLOBAL_SETTINGS_CONTEXT = context.root_settings_context()
    # Set up again only where it would come out otherwise (about 60 ms of CPU a run, for the same handlers).
    inputs = logging_inputs()
    if inputs is None or _logging_as_loaded != [inputs]:
        setup_logging(incremental=False)


def main(loaded: bool = False) -> None:
    """Run the flow run named by ``PREFECT__FLOW_RUN_ID`` with Prefect's engine (``loaded``: in a process
    forked from the host's warm interpreter, which imported the engine in an environment of its own)."""
    path = os.environ.pop(WORK_ENDED_VARIABLE, None)
    if path:
        _pipe.append(path)
    hand_over = os.environ.pop(HAND_OVER_VARIABLE, None)
    api_socket = os.environ.pop(API_SOCKET_VARIABLE, None)
    api_url = os.environ.get("PREFECT_API_URL")
    flow_folder = os.environ.pop(FLOW_FOLDER_VARIABLE, None)
    if api_socket:
        os.environ["PREFECT_API_URL"] = forward_api(api_socket)
    prepare_engine()
    if loaded:
        read_settings_again()
    _say_before_reporting()
    first_heartbeat_after_an_interval()
    wait_for_api(os.environ.get("PREFECT_API_URL"))
    with contextlib.ExitStack() as stack:
        prepare_api(stack)
        if hand_over:
            control = {name: value for name, value in ((WORK_ENDED_VARIABLE, path),
                                                       (API_SOCKET_VARIABLE, api_socket),
                                                       (FLOW_FOLDER_VARIABLE, flow_folder),
                                                       ("PREFECT_API_URL", api_url)) if value}
            start_again_with(wait_for_hand_over(hand_over), control)
        take_report_seconds()
        if flow_folder:
            os.chdir(flow_folder)  # as the deployment's pull step would have (its settings files read already)
        start_shards()
        # The engine was imported before the hand-over, on purpose: runpy's warning that it was is noise.
        warnings.filterwarnings("ignore", "'prefect.engine' found in sys.modules", RuntimeWarning)
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
