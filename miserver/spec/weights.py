"""Request and response bodies of the weights routes as msgspec Structs.

Field names are exactly the weights page's (``weights-attachment-and-step-barrier.md``: Routes,
Status, Rebuilding the tensors) and the companion contract's (section 5 checkpoints, section 6
adapters, section 8 CPU shared memory). Each body is the ``data`` of the management envelope
``{"success", "data", "error"}``. Times are RFC 3339 UTC strings (``2026-10-17T09:30:00.123Z``);
durations carry their unit in the name (``_ms``, ``_s``). Nothing here imports torch or aiohttp.

A request body with an unknown field is refused (``forbid_unknown_fields``); the routes whose
body the page does not define accept an empty body or ``{}`` (:class:`EmptyRequest`).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

WeightsStateName = Literal["clean", "writing", "torn"]
BarrierName = Literal["serving", "quiesced"]
AttachmentStateName = Literal["active", "stale"]
Role = Literal["trainer", "operator"]


class _Body(msgspec.Struct, kw_only=True, omit_defaults=False):
    pass


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


# --- requests -------------------------------------------------------------------------------
class EmptyRequest(_Request):
    """The body of detach, heartbeat, resume, commit-end and clear-stale: nothing (or
    ``{}``). The caller is the token and X-miLLM-Attachment. Attach, quiesce and commit-begin
    take an optional body (:class:`AttachRequest`, :class:`QuiesceRequest`,
    :class:`CommitBeginRequest`)."""


class AttachRequest(_Request):
    """POST /api/weights/attach (contract 10). No body, ``{}`` or ``{"transport": "cuda_ipc"}``:
    the weights page's attach (``cpu_shared_memory`` storages for a CPU arena, contract 8).
    ``{"transport": "process_group", "init_method": "tcp://HOST:PORT", "world_size": W,
    "rank": R}``: the trainer hosts the rendezvous as rank 0 and names this server's rank
    (1..W-1); the three fields are required then, and refused otherwise."""

    transport: Literal["cuda_ipc", "process_group"] = "cuda_ipc"
    init_method: str | None = None
    world_size: int | None = None
    rank: int | None = None


class CommitBeginRequest(_Request):
    """POST /api/weights/commit-begin. No body or ``{}``: every transport. ``{"ranges":
    [[offset, length], ...]}`` (process-group attachments only, contract 10): receive only
    those byte ranges of the arena (offsets into its storages taken in storage order), in that
    order, instead of every storage whole."""

    ranges: list[list[int]] | None = None


class QuiesceRequest(_Request):
    """POST /api/weights/quiesce (contract 4b). No body, ``{}`` or ``{"running": "finish"}``:
    the weights page's drain (the running sequences finish first). ``{"running": "hold"}``:
    the engine stops at the next step boundary and parks the running sequences; they continue
    after the hold ends, each prefilled again on the weights of that time."""

    running: Literal["finish", "hold"] = "finish"


class SaveRequest(_Request):
    """POST /api/weights/save (contract 5). ``name`` defaults to
    ``<parent name>-step<steps_since_load>-<first 8 of sha256>``: the parent is the checkpoint
    the served weights were loaded from, else the base row (issue 32, item 1)."""

    name: str | None = None


class LoadRequest(_Request):
    """POST /api/weights/load (contract 5): exactly one of ``checkpoint`` (sha256, name or
    path) or ``model_id`` (reload that catalogue row inside the barrier)."""

    checkpoint: str | None = None
    model_id: int | None = None

    def __post_init__(self) -> None:
        if (self.checkpoint is None) == (self.model_id is None):
            raise ValueError("give exactly one of checkpoint or model_id")


class AdapterRequest(_Request):
    """POST /api/weights/adapter (contract 6): a PEFT LoRA adapter folder to apply, unmerged."""

    name: str
    path: str


# --- shared pieces ----------------------------------------------------------------------------
class ModelRef(_Body):
    """``{model_id, name, manifest_hash}`` of the catalogue row whose weights are resident:
    the base tensors' row, also while an adapter is applied (after a checkpoint load, that
    checkpoint's row and name); ``manifest_hash`` is null unless loaded from a checkpoint
    manifest (weights page: Routes, Status)."""

    model_id: int
    name: str
    manifest_hash: str | None


class HeartbeatInfo(_Body):
    """The staleness window (WEIGHTS_HEARTBEAT_TIMEOUT_S) and the suggested interval
    (WEIGHTS_HEARTBEAT_INTERVAL_HINT_S), seconds."""

    timeout_s: float
    interval_hint_s: float


class Producer(_Body):
    """The exporting build: ``torch`` version, ``cuda`` build version, ``driver`` version."""

    torch: str
    cuda: str | None
    driver: str | None


class CudaIpcStorage(msgspec.Struct, kw_only=True, tag_field="kind", tag="cuda_ipc"):
    """One CUDA storage: the fields ``torch.multiprocessing.reductions.reduce_tensor`` emits,
    byte fields base64 (weights page: Rebuilding the tensors). Sizes and offsets in bytes."""

    device_index: int
    device_uuid: str
    handle: str
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str | None
    event_sync_required: bool


class CpuSharedMemoryStorage(
    msgspec.Struct, kw_only=True, tag_field="kind", tag="cpu_shared_memory"
):
    """One CPU shared-memory storage (contract 8): the ``file_system`` strategy's
    ``(manager_handle, storage_handle, size)``, byte fields base64; devices are null."""

    manager_handle: str
    storage_handle: str
    storage_size_bytes: int
    device_index: int | None = None
    device_uuid: str | None = None


class ProcessGroupStorage(msgspec.Struct, kw_only=True, tag_field="kind", tag="process_group"):
    """One arena storage written by the process-group transport (contract 10): its size, its
    device and the dtypes laid out in it; no handle (nothing is exported). ``device_type`` is
    ``cpu`` (the group is gloo) or ``cuda`` (NCCL); ``device_index`` and ``device_uuid`` are
    null on the CPU."""

    storage_size_bytes: int
    device_type: Literal["cpu", "cuda"]
    device_index: int | None
    device_uuid: str | None
    dtypes: list[str]


class ParameterEntry(msgspec.Struct, kw_only=True):
    """One parameter as a view of ``storages[storage]``: ``dtype`` (``float16`` or
    ``bfloat16``), ``shape``, ``stride`` and ``storage_offset`` in elements. Tied names share a
    storage; ``tied_to`` names the first name of the same tensor."""

    name: str
    storage: int
    dtype: str
    shape: list[int]
    stride: list[int]
    storage_offset: int
    requires_grad: bool
    tied_to: str | None = None


class Release(_Body):
    """``pinned_bytes`` stay reserved until every handle is rebuilt once and released;
    ``contract`` states the release order (weights page: Releasing the handles)."""

    pinned_bytes: int
    contract: str


TransportName = Literal["cuda_ipc", "cpu_shared_memory", "process_group"]


class ProcessGroupInfo(_Body):
    """The attachment's process group (contract 10): the rendezvous it joined, its backend
    (``gloo`` for a CPU arena, ``nccl`` for a CUDA one), ``group_state`` (``connecting`` until
    every rank joined, ``ready``, ``failed`` with ``error``, ``destroyed`` after a tear),
    the receives armed and the bytes received."""

    backend: Literal["gloo", "nccl"]
    init_method: str
    world_size: int
    rank: int
    group_state: Literal["connecting", "ready", "failed", "destroyed"]
    error: str | None
    receives: int
    received_bytes: int


class AttachmentInfo(_Body):
    """The status route's attachment block; never the attachment ID. ``transport``: how the
    trainer writes the weights (``cuda_ipc``, ``cpu_shared_memory``, ``process_group``);
    ``process_group``: that group, null for the other transports."""

    state: AttachmentStateName
    role: Role
    label: str
    attached_at: str
    last_heartbeat_at: str | None
    stale_since: str | None
    transport: TransportName | None = None
    process_group: ProcessGroupInfo | None = None


class CommitInfo(_Body):
    """An open or torn commit: ``open_ms`` so far, ``watchdog_ms``, ``overran``."""

    began_at: str
    open_ms: float
    watchdog_ms: float
    overran: bool


class LastSave(_Body):
    checkpoint_sha256: str
    at: str
    path: str


class LastOverrun(_Body):
    """The last late commit-end: when, and how long the commit was open."""

    at: str
    commit_ms: float


class CudaMemory(_Body):
    """What miserver's CUDA allocator reports for one card, MiB."""

    device_index: int
    allocated_mb: float
    reserved_mb: float
    #: What the continuous engine's CUDA decode graphs allocated on this card when they were
    #: captured (issue 13; ``DECODE_GRAPHS``); 0 without graphs. Included in allocated/reserved.
    decode_graphs_mb: float = 0.0
    #: The continuous engine's paged KV cache on this card (``KV_CACHE_BYTES``, issue 29),
    #: allocated once at load; included in allocated/reserved. 0 without an engine.
    kv_cache_mb: float = 0.0


