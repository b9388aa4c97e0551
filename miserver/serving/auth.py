"""Bearer tokens, attachment IDs and their audit references (weights page: Authentication).

Only identification lives here: which token a request carries and whether its
``X-miLLM-Attachment`` header names the current attachment. What follows from that (401, 403,
``NOT_ATTACHED``, ``NOT_ATTACHMENT_HOLDER`` and their order) is the lifecycle table's decision.
A token or an attachment ID never leaves this module in a log line, a response or an error.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from functools import lru_cache

from miserver.spec.settings import WeightsToken

#: The ``WWW-Authenticate`` value sent with every 401 (weights page: Authentication).
WWW_AUTHENTICATE = "Bearer"
ATTACHMENT_HEADER = "X-miLLM-Attachment"

# Process-local key for attachment references: an 8-character reference is a keyed hash, so it
# cannot be turned back into the ID (nor recomputed from it outside this process).
_REF_KEY = secrets.token_bytes(32)


@dataclass(frozen=True)
class Caller:
    """Who sent a request.

    Attributes:
        token: ``"none"`` (no or malformed ``Authorization`` header), ``"invalid"`` (a bearer
            token that matches no configured token), ``"trainer"`` or ``"operator"``.
        label: the matching token's label, else ``None``.
    """

    token: str
    label: str | None = None

    @property
    def role(self) -> str | None:
        return self.token if self.token in ("trainer", "operator") else None


def identify(authorization: str | None, tokens: tuple[WeightsToken, ...]) -> Caller:
    """Resolve an ``Authorization`` header against the configured tokens.

    Every configured token is compared in constant time (``hmac.compare_digest``), with no early
    exit, so the time taken does not tell which prefix matched. With no tokens configured every
    bearer token is ``invalid`` (the weights page: with WEIGHTS_TOKENS empty every gated call is
    refused).
    """
    if not authorization:
        return Caller("none")
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    if scheme.lower() != "bearer" or not value:
        return Caller("none")
    presented = value.encode("utf-8", "surrogateescape")
    found: WeightsToken | None = None
    for token in tokens:
        if hmac.compare_digest(presented, token.secret.encode("utf-8")) and found is None:
            found = token
    if found is None:
        return Caller("invalid")
    return Caller(found.role, found.label)


def new_attachment_id() -> str:
    """A fresh attachment ID: 256 random bits, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def attachment_ref(attachment_id: str | None) -> str | None:
    """The 8-character reference the audit log carries instead of the ID (a keyed hash)."""
    if attachment_id is None:
        return None
    return _ref(attachment_id)


@lru_cache(maxsize=16)  # every gated call of one attachment asks for the same reference
def _ref(attachment_id: str) -> str:
    return hmac.new(_REF_KEY, attachment_id.encode(), hashlib.sha256).hexdigest()[:8]


def attachment_matches(header: str | None, attachment_id: str | None) -> bool:
    """Whether an ``X-miLLM-Attachment`` header names the current attachment (constant time)."""
    if not header or attachment_id is None:
        return False
    return hmac.compare_digest(
        header.strip().encode("utf-8", "surrogateescape"), attachment_id.encode()
    )
