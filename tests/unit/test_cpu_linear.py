"""The CPU's linear layers as ``weight @ inputᵀ`` (miserver/serving/engine/cpu_linear.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from miserver.serving.engine import cpu_linear
from miserver.serving.engine.cpu_linear import MAX_ROWS, cpu_linears

#: SmolLM2-135M's weight shapes (out, in): q/o, k/v, gate/up, down, and the tied lm_head.
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_column_keeps_its_bits_for_1_to_max_rows_columns(threads: int) -> None:
    """What the engine's CPU invariance rests on (model_runner.MAX_ROWS), on the running torch:
    every column of ``W @ Xᵀ`` is the same bits in every product of 1 to MAX_ROWS columns,
    wherever the column sits, and they are ``F.linear``'s bits of that row in a product of two
    rows (what the engine computed before)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(3)
        for out_f, in_f in SHAPES:
            w = (torch.randn(out_f, in_f, generator=gen) * 0.05).to(torch.bfloat16)
            x = torch.randn(MAX_ROWS + 2, in_f, generator=gen).to(torch.bfloat16)
            pairs = torch.cat(
                [torch.nn.functional.linear(x[[r, r + 1]], w)[:1] for r in range(MAX_ROWS + 1)]
            )
            counts = sorted({1, 2, 3, 7, 16, 31, 32, 33, 63, 64, 65, 100, MAX_ROWS})
            for m in counts:
                got = cpu_linear._weight_first(x[:m], w, None)
                assert torch.equal(got, pairs[:m]), (out_f, in_f, m)
                shifted = cpu_linear._weight_first(x[1 : m + 1], w, None)
                assert torch.equal(shifted, pairs[1 : m + 1]), (out_f, in_f, m, "shifted")
    finally:
        torch.set_num_threads(before)


def test_the_layer_computes_what_f_linear_computes_and_leaves_the_weight_alone() -> None:
    gen = torch.Generator().manual_seed(4)
    layer = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    weight_before = layer.weight.detach().clone()
    ptr = layer.weight.data_ptr()
    x = torch.randn(2, 5, 64, generator=gen).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.inference_mode(), cpu_linears():
        got = layer(x)
    assert got.shape == (2, 5, 48) and got.is_contiguous() and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), expected.float(), atol=0.05, rtol=0.02)
    assert layer.weight.data_ptr() == ptr and torch.equal(layer.weight, weight_before)


def test_the_path_is_taken_only_inside_the_block_on_this_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    real = cpu_linear._weight_first

    def counted(*args: object) -> torch.Tensor:
        calls.append(threading.current_thread().name)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_linear, "_weight_first", counted)
    layer = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(3, 16)
    layer(x)
    assert calls == []  # outside the block: torch's own forward
    with cpu_linears():
        layer(x)
        assert calls == [threading.current_thread().name]
        other = threading.Thread(target=layer, args=(x,))
        other.start()
        other.join()
        assert len(calls) == 1  # the other thread ran torch's own forward
        with cpu_linears(False):  # off leaves the thread's state as it is
            layer(x)
        assert len(calls) == 2
    layer(x)
    assert len(calls) == 2  # restored on exit


