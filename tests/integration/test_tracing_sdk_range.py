"""Tracing against both ends of the opentelemetry-sdk range pyproject.toml allows.

The top end is what the suite runs with (the .venv's SDK, checked here to be the newest allowed minor).
The bottom end is installed with ``pip install --no-deps --target`` into a folder under .venv (from PyPI
on the first run, reused after) and put first on PYTHONPATH of a child interpreter, which runs
``test_tracing.py`` whole: exporters and samplers from OTEL_* variables, one trace per request across
the ingress and three workers, a worker process exporting to a real OTLP receiver.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = [pytest.mark.integration, pytest.mark.pypi, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
OLDEST = "1.43.0"
# every opentelemetry distribution the tracing path imports, at the versions opentelemetry-sdk OLDEST
# and its OTLP exporter require of each other (pinned exactly, so --no-deps leaves nothing to chance)
OLDEST_DISTS = {"opentelemetry-api": OLDEST, "opentelemetry-sdk": OLDEST,
                "opentelemetry-semantic-conventions": "0.64b0", "opentelemetry-proto": OLDEST,
                "opentelemetry-exporter-otlp-proto-common": OLDEST, "opentelemetry-exporter-otlp-proto-grpc": OLDEST}
CACHE = ROOT / ".venv" / "epd-test-cache" / f"opentelemetry-{OLDEST}"


def _allowed() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return {r.name: r for r in reqs if r.name.startswith("opentelemetry")}


def _oldest_sdk() -> Path:
    """The folder holding OLDEST_DISTS (installed on first use)."""
    done = CACHE / ".complete"
    if done.exists():
        return CACHE
    tmp = CACHE.with_name(f"{CACHE.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                          "--no-deps", "--target", str(tmp), *(f"{n}=={v}" for n, v in OLDEST_DISTS.items())],
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.fail(f"installing opentelemetry {OLDEST} from PyPI failed (this test needs PyPI once; "
                    f"deselect it with -m 'not pypi'):\n{run.stderr[-2000:]}")
    shutil.rmtree(CACHE, ignore_errors=True)
    tmp.rename(CACHE)
    done.touch()
    return CACHE


def _child_env(path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def test_the_range_runs_from_the_oldest_tested_to_the_installed_sdk():
    allowed = _allowed()
    assert set(allowed) == {"opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-otlp-proto-grpc"}
    for name, req in allowed.items():
        assert req.specifier.contains(OLDEST) and not req.specifier.contains("1.42.1"), (name, str(req))
        installed = Version(version(name))
        assert req.specifier.contains(installed), (name, installed, str(req))
        # the top of the range is a minor this suite runs on: the next minor is outside it
        assert not req.specifier.contains(f"{installed.major}.{installed.minor + 1}.0"), (name, str(req))


def test_tracing_passes_on_the_oldest_allowed_sdk():
    path = _oldest_sdk()
    check = ("import sys\n"
             "from importlib.metadata import version\n"
             f"want = {OLDEST_DISTS!r}\n"
             "got = {name: version(name) for name in want}\n"
             "assert got == want, got\n"
             "import opentelemetry.sdk.version as v\n"
             f"assert v.__version__ == {OLDEST!r} and v.__file__.startswith({str(path)!r}), v.__file__\n"
             "import pytest\n"
             "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/integration/test_tracing.py']))\n")
    run = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=_child_env(path), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, (f"test_tracing.py on opentelemetry-sdk {OLDEST}:\n"
                                 f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]
