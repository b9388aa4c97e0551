"""The trainer side: rebuild the weights miserver exports, bind them into a model, release them.

Public API (weights page "Rebuilding the tensors in the trainer" and "Releasing the handles";
contract section 8 for CPU shared memory)::

    from miserver import trainer

    with trainer.rebuild(body) as weights:           # body: the POST /attach response data
        model = trainer.build_model(body, weights)   # from body["config"]; tied stay tied
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        ...                                          # commit-begin
        with torch.no_grad():
            opt.step()                               # writes the served tensors in place
        torch.cuda.synchronize()                     # then commit-end
    # leaving the block released everything in the documented order

:func:`rebuild` opens each exported storage exactly once and takes every parameter as a view of
it; a second rebuild of a storage this process already holds is refused
(:class:`AlreadyRebuilt`), so the CUDA IPC reference counts always balance. It refuses a
``producer`` whose torch or CUDA build differs from this process's (:class:`ProducerMismatch`) and
matches CUDA devices by UUID, never by index (:class:`DeviceNotVisible`).
:meth:`AttachedWeights.release` drops every view (also those bound into a model, even while an
optimizer still references the parameters), calls ``torch.cuda.ipc_collect()``, then runs the
``on_release`` callback (the HTTP client's detach). It runs on leaving a ``with`` block, also on an
exception, and at interpreter exit if it has not run before.

The HTTP side (attach, heartbeat, the commit bracket, save, detach) is
:class:`~miserver.trainer.client.WeightsClient`, importable from here as well
(``from miserver.trainer import WeightsClient, WeightsTorn``), with one :class:`WeightsError`
subclass per error code.

This module is the trainer side's public face; it holds no code of its own. The code lives in
modules of one responsibility each, which import nothing of ``miserver.http``,
``miserver.serving`` or ``miserver.fsm`` (docs/architecture.md, Layers):

- :mod:`miserver.trainer.errors`: :class:`TrainerError` and every refusal (the rebuild's, the
  server's one class per code, the client's);
- :mod:`miserver.trainer.weights`: :func:`rebuild`, :class:`AttachedWeights`, :func:`bind_into`,
  :func:`build_model`;
- :mod:`miserver.trainer.training`: :func:`chat_example`, :func:`chat_batch`,
  :func:`init_optimizer_state`;
- :mod:`miserver.trainer.client` (over :mod:`miserver.trainer.transport`, its HTTP plumbing):
  :class:`WeightsClient`; :mod:`miserver.trainer.attachment`: :class:`Attachment`,
  :class:`CommitCycle`.
"""

from __future__ import annotations

from miserver.trainer.client import (
    ATTACHMENT_HEADER,
    HEARTBEAT_TERMINAL,
    Attachment,
    CommitCycle,
    WeightsClient,
)
from miserver.trainer.errors import (
    ERROR_CLASSES,
    AlreadyRebuilt,
    DeviceNotVisible,
    InvalidExport,
    LayoutMismatch,
    NotAttachedHere,
    ProducerMismatch,
    Released,
    StaleExport,
    TrainerError,
    TransportError,
    WeightsError,
    error_class,
)
from miserver.trainer.training import (
    IGNORE_INDEX,
    chat_batch,
    chat_example,
    init_optimizer_state,
)
from miserver.trainer.weights import (
    AttachedWeights,
    bind_into,
    build_model,
    check_producer,
    rebuild,
)

#: One :class:`WeightsError` subclass per code (``WeightsTorn``, ``NotQuiesced``, ...).
globals().update({cls.__name__: cls for cls in ERROR_CLASSES.values()})

__all__ = [
    "ATTACHMENT_HEADER",
    "ERROR_CLASSES",
    "HEARTBEAT_TERMINAL",
    "IGNORE_INDEX",
    "AlreadyRebuilt",
    "AttachedWeights",
    "Attachment",
    "CommitCycle",
    "DeviceNotVisible",
    "InvalidExport",
    "LayoutMismatch",
    "NotAttachedHere",
    "ProducerMismatch",
    "Released",
    "StaleExport",
    "TrainerError",
    "TransportError",
    "WeightsClient",
    "WeightsError",
    "bind_into",
    "build_model",
    "chat_batch",
    "chat_example",
    "check_producer",
    "error_class",
    "init_optimizer_state",
    "rebuild",
    *sorted(cls.__name__ for cls in ERROR_CLASSES.values()),
]
