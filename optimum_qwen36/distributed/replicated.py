"""A replicated control plane: every rank runs the same calls on its own copy of the model's objects.

The driver (rank 0) posts each call that runs the model (`generate()`, the engine's `add_request` / `step` /
`abort`, ...) to the workers before running it itself; each worker runs the same call on its own objects
(its model shard, caches, prefix cache, engine). The code is deterministic and every rank sees the same
logits (the all-reduces give each rank the same bits), so the ranks make the same decisions (the schedule,
prefix-cache hits and evictions, sampled tokens) and reach the same collectives in the same order; the
driver fills in what would differ (a request's random seed, the global RNG state). SGLang's TP schedulers
work this way: rank 0 receives the requests and broadcasts them.

After each call every worker posts its outcome (and a digest of its result); the driver checks them, so a
worker that failed or diverged ends the model with a clear error instead of a hang or wrong tokens. Objects
created inside a call (caches, engines) are registered under the same id on every rank, so later calls can
name them: a pickled argument that is a registered object travels as its id.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import io
import itertools
import pickle
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .group import COLLECTIVE_TIMEOUT, TensorParallelGroup, TensorParallelWorkerError, broke_a_collective
from .lockstep import Lockstep, RanksDiverged

# How long the ranks of a call that raised wait for each other's outcome: a bad input raises on every rank
# at once; if some rank raised alone, the others are stuck in a collective and the group is broken.
FAILURE_GRACE = datetime.timedelta(seconds=10)
CLOSE = "close"
Digest = Callable[[Any], str]


@dataclasses.dataclass
class Call:
    target: int
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng_state: torch.Tensor
    released: list[int]
    digest: Digest | None
    register: bool


def tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


class Replicas:
    """Objects every rank holds its own copy of, under the same id (id 0: the model)."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self._next_id = itertools.count()
        self.lockstep = Lockstep(group)  # the model's backend checks each step with it

    def register(self, obj: Any) -> int:
        raise NotImplementedError


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, ids: dict[int, int]) -> None:
        super().__init__(file)
        self.ids = ids

    def persistent_id(self, obj: Any) -> tuple[str, int] | None:
        replica = self.ids.get(id(obj))
        return None if replica is None else ("replica", replica)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, objects: dict[int, Any]) -> None:
        super().__init__(file)
        self.objects = objects

    def persistent_load(self, pid: tuple[str, int]) -> Any:
        return self.objects[pid[1]]


