"""Lockstep: before each model step, the ranks of a tensor-parallel model show each other the step they are
about to run, and again at the end of each call.

The ranks run the same deterministic code, so they reach the same steps with the same inputs. If they do
not (a scheduling decision that depended on something only rank 0 had, say), their collectives no longer
pair up: gloo then waits for its 10-minute timeout, or aborts the process when two collectives of different
sizes meet. Comparing each step's inputs first turns that into a clear error, on every rank, before any
collective of the step runs. The exchange goes through the store (one round trip a step) and
not through a collective, so a rank that waits can also see that the others finished the call, failed, or
died, instead of waiting for them.

Rank 0 exchanges with each worker (a star: if every worker agrees with rank 0 they all agree). A rank that
raises in the middle of a call posts `FAILED` where the others wait for its next step.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

import torch

from .group import TensorParallelGroup, TensorParallelWorkerError

# What a rank posts instead of a step when its call ended, normally or by an exception.
END = "the end of the call"
FAILED = "a failure of the call"
# A rank waiting for another's step: the longest gap between two steps (the ranks leave each step's last
# collective together and run the same host code until the next one).
STEP_TIMEOUT = datetime.timedelta(minutes=10)
# Integer inputs up to this size are compared by content (token ids, positions, slots, block tables);
# others (caches, hidden states) by shape and dtype.
COMPARED_NUMEL = 1 << 20


class RanksDiverged(RuntimeError):
    """The ranks of a tensor-parallel model were about to run different steps: the model cannot go on."""


def describe_step(method: str, args: tuple[Any, ...]) -> tuple[str, str]:
    """What a backend call is about to do (for the error message) and a digest of its inputs (to compare)."""
    digest = hashlib.sha256(method.encode())
    shapes = []
    for arg in args:
        if not isinstance(arg, torch.Tensor):
            digest.update(repr(arg).encode())
            continue
        digest.update(f"{tuple(arg.shape)} {arg.dtype}".encode())
        if not arg.is_floating_point() and arg.numel() <= COMPARED_NUMEL:
            digest.update(arg.detach().contiguous().cpu().numpy().tobytes())
            shapes.append(tuple(arg.shape))
    described = ", ".join("x".join(map(str, shape)) or "scalar" for shape in shapes)
    return f"{method} (integer inputs of shapes {described})", digest.hexdigest()


class Lockstep:
    """One rank's side of the exchange, for the driver's call numbered `begin(call)`."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self._call: int | None = None
        self._index = 0

    def begin(self, call: int) -> None:
        self._call, self._index = call, 0

    def check(self, description: str, digest: str) -> None:
        """Post this rank's next step and compare it with the other ranks' (rank 0's, on a worker)."""
        if self._call is None:
            return  # outside a driver's call: building the model, which is not replicated call by call
        index = self._index
        self._index += 1
        mine = (description, digest)
        if self.group.is_driver:
            for rank in range(1, self.group.degree):
                self.group.post(self._key(index, 0, rank), mine)
            for rank in range(1, self.group.degree):
                self._compare(mine, self._driver_take(index, rank, description), rank)
        else:
            self.group.post(self._key(index, self.group.rank, 0), mine)
            self._compare(mine, self.group.take(self._key(index, 0, self.group.rank)), 0)

    def end(self) -> None:
        """This rank's call returned: the others must have ended it too, not be about to run a step."""
        self.check(END, END)
        self._call = None

    def abandon(self) -> None:
        """This rank's call raised: wake the ranks waiting for its next step (the driver's side; a worker's
        failure is its posted outcome, which the driver watches for)."""
        if self._call is not None and self.group.is_driver:
            for rank in range(1, self.group.degree):
                self.group.post(self._key(self._index, 0, rank), (FAILED, FAILED))
        self._call = None

    def forget_abandoned(self) -> None:
        """A worker whose call raised as rank 0's did (both at the same step): drop the `FAILED` rank 0
        posted for its next step."""
        if self._call is not None:
            self.group.store.delete_key(self._key(self._index, 0, self.group.rank))
        self._call = None

    def _key(self, index: int, sender: int, receiver: int) -> str:
        return f"lockstep/{self._call}/{index}/{sender}->{receiver}"

    def _driver_take(self, index: int, rank: int, description: str) -> tuple[str, str]:
        """Rank `rank`'s step, or an error if it finished or failed the call, or died, instead."""
        key, done = self._key(index, rank, 0), f"done/{self._call}/{rank}"

        def gone() -> str | None:
            status = self.group.worker_status()
            if status is not None:
                return status
            # A worker posts its step before its outcome: with both there, the step is the answer.
            if not self.group.store.check([done]) or self.group.store.check([key]):
                return None
            ok, value = self.group.take(done)
            what = "finished the call" if ok else f"failed ({value})"
            return f"tensor-parallel worker rank {rank} {what} while rank 0 was at {description}"

        try:
            posted = self.group.wait_for(key, STEP_TIMEOUT, gone)
        except TensorParallelWorkerError as error:
            raise RanksDiverged(str(error)) from None
        if not posted:
            raise RanksDiverged(
                f"tensor-parallel worker rank {rank} did not reach rank 0's next step ({description}) within "
                f"{STEP_TIMEOUT}"
            )
        return self.group.take(key)

    def _compare(self, mine: tuple[str, str], theirs: tuple[str, str], rank: int) -> None:
        if theirs[1] == mine[1]:
            return
        if theirs[0] == mine[0]:
            what = f"both at {mine[0]}, with different inputs"
        else:
            what = f"rank {self.group.rank} at {mine[0]}, rank {rank} at {theirs[0]}"
        raise RanksDiverged(f"the tensor-parallel ranks diverged ({what})")


class LockstepBackend:
    """A rank's backend whose steps are checked with the other ranks' first (`Lockstep.check`)."""

    STEPS = frozenset(
        ("prefill_chunk", "decode_step", "prefill_chunk_hidden", "position_logits", "verify_step", "mtp_step")
    )

    def __init__(self, backend: Any, lockstep: Lockstep) -> None:
        self.backend = backend
        self.lockstep = lockstep

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.backend, name)
        if name not in self.STEPS:
            return attribute

        def step(*args: Any, **kwargs: Any) -> Any:
            self.lockstep.check(*describe_step(name, (*args, *kwargs.items())))
            return attribute(*args, **kwargs)

        return step
