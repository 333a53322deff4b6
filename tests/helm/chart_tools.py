"""Render the chart with a real helm and validate what it renders, offline.

- helm: ``$HELM`` or ``helm`` on PATH (``make test`` puts .venv/bin first); missing -> a test failure
  that says how to get it, never a silent skip.
- Core objects (Deployment, Service, Secret, StatefulSet, PodDisruptionBudget, Ingress, ConfigMap): the
  OpenAPI schemas bundled in ``kubernetes-validate``, strict (unknown fields are errors).
- RayCluster / RayService: the ``openAPIV3Schema`` inside KubeRay's CRDs (copied to data/k8s-crds), made
  strict the way ``kubectl apply --validate=strict`` is: objects with declared properties refuse others.
- ServiceMonitor: no CRD here (prometheus-operator is not vendored), so only a structural check.
"""

from __future__ import annotations

import atexit
import copy
import functools
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "epd"
CRDS = Path(__file__).resolve().parent / "data" / "k8s-crds"
TEXT_MODEL_VALUES = Path(__file__).resolve().parent / "data" / "text-model.yaml"
# The oldest Kubernetes the chart claims (Chart.yaml kubeVersion) and the newest kubernetes-validate bundles.
K8S_VERSIONS = ("1.28.0", "1.37.0")
POOLS = ("encode", "prefill", "decode")
CORE_KINDS = {"Deployment", "Service", "Secret", "StatefulSet", "PodDisruptionBudget", "Ingress", "ConfigMap",
              "NetworkPolicy"}
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayService": "ray.io_rayservices.yaml"}


@functools.cache
def helm_binary() -> str:
    path = os.environ.get("HELM") or shutil.which("helm")
    if not path or not os.access(path, os.X_OK):
        pytest.fail("helm not found: set $HELM to a helm binary, or put helm on PATH "
                    "(`make test` installs it into .venv/bin with scripts/get-helm.sh)", pytrace=False)
    return path


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


# helm's cache/config/data homes: this process's own (two test workers run helm at once), removed at exit
_HELM_HOME = Path(tempfile.mkdtemp(prefix="epd-helm-"))
atexit.register(shutil.rmtree, _HELM_HOME, True)


def helm(*args: str, chart: Path = CHART, model: bool = True) -> Result:
    """Run helm with ``args`` (``{chart}`` in them is replaced by the chart path). ``model``: a template,
    lint or install gets ``-f data/text-model.yaml`` (settings.model) before the other flags, so they
    override it; the chart refuses to render without a model, unless the demo model's encode pool runs."""
    given = list(args)
    if model and given and given[0] in ("template", "lint", "install") and "{chart}" in given:
        at = given.index("{chart}") + 1
        given[at:at] = ["-f", str(TEXT_MODEL_VALUES)]
    argv = [helm_binary(), *(str(chart) if a == "{chart}" else a for a in given)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HELM_CACHE_HOME": str(_HELM_HOME / "cache"),
                               "HELM_CONFIG_HOME": str(_HELM_HOME / "config"),
                               "HELM_DATA_HOME": str(_HELM_HOME / "data")})
    return Result(proc.returncode, proc.stdout, proc.stderr)


def render(*args: str, chart: Path = CHART, release: str = "t") -> list[dict[str, Any]]:
    """``helm template`` -> the rendered objects; a refusal fails the test with helm's message."""
    r = helm("template", release, "{chart}", "--namespace", "epd", *args, chart=chart)
    if r.returncode != 0:
        pytest.fail(f"helm template {' '.join(args)} failed:\n{r.stderr}", pytrace=False)
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def refusal(*args: str, model: bool = True) -> str:
    """``helm template`` that must be refused; returns helm's message."""
    r = helm("template", "t", "{chart}", *args, model=model)
    assert r.returncode != 0, f"helm accepted {args}; it rendered:\n{r.stdout[:2000]}"
    return r.stderr


