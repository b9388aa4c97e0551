"""End to end: the catalogue's GGUF row (``smollm2-135m-instruct-q4``, the embedded Q4_1 file)
served through llama.cpp (contract 4a), and ``CONTINUOUS_BATCHING=1`` as the weights page's cbm
(contract 1), against live ``miserver serve`` processes driven by the official ``openai`` package.

One server per fixture, on a free port, ``MISERVER_HOME`` = a fresh home registering the shared
default's rows. The Q4 row is loaded for real (llama.cpp, CPU).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from pydantic import BaseModel, Field

from miserver.http.model_header import parse_model_header
from tests.served import ServedProcess, start_serve

pytestmark = pytest.mark.slow

Q4 = "smollm2-135m-instruct-q4"
BF16 = "smollm2-135m-instruct"
SECRET = "gguf-e2e-trainer-secret-0123456789"
OPS_SECRET = "gguf-e2e-operator-secret-0123456789"
TRAINER = {"Authorization": f"Bearer {SECRET}"}
REPO = Path(__file__).resolve().parents[2]


class Server(ServedProcess):
    def get(self, path: str) -> dict:
        return requests.get(f"{self.base}{path}", timeout=30).json()

    def call(self, method: str, path: str, **kw: object) -> requests.Response:
        return requests.request(method, f"{self.base}{path}", timeout=300, **kw)  # type: ignore[arg-type]

    def row_id(self, name: str) -> int:
        return next(r["id"] for r in self.get("/api/models")["data"] if r["name"] == name)

    def resident(self) -> str | None:
        resident = self.get("/api/health/detailed")["data"]["resident"]
        return resident["name"] if resident else None

    def pause_unavailable(self) -> str | None:
        return self.get("/api/weights/status")["data"]["pause_unavailable"]

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base}/v1", api_key="unused", timeout=300, **{"max_retries": 0, **kw}
        )


def _start(home: str, log: Path, **extra: str) -> Server:
    want = extra.get("DEFAULT_MODEL", BF16)
    settings = dict(
        MISERVER_HOME=home,
        DEVICE="cpu",
        LOG_FORMAT="text",
        LOG_LEVEL="info",
        WEIGHTS_TOKENS=f"trn:trainer:{SECRET},ops:operator:{OPS_SECRET}",
        PYTHONPATH=str(REPO),
    )
    return start_serve(
        Server,
        log,
        lambda srv: srv.resident() == want,
        drop_prefixes=("CONTINUOUS",),
        **{**settings, **extra},
    )


@pytest.fixture(scope="module")
def home(default_home: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.conftest import copy_default_rows

    return copy_default_rows(default_home, tmp_path_factory.mktemp("e2e-gguf-home"))


@pytest.fixture(scope="module")
def server(home: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The Q4 row resident from the start (DEFAULT_MODEL), a trainer token configured."""
    log = tmp_path_factory.mktemp("e2e-gguf") / "server.log"
    srv = _start(home, log, DEFAULT_MODEL=Q4, MAX_BATCH_SIZE="4")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def q4(server: Server) -> Server:
    """The server with the Q4 row resident (loaded back if a test swapped it out)."""
    if server.resident() != Q4:
        assert server.call("POST", f"/api/models/{server.row_id(Q4)}/load").status_code == 200
    return server


# --- /v1 on a GGUF resident (contract 4a) ------------------------------------------------------
def test_chat_through_the_openai_sdk_names_the_q4_row(q4: Server) -> None:
    raw = q4.client().chat.completions.with_raw_response.create(
        model=Q4, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, seed=1
    )
    completion = raw.parse()
    assert parse_model_header(raw.headers["x-millm-model"]) == (Q4, "model", 0)
    assert completion.model == Q4 and completion.choices[0].message.content
    assert completion.choices[0].finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage is not None and 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completions_greedy_answers_and_logprobs_come_from_llama_cpp(q4: Server) -> None:
    out = q4.client().completions.create(
        model=Q4, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    choice = out.choices[0]
    assert choice.text.startswith(" Paris"), choice.text
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.tokens[0] == " Paris"
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 and " Paris" in lp.top_logprobs[0] for top in lp.top_logprobs[:1])


