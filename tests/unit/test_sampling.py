"""How tokens are picked (contract 4; :mod:`miserver.serving.engine.sampling`): a batch's rows
sampled at once (:func:`pick_tokens`, the continuous engine's sampler on CUDA) pick what each
row picks alone (:func:`pick_token`, its path on the CPU)."""

from __future__ import annotations

import torch

from miserver.serving.engine.sampling import (
    NonFiniteLogits,
    SamplingParams,
    SeedStream,
    pick_token,
    pick_tokens,
)


def test_pick_tokens_samples_every_row_as_pick_token_does() -> None:
    """Random logits, rows of every kind (greedy, temperatures, top-p cut or not, seeded draws,
    a non-finite row): each seeded or greedy row gets exactly ``pick_token``'s token with the
    same seed; an unseeded row a token inside its top-p set."""
    g = torch.Generator().manual_seed(0)
    kinds = [(t, p) for t in (0.0, 0.3, 1.0, 1.7) for p in (1.0, 0.9, 0.2)]
    for trial in range(6):
        rows = len(kinds) + 2
        logits = torch.randn((rows, 3000), generator=g) * (1 + trial)
        logits[-1, 7] = float("nan")
        params = [SamplingParams(max_tokens=4, temperature=t, top_p=p) for t, p in kinds]
        params += [SamplingParams(max_tokens=4, temperature=1.0, top_p=0.5)]  # unseeded
        params += [SamplingParams(max_tokens=4, temperature=0.7)]  # the NaN row
        seeds = [1000 * trial + r for r in range(rows)]
        gens = [
            SeedStream(s) if q.temperature > 0 else None for s, q in zip(seeds, params, strict=True)
        ]
        gens[-2] = None
        batched = pick_tokens(logits, params, gens)
        for r in range(len(kinds)):
            stream = SeedStream(seeds[r]) if params[r].temperature > 0 else None
            assert batched[r] == pick_token(logits[r], params[r], stream), (trial, kinds[r])
        probs = torch.softmax(logits[-2].double(), -1)
        ranked = torch.sort(probs, descending=True)
        keep = ranked.indices[(torch.cumsum(ranked.values, 0) - ranked.values) < 0.5]
        assert batched[-2] in keep.tolist()
        assert isinstance(batched[-1], NonFiniteLogits)