class AdapterBlock(_Body, omit_defaults=True):
    """GET /api/weights/adapter (contract 6): ``{applied: false}`` or the applied adapter
    ``{applied: true, name, path, rank, alpha, target_modules, applied_at}``.

    The same object everywhere (weights page: Status, ``adapter``): the status route and the
    adapter routes encode it alike, so ``{applied: false}`` carries no null fields.
    """

    applied: bool
    name: str | None = None
    path: str | None = None
    rank: int | None = None
    alpha: float | None = None
    target_modules: list[str] | None = None
    applied_at: str | None = None


# --- responses ------------------------------------------------------------------------------
class AttachResponse(_Body):
    """POST /api/weights/attach. ``attachment_id`` is returned once, here only."""

    attachment_id: str
    model: ModelRef
    weights_state: WeightsStateName
    steps_since_load: int
    heartbeat: HeartbeatInfo
    producer: Producer
    storages: list[CudaIpcStorage | CpuSharedMemoryStorage | ProcessGroupStorage]
    parameters: list[ParameterEntry]
    release: Release
    config: dict[str, Any] | None


class DetachResponse(_Body):
    weights_state: WeightsStateName
    barrier: BarrierName


class HeartbeatResponse(_Body):
    attachment_state: AttachmentStateName
    timeout_s: float
    interval_hint_s: float
    weights_state: WeightsStateName


