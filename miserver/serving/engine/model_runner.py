"""One forward pass of the continuous engine over the paged cache (issue 29).

:class:`ModelRunner` turns a step's scheduled sequences into the model's inputs: the new tokens
of every sequence flattened into one row (``input_ids`` / ``position_ids`` ``[1, T]``), the cache
slot of each token (``slot_mapping``), each sequence's blocks and context length
(:class:`~miserver.serving.engine.paged_attention.PagedMetadata`); runs the model's own forward
with the ``miserver_paged`` attention function; returns the logits of the positions asked for
(each sampling sequence's last position; every prompt position of an ``echo`` sequence).

CPU invariance (issue 29: a sequence's greedy text does not depend on its neighbours). The
linear layers see the step's tokens as rows of one matrix; on the CPU they compute
``weight @ inputᵀ`` (:mod:`~miserver.serving.engine.cpu_linear`), whose columns keep their bits
in any product of 1 to :data:`MAX_ROWS` columns, so a pass holds up to that many rows: one-query
rows and whole prefill chunks together (a chunk longer than a pass is alone). Without it
(``weight_first=False``) ``F.linear`` keeps a row's bits for 2 to :data:`LINEAR_MAX_ROWS` rows
only: a step of one token is padded with a second row (it writes the cache's scratch block,
never a sequence's), and so is a logits read of one row; each prefill chunk is a pass of its
own. Attention: one masked call for every one-query row, one call per prefill chunk
(:mod:`~miserver.serving.engine.paged_attention`). A sequence's positions past its
``num_prefill_tokens`` are always one-query rows, also when a preempted sequence recomputes
several of them in one step, so a recompute gives the bits of the first computation.

CUDA. :class:`DecodeGraphs` captures the decode step of ``B`` sequences (one token each) as a
CUDA graph per (batch-size bucket, block-table width bucket) over static input buffers and the
paged cache (whose tensors never move: a graph stays valid across weight commits), using the
fixed-shape ``batched`` attention path. The width bucket (a power of two of blocks, at least
:data:`SMALLEST_WIDTH`, at most the context's) bounds what a step gathers to about twice the
longest running sequence instead of the model's whole context for every row.
``DECODE_GRAPHS`` modes: ``captured`` (eager
forward captured), ``compiled`` (``torch.compile``, then captured), ``off``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from miserver.serving.engine.cpu_linear import MAX_ROWS as WEIGHT_FIRST_ROWS
from miserver.serving.engine.cpu_linear import (
    MatmulThreads,
    cpu_linears,
    product_shapes,
    same_bits,
)
from miserver.serving.engine.devices import dtype_of
from miserver.serving.engine.kv_cache import PagedKVCache
from miserver.serving.engine.paged_attention import (
    ATTENTION_NAME,
    PagedMetadata,
    SeqSpan,
    decode_mask,
    model_configs,
    pack_spans,
    register,
    use_paged_attention,
)
from miserver.serving.engine.sequence import Sequence

log = logging.getLogger("miserver.engine")

#: The fewest rows a CPU matrix product computes (module docstring).
MIN_ROWS = 2

#: The most rows a CPU forward pass of one-query rows computes (module docstring). The linear
#: layers compute ``weight @ inputᵀ`` on the CPU (:mod:`~miserver.serving.engine.cpu_linear`),
#: whose columns keep their bits for 1 to its ``MAX_ROWS`` columns. (``F.linear``'s oneDNN
#: products kept a row's bits only for 2 to 32 rows: a pass was 32 rows at most before.)
MAX_ROWS = WEIGHT_FIRST_ROWS

#: The most rows a CPU pass computes without ``weight_first``: ``F.linear``'s oneDNN products
#: give a row the same bits for 2 to 32 rows only (measured, torch 2.13, every weight shape of
#: SmolLM2-135M: from 33 rows on up to 32 of 64 rows differ).
LINEAR_MAX_ROWS = 32


@dataclass
class ScheduledSeq:
    """One sequence's work in a step: compute positions ``num_computed_tokens ..
    num_computed_tokens + num_new - 1``; ``sample``: those reach the sequence's end (its next
    token is sampled from the last one's logits); ``prompt_logits``: also return the logits of
    its prompt positions in the run (``echo`` with ``logprobs``); ``draft``: the last
    ``draft`` positions are draft tokens (:mod:`~miserver.serving.engine.speculation`), and the
    logits of the last ``draft + 1`` positions are returned."""

    seq: Sequence
    num_new: int
    sample: bool
    prompt_logits: bool = False
    draft: int = 0


@dataclass
class StepResult:
    """``logits``: ``[rows, vocab]`` float32, in schedule order, one row per sampling
    sequence (``1 + draft`` rows for a drafted one);
    ``prompt_logits``: per echo sequence (by ``id``), ``[positions, vocab]`` of its prompt
    positions in this run."""

    logits: torch.Tensor
    prompt_logits: dict[int, torch.Tensor]


def _token_at(seq: Sequence, position: int) -> int:
    prompt = seq.num_prompt_tokens
    if position < prompt:
        return seq.prompt_token_ids[position]
    return seq.output_token_ids[position - prompt]


#: The narrowest block table a decode graph is captured for (blocks).
SMALLEST_WIDTH = 16


def width_buckets(max_blocks: int, smallest: int = SMALLEST_WIDTH) -> tuple[int, ...]:
    """Block-table widths that get a decode graph: powers of two from ``smallest``, the last
    being ``max_blocks`` (a step replays the narrowest width holding its longest sequence).

    >>> width_buckets(512)
    (16, 32, 64, 128, 256, 512)
    >>> width_buckets(40)
    (16, 32, 40)
    >>> width_buckets(8)
    (8,)
    """
    out = []
    width = smallest
    while width < max_blocks:
        out.append(width)
        width *= 2
    out.append(max_blocks)
    return tuple(out)


def decode_buckets(max_rows: int) -> tuple[int, ...]:
    """Batch sizes that get a decode graph: 1, 2, 4, 8, then multiples of 8 up to
    ``max_rows`` (a batch replays the smallest bucket that holds it, padded).

    >>> decode_buckets(20)
    (1, 2, 4, 8, 16, 24)
    >>> decode_buckets(3)
    (1, 2, 4)
    """
    out = [1, 2, 4, 8]
    while out[-1] < max_rows:
        out.append(out[-1] + 8)
    while len(out) > 1 and out[-2] >= max_rows:
        out.pop()
    return tuple(out)


class ModelRunner:
    """Runs the served ``model`` over ``cache`` (module docstring).

    Args:
        model: a transformers causal LM (eval mode) whose attention modules call
            ``ALL_ATTENTION_FUNCTIONS`` (Llama-like); never modified.
        cache: the paged cache (made for this model).
        graphs: a :class:`DecodeGraphs` for the decode steps (CUDA), or None.
        packed_prefill: attend a step's prefill chunks in packs
            (:func:`~miserver.serving.engine.paged_attention.pack_spans`), the step in one
            forward pass; None: on CUDA only (on by choice on the CPU, a chunk's bits may
            then depend on its neighbours).
        weight_first: the CPU's linear layers as ``weight @ inputᵀ``
            (:mod:`~miserver.serving.engine.cpu_linear`; faster, and a pass may hold
            :data:`MAX_ROWS` one-query rows); None: on the CPU.
        matmul_threads: torch's intra-op threads for the linear products of a CPU pass in
            bfloat16 or float16 (``CPU_MATMUL_THREADS``); None: the engine thread's own count.
        own_threads: the engine thread's own count (``CPU_THREADS``); None: the calling
            thread's.
    """

    def __init__(
        self,
        model: Any,
        cache: PagedKVCache,
        graphs: DecodeGraphs | None = None,
        packed_prefill: bool | None = None,
        weight_first: bool | None = None,
        matmul_threads: int | None = None,
        own_threads: int | None = None,
    ):
        register()
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.configs = model_configs(model)
        cpu = self.device.type == "cpu"
        #: the CPU's linear layers as ``weight @ inputᵀ`` (:mod:`cpu_linear`); None: on the CPU
        self.weight_first = cpu if weight_first is None else weight_first
        #: whether a row's bits are the same in a pass of 1 to MAX_ROWS rows (bfloat16 and
        #: float16 under ``weight_first``: a one-row ``torch.mv`` equals a column of ``mm``;
        #: in float32 it does not, so a float32 pass keeps the padding row as before)
        self.rows_exact = (
            cpu and self.weight_first and dtype_of(model) in (torch.bfloat16, torch.float16)
        )
        self.min_rows = MIN_ROWS if cpu and not self.rows_exact else 1
        #: torch's threads for the linear products of a CPU pass (``CPU_MATMUL_THREADS``;
        #: :func:`cpu_linears`), or None: the engine thread's own. Settled at the first pass,
        #: on the thread that runs passes (:meth:`settle_matmul_threads`)
        self.matmul_threads: int | None = None
        #: chooses each pass's product threads (``matmul_threads`` or the engine thread's own),
        #: timing both; None until settled, or without ``matmul_threads``
        self.threads: MatmulThreads | None = None
        self._matmul_wanted = matmul_threads
        self._own_threads = own_threads
        self._matmul_settled = False
        self.max_rows = (MAX_ROWS if self.weight_first else LINEAR_MAX_ROWS) if cpu else None
        #: several prefill chunks of a step in one attention call a layer (CUDA by default;
        #: never on the CPU by default, where each chunk's bits must not depend on the others)
        self.packed_prefill = not cpu if packed_prefill is None else packed_prefill
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        #: the output embedding: its product computed a chunk of the vocabulary at a time
        self._head = (head,) if isinstance(head, torch.nn.Module) else ()
        self.graphs = graphs
        self._logits: torch.Tensor | None = None  # the CPU's float32 logits, reused (_float_rows)
        self.forward_passes = 0
        #: whether the last step ran through :class:`DecodeGraphs` (its fixed-shape path)
        self.last_graphed = False

    def settle_matmul_threads(self) -> None:
        """Settle :attr:`matmul_threads` and :attr:`threads` once, on the calling thread (the
        engine's, at its first pass). The check runs products on both counts, and on another
        thread it would leave that thread an OpenMP team: with more OpenMP threads than cores,
        the product team's threads stop spinning between products and two threads lose to one
        (measured: a lone chat 46 against 31 ms a token when the check ran on the loading
        thread; docs/decisions.md, "Products on every core")."""
        if self._matmul_settled:
            return
        self._matmul_settled = True
        own = self._own_threads or torch.get_num_threads()
        self.matmul_threads = self._matmul_threads(self.model, self._matmul_wanted, own)
        if self.matmul_threads:
            self.threads = MatmulThreads(self.matmul_threads, own)

    def _matmul_threads(self, model: Any, wanted: int | None, own: int) -> int | None:
        """``wanted`` where a pass's products may move between it and the engine thread's own
        count ``own``: a CPU pass in bfloat16 or float16 (``rows_exact``; in float32 MKL splits
        a sum otherwise on another count) whose product shapes give every row the same bits on
        both counts on this CPU (:func:`~miserver.serving.engine.cpu_linear.same_bits`:
        measured equal on 1 and 2 threads, not on 6 or more for some 128-row products). Else
        None, and the products keep the engine thread's count."""
        if not wanted or not self.rows_exact or wanted == own:
            return None
        if not same_bits(product_shapes(model), dtype_of(model), (own, wanted)):
            log.warning(
                "engine: CPU_MATMUL_THREADS=%d left unused: this CPU's products round otherwise "
                "on %d threads than on %d (CPU_THREADS), and a sequence's text would then depend "
                "on the count",
                wanted,
                wanted,
                own,
            )
            return None
        return wanted

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, keep: Any, meta: PagedMetadata):
        kwargs = {ATTENTION_NAME: meta}
        self.settle_matmul_threads()
        rows = int(ids.shape[0])
        threads = self.threads.choose(rows) if self.threads is not None else None
        with (
            use_paged_attention(self.configs),
            cpu_linears(self.weight_first, self._head, threads) as products,
        ):
            out = self.model(
                input_ids=ids[None],
                position_ids=pos[None],
                use_cache=False,
                logits_to_keep=keep,
                **kwargs,
            )
        if self.threads is not None:
            self.threads.record(rows, threads, products.seconds)
        self.forward_passes += 1
        return out.logits[0]

    def run(self, batch: list[ScheduledSeq]) -> StepResult:
        """One step over ``batch`` (non-empty). The caller has made every position writable
        (blocks allocated, copies on write done). On CUDA one forward pass; on the CPU passes
        of at most :data:`MAX_ROWS` rows (:func:`_cpu_groups`; module docstring)."""
        if (
            self.graphs is not None
            and all(s.num_new == 1 and s.sample and not s.prompt_logits for s in batch)
            and self.graphs.fits(len(batch))
        ):
            self.last_graphed = True
            return StepResult(self.graphs.run([s.seq for s in batch]), {})
        self.last_graphed = False
        units = [
            _Unit(s.seq, s.seq.num_computed_tokens, s.num_new, s.sample, s.prompt_logits, s.draft)
            for s in batch
        ]
        one_pass = self.max_rows is None or self.packed_prefill
        groups = [units] if one_pass else _cpu_groups(units, self.max_rows, self.weight_first)
        sampled: dict[int, torch.Tensor] = {}
        prompt: dict[int, torch.Tensor] = {}
        for group in groups:
            self._run_group(group, sampled, prompt)
        order = [sampled[id(s.seq)] for s in batch if s.sample]
        if not order:
            return StepResult(torch.empty(0, 0), prompt)
        return StepResult(self._float_rows(order), prompt)

    def _float_rows(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """``torch.cat(parts).float()`` (``[rows, vocab]`` float32) in one conversion copy. On
        the CPU into a buffer kept from step to step (it grows to the most rows seen): a fresh
        ``[32, 49152]`` float32 tensor a step is fresh pages to fault in, and the concatenation
        a second copy (SmolLM2, 32 rows: measured 0.76 against 0.36-0.43 ms in isolation, more
        inside a step). The rows are valid until the next step (the engine samples them
        before it)."""
        rows = sum(p.shape[0] for p in parts)
        if self.device.type != "cpu":
            return torch.cat(parts).float()
        vocab = parts[0].shape[-1]
        buf = self._logits
        if buf is None or buf.shape[0] < rows or buf.shape[1] != vocab:
            buf = self._logits = torch.empty(rows, vocab, dtype=torch.float32)
        out = buf[:rows]
        at = 0
        for part in parts:
            out[at : at + part.shape[0]].copy_(part)
            at += part.shape[0]
        return out

    def _run_group(
        self,
        units: list[_Unit],
        sampled: dict[int, torch.Tensor],
        prompt: dict[int, torch.Tensor],
    ) -> None:
        """One forward pass over ``units``: fills ``sampled`` (by ``id(seq)``: the logits
        ``[1 + draft, vocab]`` of each sampling unit's last ``1 + draft`` positions) and
        ``prompt`` (echo positions)."""
        bs = self.cache.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        keep: list[int] = []
        echo: list[tuple[int, int, int]] = []  # (id(seq), first keep index, count)
        samplers: list[tuple[int, int, int]] = []  # (id(seq), keep index, rows)
        decode_rows: list[int] = []  # flattened index of each one-query row
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        device = self.device
        for unit in units:
            seq = unit.seq
            start = unit.start
            end = start + unit.num_new
            table = seq.block_table
            q_start = len(tokens)
            if unit.rows:
                # one-query rows: a decode, or a recompute's generated positions (each as its
                # decode computed it: step_scheduler, Recompute)
                for p in range(start, end):
                    decode_rows.append(len(tokens))
                    tokens.append(_token_at(seq, p))
                    positions.append(p)
                    slots.append(table[p // bs] * bs + p % bs)
                    decode_tables.append(table[: p // bs + 1])
                    decode_lens.append(p + 1)
            else:
                tokens.extend(seq.token_ids()[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                blocks = torch.tensor(table[: -(-end // bs)], dtype=torch.long, device=device)
                spans.append(SeqSpan(q_start, unit.num_new, end, blocks))
            if unit.prompt_logits:
                # prompt positions start .. min(end, n_prompt - 1) - 1 predict tokens 1 .. n-1
                last = min(end, seq.num_prompt_tokens - 1)
                if last > start:
                    echo.append((id(seq), len(keep), last - start))
                    keep.extend(range(q_start, q_start + last - start))
            if unit.sample:
                count = unit.draft + 1
                samplers.append((id(seq), len(keep), count))
                keep.extend(range(q_start + unit.num_new - count, q_start + unit.num_new))
        real = len(tokens)
        scratch = self.cache.scratch_block
        while len(tokens) < self.min_rows:  # a padding row: one query over the scratch block
            decode_rows.append(len(tokens))
            tokens.append(tokens[-1])
            positions.append(positions[-1])
            slots.append(scratch * bs + len(tokens) % bs)
            decode_tables.append([scratch])
            decode_lens.append(1)
        if not keep:
            keep.append(real - 1)
        while len(keep) < self.min_rows:
            keep.append(keep[-1])
        packs = None
        if self.packed_prefill and len(spans) > 1:
            packs, spans = pack_spans(spans, bs)
        for span in spans:  # attended alone: causal within a chunk after cached positions
            if span.q_len < span.context_len:
                ones = torch.ones(span.q_len, span.context_len, dtype=torch.bool, device=device)
                span.mask = ones.tril(span.context_len - span.q_len)
        meta = PagedMetadata(
            self.cache, torch.tensor(slots, dtype=torch.long, device=device), spans, packs
        )
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            meta.block_tables = torch.tensor(
                [t + [scratch] * (width - len(t)) for t in decode_tables],
                dtype=torch.long,
                device=device,
            )
            meta.context_lens = torch.tensor(decode_lens, dtype=torch.long, device=device)
            meta.decode_mask = decode_mask(meta.context_lens, width * bs)
            if len(decode_rows) < len(tokens):
                meta.decode_index = torch.tensor(decode_rows, dtype=torch.long, device=device)
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        keep_t = torch.tensor(keep, dtype=torch.long, device=device)
        logits = self._forward(ids, pos, keep_t, meta)
        for key, first, count in echo:
            prompt[key] = logits[first : first + count].contiguous()
        for key, index, count in samplers:
            sampled[key] = logits[index : index + count]


@dataclass
class _Unit:
    """Positions ``start .. start + num_new - 1`` of ``seq`` in one forward pass; ``rows``:
    computed as one-query rows (a decode, or a recompute's generated positions)."""

    seq: Sequence
    start: int
    num_new: int
    sample: bool
    prompt_logits: bool = False
    draft: int = 0

    @property
    def rows(self) -> bool:
        return self.num_new == 1 or self.start >= self.seq.num_prefill_tokens


def _cpu_groups(units: list[_Unit], max_rows: int, share_chunks: bool = False) -> list[list[_Unit]]:
    """The CPU's forward passes of one step, each of at most ``max_rows`` rows: the one-query
    rows in passes of at most ``max_rows`` (a sequence's rows in position order, split where a
    pass is full; only the last piece samples); a prefill chunk whole, alone in its pass, or
    (``share_chunks``, when the linear layers give a row the same bits in any pass of up to
    ``max_rows`` rows: :mod:`~miserver.serving.engine.cpu_linear`) beside other chunks and rows
    where the pass has room for all of it. A chunk of more than ``max_rows`` tokens is always
    alone. Row-for-row the arithmetic is then the same whatever else the step holds (module
    docstring)."""
    groups: list[list[_Unit]] = []
    rows: list[_Unit] = []
    room = max_rows
    for unit in units:
        if not unit.rows:
            if not share_chunks or unit.num_new > max_rows:
                groups.append([unit])
                continue
            if unit.num_new > room:
                groups.append(rows)
                rows, room = [], max_rows
            rows.append(unit)
            room -= unit.num_new
            continue
        start, left = unit.start, unit.num_new
        while left:
            if room == 0:
                groups.append(rows)
                rows, room = [], max_rows
            take = min(left, room)
            last = take == left
            piece = _Unit(unit.seq, start, take, unit.sample and last, unit.prompt_logits and last)
            if last and unit.draft:  # a draft's rows are never split (the engine sees to it)
                assert take > unit.draft, "a drafted sequence's rows were split between passes"
                piece.draft = unit.draft
            rows.append(piece)
            start, left, room = start + take, left - take, room - take
    if rows:
        groups.append(rows)
    return groups


class DecodeGraphs:
    """The decode step of ``B`` one-token sequences, one CUDA graph per (batch-size bucket,
    width bucket) (module docstring), over static buffers: ``input_ids`` / ``positions`` /
    ``slot_mapping`` ``[max_rows]``, ``block_tables`` ``[max_rows, max_blocks]``,
    ``context_lens`` ``[max_rows]``; a graph reads the first ``width`` columns of the table. A
    bucket's padding rows write the scratch block and attend one position.

    Args:
        model: the served model (never modified).
        cache: the paged cache.
        max_rows: the largest batch with a graph (a larger one runs eagerly).
        max_blocks: blocks of the longest sequence (``ceil(context / block_size)``).
        mode: ``captured``, ``compiled`` or ``eager`` (``eager``: the same fixed-shape step
            without graphs; what the CPU tests run).
    """

    def __init__(
        self, model: Any, cache: PagedKVCache, max_rows: int, max_blocks: int, mode: str
    ) -> None:
        if mode not in ("captured", "compiled", "eager"):
            raise ValueError(f"decode graph mode must be captured, compiled or eager: {mode!r}")
        register()
        self.model = model
        self.cache = cache
        self.mode = mode
        self.buckets = decode_buckets(max_rows)
        self.widths = width_buckets(max_blocks)
        self.max_blocks = max_blocks
        device = cache.device
        rows = self.buckets[-1]
        # One flat int64 buffer holds every input (ids, positions, slots, lengths: ``rows``
        # each, then the ``[rows, max_blocks]`` table), so a step's inputs reach the device in
        # one copy from one pinned host buffer of the same layout (a copy each was five
        # synchronous pageable copies a step: host time a lone sequence pays every token).
        self._flat = torch.zeros(rows * (4 + max_blocks), dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self._host = torch.zeros(self._flat.shape, dtype=torch.long, pin_memory=pin)
        self._host_np = self._host.numpy()
        self.input_ids = self._flat[:rows]
        self.positions = self._flat[rows : 2 * rows]
        self.slot_mapping = self._flat[2 * rows : 3 * rows]
        self.context_lens = self._flat[3 * rows : 4 * rows]
        self.block_tables = self._flat[4 * rows :].view(rows, max_blocks)
        self.block_tables.fill_(cache.scratch_block)
        self.context_lens.fill_(1)
        self.configs = model_configs(model)
        self._graphs: dict[tuple[int, int], Any] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._pool: Any = None
        self._forward = model
        if mode == "compiled":
            self._forward = torch.compile(model, dynamic=False)
        self.replays = 0
        #: CUDA bytes allocated across captures (the graphs' private pool: outputs and
        #: intermediates kept for replay), summed over the buckets captured.
        self.graph_bytes = 0
        self.failed: set[tuple[int, int]] = set()

    def fits(self, rows: int) -> bool:
        return rows <= self.buckets[-1]

    def bucket(self, rows: int) -> int:
        """The smallest bucket holding ``rows``."""
        for size in self.buckets:
            if rows <= size:
                return size
        raise ValueError(f"{rows} rows exceed the largest decode bucket {self.buckets[-1]}")

    def width(self, seqs: list[Sequence]) -> int:
        """The narrowest width bucket holding every one of ``seqs``' blocks after this step."""
        bs = self.cache.block_size
        need = max((-(-(s.num_computed_tokens + 1) // bs) for s in seqs), default=1)
        for width in self.widths:
            if need <= width:
                return width
        raise ValueError(f"a sequence needs {need} blocks, more than {self.max_blocks}")

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The (rows, width) buckets captured so far, sorted."""
        return sorted(self._graphs)

    def summary(self) -> dict[str, Any]:
        """``{mode, captured: [[rows, width], ...], failed, replays, bytes}`` (``bytes``: CUDA
        memory allocated by the captures, :attr:`graph_bytes`)."""
        return {
            "mode": self.mode,
            "captured": [list(k) for k in self.captured],
            "failed": [list(k) for k in sorted(self.failed)],
            "replays": self.replays,
            "bytes": self.graph_bytes,
        }

    def _step(self, key: tuple[int, int]) -> torch.Tensor:
        rows, width = key
        lens = self.context_lens[:rows]
        meta = PagedMetadata(
            self.cache,
            self.slot_mapping[:rows],
            block_tables=self.block_tables[:rows, :width],
            context_lens=lens,
            # once a step, not once a layer (fewer kernels in the graph)
            decode_mask=decode_mask(lens, width * self.cache.block_size),
        )
        kwargs = {ATTENTION_NAME: meta}
        with use_paged_attention(self.configs):
            out = self._forward(
                input_ids=self.input_ids[:rows][None],
                position_ids=self.positions[:rows][None],
                use_cache=False,
                **kwargs,
            )
        return out.logits[0]

    def fill(self, seqs: list[Sequence], rows: int) -> None:
        """Write ``seqs``' next step into the static buffers (one host-to-device copy); rows
        past them are padding (token 0 at position 0, writing the scratch block, attending one
        position)."""
        bs = self.cache.block_size
        scratch = self.cache.scratch_block
        n = len(seqs)
        cap = self.buckets[-1]
        host = self._host_np
        table = host[4 * cap : 4 * cap + rows * self.max_blocks].reshape(rows, self.max_blocks)
        table.fill(scratch)
        for r, seq in enumerate(seqs):
            p = seq.num_computed_tokens
            host[r] = _token_at(seq, p)
            host[cap + r] = p
            host[2 * cap + r] = seq.block_table[p // bs] * bs + p % bs
            host[3 * cap + r] = p + 1
            used = seq.block_table[: -(-(p + 1) // bs)]
            table[r, : len(used)] = used
        for r in range(n, rows):
            host[r] = 0
            host[cap + r] = 0
            host[2 * cap + r] = scratch * bs + r % bs
            host[3 * cap + r] = 1
        end = 4 * cap + rows * self.max_blocks
        self._flat[:end].copy_(self._host[:end], non_blocking=True)

    def _capture(self, key: tuple[int, int]) -> None:
        from miserver.serving.engine.devices import warmup_stream

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        device = self.input_ids.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        # one warm-up stream per device: cuBLAS keeps a workspace per stream it ran on
        # (docs/benchmarks.md, the swap's memory finding)
        stream = warmup_stream(self.input_ids.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3 if self.mode == "compiled" else 2):
                self._step(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._outputs[key] = self._step(key).float()  # the float32 read, in the graph
        self._graphs[key] = graph
        torch.cuda.synchronize(device)
        self.graph_bytes += max(0, torch.cuda.memory_allocated(device) - before)

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits ``[len(seqs), vocab]`` float32 of one decode step of ``seqs``."""
        key = (self.bucket(len(seqs)), self.width(seqs))
        rows = key[0]
        self.fill(seqs, rows)
        if self.mode == "eager" or key in self.failed:
            return self._step(key)[: len(seqs)].float()
        if key not in self._graphs:
            try:
                self.fill([], rows)  # capture over padding: writes the scratch block only
                self._capture(key)
            except Exception as exc:  # noqa: BLE001 - that bucket runs eagerly from now on
                log.warning(
                    "decode graph of %d rows x %d blocks failed: %s: %s",
                    *key,
                    type(exc).__name__,
                    exc,
                )
                self.failed.add(key)
            self.fill(seqs, rows)
            if key in self.failed:
                return self._step(key)[: len(seqs)].float()
        self._graphs[key].replay()
        self.replays += 1
        return self._outputs[key][: len(seqs)]

    def drop(self) -> None:
        """Forget every captured graph (an adapter change, a reload: the modules that compute
        changed); the next use recaptures."""
        self._graphs.clear()
        self._outputs.clear()
        self.failed.clear()
        self.graph_bytes = 0
