"""Configuration: environment variables and ``miserver serve`` flags (contract section 1).

Every value is validated at start; :func:`load_settings` raises :class:`ConfigError` naming the
variable, and the CLI turns that into one line on stderr and exit status 2. A secret never appears
in an error message or a ``repr``.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

import msgspec

ROLES = ("trainer", "operator")
LABEL_RE = re.compile(r"^[a-z0-9_-]{1,64}$")
MIN_SECRET_LEN = 16


class ConfigError(ValueError):
    """A configuration value is invalid. ``variable`` names it; the message never holds a secret."""

    def __init__(self, variable: str, problem: str) -> None:
        super().__init__(f"{variable}: {problem}")
        self.variable = variable
        self.problem = problem


class WeightsToken(msgspec.Struct, frozen=True):
    """One bearer token: ``label:role:secret`` (contract section 1)."""

    label: str
    role: str
    secret: str

    def __repr__(self) -> str:  # never show the secret
        return f"WeightsToken(label={self.label!r}, role={self.role!r}, secret=***)"

    __str__ = __repr__


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """The validated configuration of one server process. Times are seconds unless ``_ms``."""

    home: str
    host: str = "127.0.0.1"
    port: int = 8000
    unix_socket: str | None = None
    default_model: str = "smollm2-135m-instruct"
    device: str = "auto"
    weights_tokens: tuple[WeightsToken, ...] = ()
    weights_hold_timeout_s: float = 5.0
    weights_commit_watchdog_ms: float = 800.0
    weights_heartbeat_timeout_s: float = 30.0
    weights_quiesce_drain_timeout_s: float = 60.0
    weights_heartbeat_interval_hint_s: float = 5.0
    weights_cpu_attach: bool = False
    weights_audit_log: str | None = None
    max_concurrent_requests: int = 1
    #: None: ``auto``, the measured default of the device (8 on the CPU, 64 on CUDA).
    max_batch_size: int | None = None
    #: None: ``auto``, the measured default of the device (0 on both: no delay).
    max_batch_delay_ms: float | None = None
    decode_graphs: str = "captured"
    continuous_batching: bool = False
    #: None: ``auto``, the CPU cores this process may run on (``os.sched_getaffinity``).
    gguf_threads: int | None = None
    max_queued_requests: int = 64
    max_request_bytes: int = 8 * 1024 * 1024
    header_read_timeout_s: float = 20.0
    body_read_timeout_s: float = 20.0
    shutdown_grace_s: float = 10.0
    management_auth: str = "none"
    v1_load_policy: str = "auto"
    log_level: str = "info"
    log_format: str = "json"

    def __repr__(self) -> str:
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        fields["weights_tokens"] = [f"{t.label}:{t.role}:***" for t in self.weights_tokens]
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"

    @property
    def has_trainer_token(self) -> bool:
        """At least one trainer token is configured (a 16-bit load is then made attachable;
        weights page, Which models can be attached: ``allocator``)."""
        return any(token.role == "trainer" for token in self.weights_tokens)

    def training_warning(self, max_concurrent: int | None = None) -> str | None:
        """The warning that training is impossible, or None (issue 32, item 5): with a
        trainer token configured and ``max_concurrent`` (default ``MAX_CONCURRENT_REQUESTS``;
        the run-time value after a ``PATCH /api/settings``) above 1, the step barrier is off
        (weights page, The write cycle 2: status ``pause_unavailable: "concurrency"``), so
        every quiesce, save and weights load is 409 BARRIER_UNAVAILABLE. One line, logged at
        start and listed in ``GET /api/health/detailed``'s ``warnings``."""
        concurrency = self.max_concurrent_requests if max_concurrent is None else max_concurrent
        if concurrency <= 1 or not self.has_trainer_token:
            return None
        return (
            f"MAX_CONCURRENT_REQUESTS is {concurrency} and a trainer token is configured, but "
            "the step barrier needs 1: every quiesce, save and weights load is 409 "
            "BARRIER_UNAVAILABLE (reason concurrency), so no trainer can write the served "
            "weights; set MAX_CONCURRENT_REQUESTS=1 (or PATCH /api/settings "
            '{"max_concurrent_requests": 1})'
        )

    def resolved_device(self) -> str:
        """``auto`` becomes ``cuda:0`` when CUDA is available, else ``cpu``."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"


# (variable, field, kind) in the order they are validated.
VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("MISERVER_HOME", "home", "path"),
    ("HOST", "host", "str"),
    ("PORT", "port", "port"),
    ("UNIX_SOCKET", "unix_socket", "socket_path"),
    ("DEFAULT_MODEL", "default_model", "str0"),
    ("DEVICE", "device", "device"),
    ("WEIGHTS_HOLD_TIMEOUT_S", "weights_hold_timeout_s", "pos_float"),
    ("WEIGHTS_COMMIT_WATCHDOG_MS", "weights_commit_watchdog_ms", "pos_float"),
    ("WEIGHTS_HEARTBEAT_TIMEOUT_S", "weights_heartbeat_timeout_s", "pos_float"),
    ("WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S", "weights_quiesce_drain_timeout_s", "pos_float"),
    ("WEIGHTS_HEARTBEAT_INTERVAL_HINT_S", "weights_heartbeat_interval_hint_s", "pos_float"),
    ("WEIGHTS_CPU_ATTACH", "weights_cpu_attach", "bool"),
    ("WEIGHTS_AUDIT_LOG", "weights_audit_log", "opt_path"),
    ("MAX_CONCURRENT_REQUESTS", "max_concurrent_requests", "pos_int"),
    ("MAX_BATCH_SIZE", "max_batch_size", "batch_size"),
    ("MAX_BATCH_DELAY_MS", "max_batch_delay_ms", "batch_delay"),
    ("DECODE_GRAPHS", "decode_graphs", "decode_graphs"),
    ("CONTINUOUS_BATCHING", "continuous_batching", "bool"),
    ("GGUF_THREADS", "gguf_threads", "threads"),
    ("MAX_QUEUED_REQUESTS", "max_queued_requests", "pos_int"),
    ("MAX_REQUEST_BYTES", "max_request_bytes", "pos_int"),
    ("HEADER_READ_TIMEOUT_S", "header_read_timeout_s", "pos_float"),
    ("BODY_READ_TIMEOUT_S", "body_read_timeout_s", "pos_float"),
    ("SHUTDOWN_GRACE_S", "shutdown_grace_s", "nonneg_float"),
    ("MANAGEMENT_AUTH", "management_auth", "management_auth"),
    ("V1_LOAD_POLICY", "v1_load_policy", "load_policy"),
    ("LOG_LEVEL", "log_level", "log_level"),
    ("LOG_FORMAT", "log_format", "log_format"),
)

#: How each kind of value is written, as the settings reference (docs/settings.md) and
#: ``miserver serve --help`` show it.
KIND_FORMATS: dict[str, str] = {
    "path": "a path (not empty)",
    "str": "a string (not empty)",
    "str0": "a string; empty for none",
    "port": "an integer 0 to 65535 (0: any free port)",
    "device": "`auto`, `cpu`, `cuda` or `cuda:N`",
    "pos_float": "a positive number",
    "pos_int": "an integer, at least 1",
    "bool": "`1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off`, empty (case-insensitive)",
    "opt_path": "a path; empty or unset for none",
    "socket_path": "a path of at most 107 bytes in an existing directory; empty or unset for none",
    "log_level": "`debug`, `info`, `warning`, `error` or `critical`",
    "log_format": "`json` or `text`",
    "decode_graphs": "`captured`, `compiled` or `off` (case-insensitive)",
    "batch_size": "`auto` or an integer 1 to 256",
    "threads": "`auto` or an integer 1 to 1024",
    "batch_delay": "`auto` or a number of milliseconds, 0 to 1000 (0: no delay)",
    "nonneg_float": "a number, at least 0",
    "management_auth": "`none` or `operator`",
    "load_policy": "`auto` or `refuse` (case-insensitive)",
}

#: What each variable of :data:`VARIABLES` does, for the settings reference (docs/settings.md,
#: generated by ``miserver docs``) and ``miserver serve --help``. A variable added to
#: :data:`VARIABLES` appears there by itself; its entry here is its effect (a test requires one).
DESCRIPTIONS: dict[str, str] = {
    "MISERVER_HOME": "Where the data lives: the catalogue (`catalogue.sqlite3`), the imported "
    "default model (`models/`), checkpoints and batch files. Default: the platform's user data "
    "dir plus `/miserver`, shared by every checkout; set it per project to keep them apart.",
    "HOST": "The address to listen on. `0.0.0.0` listens on every interface: put the server "
    "behind a network boundary and configure tokens first.",
    "PORT": "The TCP port to listen on.",
    "UNIX_SOCKET": "Also listen on this Unix domain socket (the same routes, tokens and "
    "answers as the TCP port), for a trainer on the same host: "
    "`WeightsClient(base_url, token, unix_socket=PATH)` sends its calls there, each about 5 % "
    "cheaper than over loopback TCP on an H200 (docs/benchmarks.md, issue 15). The socket file "
    "is created mode 0660: only the server's user and group may connect (connecting needs write "
    "permission on the file itself), so run the trainer as that user or in that group; keep it "
    "in a directory only they can write. It is removed at shutdown; a socket file nobody "
    "listens on (a server that is gone) is replaced; a path a live server listens on, one that "
    "is not a socket, or one the server cannot probe stops the start (exit 1, one line). "
    "A relative path is taken from the server's working directory (the log names the full "
    "path). Empty: TCP only.",
    "DEFAULT_MODEL": "The catalogue name loaded at start (the embedded SmolLM2-135M-Instruct "
    "is imported on first use). Empty: start with nothing resident.",
    "DEVICE": "Where models are loaded: `auto` is `cuda:0` when CUDA is available, else `cpu`.",
    "WEIGHTS_HOLD_TIMEOUT_S": "A quiesce left open without commit-begin or resume resumes "
    "serving on its own after this many seconds (only while the weights are clean); status "
    "records `last_hold_timeout_at`. Suspended while a commit is open or a save or adapter "
    "change holds the barrier; restarted in full by commit-end.",
    "WEIGHTS_COMMIT_WATCHDOG_MS": "A commit open longer than this many milliseconds makes the "
    "weights torn (every /v1 call 503 until recovered). A late commit-end from the same "
    "attachment still returns clean with `overran: true`. Sized for GPUs (ten times a measured "
    "99.9th-percentile commit); a CPU optimizer step needs far more (the README uses 30000).",
    "WEIGHTS_HEARTBEAT_TIMEOUT_S": "No heartbeat for this many seconds: the attachment is "
    "stale. Stale changes nothing about serving, but blocks a new attach and model loads until "
    "the holder heartbeats again or an operator calls `POST /api/weights/clear-stale`.",
    "WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S": "How long quiesce (and a save, a weights load, an "
    "adapter change or a model transition) waits for running requests to finish; past it the "
    "call is 409 MODEL_BUSY (reason `drain_timeout`) and nothing is held.",
    "WEIGHTS_HEARTBEAT_INTERVAL_HINT_S": "The heartbeat interval the attach and heartbeat "
    "answers suggest (`interval_hint_s`); `miserver.trainer` heartbeats at it. Must be below "
    "WEIGHTS_HEARTBEAT_TIMEOUT_S.",
    "WEIGHTS_CPU_ATTACH": "On a CPU server, load models attachably in shared memory, so a "
    "trainer process on the same machine can attach (without it, attach on the CPU is 400 "
    "NOT_ATTACHABLE, reason `not_on_gpu`). Takes effect at the next load.",
    "WEIGHTS_AUDIT_LOG": "Also append every `weights_audit` line (who called which weights "
    "route, the outcome) to this file, flushed per line. The lines always go to the log.",
    "MAX_CONCURRENT_REQUESTS": "Forward passes that may run at once. The step barrier needs 1 "
    "(otherwise quiesce is 409 BARRIER_UNAVAILABLE, reason `concurrency`; with a trainer token "
    "configured, one warning line at start and in `GET /api/health/detailed`'s `warnings`). "
    "Also changeable at run time with `PATCH /api/settings`.",
    "MAX_BATCH_SIZE": "Sequences one pass of the slot decodes together (a static batch, "
    "contract 4): when the slot is granted it takes the waiting requests of the resident model, "
    "interactive first, then batch rows, up to this many sequences (a request with `n` counts "
    "`n`), and decodes them one forward pass a token until the last one ends; it is also the "
    "largest `n` a request may ask for. `auto`: 8 on the CPU (two cores: 16 concurrent chats of "
    "32 tokens finished 3.5x sooner than at 1, a step of 8 sequences 1.4x a step of one), 64 on "
    "CUDA (an H200, SmolLM2-135M: a graph step of 64 sequences 5.3 ms against 3.3 ms for one, "
    "tokens a second 40x; 1.4x the throughput of 32 for 1.2x the step; docs/benchmarks.md); the "
    "rows of the batch cache are cut to a quarter of the card's free memory. A batch is one "
    "holder of the slot: a quiesce drains it as it drains one request.",
    "MAX_BATCH_DELAY_MS": "How long a free slot waits for more requests to join its static "
    "batch (a max batch delay, as in TorchServe or Triton's dynamic batcher): a request that "
    "finds the slot free is granted it once `MAX_BATCH_SIZE` sequences wait, once no further "
    "request has arrived for this many milliseconds, or at the latest ten times this long after "
    "it arrived. A lone request pays the delay once; clients that start together share one "
    "batch instead of the first taking the slot alone and the rest waiting for it to end. A slot "
    "freed with work already waiting is granted at once, and a quiesce never waits for a "
    "gathering slot (its requests are held). `auto`: 10 on CUDA, 0 (no delay) on the CPU. "
    'Measured (docs/benchmarks.md, "The static batch"): on an H200, 64 chat clients (one process '
    "each, sending within 7-12 ms) at `MAX_BATCH_SIZE` 64 formed one batch at 10 and at 20 in "
    "every run (0.42-0.53 s against 0.64-0.75 s without a delay: two batches, the first request "
    "alone, then 63), at 5 in one run of three, never at 2; a lone request pays the 10 ms once, "
    "about two decode steps of a batch of 64. On the CPU a delay made no gain for 16 clients "
    "(12.4 s without, 14.8 and 30.5 s at 5 and 20), and 4 chats sent at once became one batch "
    "only at 50-100. "
    "No effect when `MAX_BATCH_SIZE` is 1.",
    "DECODE_GRAPHS": "How a CUDA resident runs its decode step: `captured` (the default: one "
    "CUDA graph per KV-cache length bucket, replayed over the served storages, captured at load), "
    "`compiled` (the same through `torch.compile`: faster steps, a compile per bucket at load, "
    "cached under `MISERVER_HOME/compile-cache`), or `off` (one eager forward pass a token). On "
    "the CPU decoding is always eager, said once in the log. A build or capture that fails "
    "falls back to eager with one warning and `miserver_decode_graph_fallbacks_total`.",
    "HEADER_READ_TIMEOUT_S": "A connection whose request head (request line and headers) has not "
    "arrived this many seconds after it opened, or after the first byte of a later request's "
    "head, is answered 408 (JSON) and closed. Idle keep-alive connections are not affected.",
    "BODY_READ_TIMEOUT_S": "A request whose body is still incomplete and from which no byte "
    "arrived for this many seconds is answered 408 (JSON) and its connection closed. A pause, "
    "not a total: a large upload that keeps flowing is never cut.",
    "SHUTDOWN_GRACE_S": "After SIGTERM, how long running and queued requests may take to finish "
    "before they are ended with 503 SHUTTING_DOWN (0: end them at once). Keep it below "
    "Kubernetes' `terminationGracePeriodSeconds`.",
    "MANAGEMENT_AUTH": "`none` (the default: management routes are open, as the weights page "
    "says) or `operator`: every mutating management route, the adapter routes "
    "(`POST`/`DELETE /api/weights/adapter`) included, and every Batch API route, its reads "
    "(`GET /v1/files...`, `GET /v1/batches...`) included, needs an operator token (401/403 as "
    "the weights routes, one audit line per call, per refused read), and a `/v1` request "
    "naming a model that is not "
    "resident is 409 `model_not_loaded` instead of an auto-load unless it carries one; needs "
    "an operator token in `WEIGHTS_TOKENS` (else exit 2).",
    "V1_LOAD_POLICY": "Whether a `/v1` request may load a model: `auto` (the default, "
    "contract 4) loads (swaps to) a catalogue row the request names that is not resident; "
    "`refuse` never does, for every request, an operator token included: it is 409 "
    "`model_not_loaded` (as `X-miLLM-Load-Policy: refuse` is for one request), naming the "
    "served model and the management call that loads the one named "
    "(`POST /api/models/{id}/load`). Requests naming the resident are served as usual; the "
    "Batch API never loads either way. For a shared server whose clients must not swap the "
    "model out from under each other.",
    "CONTINUOUS_BATCHING": "The weights page's cbm: `1` rules hot updates out. `GET "
    "/api/weights/status` reports `pause_unavailable: cbm`; quiesce, a weights load and an "
    "adapter change are 409 `BARRIER_UNAVAILABLE` (reason `cbm`) and attach is 400 "
    "`NOT_ATTACHABLE` (reason `continuous_batching_running`). For an operator who serves and "
    "never trains in place; the engine batches either way. Also changeable with "
    "`PATCH /api/settings` (409 `MODEL_BUSY` while the barrier is held or a commit is open).",
    "GGUF_THREADS": "CPU threads llama.cpp uses for a GGUF resident (format `gguf`, section 4a "
    "of the contract): `auto` is the cores this process may run on (its CPU affinity, so a "
    "container's CPU set counts); read at each load of a GGUF row.",
    "MAX_QUEUED_REQUESTS": "Interactive requests that may wait (queued plus held by the "
    "barrier); beyond it a request is 503 QUEUE_FULL with `Retry-After`. Also changeable with "
    "`PATCH /api/settings`.",
    "MAX_REQUEST_BYTES": "Request bodies larger than this many bytes are 413 with a JSON error, "
    "before the body is read.",
    "LOG_LEVEL": "The least severe log level written.",
    "LOG_FORMAT": "`json`: one JSON object a line (for log collectors); `text`: for humans.",
}

#: The token settings, read apart from :data:`VARIABLES` (several entries, a file):
#: (variable, flag or None, format, effect). ``WEIGHTS_TOKENS`` has no flag on purpose: a
#: command line is visible to every user of the machine (``ps``).
TOKEN_VARIABLES: tuple[tuple[str, str | None, str, str], ...] = (
    (
        "WEIGHTS_TOKENS",
        None,
        "`label:role:secret` entries separated by commas or newlines; `#` starts a comment",
        "The bearer tokens of the weights routes. `label`: `[a-z0-9_-]{1,64}`, unique, named in "
        "the audit log and in status; `role`: `trainer` (attach, the write cycle, save, "
        "weights loads) or `operator` (the same, and `POST /api/weights/clear-stale`); `secret`: at "
        f"least {MIN_SECRET_LEN} characters, distinct. Empty: every gated call is refused. "
        "A trainer token must be configured before the model loads (the load is then "
        "attachable).",
    ),
    (
        "WEIGHTS_TOKENS_FILE",
        "--weights-tokens-file",
        "a path to a file of entries in the same syntax, typically one per line",
        "Tokens from a file (a mounted secret), added to WEIGHTS_TOKENS. Labels and secrets "
        "must stay unique across both.",
    ),
)


def setting_default(field: str) -> object:
    """The default of the :class:`Settings` field ``field`` (``home``: :func:`default_home`)."""
    if field == "home":
        return default_home()
    return Settings.__struct_defaults__[
        Settings.__struct_fields__.index(field) - _first_default_index()
    ]


def _first_default_index() -> int:
    return len(Settings.__struct_fields__) - len(Settings.__struct_defaults__)


def format_default(field: str, kind: str) -> str:
    """A default as it is written in the environment (``0``/``1`` for a flag, empty for none)."""
    if field == "home":
        return "the platform's user data dir + `/miserver`"
    value = setting_default(field)
    if value is None and kind in ("batch_size", "threads"):
        return "auto"
    if value is None or value == "":
        return "empty"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


#: The longest Unix socket path Linux accepts, in bytes (``sun_path`` is 108 with its NUL).
MAX_SOCKET_PATH_BYTES = 107


def _socket_path(variable: str, raw: str) -> str | None:
    """``UNIX_SOCKET``: empty for none; else a path that fits ``sun_path`` and whose directory
    exists (the socket itself is checked when it is bound: :func:`miserver.http.protocol.
    bind_unix_socket`)."""
    if not raw:
        return None
    raw = os.path.abspath(raw)  # a relative path: from the server's working directory
    size = len(os.fsencode(raw))
    if size > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(
            variable,
            f"a Unix socket path may be at most {MAX_SOCKET_PATH_BYTES} bytes, got {size}; "
            "use a shorter path (for example under /run or /tmp)",
        )
    parent = Path(raw).parent
    if not parent.is_dir():
        raise ConfigError(variable, f"the directory {parent} does not exist; create it first")
    return raw


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def default_home() -> str:
    """The platform's user data dir plus ``/miserver`` (contract section 1)."""
    import platformdirs

    return str(Path(platformdirs.user_data_dir()) / "miserver")


