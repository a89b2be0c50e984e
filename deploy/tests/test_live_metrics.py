"""A real kvcd daemon on loopback, scraped by a real Prometheus (Debian's prometheus package)
while kvctl drives a small workload; then:
  - `promtool check metrics` accepts the daemon's /metrics;
  - every query of the Grafana dashboard (deploy/grafana) returns data, and the key ones
    non-zero values (hit ratio, pool bytes, INT2 bits per element, evictions, demotions,
    RPC and attention-kernel latency);
  - Prometheus loads deploy/prometheus/kvcd-rules.yaml and evaluates its recording rules;
  - SIGTERM drains the daemon and it exits 0.
Needs KVCD_BIN and KVCTL_BIN (scripts/test-deploy.sh sets them). KVCD_SCREENSHOT_DIR, when
set, receives the Prometheus graph page URL of the key queries (for render-queries.sh).
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
KVCD = os.environ.get("KVCD_BIN", str(ROOT / "build/server/kvcd"))
KVCTL = os.environ.get("KVCTL_BIN", str(ROOT / "build/client/kvctl"))
RATE_WINDOW = "20s"  # stands for Grafana's $__rate_interval at a 1 s scrape interval


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, fn, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def http_get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


class Stack:
    def __init__(self, tmp):
        self.tmp = tmp
        self.out = open(tmp / "kvcd.out", "w+")
        self.err = open(tmp / "kvcd.err", "w+")
        self.kvcd = subprocess.Popen([KVCD, "serve", "--config", str(ROOT / "deploy/tests/live.yaml")],
                                     stdout=self.out, stderr=self.err)

        def ready():
            assert self.kvcd.poll() is None, "kvcd exited: " + (tmp / "kvcd.err").read_text()
            line = (tmp / "kvcd.out").read_text()
            return line if line.startswith("kvcd ready") else None
        fields = dict(f.split("=", 1) for f in wait_for("kvcd ready", ready).split()[2:])
        self.grpc, self.metrics = fields["grpc"], fields["metrics"]
        self.prom_addr = f"127.0.0.1:{free_port()}"
        (tmp / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{ROOT / 'deploy/prometheus/kvcd-rules.yaml'}]\n"
            "scrape_configs:\n"
            f"  - job_name: kvcd\n    static_configs: [{{targets: ['{self.metrics}']}}]\n")
        self.prom_log = open(tmp / "prometheus.log", "w")
        self.prom = subprocess.Popen(
            ["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address={self.prom_addr}",
             "--web.console.templates=/dev/null", "--web.console.libraries=/dev/null"],
            stdout=self.prom_log, stderr=subprocess.STDOUT)
        self.t0 = time.time()

    def query(self, expr, start=None):
        params = {"query": expr, "start": start or self.t0, "end": time.time(), "step": "1"}
        body = json.loads(http_get(f"http://{self.prom_addr}/api/v1/query_range?"
                                   + urllib.parse.urlencode(params)))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def kvctl(self, *args):
        r = subprocess.run([KVCTL, "--target", self.grpc, *args], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, f"kvctl {' '.join(args)}: {r.stdout}{r.stderr}"
        return r.stdout

    def stop(self):
        self.prom.terminate()
        self.prom.wait(timeout=30)
        if self.kvcd.poll() is None:
            self.kvcd.terminate()
            self.kvcd.wait(timeout=30)


@pytest.fixture(scope="module")
def stack():
    with tempfile.TemporaryDirectory() as d:
        s = Stack(pathlib.Path(d))
        try:
            wait_for("Prometheus to scrape kvcd",
                     lambda: _up(s), timeout=60)
            # The workload: prompts that share a prefix (hits), more prompts than the
            # qwen3-8b pool holds (evictions), decodes (attention; INT2 demotion).
            s.kvctl("put", "--model", "qwen3-8b", "--synthetic", "256", "--seed", "1")
            s.kvctl("put", "--model", "qwen3-8b", "--synthetic", "320", "--seed", "1")
            assert "256 tokens" in s.kvctl("match", "--model", "qwen3-8b", "--synthetic", "256", "--seed", "1")
            for seed in range(2, 6):
                s.kvctl("put", "--model", "qwen3-8b", "--synthetic", "256", "--seed", str(seed))
            s.kvctl("decode", "--model", "qwen3-8b-int2", "--synthetic", "420", "--seed", "3", "--steps", "4")
            s.kvctl("decode", "--model", "tiny", "--synthetic", "40", "--seed", "4", "--steps", "8")
            # The quota panel needs a scrape while a sequence is open: decode again until
            # Prometheus has seen one (a loaded machine can let a whole decode fall between
            # two scrapes), at most 30 times.
            for seed in range(5, 35):
                if _seen_open_sequence(s):
                    break
                s.kvctl("decode", "--model", "tiny", "--synthetic", "40", "--seed", str(seed),
                        "--steps", "64")
            s.kvctl("health")
            s.kvctl("stats")
            # Two more scrapes after the last call, so every counter's last value is in.
            last_call = time.time()
            wait_for("two scrapes after the workload", lambda: _last_scrape(s) > last_call + 1)
            yield s
        finally:
            s.stop()


def _instant(s, expr):
    body = json.loads(http_get(f"http://{s.prom_addr}/api/v1/query?"
                               + urllib.parse.urlencode({"query": expr})))
    return body["data"]["result"] if body.get("status") == "success" else []


def _seen_open_sequence(s):
    return any(float(v[1]) > 0 for r in s.query("kvcd_tenant_open_sequences") for v in r["values"])


def _last_scrape(s):
    r = _instant(s, 'timestamp(up{job="kvcd"})')
    return max((float(x["value"][1]) for x in r), default=0.0)


def _up(s):
    try:
        r = json.loads(http_get(f"http://{s.prom_addr}/api/v1/query?query=up"))
    except OSError:
        return False
    return any(x["value"][1] == "1" for x in r["data"]["result"])


def test_promtool_accepts_the_daemon_metrics(stack):
    text = http_get(f"http://{stack.metrics}/metrics")
    assert "kvcd_history_bytes_per_element" in text and "_bits" not in text
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def dashboard_queries():
    r = subprocess.run([sys.executable, str(ROOT / "deploy/grafana/generate_dashboard.py"), "--queries"],
                       capture_output=True, text=True, check=True)
    items = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(items) >= 20
    return items


def concrete(expr):
    return (expr.replace("$__rate_interval", RATE_WINDOW).replace('=~"$instance"', '=~".*"')
            .replace('=~"$method"', '=~".*"'))


def test_every_dashboard_query_returns_data(stack):
    empty = []
    for item in dashboard_queries():
        if not stack.query(concrete(item["expr"])):
            empty.append(f'{item["panel"]}: {item["expr"]}')
    assert not empty, "queries without data:\n" + "\n".join(empty)


def peak(stack, expr):
    return max((float(v[1]) for s in stack.query(expr) for v in s["values"] if v[1] != "NaN"),
               default=0.0)


def test_key_queries_show_the_workload(stack):
    by_panel = {}
    for item in dashboard_queries():
        by_panel.setdefault(item["panel"], []).append(concrete(item["expr"]))
    assert 0 < peak(stack, by_panel["Prefix hit ratio"][0]) < 1
    assert peak(stack, by_panel["Tokens served from cache"][0]) > 0
    assert peak(stack, by_panel["Pool bytes by format and state"][0]) > 0
    assert peak(stack, by_panel["Evictions and inserts"][0]) > 0
    assert peak(stack, by_panel["Demotions"][0]) > 0
    assert peak(stack, by_panel["RPC p99 by method"][0]) > 0
    assert peak(stack, by_panel["Attention kernel p50 / p99"][1]) > 0
    bits = {s["metric"]["model"]: float(s["values"][-1][1])
            for s in stack.query(by_panel["History bits per element"][0])}
    assert bits == {"qwen3-8b": 16.0, "qwen3-8b-int2": 2.25, "tiny": 16.0}
    # live.yaml's default quotas, and the default tenant's pages under the workload.
    assert peak(stack, by_panel["Open sequences by tenant, against max_sequences"][1]) == 1000
    assert peak(stack, by_panel["Registered model bytes by tenant, against max_model_bytes"][1]) == 2**30
    assert peak(stack, by_panel["Pool pages held by tenant"][0]) > 0
    assert 0 < peak(stack, by_panel["Quota use by tenant"][0]) < 1
    heat = stack.query(by_panel["RPC latency: $method"][0])
    assert len({s["metric"]["le"] for s in heat}) > 5  # one series per histogram bucket
    if os.environ.get("KVCD_SCREENSHOT_DIR"):
        exprs = [by_panel[p][0] for p in ("Prefix hit ratio", "Pool bytes by format and state",
                                          "History bits per element", "RPC p99 by method",
                                          "Evictions and inserts", "Attention kernel p50 / p99")]
        params = {}
        for i, e in enumerate(exprs):
            params.update({f"g{i}.expr": e, f"g{i}.tab": "0", f"g{i}.range_input": "1m",
                           f"g{i}.stacked": "0", f"g{i}.show_exemplars": "0"})
        out = pathlib.Path(os.environ["KVCD_SCREENSHOT_DIR"])
        out.joinpath("url").write_text(f"http://{stack.prom_addr}/graph?" + urllib.parse.urlencode(params))
        # render-queries.sh takes the screenshot while this Prometheus still runs.
        deadline = time.monotonic() + 120
        while not out.joinpath("done").exists() and time.monotonic() < deadline:
            time.sleep(0.5)


def test_recording_rules_are_evaluated(stack):
    # The group's interval is 30 s: the first evaluation comes within that.
    wait_for("kvcd:pool_used_bytes:ratio",
             lambda: stack.query("kvcd:pool_used_bytes:ratio"), timeout=45)
    rules = json.loads(http_get(f"http://{stack.prom_addr}/api/v1/rules"))["data"]["groups"]
    assert {g["name"] for g in rules} == {"kvcd.recording", "kvcd.alerts"}
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules


def test_sigterm_drains_and_exits_zero(stack):
    stack.kvcd.terminate()
    assert stack.kvcd.wait(timeout=30) == 0
    assert "drained, exiting" in (stack.tmp / "kvcd.err").read_text()
