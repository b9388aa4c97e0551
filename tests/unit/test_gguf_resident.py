"""The GGUF backend's pieces that need no model loaded (miserver/serving/models/gguf.py;
contract 4a): the checks before a load, and what a request asks llama.cpp for. The served
behaviour, through llama.cpp for real, is tests/e2e/test_gguf.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from miserver.serving.engine.generation import SamplingParams
from miserver.serving.models import gguf
from miserver.serving.models.default_model import gguf_path
from miserver.spec.errors import ApiError


def _row(path: Path | str) -> SimpleNamespace:
    return SimpleNamespace(id=7, name="q4", path=str(path))


def test_the_embedded_q4_file_passes_the_preflight_and_declares_its_context() -> None:
    gguf.preflight(_row(gguf_path()))
    assert gguf.gguf_context_length(str(gguf_path())) == 8192  # SmolLM2-135M's


@pytest.mark.parametrize("cut", [0, 100, 300_000])
def test_a_damaged_file_is_model_load_failed_400(tmp_path: Path, cut: int) -> None:
    damaged = tmp_path / "cut.gguf"
    damaged.write_bytes(Path(gguf_path()).read_bytes()[:cut])
    with pytest.raises(ApiError) as err:
        gguf.preflight(_row(damaged))
    assert (err.value.code.name, err.value.status) == ("MODEL_LOAD_FAILED", 400)
    assert "not a readable GGUF file" in err.value.message


def test_a_missing_file_and_a_missing_binding_are_told_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ApiError) as err:
        gguf.check_loadable(_row(tmp_path / "gone.gguf"))
    assert err.value.code.name == "MODEL_LOAD_FAILED" and "not there" in err.value.message
    monkeypatch.setattr(gguf, "binding_available", lambda: False)
    with pytest.raises(ApiError) as err:
        gguf.check_loadable(_row(gguf_path()))
    assert (err.value.code.name, err.value.reason) == ("BACKEND_UNAVAILABLE", "gguf")
    assert "pip install xllamacpp" in err.value.message


@pytest.mark.parametrize(
    "seed, sent", [(None, None), (7, 7), (2**32 + 5, 5), (-1, 2**32 - 2), (2**32 - 1, 2**32 - 2)]
)
def test_a_request_turns_llama_cpps_other_samplers_off_and_keeps_seeds_32_bit(
    seed: int | None, sent: int | None
) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=seed, logprobs=0)
    body = gguf.GGUFGeneration(None, None, [1, 2], params)._request()  # type: ignore[arg-type]
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 5 and body["stream"] is True
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.7, 0.9, 0, 0.0)
    assert body.get("seed") == sent
    assert body["n_probs"] == 1  # logprobs 0 still needs the chosen token's logprob
    assert "stop" not in body  # miserver matches stop sequences itself


async def test_a_request_refuses_prompt_logprobs_and_seeds_each_choice() -> None:
    from miserver.serving.engine.sampling import choice_seed

    with pytest.raises(ValueError, match="prompt logprobs"):
        gguf.choices(None, None, [1], SamplingParams(max_tokens=1, logprobs=1, echo=True))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        gguf.choices(None, None, [1], SamplingParams(max_tokens=1), n=0)  # type: ignore[arg-type]
    gens = gguf.choices(None, None, [1, 2], SamplingParams(max_tokens=1, seed=3), n=3)  # type: ignore[arg-type]
    assert [g.params.seed for g in gens] == [choice_seed(3, i) for i in range(3)]
    assert not any(g.timing.started for g in gens)  # bound, not started: submit starts them


def test_a_response_format_is_sent_as_llama_cpps_json_schema_with_compact_whitespace() -> None:
    from miserver.serving.engine.constraints import JSON_OPTIONS

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = gguf.json_schema_grammar(schema, "json_schema 'a'")
    params = SamplingParams(max_tokens=5, constraint=grammar)
    body = gguf.GGUFGeneration(None, None, [1], params)._request()  # type: ignore[arg-type]
    assert body["json_schema"] == {**schema, "x-guidance": JSON_OPTIONS}
    assert "grammar" not in body
    free = gguf.GGUFGeneration(None, None, [1], SamplingParams(max_tokens=5))._request()  # type: ignore[arg-type]
    assert "json_schema" not in free
    other = SamplingParams(max_tokens=5, constraint=object())  # miserver's own grammar
    with pytest.raises(ValueError, match="cannot enforce"):
        gguf.GGUFGeneration(None, None, [1], other)._request()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "schema, words",
    [({"type": "string", "format": "bogus"}, "bogus"), ({"type": "string", "pattern": "(["}, "[")],
)
def test_a_schema_llama_cpp_would_drop_is_a_400_instead(schema: dict, words: str) -> None:
    from miserver.serving.models.gguf import json_schema_grammar
    from miserver.serving.structured.response_format import compile_llama_cpp, parse_response_format

    fmt = parse_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert fmt is not None
    with pytest.raises(ApiError) as err:
        compile_llama_cpp(fmt, "response_format", json_schema_grammar)
    assert (err.value.status, err.value.param) == (400, "response_format")
    assert words in err.value.message
    ok = parse_response_format({"type": "json_object"})
    assert ok is not None
    assert compile_llama_cpp(ok, "response_format", json_schema_grammar).schema == {
        "type": "object"
    }
