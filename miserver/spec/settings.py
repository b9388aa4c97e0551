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
    #: None: ``auto``, the measured default of the device (10 on CUDA, 0 on the CPU).
    max_batch_delay_ms: float | None = None
    decode_graphs: str = "captured"
    #: ``continuous``, the only engine (issue 29; ``static`` was removed: :data:`ENGINE_REMOVED`).
    engine: str = "continuous"
    #: None: ``auto``, the device's default (:data:`DEFAULT_KV_CACHE_BYTES_CPU`).
    kv_cache_bytes: int | None = None
    continuous_batching: bool = False
    #: None: ``auto``, the CPU cores this process may run on (``os.sched_getaffinity``).
    gguf_threads: int | None = None
    #: None: ``auto``, one fewer than the CPU cores this process may run on (at least 1).
    cpu_threads: int | None = None
    #: None: ``auto``, the CPU cores this process may run on (``os.sched_getaffinity``).
    cpu_matmul_threads: int | None = None
    #: None: ``auto``, the device's default (:data:`DEFAULT_SPECULATIVE_TOKENS`).
    speculative_tokens: int | None = None
    max_queued_requests: int = 64
    max_request_bytes: int = 8 * 1024 * 1024
    header_read_timeout_s: float = 20.0
    body_read_timeout_s: float = 20.0
    shutdown_grace_s: float = 10.0
    management_auth: str = "none"
    v1_load_policy: str = "auto"
    log_level: str = "info"
    log_format: str = "json"

    def __post_init__(self) -> None:
        """Settings made in code are held to the one engine too (:data:`ENGINE_REMOVED`).

        Raises:
            ConfigError: ``engine`` is not ``continuous`` (naming ``ENGINE``).
        """
        if self.engine != "continuous":
            raise ConfigError(
                "ENGINE",
                ENGINE_REMOVED
                if self.engine.strip().lower() == "static"
                else f"expected continuous, got {self.engine!r}",
            )

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
    ("ENGINE", "engine", "engine"),
    ("KV_CACHE_BYTES", "kv_cache_bytes", "memory_bytes"),
    ("CONTINUOUS_BATCHING", "continuous_batching", "bool"),
    ("GGUF_THREADS", "gguf_threads", "threads"),
    ("CPU_THREADS", "cpu_threads", "threads"),
    ("CPU_MATMUL_THREADS", "cpu_matmul_threads", "threads"),
    ("SPECULATIVE_TOKENS", "speculative_tokens", "draft_tokens"),
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
    "draft_tokens": "`auto` or an integer 0 to 16 (0: off)",
    "batch_delay": "`auto` or a number of milliseconds, 0 to 1000 (0: no delay)",
    "nonneg_float": "a number, at least 0",
    "engine": "`continuous` (case-insensitive)",
    "memory_bytes": "`auto`, or a size in bytes: an integer, optionally with a unit `KiB`, "
    "`MiB`, `GiB` (powers of 1024) or `KB`, `MB`, `GB` (powers of 1000), at least 1 MiB",
    "management_auth": "`none` or `operator`",
    "load_policy": "`auto` or `refuse` (case-insensitive)",
}

# What each variable does: its own module (words, not rules), re-exported here.
from miserver.spec.settings_text import DESCRIPTIONS  # noqa: E402, F401

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
    if value is None and kind in ("batch_size", "threads", "memory_bytes", "draft_tokens"):
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
#: ``MAX_BATCH_SIZE=auto`` on each device type for the largest ``n``, the slot's grants and a
#: GGUF resident's parallel slots (measured before the continuous engine: docs/benchmarks.md).
DEFAULT_MAX_BATCH_SIZE = {"cpu": 8, "cuda": 64}
#: ``MAX_BATCH_SIZE=auto`` for the continuous engine's sequences a step, on every device.
DEFAULT_ENGINE_MAX_SEQS = 64


#: The most ``SPECULATIVE_TOKENS`` accepted.
MAX_SPECULATIVE_TOKENS = 16
#: ``SPECULATIVE_TOKENS=auto`` on each device type: prompt-lookup drafts a greedy sequence gets a
#: step on the CPU (docs/decisions.md, "Prompt-lookup speculation"); none on CUDA (the engine
#: speculates only where a drafted step's rows are bit-identical to plain decodes: the CPU, in
#: bfloat16 or float16).
DEFAULT_SPECULATIVE_TOKENS = {"cpu": 4, "cuda": 0}


def resolved_speculative_tokens(settings: Settings, device_type: str) -> int:
    """``SPECULATIVE_TOKENS``: the setting, or (``auto``) the default of ``device_type``."""
    if settings.speculative_tokens is not None:
        return settings.speculative_tokens
    return DEFAULT_SPECULATIVE_TOKENS.get(device_type, 0)


