"""Values reach the right pods: a value set at install time shows up as the EPD_* variable the settings model
reads, in its own pool's pods and the control plane only, and loads into the real model; scaling one pool
changes only its worker group."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from controlplane.settings import Settings

from chart_tools import (
    CHART,
    CPU_VALUES,
    OPTIONAL,
    POOLS,
    control_plane_env,
    defaults,
    find,
    group_env,
    render,
    replica_counts,
    settings_from_env,
    worker_groups,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("pool", POOLS)
def test_a_set_value_reaches_only_its_pools_pods(pool: str, monkeypatch: pytest.MonkeyPatch) -> None:
    var = f"EPD_{pool.upper()}__ENGINE__KV_CACHE_BYTES"
    objs = render("--set", f"settings.{pool}.engine.kv_cache_bytes=1073741824",
                  "--set", f"settings.{pool}.engine.threads=3")
    for other in POOLS:
        env = group_env(objs, other)
        if other == pool:
            assert env[var] == "1073741824" and env[f"EPD_{pool.upper()}__ENGINE__THREADS"] == "3"
        else:
            assert not [n for n in env if n.startswith(f"EPD_{pool.upper()}__")], f"{pool}'s settings leak into {other}"
    cp = control_plane_env(objs)
    assert cp[var] == "1073741824"
    loaded = settings_from_env(cp, monkeypatch, objs)  # the control plane hands this to the pool's actors
    assert loaded.pool(pool).engine.kv_cache_bytes == 1073741824 and loaded.pool(pool).engine.threads == 3
    others = [p for p in POOLS if p != pool]
    assert all(loaded.pool(p).engine.threads is None for p in others)


def test_section_settings_reach_the_control_plane_and_no_worker_group(monkeypatch: pytest.MonkeyPatch) -> None:
    objs = render("--set", "settings.transfer.codec_policy=int4\\,0=bf16\\,-1=bf16",
                  "--set", "settings.scheduler.queue_size=17")
    cp = control_plane_env(objs)
    assert cp["EPD_TRANSFER__CODEC_POLICY"] == "int4,0=bf16,-1=bf16" and cp["EPD_SCHEDULER__QUEUE_SIZE"] == "17"
    for pool in POOLS:
        assert not [n for n in group_env(objs, pool) if n.startswith(("EPD_TRANSFER", "EPD_SCHEDULER"))]
    s = settings_from_env(cp, monkeypatch, objs)
    assert s.transfer.codec_policy == "int4,0=bf16,-1=bf16" and s.scheduler.queue_size == 17


def _leaves(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{'_' if prefix == 'EPD' else '__'}{key.upper()}"
        if isinstance(value, dict) and key in NESTED:
            out.update(_leaves(value, name))
        elif value is not None:
            out[name] = value
    return out


def _nested_models() -> set[str]:
    """Fields of Settings (and of its sections) that are themselves models: where env names nest."""
    found: set[str] = set()

    def walk(model: type[BaseModel]) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                found.add(name)
                walk(ann)
    walk(Settings)
    return found


NESTED = _nested_models()


def test_the_templates_nest_exactly_where_the_settings_model_does() -> None:
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    listed = re.search(r'\$nested := list ((?:"\w+" ?)+)', text)
    assert listed, "the $nested list is gone from _helpers.tpl"
    assert set(re.findall(r'"(\w+)"', listed.group(1))) == NESTED


@pytest.mark.parametrize("values_file", [None, CPU_VALUES], ids=["defaults", "cpu"])
def test_every_settings_leaf_becomes_its_env_var(values_file: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["settings"]
    if values_file:
        overlay = yaml.safe_load(Path(values_file).read_text())["settings"]
        values = _merge(values, overlay)
    objs = render("-f", values_file) if values_file else defaults()
    cp = control_plane_env(objs)
    expected = _leaves(values, "EPD")
    counts = {pool: expected.pop(f"EPD_{pool.upper()}__REPLICAS") for pool in POOLS}
    assert replica_counts(objs) == counts  # replica counts travel in the replicas file, not as variables
    assert not [n for n in cp if n.endswith("__REPLICAS")]
    for name, value in expected.items():
        rendered = cp.get(name)
        assert rendered is not None, f"{name} missing from the control plane"
        if name.endswith("__RAY_RESOURCES"):  # the chart adds the pool's own resource
            pool = name.split("__")[0].removeprefix("EPD_").lower()
            assert json.loads(rendered) == {**value, f"epd-{pool}": 1}
        elif isinstance(value, str):
            assert rendered == value, name
        else:  # numbers, booleans, lists and dicts travel as JSON
            assert json.loads(rendered) == value, name
    loaded = settings_from_env(cp, monkeypatch, objs)
    assert loaded.decode.engine.kv_cache_bytes == values["decode"]["engine"]["kv_cache_bytes"]
    assert loaded.transfer.codec_policy == values["transfer"]["codec_policy"]
    assert {pool: loaded.pool(pool).replicas for pool in POOLS} == counts


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_each_group_advertises_the_resource_its_pool_asks_for() -> None:
    objs = defaults()
    cp = control_plane_env(objs)
    groups = worker_groups(objs)
    assert set(groups) == set(POOLS)
    for pool, group in groups.items():
        advertised = json.loads(json.loads(group["rayStartParams"]["resources"]))  # KubeRay's quoted JSON
        assert advertised == {f"epd-{pool}": 1}
        assert json.loads(cp[f"EPD_{pool.upper()}__RAY_RESOURCES"]) == {f"epd-{pool}": 1}
    head = find(objs, "RayCluster")["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no replica ever lands on the head
    assert cp["EPD_RAY__ADDRESS"] == "ray://t-epd-head-svc.epd.svc:10001"
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports["client"] == 10001


@pytest.mark.parametrize("args", [(), ("--set-json", "settings.decode.num_gpus=0.5")])
def test_scaling_one_pool_changes_its_group_and_the_replicas_file_only(args: tuple[str, ...],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica count reaches the control plane through the replicas file, so a helm upgrade that changes only
    a count rolls no pod: the Deployment (env, probe, checksums) and every group's pod template stay as they
    were, replicas sharing a GPU included (their start budget follows maxReplicas)."""
    before, after = render(*args), render(*args, "--set", "settings.decode.replicas=3")
    g0, g1 = worker_groups(before), worker_groups(after)
    assert g1["decode"]["replicas"] == 3 and g0["decode"]["replicas"] == 1
    assert g1["decode"] == {**g0["decode"], "replicas": 3}
    for pool in ("encode", "prefill"):
        assert g1[pool] == g0[pool]
    assert replica_counts(before) == {"encode": 0, "prefill": 1, "decode": 1}
    assert replica_counts(after) == {"encode": 0, "prefill": 1, "decode": 3}
    assert find(after, "Deployment", "-controlplane") == find(before, "Deployment", "-controlplane")
    loaded = settings_from_env(control_plane_env(after), monkeypatch, after)  # epd serve in the pod reads the file
    assert (loaded.prefill.replicas, loaded.decode.replicas) == (1, 3)
    changed = {"RayCluster", "Secret", "ConfigMap"}  # Secrets: generated anew by each render
    assert [o for o in before if o["kind"] not in changed] == [o for o in after if o["kind"] not in changed]
    maps = [o["metadata"]["name"] for o, p in zip(before, after) if o["kind"] == "ConfigMap" and o != p]
    assert maps == ["t-epd-replicas"]


