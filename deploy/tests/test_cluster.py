"""Checks of the cluster deployments (docs/cluster.md "Running a cluster"): the kustomize
overlays cluster (etcd membership) and cluster-dns (no etcd) and the Helm values that mirror
them (values-cluster.yaml, values-cluster-dns.yaml).

Built-in kinds pass kubernetes-validate --strict; every pod (the daemons, etcd, Redis) meets
the restricted Pod Security Standard with resources, probes and fixed image tags; the
daemons' config names what the manifests create (etcd's members, Redis's Service, the
headless Service for dns membership, the events ports) and `kvcd check-config` accepts it;
etcd's bootstrap list names its own pods; the PodDisruptionBudgets and NetworkPolicies
select what they mean to; kustomize and Helm render the same objects. Run by
scripts/test-deploy.sh with deploy/tests/test_kubernetes.py, whose helpers it uses.
"""
import copy
import re
import subprocess

import helm_python as helm
import kubernetes_validate.utils as kv
import pytest
import yaml

from test_kubernetes import CHART, CRD_KINDS, K8S, K8S_VERSION, KVCD, helm_render, kustomize, \
    normalize, one

WORKLOAD_KINDS = ("StatefulSet", "Deployment")


def chart_values(name):
    return yaml.safe_load((CHART / name).read_text())


RENDERS = {
    "kustomize-cluster": lambda: kustomize(K8S / "overlays/cluster"),
    "kustomize-cluster-dns": lambda: kustomize(K8S / "overlays/cluster-dns"),
    "helm-cluster": lambda: helm_render(chart_values("values-cluster.yaml")),
    "helm-cluster-dns": lambda: helm_render(chart_values("values-cluster-dns.yaml")),
}
ALL = sorted(RENDERS)
_cache = {}


def render(name):
    if name not in _cache:
        _cache[name] = RENDERS[name]()
    return copy.deepcopy(_cache[name])


def named(docs, kind, name):
    return one(docs, kind, name)


def pods(docs):
    """(object, pod template spec) of every workload."""
    return [(d, d["spec"]["template"]["spec"]) for d in docs if d["kind"] in WORKLOAD_KINDS]


def labels_of(d):
    return d["spec"]["template"]["metadata"]["labels"]


def daemon_config(docs):
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "kvcd.yaml" in d.get("data", {}))
    return yaml.safe_load(cm["data"]["kvcd.yaml"])


def port_of(container, name):
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def service_port(svc, name):
    return next(p["port"] for p in svc["spec"]["ports"] if p["name"] == name)


@pytest.mark.parametrize("name", ALL)
def test_builtin_kinds_pass_strict_schema_validation(name):
    docs = render(name)
    kinds = {d["kind"] for d in docs}
    want = {"StatefulSet", "Deployment", "Service", "ConfigMap", "PodDisruptionBudget",
            "NetworkPolicy"}
    assert want <= kinds, want - kinds
    for d in docs:
        if d["kind"] not in CRD_KINDS:
            kv.validate(d, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", ALL)
def test_every_pod_is_restricted_with_resources_probes_and_fixed_images(name):
    docs = render(name)
    assert len(pods(docs)) == (3 if "dns" not in name else 2)
    for obj, spec in pods(docs):
        what = f'{obj["kind"]}/{obj["metadata"]["name"]}'
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, what
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", what
        assert spec["automountServiceAccountToken"] is False, what
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key), what
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"], what
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
            assert {"cpu", "memory"} <= c["resources"]["requests"].keys(), what
            assert "memory" in c["resources"]["limits"], what
            assert "readinessProbe" in c and "livenessProbe" in c, what
            repo, _, tag = c["image"].rpartition(":")
            assert repo and tag and tag != "latest" and "/" not in tag, c["image"]
        allowed = {"configMap", "emptyDir", "secret", "persistentVolumeClaim"}
        for v in spec.get("volumes", []):
            assert set(v) - {"name"} <= allowed, (what, v)


