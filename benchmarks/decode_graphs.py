"""The decode step in process: eager, the captured graph, the compiled graph and a bare replay.

For each model shape (the embedded SmolLM2-135M-Instruct when it is imported, else a random model
of its shape; a random Qwen2.5-0.5B shape; a random Llama-3-8B shape), bfloat16 on one CUDA card,
batch 1, greedy, one run:

- ``eager``: miserver's eager decoder (the model's dynamic cache, one forward a token;
  ``DECODE_GRAPHS=off``);
- ``captured`` / ``compiled``: :class:`miserver.serving.engine.decode_graphs.DecodeEngine` sessions
  (``DECODE_GRAPHS`` of that name): replayed graph, then the host reads the next token;
- ``bare replay``: the captured graph replayed in a loop with the argmax read back each step and
  nothing else (the floor of token-by-token decoding in Python).

Columns: ms per decoded token (median of ``--repeats`` runs of ``--tokens`` steps after an
untimed warm-up), its ratio to eager, and the build time (cache allocation and the captures of
every bucket; for compiled, the compiles). Then the checks: greedy tokens of captured (and
compiled) against the eager step over the same static cache (``graphs=False``: the same kernels
launched one by one; must be equal) and against the eager decoder (dynamic cache; counted), over
``--prompts`` prompts; and after writing every parameter in place (as a trainer does), the
replayed logits against an eager forward on the written weights (max |difference|).

Usage (on the GPU machine)::

    python benchmarks/decode_graphs.py [--shapes smollm2,0.5b,8b] [--modes captured,compiled]
        [--tokens 64] [--prompts 20] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
}


def build_model(shape: str, device: str, context: int | None) -> tuple[Any, str]:
    """A bfloat16 model of ``shape`` on ``device``: the real default for smollm2 when it is
    imported (``MISERVER_HOME``), else random weights (lm_head sharpened so greedy decoding is
    well defined)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape == "smollm2":
        try:
            from miserver.serving.models.default_model import model_dir
            from miserver.spec.settings import default_home

            folder = model_dir(os.environ.get("MISERVER_HOME") or default_home())
            if (folder / "config.json").exists():
                model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
                return model.eval().to(device), "SmolLM2-135M-Instruct (real weights)"
        except Exception as exc:  # noqa: BLE001 - fall back to the random shape
            print(f"(default model unavailable: {exc}; random SmolLM2 shape)", file=sys.stderr)
    spec = dict(SHAPES[shape])
    if context:
        spec["max_position_embeddings"] = context
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval(), f"{shape} shape (random weights)"


def prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = [8, 40, 120, 300][i % 4] + i
        out.append(torch.randint(10, vocab - 10, (length,), generator=g).tolist())
    return out


