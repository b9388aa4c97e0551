"""Per-token decode time by thread: why miserver's engine runs on one long-lived thread.

On the H200 (2026-11-30) the same KV-cache decode loop took 17-19 ms a token in the main thread
and 57-67 ms in a freshly started thread, for that thread's whole first generation; a reused
thread ran at main-thread speed. miserver used to start a thread per request, which made every
answer about three times slower than ``transformers`` ``generate`` on that machine; every
sequence now runs on its resident's continuous engine, whose one thread lives as long as the
resident (``miserver.serving.engine.engine_loop``). This script measures it all in one run,
side by side:

- ``transformers generate``: ``model.generate`` in the main thread (greedy, a fixed count);
- ``decode loop, main thread``: prefill, then one token a step with the KV cache;
- ``decode loop, fresh thread``: the same loop in a thread started for it (the old way);
- ``decode loop, fresh thread, after a k-token warm-up in it``: the thread first runs a short
  loop, then the timed one, without waiting in between (does a warm-up in the thread help?);
- ``decode loop, fresh thread, 4n tokens: quarter q``: one long loop in a fresh thread, timed by
  quarter (does the slowness wear off with time or work?);
- ``miserver engine #k``: one request on the continuous engine
  (:class:`miserver.serving.engine.engine_loop.EngineLoop`, no decode graphs) from an asyncio
  loop, the k-th in a row on one engine (its thread is reused, so #1 pays the new-thread cost
  once);
- ``miserver engine on a new engine thread``, with and without a 2-token warm-up request on
  that thread first (a new engine each time, the two interleaved).

The model is SmolLM2-135M-shaped (the embedded default's architecture) with random bfloat16
weights, so no download or import is needed; the tokenizer is a stand-in that names token ids
(the decode loop, not text, is measured). On the H200 (2026-11-30 second run) neither a warm-up
in the thread (1 or 8 tokens) nor 256 tokens of work made a fresh thread fast (3.0-4.1x
``generate``), while miserver's reused worker threads (the engine before the continuous one) ran
at 0.92x; a 2-token warm-up generation on a new worker thread did not help either (75.9 against
80.6 ms a token, interleaved). Medians of ``--repeats`` runs, ms a token (``--quick``: only ``generate`` and the
miserver rows, the warm-up ones included)::

    python benchmarks/generation_threads.py [--device auto] [--tokens 64] [--repeats 3] [--quick]
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
    ap.add_argument(
        "--quick", action="store_true", help="only generate and the miserver engine rows"
    )
    args = ap.parse_args()

    import torch
    import transformers

    from miserver.serving.engine.continuous import ContinuousEngine
    from miserver.serving.engine.engine_loop import EngineLoop
    from miserver.serving.engine.generation import SamplingParams

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

    def loop(count: int = n, marks: list[float] | None = None) -> None:
        with torch.inference_mode():
            out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            past, logits = out.past_key_values, out.logits[0, -1].float()
            for _ in range(count - 1):
                if marks is not None:
                    marks.append(time.perf_counter())
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

    def in_fresh_thread(job: Callable[[], None]) -> None:
        t = threading.Thread(target=job)
        t.start()
        t.join()

    def warmed_then_timed(warm_tokens: int) -> float:
        """A fresh thread runs a ``warm_tokens`` loop, then the timed ``n``-token loop."""
        took: list[float] = []

        def job() -> None:
            loop(warm_tokens)
            sync()
            t0 = time.perf_counter()
            loop()
            sync()
            took.append((time.perf_counter() - t0) / n * 1000.0)

        in_fresh_thread(job)
        return took[0]

    def quarters_of_a_long_run() -> list[float]:
        """ms a token in each quarter of one ``4 n``-token loop in a fresh thread."""
        marks: list[float] = []
        in_fresh_thread(lambda: loop(4 * n + 1, marks))
        q = len(marks) // 4
        return [(marks[(i + 1) * q - 1] - marks[i * q]) / (q - 1) * 1000.0 for i in range(4)]

    def new_engine() -> EngineLoop:
        """A continuous engine (64 MiB of paged cache, no graphs) and its new thread."""
        engine = ContinuousEngine(model, 64 << 20, prefix_cache=False)
        return EngineLoop(engine, model, NamingTokenizer(), cross_request_prefix_cache=False)

    engine = [new_engine()]

    async def one_generation(max_tokens: int = n) -> None:
        (gen,) = engine[0].submit(
            prompt[0].tolist(), SamplingParams(max_tokens=max_tokens, temperature=0)
        )
        async for _ in gen.events():
            pass
        await gen.wait()

    def fresh_engine() -> None:
        engine[0].close(wait_s=10.0)
        engine[0] = new_engine()

    def per_token(fn: Callable[[], None]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) / n * 1000.0

    rows: dict[str, list[float]] = {}
    generate()  # warm-up in the main thread: the process's first CUDA work is not measured
    # the engine's first request runs on its new thread; the later ones on the same thread
    gens = [per_token(lambda: asyncio.run(one_generation())) for _ in range(args.repeats + 1)]
    rows["miserver engine #1 (its engine thread is new)"] = gens[:1]
    rows[f"miserver engine #2..#{len(gens)} (same engine thread)"] = gens[1:]
    if not args.quick:
        for name, fn in (
            ("transformers generate", generate),
            ("decode loop, main thread", loop),
            ("decode loop, fresh thread each run", fresh_thread),
        ):
            rows[name] = [per_token(fn) for _ in range(args.repeats)]
    else:
        rows["transformers generate"] = [per_token(generate) for _ in range(args.repeats)]
    # A warm-up: a new engine (so a new thread) first runs a 2-token request, then the timed
    # one on the same thread. Does a short request at load time spare the first request?
    # Interleaved with the same thing without the warm-up, so drift hits both alike.
    after_warm_up: list[float] = []
    cold: list[float] = []
    for _ in range(args.repeats):
        fresh_engine()
        cold.append(per_token(lambda: asyncio.run(one_generation())))
        fresh_engine()
        asyncio.run(one_generation(2))
        time.sleep(0.05)
        after_warm_up.append(per_token(lambda: asyncio.run(one_generation())))
    rows["miserver engine on a new engine thread, no warm-up (interleaved)"] = cold
    rows["miserver engine on a new engine thread after a 2-token warm-up request"] = after_warm_up
    engine[0].close(wait_s=10.0)
    for warm in () if args.quick else (1, 8):
        rows[f"decode loop, fresh thread, after a {warm}-token warm-up in it"] = [
            warmed_then_timed(warm) for _ in range(args.repeats)
        ]
    quarters = [] if args.quick else [quarters_of_a_long_run() for _ in range(args.repeats)]
    for i in range(4 if quarters else 0):
        rows[f"decode loop, fresh thread, {4 * n} tokens: quarter {i + 1}"] = [
            q[i] for q in quarters
        ]

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