@pytest.mark.parametrize("name", ALL)
def test_the_daemons_are_a_statefulset_of_four_behind_a_headless_service(name):
    docs = render(name)
    sts = named(docs, "StatefulSet", "kvcd")
    assert sts["spec"]["replicas"] == 4
    headless = named(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # Only ready daemons are members by DNS, and are dialled by clients.
    assert headless["spec"]["publishNotReadyAddresses"] is False
    assert headless["spec"]["selector"].items() <= labels_of(sts).items()
    pdb = named(docs, "PodDisruptionBudget", "kvcd")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels_of(sts).items()
    # No Service, PDB or policy of the daemons selects the etcd or Redis pods, and back.
    for obj, _ in pods(docs):
        if obj is sts:
            continue
        other = labels_of(obj)
        assert not headless["spec"]["selector"].items() <= other.items()
        assert not pdb["spec"]["selector"]["matchLabels"].items() <= other.items()


@pytest.mark.parametrize("name", ALL)
def test_the_config_names_what_the_manifests_create(name):
    docs = render(name)
    cfg = daemon_config(docs)
    cl = cfg["cluster"]
    sts = named(docs, "StatefulSet", "kvcd")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    redis = named(docs, "Service", "kvcd-redis")
    assert cl["redis_url"] == f'redis://{redis["metadata"]["name"]}:{service_port(redis, "redis")}'
    deploy = named(docs, "Deployment", "kvcd-redis")
    assert redis["spec"]["selector"].items() <= labels_of(deploy).items()
    assert port_of(c, "events") == int(cl["events_endpoint"].rsplit(":", 1)[1])
    assert port_of(c, "events-replay") == int(cl["events_replay_endpoint"].rsplit(":", 1)[1])
    # The member id defaults to the hostname: the pod's name, kvcd-N.
    assert not cl.get("member_id")
    # The address peers dial: the daemon serves gRPC on the pod's IP (a wildcard listen
    # address names no host to advertise), on the port the Services target.
    assert f'--listen=$(POD_IP):{port_of(c, "grpc")}' in c["args"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    assert not cl.get("advertise_address")
    if "dns" in name:
        assert cl["membership"] == "dns" and "etcd_endpoints" not in cl
        assert cl["dns_name"] == sts["spec"]["serviceName"]
        assert not [d for d in docs if d["metadata"]["name"].startswith("kvcd-etcd")]
        return
    assert cl["membership"] == "etcd"
    etcd = named(docs, "StatefulSet", "kvcd-etcd")
    svc = named(docs, "Service", etcd["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    port = service_port(svc, "client")
    want = [f'kvcd-etcd-{i}.{svc["metadata"]["name"]}:{port}' for i in range(etcd["spec"]["replicas"])]
    assert cl["etcd_endpoints"] == want


@pytest.mark.parametrize("name", [n for n in ALL if "dns" not in n])
def test_etcd_bootstraps_from_its_own_pods_and_keeps_a_quorum(name):
    docs = render(name)
    etcd = named(docs, "StatefulSet", "kvcd-etcd")
    n, svc = etcd["spec"]["replicas"], etcd["spec"]["serviceName"]
    assert n == 3 and etcd["spec"]["podManagementPolicy"] == "Parallel"
    (c,) = etcd["spec"]["template"]["spec"]["containers"]
    args = dict(a[2:].split("=", 1) for a in c["args"])
    assert args["initial-cluster"] == ",".join(
        f"kvcd-etcd-{i}=http://kvcd-etcd-{i}.{svc}:2380" for i in range(n))
    assert args["name"] == "$(POD_NAME)" and args["initial-cluster-state"] == "new"
    assert c["env"] == [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    assert args["data-dir"] in {m["mountPath"] for m in c["volumeMounts"]}
    (claim,) = etcd["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    pdb = named(docs, "PodDisruptionBudget", "kvcd-etcd")
    assert pdb["spec"]["maxUnavailable"] == (n - 1) // 2
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels_of(etcd).items()
    probe_port = c["livenessProbe"]["httpGet"]["port"]
    assert probe_port == "metrics" and "serializable=true" in c["livenessProbe"]["httpGet"]["path"]


def ingress_from(np, port):
    """The `from` entries of the rules that admit `port`."""
    return [f for r in np["spec"]["ingress"] if {"port": port, "protocol": "TCP"} in r["ports"]
            for f in r["from"]]


@pytest.mark.parametrize("name", ALL)
def test_networkpolicies_admit_peers_workers_and_nothing_else(name):
    docs = render(name)
    kvcd_pods = {"app.kubernetes.io/name": "kvcd", "app.kubernetes.io/instance": "kvcd"}
    workers = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvcd-workers"}}}
    daemons = {"podSelector": {"matchLabels": kvcd_pods}}
    np = named(docs, "NetworkPolicy", "kvcd")
    assert daemons in ingress_from(np, "grpc") and workers in ingress_from(np, "grpc")
    assert ingress_from(np, "events") == [workers] == ingress_from(np, "events-replay")
    redis = named(docs, "NetworkPolicy", "kvcd-redis")
    assert redis["spec"]["policyTypes"] == ["Ingress"]
    assert ingress_from(redis, "redis") == [daemons, workers]
    assert len(redis["spec"]["ingress"]) == 1
    if "dns" in name:
        return
    etcd = named(docs, "NetworkPolicy", "kvcd-etcd")
    assert ingress_from(etcd, "client") == [daemons, workers]
    etcd_pods = labels_of(named(docs, "StatefulSet", "kvcd-etcd"))
    (peers,) = ingress_from(etcd, "peer")
    assert peers["podSelector"]["matchLabels"].items() <= etcd_pods.items()
    assert etcd["spec"]["podSelector"]["matchLabels"].items() <= etcd_pods.items()


@pytest.mark.parametrize("name", ALL)
def test_daemon_accepts_the_config(name, tmp_path):
    f = tmp_path / "kvcd.yaml"
    f.write_text(yaml.safe_dump(daemon_config(render(name))))
    r = subprocess.run([KVCD, "check-config", "--config", str(f), "--insecure"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "config OK" in r.stdout


@pytest.mark.parametrize("kust,hel", [("kustomize-cluster", "helm-cluster"),
                                      ("kustomize-cluster-dns", "helm-cluster-dns")])
def test_kustomize_and_helm_render_the_same_objects(kust, hel):
    a, b = normalize(render(kust)), normalize(render(hel))
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key] == b[key], key


def test_helm_etcd_members_follow_replicas():
    values = chart_values("values-cluster.yaml")
    values["etcd"]["replicas"] = 5
    docs = helm_render(values)
    etcd = named(docs, "StatefulSet", "kvcd-etcd")
    args = [a for a in etcd["spec"]["template"]["spec"]["containers"][0]["args"]
            if a.startswith("--initial-cluster=")]
    assert args == ["--initial-cluster=" + ",".join(
        f"kvcd-etcd-{i}=http://kvcd-etcd-{i}.kvcd-etcd:2380" for i in range(5))]
    assert named(docs, "PodDisruptionBudget", "kvcd-etcd")["spec"]["maxUnavailable"] == 2


def test_helm_without_a_cluster_adds_no_peer_rule_or_ports():
    docs = helm_render()
    np = named(docs, "NetworkPolicy", "kvcd")
    assert len(np["spec"]["ingress"]) == 2
    (c,) = named(docs, "StatefulSet", "kvcd")["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in c["ports"]] == ["grpc", "health", "metrics"]
    assert "env" not in c and not [a for a in c["args"] if a.startswith("--listen")]
    assert not [d for d in docs if re.match(r"kvcd-(etcd|redis)$", d["metadata"]["name"])]


BAD_VALUES = [
    ({"etcd": {"replicas": 2}}, "/etcd/replicas"),
    ({"etcd": {"image": {"repository": "gcr.io/etcd-development/etcd", "tag": "latest"}}},
     "/etcd/image/tag"),
    ({"etcd": {"enabled": "yes"}}, "/etcd/enabled"),
    ({"redis": {"maxmemory": "1 GiB"}}, "/redis/maxmemory"),
    ({"redis": {"persistence": True}}, "persistence"),
    ({"config": {"memory_budget": "1GiB", "drain_timeout_ms": 1000, "models": [{"builtin": "tiny"}],
                 "cluster": {"membership": "zookeeper"}}}, "/config/cluster/membership"),
]


@pytest.mark.parametrize("values,field", BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_bad_cluster_values_are_refused_naming_the_field(values, field):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError) as e:
            chart.render(values, name="kvcd", namespace="kvcd")
    assert field in str(e.value), str(e.value)
