"""The e31 work pool's form (:class:`E31Variables`) and one flow run's job as the worker receives it
(:class:`E31JobConfiguration`), with what the worker reads of the run's deployment.

``prefect work-pool create NAME --type e31`` shows this form; ``prefect deploy`` fills it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect.client.schemas.objects import FlowRun
from prefect.settings import Settings, get_current_settings
from prefect.workers.base import BaseVariables
from prefect_docker.worker import DockerWorkerJobConfiguration
from pydantic import Field, PrivateAttr, create_model

from e31_prefect.flows.command_flow import COMMAND_FLOW_ENTRYPOINT
from e31_prefect.flows.flow_shards import FLOW_SHARDS_ENTRYPOINT
from e31_prefect.host import output_bounds
from e31_prefect.model.job import Job
from e31_prefect.model.job_file import anchor, code_root
from e31_prefect.model.job_values import JOB_VARIABLE_KEYS, MISSING, JobError, Problem, job_name
from e31_prefect.runtimes import SET_FOR_THE_RUN
from e31_prefect.runtimes import container as containers

if TYPE_CHECKING:
    from prefect.client.schemas.objects import Flow as APIFlow
    from prefect.client.schemas.objects import WorkPool
    from prefect.client.schemas.responses import DeploymentResponse


REQUEST_MISSING = Problem("request", MISSING, (
    "is required: a run says what it rents and for how long. Give it as a job variable of the deployment "
    "(prefect.yaml: job_variables: {request: {gpus: 1, max_duration: 2h}}) or of the run "
    "(prefect deployment run NAME --job-variable 'request={\"gpus\": 1, \"max_duration\": \"2h\"}'), or give "
    "the pool a default request for every run that sets none (e31 pool migrate, or "
    "variables.properties.request.default in its base job template)"))


def _job_fields(raw: bool) -> dict[str, Any]:
    """The job's own fields (team, work, data, request, output, ...), declared once, on the :class:`Job` model.

    The pool's form shows them as the model declares them; the job configuration takes them as
    raw values, checked by the model when a run is lived, so a bad one fails that run with the
    job file's own message instead of failing the poll.
    """
    fields: dict[str, Any] = {}
    for key in JOB_VARIABLE_KEYS:
        info = Job.model_fields[key]
        annotation = Any if raw else info.annotation | None
        fields[key] = (annotation, Field(default=None, title=info.title, description=info.description,
                                         examples=info.examples))
    return fields


def _docker_fields() -> dict[str, Any]:
    """prefect-docker's job variables, declared by prefect-docker, each described as it works on an e31 pool."""
    fields: dict[str, Any] = {}
    for name, meaning in containers.DOCKER_SETTINGS.items():
        info = DockerWorkerJobConfiguration.model_fields[name]
        # No default image: prefect-docker computes one (with a git subprocess) that an e31 job never uses.
        annotation, default = (str | None, None) if name == "image" else (
            info.annotation, info.get_default(call_default_factory=True))
        fields[name] = (annotation, Field(default=default, title=info.title, description=meaning,
                                          examples=info.examples))
    return fields