class Driver(Replicas):
    """Rank 0: runs each call here and on every worker, and checks they agree."""

    def __init__(self, group: TensorParallelGroup) -> None:
        super().__init__(group)
        self._ids: dict[int, int] = {}  # id(obj) -> replica id, while obj lives
        self._released: list[int] = []
        self._calls = itertools.count()
        # One call at a time (a server calls the engine from its loop thread, a user from theirs).
        self.lock = threading.RLock()

    def register(self, obj: Any) -> int:
        replica = next(self._next_id)
        key = id(obj)
        self._ids[key] = replica

        def released(_: Any) -> None:
            self._ids.pop(key, None)
            self._released.append(replica)

        weakref.finalize(obj, released, None)
        return replica

    def call(
        self,
        target: Any,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        local_kwargs: dict[str, Any] | None = None,
        digest: Digest | None = None,
        register: bool = False,
    ) -> Any:
        """`target.method(*args, **kwargs, **local_kwargs)` here, and on every worker its own `target` with
        the same arguments (`local_kwargs` stay here: a streamer, say)."""
        kwargs = kwargs or {}
        with self.lock:
            if self.group.dead is not None:
                raise TensorParallelWorkerError(
                    f"{self.group.dead}. The model cannot run any more: create it again (from_pretrained)."
                )
            released = []
            while self._released:  # finalizers may append meanwhile (garbage collection)
                released.append(self._released.pop())
            message = Call(
                self._ids[id(target)], method, args, kwargs, torch.get_rng_state(), released, digest, register
            )
            try:
                payload = self._pickled(message)
            except ValueError:
                self._released.extend(released)  # nothing was sent: the workers still hold those objects
                raise
            # From here the workers run the call: any failure that leaves the ranks apart ends the group.
            number = next(self._calls)
            self.group.bind()
            try:
                for rank in range(1, self.group.degree):
                    self.group.post_bytes(f"call/{number}/{rank}", payload)
                self.lockstep.begin(number)
                result = run_here(target, method, args, {**kwargs, **(local_kwargs or {})})
                self.lockstep.end()
            except TensorParallelWorkerError:
                raise
            except RanksDiverged as error:
                raise self._fail(str(error)) from None
            except BaseException as error:
                self.lockstep.abandon()
                self._after_failure(number, error)
                raise
            try:
                self._check_outcomes(number, None if digest is None else digest(result))
            except TensorParallelWorkerError:
                raise
            except BaseException as error:  # interrupted while the workers finish: they are ahead now
                raise self._fail(f"interrupted while the workers finished call {number}") from error
            if register:
                self.register(result)
            return result

    def _pickled(self, message: Call) -> bytes:
        buffer = io.BytesIO()
        try:
            _Pickler(buffer, self._ids).dump(message)
        except Exception as error:
            raise ValueError(
                f"With tp_degree={self.group.degree}, the arguments of {message.method}() are sent to every "
                f"worker process, and these could not be: {error}. Pass picklable values (token ids, "
                "GenerationConfig, logits processors defined in an importable module)."
            ) from error
        return buffer.getvalue()

    def _fail(self, reason: str) -> TensorParallelWorkerError:
        """End the group; torchrun's workers (not processes of ours) are told to stop at their next call."""
        self.lockstep.abandon()  # a worker may wait for rank 0's next step
        error = self.group.fail(reason)
        number = next(self._calls)
        for rank in range(1, self.group.degree):
            try:
                self.group.post(f"call/{number}/{rank}", CLOSE)
            except dist.DistNetworkError:
                break  # the store is gone with the processes
        return error

    def _worker_errors(self, number: int) -> str:
        """The errors the workers posted for call `number`, if any (why a worker went away)."""
        errors = []
        for rank in range(1, self.group.degree):
            key = f"done/{number}/{rank}"
            try:
                if self.group.store.check([key]):
                    ok, value = self.group.take(key)
                    if not ok:
                        errors.append(f"rank {rank}: {value}")
            except dist.DistNetworkError:
                break
        return "; ".join(errors)

    def _outcomes(self, number: int, timeout: datetime.timedelta) -> dict[int, tuple[bool, str | None]]:
        outcomes = {}
        for rank in range(1, self.group.degree):
            key = f"done/{number}/{rank}"
            if self.group.wait_for(key, timeout, self.group.worker_status):
                outcomes[rank] = self.group.take(key)
        return outcomes

    def _check_outcomes(self, number: int, digest: str | None) -> None:
        try:
            outcomes = self._outcomes(number, COLLECTIVE_TIMEOUT)
        except TensorParallelWorkerError as error:
            raise self._fail(str(error)) from None
        for rank in range(1, self.group.degree):
            if rank not in outcomes:
                raise self._fail(f"tensor-parallel worker rank {rank} did not finish call {number}")
            ok, value = outcomes[rank]
            if not ok:
                raise self._fail(f"tensor-parallel worker rank {rank} failed where rank 0 did not: {value}")
            if value != digest:
                raise self._fail(
                    f"tensor-parallel worker rank {rank} computed a different result than rank 0 (the ranks "
                    "diverged)"
                )

    def _after_failure(self, number: int, error: BaseException) -> None:
        """The call raised here: fine if it raised on every rank (bad input), else the group is broken."""
        if broke_a_collective(error):
            reason = self.group.explain(error)
            posted = self._worker_errors(number)
            raise self._fail(f"{reason} ({posted})" if posted else reason) from error
        try:
            outcomes = self._outcomes(number, FAILURE_GRACE)
        except TensorParallelWorkerError as dead:
            raise self._fail(str(dead)) from error
        same = len(outcomes) == self.group.degree - 1 and all(
            not ok and str(value).startswith(type(error).__name__) for ok, value in outcomes.values()
        )
        for rank in range(1, self.group.degree):
            self.group.post(f"verdict/{number}/{rank}", same)
        if not same:
            raise self._fail(f"rank 0 failed alone ({type(error).__name__}: {error})") from error

    def close(self) -> None:
        """Tell the workers to stop, wait until each has released its groups, then release this rank's."""
        with self.lock:
            if self.group.dead is None:
                number = next(self._calls)
                try:
                    for rank in range(1, self.group.degree):
                        self.group.post(f"call/{number}/{rank}", CLOSE)
                    self.group.wait_until_left()
                except dist.DistNetworkError:
                    pass  # a worker already gone; shutdown() below stops the others
                self.group.dead = "the model was closed"
            self.group.shutdown()


