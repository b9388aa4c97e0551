"""One attach as the trainer holds it (:class:`Attachment`: the attach answer and its rebuilt
weights, the served model built once) and what one commit cycle did (:class:`CommitCycle`).

Weights page "Routes" (the attach answer), "Rebuilding the tensors in the trainer" and
"Releasing the handles". Made by :class:`~miserver.trainer.client.WeightsClient`; re-exported
by :mod:`miserver.trainer`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from miserver.trainer.weights import AttachedWeights, build_model

log = logging.getLogger("miserver.trainer")


class _Detaches(Protocol):
    """What an :class:`Attachment` needs of the client that made it (a
    :class:`~miserver.trainer.client.WeightsClient`, which imports this module)."""

    def detach(self) -> dict[str, Any] | None: ...


@dataclass
class CommitCycle:
    """What :meth:`WeightsClient.commit` did; each field is the route's ``data`` (weights page,
    Routes), filled as the cycle goes. ``end`` holds ``steps_since_load``, ``commit_ms`` and
    ``overran`` once the block has left."""

    quiesce: dict[str, Any] | None = None
    begin: dict[str, Any] | None = None
    end: dict[str, Any] | None = None
    resume: dict[str, Any] | None = None

    @property
    def steps_since_load(self) -> int | None:
        return None if self.end is None else self.end.get("steps_since_load")


class Attachment:
    """One attach: the POST /attach answer (without the attachment ID) and its rebuilt weights.

    Attributes:
        body: the attach ``data`` minus ``attachment_id`` (weights page, Routes).
        model_ref: ``{model_id, name, manifest_hash}`` of the served base model.
        weights_state: ``clean``, ``writing`` or ``torn`` at attach time.
        steps_since_load: commits since the parameter set became resident, at attach time.
        heartbeat: ``{timeout_s, interval_hint_s}``.
        config: the served architecture config (dict) or None.
        weights: the :class:`~miserver.trainer.AttachedWeights` (each storage rebuilt once).
    """

    def __init__(self, body: dict[str, Any], weights: AttachedWeights, client: _Detaches) -> None:
        self.body = body
        self.model_ref: dict[str, Any] = dict(body.get("model") or {})
        self.weights_state: str = body.get("weights_state", "")
        self.steps_since_load: int | None = body.get("steps_since_load")
        self.heartbeat: dict[str, Any] = dict(body.get("heartbeat") or {})
        self.config: dict[str, Any] | None = body.get("config")
        self.weights = weights
        self._client = client
        self._model: torch.nn.Module | None = None
        self.cuda_devices: tuple[torch.device, ...] = tuple(
            sorted(
                {t.device for t in weights.unique_tensors() if t.device.type == "cuda"},
                key=lambda d: d.index or 0,
            )
        )

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Parameter name -> the served tensor (a view; tied names share one object)."""
        return self.weights.tensors

    @property
    def released(self) -> bool:
        return self.weights.released

    def build_model(self, model_class: type | None = None) -> torch.nn.Module:
        """The served architecture built from ``config`` with the served tensors as its
        parameters (built once, then the same object). See :func:`miserver.trainer.build_model`.

        Raises:
            InvalidExport: the export has no config (build the model and ``bind_into``).
            LayoutMismatch: the built model does not match the export.
        """
        if self._model is None:
            self._model = build_model(self.body, self.weights, model_class=model_class)
        return self._model

    @property
    def model(self) -> torch.nn.Module:
        """:meth:`build_model` with the class the config names."""
        return self.build_model()

    def detach(self) -> dict[str, Any] | None:
        """:meth:`WeightsClient.detach`."""
        return self._client.detach()

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self._client.detach()
            return
        try:  # the block's exception wins over a failed detach
            self._client.detach()
        except Exception as exc:  # noqa: BLE001
            log.warning("detach after %s failed: %s", exc_type.__name__, exc)

    def __repr__(self) -> str:
        state = "released" if self.weights.released else f"{len(self.weights)} parameter(s)"
        return (
            f"<Attachment {self.model_ref.get('name')!r} {state}, "
            f"weights_state={self.weights_state}>"
        )
