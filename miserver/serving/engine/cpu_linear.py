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

One row is a matrix-vector product (``torch.mv``: the same bits as the one-column product,
which torch computes on a slower path). Sibling projections that read the same input (queries,
keys and values; a gated MLP's gate and up) are laid out as row slices of one tensor at load
(:func:`place_fused_projections`) and computed as one product: fewer, longer reads.

Bits. In a product ``W @ Xᵀ`` a column's bits do not depend on how many columns there are, from
1 to :data:`MAX_ROWS` (and they equal ``F.linear``'s bits of that row in a product of 2 to 32
rows: the kernel oneDNN picks for those is the same arithmetic), nor on the other rows of ``W``
(a fused group gives each member the bits of its own product). The engine's CPU invariance
(a sequence's greedy text does not depend on its neighbours) rests on these properties;
tests/unit/test_cpu_linear.py checks them on the running torch. More rows than
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
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

#: The most rows a product takes through ``W @ Xᵀ`` (module docstring): a column's bits were
#: measured the same for every count of 1 to 129 columns with every weight shape of
#: SmolLM2-135M (torch 2.13, 1 and 2 threads); from 200 columns on some shapes differ.
MAX_ROWS = 128

#: Sibling projections that read the same input: attention's queries, keys and values, a
#: gated MLP's gate and up projections (by their module names, as Llama, Qwen2, Mistral and
#: SmolLM name them). :func:`place_fused_projections` lays each group's weights out as row
#: slices of one tensor at load, and a CPU pass computes the group in one product.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

#: The attribute of a member module holding its :class:`FusedGroup` (a plain attribute: not a
#: parameter, buffer or submodule, so state dicts and checkpoints never see it).
FUSED_ATTR = "_miserver_fused"


@dataclass(frozen=True)
class FusedGroup:
    """One group of sibling projections whose weights are row slices of ``weight``.

    Attributes:
        weight: ``[sum of out_features, in_features]``, CPU; member ``i``'s weight is the view
            ``weight[bounds[i][0]:bounds[i][1]]`` (the member's parameter is that view).
        bias: ``[sum of out_features]`` likewise, or None when no member has a bias.
        members: ``id()`` of each member module, in row order.
        bounds: each member's ``(first row, end row)``.
        pointers: each member weight's ``data_ptr()`` at placement: a member whose weight no
            longer lies there (moved, replaced) is computed alone.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    members: tuple[int, ...]
    bounds: tuple[tuple[int, int], ...]
    pointers: tuple[int, ...]


_local = threading.local()
_lock = threading.Lock()
_original_forward: Any = None


def _forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    # torch.compile traces torch's own forward (``is_compiling`` is folded to True there, so
    # the thread-local flag is never traced: a CUDA step compiled in a process where a CPU
    # engine once ran stays one graph)
    if (
        getattr(_local, "on", False)
        and type(self) is torch.nn.Linear
        and not torch.compiler.is_compiling()
    ):
        weight = self.weight
        rows = input.numel() // max(input.shape[-1], 1)
        if (
            1 <= rows <= MAX_ROWS
            and input.device.type == "cpu"
            and weight.device.type == "cpu"
            and input.dtype == weight.dtype
            and weight.dtype.is_floating_point
        ):
            threads = _local.matmul_threads
            before = torch.get_num_threads() if threads else 0
            if threads and threads != before:
                torch.set_num_threads(threads)  # the calling thread's team only (OpenMP)
            started = time.perf_counter()
            try:
                group = self.__dict__.get(FUSED_ATTR)
                if group is not None:
                    out = _fused_forward(self, group, input, rows)
                    if out is not None:
                        return out
                if rows > 1 and id(self) in _local.heads:
                    return _by_chunks(input, weight, self.bias)
                return _weight_first(input, weight, self.bias)
            finally:
                if threads and threads != before:
                    torch.set_num_threads(before)
                _local.timing.seconds += time.perf_counter() - started
    return _original_forward(self, input)


def _fused_forward(
    module: torch.nn.Linear, group: FusedGroup, input: torch.Tensor, rows: int
) -> torch.Tensor | None:
    """``module``'s output from one product over its whole group (the siblings' outputs are
    kept for their calls with the same input tensor), or None when the member's weight no
    longer lies in the group's tensor. A row's bits are those of the member's own
    ``weight @ inputᵀ``: each output element is the same dot product whatever the other rows
    of the weight (tests/unit/test_cpu_linear.py checks it on the running torch)."""
    me = id(module)
    index = group.members.index(me)
    if module.weight.data_ptr() != group.pointers[index]:
        return None
    kept = _local.kept.pop(me, None)
    if kept is not None and kept[0] is input:
        return kept[1]
    shape = input.shape[:-1]
    x = input.reshape(-1, input.shape[-1])
    if rows == 1:
        full = (
            torch.mv(group.weight, x[0])
            if group.bias is None
            else torch.addmv(group.bias, group.weight, x[0])
        )
        outs = [full[a:b].view(*shape, b - a) for a, b in group.bounds]
    else:
        full = (
            torch.mm(group.weight, x.t())
            if group.bias is None
            else torch.addmm(group.bias[:, None], group.weight, x.t())
        )  # [total, rows]
        outs = [full[a:b].t().contiguous().view(*shape, b - a) for a, b in group.bounds]
    for member, out in zip(group.members, outs, strict=True):
        if member != me:
            _local.kept[member] = (input, out)
    return outs[index]


def _weight_first(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` computed as ``(weight @ inputᵀ)ᵀ``.

    Args:
        input: ``[..., in_features]``, the weight's dtype, CPU.
        weight: ``[out_features, in_features]``, never modified.
        bias: ``[out_features]`` or None.

    Returns:
        ``[..., out_features]``, contiguous.
    """
    x = input.reshape(-1, input.shape[-1])
    if x.shape[0] == 1:
        # one row: a matrix-vector product (the same bits as the product's one column; torch's
        # one-column ``mm`` takes a slower path: 40 against 29 ms for SmolLM2's weights)
        out = torch.mv(weight, x[0]) if bias is None else torch.addmv(bias, weight, x[0])
        return out.view(*input.shape[:-1], weight.shape[0])
    if bias is None:
        out = torch.mm(weight, x.t()).t()
    else:
        out = torch.addmm(bias[:, None], weight, x.t()).t()
    return out.contiguous().view(*input.shape[:-1], weight.shape[0])


#: Bytes of one chunk's product ``[chunk, rows]`` in :func:`_by_chunks`: it stays in the core's
#: L2 cache while it is copied into place (1 MiB: a 4,096-row chunk of 128 rows in bfloat16).
HEAD_CHUNK_BYTES = 1 << 20


def _by_chunks(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """:func:`_weight_first` for a layer with many outputs (the output embedding: 49,152 for
    SmolLM2), its rows of the weight taken a chunk at a time, each chunk's product ``[chunk,
    rows]`` written into the ``[rows, out_features]`` output while it is still in the cache.
    The same values and bits (a product's element does not depend on the weight's other rows),
    without the transpose of the whole ``[out_features, rows]`` product, which reads it a
    cache line a value: the logits of 64 rows, then gathered row by row and made float32, took
    28.9 ms against 9.4 this way (the product included; 2-core machine, 1 thread)."""
    x = input.reshape(-1, input.shape[-1])
    rows, total = x.shape[0], weight.shape[0]
    out = torch.empty(rows, total, dtype=weight.dtype, device=weight.device)
    chunk = max(256, HEAD_CHUNK_BYTES // (rows * weight.element_size()))
    xt = x.t()
    for start in range(0, total, chunk):
        end = min(start + chunk, total)
        if bias is None:
            part = torch.mm(weight[start:end], xt)
        else:
            part = torch.addmm(bias[start:end, None], weight[start:end], xt)
        out[:, start:end].copy_(part.t())
    return out.view(*input.shape[:-1], total)


def install() -> None:
    """Wrap ``torch.nn.Linear.forward`` once (idempotent, thread-safe). The wrapper calls the
    original unless the calling thread is inside :func:`cpu_linears`."""
    global _original_forward
    with _lock:
        if _original_forward is None:
            _original_forward = torch.nn.Linear.forward
            torch.nn.Linear.forward = _forward  # type: ignore[method-assign]


@dataclass
class ProductTime:
    """Wall seconds the products of a :func:`cpu_linears` block took (its linear layers on the
    ``weight @ inputᵀ`` path, transposes included)."""

    seconds: float = 0.0


@contextmanager
def cpu_linears(
    on: bool = True, heads: Iterable[torch.nn.Module] = (), matmul_threads: int | None = None
) -> Iterator[ProductTime]:
    """Within the block, this thread's CPU ``torch.nn.Linear`` layers of up to
    :data:`MAX_ROWS` rows compute ``weight @ inputᵀ`` (module docstring); ``on=False`` leaves
    them as they are. The layers in ``heads`` (the output embedding) compute their product a
    chunk of outputs at a time (:func:`_by_chunks`). ``matmul_threads`` (>= 1, or None: the
    thread's own count): torch's intra-op threads for those products only, every other
    operation of the pass keeping the thread's count (``CPU_MATMUL_THREADS``; the products read
    the weights, and a second core's memory bandwidth nearly halves them, while the hundreds of
    small operations between them would only pay a team's synchronisation). Nests; restores the
    thread's previous state on exit.

    Raises:
        ValueError: ``matmul_threads`` below 1.
    """
    if matmul_threads is not None and matmul_threads < 1:
        raise ValueError(f"matmul_threads must be >= 1: {matmul_threads}")
    timing = ProductTime()
    if not on:
        yield timing
        return
    install()
    before = (
        getattr(_local, "on", False),
        getattr(_local, "heads", frozenset()),
        getattr(_local, "kept", {}),
        getattr(_local, "matmul_threads", None),
        getattr(_local, "timing", None),
    )
    _local.on = True
    _local.heads = frozenset(id(m) for m in heads)
    _local.kept = {}  # a fused group's outputs awaiting their sibling's call (by id(module))
    _local.matmul_threads = matmul_threads
    _local.timing = timing
    try:
        yield timing
    finally:
        _local.on, _local.heads, _local.kept, _local.matmul_threads, _local.timing = before


#: Row counts :func:`same_bits` compares (a one-row ``torch.mv``, products of 2 to MAX_ROWS).
CHECK_ROWS = (1, 2, 3, 17, 33, 64, MAX_ROWS)

#: :func:`same_bits` takes at most this many rows of a weight (a larger layer, the output
#: embedding above all, is checked on its first rows: the few-row products whose thread split
#: may cut a row's sum are the narrow ones).
CHECK_MAX_OUT = 8192


def same_bits(
    shapes: Iterable[tuple[int, int]], dtype: torch.dtype, counts: tuple[int, ...]
) -> bool:
    """Whether ``weight @ inputᵀ`` (:func:`_weight_first`) gives every row the same bits on
    each thread count in ``counts``, for random weights of each ``(out_features,
    in_features)`` in ``shapes`` (at most :data:`CHECK_MAX_OUT` rows of a weight) and inputs
    of :data:`CHECK_ROWS` rows, in ``dtype``, on the running torch and CPU. What moving a
    pass's products between thread counts needs so that a sequence's text does not depend on
    the count (:class:`MatmulThreads`). Measured: in bfloat16 1 and 2 threads agree for
    SmolLM2's shapes; 6 or more threads split some 128-row products' sums otherwise. The
    calling thread's count is restored."""
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    try:
        for out_f, in_f in sorted(set(shapes)):
            w = (torch.randn(min(out_f, CHECK_MAX_OUT), in_f, generator=gen) * 0.05).to(dtype)
            x = torch.randn(max(CHECK_ROWS), in_f, generator=gen).to(dtype)
            for rows in CHECK_ROWS:
                got = []
                for count in counts:
                    torch.set_num_threads(count)
                    got.append(_weight_first(x[:rows], w, None))
                if not all(torch.equal(got[0], g) for g in got[1:]):
                    return False
        return True
    finally:
        torch.set_num_threads(before)


def product_shapes(model: torch.nn.Module) -> set[tuple[int, int]]:
    """The ``(out, in)`` shapes of ``model``'s CPU products: each plain ``torch.nn.Linear``'s
    weight, or its fused group's (:func:`place_fused_projections`)."""
    shapes = set()
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu":
            group = module.__dict__.get(FUSED_ATTR)
            weight = group.weight if group is not None else module.weight
            shapes.add((int(weight.shape[0]), int(weight.shape[1])))
    return shapes


#: Passes of one size between probes of the thread count not in use (:class:`MatmulThreads`),
#: doubled up to :data:`PROBE_MAX` while probes confirm the choice.
PROBE_FIRST = 8
PROBE_MAX = 128


class MatmulThreads:
    """The thread count of a CPU pass's products: ``threads`` or ``fallback``, per size of pass
    (its rows, by powers of two), whichever computed them faster lately (docs/decisions.md, "Products on
    every core").

    On an idle core a second thread nearly halves the products (the weights' reads); but a
    worker the OS keeps off its core, because another busy process has it, stalls every product
    of the pass: measured 410 against 44 ms a token (SmolLM2, 2 cores, one busy process beside
    the server). So both counts are timed. A size's first passes try each count once; from
    then on a pass takes the count whose products took less time (an average weighting the
    latest pass by a half), and every :data:`PROBE_FIRST` passes one probes the other count
    (its time replaces that count's: conditions may have changed since). A probe that loses
    doubles the interval, up to :data:`PROBE_MAX` passes (a busy neighbour costs one slow pass
    in 128); a change of choice (a probe that wins, or the count in use growing slower) starts
    the interval over.

    Args:
        threads: the count to try (>= 1).
        fallback: the count to try beside it (>= 1; the engine thread's own, ``CPU_THREADS``);
            equal to ``threads``, every pass takes it.

    Raises:
        ValueError: a count below 1.
    """

    def __init__(self, threads: int, fallback: int = 1) -> None:
        if threads < 1 or fallback < 1:
            raise ValueError(f"matmul threads must be >= 1: {threads}, {fallback}")
        self.threads = threads
        self.fallback = fallback
        self._seconds: dict[tuple[int, int], float] = {}  # (size, threads) -> recent seconds
        self._probe: dict[int, list[int]] = {}  # size -> [passes until a probe, interval]
        #: how many times a size's choice changed
        self.switches = 0

    def _best(self, size: int, seconds: dict[tuple[int, int], float] | None = None) -> int | None:
        seconds = self._seconds if seconds is None else seconds
        many = seconds.get((size, self.threads))
        few = seconds.get((size, self.fallback))
        if many is None or few is None:
            return None
        return self.threads if many <= few else self.fallback

    def choose(self, rows: int) -> int:
        """The thread count for a pass of ``rows`` rows."""
        if self.threads == self.fallback:
            return self.threads
        size = rows.bit_length()
        for count in (self.threads, self.fallback):  # each count once before any choice
            if (size, count) not in self._seconds:
                return count
        best = self._best(size)
        probe = self._probe.setdefault(size, [PROBE_FIRST, PROBE_FIRST])
        probe[0] -= 1
        if probe[0] <= 0:
            return self.fallback if best == self.threads else self.threads
        return best or self.threads

    def summary(self) -> dict[str, Any]:
        """``{threads, fallback, chosen: {"LOW-HIGH" rows: count in use}, switches}`` (the
        health route's view: which count each size of pass uses now). Safe from any thread."""
        seconds = dict(self._seconds)  # one copy under the GIL: the engine thread adds sizes
        chosen = {}
        for size in sorted({size for size, _ in seconds}):
            low, high = (1 << size) >> 1, (1 << size) - 1
            best = self._best(size, seconds)
            chosen[f"{low}-{high}" if high > low else str(low)] = best or self.threads
        return {
            "threads": self.threads,
            "fallback": self.fallback,
            "chosen": chosen,
            "switches": self.switches,
        }

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """The products of a pass of ``rows`` rows on ``threads`` took ``seconds``."""
        if self.threads == self.fallback:
            return
        size = rows.bit_length()
        before = self._best(size)
        key = (size, threads)
        last = self._seconds.get(key)
        probe = self._probe.get(size)
        probing = probe is not None and probe[0] <= 0 and before not in (None, threads)
        # a probe's time replaces its count's (what it costs now, not before)
        self._seconds[key] = seconds if last is None or probing else (last + seconds) / 2
        if probe is None or before is None:
            return
        if self._best(size) != before:  # a probe won, or the count in use got slower
            self.switches += 1
            probe[:] = [PROBE_FIRST, PROBE_FIRST]
        elif probing:  # the probe lost: wait longer for the next
            probe[1] = min(2 * probe[1], PROBE_MAX)
            probe[0] = probe[1]


def place_fused_projections(model: torch.nn.Module) -> list[FusedGroup]:
    """Lay out each group of sibling projections (:data:`FUSED_GROUPS`: plain CPU
    ``torch.nn.Linear`` layers of one floating dtype, the same ``in_features`` and all with or
    all without a bias) as row slices of one new tensor, at load, before anything is served:
    each member's parameter becomes a view of it with the same shape, dtype and values (a
    trainer's in-place write to ``q_proj.weight`` lands in the group's tensor, which the next
    step reads). Within :func:`cpu_linears` the group is then one product of up to
    :data:`MAX_ROWS` rows instead of one per member: fewer, longer reads of the weights
    (SmolLM2-135M, one sequence, 1 thread: q/k/v as three products 5.9 + 2.9 ms a step at
    6.8 and 4.7 GB/s, the gate and up projections 11.1 ms at 9.5 GB/s; docs/decisions.md,
    "Sibling projections in one product"). Returns the groups placed."""
    groups: list[FusedGroup] = []
    with torch.no_grad():
        for module in model.modules():
            for names in FUSED_GROUPS:
                members = [module._modules.get(name) for name in names]
                if not _fusable(members):
                    continue
                linears: list[torch.nn.Linear] = members  # type: ignore[assignment]
                first = linears[0].weight
                total = sum(m.out_features for m in linears)
                weight = torch.empty(total, first.shape[1], dtype=first.dtype)
                with_bias = linears[0].bias is not None
                bias = torch.empty(total, dtype=first.dtype) if with_bias else None
                bounds: list[tuple[int, int]] = []
                start = 0
                for m in linears:
                    end = start + m.out_features
                    weight[start:end].copy_(m.weight)
                    m.weight.data = weight[start:end]
                    if bias is not None:
                        bias[start:end].copy_(m.bias)
                        m.bias.data = bias[start:end]
                    bounds.append((start, end))
                    start = end
                group = FusedGroup(
                    weight,
                    bias,
                    tuple(id(m) for m in linears),
                    tuple(bounds),
                    tuple(m.weight.data_ptr() for m in linears),
                )
                for m in linears:
                    m.__dict__[FUSED_ATTR] = group
                groups.append(group)
    return groups


def _fusable(members: list[Any]) -> bool:
    if not all(type(m) is torch.nn.Linear for m in members):
        return False
    first = members[0].weight
    return first.dtype.is_floating_point and all(
        m.weight.device.type == "cpu"
        and m.weight.dtype == first.dtype
        and m.weight.shape[1] == first.shape[1]
        and (m.bias is None) == (members[0].bias is None)
        and (m.bias is None or m.bias.dtype == first.dtype)
        and FUSED_ATTR not in m.__dict__
        for m in members
    )
