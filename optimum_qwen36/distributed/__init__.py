"""Tensor parallelism's processes: the group (gloo collectives, the store, launching workers) and the
replicated control plane that runs the driver's calls on every rank."""
