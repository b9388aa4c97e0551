"""Configuration validation (contract section 1): bad values name the variable, secrets never leak."""

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from miserver.spec.settings import ConfigError, load_settings

SECRET = "s3cret-value-0123456789"


def test_defaults_are_the_contracts():
    s = load_settings({"MISERVER_HOME": "/tmp/x"})
    assert (s.host, s.port, s.default_model, s.device) == (
        "127.0.0.1",
        8000,
        "smollm2-135m-instruct",
        "auto",
    )
    assert (s.weights_hold_timeout_s, s.weights_commit_watchdog_ms) == (5.0, 800.0)
    assert (s.weights_heartbeat_timeout_s, s.weights_quiesce_drain_timeout_s) == (30.0, 60.0)
    assert s.weights_heartbeat_interval_hint_s == 5.0
    assert (s.max_concurrent_requests, s.max_queued_requests, s.max_request_bytes) == (
        1,
        64,
        8388608,
    )
    assert s.weights_tokens == ()
    assert s.v1_load_policy == "auto"  # contract 4's auto-load
    assert load_settings({"MISERVER_HOME": "/x", "V1_LOAD_POLICY": "Refuse"}).v1_load_policy == (
        "refuse"
    )


@pytest.mark.parametrize(
    "env, variable",
    [
        ({"PORT": "eighty"}, "PORT"),
        ({"PORT": "70000"}, "PORT"),
        ({"MAX_CONCURRENT_REQUESTS": "0"}, "MAX_CONCURRENT_REQUESTS"),
        ({"WEIGHTS_HOLD_TIMEOUT_S": "-1"}, "WEIGHTS_HOLD_TIMEOUT_S"),
        ({"WEIGHTS_COMMIT_WATCHDOG_MS": "nan"}, "WEIGHTS_COMMIT_WATCHDOG_MS"),
        ({"DEVICE": "tpu"}, "DEVICE"),
        ({"WEIGHTS_CPU_ATTACH": "maybe"}, "WEIGHTS_CPU_ATTACH"),
        ({"LOG_FORMAT": "xml"}, "LOG_FORMAT"),
        ({"WEIGHTS_HEARTBEAT_INTERVAL_HINT_S": "30"}, "WEIGHTS_HEARTBEAT_INTERVAL_HINT_S"),
        ({"CONTINUOUS_BATCHING": "maybe"}, "CONTINUOUS_BATCHING"),
        ({"GGUF_THREADS": "0"}, "GGUF_THREADS"),
        ({"GGUF_THREADS": "many"}, "GGUF_THREADS"),
        ({"V1_LOAD_POLICY": "never"}, "V1_LOAD_POLICY"),
        ({"WEIGHTS_TOKENS": f"Bad Label:trainer:{SECRET}"}, "WEIGHTS_TOKENS"),
        ({"WEIGHTS_TOKENS": f"a:admin:{SECRET}"}, "WEIGHTS_TOKENS"),
        ({"WEIGHTS_TOKENS": "a:trainer:short"}, "WEIGHTS_TOKENS"),
        ({"WEIGHTS_TOKENS": f"a:trainer:{SECRET},a:operator:{SECRET}x"}, "WEIGHTS_TOKENS"),
        ({"WEIGHTS_TOKENS_FILE": "/nonexistent/tokens"}, "WEIGHTS_TOKENS_FILE"),
    ],
)
def test_bad_value_names_the_variable_and_hides_secrets(env, variable):
    with pytest.raises(ConfigError) as info:
        load_settings({"MISERVER_HOME": "/tmp/x", **env})
    assert info.value.variable == variable
    assert SECRET not in str(info.value)


def test_tokens_from_variable_and_file_are_merged(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"# a comment\nops:operator:{SECRET}-op\n\n")
    s = load_settings(
        {
            "MISERVER_HOME": "/tmp/x",
            "WEIGHTS_TOKENS": f"trn:trainer:{SECRET}",
            "WEIGHTS_TOKENS_FILE": str(f),
        }
    )
    assert [(t.label, t.role) for t in s.weights_tokens] == [
        ("trn", "trainer"),
        ("ops", "operator"),
    ]
    assert SECRET not in repr(s)


