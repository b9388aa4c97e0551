"""The one-GPU parts of the process-group transport's NCCL path (contract section 10): the
arena receive is posted on the group's own CUDA stream, its completion is a query of the event
recorded there after the broadcasts (never a host-blocking synchronize), a receive that does
not complete by its deadline fails, and the real ``ProcessGroupNCCL`` built by
:func:`build_group` receives into a CUDA arena in place. The two-GPU run (trainer on one card,
a replica on the other) is the next issue's. Skipped without CUDA; the gloo path runs on the CPU
in tests/unit/test_process_group.py.
"""

from __future__ import annotations

import socket

import pytest
import torch

from miserver.ipc.process_group import ArenaGroup, GroupSpec, build_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEV = torch.device("cuda", 0)
SPIN = 200_000_000  # torch.cuda._sleep cycles: well over 50 ms on any card


def _arena(n: int, fill: int) -> torch.UntypedStorage:
    return torch.full((n,), fill, dtype=torch.uint8, device=DEV).untyped_storage()


def _bytes(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=DEV).set_(st, 0, (st.nbytes(),), (1,))


class _Work:
    def wait(self, *a):  # NCCL's wait: the current stream waits; the host does not
        return True

    def is_completed(self):  # pragma: no cover - the CUDA path queries its event instead
        return True


class _StreamGroup:
    """A stand-in for ProcessGroupNCCL on one card: a broadcast is a (slow) copy enqueued on the
    current stream, which it records, like NCCL enqueues on a stream ordered after it."""

    def __init__(self, source: torch.Tensor, spin: int) -> None:
        self.source, self.spin, self.streams = source, spin, []

    def broadcast(self, tensors, opts):
        stream = torch.cuda.current_stream(DEV)
        self.streams.append(stream)
        torch.cuda._sleep(self.spin)
        (t,) = tensors
        t.copy_(self.source[: t.numel()])
        return _Work()

    def abort(self):
        pass


def _group(storages, fake, op_timeout_s=30.0):
    spec = GroupSpec("127.0.0.1", 9, 2, 1)
    return ArenaGroup(
        spec,
        storages,
        connect_timeout_s=5,
        op_timeout_s=op_timeout_s,
        builder=lambda *a, **k: (fake, None),
    ).start()


def test_the_receive_is_posted_on_the_groups_stream_and_completes_by_its_event():
    arena = _arena(1 << 20, 1)
    source = torch.full((1 << 20,), 9, dtype=torch.uint8, device=DEV)
    fake = _StreamGroup(source, SPIN)
    group = _group([arena], fake)
    assert group.wait_ready(10) and group.stream is not None
    assert group.stream != torch.cuda.current_stream(DEV)
    receive = group.arm()
    assert [s == group.stream for s in fake.streams] == [True]
    # the copy sits behind the spin on the group's stream: still in flight, and the default
    # stream (serving) was not made to wait for it
    assert receive.poll() is None
    assert torch.cuda.current_stream(DEV).query()
    assert receive.wait(30)
    assert receive.poll() is True
    torch.cuda.synchronize()
    assert torch.equal(_bytes(arena), source)
    group.destroy()


def test_a_receive_still_running_at_its_deadline_fails():
    arena = _arena(4096, 1)
    source = torch.full((4096,), 9, dtype=torch.uint8, device=DEV)
    group = _group([arena], _StreamGroup(source, SPIN * 50), op_timeout_s=0.05)
    assert group.wait_ready(10)
    receive = group.arm()
    assert receive.wait(5) is False
    assert "watchdog" in receive.error
    torch.cuda.synchronize()  # let the spin end before the next test
    group.destroy()


def test_ranges_post_one_broadcast_each_on_the_stream_in_order():
    arena = _arena(1000, 5)
    source = torch.full((1000,), 7, dtype=torch.uint8, device=DEV)
    fake = _StreamGroup(source, 0)
    group = _group([arena], fake)
    assert group.wait_ready(10)
    receive = group.arm([[900, 100], [10, 20]])
    assert receive.wait(30)
    assert len(fake.streams) == 2 and all(s == group.stream for s in fake.streams)
    expected = torch.full((1000,), 5, dtype=torch.uint8, device=DEV)
    expected[900:] = 7
    expected[10:30] = 7
    assert torch.equal(_bytes(arena), expected)
    group.destroy()


def test_a_real_nccl_group_of_one_receives_into_a_cuda_arena_and_aborts():
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nccl, store = build_group("127.0.0.1", port, 0, 1, DEV, timeout_s=30, is_master=True)
    assert type(nccl).__name__ == "ProcessGroupNCCL"
    arena = _arena(1 << 16, 3)
    ptr = arena.data_ptr()
    group = _group([arena], nccl)
    group.spec = GroupSpec("127.0.0.1", port, 1, 0)  # a group of one: this rank is the root
    assert group.wait_ready(10) and group.backend == "nccl"
    receive = group.arm()
    assert receive.wait(30), receive.error
    assert arena.data_ptr() == ptr and torch.equal(
        _bytes(arena), torch.full((1 << 16,), 3, dtype=torch.uint8, device=DEV)
    )
    group.destroy()
    assert group.state == "destroyed" and "destroyed" in group.arm().error
    del store