def greedy(decoder: Any, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and the per-step seconds (decode steps only)."""
    import torch

    logits = decoder.prefill(prompt, all_logits=False)[-1]
    out = [int(torch.argmax(logits))]
    times = []
    for _ in range(tokens - 1):
        t0 = time.perf_counter()
        logits = decoder.step(out[-1])
        out.append(int(torch.argmax(logits)))
        times.append(time.perf_counter() - t0)
    return out, times


def forced(decoder: Any, prompt: list[int], tokens: list[int]) -> Any:
    """The float32 logits ``[len(tokens), vocab]`` of feeding ``tokens`` after ``prompt``
    (teacher forcing: both paths see the same inputs, so their logits compare step by step)."""
    import torch

    rows = [decoder.prefill(prompt, all_logits=False)[-1].float()]
    for token in tokens[:-1]:
        rows.append(decoder.step(token).clone())
    return torch.stack(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="smollm2,0.5b,8b")
    parser.add_argument("--modes", default="captured,compiled")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=None, help="cap the context (buckets)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    import torch

    from miserver.serving.engine.decode_graphs import DecodeEngine
    from miserver.serving.engine.generation import _EagerDecoder, _GraphDecoder, context_length

    results: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        model, label = build_model(shape, args.device, args.context)
        context = context_length(model)
        vocab = model.config.vocab_size
        ps = prompts(args.prompts, vocab)
        row: dict[str, Any] = {"shape": shape, "model": label, "context": context}
        device = torch.device(args.device)
        with torch.inference_mode():
            eager = _EagerDecoder(model, device)
            greedy(eager, ps[0], 8)
            runs = [statistics.median(greedy(eager, ps[0], args.tokens)[1]) for _ in range(2)]
            row["eager_ms"] = statistics.median(runs) * 1000
            eager_tokens = [greedy(_EagerDecoder(model, device), p, args.tokens)[0] for p in ps]
            reference = DecodeEngine(model, "captured", context, graphs=False)
            with reference.session(model) as s:
                static_tokens = [greedy(_GraphDecoder(s), p, args.tokens)[0] for p in ps]
                static_logits = [
                    forced(_GraphDecoder(s), p, t) for p, t in zip(ps, static_tokens, strict=True)
                ]
            reference.close()
            del reference
            for mode in args.modes.split(","):
                t0 = time.perf_counter()
                engine = DecodeEngine(model, mode, context)
                engine.warm()
                build_s = time.perf_counter() - t0
                with engine.session(model) as s:
                    dec = _GraphDecoder(s)
                    greedy(dec, ps[0], 8)
                    per = [
                        statistics.median(greedy(dec, ps[0], args.tokens)[1])
                        for _ in range(args.repeats)
                    ]
                    toks = [greedy(dec, p, args.tokens)[0] for p in ps]
                    forced_diff = max(
                        float((forced(dec, p, t) - ref).abs().max())
                        for p, t, ref in zip(ps, static_tokens, static_logits, strict=True)
                    )
                    # the bare floor: replay + argmax read, nothing else
                    dec.prefill(ps[0], all_logits=False)
                    length = min(b for b in engine.buckets if b > len(ps[0]) + args.tokens)
                    graph = engine._graphs.get(length)
                    bare = None
                    if graph is not None:
                        ts = []
                        for _ in range(args.tokens):
                            t1 = time.perf_counter()
                            graph.replay()
                            int(torch.argmax(engine._logits))
                            ts.append(time.perf_counter() - t1)
                        bare = statistics.median(ts) * 1000
                    # write every parameter in place, as a trainer does; compare with eager
                    g = torch.Generator(device=device).manual_seed(7)
                    for p in model.parameters():
                        p.add_(
                            torch.randn(p.shape, generator=g, device=device, dtype=p.dtype),
                            alpha=1e-3,
                        )
                    dec.prefill(ps[1], all_logits=False)
                    replayed = dec.step(ps[1][-1]).clone()
                    eager_static = DecodeEngine(model, "captured", context, graphs=False)
                    with eager_static.session(model) as s2:
                        d2 = _GraphDecoder(s2)
                        d2.prefill(ps[1], all_logits=False)
                        expected = d2.step(ps[1][-1]).clone()
                    eager_static.close()
                    write_diff = float((replayed - expected).abs().max())
                    # undo the write so later modes see the same weights
                    g = torch.Generator(device=device).manual_seed(7)
                    for p in model.parameters():
                        p.sub_(
                            torch.randn(p.shape, generator=g, device=device, dtype=p.dtype),
                            alpha=1e-3,
                        )
                stats = engine.stats
                row[mode] = {
                    "ms": statistics.median(per) * 1000,
                    "bare_ms": bare,
                    "build_s": build_s,
                    "buckets": list(engine.buckets),
                    "eager_buckets": sorted(stats.eager_buckets),
                    "cache_mb": stats.cache_bytes / 2**20,
                    "graph_pool_mb": stats.graph_pool_bytes / 2**20,
                    "equal_to_eager_static": sum(
                        a == b for a, b in zip(toks, static_tokens, strict=True)
                    ),
                    "equal_to_eager_dynamic": sum(
                        a == b for a, b in zip(toks, eager_tokens, strict=True)
                    ),
                    "prompts": len(ps),
                    "write_in_place_max_abs_diff": write_diff,
                    "forced_logits_max_abs_diff": forced_diff,
                }
                engine.close()
                del engine
                torch.cuda.empty_cache()
            row["static_equal_dynamic"] = sum(
                a == b for a, b in zip(static_tokens, eager_tokens, strict=True)
            )
        results.append(row)
        print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()

    print(
        f"\n{torch.cuda.get_device_name(args.device)}, bf16, batch 1, greedy, "
        f"{args.tokens} tokens, median of {args.repeats}"
    )
    print(
        f"{'shape':<9}{'path':<10}{'ms/token':>9}{'x eager':>8}{'build s':>8}"
        f"{'=static':>8}{'=eager':>8}{'forced diff':>12}{'write diff':>11}{'cache MiB':>10}{'pool MiB':>9}"
    )
    for row in results:
        print(f"{row['shape']:<9}{'eager':<10}{row['eager_ms']:>9.2f}{1.0:>8.2f}")
        for mode in args.modes.split(","):
            m = row.get(mode)
            if not m:
                continue
            print(
                f"{'':<9}{mode:<10}{m['ms']:>9.2f}{row['eager_ms'] / m['ms']:>8.1f}"
                f"{m['build_s']:>8.1f}{m['equal_to_eager_static']:>5}/{m['prompts']:<2}"
                f"{m['equal_to_eager_dynamic']:>5}/{m['prompts']:<2}"
                f"{m['forced_logits_max_abs_diff']:>12.3g}"
                f"{m['write_in_place_max_abs_diff']:>11.3g}{m['cache_mb']:>10.0f}"
                f"{m['graph_pool_mb']:>9.0f}"
            )
            if m["bare_ms"] is not None:
                print(
                    f"{'':<9}{'bare':<10}{m['bare_ms']:>9.2f}{row['eager_ms'] / m['bare_ms']:>8.1f}"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
