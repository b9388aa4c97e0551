"""Per-token decode time by thread: why miserver's generations run on reused worker threads.

On the H200 (2026-11-30) the same KV-cache decode loop took 17-19 ms a token in the main thread
and 57-67 ms in a freshly started thread, for that thread's whole first generation; a reused
thread ran at main-thread speed. miserver used to start a thread per request, which made every
answer about three times slower than ``transformers`` ``generate`` on that machine; generations
now run on reused worker threads (``miserver.serving.generation``). This script measures it all
in one run, side by side:

- ``transformers generate``: ``model.generate`` in the main thread (greedy, a fixed count);
- ``decode loop, main thread``: prefill, then one token a step with the KV cache;
- ``decode loop, fresh thread``: the same loop in a thread started for it (the old way);
- ``miserver Generation #k``: :class:`miserver.serving.generation.Generation` in an asyncio loop,
  k-th generation in a row (the worker threads are reused, so #1 pays the new-thread cost once).

The model is SmolLM2-135M-shaped (the embedded default's architecture) with random bfloat16
weights, so no download or import is needed; the tokenizer is a stand-in that names token ids
(the decode loop, not text, is measured). Medians of ``--repeats`` runs, ms a token::

    python benchmarks/generation_threads.py [--device auto] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class NamingTokenizer:
    """Decodes ids to ``t<id>`` words; no end-of-sequence token (every run makes its count)."""

    eos_token_id = None

    def decode(self, ids: list[int], **_: object) -> str:
        return " ".join(f"t{i}" for i in ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto (cuda:0 when there is one), cpu, cuda:N")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (30: SmolLM2-135M)")
    args = ap.parse_args()

    import torch
    import transformers

    from miserver.serving.generation import Generation, SamplingParams

    device = args.device
    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    cfg = transformers.LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=args.layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval().to(device)
    prompt = torch.randint(0, 49000, (1, 40), device=device)
    n = args.tokens

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    def generate() -> None:
        with torch.inference_mode():
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )

    def loop() -> None:
        with torch.inference_mode():
            out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            past, logits = out.past_key_values, out.logits[0, -1].float()
            for _ in range(n - 1):
                token = int(torch.argmax(logits))
                step = model(
                    input_ids=torch.tensor([[token]], device=device),
                    use_cache=True,
                    past_key_values=past,
                )
                past, logits = step.past_key_values, step.logits[0, -1].float()

    def fresh_thread() -> None:
        t = threading.Thread(target=loop)
        t.start()
        t.join()

    async def one_generation() -> None:
        gen = Generation(
            model,
            NamingTokenizer(),
            prompt[0].tolist(),
            SamplingParams(max_tokens=n, temperature=0),
        )
        gen.start()
        async for _ in gen.events():
            pass
        await gen.wait()

    def per_token(fn: Callable[[], None]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) / n * 1000.0

    rows: dict[str, list[float]] = {}
    generate()  # warm-up in the main thread: the process's first CUDA work is not measured
    # miserver's first generation starts its worker thread; the later ones reuse it.
    gens = [per_token(lambda: asyncio.run(one_generation())) for _ in range(args.repeats + 1)]
    rows["miserver Generation #1 (its worker thread is new)"] = gens[:1]
    rows[f"miserver Generation #2..#{len(gens)} (reused)"] = gens[1:]
    for name, fn in (
        ("transformers generate", generate),
        ("decode loop, main thread", loop),
        ("decode loop, fresh thread each run", fresh_thread),
    ):
        rows[name] = [per_token(fn) for _ in range(args.repeats)]

    base = statistics.median(rows["transformers generate"])
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    print(
        f"{where}, torch {torch.__version__}, SmolLM2-135M shape ({args.layers} layers), random "
        f"bf16 weights, {n} tokens a run, median of {args.repeats}\n"
    )
    print("| path | ms / token | vs generate |")
    print("|---|---:|---:|")
    for name, xs in rows.items():
        m = statistics.median(xs)
        print(f"| {name} | {m:.2f} | {m / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
