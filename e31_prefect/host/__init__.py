"""The host: what this machine has and how a run is held on it, whatever asks.

Owns the device inventory and its leases (:mod:`.inventory`, :mod:`.lock_holders`, :mod:`.filelocks`),
the ledger of runs (:mod:`.ledger`), a run's supervisor (:mod:`.supervisor`, :mod:`.supervised_work`,
the worker's side :mod:`.supervision`), the host's heartbeat and a run's fence (:mod:`.heartbeat`, its keeper
:mod:`.fence`), the GPUs' health (:mod:`.device_health`), cgroups, the devices a run may open, sandbox, job users and
what they leave behind (:mod:`.cgroups`, :mod:`.device_rules`, :mod:`.device_fence`, :mod:`.sandbox`
with its PID namespace's init :mod:`.job_init`, :mod:`.job_users`, :mod:`.leftovers`), a run's output disk and bounds
(:mod:`.disk`, :mod:`.output_bounds`, :mod:`.fdtree`), the worker's own files (:mod:`.home_files`) and
settings (:mod:`.settings`), and the job's gateway to the Prefect API that its supervisor serves
(:mod:`.gateway`, :mod:`.gateway_rules`, :mod:`.gateway_bodies`, :mod:`.websocket_frames`).

May import: itself and the parts below it (:mod:`e31_prefect.model`; :mod:`e31_prefect.dirs`,
:mod:`e31_prefect.job_entry`), never the parts above (tests/unit/test_layout.py).
"""