#: The largest ``MAX_BATCH_SIZE`` accepted.
MAX_BATCH_SIZE_LIMIT = 256
#: ``MAX_BATCH_SIZE=auto`` on each device type (measured: docs/benchmarks.md, "Static batch").
DEFAULT_MAX_BATCH_SIZE = {"cpu": 8, "cuda": 64}


#: The largest ``MAX_BATCH_DELAY_MS`` accepted.
MAX_BATCH_DELAY_LIMIT_MS = 1000.0
#: ``MAX_BATCH_DELAY_MS=auto`` on each device type (docs/benchmarks.md, "The static batch": 10 ms
#: made 64 clients sending together one batch on an H200, 28.3x the chats at 1 against 19.3x).
DEFAULT_MAX_BATCH_DELAY_MS = {"cpu": 0.0, "cuda": 10.0}


def resolved_batch_delay_s(settings: Settings, device_type: str) -> float:
    """``MAX_BATCH_DELAY_MS`` in seconds for a server whose models load on ``device_type``
    (``cpu`` or ``cuda``): the setting, or the device's default when it is ``auto``."""
    if settings.max_batch_delay_ms is not None:
        return settings.max_batch_delay_ms / 1000.0
    ms = DEFAULT_MAX_BATCH_DELAY_MS.get(device_type, DEFAULT_MAX_BATCH_DELAY_MS["cpu"])
    return ms / 1000.0


