#!/usr/bin/env python3
"""Runs the chart's unit-test suites (deploy/helm/kvcd/tests/*.yaml) without a cluster.

The suites follow helm-unittest's layout, a subset of it that this runner implements (the
helm-unittest plugin itself cannot be installed here: it is fetched from GitHub). Each suite:

  suite: NAME
  templates: [templates/statefulset.yaml, ...]   # the documents the asserts look at
  tests:
    - it: WHAT IT CHECKS
      set: {values...}                            # merged over values.yaml by Helm
      documentIndex: 0                            # optional: one document of the templates
      asserts:
        - hasDocuments: {count: N}
        - equal: {path: spec.replicas, value: 3}
        - notEqual / exists / notExists: {path: ...}
        - contains: {path: LIST, content: ITEM}   # ITEM a subset of one element
        - matchRegex: {path: ..., pattern: RE}
        - isKind: {of: KIND}
        - failedTemplate: {errorMessage: TEXT}    # rendering (or the values schema) fails

Paths are dotted with [N] indexes, and keys with dots in brackets: metadata.labels[app.kubernetes.io/name].
Renders with helm-python-sdk (Helm's Go SDK). Exit 1 on any failure; prints
"N passed, M failed".
"""
import pathlib
import re
import sys

import helm_python as helm
import yaml

CHART = pathlib.Path(__file__).resolve().parents[2] / "deploy/helm/kvcd"


def get(doc, path):
    """(found, value) at path."""
    node = doc
    for part in re.findall(r"[^.\[\]]+|\[[^\]]+\]", path):
        key = part[1:-1] if part.startswith("[") else part
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                return False, None
            node = node[int(key)]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            return False, None
    return True, node


def subset(small, big):
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and subset(v, big[k]) for k, v in small.items())
    return small == big


def check(kind, spec, docs, error):
    """None when the assertion holds, else what went wrong."""
    if kind == "failedTemplate":
        if error is None:
            return "rendering succeeded"
        return None if spec.get("errorMessage", "") in error else f"error was: {error}"
    if error is not None:
        return f"rendering failed: {error}"
    if kind == "hasDocuments":
        return None if len(docs) == spec["count"] else f"{len(docs)} documents"
    if not docs:
        return "no document rendered"
    for doc in docs:
        if kind == "isKind":
            bad = doc.get("kind") != spec["of"] and f"kind {doc.get('kind')}"
        else:
            found, value = get(doc, spec["path"])
            if kind == "exists":
                bad = not found and "missing"
            elif kind == "notExists":
                bad = found and f"present: {value!r}"
            elif kind == "equal":
                bad = (not found or value != spec["value"]) and f"is {value!r}"
            elif kind == "notEqual":
                bad = found and value == spec["value"] and f"is {value!r}"
            elif kind == "contains":
                bad = (not isinstance(value, list) or not any(subset(spec["content"], v) for v in value)
                       ) and f"is {value!r}"
            elif kind == "matchRegex":
                bad = (not isinstance(value, str) or not re.search(spec["pattern"], value)) and f"is {value!r}"
            else:
                return f"unknown assertion {kind}"
        if bad:
            return f'{doc.get("kind")}/{doc.get("metadata", {}).get("name")}: {spec.get("path", "")} {bad}'
    return None


def render(chart, templates, values):
    try:
        manifests = chart.render(values, name="kvcd", namespace="kvcd")
    except (helm.HelmValuesError, helm.HelmRenderError) as e:
        return [], str(e)
    docs = []
    for t in templates:
        text = manifests.get(f"kvcd/{t}", "")
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs, None


def main():
    passed = failed = 0
    with helm.Chart.load(str(CHART)) as chart:
        for path in sorted((CHART / "tests").glob("*.yaml")):
            suite = yaml.safe_load(path.read_text())
            for test in suite["tests"]:
                docs, error = render(chart, suite["templates"], test.get("set") or {})
                if "documentIndex" in test and error is None:
                    docs = docs[test["documentIndex"]:test["documentIndex"] + 1]
                problems = []
                for a in test["asserts"]:
                    ((kind, spec),) = a.items()
                    why = check(kind, spec or {}, docs, error)
                    if why:
                        problems.append(f"{kind}: {why}")
                name = f'{suite["suite"]}: {test["it"]}'
                if problems:
                    failed += 1
                    print(f"FAIL {name}\n  " + "\n  ".join(problems))
                else:
                    passed += 1
                    print(f"ok   {name}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main())
