"""Device identity and build identity, shared by the server's export and the trainer's rebuild.

Weights page, "Rebuilding the tensors in the trainer": devices are named by UUID as well as index
(an index can differ between processes under ``CUDA_VISIBLE_DEVICES``, a UUID cannot), and a
trainer refuses to rebuild when ``producer`` does not match its own torch and CUDA build.
"""

from __future__ import annotations

import ctypes
import functools

import torch


def device_uuid(index: int) -> str:
    """The UUID of local CUDA device ``index`` in nvidia-smi's form (``GPU-xxxxxxxx-...``)."""
    raw = str(torch.cuda.get_device_properties(index).uuid)
    return raw if raw.startswith(("GPU-", "MIG-")) else "GPU-" + raw


def local_uuids() -> list[str]:
    """The UUID of every CUDA device this process sees, by local index; empty without CUDA."""
    if not torch.cuda.is_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def local_index_for_uuid(uuid: str, uuids: list[str] | None = None) -> int | None:
    """This process's index of the device called ``uuid``, or None when it cannot see it.

    ``uuids`` defaults to :func:`local_uuids`; tests pass their own list.
    """
    table = local_uuids() if uuids is None else uuids
    want = uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid
    for i, u in enumerate(table):
        if u == want:
            return i
    return None


@functools.cache
def driver_version() -> str | None:
    """The NVIDIA driver version (``580.159.03``) from NVML, else the CUDA driver API version
    (``13.0``), else None (no driver: CPU machines)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() == 0:
            buf = ctypes.create_string_buffer(96)
            try:
                if nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(96)) == 0:
                    return buf.value.decode()
            finally:
                nvml.nvmlShutdown()
    except OSError:
        pass
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if cuda.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        pass
    return None


def producer_info() -> dict[str, str | None]:
    """``{torch, cuda, driver}``: this process's torch version (with its build suffix, such as
    ``2.13.0+cu130``), the CUDA version torch was built with (None for a CPU build), and the
    driver version. Weights page, POST /attach ``producer``."""
    return {"torch": str(torch.__version__), "cuda": torch.version.cuda, "driver": driver_version()}
