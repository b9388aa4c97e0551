"""``miserver serve``: logging, the one-time default import, the HTTP server, clean shutdown.

Logging follows ``LOG_LEVEL`` and ``LOG_FORMAT`` (``json``: one JSON object a line, for log
shippers; ``text``: for humans). No configured token secret ever reaches a log line: a filter on
the root handler replaces each one (and any ``Bearer`` credential) with ``***``.
"""

from __future__ import annotations

import errno
import logging
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp.abc import AbstractAccessLogger

from miserver.http.protocol import request_peer
from miserver.serving.audit import info_line  # a log line without the caller's stack walk
from miserver.spec.settings import Settings

log = logging.getLogger("miserver.server")

_encode = msgspec.json.Encoder(enc_hook=str).encode
_decode = msgspec.json.Decoder().decode
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"',;]+")


class RedactSecrets(logging.Filter):
    """Replace every configured secret, and any ``Bearer <credential>``, with ``***``."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self._secrets = sorted((s for s in secrets if s), key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, "***")
        if "bearer" not in text.lower():  # the common case, without running the pattern
            return text
        return _BEARER.sub(r"\1***", text)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        clean = self.redact(message)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        record.msg, record.args = clean, None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (RFC 3339 UTC), ``level``, ``logger``, ``message``.

    A message that is itself a JSON object (the ``weights_audit`` lines) is merged in as fields.
    :meth:`format_line` is the same line from its parts (:meth:`LineHandler.emit_line`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""
        self._heads: dict[tuple[str, str], str] = {}

    def format(self, record: logging.LogRecord) -> str:
        exception = None
        if record.exc_text or record.exc_info:
            exception = record.exc_text or self.formatException(record.exc_info)
        return self.format_line(
            record.created,
            record.msecs,
            record.levelname,
            record.name,
            record.getMessage(),
            exception,
        )

    def format_line(
        self,
        created: float,
        msecs: float,
        levelname: str,
        name: str,
        message: str,
        exception: str | None = None,
    ) -> str:
        """The line :meth:`format` writes for a record with these fields (``created`` in
        seconds since the epoch, ``msecs`` its milliseconds, as ``LogRecord`` sets them)."""
        second = int(created)
        if second != self._second:  # strftime once a second, not once a line
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        out: dict[str, Any] = {
            "ts": f"{self._stamp}.{int(msecs):03d}Z",
            "level": levelname.lower(),
            "logger": name,
        }
        merged = False
        if message[:1] == "{" and message[-1:] == "}":
            try:
                fields = _decode(message)
            except msgspec.DecodeError:
                fields = None
            if isinstance(fields, dict):
                out.update({k: v for k, v in fields.items() if k not in ("level", "logger")})
                merged = True
        if not merged:
            out["message"] = message
        if exception:
            out["exception"] = exception
        return _encode(out).decode()

    def format_stamped_object(self, levelname: str, name: str, line: str, ts: str) -> str | None:
        """The line :meth:`format_line` writes for ``line``, a JSON object as msgspec encodes a
        ``weights_audit`` record (unique keys, none of them ``level`` or ``logger``, a ``ts``
        member of value ``ts`` that is not the last), without decoding and re-encoding it:
        ``ts`` moves to the front (merged over the line's own stamp), then ``level`` and
        ``logger``, then the line's other members in their order, their text as it is (the
        encoding of a decoded msgspec value is that value's text). None when ``line`` does not
        have that shape (take :meth:`format_line`)."""
        stamp = _encode(ts).decode()
        marker = f',"ts":{stamp},'
        at = line.find(marker)  # inside a string a quote is escaped: only the member matches
        if at < 2 or line[:2] != '{"' or line[-1:] != "}" or line.find(marker, at + 1) >= 0:
            return None
        head = self._heads.get((levelname, name))
        if head is None:
            head = self._heads[(levelname, name)] = (
                f',"level":{_encode(levelname.lower()).decode()},"logger":{_encode(name).decode()},'
            )
        return f'{{"ts":{stamp}{head}{line[1:at]}{line[at + len(marker) - 1 :]}'


class TextFormatter(logging.Formatter):
    """``LOG_FORMAT=text``: ``2026-12-02 18:15:43,123 INFO    miserver.x: message`` (local time),
    the stdlib formatter with :data:`TEXT_FORMAT`. :meth:`format_line` is the same line from its
    parts (:meth:`LineHandler.emit_line`), the local time formatted once a second."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second = -1
        self._stamp = ""

    def format_line(
        self, created: float, msecs: float, levelname: str, name: str, message: str
    ) -> str:
        """The line :meth:`format` writes for a record with these fields and no exception or
        stack (``created`` in seconds since the epoch, ``msecs`` its milliseconds)."""
        second = int(created)
        if second != self._second:  # an offset from UTC changes on a whole second only
            self._second = second
            self._stamp = time.strftime(self.default_time_format, self.converter(created))
        values = {
            "asctime": self.default_msec_format % (self._stamp, msecs),
            "levelname": levelname,
            "name": name,
            "message": message,
        }
        return TEXT_FORMAT % values


#: The line of ``LOG_FORMAT=text`` (a stdlib ``%`` format).
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def record_clock() -> tuple[float, float]:
    """Now as a ``LogRecord`` of this Python stamps it: ``created`` (seconds since the epoch)
    and ``msecs`` (its whole milliseconds), by the same arithmetic, so that a line written
    from its parts shows the time a record would have shown (3.13 reads ``time.time_ns``)."""
    if sys.version_info >= (3, 13):
        ns = time.time_ns()
        created = ns / 1e9
        msecs = (ns % 1_000_000_000) // 1_000_000 + 0.0
        if msecs == 999.0 and int(created) != ns // 1_000_000_000:
            msecs = 0.0  # the seconds rounded up
        return created, msecs
    ct = time.time()
    return ct, int((ct - int(ct)) * 1000) + 0.0


class LineHandler(logging.StreamHandler):
    """The stream handler of ``miserver serve``; it also writes a line from its parts.

    :func:`miserver.serving.audit.info_line` (the access and audit lines, two a barrier call)
    hands the handler the logger's name and the message when the handler is the only one the
    line would reach: :meth:`emit_line` then writes exactly what the record would have given
    (the same filters, formatter, stream, flush and lock) without building a ``LogRecord``,
    whose construction was the largest single cost of a barrier call's own work (issue 15).
    """

    def emit_line(self, name: str, levelno: int, message: str) -> bool:
        """Write the line a record of ``levelno`` (INFO or above) and ``message`` from the
        logger ``name`` would give; True when done (or when this handler's level drops it),
        False when this handler cannot (a filter or formatter it does not know: build the
        record). The message is the record's ``getMessage()``."""
        if levelno < self.level:
            return True  # as Logger.callHandlers skips it
        fmt = self.formatter
        if type(fmt) not in (JsonFormatter, TextFormatter):
            return False
        filters = self.filters
        if filters:
            for f in filters:
                if type(f) is not RedactSecrets:
                    return False
            for f in filters:
                message = f.redact(message)
        created, msecs = record_clock()
        levelname = logging.getLevelName(levelno)
        self._write(
            name,
            levelno,
            message,
            lambda: fmt.format_line(created, msecs, levelname, name, message),
        )
        return True

    def emit_stamped_object(self, name: str, levelno: int, line: str, ts: str) -> bool:
        """:meth:`emit_line` of ``line``, a ``weights_audit`` record as msgspec encodes it
        (``ts`` its stamp), the same bytes written: with :class:`JsonFormatter` and no secret
        or ``Bearer`` credential in the line (the filters leave it as it is), the line is
        spliced (:meth:`JsonFormatter.format_stamped_object`) instead of decoded, merged and
        encoded again; otherwise :meth:`emit_line`."""
        fmt = self.formatter
        if type(fmt) is not JsonFormatter or levelno < self.level:
            return self.emit_line(name, levelno, line)
        for f in self.filters:
            if type(f) is not RedactSecrets or f.redact(line) != line:
                return self.emit_line(name, levelno, line)
        out = fmt.format_stamped_object(logging.getLevelName(levelno), name, line, ts)
        if out is None:
            return self.emit_line(name, levelno, line)
        self._write(name, levelno, line, lambda: out)
        return True

    def _write(self, name: str, levelno: int, message: str, text: Callable[[], str]) -> None:
        """Write ``text()`` and the terminator under the handler's lock, flushed; a failure (of
        the formatting too) goes to ``handleError`` as ``StreamHandler.emit``'s does."""
        self.acquire()
        try:
            try:
                self.stream.write(text() + self.terminator)
                self.flush()
            except RecursionError:  # as StreamHandler.emit
                raise
            except Exception:
                record = logging.LogRecord(
                    name, levelno, "(unknown file)", 0, message, None, None, "(unknown function)"
                )
                self.handleError(record)
        finally:
            self.release()


class AccessLogger(AbstractAccessLogger):
    """One access line a request: ``remote "METHOD path HTTP/x.y" status bytes ms "agent"``.

    Cheaper than aiohttp's format-string logger (no local-time formatting, no per-request format
    parsing): every weights call writes one, inside the barrier's latency. The time is the
    handler's, in milliseconds. No header other than User-Agent is logged.
    """

    def log(self, request: Any, response: Any, time: float) -> None:
        version = request.version
        info_line(
            self.logger,
            '%s "%s %s HTTP/%d.%d" %d %d %.3fms "%s"',
            request_peer(request),
            request.method,
            request.path_qs,
            version.major,
            version.minor,
            response.status,
            response.body_length,
            time * 1000.0,
            request.headers.get("User-Agent", "-"),
        )

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


def configure_logging(settings: Settings) -> None:
    """Route all logging to stderr in ``settings.log_format`` at ``settings.log_level``."""
    handler = LineHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json" else TextFormatter())
    handler.addFilter(RedactSecrets([t.secret for t in settings.weights_tokens]))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level.upper())
    if settings.log_format == "json":
        quiet_progress_bars()
    # Third-party chatter stays at warning unless debugging.
    if settings.log_level != "debug":
        # ``transitions`` logs every state change at INFO: the audit log already records each
        # weights call, and those lines cost the barrier time on every call.
        for noisy in ("urllib3", "filelock", "httpx", "asyncio", "transitions"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def quiet_progress_bars() -> None:
    """Turn off the tqdm progress bars of transformers and huggingface_hub for this process:
    with ``LOG_FORMAT=json`` stderr carries one JSON object a line, and a bar is not one (issue
    16 item 17). The import of the default reports its phases as log lines instead."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    else:
        hf_logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:  # pragma: no cover
        pass
    else:
        disable_progress_bars()


def prepare_home(settings: Settings) -> str | None:
    """Import the embedded default at first start (or when ``DEFAULT_MODEL`` names it and its
    row was deleted), and check ``DEFAULT_MODEL`` exists.

    Returns None when ready, else the one-line configuration error (exit status 2).
    """
    from miserver.serving.models.catalogue import Catalogue
    from miserver.serving.models.default_model import (
        DEFAULT_NAME,
        DefaultModelError,
        import_default,
    )

    catalogue = Catalogue(settings.home)
    name = settings.default_model
    missing_default = name == DEFAULT_NAME and catalogue.get_by_name(name) is None
    if catalogue.is_empty() or missing_default:
        log.info("importing the embedded default model into %s (once)", settings.home)
        try:
            # Bars only for a human's log: a JSON log gets the phases as log lines.
            import_default(settings.home, progress=settings.log_format != "json")
        except DefaultModelError as exc:
            return f"the embedded default model could not be imported: {exc}"
    if name and catalogue.get_by_name(name) is None:
        names = ", ".join(r.name for r in catalogue.list()) or "none"
        return (
            f"DEFAULT_MODEL: {name!r} is not in the catalogue of {settings.home} "
            f"(rows: {names}); register it or set DEFAULT_MODEL to one of them, or to "
            "empty to load nothing"
        )
    return None


def device_problem(device: str) -> str | None:
    """Why ``DEVICE`` cannot be used on this machine (a ``cuda`` device without CUDA, or an
    index beyond the GPUs visible), as a one-line configuration error; None when it can
    (``auto`` and ``cpu`` always can). Contract 1: an invalid setting exits 2 at start."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA"
            if torch.version.cuda is None
            else "no GPU is visible (check CUDA_VISIBLE_DEVICES and the driver)"
        )
        return f"DEVICE={device}, but {why}; set DEVICE=cpu, or auto to use a GPU when there is one"
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        return f"DEVICE={device}, but only {count} GPU(s) are visible (cuda:0..cuda:{count - 1})"
    return None


