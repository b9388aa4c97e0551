"""GGUF rows served through llama.cpp (companion contract 4a).

A ``format: gguf`` catalogue row is loaded into llama.cpp's own server, embedded in this process
by the ``xllamacpp`` binding (prebuilt CPU wheels; docs/decisions.md says why this binding). The
resident is of its own kind: :class:`GGUFModel` stands where a transformers model stands on a
safetensors resident, and :func:`submit` where the engine's batch stands: a request's sequences
start on llama.cpp's parallel slots as soon as the scheduler grants it, into the resident's
running work while that has room (``MAX_BATCH_SIZE`` sequences; the scheduler's
``fill_running``), so concurrent requests share llama.cpp's steps as they arrive. The ``/v1``
path (admission, the scheduler's slot, the queue, the barrier, rendering) is the one every
resident takes. What stays miserver's own:

- the prompt: the chat template and the tokenizer are transformers', read from the GGUF file
  itself (``gguf_file=``), so the context checks, ``n`` and usage count the same tokens, and
  llama.cpp receives token ids;
- the text: llama.cpp streams UTF-8-complete pieces; miserver's
  :class:`~miserver.serving.engine.detokenize.StopMatcher` holds back what could start a stop
  sequence, so a stop sequence is never emitted (llama.cpp is given none);
- cancellation: the streaming callback returns True once the generation is cancelled (a client
  that went away), so llama.cpp stops at its next token.

llama.cpp samples: ``temperature`` (0 is greedy), ``top_p`` and ``seed`` are passed as they are,
and its other samplers are turned off (``top_k`` 0, ``min_p`` 0), so a request samples what the
OpenAI fields describe. ``logprobs`` come from llama.cpp's ``n_probs``; prompt logprobs (``echo``
with ``logprobs``) are not given by llama.cpp and are refused 400 naming ``echo``. The ``n``
choices of a request run as ``n`` requests on llama.cpp's parallel slots (``n_parallel`` is
``MAX_BATCH_SIZE``), choice ``i`` seeded like the engine's
(:func:`~miserver.serving.engine.sampling.choice_seed`).

What a GGUF resident cannot do (attach, save, in-place weights load, adapters) is refused by the
lifecycle table before anything is touched (weights page: Which models can be attached, reason
``gguf``; the ``GGUF_UNSUPPORTED`` rows; docs/reference.md lists the codes).

``response_format`` (``json_object``, ``json_schema``) is enforced by llama.cpp's own grammar: the
request body's ``json_schema``, which llama.cpp turns into its grammar (this build's is
llguidance's ``%json``) and applies in its sampler. llama.cpp drops a grammar it cannot build
without a word, so :func:`json_schema_grammar` compiles the schema with the ``llguidance``
package first: a schema it refuses is a 400 before anything is queued. ``tools`` stay refused (a
400 naming ``tools``): miserver's tool-call grammars need its own sampler.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from miserver.serving.engine.detokenize import StopMatcher
from miserver.serving.engine.generation import (
    Finished,
    GenerationError,
    SamplingParams,
    Started,
    TextDelta,
    TokenLogprob,
)
from miserver.spec import codes
from miserver.spec.errors import ApiError
from miserver.spec.settings import Settings, resolved_gguf_threads, resolved_max_batch_size

log = logging.getLogger("miserver.gguf")

#: The Python package of the llama.cpp binding (a dependency of miserver: pyproject.toml).
BINDING = "xllamacpp"


def binding_available() -> bool:
    """Whether the llama.cpp binding (:data:`BINDING`) is importable."""
    return importlib.util.find_spec(BINDING) is not None


def install_command() -> str:
    """The command that installs the binding into the running interpreter's environment."""
    import sys

    return f"{sys.executable} -m pip install {BINDING}"


def _refuse(row: Any, what: str) -> ApiError:
    return ApiError(
        codes.MODEL_LOAD_FAILED,
        f"catalogue row {row.name!r} cannot be loaded from {row.path}: {what}; nothing was "
        "unloaded (fix or re-register the file)",
        status=400,
        details={"model_id": row.id, "name": row.name, "path": row.path},
    )