def resolved_gguf_threads(settings: Settings) -> int:
    """``GGUF_THREADS``: the setting, or (``auto``) the CPU cores this process may run on."""
    if settings.gguf_threads is not None:
        return settings.gguf_threads
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def resolved_max_batch_size(settings: Settings, device_type: str) -> int:
    """``MAX_BATCH_SIZE`` for a server whose models load on ``device_type`` (``cpu`` or
    ``cuda``): the setting, or the device's default when it is ``auto``."""
    if settings.max_batch_size is not None:
        return settings.max_batch_size
    return DEFAULT_MAX_BATCH_SIZE.get(device_type, DEFAULT_MAX_BATCH_SIZE["cpu"])


def _convert(variable: str, kind: str, raw: str) -> object:
    raw = raw.strip()
    if kind in ("str", "path") and not raw:
        raise ConfigError(variable, "must not be empty")
    if kind in ("str", "str0", "path"):
        return raw
    if kind == "opt_path":
        return raw or None
    if kind == "socket_path":
        return _socket_path(variable, raw)
    if kind == "bool":
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(
            variable, f"expected 1/true/yes/on or 0/false/no/off (or empty), got {raw!r}"
        )
    if kind in ("pos_int", "port"):
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(variable, f"expected an integer, got {raw!r}") from None
        if kind == "port" and not 0 <= value <= 65535:
            raise ConfigError(variable, f"expected a port 0..65535, got {value}")
        if kind == "pos_int" and value < 1:
            raise ConfigError(variable, f"must be at least 1, got {value}")
        return value
    if kind == "pos_float":
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(variable, f"expected a number, got {raw!r}") from None
        if not value > 0 or value != value or value == float("inf"):
            raise ConfigError(variable, f"must be a positive finite number, got {raw}")
        return value
    if kind == "nonneg_float":
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(variable, f"expected a number, got {raw!r}") from None
        if not value >= 0 or value == float("inf"):
            raise ConfigError(variable, f"must be a finite number of seconds >= 0, got {raw}")
        return value
    if kind == "management_auth":
        low = raw.lower()
        if low in ("none", "operator"):
            return low
        raise ConfigError(variable, f"expected none or operator, got {raw!r}")
    if kind == "load_policy":
        low = raw.lower()
        if low in ("auto", "refuse"):
            return low
        raise ConfigError(variable, f"expected auto or refuse, got {raw!r}")
    if kind == "device":
        if raw == "auto" or raw == "cpu" or re.fullmatch(r"cuda(:\d+)?", raw):
            return raw
        raise ConfigError(variable, f"expected auto, cpu, cuda or cuda:N, got {raw!r}")
    if kind == "log_level":
        low = raw.lower()
        if low in ("debug", "info", "warning", "error", "critical"):
            return low
        raise ConfigError(
            variable, f"expected debug, info, warning, error or critical, got {raw!r}"
        )
    if kind == "batch_size":
        if raw.lower() in ("", "auto"):
            return None
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(variable, f"expected auto or an integer, got {raw!r}") from None
        if not 1 <= value <= MAX_BATCH_SIZE_LIMIT:
            raise ConfigError(variable, f"must be auto or 1 to {MAX_BATCH_SIZE_LIMIT}, got {value}")
        return value
    if kind == "threads":
        if raw.lower() in ("", "auto"):
            return None
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(variable, f"expected auto or an integer, got {raw!r}") from None
        if not 1 <= value <= 1024:
            raise ConfigError(variable, f"must be auto or 1 to 1024, got {value}")
        return value
    if kind == "batch_delay":
        if raw.strip().lower() in ("", "auto"):
            return None
        try:
            delay = float(raw)
        except ValueError:
            raise ConfigError(
                variable, f"expected auto or a number of milliseconds, got {raw!r}"
            ) from None
        if not 0 <= delay <= MAX_BATCH_DELAY_LIMIT_MS:  # also refuses nan
            raise ConfigError(
                variable, f"must be auto or 0 to {MAX_BATCH_DELAY_LIMIT_MS:g} ms, got {raw!r}"
            )
        return delay
    if kind == "decode_graphs":
        low = raw.lower()
        if low in ("captured", "compiled", "off"):
            return low
        raise ConfigError(variable, f"expected captured, compiled or off, got {raw!r}")
    if kind == "log_format":
        low = raw.lower()
        if low in ("json", "text"):
            return low
        raise ConfigError(variable, f"expected json or text, got {raw!r}")
    raise AssertionError(kind)


