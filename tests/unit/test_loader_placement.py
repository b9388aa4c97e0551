"""Where the loader puts a model read on the CPU (``miserver.serving.models.loader.place_model``).

An attachable CUDA load is copied from the CPU straight into the arena on the card (one copy
there, never two); every other load moves with ``model.to``. No GPU here: the arena's CUDA
placement is replaced by a recorder (its real path is tested on the card in
tests/gpu/test_cuda_attach.py and tests/gpu/test_model_host_cuda.py); the CPU paths run for real.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from miserver.ipc import arena as ipc_arena
from miserver.ipc.arena import ParameterArena
from miserver.serving.models.loader import place_model
from miserver.spec.settings import Settings, WeightsToken

TOKEN = WeightsToken(label="forge", role="trainer", secret="s" * 24)
CUDA = torch.device("cuda", 0)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("inv_freq", torch.ones(2))


def model(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    return Tied().to(dtype)


class Recorder:
    """Stands in for ``model.to`` and the CUDA arena placement, noting each call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, m: torch.nn.Module) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.model = m
        real_to = m.to

        def to(*args: Any, **kwargs: Any) -> torch.nn.Module:
            self.calls.append(("to", torch.device(args[0]) if args else kwargs.get("device")))
            if args and torch.device(args[0]).type == "cuda":
                return m  # no card here: note the call only
            return real_to(*args, **kwargs)

        monkeypatch.setattr(m, "to", to)
        real_place = ipc_arena.make_attachable

        def fake_place(mod: torch.nn.Module, *, cpu_shared: bool, device: Any = None) -> Any:
            devices = {str(p.device) for p in mod.parameters()}
            self.calls.append(("arena", (device, cpu_shared, frozenset(devices))))
            if device is not None and torch.device(device).type == "cuda":
                return "cuda-arena"
            return real_place(mod, cpu_shared=cpu_shared, device=device)

        monkeypatch.setattr(ipc_arena, "make_attachable", fake_place)


def settings(tmp_path, **kw: Any) -> Settings:
    return Settings(home=str(tmp_path), **kw)


def test_an_attachable_cuda_load_goes_from_the_cpu_straight_into_the_arena(tmp_path, monkeypatch):
    m = model()
    rec = Recorder(monkeypatch, m)
    arena = place_model(m, settings(tmp_path, weights_tokens=(TOKEN,)), CUDA)
    assert arena == "cuda-arena"
    # never model.to(cuda): the arena is the only copy on the card, filled from the CPU
    assert rec.calls == [("arena", (CUDA, False, frozenset({"cpu"})))]


@pytest.mark.parametrize(
    "kw, dtype",
    [
        ({}, torch.bfloat16),  # no trainer token
        ({"weights_tokens": (TOKEN,)}, torch.float32),  # FP32 is never attachable
    ],
    ids=["no-token", "fp32"],
)
def test_a_cuda_load_that_is_not_attachable_moves_with_to(tmp_path, monkeypatch, kw, dtype):
    m = model(dtype)
    rec = Recorder(monkeypatch, m)
    assert place_model(m, settings(tmp_path, **kw), CUDA) is None
    assert rec.calls == [("to", CUDA)]


def test_a_cpu_attach_load_is_placed_in_cpu_shared_memory_as_before(tmp_path, monkeypatch):
    m = model()
    rec = Recorder(monkeypatch, m)
    arena = place_model(
        m, settings(tmp_path, weights_tokens=(TOKEN,), weights_cpu_attach=True), torch.device("cpu")
    )
    assert isinstance(arena, ParameterArena) and arena.cpu_shared
    assert rec.calls == [("to", torch.device("cpu")), ("arena", (None, True, frozenset({"cpu"})))]
    assert m.head.weight is m.embed.weight  # the tie survives the placement
    assert ipc_arena.is_in_arena(arena, m.parameters())
    assert sorted(arena.slots) == ["embed.weight", "head.weight", "norm.bias", "norm.weight"]
    assert arena.slots["head.weight"].tied_to == "embed.weight"


def test_a_cpu_load_without_attach_gets_no_arena(tmp_path, monkeypatch):
    m = model()
    rec = Recorder(monkeypatch, m)
    assert place_model(m, settings(tmp_path, weights_tokens=(TOKEN,)), torch.device("cpu")) is None
    assert rec.calls == [("to", torch.device("cpu"))]


def test_a_placement_failure_is_model_load_failed_naming_the_device(
    tmp_path, tiny_model_dir, monkeypatch
):
    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.loader import load_model
    from miserver.spec import codes
    from miserver.spec.errors import ApiError

    def oom(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 270.00 MiB")

    monkeypatch.setattr(ipc_arena, "make_attachable", oom)
    row = Catalogue(tmp_path).register(
        name="tiny", format="safetensors", dtype="bfloat16", path=tiny_model_dir
    )
    with pytest.raises(ApiError) as info:
        load_model(row, settings(tmp_path, weights_tokens=(TOKEN,), weights_cpu_attach=True))
    assert info.value.code == codes.MODEL_LOAD_FAILED
    assert "onto cpu" in str(info.value) and "OutOfMemoryError" in str(info.value)


def _mapped_files(pointers: list[int]) -> set[str]:
    """The files whose memory mappings hold any of ``pointers`` (Linux ``/proc/self/maps``)."""
    files: set[str] = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(v, 16) for v in fields[0].split("-"))
            mapped = len(fields) >= 6 and fields[5].startswith("/")
            if mapped and any(low <= p < high for p in pointers):
                files.add(fields[5])
    return files


def test_a_cpu_load_owns_its_storages_out_of_the_file_mapping(tmp_path, tiny_model_dir):
    """transformers maps the safetensors file; a CPU load copies every tensor out of the
    mapping (the decode step reads them faster from process memory) and lays q/k/v and
    gate/up out as one tensor each, with the file's values."""
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.loader import load_model

    mapped = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    weights = [str(p.resolve()) for p in Path(tiny_model_dir).glob("*.safetensors")]
    pointers = [p.data_ptr() for p in mapped.parameters()]
    if not set(weights) & _mapped_files(pointers):
        pytest.skip("this transformers reads the file into memory: nothing to copy out")
    row = Catalogue(tmp_path).register(
        name="tiny", format="safetensors", dtype="bfloat16", path=tiny_model_dir
    )
    loaded = load_model(row, settings(tmp_path)).model
    assert not set(weights) & _mapped_files([p.data_ptr() for p in loaded.parameters()])
    saved = {}
    for file in weights:
        saved.update(load_file(file))
    state = loaded.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    attn, mlp = loaded.model.layers[0].self_attn, loaded.model.layers[0].mlp
    storage = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == storage
    assert attn.v_proj.weight.untyped_storage().data_ptr() == storage
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == (
        mlp.gate_proj.weight.untyped_storage().data_ptr()
    )
    assert attn.o_proj.weight.untyped_storage().data_ptr() != storage
