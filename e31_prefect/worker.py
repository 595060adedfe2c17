"""The e31 worker type, by the name the ``prefect.collections`` entry point gives.

    prefect worker start --pool NAME --type e31

pyproject.toml registers ``e31_prefect = "e31_prefect.worker"``: importing this module registers the
``e31`` worker type with Prefect. The name stays because an installed copy records its entry point at
install time; the worker itself lives in :mod:`e31_prefect.surface.worker`.
"""

from e31_prefect.surface.worker import E31Worker, E31WorkerResult
from e31_prefect.surface.worker_configuration import E31JobConfiguration, E31Variables

__all__ = ["E31JobConfiguration", "E31Variables", "E31Worker", "E31WorkerResult"]