def parse_tokens(text: str, variable: str) -> list[WeightsToken]:
    """Parse ``label:role:secret`` entries (comma- or newline-separated; ``#`` starts a comment
    that runs to the end of the line). The syntax: docs/settings.md, Tokens.

    Raises :class:`ConfigError` naming ``variable`` and the entry's position, never the secret.
    """
    tokens: list[WeightsToken] = []
    # A comment runs to the end of its line, commas included; then entries split at commas.
    entries = [e.strip() for line in text.splitlines() for e in line.split("#", 1)[0].split(",")]
    for n, entry in enumerate(e for e in entries if e):
        parts = entry.split(":", 2)
        if len(parts) != 3:
            raise ConfigError(variable, f"entry {n + 1} is not label:role:secret")
        label, role, secret = (p.strip() for p in parts)
        if not LABEL_RE.match(label):
            raise ConfigError(variable, f"entry {n + 1}: label must match [a-z0-9_-]{{1,64}}")
        if role not in ROLES:
            raise ConfigError(
                variable, f"entry {n + 1} ({label}): role must be trainer or operator"
            )
        if len(secret) < MIN_SECRET_LEN:
            raise ConfigError(
                variable,
                f"entry {n + 1} ({label}): secret must be at least {MIN_SECRET_LEN} characters",
            )
        tokens.append(WeightsToken(label=label, role=role, secret=secret))
    return tokens


