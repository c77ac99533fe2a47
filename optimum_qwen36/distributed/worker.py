"""A tensor-parallel worker process: `python -m optimum_qwen36.distributed.worker DEGREE PORT THREADS RANK`
(started by `group.launch`; what it builds and serves comes from the driver's store)."""

from __future__ import annotations

import sys

from .group import worker_main

if __name__ == "__main__":
    degree, port, threads, rank = (int(a) for a in sys.argv[1:5])
    worker_main(rank, degree, port, threads)
