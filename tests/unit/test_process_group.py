"""The process-group transport's two halves over gloo on loopback (contract section 10):
the server's :class:`ArenaGroup` (join, receive into the arena in place, completion, destroy)
and the trainer's :class:`TrainerGroup` / :class:`FlatWeights` (rendezvous as rank 0, layout,
one broadcast). Every rank runs in this process on its own thread unless a test needs a rank
to die (then a subprocess)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from miserver.ipc.process_group import (
    ArenaGroup,
    GroupSpec,
    GroupSpecError,
    RangeError,
    resolve_ranges,
)
from miserver.trainer.process_group import FlatWeights, LayoutError, TrainerGroup

WAIT_S = 20.0  # a generous bound for things that take milliseconds


def _arena(nbytes: int, fill: int = 0) -> torch.UntypedStorage:
    return torch.full((nbytes,), fill, dtype=torch.uint8).untyped_storage()


def _bytes(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))


def _export(sizes: list[int]) -> dict:
    """An attach response of kind process_group: one uint8 'parameter' per storage."""
    return {
        "storages": [
            {"kind": "process_group", "storage_size_bytes": n, "device_index": None} for n in sizes
        ],
        "parameters": [
            {
                "name": f"p{i}",
                "storage": i,
                "dtype": "uint8",
                "shape": [n],
                "stride": [1],
                "storage_offset": 0,
                "requires_grad": False,
            }
            for i, n in enumerate(sizes)
        ],
    }


def _servers(trainer: TrainerGroup, arenas: list[list[torch.UntypedStorage]], **kw):
    groups = []
    for rank, storages in enumerate(arenas, start=1):
        spec = GroupSpec.parse(trainer.init_method, trainer.world_size, rank)
        groups.append(
            ArenaGroup(
                spec,
                storages,
                connect_timeout_s=kw.get("connect_timeout_s", WAIT_S),
                op_timeout_s=kw.get("op_timeout_s", WAIT_S),
            ).start()
        )
    return groups


# --- the attach body ------------------------------------------------------------------------
def test_group_spec_parses_the_contract_body():
    spec = GroupSpec.parse("tcp://10.0.0.5:29500", 3, 2)
    assert (spec.host, spec.port, spec.world_size, spec.rank) == ("10.0.0.5", 29500, 3, 2)
    assert spec.init_method == "tcp://10.0.0.5:29500"
    assert GroupSpec.parse("tcp://[::1]:7000", 2, 1).init_method == "tcp://[::1]:7000"


@pytest.mark.parametrize(
    ("init", "world", "rank", "says"),
    [
        ("env://", 2, 1, "tcp://HOST:PORT"),
        ("tcp://host", 2, 1, "port"),
        ("tcp://host:0", 2, 1, "port"),
        ("tcp://host:99999", 2, 1, "port"),
        ("tcp://host:80/path", 2, 1, "nothing may follow"),
        (None, 2, 1, "tcp://HOST:PORT"),
        ("tcp://h:1", 1, 1, "at least 2"),
        ("tcp://h:1", "2", 1, "world_size must be an integer"),
        ("tcp://h:1", 2, True, "rank must be an integer"),
        ("tcp://h:1", 2, 0, "rank 0 is the trainer"),
        ("tcp://h:1", 2, 2, "1..1"),
    ],
)
def test_group_spec_refuses_what_cannot_work(init, world, rank, says):
    with pytest.raises(GroupSpecError, match=says.replace(".", r"\.")):
        GroupSpec.parse(init, world, rank)


def test_ranges_resolve_over_the_storages_in_order():
    assert resolve_ranges([100, 50], None) == [(0, 0, 100), (1, 0, 50)]
    assert resolve_ranges([100, 50], [[10, 5], [100, 50], [0, 1]]) == [
        (0, 10, 5),
        (1, 0, 50),
        (0, 0, 1),
    ]
    for bad, says in [
        ([[0, 0]], "length >= 1"),
        ([[-1, 2]], "offset must be >= 0"),
        ([[140, 20]], "ends past the arena"),
        ([[90, 20]], "crosses from storage 0"),
        ([[1]], "two integers"),
        ([[1.0, 2]], "two integers"),
    ]:
        with pytest.raises(RangeError, match=says):
            resolve_ranges([100, 50], bad)


# --- the trainer's layout -------------------------------------------------------------------
def test_layout_places_every_parameter_at_its_offset_and_keeps_ties():
    body = {
        "storages": [{"kind": "process_group", "storage_size_bytes": 1024}],
        "parameters": [
            {"name": "a", "storage": 0, "dtype": "bfloat16", "shape": [4, 8], "stride": [8, 1],
             "storage_offset": 0, "requires_grad": True},
            {"name": "b", "storage": 0, "dtype": "bfloat16", "shape": [8, 4], "stride": [1, 8],
             "storage_offset": 128, "requires_grad": True},
            {"name": "c", "storage": 0, "dtype": "bfloat16", "shape": [8, 4], "stride": [1, 8],
             "storage_offset": 128, "requires_grad": True, "tied_to": "b"},
        ],
    }  # fmt: skip
    w = FlatWeights.from_export(body)
    assert len(w.buffers) == 1 and w.buffers[0].numel() == 1024
    assert w["b"] is w["c"] and len(w.unique_tensors()) == 2
    assert w["b"].stride() == (1, 8) and w["b"].storage_offset() == 128
    src = {"a": torch.randn(4, 8), "b": torch.randn(8, 4), "c": torch.randn(8, 4)}
    src["c"] = src["b"]
    w.fill_from(src)
    # the bytes of the flat buffer are the parameters' bytes at their offsets
    raw = w.buffers[0][256 : 256 + 64].view(torch.bfloat16)
    assert torch.equal(raw, src["b"].to(torch.bfloat16).t().contiguous().flatten())
    assert torch.equal(w.buffers[0][:64].view(torch.bfloat16), src["a"].bfloat16().flatten())


def test_layout_refuses_another_transport_and_a_view_past_its_storage():
    body = _export([64])
    body["storages"][0]["kind"] = "cuda_ipc"
    with pytest.raises(LayoutError, match="not 'process_group'"):
        FlatWeights.from_export(body)
    body = _export([64])
    body["parameters"][0]["shape"] = [65]
    with pytest.raises(LayoutError, match="ends past its storage"):
        FlatWeights.from_export(body)
    w = FlatWeights.from_export(_export([8]))
    with pytest.raises(LayoutError, match="not in the state dict"):
        w.fill_from({})
    with pytest.raises(LayoutError, match="shapes differ"):
        w.fill_from({"p0": torch.zeros(9, dtype=torch.uint8)})


# --- one broadcast into the arena -----------------------------------------------------------
def test_a_whole_arena_commit_lands_in_place_on_every_replica():
    with TrainerGroup(3, timeout_s=WAIT_S) as trainer:
        arenas = [[_arena(4096, 1), _arena(512, 1)], [_arena(4096, 2), _arena(512, 2)]]
        pointers = [[st.data_ptr() for st in a] for a in arenas]
        servers = _servers(trainer, arenas)
        weights = trainer.layout(_export([4096, 512]))
        trainer.connect()
        assert all(s.wait_ready(WAIT_S) for s in servers)
        for step in range(3):
            receives = [s.arm() for s in servers]
            assert all(r.pending for r in receives)  # nothing has been sent yet
            weights.buffers[0].copy_(torch.randint(0, 256, (4096,), dtype=torch.uint8))
            weights.buffers[1].fill_(step + 7)
            assert trainer.send(weights) == 4096 + 512
            assert all(r.wait(WAIT_S) for r in receives), [r.error for r in receives]
            for arena in arenas:
                assert torch.equal(_bytes(arena[0]), weights.buffers[0])
                assert torch.equal(_bytes(arena[1]), weights.buffers[1])
        # in place: the arena's storages are the same allocations as before
        assert [[st.data_ptr() for st in a] for a in arenas] == pointers
        assert servers[0].describe() == {
            "transport": "process_group",
            "backend": "gloo",
            "init_method": trainer.init_method,
            "world_size": 3,
            "rank": 1,
            "group_state": "ready",
            "error": None,
        }
        for s in servers:
            s.destroy()


def test_a_ranged_commit_writes_those_bytes_only():
    with TrainerGroup(2, timeout_s=WAIT_S) as trainer:
        arena = _arena(1000, 5)
        (server,) = _servers(trainer, [[arena]])
        weights = trainer.layout(_export([1000]))
        trainer.connect()
        ranges = [[900, 100], [10, 20]]  # in the order given, not sorted
        receive = server.arm(ranges)
        weights.buffers[0].fill_(9)
        assert trainer.send(weights, ranges) == 120
        assert receive.wait(WAIT_S), receive.error
        got = _bytes(arena)
        expected = torch.full((1000,), 5, dtype=torch.uint8)
        expected[10:30] = 9
        expected[900:] = 9
        assert torch.equal(got, expected)
        with pytest.raises(RangeError):
            server.arm([[999, 2]])
        server.destroy()


def test_a_receive_armed_before_the_group_formed_is_posted_once_it_has():
    with TrainerGroup(2, timeout_s=WAIT_S) as trainer:
        arena = _arena(256)
        (server,) = _servers(trainer, [[arena]])
        receive = server.arm()  # the trainer has not joined yet: queued
        assert server.state == "connecting" and receive.pending
        weights = trainer.layout(_export([256]))
        weights.buffers[0].fill_(3)
        sender = threading.Thread(target=lambda: (trainer.connect(), trainer.send(weights)))
        sender.start()
        assert receive.wait(WAIT_S), receive.error
        sender.join(WAIT_S)
        assert torch.equal(_bytes(arena), weights.buffers[0])
        server.destroy()


def test_a_receive_the_trainer_never_sends_fails_at_the_op_timeout_and_never_lands_later():
    with TrainerGroup(2, timeout_s=WAIT_S) as trainer:
        arena = _arena(256, 1)
        (server,) = _servers(trainer, [[arena]], op_timeout_s=0.5)
        weights = trainer.layout(_export([256]))
        trainer.connect()
        assert server.wait_ready(WAIT_S)
        t0 = time.monotonic()
        receive = server.arm()
        assert not receive.wait(WAIT_S)
        assert time.monotonic() - t0 < WAIT_S / 2
        assert "Timed out" in receive.error
        assert server.settled()
        # a trainer that sends after the timeout finds the pair closed; nothing is written
        weights.buffers[0].fill_(8)
        with pytest.raises(RuntimeError):
            trainer.send(weights)
        time.sleep(0.2)
        assert torch.equal(_bytes(arena), torch.ones(256, dtype=torch.uint8))
        server.destroy()


_DYING_TRAINER = textwrap.dedent(
    """
    import os, sys, time
    from miserver.trainer.process_group import TrainerGroup
    t = TrainerGroup(2, port=int(sys.argv[1]), timeout_s=120)
    print("listening", flush=True)
    t.connect()
    print("joined", flush=True)
    time.sleep(0.5)
    os._exit(1)  # dies without sending
    """
)


def test_a_trainer_that_dies_mid_commit_fails_the_receive_at_once(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", _DYING_TRAINER, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        arena = _arena(128, 4)
        spec = GroupSpec.parse(f"tcp://127.0.0.1:{port}", 2, 1)
        assert proc.stdout.readline().strip() == "listening"  # the store is up (however slow)
        server = ArenaGroup(spec, [arena], connect_timeout_s=120, op_timeout_s=60).start()
        assert server.wait_ready(120), server.error
        assert proc.stdout.readline().strip() == "joined"
        receive = server.arm()
        t0 = time.monotonic()
        assert not receive.wait(WAIT_S)
        # far sooner than the op timeout (60 s): the closed connection fails it
        assert time.monotonic() - t0 < 10
        assert "closed" in receive.error.lower() or "reset" in receive.error.lower()
        assert torch.equal(_bytes(arena), torch.full((128,), 4, dtype=torch.uint8))
        server.destroy()
    finally:
        proc.kill()
        proc.wait(10)


def test_a_join_nobody_answers_fails_with_what_to_check_and_fails_its_receives():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there
    spec = GroupSpec.parse(f"tcp://127.0.0.1:{port}", 2, 1)
    server = ArenaGroup(spec, [_arena(64)], connect_timeout_s=1.0, op_timeout_s=1.0)
    early = server.arm()
    server.start()
    assert not server.wait_ready(WAIT_S)
    assert server.state == "failed"
    assert f"tcp://127.0.0.1:{port}" in server.error and "rank 1 of 2" in server.error
    assert not early.wait(1) and "not joined" in early.error
    late = server.arm()
    assert not late.ok and "failed" in late.error


def test_destroy_fails_a_queued_receive_and_every_later_one():
    spec = GroupSpec.parse("tcp://127.0.0.1:9", 2, 1)
    gate = threading.Event()

    def never(*a, **k):
        gate.wait(WAIT_S)
        raise RuntimeError("joined nothing")

    server = ArenaGroup(
        spec, [_arena(64)], connect_timeout_s=1, op_timeout_s=1, builder=never
    ).start()
    queued = server.arm()
    server.destroy()
    assert not queued.ok and "destroyed" in queued.error
    assert server.state == "destroyed"
    gate.set()
    assert server.wait_ready(WAIT_S) is False and server.state == "destroyed"
    assert "destroyed" in server.arm().error
    server.destroy()  # idempotent


def test_an_arena_on_two_devices_is_refused():
    spec = GroupSpec.parse("tcp://127.0.0.1:9", 2, 1)
    meta = torch.empty(8, dtype=torch.uint8, device="meta").untyped_storage()
    with pytest.raises(GroupSpecError, match="one device"):
        ArenaGroup(spec, [_arena(8), meta], connect_timeout_s=1, op_timeout_s=1)


# --- interop: a rank 0 written with plain torch.distributed ----------------------------------
@pytest.mark.parametrize("wait_for_workers", [True, False], ids=["torch_defaults", "no_wait"])
def test_a_plain_torch_rank_0_forms_the_group_whether_or_not_its_store_waits(wait_for_workers):
    """Contract section 10: the server's store client counts as a worker, so a rank 0 whose
    ``TCPStore`` keeps torch's default ``wait_for_workers=True`` (its constructor blocks until
    ``world_size`` workers joined) forms the group, as one that does not wait does."""
    import datetime
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    arenas = [[_arena(300, 1)], [_arena(300, 2)]]
    servers = [
        ArenaGroup(
            GroupSpec.parse(f"tcp://127.0.0.1:{port}", 3, rank),
            storages,
            connect_timeout_s=WAIT_S,
            op_timeout_s=WAIT_S,
        ).start()
        for rank, storages in enumerate(arenas, start=1)
    ]
    try:
        receives = [s.arm() for s in servers]  # queued until the group forms
        timeout = datetime.timedelta(seconds=5)  # a store that waits in vain fails in 5 s
        kwargs = {} if wait_for_workers else {"wait_for_workers": False}
        store = dist.TCPStore("127.0.0.1", port, 3, True, timeout, **kwargs)
        group = dist.ProcessGroupGloo(dist.PrefixStore("miserver", store), 0, 3, timeout)
        payload = torch.arange(300, dtype=torch.int64).remainder(256).to(torch.uint8)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        group.broadcast([payload], opts).wait()
        assert all(s.wait_ready(WAIT_S) for s in servers), [s.error for s in servers]
        assert all(r.wait(WAIT_S) for r in receives), [r.error for r in receives]
        for (arena,) in arenas:
            assert torch.equal(_bytes(arena), payload)
    finally:
        for s in servers:
            s.destroy()
