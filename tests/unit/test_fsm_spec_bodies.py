"""spec/weights.py: the bodies of the weights routes, with the page's field names."""

from __future__ import annotations

import msgspec
import pytest

from miserver.spec import weights as w


def _fields(struct: type) -> list[str]:
    return list(struct.__struct_fields__)


def test_field_names_are_the_weights_page_s() -> None:
    assert _fields(w.AttachResponse) == [
        "attachment_id",
        "model",
        "weights_state",
        "steps_since_load",
        "heartbeat",
        "producer",
        "storages",
        "parameters",
        "release",
        "config",
    ]
    assert _fields(w.QuiesceResponse) == [
        "held_requests",
        "held_batch_chunks",
        "parked_sequences",
        "weights_state",
        "quiesced_at",
        "hold_deadline",
    ]
    assert _fields(w.CommitEndResponse) == [
        "weights_state",
        "steps_since_load",
        "commit_ms",
        "overran",
    ]
    assert _fields(w.HeartbeatResponse) == [
        "attachment_state",
        "timeout_s",
        "interval_hint_s",
        "weights_state",
    ]
    assert _fields(w.ClearStaleResponse) == ["cleared", "weights_state", "barrier"]
    assert _fields(w.CommitInfo) == ["began_at", "open_ms", "watchdog_ms", "overran"]
    status = _fields(w.StatusResponse)
    for name in (
        "attached",
        "attachment",
        "barrier",
        "quiesced_at",
        "held_requests",
        "parked_sequences",
        "weights_state",
        "resident_model",
        "steps_since_load",
        "last_save",
        "commit",
        "commit_overran",
        "last_hold_timeout_at",
        "last_overrun",
        "pause_unavailable",
        "adapter",
        "cuda_memory",
        "exports_since_start",
    ):
        assert name in status
    assert "attachment_id" not in status and "attachment_id" not in _fields(w.AttachmentInfo)


def test_requests_refuse_unknown_fields_and_load_needs_exactly_one_source() -> None:
    assert msgspec.json.decode(b"{}", type=w.EmptyRequest) == w.EmptyRequest()
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"force": true}', type=w.EmptyRequest)
    assert msgspec.json.decode(b'{"model_id": 3}', type=w.LoadRequest).model_id == 3
    assert msgspec.json.decode(b'{"checkpoint": "abc"}', type=w.LoadRequest).checkpoint == "abc"
    for bad in (b"{}", b'{"model_id": 1, "checkpoint": "x"}', b'{"model_id": "1"}'):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(bad, type=w.LoadRequest)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"name": "a"}', type=w.AdapterRequest)


def test_storage_entries_are_tagged_by_kind() -> None:
    body = {
        "kind": "cpu_shared_memory",
        "manager_handle": "bQ==",
        "storage_handle": "cw==",
        "storage_size_bytes": 4,
        "device_index": None,
        "device_uuid": None,
    }
    entry = msgspec.convert(body, w.CudaIpcStorage | w.CpuSharedMemoryStorage)
    assert isinstance(entry, w.CpuSharedMemoryStorage)
    assert msgspec.to_builtins(entry)["kind"] == "cpu_shared_memory"


def test_storage_and_parameter_fields_match_the_ipc_exporter() -> None:
    export = pytest.importorskip("miserver.ipc.export")
    for ours, theirs in (
        (w.CudaIpcStorage, export.CudaIpcStorage),
        (w.CpuSharedMemoryStorage, export.CpuSharedMemoryStorage),
        (w.ParameterEntry, export.ParameterEntry),
        (w.Producer, export.Producer),
        (w.Release, export.Release),
    ):
        assert _fields(ours) == _fields(theirs), ours.__name__


def test_every_route_has_a_json_schema() -> None:
    for route, (request, response) in w.ROUTES.items():
        for struct in (request, response):
            if struct is not None:
                schema = msgspec.json.schema(struct)
                assert schema, route
