"""Two processes, CPU shared memory (contract section 8): the server side loads a small model
attachably and exports; a separate Python process receives the export as JSON, rebuilds it,
writes a known pattern into every parameter (biases and norms included), and the server reads
exactly that pattern back, tied weights included. Odd layouts (slices of one fused storage, a
transposed parameter, a strided column, mixed dtypes) are exported correctly.

This file is also the trainer-side program: ``python test_cpu_attach_two_process.py`` reads jobs
as JSON on stdin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def pattern(name: str, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    """A value per element that bfloat16 and float16 hold exactly (m / 64, |m| < 128)."""
    n = 1
    for s in shape:
        n *= s
    h = (zlib.crc32(name.encode()) + 31 * salt) % 97
    vals = ((torch.arange(n, dtype=torch.float64) * 7 + h) % 251 - 125) / 64
    return vals.reshape(shape).to(dtype)


# --- the trainer process ------------------------------------------------------------------------
def child() -> None:
    from miserver import trainer

    jobs = json.loads(sys.stdin.read())
    report = []
    for job in jobs:
        body, salt, mode = job["body"], job["salt"], job["mode"]
        with trainer.rebuild(body) as weights:
            if job.get("try_twice"):
                try:
                    trainer.rebuild(body)
                    report.append({"second_rebuild": "accepted"})
                except trainer.AlreadyRebuilt:
                    report.append({"second_rebuild": "AlreadyRebuilt"})
            if mode == "model":
                # the graph comes from config; tied stay tied; write as an optimizer would
                model = trainer.build_model(body, weights)
                tied = model.lm_head.weight is model.model.embed_tokens.weight
                with torch.no_grad():
                    for name, p in model.named_parameters():  # unique: a tied one once
                        p.copy_(pattern(name, tuple(p.shape), p.dtype, salt))
                report.append(
                    {
                        "tied_in_trainer": tied,
                        "storages": weights.storage_count,
                        "written": [n for n, _ in model.named_parameters()],
                    }
                )
            else:
                written = []
                with torch.no_grad():
                    for name, t in weights.tensors.items():
                        t.copy_(pattern(name, tuple(t.shape), t.dtype, salt))
                        written.append(name)
                report.append(
                    {
                        "storages": weights.storage_count,
                        "written": written,
                        "strides": {n: list(t.stride()) for n, t in weights.tensors.items()},
                    }
                )
        report[-1]["released"] = weights.released
        report[-1]["lingering"] = weights.lingering
    print(json.dumps(report))


def run_child(jobs: list[dict]) -> list[dict]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, __file__],
        input=json.dumps(jobs),
        text=True,
        capture_output=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the server side ----------------------------------------------------------------------------
def tiny_qwen2() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    return transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()


class OddLayouts(torch.nn.Module):
    """Parameters that are slices of one fused storage, transposed, strided, of mixed dtypes."""

    def __init__(self) -> None:
        super().__init__()
        fused = torch.randn(24, 4).to(torch.bfloat16)
        self.q = torch.nn.Parameter(fused[0:8])
        self.k = torch.nn.Parameter(fused[8:16])
        self.v = torch.nn.Parameter(fused[16:24])
        self.wt = torch.nn.Parameter(torch.randn(4, 6).to(torch.bfloat16).t())  # stride (1, 6)
        self.col = torch.nn.Parameter(torch.randn(5, 6).to(torch.float16)[:, 2])  # stride (6,)
        self.lin = torch.nn.Linear(3, 5, dtype=torch.bfloat16)
        self.register_buffer("steps", torch.arange(4))


def first_names(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter name -> the first name of the same Parameter (tied ones share it)."""
    seen: dict[int, str] = {}
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out[n] = seen.setdefault(id(p), n)
    return out


def assert_pattern(model: torch.nn.Module, salt: int) -> None:
    first = first_names(model)
    for n, p in model.named_parameters(remove_duplicate=False):
        want = pattern(first[n], tuple(p.shape), p.dtype, salt)
        assert torch.equal(p.detach(), want), f"{n} does not hold the trainer's pattern"


