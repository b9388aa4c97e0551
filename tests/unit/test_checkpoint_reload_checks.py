"""What a weights load checks inside the pause before it marks the set writing (contract 5:
400 CHECKPOINT_CORRUPT before anything is written; finding N3 of the second adversarial trial
of 2026-11-30): a full reload needs config.json and a tokenizer as well as verified tensors, and
the folder must still hold the manifest the request was checked against.
"""

from __future__ import annotations

import pytest

from miserver.serving.models import checkpoints as ck
from tests.unit.test_checkpoints import save, tiny_model, tiny_tokenizer


@pytest.fixture
def saved(tmp_path):
    return save(tiny_model(), tmp_path / "ckpts", "ck", tokenizer=tiny_tokenizer())


def test_a_complete_checkpoint_passes(saved):
    ck.verify_for_reload(ck.reopen(ck.open_checkpoint(saved.path)))


@pytest.mark.parametrize(
    ("remove", "file"),
    [
        (("config.json",), "config.json"),
        (("tokenizer_config.json",), "tokenizer_config.json"),
        (("tokenizer.json",), "tokenizer.json"),
    ],
)
def test_a_listed_file_that_is_gone_is_corrupt(saved, remove, file):
    handle = ck.open_checkpoint(saved.path)
    for name in remove:
        (saved.path / name).unlink()
    with pytest.raises(ck.CheckpointCorrupt) as info:
        ck.verify_for_reload(handle)
    assert info.value.file == file


def test_a_checkpoint_saved_without_a_tokenizer_cannot_be_reloaded(tmp_path):
    bare = save(tiny_model(), tmp_path / "ckpts", "bare")
    handle = ck.open_checkpoint(bare.path)
    ck.verify(handle)  # its tensors are fine: an in-place load needs nothing else
    with pytest.raises(ck.CheckpointCorrupt, match="tokenizer") as info:
        ck.verify_for_reload(handle)
    assert info.value.file == "tokenizer_config.json"


def test_read_for_load_writes_nothing_and_write_in_place_reads_no_file(saved, tmp_path):
    target = tiny_model(seed=1)
    before = {n: t.detach().clone() for n, t in target.state_dict().items()}
    handle = ck.open_checkpoint(saved.path)
    tensors = ck.read_for_load(target, handle)
    assert all(before[n].equal(t) for n, t in target.state_dict().items())
    saved.path.rename(tmp_path / "gone")  # the folder disappears between the two phases
    ck.write_in_place(target, handle, tensors)
    source = tiny_model()
    assert all(t.equal(source.state_dict()[n]) for n, t in target.state_dict().items())
