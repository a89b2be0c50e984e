"""Checks of deploy/kubernetes (kustomize) and deploy/helm/kvcd (Helm) as rendered.

Renders with `kubectl kustomize` and helm-python-sdk (Helm's Go SDK, no cluster), validates
built-in kinds with kubernetes-validate --strict against the newest Kubernetes schemas it
ships, the PrometheusRule's rules with promtool, each ConfigMap's daemon config with
`kvcd check-config`, and asserts what the deployment promises: probes on the health port,
resources, the restricted Pod Security Standard, fixed image tags, a grace period that covers
preStop plus the drain, selectors that select, and that kustomize and Helm render the same
objects. Run by scripts/test-deploy.sh (needs KVCD_BIN: the daemon binary).
"""
import copy
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import helm_python as helm
import kubernetes_validate.utils as kv
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/kubernetes"
CHART = ROOT / "deploy/helm/kvcd"
KVCD = os.environ.get("KVCD_BIN", str(ROOT / "build/server/kvcd"))
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
K8S_VERSION = kv.latest_version()


def kustomize(path):
    out = subprocess.run(["kubectl", "kustomize", str(path)], check=True, capture_output=True,
                         text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def helm_render(values=None, operator=True):
    """Renders the chart; operator: as on a cluster with the Prometheus Operator's CRDs
    (helm-python-sdk renders with Helm's default capabilities, which have none of them)."""
    values = copy.deepcopy(values or {})
    if operator:
        values.setdefault("assumePrometheusOperator", True)
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="kvcd", namespace="kvcd")
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def cuda_values():
    return yaml.safe_load((CHART / "values-cuda.yaml").read_text())