def test_too_many_rows_go_through_f_linear(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(
        cpu_linear, "_weight_first", lambda x, w, b: calls.append(1) or torch.zeros(0)
    )
    layer = torch.nn.Linear(8, 4, bias=False)
    with cpu_linears():
        out = layer(torch.randn(MAX_ROWS + 1, 8))
        assert out.shape == (MAX_ROWS + 1, 4)
    assert calls == []


def test_a_wrong_shape_fails_as_torch_s_own_layer_does() -> None:
    layer = torch.nn.Linear(8, 4, bias=False)
    with cpu_linears(), pytest.raises(RuntimeError):
        layer(torch.randn(2, 7))


def test_every_row_count_up_to_max_rows_takes_the_path_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1 to MAX_ROWS rows compute ``weight @ inputᵀ`` (one row as a matrix-vector product), and
    a row's bits do not depend on how many rows its pass holds."""
    calls: list[int] = []
    real = cpu_linear._weight_first
    monkeypatch.setattr(
        cpu_linear, "_weight_first", lambda *a: calls.append(a[0].shape[-2]) or real(*a)
    )
    gen = torch.Generator().manual_seed(5)
    layer = torch.nn.Linear(576, 192, bias=False).to(torch.bfloat16)
    x = torch.randn(1, MAX_ROWS, 576, generator=gen).to(torch.bfloat16)
    counts = (1, 2, 16, 17, 32, 33, 40, MAX_ROWS)
    with torch.inference_mode(), cpu_linears():
        outs = {m: layer(x[:, :m]) for m in counts}
    assert calls == list(counts)
    for m, out in outs.items():
        assert torch.equal(out[0], outs[MAX_ROWS][0, :m]), m


@pytest.mark.parametrize("bias", [False, True])
def test_a_head_is_computed_by_chunks_with_the_same_bits(bias: bool) -> None:
    """The output embedding's product a chunk of outputs at a time: contiguous ``[rows,
    vocab]``, the same bits as the whole product, for 1 to MAX_ROWS rows."""
    gen = torch.Generator().manual_seed(6)
    head = torch.nn.Linear(64, 5000, bias=bias).to(torch.bfloat16)
    other = torch.nn.Linear(64, 5000, bias=bias).to(torch.bfloat16)
    other.load_state_dict(head.state_dict())
    x = torch.randn(1, MAX_ROWS, 64, generator=gen).to(torch.bfloat16)
    for m in (1, 2, 33, MAX_ROWS):
        with torch.inference_mode(), cpu_linears(heads=(head,)):
            chunked, whole = head(x[:, :m]), other(x[:, :m])
        assert chunked.shape == (1, m, 5000) and chunked.is_contiguous()
        assert torch.equal(chunked, whole), m


def test_a_compiled_module_traces_torch_s_own_linear_after_the_wrapper_is_installed() -> None:
    """Once installed (a CPU engine ran in this process), ``torch.compile`` of a model still
    traces ``F.linear`` without a graph break: the wrapper is folded away while compiling."""
    import torch._dynamo

    cpu_linear.install()
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert torch.allclose(torch.compile(layer, backend="eager")(x), layer(x))


# --- sibling projections in one product (place_fused_projections) ----------------------------


class _Block(torch.nn.Module):
    """An attention's q/k/v and a gated MLP's gate/up, SmolLM2-135M's shapes (Qwen2's q/k/v
    biases when ``bias``), plus an o_proj that stays alone."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(576, 576, bias=bias)
        self.k_proj = torch.nn.Linear(576, 192, bias=bias)
        self.v_proj = torch.nn.Linear(576, 192, bias=bias)
        self.o_proj = torch.nn.Linear(576, 576, bias=False)
        self.gate_proj = torch.nn.Linear(576, 1536, bias=False)
        self.up_proj = torch.nn.Linear(576, 1536, bias=False)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")
        return [getattr(self, n)(x) for n in names]


def _pair(bias: bool) -> tuple[_Block, _Block]:
    torch.manual_seed(7)
    block = _Block(bias).to(torch.bfloat16)
    alone = _Block(bias).to(torch.bfloat16)
    alone.load_state_dict(block.state_dict())
    return block, alone


@pytest.mark.parametrize("bias", [False, True])
def test_a_fused_group_gives_each_member_the_bits_of_its_own_product(bias: bool) -> None:
    """The placement keeps every parameter's name, shape and values; each member's output is
    bit-identical to its own ``weight @ inputᵀ`` for 1 to MAX_ROWS rows."""
    block, alone = _pair(bias)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    groups = cpu_linear.place_fused_projections(block)
    assert [g.weight.shape[0] for g in groups] == [960, 3072]
    assert [g.bias is not None for g in groups] == [bias, False]
    after = block.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    storage = block.q_proj.weight.untyped_storage().data_ptr()
    assert block.v_proj.weight.untyped_storage().data_ptr() == storage
    assert block.o_proj.weight.untyped_storage().data_ptr() != storage
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, MAX_ROWS, 576, generator=gen).to(torch.bfloat16)
    with torch.inference_mode(), cpu_linears():
        for m in (1, 2, 17, 64, MAX_ROWS):
            fused, own = block(x[:, :m]), alone(x[:, :m])
            for a, b in zip(fused, own, strict=True):
                assert a.shape == b.shape and a.is_contiguous()
                assert torch.equal(a, b), m


def test_a_group_is_one_product_and_a_new_input_is_computed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    block, alone = _pair(False)
    cpu_linear.place_fused_projections(block)
    products: list[int] = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda w, x: products.append(w.shape[0]) or real_mm(w, x))
    gen = torch.Generator().manual_seed(9)
    x, y = (torch.randn(3, 576, generator=gen).to(torch.bfloat16) for _ in range(2))
    with torch.inference_mode(), cpu_linears():
        q, k = block.q_proj(x), block.k_proj(x)
        assert products == [960]  # one product for the group, k from it
        k_other = block.k_proj(y)  # another input: never a sibling's kept output
        assert products == [960, 960]
        v = block.v_proj(x)  # x's kept output was dropped when y's product was made
        assert products == [960, 960, 960]
    monkeypatch.setattr(torch, "mm", real_mm)
    with torch.inference_mode(), cpu_linears():
        assert torch.equal(q, alone.q_proj(x)) and torch.equal(k, alone.k_proj(x))
        assert torch.equal(k_other, alone.k_proj(y)) and torch.equal(v, alone.v_proj(x))


def test_a_write_into_a_member_is_read_by_the_next_product() -> None:
    """A trainer's in-place write to ``k_proj.weight`` lands in the group's tensor; a member
    given a new weight (not in the group's tensor any more) is computed alone."""
    block, alone = _pair(False)
    cpu_linear.place_fused_projections(block)
    x = torch.randn(2, 576).to(torch.bfloat16)
    with torch.no_grad():
        block.k_proj.weight.mul_(-1)
        alone.k_proj.weight.mul_(-1)
        block.v_proj.weight = torch.nn.Parameter(block.v_proj.weight.detach().clone() * 2)
        alone.v_proj.weight.mul_(2)
    with torch.inference_mode(), cpu_linears():
        assert torch.equal(block.k_proj(x), alone.k_proj(x))
        assert torch.equal(block.v_proj(x), alone.v_proj(x))
        assert torch.equal(block.q_proj(x), alone.q_proj(x))


def test_groups_are_placed_only_where_every_member_fits() -> None:
    block = _Block().to(torch.bfloat16)
    block.k_proj = torch.nn.Linear(576, 192, bias=True).to(torch.bfloat16)  # bias mismatch
    block.up_proj = torch.nn.Linear(576, 1536, bias=False)  # float32 beside bfloat16
    assert cpu_linear.place_fused_projections(block) == []
    again = _Block()
    assert len(cpu_linear.place_fused_projections(again)) == 2
    assert cpu_linear.place_fused_projections(again) == []  # placed once


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_product_has_the_same_bits_on_one_thread_and_on_two(dtype: torch.dtype) -> None:
    """What lets a pass's products move between 1 and 2 threads (``CPU_MATMUL_THREADS``,
    :class:`cpu_linear.MatmulThreads`) without a sequence's text depending on it: in bfloat16
    and float16 each row of every product of 1 to MAX_ROWS rows (one row: ``torch.mv``) is the
    same bits on 1 and on 2 threads, on the running torch (float32 is not: the engine keeps it
    on the thread's own count)."""
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(9)
    try:
        for out_f, in_f in SHAPES:
            w = (torch.randn(out_f, in_f, generator=gen) * 0.05).to(dtype)
            x = torch.randn(MAX_ROWS, in_f, generator=gen).to(dtype)
            got = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got[threads] = [
                    cpu_linear._weight_first(x[:m], w, None) for m in (1, 2, 5, 32, 33, MAX_ROWS)
                ]
            for one, two in zip(got[1], got[2], strict=True):
                assert torch.equal(one, two), (out_f, in_f, one.shape)
    finally:
        torch.set_num_threads(before)


def test_products_run_on_matmul_threads_and_everything_else_on_the_thread_s_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cpu_linears(matmul_threads=N)``: each product on N threads, the thread's own count
    back around it (so every other operation of the pass keeps it) and after the block; the
    block's products are timed."""
    seen: list[int] = []
    real = cpu_linear._weight_first
    monkeypatch.setattr(
        cpu_linear, "_weight_first", lambda *a: seen.append(torch.get_num_threads()) or real(*a)
    )
    mine = torch.get_num_threads()
    other = 1 if mine > 1 else 2
    layer = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.inference_mode(), cpu_linears(matmul_threads=other) as products:
        expected = torch.nn.functional.linear(x, layer.weight)
        assert torch.equal(layer(x), expected)
        assert torch.get_num_threads() == mine
        layer(x[:1])
    assert seen == [other, other]
    assert products.seconds > 0
    assert torch.get_num_threads() == mine
    with cpu_linears() as plain:
        layer(x)
    assert seen[-1] == mine and plain.seconds > 0
    with pytest.raises(ValueError, match="matmul_threads"), cpu_linears(matmul_threads=0):
        pass


def test_matmul_threads_keeps_the_faster_count_and_probes_the_other() -> None:
    """:class:`cpu_linear.MatmulThreads` with made-up timings: each count tried once per size of
    pass, then the faster one; a probe of the other every PROBE_FIRST passes, a losing probe
    doubling the interval up to PROBE_MAX, a winning one switching; sizes apart."""
    from miserver.serving.engine.cpu_linear import PROBE_FIRST, PROBE_MAX, MatmulThreads

    cost = {2: 0.010, 1: 0.030}  # two threads faster at first
    chooser = MatmulThreads(2)

    def passes(n: int, rows: int = 1) -> list[int]:
        used = []
        for _ in range(n):
            threads = chooser.choose(rows)
            chooser.record(rows, threads, cost[threads])
            used.append(threads)
        return used

    assert passes(2) == [2, 1]  # each count once
    used = passes(PROBE_FIRST * 3)
    assert used.count(1) == 2  # probes only: after PROBE_FIRST passes, then 2 * PROBE_FIRST
    assert used[PROBE_FIRST - 1] == 1 and used[3 * PROBE_FIRST - 1] == 1
    cost[2] = 0.5  # a busy neighbour: the second thread's core is taken
    used = passes(3)
    assert used[-1] == 1  # one slow pass makes the average lose at once
    cost[2] = 0.010  # the neighbour is gone: a probe finds it and switches back
    used = passes(PROBE_FIRST)
    assert used[-1] == 2 and chooser.switches >= 1
    intervals = chooser._probe[1]
    assert intervals[1] == PROBE_FIRST  # the change of choice started the interval over
    for _ in range(12):
        passes(PROBE_MAX)
    assert chooser._probe[1][1] == PROBE_MAX  # losing probes: the interval doubled up to its cap
    assert passes(2, rows=40) == [2, 1]  # another size learns on its own
    summary = chooser.summary()
    assert summary["threads"] == 2 and summary["fallback"] == 1
    assert summary["switches"] == chooser.switches
    assert summary["chosen"] == {"1": 2, "32-63": 2}  # rows 1, and 40's size (32 to 63)
    single = MatmulThreads(3, fallback=3)  # one count: every pass takes it
    assert {single.choose(r) for r in (1, 7, 128)} == {3}
    many = MatmulThreads(8, fallback=7)  # the engine thread's own count is the other choice
    assert many.choose(1) == 8
    many.record(1, 8, 0.01)
    assert many.choose(1) == 7
    for bad in ((0, 1), (2, 0)):
        with pytest.raises(ValueError):
            MatmulThreads(*bad)


def test_same_bits_compares_every_count_and_restores_the_thread_s_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """:func:`cpu_linear.same_bits`: True for SmolLM2's shapes on 1 and 2 threads in
    bfloat16 (what the 2-core machine has); False as soon as one count rounds a row otherwise
    (a product made to differ on 2 threads); the thread's count restored either way."""
    mine = torch.get_num_threads()
    assert cpu_linear.same_bits(SHAPES[:4], torch.bfloat16, (1, 2))
    real = cpu_linear._weight_first

    def off_on_two(x: torch.Tensor, w: torch.Tensor, b: Any) -> torch.Tensor:
        out = real(x, w, b)
        return out + 1 if torch.get_num_threads() == 2 and x.shape[0] == 33 else out

    monkeypatch.setattr(cpu_linear, "_weight_first", off_on_two)
    assert not cpu_linear.same_bits(SHAPES[:1], torch.bfloat16, (1, 2))
    assert cpu_linear.same_bits(SHAPES[:1], torch.bfloat16, (1, 1))
    assert torch.get_num_threads() == mine


def test_a_runner_whose_products_round_otherwise_keeps_its_own_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``matmul_threads`` is left unused (None, no chooser) where :func:`same_bits` says the
    model's products round otherwise on it than on the engine thread's count, or in float32,
    or when it is that count already; used otherwise."""
    from miserver.serving.engine.kv_cache import PagedKVCache, cache_shape
    from miserver.serving.engine.model_runner import ModelRunner
    from tests.tiny_llama import sharp_tiny_llama

    def runner(model: Any, threads: int, own: int) -> ModelRunner:
        cache = PagedKVCache(cache_shape(model), 4, 4, torch.device("cpu"))
        made = ModelRunner(model, cache, matmul_threads=threads, own_threads=own)
        assert made.matmul_threads is None and made.threads is None  # settled at a first pass
        made.settle_matmul_threads()
        return made

    bf16 = sharp_tiny_llama(64).to(torch.bfloat16)
    used = runner(bf16, 2, 1)
    assert used.matmul_threads == 2 and used.threads is not None
    assert used.threads.fallback == 1
    assert runner(bf16, 2, 2).matmul_threads is None  # already the engine thread's count
    assert runner(sharp_tiny_llama(64), 2, 1).matmul_threads is None  # float32
    monkeypatch.setattr(cpu_linear, "same_bits", lambda *a: False)
    from miserver.serving.engine import model_runner

    monkeypatch.setattr(model_runner, "same_bits", lambda *a: False)
    refused = runner(bf16, 2, 1)
    assert refused.matmul_threads is None and refused.threads is None