class _PoolSettings(BaseVariables):
    """The e31 work pool's form: the job's fields, prefect-docker's settings, and this one of e31's."""

    command: str | None = Field(
        default=None, title="Command",
        description="Refused: e31 runs Prefect's engine itself; a job's work is its work.flow or work.command.")
    env: dict[str, str | None] = Field(
        default_factory=dict, title="Environment Variables",
        description="Environment variables to set when starting a flow run (a job's own are its work.env). "
        "Refused: PREFECT_API_URL (a job reaches Prefect through its run's gateway), Prefect's credentials, "
        "server settings and home, and what e31 sets for each run: " + ", ".join(SET_FOR_THE_RUN) + ".")
    gpu_device_requests: containers.GpuRequests = Field(
        default="auto", title="GPU device requests",
        description="Send containers a device request for their GPUs: auto (when the engine has the NVIDIA "
        "runtime), on or off. The visible-devices variables are always set.",
        examples=["auto"])
    default_disk: str = Field(
        default=output_bounds.DEFAULT_DISK, title="Default disk",
        description="Disk a run may write in its output dir when its job sets no request.disk (bytes or 512m, "
        "16g, 2Gi). A run that fills it ends DiskLimit, keeping what it wrote.",
        examples=["20g"])
    max_output_files: int = Field(
        default=output_bounds.DEFAULT_MAX_OUTPUT_FILES, title="Most output files",
        description="Files and folders a run may leave in its output dir. A run past it ends TooManyOutputs and "
        "the first ones are sent.",
        examples=[100000])
    output_send_seconds: int = Field(
        default=output_bounds.DEFAULT_SEND_SECONDS, title="Time to send outputs",
        description="Seconds a run's outputs may take to send (on unbilled worker time); what is left then "
        "stays in the spool (e31 outputs retry), the run OutputNotSent.",
        examples=[3600])


E31Variables = create_model("E31Variables", __base__=_PoolSettings, __module__=__name__, **_docker_fields(),
                            **_job_fields(raw=False))
E31Variables.__doc__ = "The e31 work pool's form: the job's team, work, data, request and output, and the pool's."


_SERIALIZED: list[tuple[Settings, dict[str, str]]] = []  # the last settings serialized, and their variables


def settings_environment(settings: Settings) -> dict[str, str]:
    """``settings`` as the variables Prefect gives each run (the set ones), serialized once per settings object."""
    if not _SERIALIZED or _SERIALIZED[0][0] is not settings:
        _SERIALIZED[:] = [(settings, settings.to_environment_variables(exclude_unset=True))]
    return _SERIALIZED[0][1]


