"""Whether the resident model can be attached: the weights page's ``NOT_ATTACHABLE`` reasons.

Weights page, "Which models can be attached". The reasons are checked in the table's order and
the first that applies is returned, so a refusal always names the most fundamental cause (a GGUF
model is ``gguf`` even while a commit is open). Contract section 8 lifts ``not_on_gpu`` for CPU
parameters when ``WEIGHTS_CPU_ATTACH=1``.
"""

from __future__ import annotations

from collections.abc import Iterable

from miserver.spec import codes

#: The table's order (weights page "Which models can be attached"), as the code lists them.
REASONS: tuple[str, ...] = codes.NOT_ATTACHABLE.reasons

#: The parameter dtypes an attachable model may have (the ``dtype`` reason).
ATTACHABLE_DTYPES = frozenset({"float16", "bfloat16"})


def _dtype_name(d: object) -> str:
    return str(d).removeprefix("torch.")


def _device_type(d: object) -> str:
    return str(d).split(":", 1)[0]


def not_attachable_reason(
    *,
    fmt: str,
    quantization: str | None,
    param_dtypes: Iterable[object],
    devices: Iterable[object],
    arena: object | None,
    continuous_batching: bool,
    max_concurrent: int,
    model_transition: bool,
    weights_writing: bool,
    cpu_attach: bool,
) -> str | None:
    """The ``NOT_ATTACHABLE`` reason for attaching now, or None when attach may proceed.

    Pure: reads only its arguments. Weights page "Which models can be attached", in its order.

    Args:
        fmt: the catalogue row's format, ``safetensors`` or ``gguf``.
        quantization: the row's quantization (``none`` or None for an unquantized load).
        param_dtypes: every parameter's dtype (``torch.bfloat16`` or ``"bfloat16"``).
        devices: every parameter's device (``torch.device`` or ``"cuda:0"``, ``"cpu"``).
        arena: the load's :class:`~miserver.ipc.arena.ParameterArena`, None when the load was
            not made attachable.
        continuous_batching: ``CONTINUOUS_BATCHING`` is on.
        max_concurrent: ``MAX_CONCURRENT_REQUESTS``.
        model_transition: a load, unload, save, weights load or adapter change is in progress.
        weights_writing: a commit is still open.
        cpu_attach: ``WEIGHTS_CPU_ATTACH`` (contract section 8): CPU parameters count as
            attachable devices.

    Returns:
        One of :data:`REASONS`, or None.
    """
    if fmt == "gguf":
        return "gguf"
    if quantization not in (None, "", "none"):
        return "quantized"
    if any(_dtype_name(d) not in ATTACHABLE_DTYPES for d in param_dtypes):
        return "dtype"
    allowed = {"cuda", "cpu"} if cpu_attach else {"cuda"}
    if any(_device_type(d) not in allowed for d in devices):
        return "not_on_gpu"
    if arena is None:
        return "allocator"
    if continuous_batching:
        return "continuous_batching_running"
    if max_concurrent != 1:
        return "concurrency"
    if model_transition:
        return "model_transition"
    if weights_writing:
        return "weights_writing"
    return None


def should_make_attachable(
    *,
    fmt: str,
    quantization: str | None,
    param_dtypes: Iterable[object],
    devices: Iterable[object],
    has_trainer_token: bool,
    cpu_attach: bool,
) -> bool:
    """Whether a load must be placed in an arena (weights page, the ``allocator`` row).

    An unquantized 16-bit transformers load is made attachable when at least one token is
    configured at load time; on the CPU only with ``WEIGHTS_CPU_ATTACH`` (contract section 8).
    FP32 rows never are.
    """
    if not has_trainer_token:
        return False
    return (
        not_attachable_reason(
            fmt=fmt,
            quantization=quantization,
            param_dtypes=param_dtypes,
            devices=devices,
            arena=None,
            continuous_batching=False,
            max_concurrent=1,
            model_transition=False,
            weights_writing=False,
            cpu_attach=cpu_attach,
        )
        == "allocator"
    )
