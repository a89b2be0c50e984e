"""deploy/prometheus: every alert has a unit test that would notice if it stopped firing.

For each alert, a copy of the rules with that alert's expression replaced by one that never
fires must make `promtool test rules` fail; the unmodified rules must pass.
"""
import pathlib
import shutil
import subprocess

import pytest
import yaml

PROM = pathlib.Path(__file__).resolve().parents[2] / "deploy/prometheus"
RULES = yaml.safe_load((PROM / "kvcd-rules.yaml").read_text())
TESTS = yaml.safe_load((PROM / "kvcd-rules.test.yaml").read_text())
ALERTS = [r["alert"] for g in RULES["groups"] for r in g["rules"] if "alert" in r]


def promtool_test(directory):
    return subprocess.run(["promtool", "test", "rules", "kvcd-rules.test.yaml"], cwd=directory,
                          capture_output=True, text=True)


def test_rules_pass_their_unit_tests():
    r = promtool_test(PROM)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("alert", ALERTS)
def test_each_alert_has_a_firing_and_a_silent_case(alert):
    cases = [c for t in TESTS["tests"] for c in t.get("alert_rule_test", []) if c["alertname"] == alert]
    assert any(c.get("exp_alerts") for c in cases), f"{alert}: no test expects it to fire"
    assert any(not c.get("exp_alerts") for c in cases), f"{alert}: no test expects silence"


@pytest.mark.parametrize("alert", ALERTS)
def test_disabling_an_alert_fails_its_test(alert, tmp_path):
    rules = yaml.safe_load((PROM / "kvcd-rules.yaml").read_text())
    for g in rules["groups"]:
        for r in g["rules"]:
            if r.get("alert") == alert:
                r["expr"] = "vector(1) == 0"
    (tmp_path / "kvcd-rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    shutil.copy(PROM / "kvcd-rules.test.yaml", tmp_path)
    r = promtool_test(tmp_path)
    assert r.returncode != 0 and alert in r.stdout + r.stderr