class _Configuration(DockerWorkerJobConfiguration):
    """One flow run's job as the worker receives it: raw job variables, validated in :meth:`job`."""

    gpu_device_requests: containers.GpuRequests = Field(default="auto")
    # prefect-docker's image variable: the job's image where its work gives none. No default is computed.
    image: str | None = Field(default=None)
    # The pool's bounds on outputs, raw: a bad value fails its run naming it (output_bounds.bounds_for).
    default_disk: Any = Field(default=None)
    max_output_files: Any = Field(default=None)
    output_send_seconds: Any = Field(default=None)

    _job_name: str = PrivateAttr(default="job")
    _command_given: str | None = PrivateAttr(default=None)
    _env_given: dict[str, Any] | None = PrivateAttr(default=None)
    _run_env: dict[str, str] | None = PrivateAttr(default=None)
    _labels_given: dict[str, Any] | None = PrivateAttr(default=None)
    _job_folder: Path | None = PrivateAttr(default=None)
    _code_folder: Path | None = PrivateAttr(default=None)
    _entrypoint: str | None = PrivateAttr(default=None)
    _shards_start: tuple[list[str], str] | None = PrivateAttr(default=None)
    _flow_folder: str | None = PrivateAttr(default=None)

    @classmethod
    def json_template(cls) -> dict[str, Any]:
        """Template only what the pool's form offers; the rest of a container is the worker's to set."""
        return {k: v for k, v in super().json_template().items() if k in E31Variables.model_fields}

    @classmethod
    def _base_environment(cls) -> dict[str, str]:
        """Prefect's: the worker's settings as variables for every run. Serializing them costs the worker about
        20 ms of CPU, the same for each run; it is done once per settings object (a worker's stay the same,
        ``temporary_settings`` makes a new one)."""
        return dict(settings_environment(get_current_settings()))

    def prepare_for_flow_run(
        self,
        flow_run: FlowRun,
        deployment: DeploymentResponse | None = None,
        flow: APIFlow | None = None,
        work_pool: WorkPool | None = None,
        worker_name: str | None = None,
        worker_id: UUID | None = None,
    ) -> None:
        """Stamp Prefect's environment and labels; the job is named after its deployment.

        Prefect's own variables for the run (the worker's settings, the flow run's id, who runs it) are kept
        apart from what the ``env`` job variable adds (:attr:`run_environment`): a job's process waits for its
        hand-over with the first only.
        """
        given = dict(self.env or {})
        self._command_given, self._env_given, image = self.command, given, self.image
        self._labels_given = dict(self.labels or {})
        self.image = image or "unused"  # spares prefect-docker computing a default image (a git subprocess)
        self.env = {}
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        self._run_env = dict(self.env)
        # As Prefect merges them: the job variable last, a null unsetting one of Prefect's.
        self.env = {name: value for name, value in {**self._run_env, **given}.items() if value is not None}
        self.image = image
        self._job_name = job_name(deployment.name if deployment else flow_run.name)  # Prefect allows spaces
        self._job_folder = job_folder(deployment)
        self._code_folder = code_folder(deployment)
        self._entrypoint = deployment.entrypoint if deployment else None
        self._shards_start = shards_start(flow_run, deployment)
        self._flow_folder = only_moves_into(deployment) if deployment and deployment.entrypoint else None
        entrypoint = (getattr(self, "work", None) or {}).get("flow")
        if deployment is None and entrypoint:
            # A run with no deployment (an @e31 flow) names its source file: the flow is loaded
            # from there, and the file's folder is its code (mounted read-only in a container).
            folder = Path(entrypoint.rsplit(":", 1)[0]).parent
            self.env["PREFECT__FLOW_ENTRYPOINT"] = self._run_env["PREFECT__FLOW_ENTRYPOINT"] = entrypoint
            self._entrypoint = entrypoint
            self._job_folder = self._code_folder = folder if folder.is_dir() else None
            if flow is not None:
                self._job_name = job_name(flow.name)

    @property
    def entrypoint(self) -> str | None:
        """The flow the run's deployment (or decorated flow) runs, where known."""
        return self._entrypoint

    @property
    def run_environment(self) -> dict[str, str]:
        """Prefect's variables for the run as the worker sets them, without the ``env`` job variable's (none
        before :meth:`prepare_for_flow_run`: then every variable counts as the job's)."""
        return dict(self._run_env or {})

    @property
    def given_environment(self) -> dict[str, str | None]:
        """The ``env`` job variable as the deployment and the run give it (the job's own, as its work.env is;
        a null asks one of Prefect's variables unset)."""
        return dict(self.env if self._env_given is None else self._env_given)

    @property
    def flow_folder(self) -> str | None:
        """The folder the run's flow runs in where its deployment's pull steps do nothing but move there (its
        entry moves there itself at the hand-over, and loads the flow from the entrypoint at once); else None."""
        return self._flow_folder

    @property
    def shards_start(self) -> tuple[list[str], str] | None:
        """What a sharded command's shards run and in which folder, where known before the work starts."""
        return self._shards_start

    def job(self, name: str | None = None) -> Job:
        """The validated job; raises :class:`JobError` naming each bad field. Its image is its ``work.image``,
        else the run's ``image`` (prefect-docker's variable, so that a prefect-docker deployment runs as it is).

        Relative local paths (as a hand-written deployment may give) are read from the deployment's folder.
        """
        values = {k: getattr(self, k) for k in JOB_VARIABLE_KEYS}
        work = values["work"]
        if self.image and (work is None or isinstance(work, dict) and not work.get("image")):
            values["work"] = {**(work or {}), "image": self.image}  # a prefect-docker deployment's image
        try:
            job = Job.from_job_variables(values, name=name or self._job_name)
        except JobError as exc:  # a run's request comes from its job variables or its pool: say so
            raise JobError([REQUEST_MISSING if (p.field, p.value) == ("request", MISSING) else p
                            for p in exc.problems], exc.source) from None
        return anchor(job, self._code_folder) if self._code_folder else job

    def setting_problems(self, allowed_volumes: list[Path]) -> list[Problem]:
        """The prefect-docker settings of this run that an e31 pool refuses, each with the e31 way instead."""
        settings = {name: getattr(self, name) for name in containers.DOCKER_SETTINGS}
        # As given, before Prefect adds its own.
        env = self.env if self._env_given is None else self._env_given
        labels = self.labels if self._labels_given is None else self._labels_given
        return containers.setting_problems({**settings, "command": self._command_given, "env": env,
                                            "labels": labels}, allowed_volumes)

    def code_mount(self) -> Path | None:
        """The folder of the job's code that its container sees read-only at its own path: the job's folder,
        or the project folder holding it and a flow file that lives beside it (``../flows/x.py``)."""
        if self._job_folder is None:
            return None
        source = (self._entrypoint or "").rsplit(":", 1)[0]
        if self._entrypoint == FLOW_SHARDS_ENTRYPOINT:  # e31's flow shards: the code is the job's work.flow
            source = ((getattr(self, "work", None) or {}).get("flow") or "").rsplit(":", 1)[0]
        if not source.endswith(".py"):
            return self._job_folder  # a module (e31's command flow): the command runs in the job's folder
        return code_root(self._job_folder, (self._job_folder / source).resolve()) or self._job_folder


