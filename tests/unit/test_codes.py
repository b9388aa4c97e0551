"""spec/codes.py: every code of the weights page and the contract, with status and reasons."""

from __future__ import annotations

import re

from miserver.fsm.table import TABLE
from miserver.spec import codes

# Every code and reason the weights page names, with the status it gives (the page's words).
WEIGHTS_PAGE = {
    "WEIGHTS_UNAUTHORIZED": (401, ()),
    "WEIGHTS_FORBIDDEN": (403, ()),
    "NOT_ATTACHED": (409, ()),
    "NOT_ATTACHMENT_HOLDER": (403, ()),
    "ALREADY_ATTACHED": (409, ()),
    "MODEL_NOT_LOADED": (400, ()),
    "MODEL_BUSY": (409, ("drain_timeout",)),
    "QUEUE_FULL": (503, ()),
    "WEIGHTS_NOT_CLEAN": (409, ()),
    "ALREADY_QUIESCED": (409, ()),
    "PAUSE_IN_PROGRESS": (409, ("save", "weights_load", "adapter")),
    "BARRIER_UNAVAILABLE": (409, ("cbm", "concurrency")),
    "NOT_QUIESCED": (409, ("quiesce_in_progress",)),
    "NO_OPEN_COMMIT": (409, ()),
    "ATTACHMENT_NOT_STALE": (409, ()),
    "WEIGHTS_TORN": (503, ()),
    "WEIGHTS_UNSAVED": (409, ()),
    "NOT_ATTACHABLE": (
        400,
        (
            "gguf",
            "quantized",
            "dtype",
            "not_on_gpu",
            "allocator",
            "continuous_batching_running",
            "concurrency",
            "model_transition",
            "weights_writing",
        ),
    ),
}


def test_every_weights_page_code_is_defined_with_its_status_and_reasons() -> None:
    for name, (status, reasons) in WEIGHTS_PAGE.items():
        code = codes.lookup(name)
        assert code.status == status, name
        for reason in reasons:
            assert reason in code.reasons, (name, reason)
        assert name in codes.WEIGHTS_PAGE_CODES


def test_weights_page_codes_are_exactly_the_page_s() -> None:
    assert set(codes.WEIGHTS_PAGE_CODES) == set(WEIGHTS_PAGE)


def test_wire_form_is_lower_case_of_the_name() -> None:
    for code in codes.ALL.values():
        assert re.fullmatch(r"[A-Z][A-Z0-9_]+", code.name)
        assert code.wire == code.name.lower()
    assert codes.WEIGHTS_UNSAVED.wire == "weights_unsaved"
    assert codes.WEIGHTS_UNSAVED.openai_type == "invalid_request_error"  # weights page
    assert codes.WEIGHTS_TORN.openai_type == "server_error"


def test_allows_checks_status_and_reason() -> None:
    assert codes.MODEL_BUSY.allows(409, "drain_timeout")
    assert codes.MODEL_BUSY.allows(409, None)
    assert not codes.MODEL_BUSY.allows(409, "cbm")
    assert not codes.MODEL_BUSY.allows(503, None)
    assert codes.MODEL_NOT_LOADED.allows(409, None)  # /v1 with X-miLLM-Load-Policy: refuse
    assert not codes.WEIGHTS_TORN.allows(409, None)


def test_every_refusal_of_the_lifecycle_table_is_a_legal_use_of_its_code() -> None:
    for row in TABLE:
        for answer in (row.refuse, row.pending):
            if answer is None or answer.code is None:
                continue
            status = answer.http_status if hasattr(answer, "http_status") else answer.status
            assert answer.code.allows(status, answer.reason), (row.id, answer)
            assert codes.ALL[answer.code.name] is answer.code


def test_lookup_unknown_raises_key_error() -> None:
    import pytest

    with pytest.raises(KeyError):
        codes.lookup("NO_SUCH_CODE")