#: The largest ``WEIGHTS_TOKENS_FILE`` read, bytes: thousands of entries; a bound so that a
#: wrong path (a device, a log) stops the start with one line instead of reading for ever.
MAX_TOKENS_FILE_BYTES = 1024 * 1024


def read_tokens_file(path: str) -> str:
    """The text of ``WEIGHTS_TOKENS_FILE``: a regular file (a symlink to one, as Kubernetes
    mounts secrets, is fine) of UTF-8 text, at most :data:`MAX_TOKENS_FILE_BYTES`.

    Raises :class:`ConfigError` naming the variable and the problem (never the file's
    content: it holds secrets) for a missing or unreadable file, a device, FIFO or directory
    (``/dev/zero`` would never end; a FIFO would block the start), a larger file, or bytes
    that are not UTF-8.
    """
    variable = "WEIGHTS_TOKENS_FILE"
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ConfigError(variable, f"cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise ConfigError(
            variable, f"{path} is {kind}; it must be a regular file of label:role:secret lines"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKENS_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(variable, f"cannot read {path}: {exc.strerror}") from None
    if len(raw) > MAX_TOKENS_FILE_BYTES:
        raise ConfigError(
            variable,
            f"{path} is larger than {MAX_TOKENS_FILE_BYTES} bytes; it must hold only "
            "label:role:secret lines",
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            variable, f"{path} is not UTF-8 text (line {line}, byte {exc.start + 1})"
        ) from None


def load_settings(
    env: Mapping[str, str] | None = None, overrides: Mapping[str, object] | None = None
) -> Settings:
    """Build :class:`Settings` from ``env`` (default ``os.environ``) and CLI ``overrides``.

    ``overrides`` maps a variable name (``PORT``) to a raw string value; flags win over the
    environment. Raises :class:`ConfigError` on the first invalid value (contract section 1).
    """
    env = dict(os.environ if env is None else env)
    for key, value in (overrides or {}).items():
        if value is not None:
            env[key] = str(value)
    values: dict[str, object] = {}
    for variable, field, kind in VARIABLES:
        if variable in env:
            values[field] = _convert(variable, kind, env[variable])
    values.setdefault("home", default_home())
    tokens = parse_tokens(env.get("WEIGHTS_TOKENS", ""), "WEIGHTS_TOKENS")
    token_file = env.get("WEIGHTS_TOKENS_FILE", "").strip()
    if token_file:
        tokens += parse_tokens(read_tokens_file(token_file), "WEIGHTS_TOKENS_FILE")
    labels = [t.label for t in tokens]
    dup = sorted({label for label in labels if labels.count(label) > 1})
    if dup:
        raise ConfigError("WEIGHTS_TOKENS", f"label {dup[0]!r} is used more than once")
    secrets_ = [t.secret for t in tokens]
    if len(set(secrets_)) != len(secrets_):
        raise ConfigError("WEIGHTS_TOKENS", "two entries share one secret")
    values["weights_tokens"] = tuple(tokens)
    settings = Settings(**values)  # type: ignore[arg-type]
    if settings.weights_heartbeat_interval_hint_s >= settings.weights_heartbeat_timeout_s:
        raise ConfigError(
            "WEIGHTS_HEARTBEAT_INTERVAL_HINT_S",
            f"must be below WEIGHTS_HEARTBEAT_TIMEOUT_S ({settings.weights_heartbeat_timeout_s:g})",
        )
    if settings.management_auth == "operator" and not any(
        t.role == "operator" for t in settings.weights_tokens
    ):
        raise ConfigError(
            "MANAGEMENT_AUTH",
            "operator needs at least one operator token in WEIGHTS_TOKENS (label:operator:secret);"
            " without one every guarded management call would be refused",
        )
    return settings
