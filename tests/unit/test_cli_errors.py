"""`epd` refuses bad arguments in one line (`epd: error: ...`, exit status 2) before it loads or starts
anything, and its --help says what each option does and defaults to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from controlplane.cli import build_parser, main

from http_helpers import free_loopback_port

pytestmark = [pytest.mark.unit]


@pytest.fixture(autouse=True)
def _clean_env(no_epd_env, monkeypatch, tmp_path):
    monkeypatch.setenv("EPD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps help at the terminal's width: one line per option


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a command gets as far as loading a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the arguments should have been refused before loading the model")
    import bench.engine_bench as engine_bench
    import workers.runtime.loader as loader
    monkeypatch.setattr(loader, "load_model", refuse)
    monkeypatch.setattr(engine_bench, "load_model", refuse)


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("epd: error: ") and out.err.count("\n") == 1, out
    return out.err


@pytest.mark.parametrize("args, message", [
    (["--device", "gpu9"], "--device 'gpu9' is not a device epd runs on"),
    (["--threads", "-3"], "--threads must be >= 1, got -3"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--image", "/nonexistent.png"], "--image /nonexistent.png: cannot read it: No such file or directory"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
])
def test_generate_refuses_bad_arguments_before_loading(args, message, capsys, no_loading):
    assert message in one_line_error(capsys, ["generate", *args])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_generate_on_cuda_without_cuda_is_refused(capsys, no_loading):
    err = one_line_error(capsys, ["generate", "--device", "cuda"])
    assert "--device cuda: CUDA is not available here" in err and err.endswith("; use --device cpu\n")


def test_generate_on_a_cuda_index_that_does_not_exist_is_refused(capsys, no_loading):
    err = one_line_error(capsys, ["generate", "--device", f"cuda:{max(torch.cuda.device_count(), 1) + 7}"])
    assert "--device cuda:" in err


def test_model_init_into_a_file_is_refused(capsys, tmp_path):
    target = tmp_path / "a-file"
    target.write_text("keep me")
    assert f"{target} exists and is not a folder" in one_line_error(capsys, ["model", "init", str(target)])
    assert target.read_text() == "keep me"


def test_model_init_refuses_a_seed_past_int64_and_writes_nothing(capsys, tmp_path):
    target = tmp_path / "model"
    err = one_line_error(capsys, ["model", "init", str(target), "--seed", str(10**23)])
    assert "--seed must be an integer in [0, 2^63), got 100000000000000000000000" in err
    assert not target.exists()


@pytest.mark.parametrize("argv", [["model", "init", ""], ["serve", "--model", ""], ["serve", "--config", " "],
                                  ["generate", "--model", ""], ["bench", "engine", "--json", ""]])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(capsys, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:  # argparse's own refusal, in one line
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and ": an empty path (see `epd " in err, err
    assert not [p for p in tmp_path.iterdir() if p.name != "state"]  # nothing written here


def test_model_init_where_no_folder_can_be_made_is_refused(capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "model"
    assert f"cannot write the model to {target}" in one_line_error(capsys, ["model", "init", str(target)])


@pytest.mark.parametrize("args, message", [
    (["--batches", "a,b"], "--batches takes a comma list of integers"),
    (["--batches", "0"], "--batches values must be >= 1"),
    (["--batches", "8,-1"], "--batches values must be >= 1"),
    (["--prefill-lengths", "128,,4096"], "--prefill-lengths takes a comma list of integers"),
    (["--decode-tokens", "0"], "--decode-tokens must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--device", "gpu9"], "--device 'gpu9'"),
])
def test_bench_engine_refuses_bad_arguments_before_loading(args, message, capsys, no_loading):
    assert message in one_line_error(capsys, ["bench", "engine", "--no-hf", *args])


@pytest.mark.parametrize("args, message", [
    (["--policy", "int9"], "--policy: codec policy 'int9': unknown codec 'int9'"),
    (["--policy", "int8", "--policy", "auto:x"], "--policy"),
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
])
def test_bench_kv_accuracy_refuses_bad_arguments_before_any_output(args, message, capsys, no_loading):
    assert message in one_line_error(capsys, ["bench", "kv-accuracy", *args])


def test_bench_kv_accuracy_checks_policy_layers_against_the_model_before_any_output(capsys, default_ckpt):
    err = one_line_error(capsys, ["bench", "kv-accuracy", "--model", str(default_ckpt), "--policy", "int8",
                                  "--policy", "int8,99=bf16", "--prompts", "1", "--max-tokens", "1"])
    assert "--policy 'int8,99=bf16': codec policy names layer 99, but the model has 4 layers" in err


def _serve_failing_with(monkeypatch, exc: Exception) -> None:
    import controlplane.serve as serve

    def build(settings):
        raise exc
    monkeypatch.setattr(serve, "build", build)


def test_a_replica_that_fails_to_start_ends_serve_in_one_line(capsys, monkeypatch):
    from controlplane.pools.status import WorkerStartError
    report = ("1 of 2 decode replicas failed to start:\n"
              "epd-decode-abc123-0: AssertionError: Torch not compiled with CUDA enabled\n"
              "  (raised while the actor started; Ray's report follows)\n"
              "Traceback (most recent call last):\n  File ...\nAssertionError: Torch not compiled with CUDA enabled")
    _serve_failing_with(monkeypatch, WorkerStartError(report))
    err = one_line_error(capsys, ["serve", "--port", str(free_loopback_port())])
    assert err == ("epd: error: 1 of 2 decode replicas failed to start: epd-decode-abc123-0: AssertionError: "
                   "Torch not compiled with CUDA enabled\n")


def test_an_unreachable_redis_ends_serve_in_one_line(capsys, monkeypatch):
    from controlplane.state.errors import RedisServerNotFound, StateUnavailable
    _serve_failing_with(monkeypatch, StateUnavailable("redis://127.0.0.1:1/0", "Connection refused"))
    port = str(free_loopback_port())
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in one_line_error(capsys, ["serve", "--port", port])
    _serve_failing_with(monkeypatch, RedisServerNotFound("redis-server is not installed"))
    assert "redis-server is not installed" in one_line_error(capsys, ["serve", "--port", port])


def test_serve_refuses_a_redis_url_that_is_not_one(capsys):
    err = one_line_error(capsys, ["serve", "--redis-url", "notaurl", "--port", str(free_loopback_port())])
    assert "--redis-url (redis.url): 'notaurl' is not a Redis URL" in err


def test_bugs_still_raise(monkeypatch):
    _serve_failing_with(monkeypatch, KeyError("a bug"))
    with pytest.raises(KeyError):
        main(["serve", "--port", str(free_loopback_port())])


def _help(*command: str) -> str:
    parser = build_parser()
    for name in command:
        parser = next(a for a in parser._subparsers._group_actions if a.choices).choices[name]
    return parser.format_help()


def test_status_and_scale_help_say_what_they_need():
    status = _help("status")
    assert "print the admin API's JSON instead of a table" in status
    assert "running `epd serve`" in status and "admin token" in status
    scale = _help("scale")
    assert "its new replica count" in scale and "the pool to scale" in scale
    assert "running `epd serve`" in scale and "EPD_API__ADMIN_TOKEN" in scale


@pytest.mark.parametrize("command, expected", [
    (("generate",), ["tokens to generate at most (default: 32)", "(default: 1.0", "sampling seed (default: none"]),
    (("bench", "kv"), ["TTFT figure (default: 2048)"]),
    (("bench", "engine"), ["per sequence (default: 64)", "this many runs (default: 3)"]),
    (("bench", "kv-accuracy"), ["prompts to compare (default: 64)", "per prompt (default: 64)"]),
    (("bench", "compare"), ["(default: 0)", "(default: bench-compare)"]),
])
def test_help_shows_the_defaults(command, expected):
    text = " ".join(_help(*command).split())  # argparse wraps lines
    for phrase in expected:
        assert phrase in text, (command, phrase)


def test_bench_compare_help_is_plain_words():
    text = _help("bench", "compare")
    assert "``" not in text and "controlplane." not in text
    assert "goodput ratio" in text


def test_readme_lists_the_admin_commands_flags():
    commands = (Path(__file__).resolve().parents[2] / "README.md").read_text().split("## Commands", 1)[1]
    commands = commands.split("\n## ", 1)[0]
    for line in ("epd status [--json] [--url URL] [--config FILE]",
                 "epd scale POOL N [--force] [--url URL] [--config FILE]",
                 "epd drain WORKER [--undo] [--url URL] [--config FILE]"):
        assert line in commands


@pytest.mark.parametrize("args, message", [
    (["generate", "--device", "gpu9"], "--device 'gpu9' is not a device epd runs on"),
    (["bench", "engine", "--batches", "a,b"], "--batches takes a comma list of integers"),  # raised in a bench module
    # a malformed command line (argparse's own errors): one line too, pointing at the command's --help
    (["scale", "decode", "abc"], "epd scale: error: argument replicas: invalid int value: 'abc' "
                                 "(see `epd scale --help`)"),
    (["scale", "decode", "-1"], "epd scale: error: argument replicas: must be from 0 to 1000, got -1"),
    (["scale", "decode", str(10**20)], "argument replicas: must be from 0 to 1000, got 100000000000000000000"),
    (["config"], "epd config: error: the following arguments are required: ACTION (see `epd config --help`)"),
    (["drain", ""], "epd: error: a worker id is required"),
    # an unknown option: named, by the command it was given to
    (["--bogus"], "epd: error: unrecognized arguments: --bogus: a command comes first, then its options "
                  "(see `epd --help`)"),
    (["serve", "--bogus", "1"], "epd serve: error: unrecognized arguments: --bogus 1 (see `epd serve --help`)"),
    (["bench", "kv", "--bogus"], "epd bench kv: error: unrecognized arguments: --bogus (see `epd bench kv --help`)"),
])
def test_usage_errors_are_one_line_when_run_as_a_module_too(args, message):
    """`python -m controlplane.cli` makes that module __main__: its errors and the bench modules' (which raise
    ``controlplane.cli_args.UsageError``) are both one line."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "controlplane.cli", *args], capture_output=True, text=True,
                            timeout=60, cwd=Path(__file__).resolve().parents[2],
                            env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


