"""``X-miLLM-Model`` (weights page, "Which weights answered"): an RFC 8941 string item."""

from __future__ import annotations

from dataclasses import dataclass

import http_sfv
import pytest

from miserver.http.model_header import model_header, parse_model_header


@dataclass
class W:
    served_name: str
    origin: str
    commits: int | None


@pytest.mark.parametrize(
    "w, expected",
    [
        (W("my-model", "model", 1), '"my-model";origin=model;commits=1'),
        (W("my-model", "model", 0), '"my-model";origin=model;commits=0'),
        (W("my-model", "model", None), '"my-model";origin=model'),
        (
            W("ck-step3-ab12cd34", "checkpoint", 7),
            '"ck-step3-ab12cd34";origin=checkpoint;commits=7',
        ),
        (W("lora/v2", "adapter", None), '"lora/v2";origin=adapter'),
        (W('we"ird\\name', "model", 2), '"we\\"ird\\\\name";origin=model;commits=2'),
    ],
)
def test_value_and_round_trip(w: W, expected: str) -> None:
    value = model_header(w)
    assert value == expected
    assert parse_model_header(value) == (w.served_name, w.origin, w.commits)
    # An independent parse with http-sfv sees a string item (not a token) with the params.
    item = http_sfv.Item()
    item.parse(value.encode())
    assert item.value == w.served_name and not isinstance(item.value, http_sfv.Token)
    assert ("commits" in item.params) == (w.commits is not None)


@pytest.mark.parametrize(
    "w",
    [
        W("m", "lora", 1),
        W("m", "model", -1),
        W("m", "model", True),
        W("naïve", "model", 1),
        W("line\nbreak", "model", None),
    ],
)
def test_invalid_values_are_refused(w: W) -> None:
    with pytest.raises(ValueError):
        model_header(w)


@pytest.mark.parametrize(
    "value",
    [
        "my-model;origin=model",
        '"m";origin="model"',
        '"m"',
        '"m";origin=other',
        '"m";origin=model;commits=1.5',
        "(1 2)",
    ],
)
def test_parse_refuses_malformed_values(value: str) -> None:
    with pytest.raises(ValueError):
        parse_model_header(value)
