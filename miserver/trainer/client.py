"""The trainer's HTTP client: attach, heartbeat, the commit bracket, save, detach.

Weights page "The write cycle", "Timers" (the heartbeat), "Rebuilding the tensors in the
trainer" and "Releasing the handles"; companion contract 5 (save, load). Re-exported by
:mod:`miserver.trainer`::

    from miserver.trainer import WeightsClient

    with WeightsClient("http://127.0.0.1:8000", token) as client:
        att = client.attach()                  # each storage rebuilt once; the heartbeat starts
        model = att.build_model()              # the served graph; its parameters ARE the served
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        for batch in data:
            model(**batch).loss.backward()     # reads only: outside the bracket
            with client.commit():              # quiesce, commit-begin ... commit-end, resume
                opt.step()                     # the write (CUDA is synchronized before commit-end)
            opt.zero_grad()
    # leaving the block: every view dropped, torch.cuda.ipc_collect(), POST /detach

Every refusal of the server raises :class:`WeightsError`, or rather its subclass named for the
code (``WEIGHTS_TORN`` -> :class:`WeightsTorn`, ``NOT_QUIESCED`` -> :class:`NotQuiesced`, ...),
generated from :mod:`miserver.spec.codes`. A server that cannot be reached raises
:class:`TransportError`. The token and the attachment ID never appear in a log line, a repr or an
exception.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from miserver.trainer import heartbeat
from miserver.trainer.attachment import Attachment, CommitCycle
from miserver.trainer.errors import (
    ERROR_CLASSES,
    NotAttachedHere,
    TrainerError,
    TransportError,
    WeightsError,
)
from miserver.trainer.heartbeat import HEARTBEAT_TERMINAL
from miserver.trainer.transport import (
    _Bearer,
    _Connection,
    _unwrap,
    call_retrying,
    retry_wait,
)
from miserver.trainer.weights import rebuild

log = logging.getLogger("miserver.trainer")

ATTACHMENT_HEADER = "X-miLLM-Attachment"


#: What a quiesce does with the running sequences (contract 4b).
Running = Literal["finish", "hold"]


def _check_running(running: object) -> Running:
    if running not in ("finish", "hold"):
        raise ValueError(f'running must be "finish" or "hold", not {running!r}')
    return running  # type: ignore[return-value]


# --- the client ---------------------------------------------------------------------------------
class WeightsClient:
    """A synchronous client of ``/api/weights`` for one trainer process (weights page).

    Args:
        base_url: the server, ``http://host:port`` (no path).
        token: a secret of ``WEIGHTS_TOKENS`` (role trainer, or operator). Never logged.
        timeout: seconds to wait for an answer. Quiesce waits for running requests up to the
            server's WEIGHTS_QUIESCE_DRAIN_TIMEOUT_S (60 s by default): keep it above that.
        heartbeat: start the heartbeat thread on attach (``interval_hint_s``).
        unix_socket: the path of the server's ``UNIX_SOCKET`` (a trainer on the same host):
            every call, the heartbeat's too, goes to that socket instead of ``base_url``'s host
            and port (``base_url`` still gives the ``Host`` header and a path prefix): on an
            H200 a step's barrier took about 5 % less than over loopback TCP
            (docs/benchmarks.md).
            ``https://`` with a socket is a ``ValueError``; a path with no server behind it is a
            :class:`TransportError` on the first call, as a closed port is.
        running: what :meth:`quiesce` and :meth:`commit` do with the sequences the server is
            generating (contract 4b): ``"finish"`` (the default; the weights page's drain: the
            commit waits for the longest running generation) or ``"hold"`` (the server parks
            them at the next decode step and continues them on the new weights after resume:
            the commit waits at most one step; docs/trainer-guide.md says when to use which).
            Each call may override it. Anything else is a ``ValueError``.

        retry_within_s: a barrier call (quiesce, commit-begin, commit-end, resume, the pairs
            of :meth:`commit`, save, load) refused with ``Retry-After`` (503 ``QUEUE_FULL``,
            409 ``MODEL_BUSY``, 503 ``SHUTTING_DOWN``: nothing changed) is sent again after the
            header's wait while that is within this many seconds of the first try (30; 0:
            never), then the last refusal is raised. :attr:`retries` counts them.

    HTTP goes over one keep-alive connection (``http.client``, the standard library; about
    0.05 ms above a bare round trip, where ``requests`` adds 0.5 to 3 ms: benchmarks/barrier.py)
    straight to ``base_url``: no proxy environment variables, no ``~/.netrc``. A call whose
    answer was lost is never sent again (it may have been accepted); only a refusal with
    ``Retry-After`` is retried (``retry_within_s``). The heartbeat thread has its own connection.

    Use as a context manager (leaving it detaches, also on an exception); an attachment still
    held at interpreter exit is detached then (``atexit``).
    """

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 120.0,
        heartbeat: bool = True,
        unix_socket: str | os.PathLike[str] | None = None,
        running: Running = "finish",
        retry_within_s: float = 30.0,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError("base_url must start with http:// or https://")
        if unix_socket is not None and base_url.startswith("https://"):
            raise ValueError("unix_socket takes an http:// base_url (no TLS on a local socket)")
        if not isinstance(token, str) or not token:
            raise ValueError("token must be a non-empty string")
        self.running: Running = _check_running(running)
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.retry_within_s = float(retry_within_s)
        #: Barrier calls sent again after a refusal with ``Retry-After`` (``retry_within_s``).
        self.retries = 0
        self._auth = _Bearer(token)
        self.unix_socket = None if unix_socket is None else os.fspath(unix_socket)
        self._session = _Connection(self.base_url, self.unix_socket)
        self._lock = threading.RLock()
        self._attachment_id: str | None = None
        self.attachment: Attachment | None = None
        self.steps_since_load: int | None = None
        self._heartbeat_enabled = heartbeat
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._hb_session: _Connection | None = None
        self.heartbeat_interval_s: float | None = None
        #: The server's staleness window (``heartbeat.timeout_s``, seconds): how long one
        #: heartbeat may take and still count.
        self.heartbeat_window_s: float | None = None
        self.heartbeat_error: BaseException | None = None
        self.heartbeats_sent = 0
        self._detach_answer: dict[str, Any] | None = None

    # --- plumbing ---------------------------------------------------------------------------
    def _request(
        self,
        method: str,
        path: str,
        *,
        token: bool = True,
        holder: bool = False,
        body: Any = None,
        session: _Connection | None = None,
        timeout: float | None = None,
        retry: bool = False,
        started: float | None = None,
    ) -> dict[str, Any]:
        """One call; ``retry``: a barrier call (``retry_within_s``, from ``started``)."""
        if retry:
            return call_retrying(
                lambda: self._request(
                    method,
                    path,
                    token=token,
                    holder=holder,
                    body=body,
                    session=session,
                    timeout=timeout,
                ),
                self.retry_within_s,
                self._before_retry,
                started,
            )
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = self._auth.header
        if holder:
            att = self._attachment_id
            if att is None:
                raise NotAttachedHere(
                    f"{method} {path}: this client holds no attachment; call attach() first"
                )
            headers[ATTACHMENT_HEADER] = att
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        resp = (session or self._session).request(
            method, path, payload, headers, timeout or self.timeout
        )
        return _unwrap(method, path, resp)

    def _before_retry(self, exc: WeightsError, wait: float) -> None:
        self.retries += 1
        log.info("%s; sending it again in %.2f s (Retry-After)", exc, wait)
        time.sleep(wait)

    def _pair(
        self, first: str, second: str, first_body: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any] | TrainerError, dict[str, Any] | TrainerError]:
        """:meth:`_pipelined` with ``retry_within_s``: both refused, the first with
        ``Retry-After``: the pair again; only the second, with it: the second alone again."""
        started = time.monotonic()
        while True:
            one, two = self._pipelined(first, second, first_body)
            if isinstance(two, WeightsError):
                refused = one if isinstance(one, BaseException) else two
                wait = retry_wait(refused, started, self.retry_within_s)
                if wait is not None and refused is one:
                    self._before_retry(one, wait)
                    continue
                if wait is not None:  # the first was accepted: the second alone, again
                    self._before_retry(two, wait)
                    path = f"/api/weights/{second}"
                    try:
                        two = self._request("POST", path, holder=True, retry=True, started=started)
                    except TrainerError as exc:
                        two = exc
            return one, two

    def _pipelined(
        self, first: str, second: str, first_body: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any] | TrainerError, dict[str, Any] | TrainerError]:
        """POST two holder calls of the write cycle (``/api/weights/<first>``, then
        ``<second>``) in one write on the keep-alive connection and read both answers, in
        order: one round trip instead of two, the same routes, answers and audit lines.

        Returns each call's ``data``, or the error it would have raised (a
        :class:`WeightsError` subclass, or :class:`TransportError`). Raises
        :class:`NotAttachedHere` before sending anything, and :class:`TransportError` when the
        first answer could not be read (nothing is known of either call then).
        """
        att = self._attachment_id
        if att is None:
            raise NotAttachedHere(
                f"POST /{first}, /{second}: this client holds no attachment; call attach() first"
            )
        headers = {
            "Accept": "application/json",
            "Authorization": self._auth.header,
            ATTACHMENT_HEADER: att,
        }
        paths = (f"/api/weights/{first}", f"/api/weights/{second}")
        body = None if first_body is None else json.dumps(first_body).encode()
        one, two = self._session.request_pair("POST", paths, headers, self.timeout, body)
        out: list[dict[str, Any] | TrainerError] = []
        for path, resp in zip(paths, (one, two), strict=True):
            if isinstance(resp, TrainerError):
                out.append(resp)
                continue
            try:
                out.append(_unwrap("POST", path, resp))
            except WeightsError as exc:
                out.append(exc)
        return out[0], out[1]

    def _ended(self, data: dict[str, Any]) -> dict[str, Any]:
        """Book a commit-end answer: ``steps_since_load``, and a warning when it overran."""
        self.steps_since_load = data.get("steps_since_load", self.steps_since_load)
        if data.get("overran"):
            log.warning(
                "the commit took %s ms, longer than the server's "
                "WEIGHTS_COMMIT_WATCHDOG_MS: the set was torn until commit-end; raise "
                "the watchdog",
                data.get("commit_ms"),
            )
        return data

    # --- the routes -------------------------------------------------------------------------
    def attach(self, *, build_model: bool = False, model_class: type | None = None) -> Attachment:
        """POST /attach, rebuild every storage exactly once, start the heartbeat.

        Weights page, The write cycle 1 and Rebuilding the tensors. Attaching to a torn set is
        allowed: the returned ``weights_state`` says ``torn``. When the rebuild fails, the
        attachment is detached again before the error is raised.

        Args:
            build_model: also build the model from ``config`` (:meth:`Attachment.build_model`).
            model_class: the transformers class for that (default: the config's).

        Raises:
            AlreadyAttached: another attachment exists (``details.holder``), or this client
                already holds one.
            ModelNotLoaded, NotAttachable, WeightsUnauthorized, WeightsForbidden: refusals.
            ProducerMismatch, DeviceNotVisible, InvalidExport: from the rebuild.
            TransportError: the server did not answer.
        """
        with self._lock:
            if self._attachment_id is not None:
                raise ERROR_CLASSES["ALREADY_ATTACHED"](
                    "ALREADY_ATTACHED",
                    None,
                    409,
                    "this client already holds an attachment; detach() first",
                )
            data = self._request("POST", "/api/weights/attach")
            self._attachment_id = data.pop("attachment_id", None)
            if self._attachment_id is None:
                raise WeightsError(None, None, 200, "the attach answer has no attachment_id")
            atexit.register(self._detach_at_exit)
            try:
                weights = rebuild(data, on_release=self._post_detach)
            except BaseException:
                self._post_detach_quietly()
                raise
            self.attachment = Attachment(data, weights, self)
            self.steps_since_load = data.get("steps_since_load")
            if self.attachment.weights_state != "clean":
                log.warning(
                    "attached to weights that are %s; recover with POST /api/weights/load",
                    self.attachment.weights_state,
                )
            hb = data.get("heartbeat") or {}
            self.heartbeat_interval_s = float(hb.get("interval_hint_s") or 5.0)
            self.heartbeat_window_s = float(hb.get("timeout_s") or 0.0) or None
            self.heartbeat_error = None
            if self._heartbeat_enabled:
                self.start_heartbeat()
            if build_model:
                try:
                    self.attachment.build_model(model_class)
                except BaseException:
                    self.detach()
                    raise
            return self.attachment

    def heartbeat(self) -> dict[str, Any]:
        """POST /heartbeat: ``{attachment_state, timeout_s, interval_hint_s, weights_state}``.
        The thread started by :meth:`attach` calls it every ``interval_hint_s`` seconds."""
        return self._request("POST", "/api/weights/heartbeat", holder=True)

    def quiesce(self, *, running: Running | None = None) -> dict[str, Any]:
        """POST /quiesce; returns once no forward pass runs (write cycle 2).

        ``running``: ``"finish"`` or ``"hold"`` (contract 4b; ``None``: this client's
        :attr:`running`). The answer's ``parked_sequences`` counts what a hold parked.

        Raises WeightsNotClean, AlreadyQuiesced, PauseInProgress, BarrierUnavailable (also
        reason ``hold_unsupported``: the server's engine cannot park), ModelBusy (reason
        drain_timeout), QueueFull; ``ValueError`` for another ``running``."""
        return self._request(
            "POST",
            "/api/weights/quiesce",
            holder=True,
            retry=True,
            body=self._quiesce_body(running),
        )

    def _quiesce_body(self, running: Running | None) -> dict[str, Any] | None:
        """``None`` (no body: the weights page's quiesce) for finish, else the 4b body."""
        mode = self.running if running is None else _check_running(running)
        return None if mode == "finish" else {"running": mode}

    def commit_begin(self) -> dict[str, Any]:
        """POST /commit-begin: the weights are ``writing`` (write cycle 3).
        Raises NotQuiesced, WeightsNotClean, PauseInProgress."""
        return self._request("POST", "/api/weights/commit-begin", holder=True, retry=True)

    def commit_end(self) -> dict[str, Any]:
        """POST /commit-end: clean again, ``steps_since_load`` + 1 (write cycle 4). ``overran``
        is true when the watchdog had torn the set first. Raises NoOpenCommit."""
        return self._ended(
            self._request("POST", "/api/weights/commit-end", holder=True, retry=True)
        )

    def resume(self) -> dict[str, Any]:
        """POST /resume: release the held requests (write cycle 5). A no-op while serving."""
        return self._request("POST", "/api/weights/resume", holder=True, retry=True)

    @contextlib.contextmanager
    def commit(
        self, *, end_on_error: bool = True, running: Running | None = None
    ) -> Iterator[CommitCycle]:
        """The write bracket: quiesce, commit-begin, (the block: your write), CUDA synchronize,
        commit-end, resume (weights page, The write cycle).

        ``running``: what the quiesce does with the running generations (contract 4b):
        ``"finish"`` waits for them, ``"hold"`` parks them at the next decode step and the
        resume continues them on the new weights; ``None``: this client's :attr:`running`.

        Write only inside the block: a write at any other time is served half-written. Before
        commit-end every CUDA device holding attached weights is synchronized, so the write has
        landed. When the block raises an ``Exception`` the commit is still ended (commit-end,
        then resume) and the exception re-raised: restore the values, or load a checkpoint, if
        the write may have half-happened. With ``end_on_error=False``, or when the process is
        dying (``KeyboardInterrupt``, ``SystemExit``, interpreter shutdown), the commit is left
        open: the watchdog (WEIGHTS_COMMIT_WATCHDOG_MS) tears the set, so nothing half-written
        is served, and POST /api/weights/load recovers it.

        **Pipelined pairs.** The four calls go as two pairs, each sent in one write on the
        keep-alive connection (HTTP/1.1 answers them in order): quiesce + commit-begin on
        entering the block, commit-end + resume on leaving it. Two round trips a step instead of
        four; the server sees the same four calls, answers and audit lines, one after the
        other. Both answers of a pair are always read, so the connection stays usable:

        - quiesce refused: commit-begin, sent already, is refused too (its own refusal, kept
          as a note on the exception) and the quiesce error is raised. Nothing was held.
          Should commit-begin have been accepted anyway (only when this attachment already
          held the barrier: :class:`AlreadyQuiesced`), the commit it opened is ended and the
          barrier resumed first, so nothing is left open for the watchdog to tear.
        - quiesce accepted, commit-begin refused: the barrier is resumed, then the
          commit-begin error is raised (as before pipelining).
        - an answer of the pair could not be read (the connection dropped, a timeout): either
          call may have been accepted, so commit-end + resume are sent on a new connection (an
          accepted commit-begin is ended as an empty commit, counted, before the set can
          tear), then the :class:`TransportError` is raised, with a note saying which.
        - commit-end refused: resume, sent already, releases the barrier; the commit-end error
          is raised. Commit-end accepted, resume refused: the resume error is raised.

        Yields:
            A :class:`CommitCycle` filled with each route's answer.

        Raises:
            The refusals of :meth:`quiesce`, :meth:`commit_begin`, :meth:`commit_end`,
            :meth:`resume` as above, :class:`TransportError`, and a terminal heartbeat failure
            (the attachment was cleared) before anything is sent.
        """
        body = self._quiesce_body(running)
        self._raise_terminal_heartbeat_error()
        cycle = CommitCycle()
        try:
            quiesced, begun = self._pair("quiesce", "commit-begin", body)
        except TransportError as exc:  # no answer read: either call may have been accepted
            self._close_unknown(exc, "quiesce and commit-begin")
            raise
        if isinstance(quiesced, BaseException):
            if isinstance(begun, BaseException):
                quiesced.add_note(f"the pipelined commit-begin was not accepted either: {begun}")
            else:  # this attachment already held the barrier: end the commit it just opened
                try:
                    end, resumed = self._pipelined("commit-end", "resume")
                except Exception as pair_exc:  # noqa: BLE001 - the quiesce error is raised
                    end = resumed = pair_exc
                failed = [x for x in (end, resumed) if isinstance(x, BaseException)]
                quiesced.add_note(
                    "the pipelined commit-begin was accepted (this attachment already held "
                    "the barrier); that empty commit was ended and the barrier resumed"
                    + (f", but: {'; '.join(map(str, failed))}" if failed else "")
                )
                if not isinstance(end, BaseException):
                    self._ended(end)
            raise quiesced
        cycle.quiesce = quiesced
        if isinstance(begun, TransportError):  # commit-begin's answer lost: it may be open
            self._close_unknown(begun, "commit-begin")
            raise begun
        if isinstance(begun, BaseException):
            self._resume_quietly()
            raise begun
        cycle.begin = begun
        try:
            yield cycle
            self._synchronize()
        except BaseException as exc:
            dying = not isinstance(exc, Exception) or sys.is_finalizing()
            if dying or not end_on_error:
                log.warning(
                    "leaving the commit open after %s: the watchdog will tear the set",
                    type(exc).__name__,
                )
                raise
            log.warning("the write raised %s; ending the commit anyway", type(exc).__name__)
            try:
                end, resumed = self._pipelined("commit-end", "resume")
            except Exception as pair_exc:  # noqa: BLE001 - the block's exception wins
                end = resumed = pair_exc
            if isinstance(end, BaseException):
                exc.add_note(f"commit-end after the failed write also failed: {end}")
            else:
                cycle.end = self._ended(end)
            if isinstance(resumed, BaseException):
                exc.add_note(f"resume after the failed write also failed: {resumed}")
            else:
                cycle.resume = resumed
            raise
        end, resumed = self._pair("commit-end", "resume")
        if isinstance(end, BaseException):
            if isinstance(resumed, BaseException):
                log.warning("resume failed: %s", resumed)
                end.add_note(f"the pipelined resume was not accepted either: {resumed}")
            raise end
        cycle.end = self._ended(end)
        if isinstance(resumed, BaseException):
            raise resumed
        cycle.resume = resumed

    def status(self) -> dict[str, Any]:
        """GET /status (no token): the weights page's Status fields."""
        return self._request("GET", "/api/weights/status", token=False)

    def save(self, name: str | None = None) -> dict[str, Any]:
        """POST /api/weights/save (a holder call, contract 5): ``{checkpoint_sha256, name, path,
        model_id, parent_id, steps_since_load, at}``. Raises WeightsNotClean, PauseInProgress,
        BarrierUnavailable, CheckpointExists."""
        return self._request(
            "POST",
            "/api/weights/save",
            holder=True,
            body={} if name is None else {"name": name},
            retry=True,
        )

    def load(self, *, checkpoint: str | None = None, model_id: int | None = None) -> dict[str, Any]:
        """POST /api/weights/load (contract 5): exactly one of ``checkpoint`` (sha256, name or
        path) or ``model_id``. The recovery from torn. Sends the attachment header when this
        client holds one (a trainer token must be the holder while attached).

        Raises:
            ValueError: not exactly one of the two.
            CheckpointNotFound, CheckpointCorrupt, WeightsNotClean, AlreadyAttached, ...
        """
        if (checkpoint is None) == (model_id is None):
            raise ValueError("give exactly one of checkpoint or model_id")
        body = {"checkpoint": checkpoint} if checkpoint is not None else {"model_id": model_id}
        data = self._request(
            "POST",
            "/api/weights/load",
            holder=self._attachment_id is not None,
            body=body,
            retry=True,
        )
        self.steps_since_load = data.get("steps_since_load", self.steps_since_load)
        return data

    def tokenizer(self) -> Any:
        """The served model's tokenizer (transformers ``AutoTokenizer``), read from the folder of
        its catalogue row (``GET /api/models/{id}``; the trainer runs on the server's machine, so
        the path is readable here). Use it with :func:`miserver.trainer.chat_batch`.

        Raises:
            NotAttachedHere: call :meth:`attach` first (it says which model is served).
            TrainerError: the row's folder has no tokenizer (a GGUF row) or cannot be read.
        """
        held = self.attachment is not None and self._attachment_id is not None
        model_id = self.attachment.model_ref.get("model_id") if held else None
        if model_id is None:
            raise NotAttachedHere("tokenizer(): attach() first (it says which model is served)")
        row = self._request("GET", f"/api/models/{int(model_id)}", token=False)
        path = row.get("path") or ""
        if not (Path(path) / "tokenizer_config.json").is_file():
            raise TrainerError(
                f"the served row {row.get('name')!r} has no tokenizer in {path!r} "
                "(a GGUF row, or a folder this machine cannot read)"
            )
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)

    def clear_stale(self) -> dict[str, Any]:
        """POST /clear-stale (operator token only; weights page, Timers)."""
        return self._request("POST", "/api/weights/clear-stale")

    def detach(self) -> dict[str, Any] | None:
        """Release in the documented order, then POST /detach (weights page, Releasing the
        handles): stop the heartbeat, drop every rebuilt view (also those bound into a model),
        ``torch.cuda.ipc_collect()``, POST /detach. Idempotent: None when nothing is attached.

        An attachment the server no longer holds (cleared as stale) is logged, not raised.
        Raises another refusal or :class:`TransportError` of POST /detach; the client holds no
        attachment afterwards either way.
        """
        with self._lock:
            if self._attachment_id is None and (
                self.attachment is None or self.attachment.released
            ):
                return None
            self.stop_heartbeat()
            self._detach_answer = None
            if self.attachment is not None and not self.attachment.released:
                self.attachment.weights.release()  # ... then calls _post_detach
            else:
                self._post_detach()
            return self._detach_answer

    def close(self) -> None:
        """Detach (when attached) and close the open connections. The client stays usable (a
        later call opens a new connection), like ``requests.Session.close``."""
        try:
            self.detach()
        finally:
            self._session.close()

    def __enter__(self) -> WeightsClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the block's exception wins over a failed detach
            self.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("detach after %s failed: %s", exc_type.__name__, exc)

    def __repr__(self) -> str:
        state = "attached" if self._attachment_id is not None else "not attached"
        where = (
            self.base_url
            if self.unix_socket is None
            else f"{self.base_url} (unix:{self.unix_socket})"
        )
        return f"<WeightsClient {where} {state}>"

    # --- internals --------------------------------------------------------------------------
    def _post_detach(self) -> None:
        """The ``on_release`` of the rebuilt weights: the last step of the release order."""
        self.stop_heartbeat()
        with self._lock:
            if self._attachment_id is None:
                return
            try:
                self._detach_answer = self._request("POST", "/api/weights/detach", holder=True)
            except WeightsError as exc:
                if exc.code not in ("NOT_ATTACHED", "NOT_ATTACHMENT_HOLDER"):
                    raise
                log.warning("detach: the server no longer holds this attachment (%s)", exc.code)
            finally:
                self._attachment_id = None
                atexit.unregister(self._detach_at_exit)

    def _post_detach_quietly(self) -> None:
        try:
            self._post_detach()
        except Exception as exc:  # noqa: BLE001
            log.warning("detach failed: %s", exc)

    def _detach_at_exit(self) -> None:
        try:
            self.detach()
        except Exception as exc:  # noqa: BLE001 - at exit there is no caller to raise to
            log.warning("detach at exit failed: %s", exc)

    def _close_unknown(self, exc: TransportError, lost: str) -> None:
        """After the answer to ``lost`` (calls of the opening pair) could not be read, end what
        they may have opened: commit-end, then resume, pipelined on a new connection. A
        commit-begin that was accepted is ended as an empty commit (counted in
        ``steps_since_load``, nothing was written) and the barrier resumed; calls that were not
        accepted make these refused. What happened is added to ``exc`` as a note; nothing is
        raised here."""
        try:
            end, resumed = self._pipelined("commit-end", "resume")
        except Exception as pair_exc:  # noqa: BLE001 - the transport error is raised
            exc.add_note(
                f"the answer to {lost} was lost, and commit-end + resume could not be sent "
                f"after it ({pair_exc}): if commit-begin was accepted, the commit is open and "
                "the watchdog (WEIGHTS_COMMIT_WATCHDOG_MS) tears the set; POST "
                "/api/weights/load recovers it"
            )
            return
        if not isinstance(end, BaseException):
            self._ended(end)
            what = "commit-begin had been accepted: that empty commit was ended"
        else:
            what = f"no commit was open (commit-end: {end})"
        how = (
            "the barrier was resumed"
            if not isinstance(resumed, BaseException)
            else f"resume: {resumed}"
        )
        exc.add_note(
            f"the answer to {lost} was lost; commit-end + resume sent after it: {what}; {how}"
        )
        log.warning("the answer to %s was lost; %s; %s", lost, what, how)

    def _resume_quietly(self) -> None:
        try:
            self.resume()
        except Exception as exc:  # noqa: BLE001
            log.warning("resume failed: %s", exc)

    def _synchronize(self) -> None:
        if self.attachment is not None:
            for device in self.attachment.cuda_devices:
                torch.cuda.synchronize(device)

    def _raise_terminal_heartbeat_error(self) -> None:
        err = self.heartbeat_error
        if isinstance(err, WeightsError) and err.code in HEARTBEAT_TERMINAL:
            raise err

    def start_heartbeat(self) -> None:
        """Start the heartbeat thread (daemon; :meth:`attach` does it unless ``heartbeat=False``):
        POST /heartbeat every ``heartbeat_interval_s`` (the server's ``interval_hint_s``). A
        failure is logged and kept in ``heartbeat_error``; a refusal that cannot heal
        (NOT_ATTACHED, NOT_ATTACHMENT_HOLDER, a token refusal) stops the thread, and the next
        :meth:`commit` raises it. Weights page, Timers."""
        self.stop_heartbeat()
        if self._attachment_id is None:
            raise NotAttachedHere("no attachment to keep alive; call attach() first")
        self._hb_stop = threading.Event()
        self._hb_session = _Connection(self.base_url, self.unix_socket)
        self._hb_thread = threading.Thread(
            target=self._heartbeat_loop,
            args=(self._hb_stop,),
            name="miserver-heartbeat",
            daemon=True,
        )
        self._hb_thread.start()

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat thread and wait for a heartbeat in flight (detach does it)."""
        thread, self._hb_thread = self._hb_thread, None
        self._hb_stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.timeout)
        if self._hb_session is not None and thread is not None:
            self._hb_session.close()

    def _heartbeat_timeout(self) -> float:
        """Seconds one heartbeat may wait for its answer (:func:`heartbeat.answer_timeout`)."""
        return heartbeat.answer_timeout(self)

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        heartbeat.keep_alive(self, stop)


__all__ = [
    "ATTACHMENT_HEADER",
    "HEARTBEAT_TERMINAL",
    "Attachment",
    "CommitCycle",
    "WeightsClient",
]
