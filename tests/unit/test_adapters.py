"""LoRA adapters applied unmerged (contract 6): outputs change, base tensors do not, removal
restores outputs exactly, bad folders are refused with the model untouched."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from miserver.serving.models import adapters as ad
from miserver.serving.models import base_tensors
from miserver.serving.models import checkpoints as ck
from miserver.spec import codes

IDS = torch.tensor([[1, 5, 9, 17, 33, 64, 100, 2]])
NOW = 1_795_000_000.5


def tiny_model(
    dtype: torch.dtype = torch.float32, seed: int = 0, hidden: int = 32
) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()


def make_adapter(
    base: torch.nn.Module,
    folder: Path,
    *,
    seed: int = 5,
    r: int = 4,
    alpha: int = 8,
    targets=("q_proj", "v_proj"),
    **extra,
) -> Path:
    """A LoRA adapter with random (non-zero) B, saved as PEFT does."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(
            r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **extra
        ),
    )
    peft_model.save_pretrained(str(folder))
    return folder


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def greedy(model: torch.nn.Module, n: int = 12) -> list[int]:
    with torch.no_grad():
        out = model.generate(IDS, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, IDS.shape[1] :].tolist()


def base_view(model: torch.nn.Module) -> dict[str, tuple[int, int, bool]]:
    """name -> (object id, data_ptr, requires_grad) of every base parameter."""
    return {
        n: (id(p), p.data_ptr(), p.requires_grad)
        for n, p in ad.base_named_parameters(model).items()
    }


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    return make_adapter(tiny_model(), tmp_path_factory.mktemp("adapter") / "a")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_adapter_changes_outputs_and_removing_it_restores_them_exactly(tmp_path, dtype):
    model = tiny_model(dtype)
    folder = make_adapter(model, tmp_path / "a")
    before_logits, before_tokens = logits(model), greedy(model)
    names_before = list(model.state_dict())
    attrs_before = set(vars(model))
    view_before = base_view(model)
    values_before = {n: t.detach().clone() for n, t in model.state_dict().items()}

    applied = ad.apply_adapter(model, name="my-lora", path=folder, now=NOW)

    assert applied.module is model
    assert isinstance(model, LlamaForCausalLM)
    assert not torch.equal(logits(model), before_logits)
    assert base_view(model) == view_before  # same objects, addresses, requires_grad
    assert all(
        torch.equal(values_before[n], t) for n, t in base_tensors.base_state_dict(model).items()
    )
    assert list(base_tensors.base_state_dict(model)) == names_before
    assert ad.has_adapter(model)

    served = ad.remove_adapter(model, applied)

    assert served is model
    assert torch.equal(logits(model), before_logits)
    assert greedy(model) == before_tokens
    assert list(model.state_dict()) == names_before
    assert base_view(model) == view_before
    assert set(vars(model)) == attrs_before
    assert not ad.has_adapter(model)
    assert not model.training


def test_the_applied_adapter_computes_what_peft_computes(tmp_path, adapter_dir):
    model = tiny_model()
    reference = PeftModel.from_pretrained(copy.deepcopy(model), str(adapter_dir)).eval()
    merged = copy.deepcopy(reference).merge_and_unload()
    ad.apply_adapter(model, name="x", path=adapter_dir, now=NOW)
    assert torch.equal(logits(model), logits(reference))
    assert torch.allclose(logits(model), logits(merged), atol=1e-4)


def test_requires_grad_and_train_mode_are_kept(adapter_dir):
    model = tiny_model()
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    model.train()
    view = base_view(model)
    applied = ad.apply_adapter(model, name="x", path=adapter_dir, now=NOW)
    assert base_view(model) == view and model.training
    ad.remove_adapter(model, applied)
    assert base_view(model) == view and model.training


def test_the_adapter_block(adapter_dir):
    assert ad.adapter_block(None) == {"applied": False}
    applied = ad.apply_adapter(tiny_model(), name="my-lora", path=adapter_dir, now=NOW)
    block = ad.adapter_block(applied)
    assert block == {
        "applied": True,
        "name": "my-lora",
        "path": str(adapter_dir.absolute()),
        "rank": 4,
        "alpha": 8.0,
        "target_modules": ["q_proj", "v_proj"],
        "applied_at": "2026-11-18T11:06:40.500000Z",
    }
    json.dumps(block)  # the block is plain JSON


def test_base_state_dict_without_an_adapter_is_the_state_dict():
    model = tiny_model()
    sd = model.state_dict(keep_vars=True)
    base = base_tensors.base_state_dict(model)
    assert list(base) == list(sd)
    assert all(base[n] is sd[n] for n in sd)