def test_pool_placement_values_reach_their_group_only() -> None:
    objs = render("--set", "pools.prefill.nodeSelector.gpu=h100", "--set", "pools.prefill.resources.limits.cpu=12",
                  "--set", "pools.prefill.minReplicas=0", "--set", "pools.prefill.maxReplicas=5")
    groups = worker_groups(objs)
    spec = groups["prefill"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpu": "h100"} and spec["containers"][0]["resources"]["limits"]["cpu"] == 12
    assert (groups["prefill"]["minReplicas"], groups["prefill"]["maxReplicas"]) == (0, 5)
    assert all("nodeSelector" not in groups[p]["template"]["spec"] for p in ("encode", "decode"))


def test_pdbs_select_their_groups_pods() -> None:
    objs = defaults()
    cluster = find(objs, "RayCluster")["metadata"]["name"]
    for pool in POOLS:
        pdb = find(objs, "PodDisruptionBudget", f"-{pool}")
        # the labels KubeRay puts on every worker pod of the group
        assert pdb["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": cluster, "ray.io/group": pool}
        assert pdb["spec"]["maxUnavailable"] == 1


def test_probes_and_service_point_at_the_api_port() -> None:
    objs = render("--set", "settings.api.port=9000", "--set", "metrics.serviceMonitor.enabled=true")
    c = find(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert c["ports"] == [{"name": "http", "containerPort": 9000}]
    assert control_plane_env(objs)["EPD_API__PORT"] == "9000"
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    svc = find(objs, "Service", "t-epd")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    monitor = find(objs, "ServiceMonitor")["spec"]
    assert monitor["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    assert monitor["endpoints"][0]["path"] == "/metrics"
    assert monitor["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


@pytest.mark.parametrize("args,starting", [
    ((), 2),
    (("--set", "settings.encode.replicas=1"), 3),
    (("--set", "settings.mode=colocated"), 1),
    (("--set", "settings.ray.replica_start_timeout_s=60"), 2),
    # replicas sharing a GPU start one after another, each within the timeout: 1 prefill + 4 decode
    (("--set-json", "settings.decode.num_gpus=0.5", "--set", "settings.decode.replicas=4"), 5),
])
def test_the_startup_probe_outlasts_the_first_start_of_every_pool(args: tuple[str, ...], starting: int) -> None:
    """`epd serve` opens the API after starting the pools one after another, each within the start timeout."""
    objs = render(*args)
    probe = find(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    timeout = float(control_plane_env(objs)["EPD_RAY__REPLICA_START_TIMEOUT_S"])
    assert probe["periodSeconds"] * probe["failureThreshold"] >= starting * timeout + 60
    assert probe["failureThreshold"] >= 90  # never below what values ask for
    longer = render(*args, "--set", "controlPlane.startupProbe.failureThreshold=1000")
    c = find(longer, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert c["startupProbe"]["failureThreshold"] == 1000


def test_colocated_runs_the_decode_group_only(monkeypatch: pytest.MonkeyPatch) -> None:
    objs = render("--set", "settings.mode=colocated")
    assert set(worker_groups(objs)) == {"decode"}
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "PodDisruptionBudget"] == ["t-epd-decode"]
    cp = control_plane_env(objs)
    assert not [n for n in cp if n.endswith("__REPLICAS")]  # counts come from the replicas file
    assert replica_counts(objs) == {"decode": 1}
    s = settings_from_env(cp, monkeypatch, objs)  # the model refuses encode/prefill replicas in colocated mode
    assert s.mode == "colocated" and s.decode.replicas == 1 and s.encode.replicas == 0


def test_mtls_and_model_volume_reach_every_epd_pod() -> None:
    objs = render(*OPTIONAL)
    cp = control_plane_env(objs)
    assert cp["EPD_TRANSFER__TLS_CA"] == "/etc/epd/tls/ca.crt" and cp["EPD_MODEL"] == "/models/llama"
    pods = [find(objs, "Deployment")["spec"]["template"]["spec"]]
    pods += [g["template"]["spec"] for g in worker_groups(objs).values()]
    for spec in pods:
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][-1]["volumeMounts"]}
        assert mounts["mtls"] == "/etc/epd/tls" and mounts["model"] == "/models"
    assert cp["EPD_API__ADMIN_TOKEN"] == {"secretKeyRef": {"name": "my-epd", "key": "admin-token"}}
    assert not [o for o in objs if o["kind"] == "Secret"]  # both Secrets are the user's


@pytest.mark.parametrize("paths, want", [
    ((), [("/", "Prefix")]),  # docs/kubernetes.md's flags: a host alone serves every path
    (("--set", "ingress.hosts[0].paths[0].path=/v1", "--set", "ingress.hosts[0].paths[0].pathType=Exact"),
     [("/v1", "Exact")]),
], ids=["host-only", "own-paths"])
def test_an_ingress_host_set_on_the_command_line_serves_its_paths(paths: tuple[str, ...], want: list) -> None:
    objs = render("--set", "ingress.enabled=true", "--set", "ingress.className=nginx",
                  "--set", "ingress.hosts[0].host=epd.example.com", *paths)
    (rule,) = find(objs, "Ingress")["spec"]["rules"]
    assert rule["host"] == "epd.example.com"
    assert [(p["path"], p["pathType"]) for p in rule["http"]["paths"]] == want
    assert {p["backend"]["service"]["port"]["name"] for p in rule["http"]["paths"]} == {"http"}
