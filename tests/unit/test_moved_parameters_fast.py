"""The per-commit address check (``moved_parameters_fast``) lists exactly what the full check
(``moved_parameters``) lists for the recorded parameters, through its one-pass probe, also after
the arena records new addresses (issue 15: it runs at every commit-end)."""

from __future__ import annotations

import torch

from miserver.ipc.arena import make_attachable
from miserver.ipc.export import moved_parameters, moved_parameters_fast


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4).to(torch.bfloat16)
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(4, 4).to(torch.bfloat16) for _ in range(3)
        )
        self.head = torch.nn.Linear(4, 8, bias=False).to(torch.bfloat16)
        self.head.weight = self.emb.weight  # tied: two names, one parameter


def test_nothing_moved_and_in_place_writes_move_nothing():
    m = Net()
    arena = make_attachable(m, cpu_shared=True)
    assert moved_parameters_fast(arena) == [] == moved_parameters(arena, m)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2)
    assert moved_parameters_fast(arena) == []


def test_a_rebound_or_replaced_or_removed_parameter_is_listed_as_the_full_check_lists_it():
    m = Net()
    arena = make_attachable(m, cpu_shared=True)
    assert moved_parameters_fast(arena) == []  # the probe is built and cached here
    m.layers[1].weight.data = m.layers[1].weight.data.clone()  # .data rebound
    assert moved_parameters_fast(arena) == ["layers.1.weight"]
    m.layers[2].bias = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))  # replaced
    assert moved_parameters_fast(arena) == ["layers.1.weight", "layers.2.bias"]
    m.emb.weight.data = m.emb.weight.data.clone()  # the tied parameter: both names
    del m.layers[0]._parameters["bias"]  # gone from its module
    expected = ["emb.weight", "head.weight", "layers.0.bias", "layers.1.weight", "layers.2.bias"]
    assert moved_parameters_fast(arena) == expected
    assert set(expected) <= set(moved_parameters(arena, m))


def test_recorded_addresses_replace_the_probe():
    m = Net()
    arena = make_attachable(m, cpu_shared=True)
    assert moved_parameters_fast(arena) == []
    m.layers[1].weight.data = m.layers[1].weight.data.clone()
    assert moved_parameters_fast(arena) == ["layers.1.weight"]
    arena.record_addresses(m)  # as an export does: the new addresses are the reference now
    assert moved_parameters_fast(arena) == []
    m.layers[0].weight.data = m.layers[0].weight.data.clone()
    assert moved_parameters_fast(arena) == ["layers.0.weight"]