def listening_on(settings: Settings) -> str:
    """The addresses a server of ``settings`` listens on, for its log lines."""
    where = f"http://{settings.host}:{settings.port}"
    return where if settings.unix_socket is None else f"{where} and unix:{settings.unix_socket}"


def serve(settings: Settings) -> int:
    """Run the server until SIGINT/SIGTERM; returns the process exit status.

    0 after a clean shutdown, 1 when the address cannot be bound, 2 for a configuration error
    found at start (contract 1).
    """
    configure_logging(settings)
    log.info("starting miserver (home %s, device %s)", settings.home, settings.device)
    problem = device_problem(settings.device) or prepare_home(settings)
    if problem is not None:
        print(f"miserver: invalid configuration: {problem}", file=sys.stderr)
        return 2
    from miserver.http.app import create_app
    from miserver.http.protocol import UnixSocketError, run_app
    from miserver.ipc import shm

    shm.sweep_dead()  # CPU shared memory a dead miserver left in /dev/shm (issue 16, 4)

    app = create_app(settings)
    try:
        run_app(  # aiohttp's run_app, with aiohttp's own low-level errors answered as JSON
            app,
            host=settings.host,
            port=settings.port,
            unix_socket=settings.unix_socket,
            on_listening=lambda: log.info("listening on %s", listening_on(settings)),
            shutdown_timeout=10.0,
            access_log=log.getChild("access"),
            access_log_class=AccessLogger,
        )
    except OSError as exc:
        hint = (
            "; another server has the port: set PORT to a free one (0 picks any)"
            if exc.errno == errno.EADDRINUSE and not isinstance(exc, UnixSocketError)
            else ""
        )
        log.error("cannot listen on %s: %s%s", listening_on(settings), exc.strerror or exc, hint)
        return 1
    log.info("miserver stopped")
    return 0
