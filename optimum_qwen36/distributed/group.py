"""The processes of a tensor-parallel model and how they talk: a torch.distributed process group for the
model's collectives (gloo for cpu tensors; TorchNeuron's "neuron" group on the neuron backend, beside a gloo
group for the cpu tensors of saving), its TCPStore for everything else (calls, outcomes, startup reports).

Two ways to get the processes:

- `launch` (from_pretrained(..., tp_degree=N) in an ordinary process): this process is rank 0 and starts
  N - 1 worker processes (`python -m optimum_qwen36.distributed.worker`: fresh interpreters that do not
  re-run the caller's script), on this machine, with a store on a free local port; each rank gets its
  share of this process's threads.
- under `torchrun` (RANK / WORLD_SIZE set, one node or several): every process is one of torchrun's; rank 0
  is the driver and the others serve it (`torch.distributed.init_process_group("gloo")`, env://).

The gloo group is standalone in the spawned case (not torch.distributed's default group), so a user's own
process group is left alone. TorchNeuron's group cannot be: its collectives look their ranks up in
torch.distributed's registry, and it sets up the Neuron runtime of the process (one NeuronCore per rank) when
it is created, so it is created by `init_process_group("neuron")` before any device work, as the Neuron
torch.distributed guide does. A worker that dies makes the driver's next collective fail at once
("connection closed by peer"); the group then reports which rank died and how.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..network.sharding import bind_group, named_process_group, stand_in_group

logger = logging.getLogger(__name__)

# How long one collective may wait for the other ranks (they run the same layer in between), and how long
# a worker may take to build its model shard (load, shard and, for compiled backends, compile).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
STARTUP_TIMEOUT = datetime.timedelta(hours=2)
# How long the driver, closing the model, waits for each worker to report that it has released its groups.
LEAVE_TIMEOUT = datetime.timedelta(seconds=30)
# How often a wait for a store key checks whether the workers still run.
POLL_SECONDS = 0.01
HOST = "127.0.0.1"
JOB_KEY = "job"
READY_KEY = "ready"
CONNECT_KEY = "connect"
STARTUP_KEY = "startup"
# The torch.distributed backend of the model's collectives when they run on cpu tensors.
GLOO = "gloo"
SECRET_ENV = "OPTIMUM_QWEN36_TP_SECRET"
# The store refuses messages above 8 MiB (a tokenizer is about 10 MB pickled): larger ones go in parts.
STORE_MESSAGE_BYTES = 4 * 2**20


class TensorParallelWorkerError(RuntimeError):
    """A tensor-parallel worker failed or died: the model cannot run any more (create it again)."""


def broke_a_collective(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because another rank went away (or never came)."""
    return "Connection closed by peer" in str(error) or "Timed out" in str(error)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