def check_loadable(row: Any) -> None:
    """Refuse a GGUF row this installation cannot load, before anything is unloaded.

    Raises:
        ApiError: 400 BACKEND_UNAVAILABLE (reason ``gguf``) when the binding is not installed,
            naming the command that installs it; 400 MODEL_LOAD_FAILED when the file is gone.
    """
    if not binding_available():
        raise ApiError(
            codes.BACKEND_UNAVAILABLE,
            f"catalogue row {row.name!r} is a GGUF file, served through llama.cpp by the "
            f"{BINDING} package, which is not installed in this environment: install it with "
            f"{install_command()} (the README's set-up does)",
            reason="gguf",
            details={"model_id": row.id, "name": row.name, "package": BINDING},
        )
    if not Path(row.path).is_file():
        raise _refuse(row, "the file is not there (moved or deleted?)")


def preflight(row: Any) -> None:
    """Check a GGUF row's file without loading it, while the resident still serves: the
    binding, the file, its GGUF header and tensor table (the ``gguf`` package's reader: a file
    cut short or damaged fails here). Blocking (a memory map, milliseconds).

    Raises:
        ApiError: as :func:`check_loadable`; 400 MODEL_LOAD_FAILED naming the problem.
    """
    check_loadable(row)
    try:
        import gguf as gguf_format

        reader = gguf_format.GGUFReader(row.path)
        tensors = len(reader.tensors)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a damaged file
        raise _refuse(
            row, f"it is not a readable GGUF file ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    if tensors == 0:
        raise _refuse(row, "the GGUF file holds no tensors")


@dataclasses.dataclass
class GGUFConfig:
    """What the ``/v1`` context checks read of a model's config: ``max_position_embeddings``
    is the context window llama.cpp was given (tokens)."""

    max_position_embeddings: int
    model_type: str = "gguf"


class GGUFModel:
    """A GGUF file loaded into llama.cpp's server (in process), standing where a transformers
    model stands on a safetensors resident.

    Attributes:
        path: the ``.gguf`` file.
        config: :class:`GGUFConfig` (the context window, tokens).
        threads: CPU threads llama.cpp decodes with (``GGUF_THREADS``).
        parallel: llama.cpp's parallel slots (``MAX_BATCH_SIZE``): sequences decoded together.
    """

    generation_config = None

    def __init__(self, path: str, context: int, threads: int, parallel: int) -> None:
        import xllamacpp as xlc

        params = xlc.CommonParams()
        params.model.path = path
        params.n_ctx = context
        params.n_parallel = parallel
        params.kv_unified = True  # the slots share one cache of `context` cells
        params.cpuparams.n_threads = threads
        params.cpuparams_batch.n_threads = threads
        params.hostnames = ["127.0.0.1"]  # its HTTP side is not miserver's: loopback only
        params.port = 0
        params.verbosity = -1
        params.warmup = False
        self.path = path
        self.config = GGUFConfig(context)
        self.threads = threads
        self.parallel = parallel
        self._server: Any = xlc.Server(params)

    @property
    def server(self) -> Any:
        """The ``xllamacpp.Server``.

        Raises:
            RuntimeError: the model was closed (unloaded).
        """
        if self._server is None:
            raise RuntimeError("the GGUF model was unloaded")
        return self._server

    @property
    def listening_address(self) -> str | None:
        """Where llama.cpp's own HTTP server answers (loopback; benchmarks/gguf_peers.py)."""
        return None if self._server is None else self._server.listening_address

    def close(self) -> None:
        """Stop llama.cpp's server and free the model and its cache (an unload; idempotent)."""
        server, self._server = self._server, None
        del server

    def parameters(self) -> Any:
        """No torch parameters (the weights live in llama.cpp)."""
        return iter(())


def gguf_context_length(path: str) -> int:
    """The context window the GGUF file's metadata declares (``<arch>.context_length``);
    2048 when it declares none."""
    import gguf as gguf_format

    reader = gguf_format.GGUFReader(path)
    for name, field in reader.fields.items():
        if name.endswith(".context_length") and field.types:
            with contextlib.suppress(Exception):
                return int(field.contents())
    return 2048


def load_gguf(row: Any, settings: Settings) -> tuple[GGUFModel, Any]:
    """Load a GGUF row: its tokenizer (transformers, from the file) and llama.cpp's server.

    Blocking (seconds): call it in a worker thread. Returns ``(model, tokenizer)``: the
    :class:`GGUFModel` (CPU, never attachable) and the transformers tokenizer.

    Raises:
        ApiError: as :func:`preflight`; 500 MODEL_LOAD_FAILED when llama.cpp cannot open the
            file (the message says so).
    """
    preflight(row)
    path = Path(row.path)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        context = gguf_context_length(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers' errors, reported in words
        raise ApiError(
            codes.MODEL_LOAD_FAILED,
            f"catalogue row {row.name!r}: the tokenizer of {row.path} could not be read: "
            f"{type(exc).__name__}: {str(exc)[:300]}",
            details={"model_id": row.id, "name": row.name, "path": row.path},
        ) from None
    threads = resolved_gguf_threads(settings)
    parallel = resolved_max_batch_size(settings, "cpu")
    try:
        model = GGUFModel(str(path), context, threads, parallel)
    except Exception as exc:  # noqa: BLE001 - llama.cpp says only that it failed
        raise ApiError(
            codes.MODEL_LOAD_FAILED,
            f"catalogue row {row.name!r}: llama.cpp could not open {row.path} "
            f"({type(exc).__name__}: {str(exc)[:300]})",
            details={"model_id": row.id, "name": row.name, "path": row.path},
        ) from None
    log.info(
        "GGUF model %s in llama.cpp: context %d tokens, %d threads, %d parallel slots",
        row.name,
        context,
        threads,
        parallel,
    )
    return model, tokenizer


@dataclasses.dataclass(frozen=True)
class JsonSchemaGrammar:
    """A ``response_format`` as llama.cpp enforces it, standing where a
    :class:`~miserver.serving.engine.constraints.Constraint` stands in
    :attr:`SamplingParams.constraint <miserver.serving.engine.sampling.SamplingParams>` on a
    GGUF resident.

    Attributes:
        schema: the JSON schema (``{"type": "object"}`` for ``json_object``), checked by
            :func:`~miserver.serving.structured.response_format.parse_response_format`.
        description: for logs and errors (``json_schema 'city'``).
    """

    schema: dict[str, Any]
    description: str = "json_schema"

    def request_field(self) -> dict[str, Any]:
        """The completion body's ``json_schema``: the schema with llguidance's JSON options
        (``x-guidance``: whitespace as ``json.dumps`` writes it, as on a transformers resident:
        :data:`~miserver.serving.engine.constraints.JSON_OPTIONS`)."""
        from miserver.serving.engine.constraints import JSON_OPTIONS

        return {**self.schema, "x-guidance": dict(JSON_OPTIONS)}


def json_schema_grammar(
    schema: dict[str, Any], description: str = "json_schema"
) -> JsonSchemaGrammar:
    """The grammar llama.cpp enforces ``schema`` with, compiled first by the ``llguidance``
    package (no tokenizer needed; milliseconds) so that a schema llama.cpp could not build a
    grammar from (an unknown ``format``, a ``pattern`` that is no regular expression) is refused
    instead of silently giving free text.

    Raises:
        ConstraintError: llguidance refuses the schema (its message names the keyword).
    """
    import llguidance

    from miserver.serving.engine.constraints import JSON_OPTIONS, ConstraintError

    grammar = JsonSchemaGrammar(schema, description)
    try:
        compiled = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=JSON_OPTIONS
        )
    except ValueError as exc:
        raise ConstraintError(f"{description}: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, None)
    if is_error:
        raise ConstraintError(f"{description}: {messages[0] if messages else 'invalid schema'}")
    return grammar


def is_gguf(model: Any) -> bool:
    """Whether ``model`` is a :class:`GGUFModel` (a resident of this kind)."""
    return isinstance(model, GGUFModel)


# --- generation -------------------------------------------------------------------------------
@dataclasses.dataclass
class _Timing:
    started: float = 0.0
    ended: float = 0.0
    thread: str = ""
    steps: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def _logprob(entry: dict[str, Any]) -> TokenLogprob:
    top = tuple(
        (int(t["id"]), str(t["token"]), float(t["logprob"]), bytes(t.get("bytes") or b""))
        for t in entry.get("top_logprobs") or ()
    )
    return TokenLogprob(
        int(entry["id"]),
        str(entry["token"]),
        bytes(entry.get("bytes") or b""),
        float(entry["logprob"]),
        top,
    )


class GGUFGeneration:
    """One sequence generated by llama.cpp, with the interface of the engine's
    :class:`~miserver.serving.engine.generation.Generation`: :meth:`events` yields one
    :class:`Started`, :class:`TextDelta` s and one :class:`Finished`; :meth:`cancel` stops it
    at llama.cpp's next token; :meth:`wait` returns once its worker thread is done.

    Args:
        model: the :class:`GGUFModel`.
        tokenizer: its tokenizer (unused here: llama.cpp decodes the text).
        prompt_ids: the prompt's token ids.
        params: :class:`SamplingParams` (``echo`` must be False).
        stream: as the engine's: False sends the text as one delta at the end.
    """

    def __init__(
        self,
        model: GGUFModel,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stream: bool = True,
    ) -> None:
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params = params
        self.stream = stream
        self.timing = _Timing()
        self._cancel = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Any] | None = None
        self._done: asyncio.Future[None] | None = None
        self._held: list[TextDelta] = []

    # --- event-loop side ----------------------------------------------------------------------
    def bind(self) -> None:
        """Make the event queue on the running loop, before the thread starts."""
        if self._loop is not None:
            raise RuntimeError("already started")
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._done = self._loop.create_future()

    def start(self) -> None:
        """Run the generation on a thread of its own (llama.cpp batches the threads' requests
        on its parallel slots)."""
        if self._loop is None:
            self.bind()
        threading.Thread(target=self._run, name="gguf-generation", daemon=True).start()

    def cancel(self) -> None:
        """Stop before llama.cpp's next token (thread-safe, idempotent)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def events(self) -> AsyncIterator[Any]:
        """The events; a llama.cpp failure is raised as :class:`GenerationError`."""
        assert self._queue is not None, "start() first"
        while True:
            event = await self._queue.get()
            if isinstance(event, BaseException):
                raise GenerationError(
                    f"generation failed: {type(event).__name__}: {event}"
                ) from event
            yield event
            if isinstance(event, Finished):
                return

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the event loop once the worker thread is done."""
        assert self._done is not None, "start() first"
        self._done.add_done_callback(lambda _f: callback())

    async def wait(self) -> None:
        """Wait until the worker thread is done with this sequence."""
        assert self._done is not None, "start() first"
        await asyncio.shield(self._done)

    # --- thread side --------------------------------------------------------------------------
    def _post(self, event: Any) -> None:
        assert self._loop is not None and self._queue is not None
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody listens any more
            self._cancel.set()

    def _emit(self, event: Any) -> None:
        if not self.stream and isinstance(event, TextDelta):
            self._held.append(event)
            return
        if self._held:
            held, self._held = self._held, []
            self._post(
                TextDelta("".join(d.text for d in held), tuple(e for d in held for e in d.logprobs))
            )
        self._post(event)

    def _request(self) -> dict[str, Any]:
        p = self.params
        body: dict[str, Any] = {
            "prompt": self.prompt_ids,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": 0,
            "min_p": 0.0,
            "stream": True,
            "cache_prompt": True,
        }
        if p.seed is not None:
            # llama.cpp's seeds are 32 bits, and 0xFFFFFFFF is its "random" (LLAMA_DEFAULT_SEED)
            body["seed"] = min(p.seed % 2**32, 2**32 - 2)
        if p.logprobs is not None:
            body["n_probs"] = max(1, p.logprobs)
        if isinstance(p.constraint, JsonSchemaGrammar):
            body["json_schema"] = p.constraint.request_field()
        elif p.constraint is not None:  # miserver's own grammars need its sampler
            raise ValueError(f"a GGUF resident cannot enforce {p.constraint!r}")
        return body

    def _run(self) -> None:
        self.timing.started = time.perf_counter()
        self.timing.thread = threading.current_thread().name
        try:
            self._generate()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
            log.warning("GGUF generation failed: %s: %s", type(exc).__name__, exc)
            self._held = []
            self._post(exc)
        finally:
            self.timing.ended = time.perf_counter()
            loop, done = self._loop, self._done
            assert loop is not None and done is not None

            def _set() -> None:
                if not done.done():
                    done.set_result(None)

            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set)

    def _generate(self) -> None:
        want = self.params.logprobs
        stopper = StopMatcher(self.params.stop)
        state = {"tokens": 0, "decoded": 0, "released": 0, "finish": None, "usage": None}
        pending: list[tuple[int, TokenLogprob]] = []
        stopped = [False]
        errors: list[str] = []
        self._emit(Started(len(self.prompt_ids)))

        def release(text: str) -> None:
            state["released"] += len(text)
            ready: tuple[TokenLogprob, ...] = ()
            if pending:
                ready = tuple(e for start, e in pending if start < state["released"])
                pending[:] = [(s, e) for s, e in pending if s >= state["released"]]
            if text or ready:
                self._emit(TextDelta(text, ready))

        def on_chunk(chunk: Any) -> bool:
            if not isinstance(chunk, dict):
                return self._cancel.is_set()
            if "error" in chunk:
                errors.append(str(chunk["error"])[:300])
                return True
            choices = chunk.get("choices")
            if chunk.get("usage"):
                state["usage"] = chunk["usage"]
            if not choices:
                return self._cancel.is_set()
            choice = choices[0]
            entries = ((choice.get("logprobs") or {}).get("content")) or ()
            text = choice.get("text") or ""
            if entries:
                state["tokens"] += len(entries)
            elif text:
                state["tokens"] += 1
            if want is not None:
                for entry in entries:
                    lp = _logprob(entry)
                    if want == 0:
                        lp = dataclasses.replace(lp, top=())
                    else:
                        lp = dataclasses.replace(lp, top=lp.top[:want])
                    pending.append((state["decoded"], lp))
                    state["decoded"] += len(entry.get("token") or "")
            else:
                state["decoded"] += len(text)
            out, matched = stopper.feed(text)
            release(out)
            if matched:
                stopped[0] = True
                return True
            if choice.get("finish_reason"):
                state["finish"] = choice["finish_reason"]
            self.timing.steps = int(state["tokens"])
            return self._cancel.is_set()

        result = self.model.server.handle_completions(self._request(), on_chunk)
        if errors or (isinstance(result, dict) and "error" in result):
            raise RuntimeError(
                "llama.cpp: " + (errors[0] if errors else str(result.get("error"))[:300])
            )
        usage = state["usage"] or {}
        tokens = int(usage.get("completion_tokens") or state["tokens"])
        if stopped[0]:
            finish = "stop"
        elif self._cancel.is_set() and state["finish"] is None:
            finish = "cancelled"
        else:
            tail = stopper.flush()
            if tail or pending:
                release(tail)
            finish = "length" if state["finish"] == "length" else "stop"
        self._emit(Finished(finish, len(self.prompt_ids), tokens))


