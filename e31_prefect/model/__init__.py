"""The job model and time: what a job is and what its numbers mean. Pure: no client, no clock, no I/O
beyond reading a job file.

Owns the job (:mod:`.job`, its values :mod:`.job_values`, its work :mod:`.job_work`), the job file read
as hostile YAML (:mod:`.job_file`), one submission's times (:mod:`.job_plan`), durations and deadlines
(:mod:`.timing`), how a run ends (:mod:`.endings`), a run's attempts when hosts are lost
(:mod:`.attempts`), the meter's arithmetic (:mod:`.meter`), shard
settings and their schedule (:mod:`.shards`) and a run's predicted length (:mod:`.prediction`).

May import: only itself, :mod:`e31_prefect.dirs` and :mod:`e31_prefect.job_entry` (tests/unit/test_layout.py).
"""
