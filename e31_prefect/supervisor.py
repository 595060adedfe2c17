"""A run's supervisor, by its stable command line (:mod:`e31_prefect.host.supervisor`).

    python -m e31_prefect.supervisor $E31_HOME/ledger/<flow run id>

The command line stays: the worker starts each supervisor with it, and a device's lock holder is named a
run's supervisor by it (:data:`e31_prefect.host.lock_holders.SUPERVISOR_MODULE`), supervisors that an
earlier version started and that outlived their worker included.
"""

import sys

from e31_prefect.host.supervisor import main

if __name__ == "__main__":
    sys.exit(main())