class TensorParallelGroup:
    """One rank's view of the group: its rank, the degree, the collectives and the store."""

    def __init__(
        self,
        rank: int,
        degree: int,
        store: dist.Store,
        cpu_group: Any = None,
        workers: list[subprocess.Popen] | None = None,
        secret: bytes | None = None,
        owns_default_group: bool = False,
        collective_backend: str = GLOO,
        device_group: Any = None,
    ) -> None:
        self.rank = rank
        self.degree = degree
        self.store = store
        # The torch.distributed backend the model's collectives run on ("gloo", or "neuron" for neuron
        # tensors), and its group (on gloo, the cpu group itself).
        self.collective_backend = collective_backend
        self.device_group = device_group
        # Spawned groups sign every store message (workers unpickle them): the store's port is open to
        # whoever can reach it. torchrun's store is torchrun's to protect, as for torch.distributed itself.
        self.secret = secret
        # gloo, for cpu tensors: saving's gathers, and the collectives of a model on cpu.
        self.cpu_group = cpu_group
        self.workers = workers or []  # the driver's spawned worker processes (none under torchrun)
        self.dead: str | None = None  # why the group cannot run any more
        # Under torchrun, whether this group initialized torch.distributed's default group (and so must
        # destroy it: a gloo group left to interpreter teardown can abort the process, pytorch #190489).
        self.owns_default_group = owns_default_group

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ collectives
    @property
    def connected(self) -> bool:
        return self.device_group is not None

    def rendezvous(self) -> None:
        """Join the process groups, every rank at once, once every worker is ready (a worker that failed
        before it got there reports its error to the driver instead of leaving it waiting). Nothing to do
        once joined (torchrun's processes join when they start) but binding the model's collectives to
        them."""
        if self.connected:
            self.bind()
            return
        if self.is_driver:
            for rank in range(1, self.degree):
                _wait_ready(self, rank)
            for rank in range(1, self.degree):  # every rank is ready: the connection timeouts start now
                self.post(f"{CONNECT_KEY}/{rank}", None)
        else:
            self.post(f"{READY_KEY}/{self.rank}", None)
            self.take(f"{CONNECT_KEY}/{self.rank}")
        self.connect()

    def connect(self) -> None:
        """Create this rank's process groups (all ranks at the same time: gloo connects each pair)."""
        if self.cpu_group is None:
            prefix = dist.PrefixStore("optimum-qwen36-tp", self.store)
            gloo = dist.ProcessGroupGloo(prefix, self.rank, self.degree, COLLECTIVE_TIMEOUT)
            self.cpu_group = named_process_group(gloo, prefix, self.rank, self.degree)
        if self.device_group is None:
            self.device_group = self.cpu_group if self.collective_backend == GLOO else self._default_group()
        self.bind()

    def _default_group(self) -> Any:
        """torch.distributed's default group on the `collective_backend`, which this group then owns."""
        prefix = dist.PrefixStore(f"optimum-qwen36-tp-{self.collective_backend}", self.store)
        dist.init_process_group(
            self.collective_backend,
            store=prefix,
            rank=self.rank,
            world_size=self.degree,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self.owns_default_group = True
        return dist.group.WORLD

    def bind(self) -> None:
        """Make the model's collectives (called by the group name that compiled graphs hold) run on this
        group. A process may hold the ranks of several models: each call binds its own."""
        bind_group(self.device_group)

    def stand_in(self) -> contextlib.AbstractContextManager[None]:
        """While this rank traces and compiles its graphs, before the ranks connect: see `stand_in_group`."""
        return stand_in_group(self.rank, self.degree)

    @contextlib.contextmanager
    def driver_first(self, step: str) -> Iterator[None]:
        """Rank 0 runs the block first, the other ranks once it has finished (compiling into a compile cache
        the others then read). If rank 0 fails, the launcher stops the waiting workers."""
        if not self.is_driver:
            self.take(f"{step}/{self.rank}")
        yield
        if self.is_driver:
            for rank in range(1, self.degree):
                self.post(f"{step}/{rank}", None)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on each), in rank order."""
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(self.degree)]
        self.cpu_group.allgather([gathered], [tensor]).wait()
        return gathered

    # ------------------------------------------------------------------ store messages
    def post(self, key: str, value: Any) -> None:
        self.post_bytes(key, pickle.dumps(value))

    def take(self, key: str) -> Any:
        """The value posted under `key` (waiting for it), removed from the store."""
        return pickle.loads(self.take_bytes(key))

    def _signature(self, key: str, data: bytes) -> bytes:
        if self.secret is None:
            return b""
        return hmac.new(self.secret, key.encode() + b"\0" + data, hashlib.sha256).digest()

    def post_bytes(self, key: str, data: bytes) -> None:
        """Post `data` under `key` (signed), in parts when it is larger than the store takes in one
        message."""
        data = self._signature(key, data) + data
        if len(data) <= STORE_MESSAGE_BYTES:
            self.store.set(key, b"\0" + data)
            return
        parts = range(0, len(data), STORE_MESSAGE_BYTES)
        for number, start in enumerate(parts):
            self.store.set(f"{key}#{number}", data[start : start + STORE_MESSAGE_BYTES])
        self.store.set(key, b"\1" + str(len(parts)).encode())

    def take_bytes(self, key: str) -> bytes:
        """What `post_bytes` posted under `key`, removed from the store; waits for it, however long (a
        worker waiting for the driver's next call), and raises when the driver, which hosts the store, is
        gone."""
        while True:
            try:
                value = self.store.get(key)
                break
            except dist.DistStoreError as error:
                if "timeout" not in str(error).lower():
                    raise
        self.store.delete_key(key)
        if value[:1] == b"\0":
            data = value[1:]
        else:
            parts = []
            for number in range(int(value[1:])):
                parts.append(self.store.get(f"{key}#{number}"))
                self.store.delete_key(f"{key}#{number}")
            data = b"".join(parts)
        size = len(self._signature(key, b""))
        signature, data = data[:size], data[size:]
        if not hmac.compare_digest(signature, self._signature(key, data)):
            raise TensorParallelWorkerError(f"the store message {key!r} is not signed by this group's driver")
        return data

    def wait_for(self, key: str, timeout: datetime.timedelta, alive: Callable[[], str | None]) -> bool:
        """Wait until `key` is posted (True) or `timeout` passes (False); `alive` says why to stop early."""
        return self.wait_for_any([key], timeout, alive) is not None

    def wait_for_any(
        self, keys: list[str], timeout: datetime.timedelta, alive: Callable[[], str | None]
    ) -> str | None:
        """The first of `keys` found posted (waiting for one), or None once `timeout` passes; `alive` says
        why to stop early."""
        deadline = time.monotonic() + timeout.total_seconds()
        pause = POLL_SECONDS / 64  # an outcome is usually posted within a millisecond
        while True:
            for key in keys:
                if self.store.check([key]):
                    return key
            reason = alive()
            if reason is not None:
                raise TensorParallelWorkerError(reason)
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(2 * pause, POLL_SECONDS)

    # ------------------------------------------------------------------ failures
    def worker_status(self) -> str | None:
        """Why some spawned worker is gone (its rank, pid and exit code), or None while all run."""
        for rank, process in enumerate(self.workers, start=1):
            code = process.poll()
            if code is not None:
                return f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {code}"
        return None

    def explain(self, error: BaseException) -> str:
        """What a failed collective means for this group: a dead worker, or the error itself."""
        time.sleep(0.2)  # a killed worker's exit code shows up just after its sockets close
        status = self.worker_status()
        return status or f"a collective with the tensor-parallel workers failed: {error}"

    def fail(self, reason: str) -> TensorParallelWorkerError:
        """Mark the group dead, stop the workers, and return the error to raise."""
        self.dead = reason
        self.shutdown()
        return TensorParallelWorkerError(
            f"{reason}. The model cannot run any more: create it again (from_pretrained)."
        )

    def leave(self) -> None:
        """A worker's last act once the driver closed the model: release its process group (destroying
        torch.distributed's default group if this group initialized it), then tell the driver, which waits
        for every rank before it releases its own: rank 0's process holds the store, so it goes last, and no
        rank tears down its gloo connections while another still holds them."""
        self._release_groups()
        self.post(f"left/{self.rank}", None)

    def wait_until_left(self) -> None:
        """The driver, closing the model: wait (at most LEAVE_TIMEOUT each) until every worker has left,
        and until the spawned ones have exited."""
        for rank in range(1, self.degree):
            try:
                if not self.wait_for(f"left/{rank}", LEAVE_TIMEOUT, self.worker_status):
                    logger.warning("tensor-parallel rank %d did not leave within %s", rank, LEAVE_TIMEOUT)
            except (TensorParallelWorkerError, dist.DistNetworkError) as gone:  # nothing left to wait for
                logger.info("tensor-parallel rank %d is gone: %s", rank, gone)
        for process in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):  # shutdown() stops what is still running
                process.wait(timeout=LEAVE_TIMEOUT.total_seconds())

    def shutdown(self) -> None:
        """Stop the spawned workers (a torchrun job's workers stop when they read the `close` call), and
        destroy the default process group if this group initialized it."""
        for process in self.workers:
            if process.poll() is None:
                process.terminate()
        for process in self.workers:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._release_groups()

    def _release_groups(self) -> None:
        self.cpu_group = self.device_group = None
        if self.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_default_group = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _store(rank: int, degree: int, port: int) -> dist.TCPStore:
    # The store's own timeout bounds a single get: waits that may be long are polled (`wait_for`).
    return dist.TCPStore(
        HOST, port, degree, is_master=rank == 0, timeout=STARTUP_TIMEOUT, wait_for_workers=False
    )


RankJob = Callable[[TensorParallelGroup], Any]
WorkerLoop = Callable[[Any, TensorParallelGroup], None]


def worker_main(rank: int, degree: int, port: int, threads: int) -> None:
    """A spawned worker: build this rank's model, join the process groups (while building, if the model
    needs them for that), report it built (or the error), serve the driver."""
    torch.set_num_threads(threads)
    secret = bytes.fromhex(os.environ.pop(SECRET_ENV))
    group = TensorParallelGroup(rank, degree, _store(rank, degree, port), secret=secret)
    try:
        job, loop, group.collective_backend = group.take(f"{JOB_KEY}/{rank}")
        model = job(group)
        group.rendezvous()
    except BaseException as error:  # reported to the driver, which raises it
        group.post(f"{STARTUP_KEY}/{rank}", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        return
    group.post(f"{STARTUP_KEY}/{rank}", None)
    try:
        loop(model, group)
        group.leave()
    except dist.DistNetworkError:
        logger.info("tensor-parallel worker rank %d: the driver is gone, exiting", rank)


def launch(
    degree: int,
    job: RankJob,
    loop: WorkerLoop,
    collective_backend: str = GLOO,
    environments: list[dict[str, str]] | None = None,
) -> tuple[TensorParallelGroup, Any]:
    """Rank 0's group and model, with the other ranks' models built and serving it.

    `job(group)` builds one rank's model (calling `group.rendezvous()` where it needs the process groups;
    else they are joined after it); `loop(model, group)` serves the driver's calls on a worker. The model's
    collectives run on a `collective_backend` group ("gloo", or "neuron": torch.distributed's default
    group then). `environments[r]`: environment variables of rank r (rank 0 is this process: set here, and
    undone if the launch fails). Under torchrun a worker's process runs its loop here and then exits (its
    from_pretrained never returns), and the environments are torchrun's to set."""
    if under_torchrun():
        return _join_torchrun(degree, job, loop, collective_backend)
    if collective_backend != GLOO and dist.is_initialized():
        raise RuntimeError(
            f"tp_degree={degree} with {collective_backend!r} collectives creates torch.distributed's default "
            f"process group, and this process already has one (backend {dist.get_backend()!r}). Create the "
            "model in a process without one, or launch every rank with torchrun (the model then uses the "
            f"default group, which must be a {collective_backend!r} group)."
        )
    port = _free_port()
    store = _store(0, degree, port)
    threads = max(1, torch.get_num_threads() // degree)
    if threads != torch.get_num_threads():
        logger.info("tp_degree=%d: each rank (this process included) uses %d threads", degree, threads)
        torch.set_num_threads(threads)
    environments = environments or [{} for _ in range(degree)]
    before = {name: os.environ.get(name) for name in environments[0]}
    os.environ.update(environments[0])
    command = [
        sys.executable,
        "-m",
        "optimum_qwen36.distributed.worker",
        str(degree),
        str(port),
        str(threads),
    ]
    secret = secrets.token_bytes(32)
    workers = [
        # The secret is not on the command line: `ps` shows that.
        subprocess.Popen(
            [*command, str(rank)], env={**os.environ, **environments[rank], SECRET_ENV: secret.hex()}
        )
        for rank in range(1, degree)
    ]
    group = TensorParallelGroup(
        0, degree, store, workers=workers, secret=secret, collective_backend=collective_backend
    )
    try:
        for rank in range(1, degree):
            group.post(f"{JOB_KEY}/{rank}", (job, loop, collective_backend))
        model = job(group)
        group.rendezvous()
        for rank in range(1, degree):
            _wait_startup(group, rank)
    except BaseException as error:
        reason = _launch_failure(group, error)
        group.shutdown()
        _restore_environment(before)
        if reason is not None:
            raise TensorParallelWorkerError(reason) from error
        raise
    return group, model


def _launch_failure(group: TensorParallelGroup, error: BaseException) -> str | None:
    """What to report instead of rank 0's `error` when the launch failed: the errors the workers posted,
    unless every one failed as rank 0 did (bad settings) and rank 0's is not a collective a worker broke;
    else, for a broken collective, which worker died."""
    posted = _posted_startup_errors(group)
    other = any(not message.startswith(f"{type(error).__name__}:") for message in posted.values())
    if posted and (other or broke_a_collective(error)):
        return "; ".join(_build_failure(rank, message) for rank, message in posted.items())
    if broke_a_collective(error):
        return group.explain(error)
    return None


def _restore_environment(before: dict[str, str | None]) -> None:
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _build_failure(rank: int, error: str) -> str:
    return f"tensor-parallel worker rank {rank} failed to build its model: {error}"


def _startup_error(group: TensorParallelGroup, rank: int) -> TensorParallelWorkerError | None:
    """The error worker `rank` posted when it failed to build its model (taken from the store), if any."""
    error = group.take(f"{STARTUP_KEY}/{rank}")
    return None if error is None else TensorParallelWorkerError(_build_failure(rank, error))


def _posted_startup_errors(group: TensorParallelGroup) -> dict[int, str]:
    """The errors the workers posted so far (taken from the store), by rank."""
    errors = {}
    for rank in range(1, group.degree):
        with contextlib.suppress(dist.DistError):  # the store may be gone
            if group.store.check([f"{STARTUP_KEY}/{rank}"]):
                error = group.take(f"{STARTUP_KEY}/{rank}")
                if error is not None:
                    errors[rank] = error
    return errors


def _wait_ready(group: TensorParallelGroup, rank: int) -> None:
    """Wait until worker `rank` is ready to join the process groups; raise its error if it failed first (a
    worker reports its model built only after it joined)."""
    ready, failed = f"{READY_KEY}/{rank}", f"{STARTUP_KEY}/{rank}"
    posted = group.wait_for_any([ready, failed], STARTUP_TIMEOUT, group.worker_status)
    if posted is None:
        raise TensorParallelWorkerError(
            f"tensor-parallel worker rank {rank} was not ready to join the process group within "
            f"{STARTUP_TIMEOUT}."
        )
    if posted == failed:
        raise _startup_error(group, rank) or TensorParallelWorkerError(f"worker rank {rank}: no error posted")
    group.take(ready)


def _wait_startup(group: TensorParallelGroup, rank: int) -> None:
    if not group.wait_for(f"{STARTUP_KEY}/{rank}", STARTUP_TIMEOUT, group.worker_status):
        raise TensorParallelWorkerError(
            f"tensor-parallel worker rank {rank} did not build its model within {STARTUP_TIMEOUT}."
        )
    error = _startup_error(group, rank)
    if error is not None:
        raise error


def _join_torchrun(
    degree: int, job: RankJob, loop: WorkerLoop, collective_backend: str
) -> tuple[TensorParallelGroup, Any]:
    world = int(os.environ["WORLD_SIZE"])
    if world != degree:
        raise ValueError(
            f"tp_degree={degree} but torchrun started {world} processes (WORLD_SIZE): launch it with "
            f"--nproc-per-node / --nnodes giving {degree} processes in all."
        )
    initialize = not dist.is_initialized()  # a group the user initialized is the user's to destroy
    if initialize:
        dist.init_process_group(collective_backend, timeout=COLLECTIVE_TIMEOUT)
    elif collective_backend != GLOO and dist.get_backend() != collective_backend:
        raise RuntimeError(
            f"This model's collectives run on a {collective_backend!r} process group, and "
            f"torch.distributed's default group is a {dist.get_backend()!r} one: initialize it with "
            f"backend={collective_backend!r}, or leave it to from_pretrained."
        )
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    # The gathers of saving move cpu tensors: a gloo group beside a device backend's.
    cpu_group = dist.group.WORLD if collective_backend == GLOO else dist.new_group(backend=GLOO)
    group = TensorParallelGroup(
        rank,
        degree,
        store,
        cpu_group=cpu_group,
        owns_default_group=initialize,
        collective_backend=collective_backend,
        device_group=dist.group.WORLD,
    )
    model = job(group)
    if rank == 0:
        return group, model
    loop(model, group)
    group.leave()
    if dist.is_initialized():  # a group the user initialized: this process ends here all the same
        dist.destroy_process_group()
    raise SystemExit(0)
