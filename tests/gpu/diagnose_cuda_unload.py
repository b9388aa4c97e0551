"""Diagnose CUDA memory kept after a model host unload, and the peak of a load (a plain script;
pytest does not collect it).

Runs the sequence of tests/gpu/test_model_host_cuda.py::test_load_unload_and_swap_return_cuda_memory
(load ``smol-a``, swap to ``smol-b``, unload, in one coroutine with no yield between the steps)
through :class:`miserver.serving.models.host.ModelHost` with the default model (SmolLM2-135M, bfloat16),
in four scenarios side by side:

- ``fixed/attach-off``: the current code, no trainer token (the failing test's settings);
- ``fixed/attach-on``: the current code with a trainer token (the load is placed in the arena);
- ``old-host/attach-off``: the load's result returned through ``asyncio.to_thread`` as before
  the fix (expected: one model, ~269 MB, still allocated after the unload: the cause);
- ``old-loader/attach-on``: ``model.to(device)`` then the arena, as before (expected: a load
  peak of about two models).

After each unload it prints ``torch.cuda.memory_allocated``; when more than 16 MiB is left it
lists every live CUDA tensor found through ``gc.get_objects()`` (shape, dtype, bytes, and the
types of its referrers two levels up), every live model object with its referrer chain, and the
active blocks of the CUDA allocator's snapshot (which also shows memory that no Python object
holds, such as CUDA IPC handles not yet released). For each load it prints the peak
(``max_memory_allocated`` after ``reset_peak_memory_stats``) against the model's parameter bytes.

Usage (from the repository root, on the CUDA machine)::

    python tests/gpu/diagnose_cuda_unload.py [--home MISERVER_HOME] [--device cuda:0]

The home is, in order: ``--home``, ``MISERVER_TEST_HOME``, ``MISERVER_HOME``, else the tests'
shared ``default_home`` (tests/conftest.py); the default model is imported there if missing.
Exit status 0 when the fixed scenarios leave < 16 MiB and peak below 1.25 models, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import types
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from miserver.serving.models import host as host_module  # noqa: E402
from miserver.serving.models import loader as loader_module  # noqa: E402
from miserver.serving.models.catalogue import Catalogue  # noqa: E402
from miserver.serving.models.default_model import import_default, model_dir  # noqa: E402
from miserver.serving.models.host import ModelHost  # noqa: E402
from miserver.spec.settings import Settings, WeightsToken  # noqa: E402

MIB = 2**20
LEFT_LIMIT = 16 * MIB
TOKEN = WeightsToken(label="diagnose", role="trainer", secret="d" * 32)


def resolve_home(arg: str | None) -> str:
    home = arg or os.environ.get("MISERVER_TEST_HOME") or os.environ.get("MISERVER_HOME")
    if not home:
        from tests.conftest import _cache_key  # the same shared location as the tests

        home = str(
            Path(tempfile.gettempdir()) / f"miserver-test-default-{os.getuid()}-{_cache_key()}"
        )
    import_default(home, progress=False)
    return home


def mib(n: int) -> str:
    return f"{n / MIB:9.2f} MiB"


def describe(obj: Any) -> str:
    """A short, safe description of a referrer."""
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_name} ({Path(obj.f_code.co_filename).name}:{obj.f_lineno})"
    if isinstance(obj, dict):
        keys = [str(k)[:30] for k in list(obj)[:6]]
        return f"dict({len(obj)} keys: {', '.join(keys)})"
    if isinstance(obj, list | tuple | set):
        return f"{type(obj).__name__}(len {len(obj)})"
    if isinstance(obj, types.CellType):
        return "cell"
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__qualname__}"
    if isinstance(obj, types.MethodType):
        return f"bound method {obj.__qualname__}"
    name = type(obj).__module__ + "." + type(obj).__qualname__
    if isinstance(obj, torch.Tensor):
        return f"{name}{tuple(obj.shape)}"
    return name


def referrer_chain(obj: Any, depth: int, ignore: set[int], indent: str = "      ") -> None:
    """Print the referrers of ``obj``, ``depth`` levels up (ignoring this script's own lists)."""
    if depth == 0:
        return
    refs = [
        r
        for r in gc.get_referrers(obj)
        if id(r) not in ignore and not (isinstance(r, types.FrameType) and r.f_code in _OWN_CODE)
    ]
    ignore.add(id(refs))
    ignore.update(id(r) for r in refs)
    for i in range(min(8, len(refs))):  # no slice or enumerate: one more referrer each
        r = refs[i]
        print(f"{indent}<- {describe(r)}")
        referrer_chain(r, depth - 1, ignore, indent + "   ")
    if len(refs) > 8:
        print(f"{indent}   ... {len(refs) - 8} more referrers")


def scan_live_cuda(max_listed: int = 12) -> None:
    """List the live CUDA tensors and model objects, and the allocator's active blocks."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
        warnings.simplefilter("ignore")
        _scan_live_cuda(max_listed)


def _scan_live_cuda(max_listed: int) -> None:
    objects = gc.get_objects()
    ignore = {id(objects), id(sys._getframe())}
    tensors = [o for o in objects if isinstance(o, torch.Tensor) and o.is_cuda]
    models = [
        o
        for o in objects
        if isinstance(o, torch.nn.Module) and type(o).__name__.endswith("ForCausalLM")
    ]
    ignore.update({id(tensors), id(models)})
    del objects
    storages: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    print(
        f"    live CUDA tensors (gc.get_objects): {len(tensors)}, on {len(storages)} storages "
        f"totalling {mib(sum(storages.values()))}"
    )
    for t in tensors[:max_listed]:
        print(
            f"    - {type(t).__name__} shape={tuple(t.shape)} dtype={t.dtype} "
            f"bytes={t.numel() * t.element_size()} storage={t.untyped_storage().nbytes()} "
            f"ptr={t.untyped_storage().data_ptr():#x}"
        )
        referrer_chain(t, 2, ignore)
    if len(tensors) > max_listed:
        print(f"    ... {len(tensors) - max_listed} more CUDA tensors")
    print(f"    live *ForCausalLM objects: {len(models)}")
    for m in models:
        print(f"    - {describe(m)} at {id(m):#x}")
        referrer_chain(m, 4, ignore)
    del tensors, models
    active = []
    for seg in torch.cuda.memory_snapshot():
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                active.append((b["size"], seg.get("segment_pool_id"), seg["address"]))
    active.sort(reverse=True)
    print(f"    allocator active blocks: {len(active)}, {mib(sum(a[0] for a in active))}")
    for size, pool, address in active[:10]:
        print(f"      {mib(size)} pool={pool} segment={address:#x}")


_OWN_CODE = {referrer_chain.__code__, _scan_live_cuda.__code__}


def param_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def old_place_model(model: torch.nn.Module, settings: Settings, device: torch.device) -> Any:
    """The loader before the fix: move the model to the card, then into the arena."""
    model.to(device)
    return loader_module.make_attachable(model, settings)


async def scenario(name: str, home: str, device: str, attach: bool) -> dict[str, Any]:
    """The failing test's sequence; returns the measurements."""
    print(f"\n=== {name} ===")
    tmp = tempfile.mkdtemp(prefix="miserver-diagnose-")
    cat = Catalogue(tmp)
    for row_name in ("smol-a", "smol-b"):
        cat.register(
            name=row_name, format="safetensors", dtype="bfloat16", path=str(model_dir(home))
        )
    settings = Settings(home=tmp, device=device, weights_tokens=(TOKEN,) if attach else ())
    host = ModelHost(settings, cat)
    dev = torch.device(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(dev)
    baseline = torch.cuda.memory_allocated(dev)
    print(f"  baseline allocated {mib(baseline)}")
    out: dict[str, Any] = {"name": name}

    torch.cuda.reset_peak_memory_stats(dev)
    resident = await host.ensure_for_request("smol-a")
    torch.cuda.synchronize(dev)
    one = param_bytes(resident.model)
    out["params"] = one
    out["peak_load"] = torch.cuda.max_memory_allocated(dev) - baseline
    out["after_load"] = torch.cuda.memory_allocated(dev) - baseline
    print(
        f"  load a:   params {mib(one)}  allocated {mib(out['after_load'])}  "
        f"peak {mib(out['peak_load'])}  ({out['peak_load'] / one:.2f} x params)  "
        f"attachable={resident.attachable}"
    )
    del resident

    torch.cuda.reset_peak_memory_stats(dev)
    await host.ensure_for_request("smol-b")  # a swap, same task step as the load of a
    torch.cuda.synchronize(dev)
    out["peak_swap"] = torch.cuda.max_memory_allocated(dev) - baseline
    out["after_swap"] = torch.cuda.memory_allocated(dev) - baseline
    print(
        f"  swap b:   allocated {mib(out['after_swap'])}  peak {mib(out['peak_swap'])}  "
        f"({out['peak_swap'] / one:.2f} x params)"
    )

    await host.unload()
    torch.cuda.synchronize(dev)
    out["after_unload"] = torch.cuda.memory_allocated(dev) - baseline
    print(
        f"  unload:   allocated above baseline {mib(out['after_unload'])}  "
        f"(memory_allocated {torch.cuda.memory_allocated(dev)}, "
        f"reserved {mib(torch.cuda.memory_reserved(dev))})"
    )
    if out["after_unload"] > LEFT_LIMIT:
        print("  MORE THAN 16 MiB LEFT: what holds it")
        scan_live_cuda()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", help="a MISERVER_HOME with the default model imported")
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    home = resolve_home(args.home)
    print(f"home {home}; torch {torch.__version__}; {torch.cuda.get_device_name(args.device)}")
    results = []
    results.append(asyncio.run(scenario("fixed/attach-off", home, args.device, attach=False)))
    results.append(asyncio.run(scenario("fixed/attach-on", home, args.device, attach=True)))

    real_run = host_module.run_without_keeping
    host_module.run_without_keeping = asyncio.to_thread  # type: ignore[assignment]
    try:
        results.append(
            asyncio.run(scenario("old-host/attach-off", home, args.device, attach=False))
        )
    finally:
        host_module.run_without_keeping = real_run
    gc.collect()

    real_place = loader_module.place_model
    loader_module.place_model = old_place_model  # type: ignore[assignment]
    try:
        results.append(
            asyncio.run(scenario("old-loader/attach-on", home, args.device, attach=True))
        )
    finally:
        loader_module.place_model = real_place
    gc.collect()
    torch.cuda.empty_cache()

    print("\nscenario               load peak   swap peak   left after unload   (x params)")
    ok = True
    for r in results:
        one = r["params"]
        print(
            f"{r['name']:<22} {r['peak_load'] / one:9.2f}   {r['peak_swap'] / one:9.2f}   "
            f"{mib(r['after_unload'])}"
        )
        if r["name"].startswith("fixed"):
            ok &= r["after_unload"] < LEFT_LIMIT
            ok &= r["peak_load"] < 1.25 * one and r["peak_swap"] < 1.25 * one
    print("RESULT:", "ok (fixed scenarios free everything, one copy at a time)" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
