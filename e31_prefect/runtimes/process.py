"""The process runtime: the flow run as a local process, in a session and cgroup of its own.

Its supervisor starts ``python -s -P -m e31_prefect.job_entry`` (Prefect's
engine, saying when the work is done) before the rent, with no device visible
and nothing of the job's: e31's own environment (:func:`environment`), no
working folder or user site on ``sys.path``. The entry is handed exactly the
rented devices and the job's own environment (:func:`job_variables`), and every
process of it is killed at the end.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e31_prefect.data.results import result_environment
from e31_prefect.host import job_users
from e31_prefect.host.inventory import visible_devices_env
from e31_prefect.host.ledger import Spec
from e31_prefect.job_entry import FLOW_FOLDER_VARIABLE, entry_arguments
from e31_prefect.model import endings
from e31_prefect.runtimes import (
    API_SOCKET_VARIABLE,
    HAND_OVER_VARIABLE,
    WITHHELD_PREFECT,
    WORK_ENDED_VARIABLE,
    Placement,
    job_environment,
    prefect_environment,
)

if TYPE_CHECKING:
    from e31_prefect.host.settings import E31Settings
    from e31_prefect.host.supervision import Supervisor
    from e31_prefect.host.warm_requests import WarmInterpreter

# All a job's process takes from its worker's environment: where programs and Python's modules are (e31's and
# Prefect's), and the locale. Nothing else (credentials, the worker's settings) reaches it.
HOST_VARIABLES = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")


class ProcessRuntime:
    """A run as a local process under its supervisor: as a user of its own, in a network of its own, where
    the worker runs as root (and the pool's ``job_users`` is ``auto``)."""

    name = "process"
    died = endings.PROCESS_DIED
    loads_before_rent = True  # its devices are only variables, set by its entry at the hand-over

    def __init__(self, settings: E31Settings, configuration: Any, warm: WarmInterpreter | None = None,
                 api_csrf: bool = True):
        self.settings = settings
        self.configuration = configuration
        self.api_csrf = api_csrf  # whether the Prefect API asks for CSRF tokens, as the worker's client found
        self.isolated = isolated(settings)
        self.warm = warm  # the worker's warm interpreter, which forks the job's entry with Prefect loaded

    async def check(self) -> str | None:
        if not self.isolated:
            return None
        unreadable = await asyncio.to_thread(unreadable_to_jobs, needed_paths(self.configuration))
        if unreadable:
            first = self.settings.job_uid_range[0]
            return (f"a job's own user (uid {first} and up) cannot read {', '.join(unreadable)}: "
                    "make them readable to others (chmod o+rX on each folder down to them), "
                    "or set E31_JOB_USERS=worker")
        return None

    def spec(self, placement: Placement) -> Spec:
        home = placement.workspace / "home"
        home.mkdir(parents=True, exist_ok=True)
        view = [*needed_paths(self.configuration), placement.workspace, placement.folder.path]
        uids = self.settings.job_uid_range
        isolated = {"private_network": True, "job_user_locks": str(job_users.LOCKS),
                    "job_writable": [str(placement.output_dir), str(home)],
                    "job_view": [str(path) for path in view],
                    # The host's lock folders: a job must not hold the lock of a device (or a uid) it was not given.
                    "job_hidden": [str(self.settings.device_locks), str(job_users.LOCKS)],
                    "job_temp_bytes": self.settings.job_temp_bytes,
                    "job_uids": [uids[0], uids[-1]],
                    "warm_interpreter": str(self.warm.socket_path()) if self.warm is not None else None,
                    } if self.isolated else {}
        env = {**environment(placement, home), **known_answers(self.configuration, self.api_csrf)}
        return placement.spec(
            self.name, argv=[sys.executable, *entry_arguments(user_site=False)], env=env,
            hand_over_env=job_variables(placement), cwd=str(placement.workspace), **isolated)

    async def start(self, placement: Placement, supervisor: Supervisor) -> None:
        return None  # the supervisor starts the process itself

    def ended(self) -> None:
        return None  # Prefect's own events say how the flow run ended


def isolated(settings: E31Settings) -> bool:
    """Whether a process job runs as a user of its own, in namespaces of its own (the worker runs as root and
    the pool's ``job_users`` is ``auto``): only then is its entry forked by the host's warm interpreter."""
    return settings.job_users == "auto" and os.geteuid() == 0


def warm_interpreter(home: Path) -> WarmInterpreter:
    """A worker's warm interpreter, its files in ``home``, started with e31's own environment alone."""
    from e31_prefect.host.warm_requests import WarmInterpreter

    return WarmInterpreter(home / "warm", {k: os.environ[k] for k in HOST_VARIABLES if k in os.environ})


def needed_paths(configuration: Any) -> list[Path]:
    """What a job's process reads besides its workspace: Python (its environment and its base), Prefect,
    e31's entry, what PYTHONPATH adds, the job's code."""
    import prefect

    paths = [Path(sys.prefix), Path(sys.base_prefix), Path(prefect.__file__).parent,
             Path(__file__).parent.parent]  # e31_prefect's own folder
    paths += [Path(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if configuration is not None:  # the job's folder and, for a `prefect deploy` deployment, its code's
        paths += [code for code in (configuration.code_mount(), configuration._code_folder) if code is not None]
    return paths


def unreadable_to_jobs(paths: list[Path]) -> list[str]:
    """Those of ``paths`` a job's own user could not read (the folders above them are shown to it
    whatever their modes: :mod:`e31_prefect.host.sandbox`)."""
    def readable(path: Path) -> bool:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return False
        bits = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
        return mode & bits == bits

    return [str(path) for path in paths if not readable(path)]


def environment(placement: Placement, home: Path) -> dict[str, str]:
    """What the job's process starts with, before its hand-over: e31's own, an allow-list with nothing of the
    job's. The host's paths and locale, a home in its workspace (Prefect's own there too, so no profile of
    the worker's is read), Prefect's variables for the run as the worker sets them (not the ``env`` job
    variable's), where the flow's result is kept, no device, its pipes and its gateway to the Prefect API."""
    host = {k: os.environ[k] for k in HOST_VARIABLES if k in os.environ}
    return {**host, "HOME": str(home), "PREFECT_HOME": str(home / ".prefect"),
            **prefect_environment(placement.configuration.run_environment),
            **result_environment(placement.output_dir),
            **visible_devices_env([]),
            WORK_ENDED_VARIABLE: str(placement.folder.work_ended_pipe),
            HAND_OVER_VARIABLE: str(placement.folder.hand_over_pipe),
            API_SOCKET_VARIABLE: str(placement.folder.api_socket)}


def known_answers(configuration: Any, api_csrf: bool) -> dict[str, str]:
    """Prefect settings that spare a job's engine the API calls whose answers its worker already has; each
    costs the server, the run's gateway and the job's own start (about 20 ms of host CPU a call).

    - The server's version: the job's Prefect is the worker's own, which checked this server at its start.
    - CSRF tokens, where the worker's client was told the API does not use them.
    - The deployment: where its pull steps only move into a folder on this host, the entry moves there
      itself at the hand-over and its engine loads the flow from the entrypoint at once (as Prefect's
      runner does with ``PREFECT__FLOW_ENTRYPOINT``), instead of reading the deployment, running the step
      and sending an event about it (a websocket and four reads for its related objects). The process
      still starts in its workspace: Prefect reads settings files (``.env``, ``prefect.toml``) from where
      it starts, and the job's folder is the job's.
    """
    settings = {"PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED": "false"}
    if not api_csrf:
        settings["PREFECT_CLIENT_CSRF_SUPPORT_ENABLED"] = "false"
    run_env = configuration.run_environment
    if configuration.flow_folder and configuration.entrypoint and "PREFECT__FLOW_ENTRYPOINT" not in run_env:
        settings.update({"PREFECT__FLOW_ENTRYPOINT": configuration.entrypoint,
                         FLOW_FOLDER_VARIABLE: configuration.flow_folder})
    return settings


def csrf_in_use(client: Any) -> bool:
    """Whether the Prefect API asks for CSRF tokens, as ``client`` (the worker's) found out: Prefect's client
    asks on its first change and stops once told they are off. True until it knows otherwise."""
    return getattr(getattr(client, "_client", None), "enable_csrf_support", True) is not False


def job_variables(placement: Placement) -> dict[str, str | None]:
    """What the job and its deployment declare (the ``env`` job variable, then work.env), and its dirs and
    shards: given at the hand-over with its devices (which come last, so it cannot widen its view), set by
    its entry before any code of the job runs. A null unsets one of Prefect's variables, as the job
    variable asks."""
    given = placement.configuration.given_environment
    unset = {name: None for name, value in given.items() if value is None and not name.startswith(WITHHELD_PREFECT)}
    job = job_environment(placement.job, [], placement.data_dir, placement.output_dir,
                          placement.configuration.shards_start)
    control = (WORK_ENDED_VARIABLE, HAND_OVER_VARIABLE, API_SOCKET_VARIABLE)  # the entry's, given at its start
    return {name: value for name, value in {**unset, **prefect_environment(given), **job}.items()
            if name not in control}
