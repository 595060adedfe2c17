"""The built-in command flow, by the entrypoint deployments store (:mod:`e31_prefect.flows.command_flow`).

Deployments of command jobs name ``e31_prefect.command_flow.run_command`` (``COMMAND_FLOW_ENTRYPOINT``),
and the Prefect server keeps that name for as long as they exist: it must keep loading.
"""

from e31_prefect.flows.command_flow import run_command

__all__ = ["run_command"]