class Worker(Replicas):
    """Ranks 1..: run the driver's calls on this rank's objects until it closes."""

    def __init__(self, group: TensorParallelGroup) -> None:
        super().__init__(group)
        self.objects: dict[int, Any] = {}

    def register(self, obj: Any) -> int:
        replica = next(self._next_id)
        self.objects[replica] = obj
        return replica

    def serve(self) -> None:
        rank = self.group.rank
        for number in itertools.count():
            raw = self.group.take_bytes(f"call/{number}/{rank}")
            if raw == pickle.dumps(CLOSE):
                return
            try:
                self.lockstep.begin(number)
                call: Call = _Unpickler(io.BytesIO(raw), self.objects).load()
                for replica in call.released:
                    self.objects.pop(replica, None)
                torch.set_rng_state(call.rng_state)
                self.group.bind()
                result = run_here(self.objects[call.target], call.method, call.args, call.kwargs)
                self.lockstep.end()
            except BaseException as error:
                self.group.post(f"done/{number}/{rank}", (False, f"{type(error).__name__}: {error}"))
                verdict = f"verdict/{number}/{rank}"
                if not self.group.wait_for(verdict, FAILURE_GRACE, lambda: None) or not self.group.take(
                    verdict
                ):
                    raise  # rank 0 did not fail the same way: the group is broken, and this worker ends
                self.lockstep.forget_abandoned()
                continue
            self.group.post(
                f"done/{number}/{rank}", (True, None if call.digest is None else call.digest(result))
            )
            if call.register:
                self.register(result)
            del result  # a gathered state dict, say: not kept until the next call


def on_every_rank(
    *, digest: Digest | None = None, local: tuple[str, ...] = (), register: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A method of a replicated object (one with a `tensor_parallel` attribute: its `Replicas`, or None)
    that runs on every rank: called on the driver, it is posted to the workers and run on each rank's own
    object (`Driver.call`, with `digest`, the keyword arguments named in `local` kept on the driver, and
    the result registered when `register`); anywhere else it runs as written."""

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
            replicas = self.tensor_parallel
            if not isinstance(replicas, Driver):
                return method(self, *args, **kwargs)
            kept = {name: kwargs.pop(name) for name in local if name in kwargs}
            return replicas.call(
                self, method.__name__, args, kwargs, local_kwargs=kept, digest=digest, register=register
            )

        return dispatch

    return decorate


def run_here(target: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`target.method(*args, **kwargs)` on this rank alone: an `on_every_rank` method runs its own body."""
    function = getattr(type(target), method, None)
    body = getattr(function, "__wrapped__", None)
    if body is not None:
        return body(target, *args, **kwargs)
    return getattr(target, method)(*args, **kwargs)


def serve_driver(model: Any, group: TensorParallelGroup) -> None:
    """A worker's loop: the model was registered (id 0) when it was built; serve until the driver closes."""
    model.tensor_parallel.serve()
