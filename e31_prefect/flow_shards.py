"""The built-in flow-shards flow, by the entrypoint deployments store (:mod:`e31_prefect.flows.flow_shards`).

Deployments of sharded flows name ``e31_prefect.flow_shards.run_flow_shards`` (``FLOW_SHARDS_ENTRYPOINT``),
and the Prefect server keeps that name for as long as they exist: it must keep loading.
"""

from e31_prefect.flows.flow_shards import run_flow_shards

__all__ = ["run_flow_shards"]
