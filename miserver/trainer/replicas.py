"""Several miserver replicas written by one broadcast (contract section 10, the process-group
transport): the trainer's client for trainers on other hosts.

::

    from miserver.trainer.replicas import ReplicaSet

    with ReplicaSet(["http://10.0.0.2:8000", "http://10.0.0.3:8000"], token,
                    advertise_host="10.0.0.1", port=29500) as replicas:
        weights = replicas.attach()                 # one group over the trainer and every replica
        weights.fill_from(my_model.state_dict())   # start from the values the replicas serve
        model = replicas.build_model()              # or bind_into(your_model, weights)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        for batch in data:
            model(**batch).loss.backward()
            with replicas.commit():                 # quiesce all, commit-begin all
                opt.step()                          # writes the trainer's copy
            # leaving the block: one broadcast, commit-end all, resume all
    # leaving the with: every replica detached, the group destroyed

Each replica keeps its own lifecycle, barrier, timers and audit; this class only drives them in
step. A replica that refuses is named: :class:`ReplicaRefused` carries ``(url, call, error)``
for each refusal, and says what was done about the others.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from miserver.trainer import TrainerError, build_model
from miserver.trainer.client import WeightsClient, WeightsError
from miserver.trainer.process_group import FlatWeights, LayoutError, TrainerGroup

log = logging.getLogger("miserver.trainer")

__all__ = ["ReplicaRefused", "ReplicaSet"]


class ReplicaRefused(TrainerError):
    """One or more replicas refused a call of the bracket (or could not be reached).

    Attributes:
        failures: ``[(url, call, error)]``: which replica refused which call, and the error
            (a :class:`~miserver.trainer.client.WeightsError` subclass or a transport error).
        done: what was done about the others (a sentence).
    """

    def __init__(self, failures: list[tuple[str, str, BaseException]], done: str) -> None:
        self.failures = failures
        self.done = done
        parts = [f"{url} refused {call}: {err}" for url, call, err in failures]
        super().__init__("; ".join(parts) + (f". {done}" if done else ""))

    @property
    def codes(self) -> dict[str, str | None]:
        """url -> the refusal's code (None for a transport error)."""
        return {url: getattr(err, "code", None) for url, _, err in self.failures}


class Bracket:
    """One open commit over every replica (yielded by :meth:`ReplicaSet.commit`).

    Attributes:
        begun: each replica's commit-begin answer, in order.
        ranges: the byte ranges every replica armed (None: every storage whole).
        sent: bytes sent so far in this bracket (per replica).
    """

    def __init__(self, group: TrainerGroup, weights: FlatWeights, begun: list[dict], ranges):
        self._group, self._weights = group, weights
        self.begun = begun
        self.ranges = ranges
        self.sent = 0
        self.sends = 0

    def send(self, weights: FlatWeights | None = None, ranges=None) -> int:
        """Send now instead of on leaving the block: ``weights`` (default: the attached copy)
        over ``ranges`` (default: the bracket's). Each replica receives the spans it armed in
        order, so the sends of one bracket must together cover exactly the bracket's
        ``ranges`` (a second send of the whole arena needs ``ranges`` armed twice). Returns the
        bytes sent."""
        n = self._group.send(
            self._weights if weights is None else weights,
            self.ranges if ranges is None else ranges,
        )
        self.sent += n
        self.sends += 1
        return n


