"""Token identification and attachment references (weights page: Authentication and headers)."""

from miserver.serving.auth import (
    attachment_matches,
    attachment_ref,
    identify,
    new_attachment_id,
)
from miserver.spec.settings import WeightsToken

TOKENS = (
    WeightsToken(label="trn", role="trainer", secret="trainer-secret-0123456789"),
    WeightsToken(label="ops", role="operator", secret="operator-secret-0123456789"),
)


def test_identify_each_kind():
    assert identify(None, TOKENS).token == "none"
    assert identify("Basic abc", TOKENS).token == "none"
    assert identify("Bearer ", TOKENS).token == "none"
    assert identify("Bearer nope-nope-nope-nope", TOKENS).token == "invalid"
    assert identify("Bearer trainer-secret-0123456789", TOKENS).label == "trn"
    caller = identify("bearer operator-secret-0123456789", TOKENS)
    assert (caller.token, caller.label, caller.role) == ("operator", "ops", "operator")


def test_no_tokens_configured_refuses_every_token():
    assert identify("Bearer trainer-secret-0123456789", ()).token == "invalid"


def test_prefix_of_a_token_is_invalid():
    assert identify("Bearer trainer-secret-012345678", TOKENS).token == "invalid"


def test_attachment_ids_are_long_random_and_refs_are_short_and_not_the_id():
    a, b = new_attachment_id(), new_attachment_id()
    assert a != b and len(a) >= 43
    ref = attachment_ref(a)
    assert len(ref) == 8 and ref not in a and ref == attachment_ref(a) and ref != attachment_ref(b)


def test_attachment_matches():
    a = new_attachment_id()
    assert attachment_matches(a, a)
    assert attachment_matches(f" {a} ", a)
    assert not attachment_matches(None, a)
    assert not attachment_matches(a, None)
    assert not attachment_matches(a[:-1], a)