def test_flags_win_over_environment():
    s = load_settings({"MISERVER_HOME": "/tmp/x", "PORT": "1234"}, {"PORT": "4321"})
    assert s.port == 4321


def test_cli_exits_2_with_one_line_naming_the_variable(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "miserver.cli", "serve", "--port", "nope"],
        capture_output=True,
        text=True,
        env={"MISERVER_HOME": str(tmp_path), "PATH": "/usr/bin"},
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "PORT" in lines[0]


# --- WEIGHTS_TOKENS_FILE that is not text, or not a file (breaker finding F9) -----------------
def _serve_with_tokens_file(tmp_path, path: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miserver.cli", "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,  # /dev/zero read for ever before the size bound
        env={
            "MISERVER_HOME": str(tmp_path / "home"),
            "PATH": "/usr/bin",
            "WEIGHTS_TOKENS_FILE": path,
            "DEFAULT_MODEL": "",
        },
    )


def test_a_tokens_file_that_is_not_utf8_exits_2_with_one_line(tmp_path):
    f = tmp_path / "tokens"
    f.write_bytes(b"\xff\xfe bad utf8 x:trainer:" + SECRET.encode() + b"\n")
    proc = _serve_with_tokens_file(tmp_path, str(f))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "WEIGHTS_TOKENS_FILE" in lines[0] and "UTF-8" in lines[0], lines
    assert SECRET not in proc.stderr