#: ``KV_CACHE_BYTES=auto`` on the CPU, bytes (see its description in :data:`DESCRIPTIONS`).
DEFAULT_KV_CACHE_BYTES_CPU = 1 << 30
#: ``KV_CACHE_BYTES=auto`` on CUDA: this share of the card's free memory after the load.
DEFAULT_KV_CACHE_CUDA_FREE_FRACTION = 0.25
#: The smallest ``KV_CACHE_BYTES`` accepted (1 MiB: a few blocks of a small model).
MIN_KV_CACHE_BYTES = 1 << 20
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_memory_bytes(variable: str, raw: str) -> int | None:
    """A size such as ``512MiB``, ``2GiB``, ``1.5GB`` or ``1073741824`` in bytes; ``auto`` (or
    empty) is None. Raises :class:`ConfigError` naming ``variable`` for anything else, or a size
    below :data:`MIN_KV_CACHE_BYTES`."""
    text = raw.strip()
    if text.lower() in ("", "auto"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(
            variable,
            f"expected auto or a size such as 512MiB, 2GiB or a number of bytes, got {raw!r}",
        )
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value < MIN_KV_CACHE_BYTES:
        raise ConfigError(
            variable, f"must be at least {MIN_KV_CACHE_BYTES} bytes (1 MiB), got {raw!r}"
        )
    return value


def resolved_kv_cache_bytes(
    settings: Settings, device_type: str, free_bytes: int | None = None
) -> int:
    """``KV_CACHE_BYTES`` for a model loaded on ``device_type`` (``cpu`` or ``cuda``): the
    setting, else on CUDA :data:`DEFAULT_KV_CACHE_CUDA_FREE_FRACTION` of ``free_bytes`` (the
    card's free memory after the load; at least :data:`MIN_KV_CACHE_BYTES`), else
    :data:`DEFAULT_KV_CACHE_BYTES_CPU`. Bytes (int)."""
    if settings.kv_cache_bytes is not None:
        return settings.kv_cache_bytes
    if device_type == "cuda" and free_bytes is not None:
        return max(MIN_KV_CACHE_BYTES, int(free_bytes * DEFAULT_KV_CACHE_CUDA_FREE_FRACTION))
    return DEFAULT_KV_CACHE_BYTES_CPU


#: The largest ``MAX_BATCH_DELAY_MS`` accepted.
MAX_BATCH_DELAY_LIMIT_MS = 1000.0
#: ``MAX_BATCH_DELAY_MS=auto`` on each device type (measured before the continuous engine,
#: docs/benchmarks.md: 10 ms made 64 clients sending together one batch on an H200, 28.3x the
#: chats at 1 against 19.3x; the settings reference says what it does now).
DEFAULT_MAX_BATCH_DELAY_MS = {"cpu": 0.0, "cuda": 10.0}


def resolved_batch_delay_s(settings: Settings, device_type: str) -> float:
    """``MAX_BATCH_DELAY_MS`` in seconds for a server whose models load on ``device_type``
    (``cpu`` or ``cuda``): the setting, or the device's default when it is ``auto``."""
    if settings.max_batch_delay_ms is not None:
        return settings.max_batch_delay_ms / 1000.0
    ms = DEFAULT_MAX_BATCH_DELAY_MS.get(device_type, DEFAULT_MAX_BATCH_DELAY_MS["cpu"])
    return ms / 1000.0


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, so a container's CPU set counts)."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def resolved_gguf_threads(settings: Settings) -> int:
    """``GGUF_THREADS``: the setting, or (``auto``) the CPU cores this process may run on."""
    if settings.gguf_threads is not None:
        return settings.gguf_threads
    return usable_cores()


def resolved_cpu_threads(settings: Settings) -> int:
    """``CPU_THREADS``: the setting, or (``auto``) one fewer than the CPU cores this process may
    run on, at least 1: the other core is the event loop's (docs/decisions.md, "Threads")."""
    if settings.cpu_threads is not None:
        return settings.cpu_threads
    return max(1, usable_cores() - 1)


def resolved_cpu_matmul_threads(settings: Settings) -> int:
    """``CPU_MATMUL_THREADS``: the setting, or (``auto``) the CPU cores this process may run on:
    the engine's linear products (reads of the weights) on every core, its other operations on
    ``CPU_THREADS`` (docs/decisions.md, "Products on every core")."""
    if settings.cpu_matmul_threads is not None:
        return settings.cpu_matmul_threads
    return usable_cores()


def resolved_max_batch_size(settings: Settings, device_type: str) -> int:
    """``MAX_BATCH_SIZE`` for a server whose models load on ``device_type`` (``cpu`` or
    ``cuda``): the setting, or the device's default when it is ``auto``."""
    if settings.max_batch_size is not None:
        return settings.max_batch_size
    return DEFAULT_MAX_BATCH_SIZE.get(device_type, DEFAULT_MAX_BATCH_SIZE["cpu"])


#: Why ``ENGINE=static`` is refused at start (issue 29: one engine for every sequence).
ENGINE_REMOVED = (
    "static is no longer available: the static batch was removed, and the continuous engine "
    "serves every sequence of a transformers resident (set ENGINE=continuous, or leave ENGINE "
    "unset)"
)


def _auto_int(variable: str, raw: str, low: int, high: int) -> int | None:
    """``auto`` (or empty): None; else an integer ``low`` to ``high``.

    Raises:
        ConfigError: anything else, naming ``variable``.
    """
    if raw.lower() in ("", "auto"):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(variable, f"expected auto or an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise ConfigError(variable, f"must be auto or {low} to {high}, got {value}")
    return value


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
        return _auto_int(variable, raw, 1, MAX_BATCH_SIZE_LIMIT)
    if kind == "threads":
        return _auto_int(variable, raw, 1, 1024)
    if kind == "draft_tokens":
        return _auto_int(variable, raw, 0, MAX_SPECULATIVE_TOKENS)
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
    if kind == "memory_bytes":
        return parse_memory_bytes(variable, raw)
    if kind == "engine":
        low = raw.strip().lower()
        if low in ("", "continuous"):  # empty (``ENGINE=`` in an env file): as if unset
            return "continuous"
        if low == "static":
            raise ConfigError(variable, ENGINE_REMOVED)
        raise ConfigError(variable, f"expected continuous, got {raw!r}")
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