def test_a_command_package_that_cannot_be_imported_leaves_epd_working(capsys, monkeypatch):
    """`bench` (or any package registered under epd.commands) that fails to import costs only its own
    command: it says why in one line; every other command still parses."""
    import controlplane.cli as cli

    class Broken:
        name = "bench"

        def load(self):
            raise ImportError("No module named 'bench'")

    monkeypatch.setattr(cli, "entry_points", lambda group: [Broken()])
    assert build_parser().parse_args(["status", "--json"]).json is True
    err = one_line_error(capsys, ["bench", "engine", "--batches", "1"])
    assert "epd bench cannot be imported here (No module named 'bench')" in err


@pytest.mark.parametrize("argv, blocked, missing", [
    (["bench", "serve", "--url", "http://127.0.0.1:1", "--num-prompts", "1"], ["httpx"], "httpx"),
    (["bench", "serve", "--url", "http://127.0.0.1:1", "--plot-dir", "plots"], ["matplotlib"], "matplotlib"),
    (["bench", "compare"], ["httpx", "matplotlib"], "httpx and matplotlib"),
    (["bench", "chaos"], ["httpx"], "httpx"),
    (["bench", "controlplane"], ["httpx"], "httpx"),
])
def test_a_bench_suite_without_the_bench_extra_names_the_install_before_it_starts(capsys, monkeypatch, tmp_path,
                                                                                    argv, blocked, missing):
    """An install without the bench extra (a wheel, the container image): the suites that need it say so in one line
    before they start anything, instead of a ModuleNotFoundError traceback (or one after a finished run)."""
    import sys

    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError, as when not installed
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, argv)
    assert f"epd bench {argv[1]} needs {missing}, from the bench extra: pip install {' '.join(blocked)} " in err
    assert list(tmp_path.iterdir()) == []  # no report, plot or results folder written