def test_stream_has_the_chunk_shapes_usage_and_the_model_on_its_terminal_chunk(q4: Server) -> None:
    chunks = list(
        q4.client().chat.completions.create(
            model=Q4,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            seed=3,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text and finishes[-1] in ("stop", "length") and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens >= 1
    extra = chunks[-1].model_extra or {}
    assert parse_model_header(extra["millm_model"]) == (Q4, "model", 0)


def test_stop_is_never_emitted_and_ends_with_stop(q4: Server) -> None:
    client = q4.client()
    free = client.completions.create(
        model=Q4, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0
    ).choices[0]
    assert " 6" in free.text, free.text  # what greedy says without a stop
    stopped = client.completions.create(
        model=Q4, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 6"]
    ).choices[0]
    assert stopped.finish_reason == "stop" and " 6" not in stopped.text
    assert free.text.startswith(stopped.text)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=Q4, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 6"], stream=True
        )
        if c.choices
    )
    assert streamed == stopped.text


def test_seed_repeats_and_n_gives_n_choices(q4: Server) -> None:
    client = q4.client()
    kw = dict(model=Q4, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7)
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert first.choices[0].text == again.choices[0].text
    many = client.completions.create(**kw, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    # Choice 0 samples with the seed too, but llama.cpp decodes the 3 choices together in its
    # parallel slots, and a batched pass may differ from a lone one in the logits' last bits:
    # the same seed repeats an answer when the request is decoded alone (docs/decisions.md).
    assert len({c.text for c in many.choices}) > 1
    assert 3 <= many.usage.completion_tokens <= 3 * 12


def test_errors_are_openai_shaped_before_anything_runs(q4: Server) -> None:
    client = q4.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=Q4, messages=[{"role": "user", "content": "hi"}], max_tokens=100_000
        )
    assert err.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=Q4, prompt="hi", max_tokens=2, echo=True, logprobs=1)
    assert err.value.body["param"] == "echo"  # type: ignore[index]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=Q4,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            tools=[tool],  # type: ignore[list-item]
        )
    assert err.value.body["param"] == "tools"  # type: ignore[index]
    assert "GGUF" in err.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=Q4, prompt="hi", max_tokens=2, n=5)  # MAX_BATCH_SIZE 4
    assert err.value.body["param"] == "n"  # type: ignore[index]


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    coastal: bool


CITY_SCHEMA = {**City.model_json_schema(), "additionalProperties": False}
CITY_PROMPTS = [f"Describe the city of {c} as JSON." for c in ("Paris", "Tokyo", "Lagos", "Oslo")]


def test_json_object_output_parses_on_a_gguf_resident(q4: Server) -> None:
    stopped = 0
    for prompt in CITY_PROMPTS[:3]:
        completion = q4.client().chat.completions.create(
            model=Q4,
            messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_object"},
            n=2,
            max_tokens=160,
            seed=5,
        )
        assert len(completion.choices) == 2
        for choice in completion.choices:
            text = choice.message.content or ""
            if choice.finish_reason == "stop":  # the grammar completed: an object
                stopped += 1
                assert isinstance(json.loads(text), dict), text
            else:  # cut by max_tokens: still a prefix of an object
                assert choice.finish_reason == "length" and text.startswith("{"), text
    assert stopped >= 1  # at least one answer ran to its closing brace


def test_parse_with_a_pydantic_model_validates_on_a_gguf_resident(q4: Server) -> None:
    for prompt in CITY_PROMPTS:
        completion = q4.client().chat.completions.parse(
            model=Q4,
            messages=[{"role": "user", "content": prompt}],
            response_format=City,
            n=2,
            max_completion_tokens=200,
            seed=1,
        )
        assert len(completion.choices) == 2
        for choice in completion.choices:
            assert choice.finish_reason == "stop", choice.message.content
            assert isinstance(choice.message.parsed, City)  # the SDK validated it
            City.model_validate_json(choice.message.content or "")
    # the completions route takes it too, with a stop sequence the JSON never reaches
    out = q4.client().completions.create(
        model=Q4,
        prompt="A city as JSON: ",
        max_tokens=200,
        temperature=0,
        stop=["\n\n"],
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True},
            }
        },
    )
    assert out.choices[0].finish_reason == "stop"
    City.model_validate_json(out.choices[0].text)


def test_a_streamed_constrained_answer_equals_the_non_streamed_one_on_gguf(q4: Server) -> None:
    kwargs: dict = {
        "model": Q4,
        "messages": [{"role": "user", "content": CITY_PROMPTS[0]}],
        "temperature": 0,
        "max_tokens": 200,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True},
        },
    }
    client = q4.client()
    whole = client.chat.completions.create(**kwargs)
    pieces, finish = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert len(pieces) > 1  # streamed token by token, not as one piece
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason == "stop"
    City.model_validate_json(whole.choices[0].message.content or "")


