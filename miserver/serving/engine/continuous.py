"""The continuous engine: sequences join and leave the running batch at every step (issue 29).

:class:`ContinuousEngine` owns one resident model's paged KV cache
(:mod:`~miserver.serving.engine.kv_cache`, allocated once from ``cache_budget_bytes``), its block
manager, its step scheduler and its model runner. Another thread may :meth:`~ContinuousEngine.add`
and :meth:`~ContinuousEngine.abort` sequences at any time; one engine thread calls
:meth:`~ContinuousEngine.step` while :meth:`~ContinuousEngine.has_work`: each step admits
waiting sequences (chunked prefill), decodes one token for every running sequence, and returns
each sequence's new tokens as :class:`~miserver.serving.engine.sequence.SequenceOutput` s. A
sequence that ends leaves at once; its blocks serve the next step.

The ``n`` choices of one request (one ``group``) prefill the prompt once: the first admitted
computes it, the others fork from it when it is done (sharing its blocks, copy on write) and
take their first token from the same logits (each with its own seed). ``stats()["prefills"]``
counts prompt prefills (a fork is not one; a recompute after preemption counts in
``recomputes``).

The barrier (ENGINE_API.md): :meth:`~ContinuousEngine.close_admission` makes the next step
admit no new sequence (running ones go on: the drain); :meth:`~ContinuousEngine.preempt_all`
parks every running sequence (their tokens kept; they re-prefill once admission opens);
:meth:`~ContinuousEngine.drop_prefix_cache` forgets every cached block (``DROP_CACHE``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import torch

from miserver.serving.engine import speculation
from miserver.serving.engine.block_manager import BlockManager
from miserver.serving.engine.devices import dtype_of
from miserver.serving.engine.kv_cache import PagedKVCache, blocks_for_budget, cache_shape
from miserver.serving.engine.model_runner import DecodeGraphs, ModelRunner, ScheduledSeq
from miserver.serving.engine.sampler import prompt_logprobs, sample
from miserver.serving.engine.sequence import Sequence, SequenceOutput, SequenceStatus
from miserver.serving.engine.step_scheduler import SchedulerConfig, StepScheduler

log = logging.getLogger("miserver.engine")

#: Default positions a KV block holds.
DEFAULT_BLOCK_SIZE = 16


def _device_of(model: Any) -> torch.device:
    return next(model.parameters()).device


def _context_length(model: Any) -> int:
    from miserver.serving.engine.generation import context_length

    return context_length(model)


class ContinuousEngine:
    """One resident's continuous engine (module docstring).

    Args:
        model: the served transformers causal LM (eval mode); used as is, never modified.
        cache_budget_bytes: bytes for the paged KV cache (blocks = budget // block bytes, one
            of them kept as scratch).
        block_size: positions per block.
        max_num_seqs, max_num_batched_tokens, prefill_chunk: :class:`SchedulerConfig`.
        decode_graphs: ``captured`` / ``compiled`` (CUDA: decode steps replay graphs per batch
            bucket), ``eager`` (the fixed-shape decode path without graphs), ``off``.
        max_model_len: the longest sequence (prompt + generated); the model's context if None.
        prefix_cache: take blocks from the cross-request prefix cache at admission
            (:class:`SchedulerConfig`; the server turns it off on the CPU).
        packed_prefill: :class:`ModelRunner`'s (None: on CUDA only).
        speculative_tokens: the most draft tokens a greedy sequence gets a step
            (:mod:`~miserver.serving.engine.speculation`); 0: none; None:
            :data:`~miserver.serving.engine.speculation.DRAFT_TOKENS`. Always 0 unless the
            runner's rows are bit-identical across pass sizes (``ModelRunner.rows_exact``: the
            CPU, bfloat16 or float16), so a greedy answer never depends on speculation.
        matmul_threads: :class:`ModelRunner`'s (``CPU_MATMUL_THREADS``; None: the engine
            thread's own count).
        cpu_threads: the count the engine thread computes on (``CPU_THREADS``, the products'
            other count); None: the constructing thread's.

    Raises:
        ValueError: the budget holds fewer than two blocks, or a limit is invalid.
    """

    def __init__(
        self,
        model: Any,
        cache_budget_bytes: int,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        prefill_chunk: int = 256,
        decode_graphs: str = "off",
        max_model_len: int | None = None,
        prefix_cache: bool = True,
        packed_prefill: bool | None = None,
        speculative_tokens: int | None = None,
        matmul_threads: int | None = None,
        cpu_threads: int | None = None,
    ) -> None:
        shape = cache_shape(model)
        total = blocks_for_budget(cache_budget_bytes, shape, block_size)
        if total < 2:
            raise ValueError(
                f"cache_budget_bytes={cache_budget_bytes} holds {total} KV blocks of "
                f"{block_size} positions ({shape.bytes_per_token * block_size} bytes each); "
                "at least 2 are needed: raise the budget"
            )
        self.model = model
        self.device = _device_of(model)
        self.max_model_len = max_model_len or _context_length(model)
        self.cache = PagedKVCache(shape, total - 1, block_size, self.device)
        self.blocks = BlockManager(total - 1, block_size)
        self.scheduler = StepScheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, prefill_chunk, prefix_cache),
            self.blocks,
        )
        graphs = None
        if decode_graphs != "off":
            max_blocks = -(-self.max_model_len // block_size)
            graphs = DecodeGraphs(model, self.cache, max_num_seqs, max_blocks, decode_graphs)
        self.runner = ModelRunner(
            model,
            self.cache,
            graphs,
            packed_prefill,
            matmul_threads=matmul_threads,
            own_threads=cpu_threads,
        )
        if speculative_tokens is None:
            speculative_tokens = speculation.DRAFT_TOKENS
        if speculative_tokens < 0:
            raise ValueError("speculative_tokens must be >= 0")
        if not self.runner.rows_exact:
            # only where a drafted step's rows have the bits of plain decodes (the CPU, in
            # bfloat16 or float16): elsewhere speculation could change a greedy answer
            if speculative_tokens:
                log.info(
                    "engine: no speculation for this model (%s, %s): its rows are not "
                    "bit-identical across pass sizes",
                    self.device.type,
                    dtype_of(model),
                )
            speculative_tokens = 0
        self.speculative_tokens = speculative_tokens
        #: this step's drafted sequences: id(seq) -> (seq, draft tokens appended)
        self._drafts: dict[int, tuple[Sequence, int]] = {}
        self._lock = threading.Lock()
        self._pending: list[Sequence] = []
        self._aborts: dict[Any, str] = {}
        self._live: dict[Any, Sequence] = {}
        self._open = True
        self._prompt_parts: dict[int, list[torch.Tensor]] = {}
        #: the most sequences one step computed (the batch's peak, for the health route).
        self.peak_batch = 0
        #: per step kind (``graph``, ``eager``): [steps, total seconds] (:meth:`step_summary`).
        self.step_times: dict[str, list[float]] = {"graph": [0, 0.0], "eager": [0, 0.0]}
        self.slowest_step_s = 0.0
        self.counters = {
            "prefills": 0,
            "recomputes": 0,
            "forks": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "steps": 0,
            "draft_tokens": 0,
            "accepted_draft_tokens": 0,
        }

    # --- any thread ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` for admission at the next step (thread-safe).

        Raises:
            ValueError: its prompt leaves no room to generate within ``max_model_len``, or its
                id is already live.
        """
        if seq.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {seq.num_prompt_tokens} tokens; the engine's context is "
                f"{self.max_model_len}"
            )
        with self._lock:
            if seq.seq_id in self._live:
                raise ValueError(f"sequence {seq.seq_id!r} is already in the engine")
            self._live[seq.seq_id] = seq
            self._pending.append(seq)

    def abort(self, seq_id: Any, reason: str = "cancelled") -> None:
        """End ``seq_id`` at the next step with ``finish_reason`` ``reason`` (thread-safe; an
        unknown or finished id is ignored)."""
        with self._lock:
            if seq_id in self._live:
                self._aborts[seq_id] = reason

    def close_admission(self) -> None:
        """From the next step on, admit no new sequence (running ones go on)."""
        with self._lock:
            self._open = False

    def open_admission(self) -> None:
        with self._lock:
            self._open = True

    def has_work(self) -> bool:
        """Whether :meth:`step` has anything to do."""
        with self._lock:
            if self._pending or self._aborts:
                return True
            self.scheduler.admission_open = self._open
        return self.scheduler.has_work()

    # --- the engine thread --------------------------------------------------------------------
    def preempt_all(self) -> int:
        """Park every running sequence: free its blocks, keep its tokens; it re-prefills when
        admitted again (engine thread, between steps). Returns how many were parked."""
        return self.scheduler.preempt_all()

    def drop_prefix_cache(self) -> int:
        """Forget every prefix-cache key (``DROP_CACHE``); returns how many blocks were keyed."""
        return self.blocks.drop_prefix_cache()

    def drop_graphs(self) -> None:
        """Forget the captured decode graphs (an adapter change, a reload: the modules that
        compute changed; a commit does not need this, the storages never move)."""
        if self.runner.graphs is not None:
            self.runner.graphs.drop()

    def close(self) -> list[Any]:
        """End every sequence (the resident is going away) and let go of the cache tensors;
        returns the ids of the sequences that were still live. The engine is unusable after."""
        with self._lock:
            live = list(self._live)
            self._live.clear()
            self._pending.clear()
            self._aborts.clear()
            self._open = False
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = seq.finish_reason or "cancelled"
        self.drop_graphs()
        self.cache.keys.clear()
        self.cache.values.clear()
        return live

    def stats(self) -> dict[str, Any]:
        """Counts: ``blocks_total``, ``blocks_free``, ``block_size``, ``cache_bytes``,
        ``running``, ``waiting``, ``prefix_cache_hits`` (blocks taken from the cache),
        ``prefix_cached_blocks``, ``prefills``, ``recomputes``, ``forks``, ``preemptions``,
        ``prefill_tokens``, ``decode_tokens``, ``steps``, ``draft_tokens`` and
        ``accepted_draft_tokens`` (speculation), ``forward_passes``, ``peak_batch`` (the
        most sequences one step computed), ``step_times`` (:meth:`step_summary`), with
        decode graphs ``decode_graphs`` (:meth:`DecodeGraphs.summary`), and on a CPU resident
        with ``matmul_threads`` ``matmul_threads``
        (:meth:`~miserver.serving.engine.cpu_linear.MatmulThreads.summary`)."""
        with self._lock:
            pending = len(self._pending)
        graphs = self.runner.graphs
        return {
            "peak_batch": self.peak_batch,
            "step_times": self.step_summary(),
            **({"decode_graphs": graphs.summary()} if graphs is not None else {}),
            **(
                {"matmul_threads": self.runner.threads.summary()}
                if self.runner.threads is not None
                else {}
            ),
            "blocks_total": self.blocks.num_blocks,
            "blocks_free": self.blocks.num_free_blocks,
            "block_size": self.blocks.block_size,
            "cache_bytes": self.cache.bytes,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + pending,
            "prefix_cache_hits": self.blocks.prefix_hits,
            "prefix_cached_blocks": self.blocks.cached_blocks,
            "preemptions": self.scheduler.preemptions,
            "forward_passes": self.runner.forward_passes,
            **self.counters,
        }

    def _intake(self, outputs: list[SequenceOutput]) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            aborts, self._aborts = self._aborts, {}
            self.scheduler.admission_open = self._open
        for seq in pending:
            self.scheduler.add(seq)
        for seq_id, reason in aborts.items():
            seq = self._live.get(seq_id)
            if seq is None or seq.is_finished:
                continue
            self._finish(seq, reason, outputs)

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        outputs: list[SequenceOutput] | None,
        out: SequenceOutput | None = None,
        error: BaseException | None = None,
    ) -> None:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._prompt_parts.pop(id(seq), None)
        with self._lock:
            self._live.pop(seq.seq_id, None)
        if out is None:
            out = SequenceOutput(seq.seq_id)
            assert outputs is not None
            outputs.append(out)
        out.finished = True
        out.finish_reason = reason
        out.error = error

    def step(self) -> list[SequenceOutput]:
        """One scheduler step and (when there is work) one forward pass; the outputs of every
        sequence that got a token or ended."""
        outputs: list[SequenceOutput] = []
        self._intake(outputs)
        batch, copies = self.scheduler.schedule()
        if self.speculative_tokens:
            copies += self._draft(batch)
        for seq in self.scheduler.overlong:
            log.warning(
                "engine: sequence %s ends (length): its %d tokens need more than the KV "
                "cache's %d blocks of %d positions (raise KV_CACHE_BYTES)",
                seq.seq_id,
                seq.num_tokens,
                self.blocks.num_blocks,
                self.blocks.block_size,
            )
            self._finish(seq, "length", outputs)
        self.scheduler.overlong.clear()
        if not batch:
            return outputs
        self.counters["steps"] += 1
        self.peak_batch = max(self.peak_batch, len(batch))
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                self.cache.copy_blocks(copies)
                result = self.runner.run(batch)
        except Exception as exc:  # noqa: BLE001 - the step's sequences fail; the engine goes on
            log.warning("engine step failed: %s: %s", type(exc).__name__, exc)
            self._drop_drafts()
            for item in batch:
                self._finish(item.seq, "error", outputs, error=exc)
            return outputs
        try:
            self._after(batch, result, outputs)
        finally:
            self._drop_drafts()  # any left unverified (an error while settling the step)
        self._time_step(time.perf_counter() - t0)
        return outputs

    def _drop_drafts(self) -> None:
        """Take every unsettled draft off its sequence (never reported as its tokens)."""
        for seq, k in self._drafts.values():
            del seq.output_token_ids[-k:]
        self._drafts.clear()

    def _draft(self, batch: list[ScheduledSeq]) -> list[tuple[int, int]]:
        """Give the greedy sequences of a step of decodes alone, with at most
        ``speculation.MAX_SEQS`` sequences and nothing waiting, draft tokens
        (:mod:`~miserver.serving.engine.speculation`): each drafted sequence's item in
        ``batch`` then computes its last token and its drafts, on blocks taken from the free
        ones (never by preemption: a sequence the free blocks cannot extend gets no drafts).
        Returns the block copies (copy on write) the extension needs. :meth:`_verify` settles
        the drafts after the forward."""
        if len(batch) > speculation.MAX_SEQS or self.scheduler.waiting:
            return []
        if any(item.num_new != 1 or not item.sample for item in batch):
            return []  # a prefill or a recompute shares the step
        config = self.scheduler.config
        room = min(config.max_num_batched_tokens, self.runner.max_rows or config.prefill_chunk)
        rows = len(batch)
        alone = rows == 1
        most = self.speculative_tokens
        if alone:  # its extra rows are nearly free
            most *= 2
        ngram_min = speculation.NGRAM_MIN_ALONE if alone else speculation.NGRAM_MIN
        copies: list[tuple[int, int]] = []
        for index, item in enumerate(batch):
            seq = item.seq
            if not speculation.eligible(seq):
                continue
            limit = min(
                most,
                seq.params.max_tokens - len(seq.output_token_ids) - 1,
                self.max_model_len - seq.num_tokens - 1,
                config.prefill_chunk - 1,
                room - rows,
            )
            draft = speculation.propose(seq.token_ids(), limit, ngram_min=ngram_min)
            while draft:
                target = seq.num_tokens + len(draft)
                if self.blocks.append_cost(seq, target) <= self.blocks.num_free_blocks:
                    break
                draft.pop()
            if not draft:
                continue
            seq.output_token_ids.extend(draft)
            copies += self.blocks.prepare_append(seq, seq.num_tokens)
            self._drafts[id(seq)] = (seq, len(draft))
            batch[index] = dataclasses.replace(item, num_new=1 + len(draft), draft=len(draft))
            rows += len(draft)
        return copies

    def _verify(
        self, item: ScheduledSeq, logits: torch.Tensor, row: int, outputs: list[SequenceOutput]
    ) -> int:
        """Keep the drafts of ``item`` the model agrees with (greedy), append the next token,
        end the sequence as a decode would (stop token, ``max_tokens``, context); returns the
        next row of ``logits``."""
        seq, k = item.seq, item.draft
        del self._drafts[id(seq)]
        before = seq.num_computed_tokens
        drafts = seq.output_token_ids[-k:]
        del seq.output_token_ids[-k:]
        out = SequenceOutput(seq.seq_id)
        outputs.append(out)
        self.counters["draft_tokens"] += k
        reason, error = None, None
        for j in range(k + 1):
            picked = sample([seq], logits[row + j : row + j + 1])[0]  # the sampler's argmax
            if picked.error is not None:
                if j == 0:
                    reason, error = "error", picked.error
                # a later row: its position is decoded plainly next step (and fails there,
                # after the tokens kept so far reach the client, as without speculation)
                break
            token = picked.token
            assert token is not None
            seq.output_token_ids.append(token)
            out.new_token_ids.append(token)
            self.counters["decode_tokens"] += 1
            if token in seq.stop_token_ids:
                reason = "stop"
            elif (
                len(seq.output_token_ids) >= seq.params.max_tokens
                or seq.num_tokens >= self.max_model_len
            ):
                reason = "length"
            if reason is not None or j == k or token != drafts[j]:
                break
        # the rows up to the last token produced were computed from the right tokens
        # (the last real token, then the drafts equal to the tokens produced after it)
        produced = len(out.new_token_ids)
        self.counters["accepted_draft_tokens"] += max(0, produced - 1)
        seq.num_computed_tokens = before + produced
        self.blocks.register_full_blocks(seq)
        if reason is not None:
            self._finish(seq, reason, None, out, error)
        return row + k + 1

    def _time_step(self, seconds: float) -> None:
        kind = "graph" if self.runner.last_graphed else "eager"
        times = self.step_times[kind]
        times[0] += 1
        times[1] += seconds
        self.slowest_step_s = max(self.slowest_step_s, seconds)

    def step_summary(self) -> dict[str, Any]:
        """Where the engine's time went: ``{graph: {steps, ms}, eager: {steps, ms},
        slowest_ms}``: steps that replayed a decode graph and the others (prefill chunks, mixed
        steps, a batch past the largest bucket, the CPU), each with its total wall ms from the
        forward's launch to the sampled tokens (the sampling reads them, so this includes the
        device's time), and the slowest step."""
        return {
            **{
                kind: {"steps": n, "ms": round(total * 1000, 1)}
                for kind, (n, total) in self.step_times.items()
            },
            "slowest_ms": round(self.slowest_step_s * 1000, 2),
        }

    def _after(self, batch: list[ScheduledSeq], result: Any, outputs: list[SequenceOutput]) -> None:
        row = 0
        to_sample: list[tuple[Sequence, int, SequenceOutput]] = []
        for item in batch:
            seq = item.seq
            if item.draft:
                row = self._verify(item, result.logits, row, outputs)
                continue
            before = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_new
            if item.num_new > 1 or before < seq.num_prompt_tokens:
                self.counters["prefill_tokens"] += item.num_new
            else:
                self.counters["decode_tokens"] += 1
            self.blocks.register_full_blocks(seq)
            out = SequenceOutput(seq.seq_id)
            part = result.prompt_logits.get(id(seq))
            if part is not None:
                self._prompt_parts.setdefault(id(seq), []).append(part)
            if (
                seq.wants_prompt_logprobs
                and not seq.prompt_logprobs_done
                and seq.num_computed_tokens >= seq.num_prompt_tokens
            ):
                parts = self._prompt_parts.pop(id(seq), [])
                logits = torch.cat(parts) if parts else torch.empty(0)
                out.prompt_logprobs = prompt_logprobs(
                    logits, seq.prompt_token_ids, seq.params.logprobs or 0
                )
                seq.prompt_logprobs_done = True
            if not item.sample:
                if out.prompt_logprobs is not None:
                    outputs.append(out)
                continue
            if not seq.output_token_ids:
                out.first = True
                self.counters["prefills"] += 1
            elif before < seq.num_tokens - 1:
                self.counters["recomputes"] += 1
            to_sample.append((seq, row, out))
            if out.first and seq.group is not None:
                for sib in self._fork_siblings(seq):
                    sib_out = SequenceOutput(sib.seq_id, first=True)
                    sib_out.prompt_logprobs = out.prompt_logprobs
                    if sib.wants_prompt_logprobs:
                        sib.prompt_logprobs_done = True
                    to_sample.append((sib, row, sib_out))
            row += 1
        if not to_sample:
            return
        seqs = [s for s, _, _ in to_sample]
        picks = [r for _, r, _ in to_sample]
        if picks == list(range(len(result.logits))):
            rows = result.logits  # every row once, in order (no siblings forked this step)
        else:
            rows = result.logits.index_select(0, torch.tensor(picks, device=result.logits.device))
        for (seq, _, out), picked in zip(to_sample, sample(seqs, rows), strict=True):
            outputs.append(out)
            if picked.error is not None:
                self._finish(seq, "error", None, out, picked.error)
                continue
            token = picked.token
            assert token is not None
            seq.output_token_ids.append(token)
            out.new_token_ids.append(token)
            if picked.logprob is not None:
                out.logprobs = [picked.logprob]
            if token in seq.stop_token_ids or picked.terminated:
                self._finish(seq, "stop", None, out)
            elif (
                len(seq.output_token_ids) >= seq.params.max_tokens
                or seq.num_tokens >= self.max_model_len
            ):
                self._finish(seq, "length", None, out)

    def _fork_siblings(self, leader: Sequence) -> list[Sequence]:
        """The waiting, never-started siblings of ``leader`` (its prompt just computed), forked
        onto its blocks, as many as ``max_num_seqs`` allows; the rest are admitted later (the
        prefix cache gives them the prompt's full blocks)."""
        room = self.scheduler.config.max_num_seqs - len(self.scheduler.running)
        forked: list[Sequence] = []
        for sib in list(self.scheduler.waiting):
            if room <= 0:
                break
            if sib.group is not leader.group or sib.output_token_ids or sib.block_table:
                continue
            if sib.prompt_token_ids != leader.prompt_token_ids:
                continue
            self.blocks.fork(leader, sib)
            self.scheduler.waiting.remove(sib)
            sib.status = SequenceStatus.RUNNING
            self.scheduler.running.append(sib)
            self.counters["forks"] += 1
            forked.append(sib)
            room -= 1
        return forked
