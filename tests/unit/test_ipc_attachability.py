"""The NOT_ATTACHABLE reasons, in the weights page table's order ("Which models can be attached")."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from miserver.ipc.attachability import REASONS, not_attachable_reason, should_make_attachable
from miserver.spec import codes

CLEAN = dict(
    fmt="safetensors",
    quantization="none",
    param_dtypes=["bfloat16"],
    devices=["cuda:0"],
    arena=object(),
    continuous_batching=False,
    max_concurrent=1,
    model_transition=False,
    weights_writing=False,
    cpu_attach=False,
)

# each reason and the smallest change of CLEAN that causes it
CAUSES = {
    "gguf": {"fmt": "gguf"},
    "quantized": {"quantization": "bitsandbytes-4bit"},
    "dtype": {"param_dtypes": ["bfloat16", torch.float32]},
    "not_on_gpu": {"devices": ["cuda:0", "cpu"]},
    "allocator": {"arena": None},
    "continuous_batching_running": {"continuous_batching": True},
    "concurrency": {"max_concurrent": 2},
    "model_transition": {"model_transition": True},
    "weights_writing": {"weights_writing": True},
}


def test_the_table_order_is_the_weights_page_order():
    assert REASONS == (
        "gguf",
        "quantized",
        "dtype",
        "not_on_gpu",
        "allocator",
        "continuous_batching_running",
        "concurrency",
        "model_transition",
        "weights_writing",
    )
    assert codes.NOT_ATTACHABLE.reasons == REASONS
    assert list(CAUSES) == list(REASONS)


def test_a_clean_attachable_model_has_no_reason():
    assert not_attachable_reason(**CLEAN) is None
    assert (
        not_attachable_reason(
            **{
                **CLEAN,
                "param_dtypes": [torch.float16, "bfloat16"],
                "devices": [torch.device("cuda", 1)],
            }
        )
        is None
    )


@pytest.mark.parametrize("reason", REASONS)
def test_each_condition_alone_gives_its_reason(reason):
    assert not_attachable_reason(**{**CLEAN, **CAUSES[reason]}) == reason


@given(st.sets(st.sampled_from(REASONS)))
def test_the_first_applicable_reason_in_table_order_wins(present):
    kwargs = dict(CLEAN)
    for r in present:
        kwargs.update(CAUSES[r])
    expected = next((r for r in REASONS if r in present), None)
    assert not_attachable_reason(**kwargs) == expected


def test_cpu_attach_accepts_cpu_parameters_only():
    cpu = {**CLEAN, "devices": ["cpu"]}
    assert not_attachable_reason(**cpu) == "not_on_gpu"
    assert not_attachable_reason(**{**cpu, "cpu_attach": True}) is None
    assert not_attachable_reason(**{**cpu, "cpu_attach": True, "devices": ["meta"]}) == "not_on_gpu"


def test_quantization_none_spellings_are_unquantized():
    for q in (None, "", "none"):
        assert not_attachable_reason(**{**CLEAN, "quantization": q}) is None
    for q in ("gptq", "awq", "bitsandbytes-8bit"):
        assert not_attachable_reason(**{**CLEAN, "quantization": q}) == "quantized"


def test_which_loads_are_made_attachable():
    base = dict(
        fmt="safetensors",
        quantization="none",
        param_dtypes=["bfloat16"],
        devices=["cuda:0"],
        has_trainer_token=True,
        cpu_attach=False,
    )
    assert should_make_attachable(**base)
    assert should_make_attachable(**{**base, "param_dtypes": ["float16"]})
    assert not should_make_attachable(**{**base, "has_trainer_token": False})
    assert not should_make_attachable(**{**base, "param_dtypes": ["float32"]})  # FP32 never
    assert not should_make_attachable(**{**base, "quantization": "gptq"})
    assert not should_make_attachable(**{**base, "fmt": "gguf"})
    assert not should_make_attachable(**{**base, "devices": ["cpu"]})
    assert should_make_attachable(**{**base, "devices": ["cpu"], "cpu_attach": True})
