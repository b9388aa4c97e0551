"""The parameter arena and the handle export, on the CPU (contract section 8). The CUDA path has
its own tests in tests/gpu/."""

from __future__ import annotations

import base64
import json
import os

import msgspec
import pytest
import torch

from miserver.ipc.arena import SIZE_GRANULE, NotArenaCompatible, make_attachable
from miserver.ipc.export import (
    ExportBody,
    ParametersMoved,
    cuda_memory,
    export_handles,
    exports_since_start,
    moved_parameters,
)


class Tied(torch.nn.Module):
    def __init__(self, dtype=torch.bfloat16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, dtype=dtype)
        self.norm = torch.nn.LayerNorm(4, dtype=dtype)
        self.head = torch.nn.Linear(4, 10, bias=False, dtype=dtype)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(4))


def test_one_shared_storage_values_and_parameter_objects_kept():
    torch.manual_seed(0)
    m = Tied()
    params = dict(m.named_parameters(remove_duplicate=False))
    before = {n: p.detach().clone() for n, p in params.items()}
    scale_ptr = m.scale.data_ptr()
    arena = make_attachable(m, cpu_shared=True)
    assert len(arena.storages) == 1
    assert arena.storages[0].is_shared()
    assert arena.nbytes[0] % SIZE_GRANULE == 0
    for n, p in m.named_parameters(remove_duplicate=False):
        assert p is params[n]  # the same Parameter objects: ties and references stay valid
        assert torch.equal(p.detach(), before[n])
        assert p.untyped_storage().data_ptr() == arena.storages[0].data_ptr()
    assert m.head.weight is m.emb.weight
    assert m.scale.data_ptr() == scale_ptr  # buffers are excluded
    assert arena.slots["head.weight"].tied_to == "emb.weight"
    assert arena.slots["head.weight"].storage_offset == arena.slots["emb.weight"].storage_offset
    # nothing but parameters (and zero padding) in the storage
    used = sum(p.numel() * p.element_size() for p in m.parameters())
    assert used <= arena.total_bytes < used + len(list(m.parameters())) * 256 + SIZE_GRANULE


def test_arena_views_alias_the_parameters():
    m = Tied()
    arena = make_attachable(m, cpu_shared=True)
    views = arena.views()
    with torch.no_grad():
        views["norm.bias"].fill_(3.0)
    assert torch.all(m.norm.bias == 3.0)


def test_cpu_placement_needs_cpu_shared_and_meta_is_refused():
    with pytest.raises(NotArenaCompatible, match="WEIGHTS_CPU_ATTACH"):
        make_attachable(Tied(), cpu_shared=False)
    with torch.device("meta"):
        meta = Tied()
    with pytest.raises(NotArenaCompatible, match="meta"):
        make_attachable(meta, cpu_shared=True)


def test_export_body_fields_and_counter():
    m = Tied()
    arena = make_attachable(m, cpu_shared=True)
    n0 = exports_since_start()
    body = export_handles(arena, m)
    assert exports_since_start() == n0 + 1
    data = body.to_builtins()
    (st,) = data["storages"]
    assert st["kind"] == "cpu_shared_memory"
    assert st["device_index"] is None and st["device_uuid"] is None
    assert st["storage_size_bytes"] == arena.nbytes[0]
    # byte fields are base64 of what the file-system strategy emits; the handle is this
    # attach's own name of the server's file (miserver.ipc.shm: one hard link per attach)
    manager, _torch_name, size = arena.storages[0]._share_filename_cpu_()
    assert base64.b64decode(st["manager_handle"]) == manager and size == arena.nbytes[0]
    handle = base64.b64decode(st["storage_handle"]).decode()
    (arena_name,) = arena.shm_names
    assert handle.startswith(arena_name + "-e")
    assert os.stat("/dev/shm" + handle).st_ino == os.stat("/dev/shm" + arena_name).st_ino
    names = [p["name"] for p in data["parameters"]]
    assert names == [n for n, _ in m.named_parameters(remove_duplicate=False)]
    head = next(p for p in data["parameters"] if p["name"] == "head.weight")
    assert head["tied_to"] == "emb.weight" and head["dtype"] == "bfloat16"
    assert head["shape"] == [10, 4] and head["stride"] == [4, 1]
    assert data["producer"]["torch"] == str(torch.__version__)
    assert data["producer"]["cuda"] == torch.version.cuda
    assert data["release"]["pinned_bytes"] == arena.total_bytes
    assert "ipc_collect" in data["release"]["contract"]
    assert data["config"] is None  # a plain module has no config
    # the tagged union survives JSON both ways
    again = msgspec.json.decode(msgspec.json.encode(body), type=ExportBody)
    assert again == body


def test_config_is_stated_in_full():
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    arena = make_attachable(m, cpu_shared=True)
    config = export_handles(arena, m).config
    full = m.config.to_dict()
    assert set(full) <= set(config)  # every attribute stated, defaults too
    assert config["rms_norm_eps"] == cfg.rms_norm_eps and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    json.dumps(config)


def test_moved_parameters_are_detected_and_block_export():
    m = Tied()
    arena = make_attachable(m, cpu_shared=True)
    assert moved_parameters(arena, m) == []
    with torch.no_grad():
        m.norm.weight.mul_(2)  # an in-place write does not move
    assert moved_parameters(arena, m) == []
    m.emb.weight.data = m.emb.weight.data.clone()  # re-allocated: tied name moves with it
    assert moved_parameters(arena, m) == ["emb.weight", "head.weight"]
    n0 = exports_since_start()
    with pytest.raises(ParametersMoved) as e:
        export_handles(arena, m)
    assert e.value.names == ["emb.weight", "head.weight"]
    assert exports_since_start() == n0  # a refused export counts nothing


def test_a_new_or_removed_parameter_counts_as_moved():
    m = Tied()
    arena = make_attachable(m, cpu_shared=True)
    m.extra = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    assert moved_parameters(arena, m) == ["extra"]
    del m.extra
    del m.norm.bias
    m.norm.register_parameter("bias", None)
    assert moved_parameters(arena, m) == ["norm.bias"]


def test_cuda_memory_is_null_without_cuda():
    if torch.cuda.is_available():
        rows = cuda_memory()
        assert rows and set(rows[0]) == {"device_index", "allocated_mb", "reserved_mb"}
    else:
        assert cuda_memory() is None