def find(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(hits) == 1, f"expected one {kind} named *{name_suffix}, got {[o['metadata']['name'] for o in hits]}"
    return hits[0]


def worker_groups(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    cluster = find(objects, "RayCluster")
    return {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """name -> value (or the valueFrom mapping); duplicate names are an error (the later would win silently)."""
    names = [e["name"] for e in container.get("env", [])]
    assert len(names) == len(set(names)), f"duplicate env names in {container['name']}: {names}"
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def group_env(objects: list[dict[str, Any]], pool: str) -> dict[str, Any]:
    return env_of(worker_groups(objects)[pool]["template"]["spec"]["containers"][0])


def control_plane_env(objects: list[dict[str, Any]]) -> dict[str, Any]:
    deploy = find(objects, "Deployment", "-controlplane")
    return env_of(deploy["spec"]["template"]["spec"]["containers"][0])


def replica_counts(objects: list[dict[str, Any]]) -> dict[str, int]:
    """The replicas file the chart mounts in the control plane's pod, as the pool manager reads it."""
    from controlplane.replicas_file import parse_replicas

    return parse_replicas(find(objects, "ConfigMap", "-replicas")["data"]["replicas.json"])


# ------------------------------------------------------------------ validation
def _strict(schema: Any) -> Any:
    """Close every object schema that lists properties (unless it preserves unknown fields)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(kind: str) -> jsonschema.protocols.Validator:
    doc = yaml.safe_load((CRDS / CRD_FILES[kind]).read_text())
    served = [v for v in doc["spec"]["versions"] if v["name"] == "v1"]
    assert served, f"{CRD_FILES[kind]} has no v1 version"
    schema = _strict(copy.deepcopy(served[0]["schema"]["openAPIV3Schema"]))
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked below, like the API server does
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def _check_meta(obj: dict[str, Any]) -> Iterator[str]:
    name = obj.get("metadata", {}).get("name", "")
    if not name or len(name) > 63 or not name.replace("-", "a").isalnum() or name != name.lower():
        yield f"metadata.name {name!r} is not a DNS-1123 label"
    for key, value in obj["metadata"].get("labels", {}).items():
        if not isinstance(value, str) or len(value) > 63:
            yield f"label {key}={value!r} is not a string of at most 63 characters"


def check_service_monitor(obj: dict[str, Any]) -> list[str]:
    """Structural only (no prometheus-operator CRD here): the fields Prometheus needs, with the right types."""
    errors = list(_check_meta(obj))
    spec = obj.get("spec", {})
    if obj.get("apiVersion") != "monitoring.coreos.com/v1":
        errors.append(f"apiVersion {obj.get('apiVersion')!r}")
    if not isinstance(spec.get("selector", {}).get("matchLabels"), dict) or not spec["selector"]["matchLabels"]:
        errors.append("spec.selector.matchLabels must be a non-empty mapping")
    endpoints = spec.get("endpoints")
    if not isinstance(endpoints, list) or not endpoints:
        errors.append("spec.endpoints must be a non-empty list")
    for ep in endpoints or []:
        unknown = set(ep) - {"port", "path", "interval", "scrapeTimeout", "scheme", "bearerTokenSecret",
                             "authorization"}
        if unknown or not isinstance(ep.get("port"), str) or not str(ep.get("path", "")).startswith("/"):
            errors.append(f"endpoint {ep} needs a named port and an absolute path (unknown: {sorted(unknown)})")
        auth = ep.get("authorization")
        if auth is not None and (auth.get("type") != "Bearer" or set(auth.get("credentials", {})) != {"name", "key"}
                                 or not all(isinstance(v, str) and v for v in auth["credentials"].values())):
            errors.append(f"endpoint authorization {auth} needs type Bearer and credentials {{name, key}} of a Secret")
    return errors


def validate_objects(objects: list[dict[str, Any]]) -> dict[str, int]:
    """Validate every object; returns a count per kind. Fails the test listing every error."""
    errors: list[str] = []
    counts: dict[str, int] = {}
    for obj in objects:
        kind = obj["kind"]
        counts[kind] = counts.get(kind, 0) + 1
        where = f"{kind}/{obj['metadata']['name']}"
        if kind in CORE_KINDS:
            for version in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    errors.append(f"{where} (k8s {version}): {exc.message} at {'.'.join(map(str, exc.path))}")
        elif kind in CRD_FILES:
            errors += [f"{where}: {e}" for e in _check_meta(obj)]
            for e in crd_validator(kind).iter_errors(obj):
                errors.append(f"{where}: {e.message} at {'.'.join(map(str, e.absolute_path))}")
        elif kind == "ServiceMonitor":
            errors += [f"{where}: {e}" for e in check_service_monitor(obj)]
        else:
            errors.append(f"{where}: no validator for kind {kind}")
    assert not errors, "invalid objects:\n" + "\n".join(errors)
    return counts


# ------------------------------------------------------------------ shared by the chart tests
CPU_VALUES = str(CHART / "values-cpu.yaml")
EXTERNAL_REDIS = ("--set", "redis.enabled=false", "--set", "redis.external.url=redis://redis.example:6379/2")

# every optional object on, and the user bringing every Secret
OPTIONAL = ("--set", "ingress.enabled=true", "--set", "ingress.className=nginx",
            "--set", "metrics.serviceMonitor.enabled=true", "--set", "autoscaling.enabled=true",
            "--set", "auth.mtls.secretName=epd-mtls",
            "--set-json", 'modelVolume.volume={"persistentVolumeClaim": {"claimName": "models", "readOnly": true}}',
            "--set", "settings.model=/models/llama", "--set", "auth.existingSecret=my-epd",
            "--set", "redis.auth.existingSecret=my-redis", "--set", "auth.rayToken.existingSecret=my-ray")


@functools.cache
def default_objects() -> tuple[dict[str, Any], ...]:
    return tuple(render())


def defaults() -> list[dict[str, Any]]:
    return copy.deepcopy(list(default_objects()))


def settings_from_env(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                      objects: list[dict[str, Any]] | None = None) -> Any:
    """Load the real settings model from a container's env, as `epd serve` in that pod would: plain values
    as rendered, secretKeyRefs replaced by stand-ins, $(VAR) references expanded like the kubelet does, and
    the replicas file (EPD_REPLICAS_FILE) written from the rendered ConfigMap in ``objects``."""
    if "EPD_REPLICAS_FILE" in env:
        assert objects is not None, "this env reads the replicas file: pass the rendered objects too"
        folder = tempfile.mkdtemp(prefix="epd-replicas-")
        atexit.register(shutil.rmtree, folder, True)
        path = Path(folder) / "replicas.json"
        path.write_text(find(objects, "ConfigMap", "-replicas")["data"]["replicas.json"])
        env = {**env, "EPD_REPLICAS_FILE": str(path)}
    stand_in = {"EPD_TRANSFER__TOKEN": "t" * 32, "EPD_API__ADMIN_TOKEN": "a" * 32,
                "EPD_API__API_KEYS": '["k-0123456789abcdef"]', "EPD_API__OPS_TOKEN": "o" * 32,
                "EPD_CHART_REDIS_PASSWORD": "pw"}
    for name in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(name)
    resolved: dict[str, str] = {}
    for name, value in env.items():
        if isinstance(value, dict):
            value = stand_in.get(name, "from-a-secret")
        resolved[name] = re.sub(r"\$\((\w+)\)", lambda m: resolved.get(m.group(1), m.group(0)), value)
        monkeypatch.setenv(name, resolved[name])
    from controlplane.settings import Settings

    return Settings.load()
