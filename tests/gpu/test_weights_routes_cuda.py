"""The weights routes on a real CUDA card (issues 5 and 6): a CUDA IPC export over HTTP, and an
in-place checkpoint load that allocates no device memory (measured through ``cuda_memory``)."""

from __future__ import annotations

import pytest
import torch

from miserver.http import keys

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


async def test_cuda_attach_and_in_place_load_allocate_nothing(tmp_path, tiny_model_dir):
    from tests.unit.test_weights_routes import TRN, auth, make_client, post

    client = await make_client(tmp_path, tiny_model_dir, DEVICE="cuda:0", WEIGHTS_CPU_ATTACH="0")
    try:
        st, body, _ = await post(client, "/api/weights/attach", auth(TRN))
        assert st == 200, body
        data = body["data"]
        assert [s["kind"] for s in data["storages"]] == ["cuda_ipc"]
        assert data["storages"][0]["device_uuid"].startswith("GPU-")
        h = auth(TRN, data["attachment_id"])
        st, body, _ = await post(client, "/api/weights/save", h, {"name": "tiny-gpu"})
        assert st == 200, body
        for path in ("quiesce", "commit-begin"):
            assert (await post(client, f"/api/weights/{path}", h))[0] == 200
        with torch.no_grad():
            client.app[keys.HOST].resident.model.model.norm.weight.add_(1.0)
        for path in ("commit-end", "resume"):
            assert (await post(client, f"/api/weights/{path}", h))[0] == 200
        torch.cuda.synchronize()
        before = (await (await client.get("/api/weights/status")).json())["data"]["cuda_memory"]
        st, body, _ = await post(client, "/api/weights/load", h, {"checkpoint": "tiny-gpu"})
        assert st == 200 and body["data"]["in_place"] is True, body
        torch.cuda.synchronize()
        after = (await (await client.get("/api/weights/status")).json())["data"]["cuda_memory"]
        print("cuda_memory before in-place load:", before, "after:", after)
        assert after[0]["allocated_mb"] == before[0]["allocated_mb"]
        norm = client.app[keys.HOST].resident.model.model.norm.weight
        assert float(norm.float().mean()) < 1.5  # the bump was undone by the load
        assert (await post(client, "/api/weights/detach", h))[0] == 200
    finally:
        await client.close()