def test_a_save_while_an_adapter_is_applied_saves_the_base_weights(tmp_path, adapter_dir):
    model = tiny_model(torch.bfloat16)
    base_logits = logits(model)
    ad.apply_adapter(model, name="x", path=adapter_dir, now=NOW)
    saved = ck.save_checkpoint(
        model,
        None,
        root=tmp_path / "ck",
        name="with-lora",
        base_row_id=1,
        base_name="tiny",
        parent_sha256=None,
        steps_since_load=0,
        now=NOW,
    )
    assert saved.manifest.names() == set(tiny_model(torch.bfloat16).state_dict())
    target = tiny_model(torch.bfloat16, seed=1)
    handle = ck.open_checkpoint(saved.path)
    assert ck.layout_matches(model, handle)  # the in-place layout looks through the adapter
    ck.load_in_place(target, handle)
    assert torch.equal(logits(target), base_logits)


def test_an_in_place_load_under_an_adapter_writes_the_base_tensors(tmp_path, adapter_dir):
    source = tiny_model(seed=3)
    handle = ck.open_checkpoint(
        ck.save_checkpoint(
            source,
            None,
            root=tmp_path,
            name="s",
            base_row_id=1,
            base_name="tiny",
            parent_sha256=None,
            steps_since_load=0,
            now=NOW,
        ).path
    )
    model = tiny_model(seed=0)
    applied = ad.apply_adapter(model, name="x", path=adapter_dir, now=NOW)
    view = base_view(model)
    ck.load_in_place(model, handle)
    assert base_view(model) == view
    ad.remove_adapter(model, applied)
    assert torch.equal(logits(model), logits(source))


def test_replacing_an_adapter_gives_the_new_adapters_outputs(tmp_path, adapter_dir):
    other = make_adapter(tiny_model(), tmp_path / "b", seed=9, r=2, alpha=4, targets=("o_proj",))
    alone = tiny_model()
    ad.apply_adapter(alone, name="b", path=other, now=NOW)
    model = tiny_model()
    base_logits = logits(model)
    first = ad.apply_adapter(model, name="a", path=adapter_dir, now=NOW)
    second = ad.apply_adapter(model, name="b", path=other, now=NOW, replacing=first)
    assert second.block()["target_modules"] == ["o_proj"]
    assert torch.equal(logits(model), logits(alone))
    ad.remove_adapter(model, second)
    assert torch.equal(logits(model), base_logits)


def test_applying_over_an_adapter_without_replacing_is_a_programming_error(adapter_dir):
    model = tiny_model()
    ad.apply_adapter(model, name="a", path=adapter_dir, now=NOW)
    with pytest.raises(RuntimeError):
        ad.apply_adapter(model, name="b", path=adapter_dir, now=NOW)


def _config_edit(edit):
    def damage(folder: Path) -> None:
        cfg = json.loads((folder / ad.CONFIG_NAME).read_text())
        edit(cfg)
        (folder / ad.CONFIG_NAME).write_text(json.dumps(cfg))

    return damage


def _to_bin(folder: Path) -> None:
    (folder / ad.WEIGHTS_NAME).rename(folder / ad.PICKLE_WEIGHTS_NAME)


def _rename_keys(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / ad.WEIGHTS_NAME))
    save_file(
        {k.replace("self_attn", "attention"): v for k, v in tensors.items()},
        str(folder / ad.WEIGHTS_NAME),
    )


