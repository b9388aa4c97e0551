"""Nothing a save, a weights load or an adapter change did keeps a dropped model alive.

The jobs of :mod:`miserver.serving.weights.jobs` hand the model, an applied adapter (which holds
the model) or a failure (whose frames hold the model) back from a worker thread. Through
``asyncio.to_thread`` the result stayed alive for the rest of the awaiting task's step, and a
failure's traceback for as long as the runtime kept the error (it is the HTTP answer, kept as the
last job result): an unload after it then freed nothing (on a GPU the card's memory stays
allocated). The CPU stand-in for the CUDA unload test, like tests/unit/test_host_unload_refs.py;
the assertions deliberately run without an extra ``gc.collect()``.
"""

from __future__ import annotations

import inspect
import weakref
from pathlib import Path
from typing import Any

import msgspec
import pytest

from miserver.http import keys
from miserver.serving.models.host import clear_traceback_frames, run_without_keeping
from miserver.serving.weights.jobs import WeightsJobs
from tests.unit.test_host_unload_refs import OPS, TRN, Refs, make_adapter, make_client, post


def jobs_of(client: Any) -> WeightsJobs:
    """The app's :class:`WeightsJobs` (the object its registered ``adapter`` job is bound to)."""
    runtime = client.app[keys.WEIGHTS]
    return inspect.unwrap(runtime._jobs["adapter"]).__self__


async def test_a_failure_in_run_without_keeping_keeps_no_argument_once_frames_are_cleared():
    # A frame keeps its function alive, and clearing a frame does not empty that function's
    # closure: the thread's function must not hold the arguments (positional or keyword).
    class Big:
        pass

    def fail(model: Big, *, adapter: Big) -> None:
        raise OSError("disk gone")

    model, adapter = Big(), Big()
    refs = [weakref.ref(model), weakref.ref(adapter)]
    with pytest.raises(OSError, match="disk gone") as info:
        await run_without_keeping(fail, model, adapter=adapter)
    del model, adapter
    clear_traceback_frames(info.value)
    assert info.value.__traceback__ is not None  # the error itself is kept, as a runtime does
    assert [r() for r in refs] == [None, None]


class AdapterBody(msgspec.Struct):
    name: str
    path: str


async def test_an_adapter_applied_then_an_unload_in_the_same_step_frees_everything(
    tmp_path, tiny_model_dir
):
    # The job's result (the AppliedAdapter, which holds the model) must not ride in a future
    # that the awaiting task keeps until its step ends: this unload runs in that same step.
    adapter = make_adapter(tiny_model_dir, tmp_path / "lora")
    client = await make_client(tmp_path, tiny_model_dir, attach=True)
    try:
        host = client.app[keys.HOST]
        refs = Refs(host.resident)
        jobs = jobs_of(client)
        body = AdapterBody(name="tiny-lora", path=str(adapter))
        answer = await jobs.adapter({"body": body, "apply": True})
        assert answer == {"served_name": "tiny-lora", "applied": True}
        assert jobs.applied is not None and jobs.applied.module is host.resident.model
        await host.unload()
        assert jobs.applied is None
        assert refs.alive() == []
    finally:
        await client.close()


async def test_an_adapter_removed_then_an_unload_in_the_same_step_frees_everything(
    tmp_path, tiny_model_dir
):
    adapter = make_adapter(tiny_model_dir, tmp_path / "lora")
    client = await make_client(tmp_path, tiny_model_dir, attach=True)
    try:
        host = client.app[keys.HOST]
        resp = await client.post(
            "/api/weights/adapter", json={"name": "tiny-lora", "path": str(adapter)}
        )
        assert resp.status == 200, await resp.text()
        del resp
        refs = Refs(host.resident)
        jobs = jobs_of(client)
        answer = await jobs.adapter({"body": None, "apply": False})
        assert answer == {
            "served_name": "tiny-a",
            "applied": False,
            "origin": "model",
            "commits": 0,
        }
        assert jobs.applied is None
        await host.unload()
        assert refs.alive() == []
    finally:
        await client.close()


async def test_a_failed_save_keeps_nothing_after_detach_and_unload(
    tmp_path, tiny_model_dir, monkeypatch
):
    # The save fails inside its worker thread (the folder of that name appeared while it was
    # writing, say another server sharing MISERVER_HOME: 409 CHECKPOINT_EXISTS). The error is
    # the answer and the runtime keeps it; its traceback (save_checkpoint's frame holds the
    # model) must not keep the model that was then unloaded.
    from miserver.serving.models import checkpoints

    def taken(tmp: Path, final: Path) -> None:
        raise checkpoints.CheckpointExists(f"a checkpoint named {final.name!r} already exists")

    monkeypatch.setattr(checkpoints, "_publish", taken)
    client = await make_client(tmp_path, tiny_model_dir, attach=True)
    try:
        host = client.app[keys.HOST]
        ids = {r.name: r.id for r in host.catalogue.list()}
        refs = Refs(host.resident)
        auth = {"Authorization": f"Bearer {TRN}"}
        status, body = await post(client, "/api/weights/attach", auth)
        assert status == 200, body
        auth["X-miLLM-Attachment"] = body["data"]["attachment_id"]
        del body
        status, body = await post(client, "/api/weights/save", auth, {"name": "taken"})
        assert status == 409 and body["error"]["code"] == "CHECKPOINT_EXISTS", body
        status, body = await post(client, "/api/weights/detach", auth)
        assert status == 200, body
        status, body = await post(client, f"/api/models/{ids['tiny-a']}/unload")
        assert status == 200, body
        assert host.resident is None
        assert refs.alive() == []
    finally:
        await client.close()


async def test_a_failed_in_place_load_keeps_nothing_after_the_unload(
    tmp_path, tiny_model_dir, monkeypatch
):
    # An in-place weights load that fails while writing (a disk error, say) leaves the set
    # torn; the unload that follows (allowed while torn) must free the model.
    from miserver.serving.models import checkpoints

    client = await make_client(tmp_path, tiny_model_dir, attach=True)
    try:
        host = client.app[keys.HOST]
        ids = {r.name: r.id for r in host.catalogue.list()}
        auth = {"Authorization": f"Bearer {TRN}"}
        status, body = await post(client, "/api/weights/attach", auth)
        assert status == 200, body
        auth["X-miLLM-Attachment"] = body["data"]["attachment_id"]
        del body
        status, body = await post(client, "/api/weights/save", auth, {"name": "ck"})
        assert status == 200, body
        status, body = await post(client, "/api/weights/detach", auth)
        assert status == 200, body
        refs = Refs(host.resident)
        real = checkpoints.write_in_place

        def failing(model: Any, handle: Any, tensors: Any) -> None:
            real(model, handle, tensors)
            raise checkpoints.CheckpointError("read error while writing in place")

        monkeypatch.setattr(checkpoints, "write_in_place", failing)
        ops = {"Authorization": f"Bearer {OPS}"}
        status, body = await post(client, "/api/weights/load", ops, {"checkpoint": "ck"})
        assert status == 400 and body["error"]["message"] == "read error while writing in place"
        assert client.app[keys.WEIGHTS].lifecycle.state.weights == "torn"
        status, body = await post(client, f"/api/models/{ids['tiny-a']}/unload")
        assert status == 200, body
        assert host.resident is None
        assert refs.alive() == []
    finally:
        await client.close()
