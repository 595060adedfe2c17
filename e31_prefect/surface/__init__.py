"""Prefect's surface: the e31 worker and everything it says to and reads from the Prefect API.

Owns the worker (:mod:`.worker`, its pool form and run configuration :mod:`.worker_configuration`, its
backlog reading :mod:`.worker_backlog`), the life of one job (:mod:`.life`, :mod:`.life_terms`,
:mod:`.life_watch`, :mod:`.life_sending`, its attempt :mod:`.life_attempts`, adoption :mod:`.life_adoption`),
the pool's watch over its hosts (:mod:`.host_watch`, their heartbeats :mod:`.beats`, ending a lost attempt
:mod:`.lost_attempts`, drained hosts and GPUs :mod:`.drains`, ``e31 hosts`` :mod:`.hosts_table`), reports as
events, states, tags and artifacts
(:mod:`.reporting`, :mod:`.plan_artifact`), the run states it watches (:mod:`.run_states`), pool and
team quotas (:mod:`.quotas`), the published inventories (:mod:`.inventories`), the spool of outputs
not sent (:mod:`.spool`), submissions (:mod:`.submission`), the ``@e31`` decorator (:mod:`.decorators`)
and the template of a pool that replaces a DockerWorker pool (:mod:`.pool_templates`).

May import: itself and every part below it (:mod:`e31_prefect.flows`, :mod:`e31_prefect.runtimes`,
:mod:`e31_prefect.planning`, :mod:`e31_prefect.data`, :mod:`e31_prefect.host`, :mod:`e31_prefect.model`;
:mod:`e31_prefect.dirs`, :mod:`e31_prefect.job_entry`); only :mod:`e31_prefect.cli` and the package's
public names import it (tests/unit/test_layout.py).
"""
