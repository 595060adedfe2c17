"""Data movement: a job's inputs in, its outputs out, and which host paths its bytes may touch.

Owns staging (:mod:`.staging`), the object store through fsspec (:mod:`.store`), the host's content
cache (:mod:`.cache`), the paths a job may read and write (:mod:`.confine`, :mod:`.keyboard`), the
storage credentials block (:mod:`.blocks`) and a run's return value kept with its outputs (:mod:`.results`).

May import: itself and the parts below it (:mod:`e31_prefect.host`, :mod:`e31_prefect.model`;
:mod:`e31_prefect.dirs`, :mod:`e31_prefect.job_entry`), never the parts above (tests/unit/test_layout.py).
"""