@pytest.mark.parametrize(
    "schema, param",
    [
        (
            {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
            "response_format.json_schema.schema.properties.tags.uniqueItems",
        ),
        ({"type": "string", "format": "bogus"}, "response_format"),
        ({"type": "string", "pattern": "(["}, "response_format"),
    ],
)
def test_an_unsupported_schema_is_a_400_before_anything_runs_on_gguf(
    q4: Server, schema: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        q4.client().chat.completions.create(
            model=Q4,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=20,
            stream=True,
            response_format={  # type: ignore[typeddict-item]
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": schema},
            },
        )
    assert err.value.status_code == 400
    assert err.value.body["param"] == param  # type: ignore[index]


def test_a_client_that_goes_away_stops_its_generation(q4: Server) -> None:
    stream = q4.client().completions.create(
        model=Q4, prompt="A very long story:", max_tokens=2000, temperature=1.0, stream=True
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    t0 = time.monotonic()
    while q4.get("/api/health/detailed")["data"]["queue"]["running"] != 0:
        assert time.monotonic() - t0 < 10, "the generation still runs 10 s after the disconnect"
        time.sleep(0.1)


def test_the_queue_and_queue_full_hold_on_a_gguf_resident(q4: Server) -> None:
    """One long request decodes; requests that arrive meanwhile go into llama.cpp's slots beside
    it while the running work has room (MAX_BATCH_SIZE 4: three more), one more waits
    (MAX_QUEUED_REQUESTS 1), the rest are 503 queue_full with Retry-After; the metrics count
    them."""
    assert q4.call("PATCH", "/api/settings", json={"max_queued_requests": 1}).status_code == 200
    client = q4.client()
    count = "Count from 1 to 500: 1, 2, 3, 4,"

    def one(i: int, tokens: int = 48) -> str:
        try:
            client.completions.create(
                model=Q4, prompt=count, max_tokens=tokens, temperature=0, seed=i
            )
            return "ok"
        except openai.APIStatusError as err:
            assert err.status_code == 503 and err.response.headers.get("retry-after")
            return err.body["code"]  # type: ignore[index]

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            first = pool.submit(one, 0, 400)
            t0 = time.monotonic()
            while q4.get("/api/health/detailed")["data"]["queue"]["running"] == 0:
                assert time.monotonic() - t0 < 60
                time.sleep(0.02)
            rest = [pool.submit(one, i) for i in range(1, 7)]
            outcomes = [first.result()] + [f.result() for f in rest]
    finally:
        q4.call("PATCH", "/api/settings", json={"max_queued_requests": 64})
    # three joined the running work and one waited for room (a batch that took no one after it
    # started would have run one request and queued one: two answers); the others were refused
    assert outcomes[0] == "ok" and outcomes.count("ok") >= 5, outcomes
    assert "queue_full" in outcomes, outcomes
    metrics = requests.get(f"{q4.base}/metrics", timeout=10).text
    assert 'code="QUEUE_FULL"' in metrics


def test_the_batch_api_runs_on_a_gguf_resident(q4: Server) -> None:
    import io
    import json

    client = q4.client()
    lines = [
        {
            "custom_id": f"row-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": Q4,
                "prompt": "The capital of France is",
                "max_tokens": 3,
                "temperature": 0,
            },
        }
        for i in range(2)
    ]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    file = client.files.create(file=("rows.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
    )
    t0 = time.monotonic()
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() - t0 < 120, batch
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    out = [
        json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()
    ]
    assert sorted(o["custom_id"] for o in out) == ["row-0", "row-1"]
    for o in out:
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["choices"][0]["text"].startswith(" Paris")


# --- what a GGUF resident cannot do (weights page: Which models can be attached) -------------
def test_attach_is_not_attachable_reason_gguf(q4: Server) -> None:
    r = q4.call("POST", "/api/weights/attach", headers=TRAINER)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["reason"]) == ("NOT_ATTACHABLE", "gguf")
    assert q4.get("/api/weights/status")["data"]["attached"] is False


def test_save_checkpoint_load_and_adapters_are_gguf_unsupported(q4: Server) -> None:
    for path, body, reason in (
        ("/api/weights/save", {"name": "gguf-save"}, "save"),
        ("/api/weights/load", {"checkpoint": "anything"}, "weights_load"),
        ("/api/weights/adapter", {"name": "lora-a", "path": "/nonexistent"}, "adapter"),
    ):
        r = q4.call("POST", path, json=body, headers=TRAINER)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert (err["code"], err["reason"]) == ("GGUF_UNSUPPORTED", reason), err
    assert q4.resident() == Q4


def test_a_damaged_gguf_file_is_refused_and_the_resident_serves_on(
    q4: Server, tmp_path: Path
) -> None:
    q4_path = next(r["path"] for r in q4.get("/api/models")["data"] if r["name"] == Q4)
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(Path(q4_path).read_bytes()[:400_000])
    r = q4.call("POST", "/api/models", json={"name": "damaged-q4", "path": str(damaged)})
    assert r.status_code == 201, r.text
    row = r.json()["data"]["id"]
    r = q4.call("POST", f"/api/models/{row}/load")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "MODEL_LOAD_FAILED"
    assert q4.resident() == Q4
    out = q4.client().completions.create(model=Q4, prompt="Hello", max_tokens=3)
    assert out.usage.completion_tokens >= 1
    assert q4.call("DELETE", f"/api/models/{row}").status_code == 200


# --- swaps through the table (contract 3, 4a) ------------------------------------------------------
def _chat_under_swap(srv: Server, name: str, target: str, k: int = 3) -> list[str]:
    """``k`` requests naming ``name`` run while a management load of ``target`` starts. Every
    request is answered: computed on ``name`` (it ran before the swap: the drain), or refused
    409 ``model_busy`` with ``Retry-After`` (it waited for the slot while the swap ran; contract
    4) and then answered by ``target`` when retried naming it. Returns the X-miLLM-Model names
    of the answers, in request order."""
    client = srv.client()

    def one(i: int, model: str) -> str:
        raw = client.completions.with_raw_response.create(
            model=model, prompt=f"Story {i}:", max_tokens=24, temperature=0.8, seed=i
        )
        assert raw.parse().choices[0].text
        return parse_model_header(raw.headers["x-millm-model"])[0]

    def first_try(i: int) -> str | None:
        try:
            return one(i, name)
        except openai.ConflictError as err:
            assert err.body["code"] == "model_busy", err.body  # type: ignore[index]
            assert err.response.headers.get("retry-after")
            return None

    with concurrent.futures.ThreadPoolExecutor(k + 1) as pool:
        futures = [pool.submit(first_try, i) for i in range(k)]
        t0 = time.monotonic()
        while srv.get("/api/health/detailed")["data"]["queue"]["running"] == 0:
            assert time.monotonic() - t0 < 60, "no request started"
            time.sleep(0.05)
        load = pool.submit(srv.call, "POST", f"/api/models/{srv.row_id(target)}/load")
        answers = [f.result() for f in futures]
        assert load.result().status_code == 200, load.result().text
    assert name in answers, answers  # the one running when the swap began was drained
    return [a if a is not None else one(i, target) for i, a in enumerate(answers)]


def test_swap_gguf_to_bfloat16_and_back_under_load_loses_no_request(q4: Server) -> None:
    answers = _chat_under_swap(q4, Q4, BF16)
    assert Q4 in answers and set(answers) <= {Q4, BF16}
    assert q4.resident() == BF16
    answers = _chat_under_swap(q4, BF16, Q4)
    assert BF16 in answers and set(answers) <= {Q4, BF16}
    assert q4.resident() == Q4
    out = q4.client().completions.create(
        model=Q4, prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert out.choices[0].text.startswith(" Paris")


def test_an_unloaded_gguf_resident_returns_its_memory(q4: Server) -> None:
    def rss_kib() -> int:
        status = Path(f"/proc/{q4.proc.pid}/status").read_text()
        return int(
            next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))
        )

    loaded = rss_kib()
    r = q4.call("POST", f"/api/models/{q4.row_id(Q4)}/unload")
    assert r.status_code == 200, r.text
    time.sleep(0.5)
    unloaded = rss_kib()
    # The Q4 file maps ~90 MB, its KV cache and compute buffers more: well above 40 MB go.
    assert loaded - unloaded > 40_000, (loaded, unloaded)
    assert q4.call("POST", f"/api/models/{q4.row_id(Q4)}/load").status_code == 200


# --- CONTINUOUS_BATCHING=1: the weights page's cbm (contract 1) --------------------------------
def _refusal(r: requests.Response) -> tuple[int, str, str | None]:
    err = r.json()["error"]
    return r.status_code, err["code"], err["reason"]


def _cbm_refusals(srv: Server) -> None:
    """With cbm on: attach is NOT_ATTACHABLE continuous_batching_running; a weights load is
    BARRIER_UNAVAILABLE cbm (the row is checked first: it exists); /v1 serves."""
    assert srv.pause_unavailable() == "cbm"
    assert srv.get("/api/settings")["data"]["continuous_batching"] is True
    r = srv.call("POST", "/api/weights/attach", headers=TRAINER)
    assert _refusal(r) == (400, "NOT_ATTACHABLE", "continuous_batching_running")
    r = srv.call("POST", "/api/weights/load", json={"model_id": srv.row_id(BF16)}, headers=TRAINER)
    assert _refusal(r) == (409, "BARRIER_UNAVAILABLE", "cbm")
    out = srv.client().completions.create(model=BF16, prompt="Hello", max_tokens=2)
    assert out.usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def cbm_server(home: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The bfloat16 row, attachable on the CPU (WEIGHTS_CPU_ATTACH=1), cbm on from the start."""
    log = tmp_path_factory.mktemp("e2e-cbm") / "server.log"
    srv = _start(home, log, DEFAULT_MODEL=BF16, WEIGHTS_CPU_ATTACH="1", CONTINUOUS_BATCHING="1")
    try:
        yield srv
    finally:
        srv.stop()


def test_continuous_batching_from_the_start_refuses_the_barrier(cbm_server: Server) -> None:
    _cbm_refusals(cbm_server)
    # attach's own order (weights page): a GGUF resident is refused gguf before cbm
    assert cbm_server.call("POST", f"/api/models/{cbm_server.row_id(Q4)}/load").status_code == 200
    r = cbm_server.call("POST", "/api/weights/attach", headers=TRAINER)
    assert _refusal(r) == (400, "NOT_ATTACHABLE", "gguf")
    assert cbm_server.call("POST", f"/api/models/{cbm_server.row_id(BF16)}/load").status_code == 200


def test_the_newcomer_path_a_chat_naming_the_q4_row_answers(cbm_server: Server) -> None:
    """What the README tells a newcomer: the server as `make serve` starts it (the bfloat16 row
    resident), then a chat naming the q4 row: it is loaded (a swap) and answers."""
    raw = cbm_server.client().chat.completions.with_raw_response.create(
        model=Q4, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8
    )
    assert raw.parse().choices[0].message.content
    assert parse_model_header(raw.headers["x-millm-model"])[0] == Q4
    assert cbm_server.resident() == Q4
    assert cbm_server.call("POST", f"/api/models/{cbm_server.row_id(BF16)}/load").status_code == 200


def test_continuous_batching_by_patch_under_an_attachment(cbm_server: Server) -> None:
    srv = cbm_server
    r = srv.call("PATCH", "/api/settings", json={"continuous_batching": False})
    assert r.status_code == 200 and r.json()["data"]["continuous_batching"] is False
    assert srv.pause_unavailable() is None
    r = srv.call("POST", "/api/weights/attach", headers=TRAINER)
    assert r.status_code == 200, r.text
    holder = {**TRAINER, "X-miLLM-Attachment": r.json()["data"]["attachment_id"]}
    try:
        # attached and idle: the PATCH is accepted, and the next quiesce is refused cbm
        r = srv.call("PATCH", "/api/settings", json={"continuous_batching": True})
        assert r.status_code == 200, r.text
        assert srv.pause_unavailable() == "cbm"
        r = srv.call("POST", "/api/weights/quiesce", headers=holder)
        assert _refusal(r) == (409, "BARRIER_UNAVAILABLE", "cbm")
        # cbm is named before concurrency (weights page: Status)
        r = srv.call("PATCH", "/api/settings", json={"max_concurrent_requests": 2})
        assert r.status_code == 200 and srv.pause_unavailable() == "cbm"
        r = srv.call("POST", "/api/weights/quiesce", headers=holder)
        assert _refusal(r) == (409, "BARRIER_UNAVAILABLE", "cbm")
        r = srv.call(
            "PATCH",
            "/api/settings",
            json={"continuous_batching": False, "max_concurrent_requests": 1},
        )
        assert r.status_code == 200 and srv.pause_unavailable() is None
        # while the barrier is held, turning it on is 409 MODEL_BUSY and changes nothing
        r = srv.call("POST", "/api/weights/quiesce", headers=holder)
        assert r.status_code == 200, r.text
        r = srv.call("PATCH", "/api/settings", json={"continuous_batching": True})
        assert _refusal(r)[:2] == (409, "MODEL_BUSY")
        assert srv.get("/api/settings")["data"]["continuous_batching"] is False
        assert srv.call("POST", "/api/weights/resume", headers=holder).status_code == 200
    finally:
        assert srv.call("POST", "/api/weights/detach", headers=holder).status_code == 200
    r = srv.call("PATCH", "/api/settings", json={"continuous_batching": True})
    assert r.status_code == 200
    _cbm_refusals(srv)