def kustomize_tls():
    """overlays/cpu with the tls-auth component, as an operator would compose it."""
    with tempfile.TemporaryDirectory(dir=K8S) as d:
        pathlib.Path(d, "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            "resources: [../overlays/cpu]\ncomponents: [../components/tls-auth]\n")
        return kustomize(d)


RENDERS = {
    "kustomize-cpu": lambda: kustomize(K8S / "overlays/cpu"),
    "kustomize-cuda": lambda: kustomize(K8S / "overlays/cuda"),
    "kustomize-cpu-tls": kustomize_tls,
    "helm-default": lambda: helm_render(),
    "helm-cuda": lambda: helm_render(cuda_values()),
    "helm-tls": lambda: helm_render({"tls": {"enabled": True, "secretName": "kvcd-tls",
                                             "clientCA": True},
                                     "auth": {"enabled": True, "secretName": "kvcd-tokens"},
                                     "insecure": False}),
}
_cache = {}


def render(name):
    if name not in _cache:
        _cache[name] = RENDERS[name]()
    return copy.deepcopy(_cache[name])


def one(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def daemon_config(docs):
    cm = one(docs, "ConfigMap", None) if sum(d["kind"] == "ConfigMap" for d in docs) == 1 else \
        next(d for d in docs if d["kind"] == "ConfigMap" and "kvcd.yaml" in d.get("data", {}))
    return yaml.safe_load(cm["data"]["kvcd.yaml"])


def pod_spec(docs):
    return one(docs, "StatefulSet")["spec"]["template"]["spec"]


def container(docs):
    (c,) = pod_spec(docs)["containers"]
    return c


ALL = sorted(RENDERS)


@pytest.mark.parametrize("name", ALL)
def test_builtin_kinds_pass_strict_schema_validation(name):
    docs = render(name)
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy",
            "ServiceMonitor", "PrometheusRule", "ServiceAccount"} <= kinds
    for d in docs:
        if d["kind"] in CRD_KINDS:
            continue  # no schema in kubernetes-validate; checked below
        kv.validate(d, K8S_VERSION, strict=True)


def test_strict_validation_rejects_a_misspelt_field():
    sts = one(render("kustomize-cpu"), "StatefulSet")
    sts["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"grpc": {"port": 8081}}
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", ALL)
def test_prometheusrule_rules_pass_promtool(name, tmp_path):
    rule = one(render(name), "PrometheusRule")
    f = tmp_path / "rules.yaml"
    f.write_text(yaml.safe_dump(rule["spec"]))
    r = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sum(len(g["rules"]) for g in rule["spec"]["groups"]) >= 15


@pytest.mark.parametrize("name", ALL)
def test_servicemonitor_selects_the_api_service_and_its_metrics_port(name):
    docs = render(name)
    sm = one(docs, "ServiceMonitor")
    want = sm["spec"]["selector"]["matchLabels"]
    selected = [d for d in docs if d["kind"] == "Service"
                and want.items() <= d["metadata"].get("labels", {}).items()]
    assert len(selected) == 1, "the ServiceMonitor must select exactly one Service (no double scrapes)"
    ports = {p["name"] for p in selected[0]["spec"]["ports"]}
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"] and "metrics" in ports
    # The job label comes from this Service label; the rules expect job="kvcd".
    assert selected[0]["metadata"]["labels"][sm["spec"]["jobLabel"]] == "kvcd"


@pytest.mark.parametrize("name", ALL)
def test_selectors_select_the_daemon_pods(name):
    docs = render(name)
    sts = one(docs, "StatefulSet")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert svc["spec"]["selector"].items() <= pod_labels.items(), svc["metadata"]["name"]
    assert one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert one(docs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    headless = [d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"]
    assert [h["metadata"]["name"] for h in headless] == [sts["spec"]["serviceName"]]
    assert any(d["kind"] == "Service" and d["spec"].get("type") == "ClusterIP" for d in docs)


@pytest.mark.parametrize("name", ALL)
def test_probes_use_grpc_on_the_health_port(name):
    docs = render(name)
    c = container(docs)
    cfg = daemon_config(docs)
    health_port = int(cfg["health_listen"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["health"] == health_port
    assert ports["grpc"] == int(cfg["listen"].rsplit(":", 1)[1]) != health_port
    assert ports["metrics"] == int(cfg["metrics_listen"].rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": health_port}, probe


@pytest.mark.parametrize("name", ALL)
def test_grace_period_covers_prestop_and_drain(name):
    docs = render(name)
    spec = pod_spec(docs)
    cmd = container(docs)["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "/bin/sleep"
    drain_s = math.ceil(daemon_config(docs)["drain_timeout_ms"] / 1000)
    assert spec["terminationGracePeriodSeconds"] >= int(cmd[1]) + drain_s + 1


@pytest.mark.parametrize("name", ALL)
def test_resources_and_image(name):
    docs = render(name)
    c = container(docs)
    assert {"cpu", "memory"} <= c["resources"]["requests"].keys()
    assert "memory" in c["resources"]["limits"]
    repo, _, tag = c["image"].rpartition(":")
    assert repo and tag and tag != "latest" and "/" not in tag, c["image"]
    for d in docs:  # no object anywhere names an image without a fixed tag
        for m in re.finditer(r"image: *\"?([^\s\"]+)", yaml.safe_dump(d)):
            assert ":" in m.group(1) and not m.group(1).endswith(":latest"), m.group(1)


@pytest.mark.parametrize("name", ALL)
def test_restricted_pod_security_standard(name):
    docs = render(name)
    spec = pod_spec(docs)
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(key)
    assert spec["automountServiceAccountToken"] is False
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
        assert not sc.get("privileged") and sc.get("runAsUser", 1) != 0
        assert sc["readOnlyRootFilesystem"] is True
        assert not any("hostPort" in p for p in c["ports"])
    allowed = {"configMap", "emptyDir", "secret", "projected", "downwardAPI",
               "persistentVolumeClaim", "ephemeral", "csi"}
    for v in spec["volumes"]:
        assert set(v) - {"name"} <= allowed, v
    for ns in (d for d in docs if d["kind"] == "Namespace"):
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("name", ALL)
def test_networkpolicy_admits_only_workers_and_prometheus(name):
    np = one(render(name), "NetworkPolicy")
    assert np["spec"]["policyTypes"] == ["Ingress"]
    rules = np["spec"]["ingress"]
    assert len(rules) == 2
    grpc, metrics = rules
    assert grpc["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert grpc["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "kvcd-workers"}}}]
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    (src,) = metrics["from"]
    assert src["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    assert src["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}


@pytest.mark.parametrize("name", ALL)
def test_daemon_accepts_the_config(name, tmp_path):
    docs = render(name)
    cfg = daemon_config(docs)
    args = container(docs).get("args", [])
    if cfg.get("tls") or cfg.get("auth") or "--insecure" not in args:
        pytest.skip("tls/auth files are Secret mounts that exist only in the cluster; "
                    "the daemon's own tests check those keys (security_config_test)")
    if cfg["backend"] == "cuda":
        r = subprocess.run([KVCD, "--version"], capture_output=True, text=True)
        assert r.returncode == 0
    f = tmp_path / "kvcd.yaml"
    f.write_text(yaml.safe_dump(cfg))
    # The pod runs with --insecure while TLS is off (its listen address is 0.0.0.0).
    r = subprocess.run([KVCD, "check-config", "--config", str(f), "--insecure"],
                       capture_output=True, text=True)
    if r.returncode != 0 and cfg["backend"] == "cuda" and "cuda" in (r.stdout + r.stderr).lower():
        pytest.skip("this kvcd build has no CUDA backend: " + r.stderr.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "config OK" in r.stdout


def test_cuda_renders_ask_for_one_gpu_per_daemon():
    for name in ("kustomize-cuda", "helm-cuda"):
        docs = render(name)
        c = container(docs)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1, name
        cfg = daemon_config(docs)
        assert cfg["backend"] == "cuda" and cfg["cuda_device"] == 0, name
        assert c["image"].endswith("-cuda"), name
    for name in ("kustomize-cpu", "helm-default"):
        assert "nvidia.com/gpu" not in container(render(name))["resources"]["limits"]


def test_tls_renders_mount_secrets_and_drop_insecure():
    for name in ("kustomize-cpu-tls", "helm-tls"):
        docs = render(name)
        c = container(docs)
        assert "--insecure" not in c["args"], name
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert {"/etc/kvcd/tls", "/etc/kvcd/auth"} <= mounts.keys(), name
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod_spec(docs)["volumes"] if "secret" in v}
        assert set(secrets) == {"tls", "auth"}, name
    cfg = daemon_config(render("helm-tls"))
    assert cfg["tls"] == {"cert_file": "/etc/kvcd/tls/tls.crt", "key_file": "/etc/kvcd/tls/tls.key",
                          "client_ca_file": "/etc/kvcd/tls/ca.crt"}
    assert cfg["auth"] == {"tokens_file": "/etc/kvcd/auth/tokens"}
    assert "--insecure" in container(render("helm-default"))["args"]


HELM_ONLY_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/version"}


def normalize(docs):
    """Objects keyed by kind/name, minus what only one tool adds."""
    out = {}
    for d in docs:
        if d["kind"] == "Namespace":
            continue  # the overlays create it; Helm installs into an existing one (-n)
        md = d["metadata"]
        if d["kind"] == "ConfigMap":
            md["name"] = re.sub(r"-[a-z0-9]{10}$", "", md["name"])  # kustomize's hash suffix
            d["data"] = {k: yaml.safe_load(v) for k, v in d["data"].items()}
        for labels in (md.get("labels"), d.get("spec", {}).get("template", {}).get("metadata", {}).get("labels")):
            for k in HELM_ONLY_LABELS:
                (labels or {}).pop(k, None)
        tmpl = d.get("spec", {}).get("template", {})
        if tmpl:
            tmpl["metadata"].get("annotations", {}).pop("checksum/config", None)
            if not tmpl["metadata"].get("annotations"):
                tmpl["metadata"].pop("annotations", None)
            for v in tmpl["spec"].get("volumes", []):
                if "configMap" in v:
                    v["configMap"]["name"] = re.sub(r"-[a-z0-9]{10}$", "", v["configMap"]["name"])
        out[f'{d["kind"]}/{md["name"]}'] = d
    return out


@pytest.mark.parametrize("kust,hel", [("kustomize-cpu", "helm-default"),
                                      ("kustomize-cuda", "helm-cuda"),
                                      ("kustomize-cpu-tls", "helm-tls")])
def test_kustomize_and_helm_render_the_same_objects(kust, hel):
    a, b = normalize(render(kust)), normalize(render(hel))
    if kust == "kustomize-cpu-tls":  # the kustomize config is the operator's to extend
        for objs in (a, b):
            objs.pop("ConfigMap/kvcd-config")
            objs["StatefulSet/kvcd"]["spec"]["template"]["spec"]["volumes"] = sorted(
                objs["StatefulSet/kvcd"]["spec"]["template"]["spec"]["volumes"], key=lambda v: v["name"])
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key] == b[key], key


BAD_VALUES = [
    ({"image": {"repository": "kvcd", "tag": "latest"}}, "/image/tag"),
    ({"replicas": 0}, "/replicas"),
    ({"backend": "rocm"}, "/backend"),
    ({"config": {"memory_budget": "1GiB", "drain_timeout_ms": "10s", "models": [{"builtin": "tiny"}]}},
     "/config/drain_timeout_ms"),
    ({"config": {"memory_budget": "1GiB", "drain_timeout_ms": 1000,
                 "models": [{"builtin": "tiny", "memroy": "1MiB"}]}}, "memroy"),
    ({"config": {"memory_budget": "1GiB", "drain_timeout_ms": 1000, "listen": "0.0.0.0:1",
                 "models": [{"builtin": "tiny"}]}}, "listen"),
    ({"ports": {"grpc": 50051, "health": 70000, "metrics": 9464}}, "/ports/health"),
    ({"resources": {"requests": {"cpu": "2", "memory": "2Gi", "nvidia.com/gpu": 1},
                    "limits": {"memory": "2Gi"}}}, "nvidia.com/gpu"),
    ({"resources": {"requests": {"memory": None}}}, "/resources/requests"),  # null deletes
    ({"insecure": False}, "/insecure"),
    ({"tls": {"enabled": True}}, "/tls"),
    ({"auth": {"enabled": True, "secretName": ""}}, "/auth/secretName"),
    ({"networkPolicy": {"workersNamespace": "Workers_NS"}}, "/networkPolicy/workersNamespace"),
    ({"serviceMonitor": {"interval": "15 seconds"}}, "/serviceMonitor/interval"),
    ({"replica": 3}, "replica"),
]


@pytest.mark.parametrize("values,field", BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_bad_values_are_refused_naming_the_field(values, field):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError) as e:
            chart.render(values, name="kvcd", namespace="kvcd")
    assert field in str(e.value), str(e.value)


def test_helm_lint_strict_is_clean():
    for values in ({}, cuda_values()):
        report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{K8S_VERSION}.0")
        # Severity 1 is INFO (e.g. "icon is recommended"); --strict fails on 2+ (warnings).
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_generated_copies_are_in_sync():
    r = subprocess.run([sys.executable, str(ROOT / "deploy/tools/sync_generated.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_monitoring_objects_need_the_operator_crds():
    """Without monitoring.coreos.com/v1 in the cluster (Helm's default capabilities here) the
    ServiceMonitor and PrometheusRule are left out, so an install does not fail on a cluster
    without the Prometheus Operator; the NOTES say so."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render({}, name="kvcd", namespace="kvcd")
    kinds = {d["kind"] for path, text in manifests.items() if path.endswith(".yaml")
             for d in yaml.safe_load_all(text) if d}
    assert "StatefulSet" in kinds and not kinds & CRD_KINDS, kinds
    notes = next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))
    assert "no monitoring.coreos.com/v1" in notes
    assert CRD_KINDS <= {d["kind"] for d in helm_render({})}


def test_extra_volumes_mount_a_codec_file():
    docs = helm_render({
        "extraVolumes": [{"name": "codecs", "configMap": {"name": "kvcd-codecs"}}],
        "extraVolumeMounts": [{"name": "codecs", "mountPath": "/opt/kvcd/codecs", "readOnly": True}],
    })
    mounts = {m["mountPath"]: m["name"] for m in container(docs)["volumeMounts"]}
    assert mounts["/opt/kvcd/codecs"] == "codecs"
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert volumes["codecs"]["configMap"] == {"name": "kvcd-codecs"}
    kv.validate(one(docs, "StatefulSet"), K8S_VERSION, strict=True)
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError) as e:  # would hide the config or the Secrets
            chart.render({"extraVolumeMounts": [{"name": "x", "mountPath": "/etc/kvcd/tls"}]},
                         name="kvcd", namespace="kvcd")
    assert "/extraVolumeMounts/0/mountPath" in str(e.value), str(e.value)


# Keys the chart writes itself (ports, backend, tls, auth): deploy/tools/sync_generated.py.
sys.path.insert(0, str(ROOT / "deploy/tools"))
from sync_generated import without_chart_owned  # noqa: E402

# Every daemon config in the repository: the examples, the images', the overlays', the live
# test's and the config fuzzer's seeds.
EXAMPLE_CONFIGS = sorted(
    p for pattern in ("deploy/config/kvcd-*.yaml", "deploy/container/*.yaml",
                      "deploy/kubernetes/overlays/*/kvcd.yaml", "deploy/tests/live.yaml",
                      "tests/fuzz/corpus/config_fuzz/*.yaml")
    for p in ROOT.glob(pattern) if "tokens" not in p.name)


def check_config(cfg, tmp_path, name="kvcd.yaml"):
    f = tmp_path / name
    f.write_text(yaml.safe_dump(cfg))
    return subprocess.run([KVCD, "check-config", "--config", str(f), "--insecure"],
                          capture_output=True, text=True)


def as_chart_values(cfg):
    values = {"config": without_chart_owned(cfg)}
    if "backend" in cfg:
        values["backend"] = cfg["backend"]
    return values


def test_example_configs_are_found():
    names = {p.name for p in EXAMPLE_CONFIGS}
    assert {"kvcd-demo.yaml", "kvcd-secure.yaml", "kvcd-h200.yaml", "live.yaml",
            "full.yaml"} <= names, names


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_chart_accepts_every_config_the_daemon_accepts(path, tmp_path):
    """A config kvcd accepts renders through the chart (its schema, derived from the
    daemon's, refuses nothing the daemon takes), and the rendered config says the same and is
    accepted by kvcd in turn."""
    cfg = yaml.safe_load(path.read_text())
    local = {k: v for k, v in cfg.items() if k not in ("tls", "auth")}  # files exist in pods only
    local["backend"] = "cpu"  # what check-config can open here; the key itself is the chart's
    daemon = check_config(local, tmp_path)
    if daemon.returncode != 0:
        pytest.skip(f"kvcd refuses it, so the chart may too: {daemon.stderr.strip()}")
    docs = helm_render(as_chart_values(cfg))
    rendered = daemon_config(docs)
    for k, v in without_chart_owned(cfg).items():
        assert rendered[k] == v, k
    rendered = {k: v for k, v in rendered.items() if k not in ("tls", "auth")}
    rendered["backend"] = "cpu"
    r = check_config(rendered, tmp_path, "rendered.yaml")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("key", [["colour"], ["models", 0, "memroy"], ["quotas", "default", "max_pages"],
                                 ["lease", "maximum_ms"], ["quotas", "tenants", 0, "tennant"]])
def test_a_key_the_schema_lacks_fails_both(key, tmp_path):
    cfg = {"memory_budget": "1GiB", "drain_timeout_ms": 1000, "models": [{"builtin": "tiny"}],
           "quotas": {"default": {"max_sequences": 4}, "tenants": [{"tenant": "a"}]},
           "lease": {"default_ms": 1000}}
    node = cfg
    for part in key[:-1]:
        node = node[part]
    node[key[-1]] = 1
    r = check_config(cfg, tmp_path)
    assert r.returncode != 0 and f"unknown key '" in r.stderr and key[-1] in r.stderr, r.stderr
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError) as e:
            chart.render({"config": cfg}, name="kvcd", namespace="kvcd")
    assert key[-1] in str(e.value), str(e.value)


def test_session_and_channel_keys_are_accepted_by_the_chart():
    """The prefix-pin and decode-channel keys (issues 31 and 35) pass through the chart."""
    docs = helm_render({"config": {"memory_budget": "1GiB", "drain_timeout_ms": 1000,
                                   "models": [{"builtin": "tiny"}], "max_pin_ttl_ms": 60000,
                                   "quotas": {"default": {"max_pinned_prefix_pages": 10,
                                                          "max_decode_channels": 2}}}})
    assert daemon_config(docs)["quotas"]["default"]["max_decode_channels"] == 2
