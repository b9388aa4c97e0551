"""The trainer side's exceptions: every refusal :mod:`miserver.trainer` raises.

:class:`TrainerError` is the base of all. The rebuild's own refusals (weights page "Rebuilding the
tensors in the trainer": :class:`ProducerMismatch`, :class:`DeviceNotVisible`,
:class:`AlreadyRebuilt`, :class:`InvalidExport`, :class:`LayoutMismatch`, :class:`Released`,
:class:`StaleExport`) come first; then the server's refusals, :class:`WeightsError` and one
subclass per code of :mod:`miserver.spec.codes` (``WEIGHTS_TORN`` -> :class:`WeightsTorn`), and the
client's own (:class:`TransportError`, :class:`NotAttachedHere`). Every name is re-exported by
:mod:`miserver.trainer`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miserver.spec import codes


class TrainerError(RuntimeError):
    """Base class of every refusal raised by :mod:`miserver.trainer`."""


class ProducerMismatch(TrainerError):
    """The exporting process's torch or CUDA build differs from this one's (weights page:
    refuse to rebuild). ``differences`` maps field -> (producer's, ours)."""

    def __init__(self, differences: dict[str, tuple[Any, Any]]) -> None:
        text = "; ".join(f"{k}: server {a!r}, trainer {b!r}" for k, (a, b) in differences.items())
        super().__init__(
            "refusing to rebuild: the server's build differs from this process's ("
            + text
            + "); install the same torch build on both sides"
        )
        self.differences = differences


class DeviceNotVisible(TrainerError):
    """A storage's device (named by UUID) is not visible to this process."""


class AlreadyRebuilt(TrainerError):
    """This process already holds a rebuilt copy of the storage; rebuilding it again would
    release an IPC reference that was never opened and strand the storage in the server."""


class InvalidExport(TrainerError):
    """The export body is malformed (missing field, bad dtype, a view outside its storage)."""


class LayoutMismatch(TrainerError):
    """The model's parameters do not match the exported ones (names, shapes or dtypes)."""


class Released(TrainerError):
    """The weights were already released."""


class StaleExport(TrainerError):
    """The export body names a storage the server no longer serves (a body kept from an earlier
    attach, rebuilt after detach, reload, unload or a server restart): attach again."""


class WeightsError(TrainerError):
    """The server refused a call (management envelope ``error``, contract section 2).

    Attributes:
        code: the error code (``"WEIGHTS_TORN"``), None when the answer was not miserver's JSON.
        reason: the code's ``reason`` value or None.
        status: the HTTP status.
        message: the server's message (never carries a token or an attachment ID).
        details: the error's ``details`` object or None (``ALREADY_ATTACHED``: the holder).
        retry_after_s: the ``Retry-After`` header in seconds, when sent.
        call: the refused request (``"POST /api/weights/commit-end"``) when the client knows
            it; ``str()`` starts with it then.
    """

    def __init__(
        self,
        code: str | None,
        reason: str | None,
        status: int,
        message: str,
        details: Mapping[str, Any] | None = None,
        *,
        retry_after_s: float | None = None,
        call: str | None = None,
    ) -> None:
        super().__init__(message)
        self.call = call
        self.code = code
        self.reason = reason
        self.status = status
        self.message = message
        self.details = dict(details) if details is not None else None
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        head = f"{self.status} {self.code or 'error'}"
        if self.reason:
            head += f" (reason: {self.reason})"
        if self.call:
            head = f"{self.call}: {head}"
        return f"{head}: {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _make_error,
            (
                self.code,
                self.reason,
                self.status,
                self.message,
                self.details,
                self.retry_after_s,
                self.call,
            ),
        )


def _class_name(code: str) -> str:
    return "".join(part.capitalize() for part in code.split("_"))


def _generate() -> dict[str, type[WeightsError]]:
    out: dict[str, type[WeightsError]] = {}
    for name, code in codes.ALL.items():
        doc = f"{code.status} {name} ({code.source})." + (
            f" Reasons: {', '.join(code.reasons)}." if code.reasons else ""
        )
        cls = type(
            _class_name(name),
            (WeightsError,),
            {"__doc__": doc, "__module__": __name__, "CODE": code},
        )
        out[name] = cls
    return out


#: One :class:`WeightsError` subclass per code of :mod:`miserver.spec.codes` (every code of the
#: weights page, and the contract's checkpoint and catalogue codes), keyed by the wire name.
ERROR_CLASSES: dict[str, type[WeightsError]] = _generate()
globals().update({cls.__name__: cls for cls in ERROR_CLASSES.values()})


def error_class(code: str | None) -> type[WeightsError]:
    """The exception class for ``code``: its generated subclass, or :class:`WeightsError` for
    an unknown code or None."""
    return ERROR_CLASSES.get(code or "", WeightsError)


def _make_error(
    code: str | None,
    reason: str | None,
    status: int,
    message: str,
    details: Mapping[str, Any] | None,
    retry_after_s: float | None,
    call: str | None = None,
) -> WeightsError:
    return error_class(code)(
        code, reason, status, message, details, retry_after_s=retry_after_s, call=call
    )


class TransportError(TrainerError):
    """The server could not be reached, or did not answer within the timeout."""


class NotAttachedHere(TrainerError):
    """This client holds no attachment (call :meth:`WeightsClient.attach` first)."""