@pytest.mark.parametrize("command", [["config", "schema"], ["config", "show"]])  # 30 KB; 2 KB (flushed at exit)
def test_a_reader_that_leaves_early_gets_no_traceback(command):
    """`epd config show | head -1`: the pipe closes under epd's output; it stops quietly (exit 1), as
    Python's own recipe does, instead of a BrokenPipeError traceback (or "Exception ignored" at exit)."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "controlplane.cli", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2],
                            env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # gone before epd writes its first byte
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(60) == 1 and err == "", err


def test_a_broken_pipe_that_is_not_stdout_is_still_a_bug(monkeypatch):
    """A BrokenPipeError from another pipe (a benchmark's child process that died) is not a reader that
    left: it still raises, with its traceback."""
    import controlplane.cli as cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_config_schema", broken)
    with pytest.raises(BrokenPipeError):
        main(["config", "schema"])


def test_the_drain_message_names_the_undo_command_whole(capsys, monkeypatch):
    """"undo with `epd drain --undo`" was refused as written: the worker id is required."""
    import controlplane.admin_client as admin_client

    calls: list[tuple[str, str]] = []

    def call(settings, method: str, path: str, *rest, **kw) -> dict:
        calls.append((method, path))
        return {}

    monkeypatch.setattr(admin_client, "call", call)
    assert main(["drain", "decode-vm1-ab12"]) == 0
    assert calls == [("POST", "/admin/workers/decode-vm1-ab12/drain")]
    assert "undo with `epd drain decode-vm1-ab12 --undo`" in capsys.readouterr().out


def test_a_micro_benchmark_missing_a_module_names_the_package_only_when_it_is_the_bench_extras(monkeypatch):
    import sys

    from bench.micro.runner import Benchmark, run_suite
    from bench.micro.timing import Plan

    # as when the bench extra is not installed: its submodules too, which an earlier test may have imported
    # (an import of a submodule already in sys.modules never looks at its parent)
    for name in ["transformers", *(m for m in sys.modules if m.startswith("transformers."))]:
        monkeypatch.setitem(sys.modules, name, None)
    run = run_suite([Benchmark("sampler", "bench.micro.sampler:run", ""),
                     Benchmark("other", "no_such_module_here.sub:run", "")], Plan(repeats=2, quick=True))
    assert run.errors["sampler"] == ("needs transformers, which is not installed (the bench extra: "
                                     "pip install transformers)")
    assert run.errors["other"].startswith("ModuleNotFoundError: No module named 'no_such_module_here'")


def test_the_cli_imports_no_ray_before_serve_sets_its_environment() -> None:
    """`epd serve` sets Ray's environment (loopback-only, no auto-connect) before its first `import ray`, which
    Ray reads once: anything that imported Ray at start-up (a command plugin, a settings module) would silently
    undo both. A fresh interpreter, as `epd` starts."""
    code = ("import sys; import controlplane.cli as cli; cli.build_parser(); import controlplane.serve; "
            "from controlplane.settings import Settings; Settings.load(); print(sorted(m for m in sys.modules "
            "if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2],
                         env={k: v for k, v in os.environ.items() if not k.startswith("EPD_")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.fixture
def no_runs(monkeypatch):
    """Fail the test if a bench command gets as far as running (starting a stack, measuring)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the arguments should have been refused before the run")
    import bench.chaos.run as chaos_run
    import bench.compare as compare
    import bench.controlplane_bench as controlplane_bench
    import bench.kv_bench as kv_bench
    import bench.serve.runner as serve_runner
    for module, name in ((chaos_run, "chaos"), (chaos_run, "soak"), (compare, "compare"),
                         (controlplane_bench, "run"), (kv_bench, "run"), (serve_runner, "run_serve_bench")):
        monkeypatch.setattr(module, name, refuse)


@pytest.mark.parametrize("args, message", [
    (["kv", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["kv", "--ttft-tokens", "0"], "--ttft-tokens must be >= 1, got 0"),
    (["kv", "--threads", "-1"], "--threads must be >= 1, got -1"),
    (["kv", "--paired", "-1"], "--paired must be 0 or more, got -1"),
    (["kv", "--ttft-codec", "bogus"], "--ttft-codec: unknown codec 'bogus'"),
    (["kv", "--json", "/proc/nope/r.json"], "--json /proc/nope/r.json: the folder /proc/nope does not exist"),
    (["controlplane", "--observability-cost", "-1"], "--observability-cost takes a number of rounds >= 0, got -1"),
    (["controlplane", "--observability-tokens", "0"], "--observability-tokens must be >= 1, got 0"),
    (["controlplane", "--concurrency", "0"], "--concurrency must be >= 1, got 0"),
    (["chaos", "--model", "/nonexistent-model"], "--model /nonexistent-model"),
    (["chaos", "--json", "/proc/nope/r.json"], "--json /proc/nope/r.json: the folder /proc/nope does not exist"),
    (["chaos", "--mix"], "--mix shapes the soak: give it with --soak MINUTES"),
    (["chaos", "--idle-s", "10"], "--idle-s shapes the soak: give it with --soak MINUTES"),
    (["compare", "--out", "/dev/null/out"], "--out /dev/null/out: /dev/null is not a folder"),
])
def test_bench_flags_are_refused_before_the_run(args, message, capsys, no_runs):
    assert message in one_line_error(capsys, ["bench", *args])


@pytest.mark.parametrize("args", [["--soak", "inf"], ["--baseline-s", "1e999"], ["--stop-s", "nan"],
                                  ["--idle-s", "nan"], ["--idle-s", "-1"]])
def test_bench_chaos_refuses_non_finite_durations(args, capsys, no_runs):
    with pytest.raises(SystemExit) as exited:
        main(["bench", "chaos", *args])
    assert exited.value.code == 2 and "a positive number" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--request-timeout", "nan"], "--request-timeout must be a positive number of seconds"),
    (["--request-timeout", "inf"], "--request-timeout must be a positive number of seconds"),
    (["--temperature", "nan"], "--temperature must be a number >= 0"),
    (["--temperature", "-1"], "--temperature must be a number >= 0"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2^63)"),
    (["--result-json", "/dev/null/r.json"], "--result-json /dev/null/r.json: /dev/null is not a folder"),
])
def test_bench_serve_refuses_bad_values_before_the_load_test(args, message, capsys, no_runs):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epd bench serve: error: ") and message in err, err


@pytest.mark.parametrize("args, message", [
    (["--port", "0"], "invalid settings: --port (api.port): Input should be greater than or equal to 1"),
    (["--redis-url", "foo"], "invalid settings: --redis-url (redis.url): 'foo' is not a Redis URL"),
])
def test_a_flags_refused_value_is_named_by_the_flag(args, message, capsys):
    assert message in one_line_error(capsys, ["serve", *args])


def test_a_result_json_in_a_folder_yet_to_be_made_is_accepted(tmp_path):
    """bench serve makes --result-json's folder itself: only a path no folder can be made for is refused."""
    from controlplane.cli_args import UsageError, check_writable

    check_writable("--result-json", tmp_path / "results" / "run1.json", parents_made=True)
    with pytest.raises(UsageError, match="the folder .*results does not exist"):
        check_writable("--json", tmp_path / "results" / "run1.json")