def choices(
    model: GGUFModel,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    n: int = 1,
    stream: bool = True,
) -> list[GGUFGeneration]:
    """One request's ``n`` sequences, bound to the running loop and not started; choice ``i``
    is seeded with ``choice_seed(seed, i)`` as on any resident.

    Raises:
        ValueError: ``n`` below 1, an empty prompt, prompt logprobs asked for.
    """
    from miserver.serving.engine.sampling import choice_seed

    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if params.echo:
        raise ValueError("llama.cpp gives no prompt logprobs")
    gens = []
    for i in range(n):
        gen = GGUFGeneration(
            model,
            tokenizer,
            prompt_ids,
            dataclasses.replace(params, seed=choice_seed(params.seed, i)),
            stream=stream,
        )
        gen.bind()
        gens.append(gen)
    return gens


def submit(
    model: GGUFModel,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    n: int = 1,
    stream: bool = True,
) -> list[GGUFGeneration]:
    """Start one request's ``n`` sequences (:func:`choices`) on llama.cpp's parallel slots, at
    once: llama.cpp batches whatever its slots decode at each of its steps, so a request granted
    into the resident's running work (the scheduler's ``fill_running``) decodes from llama.cpp's
    next step, beside the sequences already there, as the continuous engine admits a request
    at its next step. Returns the sequences in choice order.

    Raises:
        ValueError: as :func:`choices`.
    """
    gens = choices(model, tokenizer, prompt_ids, params, n, stream)
    for gen in gens:
        gen.start()
    return gens