class ReplicaSet:
    """The trainer's side of one process group over several replicas (contract section 10).

    Args:
        urls: each replica's ``http://host:port``; replica ``i`` is rank ``i + 1``.
        token: a WEIGHTS_TOKENS secret every replica accepts (role trainer). Never logged.
        advertise_host: the address the replicas reach this trainer at (``init_method``).
        port: the rendezvous port (the ``TCPStore``); 0 picks a free one.
        device: where the trainer's copy lives (``cpu``: gloo; a CUDA device: NCCL).
        timeout_s: HTTP timeout, the join timeout and each collective's timeout.
        heartbeat: keep each attachment alive with its own heartbeat thread.
    """

    def __init__(
        self,
        urls: Sequence[str],
        token: str,
        *,
        advertise_host: str = "127.0.0.1",
        port: int = 0,
        device: torch.device | str = "cpu",
        timeout_s: float = 120.0,
        heartbeat: bool = True,
    ) -> None:
        if not urls:
            raise ValueError("give at least one replica URL")
        if len(set(urls)) != len(urls):
            raise ValueError("a replica URL is listed twice")
        self.urls = [u.rstrip("/") for u in urls]
        self.clients = [
            WeightsClient(u, token, timeout=timeout_s, heartbeat=heartbeat) for u in self.urls
        ]
        self.advertise_host = advertise_host
        self.port = port
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.group: TrainerGroup | None = None
        self.weights: FlatWeights | None = None
        self.bodies: list[dict[str, Any]] = []
        self.steps_since_load: list[int | None] = [None] * len(self.urls)
        self._pool = ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="replica")

    # --- plumbing ---------------------------------------------------------------------------
    def _each(
        self, call: str, fn: Callable[[WeightsClient], Any], which: Sequence[int] | None = None
    ) -> tuple[dict[int, Any], list[tuple[str, str, BaseException]]]:
        """Run ``fn`` on each replica (``which``: those indices) at once; returns the answers by
        index and the failures as ``(url, call, error)``."""
        idx = list(range(len(self.clients))) if which is None else list(which)
        futures = {i: self._pool.submit(fn, self.clients[i]) for i in idx}
        answers: dict[int, Any] = {}
        failures: list[tuple[str, str, BaseException]] = []
        for i, fut in futures.items():
            try:
                answers[i] = fut.result()
            except Exception as exc:  # noqa: BLE001 - reported per replica
                failures.append((self.urls[i], call, exc))
        return answers, failures

    @staticmethod
    def _attach_one(client: WeightsClient, body: dict[str, Any]) -> dict[str, Any]:
        data = client._request("POST", "/api/weights/attach", body=body)
        att = data.pop("attachment_id", None)
        if att is None:
            raise WeightsError(None, None, 200, "the attach answer has no attachment_id")
        client._attachment_id = att
        atexit.register(client._detach_at_exit)
        hb = data.get("heartbeat") or {}
        client.heartbeat_interval_s = float(hb.get("interval_hint_s") or 5.0)
        client.heartbeat_window_s = float(hb.get("timeout_s") or 0.0) or None
        client.steps_since_load = data.get("steps_since_load")
        if client._heartbeat_enabled:
            client.start_heartbeat()
        return data

    @staticmethod
    def _commit_begin(client: WeightsClient, ranges: Any) -> dict[str, Any]:
        body = None if ranges is None else {"ranges": [list(r) for r in ranges]}
        return client._request(
            "POST", "/api/weights/commit-begin", holder=True, body=body, retry=True
        )

    # --- attach -----------------------------------------------------------------------------
    def attach(self) -> FlatWeights:
        """Host the rendezvous, attach to every replica with its rank, join the group, lay the
        trainer's copy out as the arenas are laid out. Every replica must serve the same layout
        (the same model).

        Returns:
            The trainer's :class:`~miserver.trainer.process_group.FlatWeights` (zeros: fill them with
            the values the replicas serve, :meth:`FlatWeights.fill_from`).

        Raises:
            ReplicaRefused: a replica refused the attach (the others are detached again).
            LayoutError: the replicas' layouts differ.
            GroupUnavailable: not every replica joined within ``timeout_s``.
        """
        if self.group is not None:
            raise TrainerError("this ReplicaSet is attached already; detach() first")
        group = TrainerGroup(
            len(self.urls) + 1,
            port=self.port,
            advertise_host=self.advertise_host,
            device=self.device,
            timeout_s=self.timeout_s,
        )
        answers, failures = self._each(
            "attach",
            lambda c: self._attach_one(c, group.attach_body(self.clients.index(c) + 1)),
        )
        if failures:
            self._detach_quietly(answers)
            group.destroy()
            raise ReplicaRefused(failures, "the replicas that had attached were detached again")
        bodies = [answers[i] for i in range(len(self.urls))]
        layouts = [(b.get("storages"), b.get("parameters")) for b in bodies]
        if any(lay != layouts[0] for lay in layouts[1:]):
            self._detach_quietly(answers)
            group.destroy()
            raise LayoutError(
                "the replicas serve different layouts (storages[] or parameters[] differ): "
                "every replica must serve the same model"
            )
        try:
            weights = group.layout(bodies[0])
            group.connect()
        except BaseException:
            self._detach_quietly(answers)
            group.destroy()
            raise
        self.group, self.weights, self.bodies = group, weights, bodies
        self.steps_since_load = [b.get("steps_since_load") for b in bodies]
        for url, b in zip(self.urls, bodies, strict=True):
            if b.get("weights_state") != "clean":
                log.warning(
                    "%s: attached to weights that are %s; recover with POST /api/weights/load",
                    url,
                    b.get("weights_state"),
                )
        return weights

    def build_model(self, model_class: type | None = None) -> torch.nn.Module:
        """The served architecture from the first replica's ``config``, its parameters bound to
        the trainer's copy (:func:`miserver.trainer.build_model`)."""
        if self.weights is None:
            raise TrainerError("attach() first")
        return build_model(self.bodies[0], self.weights, model_class=model_class)

    # --- the bracket ------------------------------------------------------------------------
    @contextlib.contextmanager
    def commit(self, ranges: Sequence[Sequence[int]] | None = None) -> Iterator[Bracket]:
        """The write bracket over every replica: quiesce all, commit-begin all (arming each
        replica's receive, whole arena or ``ranges``), the block (write the trainer's copy),
        one broadcast, commit-end all, resume all.

        Yields a :class:`Bracket` (the commit-begin answers; :meth:`Bracket.send` sends inside
        the block, else leaving it sends the attached copy once). The trainer's copy is not
        served: step the optimizer before the bracket, which then only moves the bytes.
        Refusals:

        - a quiesce refused: the replicas that quiesced are resumed; nothing was written.
        - a commit-begin refused: nothing is sent (a broadcast needs every rank); the replicas
          that had begun stay writing until their watchdog tears them, as a trainer that
          stalls would. Detach, attach again and recover them with POST /api/weights/load.
        - the block raised before sending: as a refused commit-begin (nothing is sent); the
          error is raised.
        - a broadcast failed (a replica left), or the block raised after sending part: every
          replica is sent commit-end (those whose receive did not complete refuse it, and
          their watchdog tears them) and resume.
        - a commit-end refused: the others are ended and every replica resumed first.

        Raises:
            ReplicaRefused: naming each ``(url, call, error)``.
        """
        group, weights = self.group, self.weights
        if group is None or weights is None:
            raise TrainerError("attach() first")
        for c in self.clients:
            c._raise_terminal_heartbeat_error()
        quiesced, failures = self._each("quiesce", lambda c: c.quiesce())
        if failures:
            _, more = self._each("resume", lambda c: c.resume(), sorted(quiesced))
            raise ReplicaRefused(
                failures + more, "the replicas that had quiesced were resumed; nothing written"
            )
        begun, failures = self._each("commit-begin", lambda c: self._commit_begin(c, ranges))
        if failures:
            left = [i for i in range(len(self.urls)) if i not in begun]
            _, more = self._each("resume", lambda c: c.resume(), left)
            raise ReplicaRefused(
                failures + more,
                "nothing was sent; "
                + (
                    f"{', '.join(self.urls[i] for i in sorted(begun))} had begun and tear at "
                    "their watchdog: detach, attach again and POST /api/weights/load"
                    if begun
                    else "no replica had begun"
                ),
            )
        bracket = Bracket(group, weights, [begun[i] for i in range(len(self.urls))], ranges)
        try:
            yield bracket
            if bracket.sends == 0:
                bracket.send()
        except Exception as exc:
            if not isinstance(exc, ReplicaRefused) and bracket.sends == 0:
                exc.add_note(
                    "nothing was sent: every replica stays writing until its watchdog tears "
                    "it; detach, attach again and POST /api/weights/load"
                )
                raise
            ended, failures = self._each("commit-end", lambda c: c.commit_end())
            self._each("resume", lambda c: c.resume())
            raise ReplicaRefused(
                [("trainer", "broadcast", exc), *failures],
                "the broadcast failed: the replicas whose receive did not complete tear at "
                "their watchdog",
            ) from exc
        except BaseException as exc:
            exc.add_note("the commit was left open: the replicas' watchdog tears their sets")
            raise
        ended, failures = self._each("commit-end", lambda c: c.commit_end())
        for i, data in ended.items():
            self.steps_since_load[i] = self.clients[i]._ended(data).get("steps_since_load")
        _, resumed_failures = self._each("resume", lambda c: c.resume())
        if failures or resumed_failures:
            raise ReplicaRefused(
                failures + resumed_failures, "every replica was sent commit-end and resume"
            )

    # --- the rest ---------------------------------------------------------------------------
    def status(self) -> list[dict[str, Any]]:
        """GET /api/weights/status of every replica, in order."""
        answers, failures = self._each("status", lambda c: c.status())
        if failures:
            raise ReplicaRefused(failures, "")
        return [answers[i] for i in range(len(self.urls))]

    def save(self) -> list[dict[str, Any]]:
        """POST /api/weights/save on every replica (each saves its own checkpoint)."""
        answers, failures = self._each("save", lambda c: c.save())
        if failures:
            raise ReplicaRefused(failures, "")
        return [answers[i] for i in range(len(self.urls))]

    def _detach_quietly(self, which: Any = None) -> None:
        idx = list(range(len(self.clients))) if which is None else sorted(which)
        _, failures = self._each("detach", lambda c: c.detach(), idx)
        for url, _, err in failures:
            log.warning("%s: detach failed: %s", url, err)

    def detach(self) -> None:
        """Detach from every replica (each destroys its side of the group) and destroy the
        trainer's side. Idempotent; a replica that fails to detach is logged."""
        group, self.group, self.weights = self.group, None, None
        self._detach_quietly()
        if group is not None:
            group.destroy()

    def close(self) -> None:
        """Detach and close every connection."""
        try:
            self.detach()
        finally:
            for c in self.clients:
                c.close()
            self._pool.shutdown(wait=False)

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
