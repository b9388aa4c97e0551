"""The decoders a static batch's decode loop (:mod:`miserver.serving.engine.generation`) runs
its forward passes through: the resident's decode engine when it is free (a lone sequence: its
one-sequence graphs; a batch that fits the batch cache: the batched graphs,
:mod:`miserver.serving.engine.decode_graphs`), else the eager batched decoder
(:class:`~miserver.serving.engine.static_batch.BatchDecoder`); and the forward argument that
takes the KV cache (:func:`cache_kwarg`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch


def cache_kwarg(model: Any) -> str:
    """The forward argument that takes the KV cache: ``cache`` (transformers >= 5.2x) or
    ``past_key_values``. Wrappers (PEFT) are looked through to the first module that names one.
    """
    import inspect

    modules = model.modules() if isinstance(model, torch.nn.Module) else iter((model,))
    for module in modules:
        try:
            names = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        for name in ("cache", "past_key_values"):
            if name in names:
                return name
    return "past_key_values"


@contextlib.contextmanager
def _decoder(gens: list[Any]) -> Any:
    """The resident's decode engine when it is free (a lone sequence: its one-sequence graphs;
    a static batch that fits its batch cache: the batched graphs), else the eager (batched)
    decoder."""
    first = gens[0]
    model = first.model
    if len(gens) == 1 and first.engine is not None:
        with first.engine.session(model) as session:
            if session is not None:
                yield _Rows(_GraphDecoder(session))
                return
    elif first.engine is not None and getattr(first.engine, "batch_rows", 0) >= 2:
        # left padding: every row's keys end at the longest prompt's length
        need = max(len(g.prompt_ids) for g in gens) + max(g.params.max_tokens for g in gens)
        with first.engine.batch_session(model, len(gens), need) as batch:
            if batch is not None:
                leads = {id(g._prefill_group or g): g for g in gens}
                batch.expect(
                    [
                        g.prompt_ids
                        for g in leads.values()
                        if not (g.params.echo and g.params.logprobs is not None)
                    ]
                )
                yield batch
                return
    from miserver.serving.engine.static_batch import BatchDecoder

    device = next(model.parameters()).device
    yield BatchDecoder(model, device, cache_kwarg(model))


# --- decoders ---------------------------------------------------------------------------------
class _EagerDecoder:
    """The eager decode of one sequence, as the server runs it (a :class:`BatchDecoder` of
    one row): ``prefill(ids)`` then ``step(token)``, each returning logits."""

    kind = "eager"
    full = False

    def __init__(self, model: Any, device: torch.device) -> None:
        from miserver.serving.engine.static_batch import BatchDecoder

        self._batch = BatchDecoder(model, device, cache_kwarg(model))

    def prefill(self, prompt_ids: Sequence[int], *, all_logits: bool) -> torch.Tensor:
        """Logits ``[n, vocab]`` (``all_logits``) or ``[1, vocab]`` of the prompt."""
        logits = self._batch.prefill(prompt_ids, all_logits=all_logits)
        self._batch.begin([0])
        return logits

    def step(self, token: int) -> torch.Tensor:
        """The next position's logits, float32 ``[vocab]``."""
        return self._batch.step([token])[0]


class _Rows:
    """A one-sequence decoder (``prefill``, ``step(token)``, ``full``) as the batch loop uses
    it: one row."""

    def __init__(self, decoder: Any) -> None:
        self._d = decoder
        self.kind = decoder.kind

    def prefill(self, prompt_ids: Sequence[int], *, all_logits: bool) -> torch.Tensor:
        return self._d.prefill(prompt_ids, all_logits=all_logits)

    def begin(self, sources: Sequence[int]) -> None:
        if list(sources) != [0]:
            raise ValueError("a one-sequence decoder decodes one row")

    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        return self._d.step(tokens[0])[None]

    def keep(self, rows: Sequence[int]) -> None:
        if list(rows) not in ([], [0]):
            raise ValueError("a one-sequence decoder decodes one row")

    def full(self, row: int) -> bool:
        return bool(self._d.full)


class _GraphDecoder:
    """The decode engine's session: eager prefill into the static cache, replayed steps."""

    def __init__(self, session: Any) -> None:
        self._s = session
        self.kind = f"graphs:{session._e.mode}"

    @property
    def full(self) -> bool:
        """The static cache holds the whole context: no further position fits."""
        return self._s.position >= self._s.capacity

    def prefill(self, prompt_ids: Sequence[int], *, all_logits: bool) -> torch.Tensor:
        return self._s.prefill(prompt_ids, all_logits=all_logits)

    def step(self, token: int) -> torch.Tensor:
        return self._s.step(token)
