"""``@e31(...)``: bind a flow to an e31 work pool, so that calling it runs it as an E31 job.

    from prefect import flow
    from e31_prefect import e31

    @e31(work_pool="gpu", gpus=1, max_duration="2h", deadline="+8h",
         data=["s3://footage/night/"], output="s3://results/{job}/{flow_run.id}/")
    @flow
    def track(threshold: int = 60) -> dict: ...

    track(threshold=50)   # staged, rented, run, outputs sent, released, metered; returns its value

In the manner of prefect-docker's ``@docker``: the call starts an e31 worker in
this process, which lives the job's whole life from the flow's source file
(no deployment, no bundle storage) and returns the flow's result. The run's
job variables carry the entrypoint, so it is an ordinary E31 run in the UI.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from prefect import Flow, get_client
from prefect.flows import InfrastructureBoundFlow
from prefect.logging import get_logger
from prefect.utilities.asyncutils import run_coro_as_sync
from prefect.utilities.callables import get_call_parameters
from typing_extensions import ParamSpec

from e31_prefect.data.results import wait_released
from e31_prefect.model.job import Request, parse_job
from e31_prefect.model.job_file import anchor
from e31_prefect.model.job_values import JobError, Problem, job_name
from e31_prefect.surface.submission import DEFAULT_POOL

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup  # the builtin from 3.11; Prefect installs the backport

P = ParamSpec("P")
R = TypeVar("R")

_REQUEST_FIELDS = frozenset(Request.model_fields)


class E31Flow(InfrastructureBoundFlow[P, R]):
    """A flow bound to an e31 pool: calling it runs it as an E31 job and returns its result."""

    def __call__(self, *args: Any, return_state: bool = False, **kwargs: Any) -> Any:
        """Run the flow as an E31 job through an e31 worker in this process; its value (or final state)."""

        if os.environ.get("PREFECT__FLOW_ENTRYPOINT") == self.job_variables["work"]["flow"]:
            # The job's process is importing the flow's file to run it: a call at the top of that file
            # would start the job again from inside itself.
            raise RuntimeError(f"{self.name!r} was called while its own E31 job loads its file; call it under "
                               "`if __name__ == \"__main__\":` so that only you start it")

        async def call() -> Any:
            parameters = get_call_parameters(self, args, kwargs)
            try:
                async with self.worker_cls(work_pool_name=self.work_pool) as worker:
                    with warnings.catch_warnings():
                        # Prefect marks ad hoc submission experimental; here it is the documented way in.
                        warnings.simplefilter("ignore", FutureWarning)
                        future = await worker.submit(flow=self, parameters=parameters,
                                                     job_variables=self.job_variables)
            except BaseExceptionGroup as group:  # the worker's task group wraps what went wrong
                raise group.exceptions[0] if len(group.exceptions) == 1 else group from None
            # Leaving the worker waited for the job's whole life here: outputs sent, result moved with
            # them, meter closed. A run this host could not rent for went back to the pool; then the
            # caller waits for whichever e31 worker takes it.
            async with get_client() as client:
                state = (await client.read_flow_run(future.flow_run_id)).state
                if state is not None and state.is_scheduled():
                    get_logger("e31").warning(
                        "No room on this host for %r (%s); it waits in work pool %r for an e31 worker",
                        self.name, state.message, self.work_pool)
                    state = (await wait_released(client, future.flow_run_id)).state
            return state if return_state else await state.aresult()

        return call() if inspect.iscoroutinefunction(self.fn) else run_coro_as_sync(call())


def e31(
    work_pool: str = DEFAULT_POOL,
    *,
    team: str | None = None,
    timezone: str | None = None,
    image: str | None = None,
    env: dict[str, str] | None = None,
    data: Iterable[str | dict[str, Any]] = (),
    output: str | None = None,
    expect: Iterable[str] = (),
    storage: str | None = None,
    **request: Any,
) -> Callable[[Flow[P, R]], E31Flow[P, R]]:
    """Bind a flow to the e31 pool ``work_pool`` with the job's request, data and output.

    ``request`` takes the job file's request fields (``gpus``, ``gpu_type``, ``max_duration``,
    ``until_done``, ``expected_duration``, ``start``, ``deadline``, ``priority``, ``cpus``, ``memory``).
    ``data`` items are URLs (or the job file's ``{from, to, size, sha256}`` mappings); relative paths
    are read from the flow's folder. A bad value raises :class:`JobError` naming the field and the fix.
    """
    unknown = sorted(set(request) - _REQUEST_FIELDS)
    if unknown:
        raise JobError([Problem(name, request[name], "not a request field; use one of "
                                + ", ".join(sorted(_REQUEST_FIELDS - {"start"}))) for name in unknown], "@e31(...)")
    if "start" in request:
        raise JobError([Problem("start", request["start"], "a called flow starts now; for a later start, deploy "
                                "it with a schedule (prefect deploy) or submit a job file (e31 submit)")], "@e31(...)")

    def bind(flow: Flow[P, R]) -> E31Flow[P, R]:
        source = Path(inspect.getfile(flow.fn)).resolve()
        job = parse_job({
            "name": job_name(flow.name),
            "team": team,
            "timezone": timezone,
            "work": {"flow": f"{source}:{flow.fn.__name__}", "image": image, "env": env or {}},
            "data": [item if isinstance(item, dict) else {"from": item} for item in data],
            "request": request,
            "output": {"to": output, "expect": list(expect)},
            "storage": storage,
        }, source="@e31(...)")
        job_variables = anchor(job, source.parent).to_job_variables()
        bound = E31Flow[P, R](flow.fn, work_pool=work_pool, job_variables=job_variables, worker_cls=_worker_class())
        # Keep everything the @flow decorator set (name, retries, result settings...), as Prefect's binding does.
        for attribute, value in flow.__dict__.items():
            if attribute not in ("work_pool", "job_variables", "worker_cls"):
                setattr(bound, attribute, value)
        return bound

    return bind


def _worker_class() -> type:
    from e31_prefect.surface.worker import E31Worker  # the worker imports this package; import it when binding

    return E31Worker