class QuiesceResponse(_Body):
    """POST /quiesce, returned once no forward pass runs. ``hold_deadline``: when the hold
    resumes on its own unless commit-begin or resume comes first. ``parked_sequences``: the
    running sequences a ``{"running": "hold"}`` parked (a request with ``n`` choices counts
    ``n``); 0 for a ``finish`` quiesce (contract 4b)."""

    held_requests: int
    held_batch_chunks: int
    parked_sequences: int
    weights_state: WeightsStateName
    quiesced_at: str
    hold_deadline: str | None


class ResumeResponse(_Body):
    barrier: BarrierName
    weights_state: WeightsStateName


class CommitBeginResponse(_Body):
    weights_state: WeightsStateName
    began_at: str
    watchdog_ms: float


class CommitEndResponse(_Body):
    """``overran``: the commit ended after the watchdog tore it (recorded in last_overrun)."""

    weights_state: WeightsStateName
    steps_since_load: int
    commit_ms: float
    overran: bool


class ClearedAttachment(_Body):
    role: Role
    label: str
    stale_since: str | None


class ClearStaleResponse(_Body):
    cleared: ClearedAttachment
    weights_state: WeightsStateName
    barrier: BarrierName


class StatusResponse(_Body):
    """GET /api/weights/status (weights page: Status). Never an attachment ID or a token."""

    attached: bool
    attachment: AttachmentInfo | None
    barrier: BarrierName
    quiesced_at: str | None
    held_requests: int | None
    parked_sequences: int | None
    weights_state: WeightsStateName
    resident_model: ModelRef | None
    steps_since_load: int | None
    last_save: LastSave | None
    commit: CommitInfo | None
    commit_overran: str | None
    last_hold_timeout_at: str | None
    last_overrun: LastOverrun | None
    pause_unavailable: Literal["cbm", "concurrency"] | None
    adapter: AdapterBlock | None
    cuda_memory: list[CudaMemory] | None
    exports_since_start: int


