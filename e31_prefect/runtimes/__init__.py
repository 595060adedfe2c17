"""Where a flow run's work executes: a local process (here) or a container (docker)."""
