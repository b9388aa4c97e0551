"""miserver.trainer: refusals, UUID matching, binding, and the release order (weights page
"Rebuilding the tensors in the trainer", "Releasing the handles"). CPU shared memory lets one
process rebuild its own export, which is enough for these; the two-process path is in
tests/e2e/test_cpu_attach_two_process.py and the CUDA path in tests/gpu/."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from miserver import trainer
from miserver.ipc.arena import make_attachable
from miserver.ipc.devices import local_index_for_uuid
from miserver.ipc.export import export_handles

REPO = Path(__file__).resolve().parents[2]


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, dtype=torch.bfloat16)
        self.norm = torch.nn.LayerNorm(4, dtype=torch.bfloat16)
        self.head = torch.nn.Linear(4, 10, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.emb.weight


@pytest.fixture
def served():
    torch.manual_seed(0)
    m = Tied()
    arena = make_attachable(m, cpu_shared=True)
    return m, arena


def body_of(served):
    m, arena = served
    return export_handles(arena, m).to_builtins()


def test_rebuild_gives_views_of_one_storage_with_tied_names_sharing_a_tensor(served):
    m, _ = served
    with trainer.rebuild(body_of(served)) as w:
        assert w.storage_count == 1
        assert w["head.weight"] is w["emb.weight"]
        assert len(w.unique_tensors()) == 3
        for n, p in m.named_parameters(remove_duplicate=False):
            assert torch.equal(w[n], p.detach())
            assert w[n].requires_grad == p.requires_grad
        with torch.no_grad():
            w["norm.weight"].fill_(7)
        assert torch.all(m.norm.weight == 7)


def test_a_producer_mismatch_is_refused_before_anything_is_opened(served):
    body = body_of(served)
    body["producer"] = {**body["producer"], "torch": "1.0.0+cu999"}
    with pytest.raises(trainer.ProducerMismatch) as e:
        trainer.rebuild(body)
    assert "1.0.0+cu999" in str(e.value) and "torch" in e.value.differences
    body["producer"] = {**body_of(served)["producer"], "cuda": "99.9"}
    with pytest.raises(trainer.ProducerMismatch, match="cuda"):
        trainer.rebuild(body)
    # nothing was claimed: a correct body rebuilds at once
    trainer.rebuild(body_of(served)).release()


def test_devices_are_matched_by_uuid_not_index():
    uuids = ["GPU-aaaa", "GPU-bbbb"]
    assert local_index_for_uuid("GPU-bbbb", uuids) == 1
    assert local_index_for_uuid("bbbb", uuids) == 1
    assert local_index_for_uuid("GPU-cccc", uuids) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_a_cuda_entry_without_cuda_is_refused(served):
    body = body_of(served)
    body["storages"] = [
        {
            "kind": "cuda_ipc",
            "device_index": 0,
            "device_uuid": "GPU-x",
            "handle": "AAAA",
            "storage_size_bytes": 512,
            "storage_offset_bytes": 0,
            "ref_counter_handle": "AAAA",
            "ref_counter_offset": 0,
            "event_handle": None,
            "event_sync_required": False,
        }
    ]
    with pytest.raises(trainer.DeviceNotVisible, match="GPU-x"):
        trainer.rebuild(body)


def test_a_second_rebuild_while_the_first_is_held_is_refused(served):
    body = body_of(served)
    with trainer.rebuild(body), pytest.raises(trainer.AlreadyRebuilt):
        trainer.rebuild(body_of(served))
    with trainer.rebuild(body_of(served)) as again:  # after release it is fine
        assert again.storage_count == 1


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b["storages"][0].update(kind="rdma"), "unknown kind"),
        (lambda b: b["parameters"][0].update(dtype="float99"), "unknown dtype"),
        (lambda b: b["parameters"][0].update(storage=3), "storage 3 does not exist"),
        (lambda b: b["parameters"][0].update(storage_offset=10**6), "beyond its storage"),
        (lambda b: b["parameters"][0].update(shape=[2, 2], stride=[1]), "shape and stride"),
        (lambda b: b["storages"][0].update(storage_handle="***"), "not base64"),
        (lambda b: b.pop("storages"), "storages"),
    ],
)
def test_malformed_exports_are_refused_clearly_and_release_their_claims(served, mutate, match):
    body = copy.deepcopy(body_of(served))
    mutate(body)
    with pytest.raises(trainer.InvalidExport, match=match):
        trainer.rebuild(body)
    trainer.rebuild(body_of(served)).release()  # no claim left behind


def test_release_order_views_dropped_then_detach(served):
    m, _ = served
    calls = []
    w = trainer.rebuild(
        body_of(served),
        on_release=lambda: calls.append(
            ("detach", len(w.tensors), [p.numel() for p in bound.parameters()])
        ),
    )
    bound = trainer.bind_into(Tied(), w)
    assert bound.head.weight is bound.emb.weight  # tied stays tied
    opt = torch.optim.SGD(bound.parameters(), lr=1.0)
    for p in bound.parameters():
        p.grad = torch.ones_like(p)
    with torch.no_grad():
        opt.step()  # an optimizer step writes the served tensors in place
    assert torch.equal(m.norm.bias.detach(), bound.norm.bias.detach())
    w.release()
    # detach ran last, after every view (also the bound, optimizer-held parameters) was dropped
    assert calls == [("detach", 0, [0, 0, 0])]
    assert w.released and w.lingering == 0
    w.release()  # idempotent
    assert len(calls) == 1
    with pytest.raises(trainer.Released):
        w["emb.weight"]


def test_release_runs_when_the_block_raises(served):
    calls = []
    w = trainer.rebuild(body_of(served), on_release=lambda: calls.append(1))
    with pytest.raises(ZeroDivisionError), w:
        raise ZeroDivisionError
    assert w.released and calls == [1]


def test_a_view_kept_outside_is_reported_as_lingering(served):
    w = trainer.rebuild(body_of(served))
    kept = w["norm.weight"][:2]
    with pytest.warns(ResourceWarning, match="still referenced"):
        w.release()
    assert w.lingering == 1
    del kept


def test_bind_into_refuses_a_different_model_and_changes_nothing(served):
    class Other(Tied):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(5, dtype=torch.bfloat16)

    with trainer.rebuild(body_of(served)) as w:
        other = Other()
        before = other.norm.weight
        with pytest.raises(trainer.LayoutMismatch, match="norm.weight"):
            trainer.bind_into(other, w)
        assert other.norm.weight is before


def test_build_model_from_config_binds_every_parameter_without_a_copy():
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    served = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    arena = make_attachable(served, cpu_shared=True)
    body = export_handles(arena, served).to_builtins()
    ids = torch.tensor([[3, 1, 4]])
    with trainer.rebuild(body) as w:
        model = trainer.build_model(body, w).eval()
        assert type(model) is transformers.Qwen2ForCausalLM
        assert model.lm_head.weight is model.model.embed_tokens.weight
        ptrs = {st.data_ptr() for st in w._storages}
        assert all(p.untyped_storage().data_ptr() in ptrs for p in model.parameters())
        assert torch.equal(model(ids).logits, served(ids).logits)
    assert all(p.numel() == 0 for p in model.parameters())  # released with the block


def test_build_model_needs_a_config(served):
    body = body_of(served)
    with pytest.raises(trainer.InvalidExport, match="no config"):
        trainer.build_model(body)


@pytest.mark.full  # tens of seconds: left out of make quick
def test_interpreter_exit_releases_what_was_never_released(tmp_path):
    script = textwrap.dedent("""
        import torch
        from miserver import trainer
        from miserver.ipc.arena import make_attachable
        from miserver.ipc.export import export_handles
        m = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
        arena = make_attachable(m, cpu_shared=True)
        body = export_handles(arena, m).to_builtins()
        WEIGHTS = trainer.rebuild(body, on_release=lambda: print("detached", len(WEIGHTS.tensors)))
        print("exiting")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        ),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["exiting", "detached", "0"]