def _other_width(folder: Path) -> None:
    shutil.rmtree(folder)
    make_adapter(tiny_model(hidden=64), folder)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda f: shutil.rmtree(f), "not_found"),
        (lambda f: (f / ad.CONFIG_NAME).unlink(), "no_config"),
        (lambda f: (f / ad.CONFIG_NAME).write_text("{oops"), "no_config"),
        (_config_edit(lambda c: c.update(peft_type="PREFIX_TUNING")), "not_lora"),
        (_config_edit(lambda c: c.update(r=0)), "no_config"),
        (_config_edit(lambda c: c.update(modules_to_save=["lm_head"])), "incompatible"),
        (_to_bin, "unsafe_format"),
        (lambda f: (f / ad.WEIGHTS_NAME).unlink(), "not_found"),
        (lambda f: (f / ad.WEIGHTS_NAME).write_bytes(b"\x01\x02"), "incompatible"),
        (_rename_keys, "incompatible"),
        (_other_width, "incompatible"),
        (_config_edit(lambda c: c.update(target_modules=["no_such_proj"])), "incompatible"),
    ],
)
def test_a_bad_adapter_folder_is_refused_and_the_model_is_unchanged(
    tmp_path, adapter_dir, damage, reason
):
    folder = tmp_path / "bad"
    shutil.copytree(adapter_dir, folder)
    damage(folder)
    model = tiny_model()
    before = logits(model)
    names = list(model.state_dict())

    with pytest.raises(ad.AdapterInvalid) as err:
        ad.apply_adapter(model, name="bad", path=folder, now=NOW)

    assert err.value.reason == reason
    assert err.value.details["path"] == str(folder.absolute())
    api = err.value.as_api_error()
    assert (api.status, api.code, api.reason) == (400, codes.ADAPTER_INVALID, reason)
    assert not ad.has_adapter(model)
    assert list(model.state_dict()) == names
    assert torch.equal(logits(model), before)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_an_adapter_with_non_finite_tensors_is_refused_naming_the_first(tmp_path, adapter_dir, bad):
    """Breaker finding F3: an adapter of NaN (or Inf) was applied, and every /v1 call was
    then a 500 (non-finite logits)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan"
    shutil.copytree(adapter_dir, folder)
    tensors = load_file(str(folder / ad.WEIGHTS_NAME))
    names = sorted(tensors)
    poisoned = [names[2], names[-1]]  # not the first in name order: the first bad one is named
    for name in poisoned:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[1] = bad
    save_file(tensors, str(folder / ad.WEIGHTS_NAME))
    model = tiny_model()
    before = logits(model)

    with pytest.raises(ad.AdapterInvalid) as err:
        ad.apply_adapter(model, name="nan", path=folder, now=NOW)

    assert err.value.reason == "incompatible"
    assert err.value.details["tensor"] == poisoned[0]
    assert repr(poisoned[0]) in err.value.message and "non-finite" in err.value.message
    api = err.value.as_api_error()
    assert (api.status, api.code) == (400, codes.ADAPTER_INVALID)
    assert not ad.has_adapter(model)
    assert torch.equal(logits(model), before)
    with pytest.raises(ad.AdapterInvalid):  # the route's check before the pause refuses it too
        ad.inspect_adapter(model, folder)


def test_a_refused_replacement_leaves_the_current_adapter_applied(tmp_path, adapter_dir):
    model = tiny_model()
    current = ad.apply_adapter(model, name="a", path=adapter_dir, now=NOW)
    with_adapter = logits(model)
    with pytest.raises(ad.AdapterInvalid):
        ad.apply_adapter(model, name="b", path=tmp_path / "missing", now=NOW, replacing=current)
    assert torch.equal(logits(model), with_adapter)
    ad.remove_adapter(model, current)


def test_error_messages_name_the_problem(tmp_path, adapter_dir):
    folder = tmp_path / "p"
    shutil.copytree(adapter_dir, folder)
    _config_edit(lambda c: c.update(peft_type="IA3"))(folder)
    with pytest.raises(ad.AdapterInvalid, match=re.escape("'IA3'")):
        ad.inspect_adapter(tiny_model(), folder)


def test_a_replacement_peft_refuses_puts_the_current_adapter_back(
    tmp_path, adapter_dir, monkeypatch
):
    # inspect_adapter checks what it can before anything changes; PEFT may still refuse while
    # injecting (after the current adapter was removed): the current one goes back.
    folder = tmp_path / "other"
    shutil.copytree(adapter_dir, folder)
    model = tiny_model()
    current = ad.apply_adapter(model, name="a", path=adapter_dir, now=NOW)
    with_adapter = logits(model)
    real = PeftModel.from_pretrained.__func__

    def refuse_other(cls, model, model_id, *args, **kwargs):
        if str(model_id) == str(folder):
            raise ValueError("Target module Dropout() is not supported")
        return real(cls, model, model_id, *args, **kwargs)

    monkeypatch.setattr(PeftModel, "from_pretrained", classmethod(refuse_other))
    with pytest.raises(ad.AdapterInvalid) as err:
        ad.apply_adapter(model, name="b", path=folder, now=NOW, replacing=current)
    assert err.value.reason == "incompatible"
    assert torch.equal(logits(model), with_adapter)
    ad.remove_adapter(model, current)
    assert not ad.has_adapter(model)
    assert torch.equal(logits(model), logits(tiny_model()))


@pytest.mark.parametrize("name", ["", "has space", "../x", "naïve", None])
def test_an_invalid_served_name_is_refused_before_anything_changes(adapter_dir, name):
    model = tiny_model()
    with pytest.raises(ad.InvalidAdapterName) as err:
        ad.apply_adapter(model, name=name, path=adapter_dir, now=NOW)
    assert err.value.as_api_error().status == 400
    assert not ad.has_adapter(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_adapter_lives_on_the_card_and_removal_restores_exactly(adapter_dir):
    model = tiny_model(torch.bfloat16).cuda()
    ids = IDS.cuda()
    with torch.no_grad():
        before = model(ids).logits
    view = base_view(model)
    applied = ad.apply_adapter(model, name="x", path=adapter_dir, now=NOW)
    assert all(p.is_cuda for p in model.parameters())
    assert base_view(model) == view
    ad.remove_adapter(model, applied)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
