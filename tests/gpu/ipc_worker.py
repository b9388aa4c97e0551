"""A trainer process for the GPU tests and the benchmark: JSON commands on stdin, one JSON answer
per line on stdout. It uses the public client (miserver.trainer) except for ``naive_per_name``,
which rebuilds per parameter name the way a hand-written client would (the weights page's
counter-example).

Run: ``python tests/gpu/ipc_worker.py`` (the tests start it with subprocess).
"""

from __future__ import annotations

import json
import sys
import zlib

import torch

from miserver import trainer
from miserver.ipc.devices import local_uuids

HELD: list[trainer.AttachedWeights] = []


def pattern(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    salt: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A value per element that bfloat16 and float16 hold exactly (m / 64, |m| <= 125)."""
    n = 1
    for s in shape:
        n *= s
    h = (zlib.crc32(name.encode()) + 31 * salt) % 97
    vals = ((torch.arange(n, dtype=torch.float32, device=device) * 7 + h) % 251 - 125) / 64
    return vals.reshape(shape).to(dtype)


def first_names(names_to_tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    out = []
    for n, t in names_to_tensors.items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((n, t))
    return out


def first_storage_views(w: trainer.AttachedWeights) -> list[torch.Tensor]:
    """One view per rebuilt storage, in storage order (the device each storage landed on)."""
    return [torch.empty(0, device=st.device) for st in w._storages]


def op_rebuild_write(msg: dict) -> dict:
    body, salt = msg["body"], msg["salt"]
    with trainer.rebuild(body) as w:
        if msg.get("build_model"):
            model = trainer.build_model(body, w)
            items = list(model.named_parameters())
        else:
            items = first_names(w.tensors)
        with torch.no_grad():
            for n, t in items:
                t.copy_(pattern(n, tuple(t.shape), t.dtype, salt, t.device))
        torch.cuda.synchronize()
        info = {
            "storages": w.storage_count,
            "storage_devices": [str(t.device) for t in first_storage_views(w)],
            "written": len(items),
        }
        del items
        if msg.get("build_model"):
            del model
    info["lingering"] = w.lingering
    return info


def op_hold(msg: dict) -> dict:
    w = trainer.rebuild(msg["body"])
    HELD.append(w)
    return {"storages": w.storage_count}


def op_release_held(msg: dict) -> dict:
    n = 0
    while HELD:
        HELD.pop().release()
        n += 1
    return {"released": n}


def op_rebuild_twice(msg: dict) -> dict:
    with trainer.rebuild(msg["body"]):
        try:
            trainer.rebuild(msg["body"])
        except trainer.AlreadyRebuilt:
            return {"second": "AlreadyRebuilt"}
        return {"second": "accepted"}


def op_naive_per_name(msg: dict) -> dict:
    """Rebuild the storage once per parameter name (what reduce_tensor per tensor amounts to),
    write, drop everything and ipc_collect: the counter-example of the weights page."""
    import base64

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    body = msg["body"]

    def b(s: dict, k: str) -> bytes | None:
        return base64.b64decode(s[k]) if s[k] is not None else None

    tensors = []
    for p in body["parameters"]:
        s = body["storages"][p["storage"]]
        tensors.append(
            rebuild_cuda_tensor(
                torch.Tensor,
                tuple(p["shape"]),
                tuple(p["stride"]),
                p["storage_offset"],
                torch.UntypedStorage,
                getattr(torch, p["dtype"]),
                s["device_index"],
                b(s, "handle"),
                s["storage_size_bytes"],
                s["storage_offset_bytes"],
                False,
                b(s, "ref_counter_handle"),
                s["ref_counter_offset"],
                b(s, "event_handle"),
                s["event_sync_required"],
            )
        )
    n = len(tensors)
    del tensors
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    return {"rebuilds": n}


def op_uuids(msg: dict) -> dict:
    return {"uuids": local_uuids()}


OPS = {
    "rebuild_write": op_rebuild_write,
    "hold": op_hold,
    "release_held": op_release_held,
    "rebuild_twice": op_rebuild_twice,
    "naive_per_name": op_naive_per_name,
    "uuids": op_uuids,
}


def main() -> None:
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "exit":
            break
        try:
            answer = {"ok": True, **OPS[msg["op"]](msg)}
        except Exception as e:  # answer the error, keep serving
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