E31JobConfiguration = create_model("E31JobConfiguration", __base__=_Configuration, __module__=__name__,
                                   **_job_fields(raw=True))


SET_WORKING_DIRECTORY = "prefect.deployments.steps.set_working_directory"  # a local deployment's pull step


def only_moves_into(deployment: DeploymentResponse | None) -> str | None:
    """The folder a deployment's pull steps move into, where moving there is all they do (its only step, as
    e31 submit and a local ``prefect deploy`` write) and it is a folder on this host; else None."""
    steps = (deployment.pull_steps or []) if deployment is not None else []
    if len(steps) != 1 or list(steps[0]) != [SET_WORKING_DIRECTORY]:
        return None
    step = steps[0][SET_WORKING_DIRECTORY]
    folder = step.get("directory") if isinstance(step, dict) and list(step) == ["directory"] else None
    return folder if isinstance(folder, str) and os.path.isabs(folder) and os.path.isdir(folder) else None


def shards_start(flow_run: FlowRun, deployment: DeploymentResponse | None) -> tuple[list[str], str] | None:
    """The command a run of e31's command flow gives its shards (its parameter) and the folder they run in,
    where nothing but moving into that folder comes first: the job's entry can start them before Prefect
    loads. Else None.
    """
    if deployment is None or deployment.entrypoint != COMMAND_FLOW_ENTRYPOINT:
        return None
    folder, command = only_moves_into(deployment), flow_run.parameters.get("command")
    if folder is None or not (isinstance(command, list) and command and all(isinstance(p, str) for p in command)):
        return None
    return command, folder


def code_folder(deployment: DeploymentResponse | None) -> Path | None:
    """Where a deployment's code lives on this host: the folder its pull step moves into (``prefect deploy``
    of local code writes a ``set_working_directory`` step, as e31 does), else its path.

    The pull step first: it is where the flow really runs, and ``prefect deploy`` over a deployment
    that e31 made keeps the old ``path``.
    """
    if deployment is None:
        return None
    folders = [step[SET_WORKING_DIRECTORY].get("directory")
               for step in deployment.pull_steps or [] if SET_WORKING_DIRECTORY in step]
    folders += [deployment.path] if deployment.path else []
    return next((Path(folder) for folder in folders if folder and Path(folder).is_dir()), None)


def job_folder(deployment: DeploymentResponse | None) -> Path | None:
    """The job file's folder on this host, for a deployment made from a job file (its code lives there)."""
    if deployment is None or not deployment.path:
        return None
    steps = deployment.pull_steps or []
    made_by_e31 = steps == [{SET_WORKING_DIRECTORY: {"directory": deployment.path}}]
    folder = Path(deployment.path)
    return folder if made_by_e31 and folder.is_dir() else None