class SaveResponse(_Body):
    """POST /api/weights/save (contract 5): the checkpoint written and its catalogue row."""

    checkpoint_sha256: str
    name: str
    path: str
    model_id: int
    parent_id: int | None
    steps_since_load: int
    at: str


class LoadResponse(_Body):
    """POST /api/weights/load (contract 5). ``in_place``: written into the existing storages
    (allocates nothing) rather than a full reload."""

    weights_state: WeightsStateName
    steps_since_load: int
    in_place: bool
    model: ModelRef


class LineageEntry(_Body):
    """One link of the resident's chain back to its base row (contract 5)."""

    model_id: int
    name: str
    origin: Literal["model", "checkpoint"]
    parent_id: int | None
    checkpoint_sha256: str | None
    steps_since_load: int | None
    created_at: str


class LineageResponse(_Body):
    """GET /api/weights/lineage: ``chain[0]`` is the resident, the last entry its base row."""

    chain: list[LineageEntry]


class CheckpointsResponse(_Body):
    """GET /api/weights/checkpoints: every checkpoint in the catalogue."""

    checkpoints: list[LineageEntry]


class WeightSpan(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One entry of a ``/v1`` choice's ``millm_weight_spans`` (contract 4; issue 30): ``tokens``
    consecutive tokens of the choice produced by the parameter set whose ``X-miLLM-Model``
    ``commits`` is ``commits`` (absent where not known, never 0 for unknown). A choice carries
    the list, in order, only when its tokens span more than one set (a sequence held across a
    commit with ``{"running": "hold"}``); a stream carries it on the choice's terminal chunk,
    the Batch API on the output line."""

    commits: int | msgspec.UnsetType = msgspec.UNSET
    tokens: int


#: The ``/v1`` extension fields described beside the routes in the JSON schema's ``$defs``.
V1_EXTENSIONS: dict[str, Any] = {"MillmWeightSpans": list[WeightSpan]}


#: Route -> (request body, response data) for the docs and the JSON schema generator.
ROUTES: dict[str, tuple[type[msgspec.Struct] | None, type[msgspec.Struct]]] = {
    "POST /api/weights/attach": (AttachRequest, AttachResponse),
    "POST /api/weights/detach": (EmptyRequest, DetachResponse),
    "POST /api/weights/heartbeat": (EmptyRequest, HeartbeatResponse),
    "POST /api/weights/quiesce": (QuiesceRequest, QuiesceResponse),
    "POST /api/weights/resume": (EmptyRequest, ResumeResponse),
    "POST /api/weights/commit-begin": (CommitBeginRequest, CommitBeginResponse),
    "POST /api/weights/commit-end": (EmptyRequest, CommitEndResponse),
    "POST /api/weights/clear-stale": (EmptyRequest, ClearStaleResponse),
    "GET /api/weights/status": (None, StatusResponse),
    "POST /api/weights/save": (SaveRequest, SaveResponse),
    "POST /api/weights/load": (LoadRequest, LoadResponse),
    "GET /api/weights/lineage": (None, LineageResponse),
    "GET /api/weights/checkpoints": (None, CheckpointsResponse),
    "GET /api/weights/adapter": (None, AdapterBlock),
    "POST /api/weights/adapter": (AdapterRequest, AdapterBlock),
    "DELETE /api/weights/adapter": (None, AdapterBlock),
}
