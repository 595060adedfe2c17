"""The built-in flows that run inside a job's process: a plain command, shards of a command or of a flow.

Owns the command flow (:mod:`.command_flow`), the flow-shards flow (:mod:`.flow_shards`) and the shard
runner both use (:mod:`.shard_runner`). Deployments name them by the stable paths
``e31_prefect.command_flow.run_command`` and ``e31_prefect.flow_shards.run_flow_shards`` (the
top-level modules of those names).

May import: itself and the parts below it (:mod:`e31_prefect.runtimes`, :mod:`e31_prefect.planning`,
:mod:`e31_prefect.data`, :mod:`e31_prefect.host`, :mod:`e31_prefect.model`; :mod:`e31_prefect.dirs`,
:mod:`e31_prefect.job_entry`), never the parts above (tests/unit/test_layout.py).
"""