def test_two_processes_write_every_parameter_and_the_server_reads_it_back():
    from miserver.ipc.arena import make_attachable
    from miserver.ipc.export import export_handles, exports_since_start, moved_parameters

    model = tiny_qwen2()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([[1, 5, 9, 2]])
    before = model(ids).logits.detach().clone()
    arena = make_attachable(model, cpu_shared=True)
    assert len(arena.storages) == 1 and arena.storages[0].is_shared()
    assert torch.equal(model(ids).logits, before)  # placement changes no value

    n0 = exports_since_start()
    bodies = [export_handles(arena, model).to_builtins() for _ in range(2)]
    assert exports_since_start() == n0 + 2
    body = bodies[0]
    assert [s["kind"] for s in body["storages"]] == ["cpu_shared_memory"]
    names = [p["name"] for p in body["parameters"]]
    assert "lm_head.weight" in names and "model.norm.weight" in names
    assert any(n.endswith("q_proj.bias") for n in names)
    by = {p["name"]: p for p in body["parameters"]}
    assert by["lm_head.weight"]["storage"] == by["model.embed_tokens.weight"]["storage"]
    assert (
        by["lm_head.weight"]["storage_offset"] == by["model.embed_tokens.weight"]["storage_offset"]
    )

    # one child, two attaches: write salt 1 under the first export, release, then salt 2 under
    # the second (the same storage rebuilt again after a release is fine; twice at once is not)
    report = run_child(
        [
            {
                "body": json.loads(json.dumps(bodies[0])),
                "salt": 1,
                "mode": "model",
                "try_twice": True,
            },
            {"body": json.loads(json.dumps(bodies[1])), "salt": 2, "mode": "model"},
        ]
    )
    assert report[0] == {"second_rebuild": "AlreadyRebuilt"}
    first, second = report[1], report[2]
    assert first["tied_in_trainer"] is True and first["storages"] == 1
    assert first["released"] is True and first["lingering"] == 0
    assert second["released"] is True and second["lingering"] == 0
    # every unique parameter was written, biases and norms included
    unique = [n for n, _ in model.named_parameters()]
    assert sorted(second["written"]) == sorted(unique)
    assert_pattern(model, salt=2)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert moved_parameters(arena, model) == []
    # the served forward pass now computes with the trainer's values
    assert not torch.equal(model(ids).logits, before)


def test_sliced_transposed_strided_and_mixed_dtype_layouts_round_trip():
    from miserver.ipc.arena import make_attachable
    from miserver.ipc.export import export_handles

    torch.manual_seed(1)
    model = OddLayouts()
    original = {n: (tuple(p.shape), tuple(p.stride())) for n, p in model.named_parameters()}
    buffer_ptr = model.steps.data_ptr()
    arena = make_attachable(model, cpu_shared=True)
    assert model.steps.data_ptr() == buffer_ptr  # buffers excluded
    assert len(arena.storages) == 1
    # q, k, v are still consecutive slices of one region; wt keeps its transposed strides
    assert model.k.data_ptr() - model.q.data_ptr() == 8 * 4 * 2
    body = export_handles(arena, model).to_builtins()
    by = {p["name"]: p for p in body["parameters"]}
    for n, (shape, stride) in original.items():
        assert (tuple(by[n]["shape"]), tuple(by[n]["stride"])) == (shape, stride), n
    assert by["col"]["dtype"] == "float16" and by["wt"]["stride"] == [1, 6]

    report = run_child([{"body": body, "salt": 3, "mode": "views"}])
    assert report[0]["storages"] == 1 and report[0]["lingering"] == 0
    assert report[0]["strides"]["wt"] == [1, 6] and report[0]["strides"]["col"] == [6]
    assert_pattern(model, salt=3)
    assert torch.equal(model.steps, torch.arange(4))


if __name__ == "__main__":
    child()
