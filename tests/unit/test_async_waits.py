"""The asynchronous workers' two local waits — the staleness gate and the wait for this
server's own step to be applied — end as soon as this process's server thread is known to have
failed, instead of after `Config.collective_timeout_s` (a dead server thread left its peers
waiting for acknowledgements and its own worker in the gate until the timeout)."""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed import HashStore

from parallax.engine.asynchronous.async_server import ServerState, ServerThread
from parallax.engine.asynchronous.async_training import StalenessGate
from parallax.errors import AsyncServerError


class _ThreadDied(Exception):
    pass


def _failing_after(calls: int) -> tuple[list[int], object]:
    seen = [0]

    def check() -> None:
        seen[0] += 1
        if seen[0] >= calls:
            raise _ThreadDied("server thread failed")
    return seen, check


def _gate(timeout_s: float, check: object = None) -> StalenessGate:
    """Rank 0 of two; rank 1's clock is set through the same store (each gate in a process
    has a prefix of its own)."""
    return StalenessGate(0, 2, 0, timeout_s=timeout_s, store=HashStore(),
                         check=check)  # type: ignore[arg-type]


def test_gate_waits_while_the_slowest_is_behind_and_passes_once_it_finishes() -> None:
    gate = _gate(0.3)
    gate.start(0)
    gate.store.set("clock1", "0")
    gate.wait(1)  # step 1 needs step 0: both have it
    gate.finished()
    began = time.monotonic()
    with pytest.raises(AsyncServerError, match=r"rank 1 finished 0"):
        gate.wait(2)
    assert time.monotonic() - began >= 0.3
    gate.store.add("clock1", 1)
    gate.wait(2)
    assert gate.lags == [0, 0]


def test_gate_raises_the_server_threads_failure_at_once() -> None:
    seen, check = _failing_after(3)
    gate = _gate(60, check)
    gate.start(1)
    gate.store.set("clock1", "0")
    began = time.monotonic()
    with pytest.raises(_ThreadDied):
        gate.wait(2)  # rank 1 has not finished step 1: it would wait 60 s
    assert time.monotonic() - began < 5
    assert seen[0] == 3


def test_wait_applied_raises_the_server_threads_failure_at_once() -> None:
    state = ServerState([], world_size=2, aggregate=True, rank=0, timeout_s=60)
    seen, check = _failing_after(2)
    began = time.monotonic()
    with pytest.raises(_ThreadDied):
        state.wait_applied(1, check=check)  # type: ignore[arg-type]
    assert 0.5 < time.monotonic() - began < 5  # polled every half second
    assert seen[0] == 2


def test_wait_applied_still_times_out_and_names_who_did_not_push() -> None:
    state = ServerState([], world_size=3, aggregate=True, rank=0, timeout_s=0.3)
    state._round = [0]
    with pytest.raises(AsyncServerError, match=r"rank\(s\) \[1, 2\] did not push it"):
        state.wait_applied(1, check=lambda: None)


class _Work:
    """A gloo send: complete only once its receiver took it (``channel.taken``)."""

    def __init__(self, channel: _ScriptedChannel):
        self.channel = channel

    def is_completed(self) -> bool:
        return self.channel.taken

    def wait(self, timeout: object = None) -> bool:
        assert self.channel.taken, "the server waited on a reply its receiver has not taken"
        return True


class _Received:
    def __init__(self, fill: object):
        self.fill = fill

    def wait(self, timeout: object = None) -> bool:
        self.fill()  # type: ignore[operator]
        return True


class _ScriptedChannel:
    """A server's channel fed a script of requests; its workers take replies only after the
    script's ``take_after``-th request (they wait for another server first)."""

    def __init__(self, script: list[list[int]], take_after: int):
        self.script = list(script)
        self.served = 0
        self.take_after = take_after
        self.taken = False
        self.rank = 0
        self.timeout = None
        self.replies: list[tuple[int, torch.Tensor]] = []
        self.group = self

    def empty_header(self) -> torch.Tensor:
        return torch.zeros(4, dtype=torch.long)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> _Received:
        def fill() -> None:
            tensors[0].copy_(torch.tensor(self.script[self.served]))
            self.served += 1
            self.taken = self.taken or self.served > self.take_after
        return _Received(fill)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> torch.Tensor:
        return tensor.fill_(0)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> _Work:
        self.replies.append((dst, tensor))
        return _Work(self)


class _State:
    def pull(self, counts: list[int], ids: torch.Tensor) -> list[torch.Tensor]:
        return [torch.full((int(counts[0]), 2), 7.0)]


def test_the_server_thread_serves_on_while_its_replies_wait_for_their_receivers() -> None:
    # rank 1's pull is answered first, but rank 1 takes the rows only after rank 3's pull is
    # served (it waits for another server first): a server that waited on its reply to rank 1
    # would never serve rank 3, whose server (in the real cycle) rank 1 waits for
    pull, stop = 1, 4
    script = [[pull, 1, 0, 2], [pull, 3, 0, 1], [stop, 1, 0, 0], [stop, 2, 0, 0],
              [stop, 3, 0, 0]]
    channel = _ScriptedChannel(script, take_after=2)
    thread = ServerThread(channel, _State(), world_size=4)  # type: ignore[arg-type]
    thread._run()
    assert thread.error is None, thread.error
    assert [dst for dst, _ in channel.replies] == [1, 3]
    assert [tuple(rows.shape) for _, rows in channel.replies] == [(2, 2), (1, 2)]
    assert thread.in_flight == []  # reaped once taken
