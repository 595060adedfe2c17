"""Scheduling: which waiting run goes next, on which devices, and what the pool's backlog is.

Owns the decision and its simulator (:mod:`.scheduling`), the pool's backlog read from Prefect and kept
between polls (:mod:`.backlog`, :mod:`.backlog_watch`) and the deployments' past runs
(:mod:`.run_history`). Pure apart from reading the backlog and the history.

May import: itself and the parts below it (:mod:`e31_prefect.data`, :mod:`e31_prefect.host`,
:mod:`e31_prefect.model`; :mod:`e31_prefect.dirs`, :mod:`e31_prefect.job_entry`), never the parts
above (tests/unit/test_layout.py).
"""
