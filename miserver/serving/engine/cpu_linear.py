"""The linear layers of a CPU forward pass as ``weight @ inputᵀ`` (issue 29, CPU speed).

``torch.nn.functional.linear(x, W)`` computes ``x @ Wᵀ``. For the few rows a decode step has,
oneDNN then treats the served weight as the product's second operand and reorders it into its
blocked layout on every call: the weight is read, written and read again, and a step that is
bound by reading the weights (270 MB of bfloat16 for SmolLM2-135M) pays that about twice.
``torch.mm(W, xᵀ)`` computes the same numbers with the weight as the first operand, which
the library reads as it lies; its transpose (made contiguous, ``[rows, out]``) is the layer's
output. Nothing is copied from or written to the weight: the served storages stay exactly as
they are (the arena invariant), so a trainer's in-place commit is seen by the next step.

Measured on the 2-core CPU machine (torch 2.13, bfloat16, SmolLM2-135M's weight shapes,
``benchmarks/cpu_linear.py``): see docs/decisions.md, "The CPU's linear layers".

Bits. In a product ``W @ Xᵀ`` a column's bits do not depend on how many columns there are, from
1 to :data:`MAX_ROWS` (and they equal ``F.linear``'s bits of that row in a product of 2 to 32
rows: the kernel oneDNN picks for those is the same arithmetic). The engine's CPU invariance
(a sequence's greedy text does not depend on its neighbours) rests on that property;
tests/unit/test_cpu_linear.py checks it on the running torch. More rows than
:data:`MAX_ROWS` (a long prefill chunk, computed in a forward pass of its own) go through
``F.linear`` as before.

Scope. :func:`cpu_linears` turns the path on for the calling thread only, for the duration of a
``with`` block: ``torch.nn.Linear.forward`` is wrapped once, process-wide, by a function that
checks a thread-local flag and otherwise calls the original, so every other thread (the event
loop, another resident's engine, a trainer in the same process) runs torch's own code. Only a
plain ``torch.nn.Linear`` (not a subclass that overrides ``forward``) on a CPU tensor of a
floating dtype takes the path.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: The most rows a product takes through ``W @ Xᵀ`` (module docstring): a column's bits were
#: measured the same for every count of 1 to 129 columns with every weight shape of
#: SmolLM2-135M (torch 2.13, 1 and 2 threads); from 200 columns on some shapes differ.
MAX_ROWS = 128

#: Row counts left to ``F.linear``: its products of 2 to 32 rows give a row the same bits as
#: ``W @ Xᵀ`` does (tests/unit/test_cpu_linear.py), and from 17 rows on it is as fast or faster
#: than ``W @ Xᵀ`` with the transpose made contiguous (``benchmarks/cpu_linear.py``).
LINEAR_FIRST, LINEAR_LAST = 17, 32

_local = threading.local()
_lock = threading.Lock()
_original_forward: Any = None


def _forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    # torch.compile traces torch's own forward (``is_compiling`` is folded to True there, so
    # the thread-local flag is never traced: a CUDA step compiled in a process where a CPU
    # engine once ran stays one graph)
    if (
        not torch.compiler.is_compiling()
        and getattr(_local, "on", False)
        and type(self) is torch.nn.Linear
    ):
        weight = self.weight
        rows = input.numel() // max(input.shape[-1], 1)
        if (
            1 <= rows <= MAX_ROWS
            and not LINEAR_FIRST <= rows <= LINEAR_LAST
            and input.device.type == "cpu"
            and weight.device.type == "cpu"
            and input.dtype == weight.dtype
            and weight.dtype.is_floating_point
        ):
            return _weight_first(input, weight, self.bias, id(self) not in _local.transposed)
    return _original_forward(self, input)


def _weight_first(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    contiguous: bool = True,
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` computed as ``(weight @ inputᵀ)ᵀ``.

    Args:
        input: ``[..., in_features]``, the weight's dtype, CPU.
        weight: ``[out_features, in_features]``, never modified.
        bias: ``[out_features]`` or None.
        contiguous: False: return the transpose of the product as it is (same values; the
            copy is left to the reader, as for the logits a sampler gathers row by row).

    Returns:
        ``[..., out_features]``, contiguous unless ``contiguous`` is False.
    """
    x = input.reshape(-1, input.shape[-1])
    if bias is None:
        out = torch.mm(weight, x.t()).t()
    else:
        out = torch.addmm(bias[:, None], weight, x.t()).t()
    if contiguous:
        out = out.contiguous()
    return out.view(*input.shape[:-1], weight.shape[0])


def install() -> None:
    """Wrap ``torch.nn.Linear.forward`` once (idempotent, thread-safe). The wrapper calls the
    original unless the calling thread is inside :func:`cpu_linears`."""
    global _original_forward
    with _lock:
        if _original_forward is None:
            _original_forward = torch.nn.Linear.forward
            torch.nn.Linear.forward = _forward  # type: ignore[method-assign]


@contextmanager
def cpu_linears(on: bool = True, transposed: Iterable[torch.nn.Module] = ()) -> Iterator[None]:
    """Within the block, this thread's CPU ``torch.nn.Linear`` layers of up to
    :data:`MAX_ROWS` rows compute ``weight @ inputᵀ`` (module docstring); ``on=False`` leaves
    them as they are. The layers in ``transposed`` (the output embedding, whose logits the
    runner gathers row by row anyway) return the product's transpose without making it
    contiguous: the same values, one copy fewer of ``[rows, vocab]``. Nests; restores the
    thread's previous state on exit."""
    if not on:
        yield
        return
    install()
    before = getattr(_local, "on", False), getattr(_local, "transposed", frozenset())
    _local.on = True
    _local.transposed = frozenset(id(m) for m in transposed)
    try:
        yield
    finally:
        _local.on, _local.transposed = before
