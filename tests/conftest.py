"""Shared fixtures.

``default_home``: a ``MISERVER_HOME`` with the embedded default imported (session-scoped; the
import takes ~35 s on two cores, so it happens once per session, and is reused across sessions
from ``/tmp`` while ``default_model.py`` and transformers do not change). Treat it as read-only.

``home_with_default``: a fresh ``MISERVER_HOME`` per test whose catalogue has the two default rows,
pointing at the shared imported folder (no copy). Use it when a test registers rows, saves
checkpoints or writes batch files.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _no_heartbeat_thread_left_behind():
    """Fail a test that leaves a trainer client's heartbeat thread running (a client never
    detached: it would go on posting to a server that is gone, and log after pytest's summary),
    and stop that thread so it cannot disturb the tests after it."""
    before = set(threading.enumerate())
    yield
    left = [
        t
        for t in threading.enumerate()
        if t not in before and t.name == "miserver-heartbeat" and t.is_alive()
    ]
    for t in left:
        stop = getattr(t, "_args", (None,))[0]  # WeightsClient.start_heartbeat's stop event
        if isinstance(stop, threading.Event):
            stop.set()
        t.join(10)
    if left:
        pytest.fail(
            f"{len(left)} heartbeat thread(s) still running after the test: detach the client "
            "(WeightsClient.detach/close, or use it as a context manager)"
        )


def _cache_key() -> str:
    import transformers

    import miserver.serving.models.default_model as dm

    source = Path(dm.__file__).read_bytes()
    # The catalogue records the GGUF's path inside this environment: key on it too, so a second
    # checkout's venv does not reuse rows that point into another one.
    env = sys.prefix.encode()
    return hashlib.sha256(source + transformers.__version__.encode() + env).hexdigest()[:12]


@pytest.fixture(scope="session")
def default_home() -> str:
    """Path of a ``MISERVER_HOME`` holding the imported default (rows ``smollm2-135m-instruct``
    and ``smollm2-135m-instruct-q4``). Override the location with ``MISERVER_TEST_HOME``."""
    from miserver.serving.models.default_model import import_default

    home = os.environ.get("MISERVER_TEST_HOME") or str(
        Path(tempfile.gettempdir()) / f"miserver-test-default-{os.getuid()}-{_cache_key()}"
    )
    import_default(home, progress=False)
    return home


@pytest.fixture
def home_with_default(default_home: str, tmp_path: Path) -> str:
    """A fresh ``MISERVER_HOME`` (under ``tmp_path``) registering the shared default's rows."""
    return copy_default_rows(default_home, tmp_path / "home")


def copy_default_rows(default_home: str, path: Path) -> str:
    """Register the shared default home's catalogue rows (their folders, not copies) in a new
    ``MISERVER_HOME`` at ``path``; returns ``path`` as a string."""
    from miserver.serving.models.catalogue import Catalogue

    fresh = Catalogue(path)
    for row in Catalogue(default_home).list():
        fresh.register(
            name=row.name,
            format=row.format,
            dtype=row.dtype,
            path=row.path,
            quantization=row.quantization,
            origin=row.origin,
        )
    return str(path)


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


@pytest.fixture(scope="session")
def tiny_model_dir(default_home: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real, tiny Llama folder (2 layers, hidden 32, ~1.6M parameters, tied embeddings) in
    bfloat16 safetensors with the default model's tokenizer and chat template. Loads in well
    under a second; its output is noise, so use it for loads and plumbing, not for answers."""
    import shutil

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from miserver.serving.models.default_model import model_dir

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(folder)
    source = model_dir(default_home)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return str(folder)


#: Fixtures that load a real model (the embedded default, or the tiny Llama built from it):
#: tests using them are left out of ``--quick``.
#: (``cache_dir``, ``folder``: the tiny model folder of the /v1 tests, tests/unit/v1_fixtures.py.)
MODEL_FIXTURES = frozenset(
    {"default_home", "home_with_default", "tiny_model_dir", "cache_dir", "folder"}
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="the quick suite (make quick): leave out the tests that load a model "
        f"({', '.join(sorted(MODEL_FIXTURES))}) or are marked slow, full or gpu",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--quick"):
        return
    keep, drop = [], []
    for item in items:
        heavy = MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        marked = any(item.get_closest_marker(m) for m in ("slow", "full", "gpu"))
        (drop if heavy or marked else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