@pytest.mark.parametrize("path", ["/dev/zero", "fifo", "dir"])
def test_a_tokens_file_that_is_no_regular_file_exits_2_at_once(tmp_path, path):
    if path == "fifo":
        os.mkfifo(tmp_path / "fifo")  # opening it would wait for a writer
        path = str(tmp_path / "fifo")
    elif path == "dir":
        path = str(tmp_path)
    proc = _serve_with_tokens_file(tmp_path, path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "WEIGHTS_TOKENS_FILE" in lines[0], lines


def test_a_tokens_file_over_the_size_bound_is_refused(tmp_path):
    from miserver.spec.settings import MAX_TOKENS_FILE_BYTES

    f = tmp_path / "tokens"
    f.write_bytes(b"# " + b"x" * MAX_TOKENS_FILE_BYTES + b"\n")
    with pytest.raises(ConfigError, match="larger than") as info:
        load_settings({"MISERVER_HOME": "/tmp/x", "WEIGHTS_TOKENS_FILE": str(f)})
    assert info.value.variable == "WEIGHTS_TOKENS_FILE"


def test_max_batch_size_is_auto_or_1_to_256_and_auto_takes_the_devices_default() -> None:
    from miserver.spec.settings import resolved_max_batch_size

    auto = load_settings({"MISERVER_HOME": "/x"})
    assert auto.max_batch_size is None
    assert resolved_max_batch_size(auto, "cpu") == 8 and resolved_max_batch_size(auto, "cuda") == 64
    for raw, value in (("auto", None), ("AUTO", None), ("1", 1), ("64", 64), ("256", 256)):
        got = load_settings({"MISERVER_HOME": "/x", "MAX_BATCH_SIZE": raw})
        assert got.max_batch_size == value
    assert (
        resolved_max_batch_size(
            load_settings({"MISERVER_HOME": "/x", "MAX_BATCH_SIZE": "3"}), "cuda"
        )
        == 3
    )
    for bad in ("0", "257", "-1", "eight", "1.5"):
        with pytest.raises(ConfigError, match="MAX_BATCH_SIZE"):
            load_settings({"MISERVER_HOME": "/x", "MAX_BATCH_SIZE": bad})


def test_kv_cache_bytes_takes_sizes_with_units_and_auto_is_the_devices_default() -> None:
    from miserver.spec.settings import resolved_kv_cache_bytes

    auto = load_settings({"MISERVER_HOME": "/x"})
    assert auto.kv_cache_bytes is None
    assert resolved_kv_cache_bytes(auto, "cpu") == 1 << 30
    assert resolved_kv_cache_bytes(auto, "cuda", free_bytes=80 << 30) == 20 << 30
    for raw, value in (
        ("auto", None),
        ("", None),
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("2 gib", 2 << 30),
        ("1.5GB", 1_500_000_000),
        ("1048576", 1 << 20),
    ):
        got = load_settings({"MISERVER_HOME": "/x", "KV_CACHE_BYTES": raw})
        assert got.kv_cache_bytes == value, raw
    fixed = load_settings({"MISERVER_HOME": "/x", "KV_CACHE_BYTES": "64MiB"})
    assert resolved_kv_cache_bytes(fixed, "cuda", free_bytes=80 << 30) == 64 << 20
    for bad in ("0", "1000", "-5MiB", "lots", "5XB", "1e9", "nan"):
        with pytest.raises(ConfigError, match="KV_CACHE_BYTES"):
            load_settings({"MISERVER_HOME": "/x", "KV_CACHE_BYTES": bad})


def test_a_bad_switch_lists_every_accepted_spelling():
    with pytest.raises(ConfigError) as info:
        load_settings({"MISERVER_HOME": "/tmp/x", "WEIGHTS_CPU_ATTACH": "maybe"})
    for word in ("1", "true", "yes", "on", "0", "false", "no", "off", "'maybe'"):
        assert word in str(info.value)


def test_gguf_threads_is_auto_or_a_count_and_auto_follows_the_cpu_affinity() -> None:
    import os

    from miserver.spec.settings import resolved_gguf_threads

    auto = load_settings({"MISERVER_HOME": "/x"})
    assert auto.gguf_threads is None
    assert resolved_gguf_threads(auto) == len(os.sched_getaffinity(0))
    set_ = load_settings({"MISERVER_HOME": "/x", "GGUF_THREADS": "3"})
    assert (set_.gguf_threads, resolved_gguf_threads(set_)) == (3, 3)
    for bad in ("0", "1025", "-2", "two"):
        with pytest.raises(ConfigError, match="GGUF_THREADS"):
            load_settings({"MISERVER_HOME": "/x", "GGUF_THREADS": bad})


@pytest.mark.parametrize(
    ("variable", "field", "resolve", "auto_for"),
    [
        # CPU_THREADS: auto leaves one core to the event loop
        ("CPU_THREADS", "cpu_threads", "resolved_cpu_threads", lambda c: max(1, c - 1)),
        # CPU_MATMUL_THREADS: auto is every core
        ("CPU_MATMUL_THREADS", "cpu_matmul_threads", "resolved_cpu_matmul_threads", lambda c: c),
    ],
)
def test_cpu_thread_counts_are_auto_or_a_count(
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    field: str,
    resolve: str,
    auto_for: Callable[[int], int],
) -> None:
    from miserver.spec import settings as settings_module

    resolved = getattr(settings_module, resolve)
    auto = load_settings({"MISERVER_HOME": "/x"})
    assert getattr(auto, field) is None
    assert resolved(auto) == auto_for(len(os.sched_getaffinity(0)))
    for cores, threads in ((1, auto_for(1)), (2, auto_for(2)), (16, auto_for(16))):
        monkeypatch.setattr(settings_module, "usable_cores", lambda c=cores: c)
        assert resolved(auto) == threads
    set_ = load_settings({"MISERVER_HOME": "/x", variable: "2"})
    assert (getattr(set_, field), resolved(set_)) == (2, 2)
    for bad in ("0", "1025", "-2", "two"):
        with pytest.raises(ConfigError, match=variable):
            load_settings({"MISERVER_HOME": "/x", variable: bad})


def test_continuous_batching_1_starts_with_pauses_unavailable_as_cbm() -> None:
    from miserver.fsm.machine import Lifecycle

    on = load_settings({"MISERVER_HOME": "/x", "CONTINUOUS_BATCHING": "1"})
    assert on.continuous_batching is True
    assert Lifecycle.from_settings(on).state.avail == "cbm"
    # cbm is named before concurrency (weights page: Status pause_unavailable)
    both = load_settings(
        {"MISERVER_HOME": "/x", "CONTINUOUS_BATCHING": "1", "MAX_CONCURRENT_REQUESTS": "2"}
    )
    assert Lifecycle.from_settings(both).state.avail == "cbm"
    off = load_settings({"MISERVER_HOME": "/x"})
    assert Lifecycle.from_settings(off).state.avail == "ok"


# --- ENGINE: the static batch was removed (issue 29) -----------------------------------------
@pytest.mark.parametrize("value", ["static", "STATIC", " Static "])
def test_engine_static_is_refused_saying_the_static_batch_was_removed(value):
    with pytest.raises(ConfigError) as err:
        load_settings({"MISERVER_HOME": "/tmp/x", "ENGINE": value})
    assert err.value.variable == "ENGINE"
    message = str(err.value)
    assert "static batch was removed" in message
    assert "continuous engine serves every sequence" in message


def test_settings_made_in_code_refuse_the_static_engine_too():
    from miserver.spec.settings import Settings

    with pytest.raises(ConfigError) as err:
        Settings(home="/tmp/x", engine="static")
    assert err.value.variable == "ENGINE" and "static batch was removed" in str(err.value)
    assert Settings(home="/tmp/x").engine == "continuous"


def test_engine_accepts_only_continuous():
    env = {"MISERVER_HOME": "/tmp/x"}
    assert load_settings(env).engine == "continuous"
    assert load_settings({**env, "ENGINE": ""}).engine == "continuous"  # ENGINE= : unset
    assert load_settings({**env, "ENGINE": "Continuous"}).engine == "continuous"
    with pytest.raises(ConfigError) as err:
        load_settings({**env, "ENGINE": "paged"})
    assert err.value.variable == "ENGINE" and "expected continuous" in str(err.value)


def test_cli_refuses_engine_static_at_start_with_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "miserver.cli", "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"MISERVER_HOME": str(tmp_path), "PATH": "/usr/bin", "ENGINE": "static"},
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "ENGINE" in lines[0] and "static batch was removed" in lines[0]


def test_speculative_tokens_is_auto_or_0_to_16_and_auto_is_4_on_the_cpu_only() -> None:
    from miserver.spec.settings import resolved_speculative_tokens

    auto = load_settings({"MISERVER_HOME": "/x"})
    assert auto.speculative_tokens is None
    assert resolved_speculative_tokens(auto, "cpu") == 4
    assert resolved_speculative_tokens(auto, "cuda") == 0
    off = load_settings({"MISERVER_HOME": "/x", "SPECULATIVE_TOKENS": "0"})
    assert resolved_speculative_tokens(off, "cpu") == 0
    six = load_settings({"MISERVER_HOME": "/x", "SPECULATIVE_TOKENS": "6"})
    assert resolved_speculative_tokens(six, "cuda") == 6
    for bad in ("17", "-1", "four"):
        with pytest.raises(ConfigError, match="SPECULATIVE_TOKENS"):
            load_settings({"MISERVER_HOME": "/x", "SPECULATIVE_TOKENS": bad})


def test_serve_sets_openmp_for_its_device_and_an_explicit_environment_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``miserver serve``'s OpenMP environment (cli.set_thread_environment): a CPU server
    ``OMP_NUM_THREADS=1`` (the engine thread sets its own counts), a CUDA server
    ``OMP_WAIT_POLICY=PASSIVE``; ``auto`` is the CPU without an NVIDIA device node; a variable
    already set is left as it is."""
    import glob

    from miserver import cli

    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    cpu = load_settings({"MISERVER_HOME": "/x", "DEVICE": "cpu"})
    cuda = load_settings({"MISERVER_HOME": "/x", "DEVICE": "cuda"})
    auto = load_settings({"MISERVER_HOME": "/x"})
    assert cli.serves_on_cpu(cpu) and not cli.serves_on_cpu(cuda)
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"])
    assert not cli.serves_on_cpu(auto)
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    assert cli.serves_on_cpu(auto)
    cli.set_thread_environment(cpu)
    assert os.environ.get("OMP_NUM_THREADS") == "1" and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.delenv("OMP_NUM_THREADS")
    cli.set_thread_environment(cuda)
    assert os.environ.get("OMP_WAIT_POLICY") == "PASSIVE" and "OMP_NUM_THREADS" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    cli.set_thread_environment(cpu)
    assert os.environ["OMP_NUM_THREADS"] == "4"
