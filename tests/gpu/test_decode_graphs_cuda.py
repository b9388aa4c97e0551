"""The continuous engine's CUDA decode graphs through the server on a real card (issue 13's
graph lifetime, issue 29's engine): graphs dropped and captured again after an adapter change
and a swap, and a trainer's in-place write over CUDA IPC served by graphs captured before it.
Skipped without CUDA (run on the GPU machine); tests/gpu/test_continuous_cuda.py compares the
engine's graphs with its eager path, tests/unit/test_engine_effects.py what runs without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_a_full_reload_or_swap_rebuilds_and_an_adapter_invalidates(
    tmp_path, default_home, tiny_model_dir
) -> None:
    """Through the server (the continuous engine's graphs per (rows, width)): after an adapter
    apply the answer
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
        """The resident's decode graphs (the continuous engine's; None with graphs off)."""
        assert resident.engine_loop is not None
        return resident.engine_loop.engine.runner.graphs

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
            assert (graphs_of(resident) is not None) == (mode != "off")
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
                assert graphs is not None and graphs.replays > 0
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
