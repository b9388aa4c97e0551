"""The decode engine on a real CUDA card (issue 13): captured and compiled graphs against the
eager path, a trainer's in-place write over CUDA IPC, and graphs dropped after an adapter change
and a swap. Skipped without CUDA (run on the GPU machine); tests/unit/test_decode_graphs.py covers
what runs without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICE = torch.device("cuda:0")
TOKENS = 64
N_PROMPTS = 20
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CUDA graph is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into German.",
    "Why is the sky blue?",
    "Give me a name for a cat.",
    "What is 12 times 12?",
    "Summarise the plot of Hamlet in two sentences.",
    "Write a Python function that adds two numbers.",
]


def _greedy(decoder, prompt: list[int], tokens: int = TOKENS, rows=None) -> list[int]:
    """Greedy tokens; ``rows`` (a list) also collects each step's float32 logits."""
    logits = decoder.prefill(prompt, all_logits=False)[-1].float()
    out = [int(torch.argmax(logits))]
    for _ in range(tokens - 1):
        if rows is not None:
            rows.append(logits.clone())
        logits = decoder.step(out[-1])
        out.append(int(torch.argmax(logits)))
    if rows is not None:
        rows.append(logits.clone())
    return out


def _forced(decoder, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    rows = [decoder.prefill(prompt, all_logits=False)[-1].float()]
    for token in tokens[:-1]:
        rows.append(decoder.step(token).clone())
    return torch.stack(rows)


def _random_model(shape: str):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from decode_graphs import build_model

    model, _label = build_model(shape, "cuda:0", 1024)
    return model


def _prompts(tokenizer=None, vocab: int = 0) -> list[list[int]]:
    if tokenizer is not None:
        out = []
        for i in range(N_PROMPTS):
            chat = [{"role": "user", "content": CHATS[i % len(CHATS)] + " " * (i // len(CHATS))}]
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        return out
    g = torch.Generator().manual_seed(3)
    return [
        torch.randint(10, vocab - 10, (8 + 17 * i,), generator=g).tolist() for i in range(N_PROMPTS)
    ]


@pytest.fixture(scope="module")
def default_model(default_home):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miserver.serving.models.default_model import model_dir

    folder = model_dir(default_home)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval().to(DEVICE)
    return model, AutoTokenizer.from_pretrained(folder)


def test_default_model_captured_graphs_give_the_eager_tokens(default_model) -> None:
    """SmolLM2-135M-Instruct, 20 chat prompts x 64 greedy tokens: the captured graphs' tokens
    equal the eager path's (DECODE_GRAPHS=off: the dynamic cache, one forward a token), over the
    served context (every bucket to 8192 captured)."""
    from miserver.serving.engine.decode_graphs import DecodeEngine
    from miserver.serving.engine.generation import _EagerDecoder, _GraphDecoder, context_length

    model, tokenizer = default_model
    prompts = _prompts(tokenizer)
    with torch.inference_mode():
        eager = [_greedy(_EagerDecoder(model, DEVICE), p) for p in prompts]
        engine = DecodeEngine(model, "captured", context_length(model))
        engine.warm()
        with engine.session(model) as s:
            graphs = [_greedy(_GraphDecoder(s), p) for p in prompts]
        captured, fell_back = sorted(engine.stats.captured), sorted(engine.stats.eager_buckets)
        replays = engine.stats.replays
        engine.close()
    print(f"captured: buckets {captured}, eager buckets {fell_back}, {replays} replays")
    assert not fell_back, "a capture fell back to eager"
    assert replays >= N_PROMPTS * (TOKENS - 1)
    same = sum(a == b for a, b in zip(graphs, eager, strict=True))
    print(f"captured: {same}/{len(prompts)} prompts give the eager path's {TOKENS} tokens")
    assert same == len(prompts)


#: Fed the same tokens, the most ``compiled``'s logits may differ from the eager path's, as a
#: fraction of the largest logit: inductor's fused bfloat16 kernels round differently (measured
#: on the H200, 2026-12-02: SmolLM2-135M's shape 0.31 against a largest logit of about 20, the
#: real model's greedy tokens equal on 6 of 20 prompts x 64, each first difference a near-tie).
COMPILED_TOLERANCE = 0.05


def test_default_model_compiled_graphs_follow_the_eager_logits_and_an_in_place_write(
    default_model,
) -> None:
    """SmolLM2-135M-Instruct, 20 chat prompts x 64 tokens, DECODE_GRAPHS=compiled: fed the eager
    path's greedy tokens, the compiled graphs' logits stay within :data:`COMPILED_TOLERANCE` of
    the eager path's; where the compiled greedy tokens first differ, the two tokens' eager logits
    are that close (a near-tie). Then every parameter is written in place (scaled by 1.1): the
    graphs compiled before the write, replayed unchanged, give the eager logits of the written
    weights within the tolerance, and differ from their own logits before the write by at least
    four times it (a graph that missed the write would have answered as before)."""
    from miserver.serving.engine.decode_graphs import DecodeEngine
    from miserver.serving.engine.generation import _EagerDecoder, _GraphDecoder

    model, tokenizer = default_model
    prompts = _prompts(tokenizer)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max())

    with torch.inference_mode():
        eager, eager_logits = [], []
        for p in prompts:
            rows: list[torch.Tensor] = []
            eager.append(_greedy(_EagerDecoder(model, DEVICE), p, rows=rows))
            eager_logits.append(torch.stack(rows))
        # the prompts and 64 tokens fit the first bucket; 512 keeps the cold compile to 2 buckets
        engine = DecodeEngine(model, "compiled", 512)
        engine.warm()
        with engine.session(model) as s:
            compiled = [_greedy(_GraphDecoder(s), p) for p in prompts]
            diffs = [
                rel(_forced(_GraphDecoder(s), p, t), ref)
                for p, t, ref in zip(prompts, eager, eager_logits, strict=True)
            ]
            before = _forced(_GraphDecoder(s), prompts[0], eager[0])
        built, fell_back = sorted(engine.stats.captured), sorted(engine.stats.eager_buckets)
        saved = [p.detach().clone() for p in model.parameters()]
        try:
            for p in model.parameters():
                p.mul_(1.1)  # in place: the same storages, as a trainer writes them
            written_eager = _forced(_EagerDecoder(model, DEVICE), prompts[0], eager[0])
            with engine.session(model) as s:
                after = _forced(_GraphDecoder(s), prompts[0], eager[0])
            rebuilt = sorted(engine.stats.captured)
        finally:
            for p, old in zip(model.parameters(), saved, strict=True):
                p.copy_(old)
        engine.close()
    same = sum(a == b for a, b in zip(compiled, eager, strict=True))
    print(
        f"compiled: buckets {built}, eager buckets {fell_back}; {same}/{N_PROMPTS} prompts give "
        f"the eager path's {TOKENS} tokens; forced logits max rel diff {max(diffs):.4f}"
    )
    print(
        f"compiled after a write of every parameter: rel diff to the eager logits on the written "
        f"weights {rel(after, written_eager):.4f}, to its own logits before the write "
        f"{rel(after, before):.4f} (tolerance {COMPILED_TOLERANCE})"
    )
    assert not fell_back, "a compile fell back to eager"
    assert built == rebuilt  # nothing was compiled or captured again for the write
    assert max(diffs) <= COMPILED_TOLERANCE
    for got, want, logits in zip(compiled, eager, eager_logits, strict=True):
        k = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if k is not None:
            margin = float(logits[k, want[k]] - logits[k, got[k]])
            assert margin <= COMPILED_TOLERANCE * float(logits[k].abs().max()), (k, margin)
    assert rel(after, written_eager) <= COMPILED_TOLERANCE
    assert rel(after, before) >= 4 * COMPILED_TOLERANCE


#: Fed the same tokens, the most the captured step's logits may differ from the eager step's over
#: the same static cache, as a fraction of the largest logit. Measured on the H200 (2026-12-01,
#: 20 prompts x 64 tokens): the real SmolLM2-135M 0 (all tokens equal); single steps after an
#: in-place write 0.0 at all three shapes; random 0.5B 0.018, random 8B 0.040 over 64 steps
#: (random weights amplify bfloat16 rounding through the layers: the eager static-cache and
#: eager dynamic-cache paths themselves disagreed on 2 of 8 8B prompts).
RANDOM_SHAPE_TOLERANCE = 0.05


@pytest.mark.parametrize("shape", ["0.5b", "8b"])
def test_random_shapes_captured_equals_the_eager_step(shape) -> None:
    """Random 0.5B and 8B shapes, 20 prompts x 64 tokens: fed the same tokens, the captured
    graph's logits stay within :data:`RANDOM_SHAPE_TOLERANCE` of the eager step's over the same
    static cache, and its greedy tokens equal the eager step's up to a near-tie: where they first
    differ, the eager logits of the two tokens are within that tolerance of each other."""
    from miserver.serving.engine.decode_graphs import DecodeEngine
    from miserver.serving.engine.generation import _GraphDecoder

    model = _random_model(shape)
    prompts = _prompts(vocab=model.config.vocab_size)
    with torch.inference_mode():
        reference = DecodeEngine(model, "captured", 1024, graphs=False)
        eager, eager_logits = [], []
        with reference.session(model) as s:
            for p in prompts:
                rows: list[torch.Tensor] = []
                eager.append(_greedy(_GraphDecoder(s), p, rows=rows))
                eager_logits.append(torch.stack(rows))
        reference.close()
        engine = DecodeEngine(model, "captured", 1024)
        engine.warm()
        with engine.session(model) as s:
            captured = [_greedy(_GraphDecoder(s), p) for p in prompts]
            diffs = [
                float((_forced(_GraphDecoder(s), p, t) - ref).abs().max() / ref.abs().max())
                for p, t, ref in zip(prompts, eager, eager_logits, strict=True)
            ]
        assert not engine.stats.eager_buckets, "a capture fell back to eager"
        engine.close()
    same = sum(a == b for a, b in zip(captured, eager, strict=True))
    print(f"{shape}: captured {same}/{N_PROMPTS} equal; forced logits max rel diff {max(diffs)}")
    assert max(diffs) <= RANDOM_SHAPE_TOLERANCE
    for got, want, logits in zip(captured, eager, eager_logits, strict=True):
        k = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if k is None:
            continue
        margin = float(logits[k, want[k]] - logits[k, got[k]])
        assert margin <= RANDOM_SHAPE_TOLERANCE * float(logits[k].abs().max()), (k, margin)


@pytest.mark.parametrize("engine_kind", ["static", "continuous"])
def test_a_full_reload_or_swap_rebuilds_and_an_adapter_invalidates(
    tmp_path, default_home, tiny_model_dir, engine_kind
) -> None:
    """Through the server, on each engine (``ENGINE``: the static batch's one-sequence graph
    engine, the continuous engine's graphs per (rows, width)): after an adapter apply the answer
    is the adapter's (a graph captured over the base model would answer as the base), after its
    removal the base's again, and after a swap the new model's, each equal to the eager path
    (DECODE_GRAPHS=off) in the same state."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from miserver.http import keys
    from miserver.http.app import create_app
    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.default_model import model_dir
    from miserver.spec.settings import load_settings

    adapter = tmp_path / "lora"
    base = AutoModelForCausalLM.from_pretrained(model_dir(default_home), dtype=torch.bfloat16)
    torch.manual_seed(5)
    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        ),
    )
    peft_model.save_pretrained(str(adapter))
    del peft_model, base

    def graphs_of(resident: Any) -> Any:
        """The resident's decode graphs: the continuous engine's, or the graph engine."""
        if engine_kind == "continuous":
            assert resident.engine_loop is not None and resident.engine is None
            return resident.engine_loop.engine.runner.graphs
        assert resident.engine_loop is None
        return resident.engine

    def replays(graphs: Any) -> int:
        return graphs.replays if engine_kind == "continuous" else graphs.stats.replays

    async def answers(mode: str) -> dict[str, str]:
        home = tmp_path / f"home-{mode}"
        cat = Catalogue(str(home))
        cat.register(
            name="smol",
            format="safetensors",
            dtype="bfloat16",
            path=str(model_dir(default_home)),
        )
        cat.register(name="tiny", format="safetensors", dtype="bfloat16", path=tiny_model_dir)
        settings = load_settings(
            {
                "MISERVER_HOME": str(home),
                "DEFAULT_MODEL": "smol",
                "DEVICE": "cuda:0",
                "DECODE_GRAPHS": mode,
                "ENGINE": engine_kind,
            }
        )
        client = TestClient(TestServer(create_app(settings)))
        await client.start_server()
        out: dict[str, str] = {}

        async def ask(model: str) -> str:
            r = await client.post(
                "/v1/completions",
                json={"model": model, "prompt": "The ocean is", "max_tokens": 24, "temperature": 0},
            )
            body = await r.json()
            assert r.status == 200, body
            return body["choices"][0]["text"]

        try:
            await client.app[keys.STARTUP_LOAD]
            resident = client.app[keys.HOST].resident
            assert (graphs_of(resident) is not None) == (mode != "off"), resident.engine_off_reason
            out["base"] = await ask("smol")
            r = await client.post(
                "/api/weights/adapter", json={"name": "lora", "path": str(adapter)}
            )
            assert r.status == 200, await r.text()
            out["adapter"] = await ask("lora")
            r = await client.delete("/api/weights/adapter")
            assert r.status == 200, await r.text()
            out["removed"] = await ask("smol")
            rows = (await (await client.get("/api/models")).json())["data"]
            tiny = next(row["id"] for row in rows if row["name"] == "tiny")
            r = await client.post(f"/api/models/{tiny}/load")
            assert r.status == 200, await r.text()
            out["swapped"] = await ask("tiny")
            if mode != "off":
                graphs = graphs_of(client.app[keys.HOST].resident)
                assert graphs is not None and replays(graphs) > 0
        finally:
            await client.close()
        return out

    eager = asyncio.run(answers("off"))
    captured = asyncio.run(answers("captured"))
    print(json.dumps({"eager": eager, "captured": captured}, indent=1))
    assert eager["adapter"] != eager["base"]  # the adapter changes the answer
    assert eager["swapped"] != eager["base"]
    assert captured == eager


TRAINER = textwrap.dedent(
    """
    import json, sys, torch
    from miserver.trainer import WeightsClient
    from transformers import AutoTokenizer
    url, secret, folder = sys.argv[1:4]
    tok = AutoTokenizer.from_pretrained(folder)
    with WeightsClient(url, secret) as client:
        model = client.attach().build_model()
        g = torch.Generator(device="cuda").manual_seed(11)
        with client.commit():
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + 0.02 * torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype))
        torch.cuda.synchronize()
        ids = tok("The ocean is", return_tensors="pt")["input_ids"].to("cuda")
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=24, do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        client.detach()
    print(json.dumps({"expected": text}))
    """
)


def test_a_trainers_in_place_write_is_what_the_graph_serves(tmp_path, default_home) -> None:
    """A trainer process writes every parameter in place over CUDA IPC inside the commit bracket;
    the next request (replayed graphs, captured before the write) answers what an eager forward on
    the written weights answers (the trainer's own ``generate`` over the same storages)."""
    import socket
    import time
    import urllib.request

    from miserver.serving.models.default_model import model_dir

    secret = "t" * 24
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tmp_path / "home"
    env = {
        **os.environ,
        "MISERVER_HOME": str(home),
        "PORT": str(port),
        "DEVICE": "cuda:0",
        "DECODE_GRAPHS": "captured",
        "WEIGHTS_TOKENS": f"trn:trainer:{secret}",
        "LOG_FORMAT": "text",
    }
    from miserver.serving.models.catalogue import Catalogue

    Catalogue(str(home)).register(
        name="smollm2-135m-instruct",
        format="safetensors",
        dtype="bfloat16",
        path=str(model_dir(default_home)),
    )
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "miserver.cli", "serve"], env=env, stderr=log)
    base = f"http://127.0.0.1:{port}"

    def complete() -> str:
        body = json.dumps(
            {
                "model": "smollm2-135m-instruct",
                "prompt": "The ocean is",
                "max_tokens": 24,
                "temperature": 0,
            }
        ).encode()
        req = urllib.request.Request(
            f"{base}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["text"]

    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/api/health/detailed", timeout=2) as r:
                    if json.loads(r.read())["data"].get("resident"):
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not load the model"
            time.sleep(0.5)
        before = complete()
        script = tmp_path / "trainer.py"
        script.write_text(TRAINER)
        done = subprocess.run(
            [sys.executable, str(script), base, secret, str(model_dir(default_home))],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        expected = json.loads(done.stdout.strip().splitlines()[-1])["expected"]
        after = complete()
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        replays = [
            line
            for line in metrics.splitlines()
            if line.startswith("miserver_decode_graph_replays")
        ]
        print(json.dumps({"before": before, "after": after, "expected": expected}), replays)
        assert after != before  # the write changed the answer
        assert after == expected
        assert replays and float(replays[0].split()[-1]) > 0
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
