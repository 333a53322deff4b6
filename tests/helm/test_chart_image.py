"""The chart runs the image the repository's Dockerfile builds, its defaults fit a text-only model, and the Ray
version is pinned once (pyproject.toml) with the chart agreeing."""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml

from chart_tools import CHART, ROOT, control_plane_env, defaults, replica_counts, worker_groups

pytestmark = [pytest.mark.unit]


def _ray_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d for d in deps if d.replace(" ", "").startswith("ray[serve]")]
    assert len(pins) == 1, pins
    m = re.fullmatch(r"ray\[serve\]==([0-9.]+)", pins[0].replace(" ", ""))
    assert m, f"Ray must be pinned exactly (==) in one place: {pins[0]}"
    return m.group(1)


def test_the_ray_version_is_pinned_once_and_the_chart_agrees():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["rayVersion"] == _ray_pin()
    raycluster = next(o for o in defaults() if o["kind"] == "RayCluster")
    assert raycluster["spec"]["rayVersion"] == _ray_pin()
    # the image takes Ray from the package's own pin: the Dockerfile never names a Ray version of its own
    assert not re.search(r"ray(\[serve\])?\s*==", (ROOT / "Dockerfile").read_text())


def test_the_chart_runs_the_dockerfiles_image():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version
    images = {c["image"] for o in defaults() if o["kind"] in ("Deployment", "RayCluster")
              for c in _containers(o)}
    assert f"epd:{version}" in images
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", dockerfile, re.M) and "cuda)" in dockerfile
    assert "pip install /src" in dockerfile  # the package as pip builds it: the generated wire code comes along
    # the probes KubeRay injects into Ray containers run wget
    assert re.search(r"^RUN apt-get update && apt-get install .*\bwget\b", dockerfile, re.M)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "proto/epd/**/*_pb2.py"} <= set(ignored)


def test_defaults_fit_a_text_only_model():
    objs = defaults()
    encode = worker_groups(objs)["encode"]
    assert encode["replicas"] == 0
    spec = encode["template"]["spec"]
    resources = spec["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in {**resources.get("requests", {}), **resources.get("limits", {})}
    assert not any("nvidia" in str(t) for t in spec.get("tolerations", []))
    env = control_plane_env(objs)
    assert replica_counts(objs)["encode"] == 0 and env["EPD_ENCODE__NUM_GPUS"] in ("0", "0.0")
    assert env["EPD_TRANSFER__CODEC_POLICY"] == "lossless"  # exact unless the operator opts into a quantised wire
    for pool in ("prefill", "decode"):  # the language model's pools keep their GPU
        limits = worker_groups(objs)[pool]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1


def _containers(obj: dict) -> list[dict]:
    if obj["kind"] == "Deployment":
        return obj["spec"]["template"]["spec"]["containers"]
    spec = obj["spec"]
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]
