"""The `epd` command line as a user runs it: real subprocesses, real files."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.loader import load_model
from workers.runtime.sampler import SamplingParams

pytestmark = [pytest.mark.integration]


def epd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controlplane.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli") / "demo"
    result = epd("model", "init", str(folder))
    assert result.returncode == 0, result.stderr
    assert "random weights" in result.stdout
    return folder


def test_model_init_is_deterministic_and_loadable(model_dir, tmp_path):
    again = tmp_path / "again"
    assert epd("model", "init", str(again)).returncode == 0
    assert _digest(again) == _digest(model_dir)
    other_seed = tmp_path / "seed1"
    assert epd("model", "init", str(other_seed), "--seed", "1", "--no-vision").returncode == 0
    assert _digest(other_seed)["model.safetensors"] != _digest(model_dir)["model.safetensors"]
    assert not (other_seed / "vision").exists()
    bundle = load_model(model_dir)
    assert bundle.vision is not None and bundle.image_token_id is not None


def test_model_init_refuses_a_non_empty_folder(model_dir):
    before = _digest(model_dir)
    result = epd("model", "init", str(model_dir))
    assert result.returncode == 2
    assert result.stderr.startswith("epd: error: ") and "not empty" in result.stderr and "--force" in result.stderr
    assert _digest(model_dir) == before


def test_generate_prints_what_the_library_generates(model_dir):
    result = epd("generate", "--model", str(model_dir), "--prompt", "Hello, world", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    expected = generate(load_model(model_dir), [GenerateRequest(
        prompt="Hello, world", params=SamplingParams(max_tokens=12, temperature=0.0))])[0]
    assert result.stdout.rstrip("\n") == expected.text
    assert f"{len(expected.token_ids)} tokens" in result.stderr


def test_generate_with_an_image(model_dir, tmp_path):
    png = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (220, 20, 20)).save(png)
    result = epd("generate", "--model", str(model_dir), "--chat", "What is this?", "--image", str(png),
                 "--max-tokens", "6")
    assert result.returncode == 0, result.stderr
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (220, 20, 20)).save(buf, "PNG")
    expected = generate(load_model(model_dir), [GenerateRequest(
        messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        images=(png.read_bytes(),), params=SamplingParams(max_tokens=6, temperature=0.0))])[0]
    assert result.stdout.rstrip("\n") == expected.text
    # 64 image tokens plus the chat scaffolding
    assert f"prompt {len(expected.prompt_ids)} tokens" in result.stderr and len(expected.prompt_ids) > 64


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/nonexistent/model"], "not a checkpoint folder"),
    (["generate", "--max-tokens", "0"], "max_tokens must be an integer >= 1"),
])
def test_bad_arguments_give_a_clear_error(args, message):
    result = epd(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_on_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    """One line and status 2, before Redis, Ray or a replica starts (it used to start them all, say it was
    serving, then fail in uvicorn with status 3)."""
    import os
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "controlplane.cli", "serve", "--port", str(port)],
                                capture_output=True, text=True, timeout=120,
                                env={**os.environ, "EPD_STATE_DIR": str(tmp_path / "state")})
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"epd: error: cannot listen on 127.0.0.1:{port}: Address already in use; another epd "
                             f"serve (or another server) uses it: stop it or pick --port\n")
    assert "serving" not in result.stdout and "redis" not in result.stdout.lower()


def test_undecodable_image_is_refused(model_dir, tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"this is not an image")
    result = epd("generate", "--model", str(model_dir), "--image", str(bad))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "image" in result.stderr.lower()


def test_help_lists_the_commands():
    result = epd("--help")
    assert result.returncode == 0
    for command in ("model", "generate", "bench"):
        assert command in result.stdout


def make_demo(tmp_path: Path, *variables: str) -> list[str]:
    """Run `make demo` with a stand-in epd that prints the arguments it got (as JSON); return them."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    fake = tmp_path / "venv" / "bin" / "epd"
    fake.parent.mkdir(parents=True)
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PROMPT", "MAX_TOKENS", "MAKEFLAGS")}
    result = subprocess.run(["make", "-s", "-o", "setup", "demo", f"VENV={fake.parent.parent}", *variables],
                            cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1, result.stdout  # nothing else ran and printed
    return json.loads(result.stdout)


@pytest.mark.parametrize("prompt, max_tokens", [
    ("""it's "$HOME" $(id) `id` $$ \\ back # hash; echo INJECTED""", "5"),
    ("x", "3; echo INJECTED"),
    ("", "48"),
])
def test_make_demo_passes_prompt_and_max_tokens_verbatim(prompt, max_tokens, tmp_path):
    """Both reach epd as single arguments, whatever they hold: no shell parsing, no make expansion of $."""
    assert make_demo(tmp_path, f"PROMPT={prompt}", f"MAX_TOKENS={max_tokens}") == [
        "generate", "--prompt", prompt, "--max-tokens", max_tokens]


def test_make_demo_defaults(tmp_path):
    assert make_demo(tmp_path) == ["generate", "--prompt", "The model reads a checkpoint folder and",
                                   "--max-tokens", "48"]


def test_model_init_that_runs_out_of_room_says_so_and_leaves_no_folder(tmp_path: Path) -> None:
    """A file-size limit (a full disk's stand-in) stops the weights' write: one line, exit 2, and no
    half-written folder that would look like a checkpoint."""
    import resource

    target = tmp_path / "model"
    result = subprocess.run(
        [sys.executable, "-m", "controlplane.cli", "model", "init", str(target)], capture_output=True, text=True,
        timeout=120, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"epd: error: cannot write the model to {target}")
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr and not target.exists()
