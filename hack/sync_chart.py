#!/usr/bin/env python3
"""Make the Helm chart's CRDs and RBAC what the repository's crds/ and deploy/ say.

crds/ and deploy/ are the sources of truth (plain ``kubectl apply`` installs use them as they
are); the chart ships the same objects with release-specific names. Hand copies drift, so this
script writes them instead:

- ``crds/*.yaml`` are copied byte for byte to ``charts/offloadpool/files/crds/`` (the chart
  renders them from there, see templates/crds.yaml; stale copies are removed);
- ``deploy/rbac-operator.yaml`` and ``deploy/rbac-agent.yaml`` become
  ``templates/rbac-operator.yaml`` and ``templates/rbac-agent.yaml``: the same documents, rules
  and comments, with the names, the namespace and the labels of the release (Helm expressions),
  and the admission webhook's rule only when ``webhook.enabled``;
- ``deploy/policy-agent.yaml`` (the ValidatingAdmissionPolicy that holds each agent to its own
  node) becomes ``templates/policy-agent.yaml`` the same way, the agent ServiceAccount's user
  name made the release's, the whole file only when ``agent.nodeRestriction.enabled``;
- ``deploy/policy-operator.yaml`` (the policy that holds the operator to its own marks on Nodes
  and its own agent DaemonSets) becomes ``templates/policy-operator.yaml`` likewise, the agents'
  ServiceAccount it names made the release's, only when ``operator.writeRestriction.enabled``.

The agent's objects (its ServiceAccount, RBAC and policy) carry ``helm.sh/resource-policy: keep``:
``helm uninstall`` leaves them, so the agents of pools that outlive the release keep a token that
works (a pod's token is bound to its ServiceAccount's uid: delete the account and the agents
are refused with 401 until their pods are replaced) and stay held to their own nodes; a later
``helm install`` of the same release name and namespace adopts them (they still carry its
meta.helm.sh/release-name and release-namespace annotations).

``--check`` writes nothing and exits 1 naming every file that is not what it would write (the
test command runs it; tests/test_chart.py also renders the chart and compares the rules).

The conversion works on lines, not on parsed YAML, so the comments that explain each rule
survive into the chart. It knows the few shapes deploy/ uses (metadata name/namespace/labels,
roleRef, subjects, rules, a policy's policyName and block scalars, the ServiceAccount's user
name) and refuses anything else it would have to guess at, such as deploy/'s namespace left
anywhere else.

Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CRDS = REPO / "crds"
DEPLOY = REPO / "deploy"
CHART = REPO / "charts" / "offloadpool"
CHART_CRDS = CHART / "files" / "crds"
TEMPLATES = CHART / "templates"

#: the namespace deploy/ is written for; the chart installs into the release's namespace
DEPLOY_NAMESPACE = "offloadpool-system"
FULLNAME = '{{ include "offloadpool.fullname" . }}'
LABELS = '{{- include "offloadpool.labels" . | nindent 4 }}'
#: API groups whose rules the chart renders only when a value is set (the rule serves a feature
#: the chart can turn off)
CONDITIONAL_GROUPS = {"admissionregistration.k8s.io": ".Values.webhook.enabled"}


@dataclass(frozen=True)
class Component:
    """One deploy/rbac-*.yaml: whose it is and what its ServiceAccount is called in the chart."""

    app: str  # app.kubernetes.io/name, and the name of every object in deploy/
    source: Path
    target: Path
    service_account: str  # Helm expression for the ServiceAccount's name
    condition: str = ""  # a value the whole file is rendered under, if any
    keep: bool = False  # helm uninstall leaves its objects (helm.sh/resource-policy: keep)
    #: other exact strings of deploy/ and what the chart writes for them (the agents'
    #: ServiceAccount named in the operator's policy)
    replacements: tuple[tuple[str, str], ...] = ()

    def replaced(self, line: str) -> str:
        """``line`` with the ServiceAccount's user name and every replacement the chart's."""
        line = line.replace(self.user_name, self.chart_user_name)
        for plain, chart in self.replacements:
            line = line.replace(plain, chart)
        return line

    @property
    def user_name(self) -> str:
        """The ServiceAccount's user name in deploy/ (what a policy matches requests by)."""
        return f"system:serviceaccount:{DEPLOY_NAMESPACE}:{self.app}"

    @property
    def chart_user_name(self) -> str:
        return f"system:serviceaccount:{{{{ .Release.Namespace }}}}:{self.service_account}"

    @property
    def chart_name(self) -> str:
        """The name of the chart's objects for what deploy/ names ``app``."""
        return f"{FULLNAME}-{self.app.removeprefix('offloadpool-')}"


COMPONENTS = (
    Component(
        "offloadpool-operator",
        DEPLOY / "rbac-operator.yaml",
        TEMPLATES / "rbac-operator.yaml",
        '{{ include "offloadpool.operatorServiceAccount" . }}',
    ),
    Component(
        "offloadpool-agent",
        DEPLOY / "rbac-agent.yaml",
        TEMPLATES / "rbac-agent.yaml",
        "{{ .Values.agent.serviceAccountName }}",
        keep=True,
    ),
    Component(
        "offloadpool-agent",
        DEPLOY / "policy-agent.yaml",
        TEMPLATES / "policy-agent.yaml",
        "{{ .Values.agent.serviceAccountName }}",
        condition=".Values.agent.nodeRestriction.enabled",
        keep=True,
    ),
    Component(
        "offloadpool-operator",
        DEPLOY / "policy-operator.yaml",
        TEMPLATES / "policy-operator.yaml",
        '{{ include "offloadpool.operatorServiceAccount" . }}',
        condition=".Values.operator.writeRestriction.enabled",
        replacements=(
            (
                "serviceAccountName == 'offloadpool-agent'",
                "serviceAccountName == '{{ .Values.agent.serviceAccountName }}'",
            ),
            ("ServiceAccount offloadpool-agent,", "ServiceAccount {{ .Values.agent.serviceAccountName }},"),
        ),
    ),
)

_KEY = re.compile(r"^(?P<indent> *)(?P<dash>- )?(?P<key>[A-Za-z./-]+):(?: (?P<value>.*))?$")
#: a value continued on the lines below (a CEL expression written over several lines)
_BLOCK_SCALARS = {">", ">-", "|", "|-"}


class ShapeError(ValueError):
    """deploy/ has a line this script does not know how to carry into the chart."""


def rbac_template(component: Component, text: str) -> str:
    """The chart template for one deploy/ file (see the module docstring)."""
    out = [
        f"# Generated from deploy/{component.source.name} by hack/sync_chart.py: edit that file, then run",
        "# `python3 hack/sync_chart.py`. The chart renders the same rules (tests/test_chart.py).",
    ]
    if component.keep:
        out += [
            "# helm uninstall keeps these objects (helm.sh/resource-policy: keep): agents of pools",
            "# that outlive the release keep a working token and their policy; a reinstall of the",
            "# same release name and namespace adopts them (hack/sync_chart.py, docs/operator.md).",
        ]
    if component.condition:
        out.append(f"{{{{- if {component.condition} }}}}")
    lines = text.splitlines()
    start = 0
    while start < len(lines) and (lines[start].startswith("#") or not lines[start].strip()):
        start += 1  # deploy/'s own header comment describes plain manifests, not the chart
    kind = ""
    section = ""  # the top-level key the current line is under
    pending_comments: list[str] = []
    open_condition = ""  # the value an open {{ if }} around the current rule tests
    block_indent = -1  # the indent of the key whose block scalar the next lines may continue
    for number, line in enumerate(lines[start:], start + 1):
        where = f"{component.source.relative_to(REPO)}:{number}"
        if block_indent >= 0 and line.strip() and len(line) - len(line.lstrip()) > block_indent:
            out += pending_comments
            pending_comments = []
            out.append(_checked(component.replaced(line), where))
            continue
        block_indent = -1
        if line == "---":
            out += _close(open_condition) + pending_comments + [line]
            open_condition, pending_comments, kind, section = "", [], "", ""
            continue
        if not line.strip() or line.lstrip().startswith("#"):
            pending_comments.append(line)
            continue
        m = _KEY.match(line)
        if m is None:
            raise ShapeError(f"{where}: cannot read {line!r}")
        indent, key, value = len(m["indent"]), m["key"], m["value"]
        if indent == 0:
            section = key
            if key == "kind":
                kind = value or ""
        if section == "rules" and m["dash"] and indent == 2:  # a new rule starts
            condition = next(
                (v for g, v in CONDITIONAL_GROUPS.items() if key == "apiGroups" and g in (value or "")), ""
            )
            if condition != open_condition:
                out += _close(open_condition)
                if condition:
                    out.append(f"  {{{{- if {condition} }}}}")
                open_condition = condition
        elif indent == 0 and open_condition:
            out += _close(open_condition)
            open_condition = ""
        out += pending_comments
        pending_comments = []
        if component.keep and section == "metadata" and key == "labels" and indent == 2:
            out += ["  annotations:", "    helm.sh/resource-policy: keep"]
        out.append(_line(component, kind, section, line, key, value, where))
        if value in _BLOCK_SCALARS:
            block_indent = indent
    out += _close(open_condition) + pending_comments
    if component.condition:
        out.append("{{- end }}")
    return "\n".join(out) + "\n"


def _checked(line: str, where: str) -> str:
    """``line``, unless deploy/'s namespace is still in it (the chart's is the release's)."""
    if DEPLOY_NAMESPACE in line:
        raise ShapeError(f"{where}: {DEPLOY_NAMESPACE!r} where the chart has no equivalent: {line!r}")
    return line


def _close(condition: str) -> list[str]:
    return ["  {{- end }}"] if condition else []


def _line(
    component: Component, kind: str, section: str, line: str, key: str, value: str | None, where: str
) -> str:
    """One line of deploy/ as the chart writes it."""
    indent = line[: len(line) - len(line.lstrip())]
    if component.user_name in line:
        return _checked(component.replaced(line), where)
    if key == "namespace" and section in ("metadata", "subjects"):
        if value != DEPLOY_NAMESPACE:
            raise ShapeError(f"{where}: namespace {value!r}, expected {DEPLOY_NAMESPACE!r}")
        return line.replace(DEPLOY_NAMESPACE, "{{ .Release.Namespace }}")
    if key == "name" and section in ("metadata", "roleRef", "subjects"):
        if value != component.app:
            raise ShapeError(f"{where}: name {value!r}, expected {component.app!r}")
        account = (section == "metadata" and kind == "ServiceAccount") or section == "subjects"
        new = component.service_account if account else component.chart_name
        return line.replace(f"name: {value}", f"name: {new}")
    if key == "policyName":
        if value != component.app:
            raise ShapeError(f"{where}: policyName {value!r}, expected {component.app!r}")
        return line.replace(f"policyName: {value}", f"policyName: {component.chart_name}")
    if key == "app.kubernetes.io/part-of":
        return f"{indent}{LABELS}"
    if key.startswith("app.kubernetes.io/") and key != "app.kubernetes.io/name":
        raise ShapeError(f"{where}: label {key} has no chart equivalent")
    return _checked(line, where)


def expected_files() -> dict[Path, bytes]:
    """Every file the chart should have, with its content."""
    files = {CHART_CRDS / p.name: p.read_bytes() for p in sorted(CRDS.glob("*.yaml"))}
    if not files:
        raise ShapeError(f"no CRDs in {CRDS}")
    for component in COMPONENTS:
        files[component.target] = rbac_template(component, component.source.read_text()).encode()
    return files


def stale_files() -> list[Path]:
    """CRD copies in the chart whose source is gone."""
    sources = {p.name for p in CRDS.glob("*.yaml")}
    return [p for p in sorted(CHART_CRDS.glob("*.yaml")) if p.name not in sources]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the chart is out of date"
    )
    args = parser.parse_args(argv)
    try:
        files = expected_files()
    except ShapeError as exc:
        print(f"sync_chart: {exc}", file=sys.stderr)
        return 2
    differing = [p for p, content in files.items() if not p.is_file() or p.read_bytes() != content]
    stale = stale_files()
    if args.check:
        for p in differing:
            print(f"out of date: {p.relative_to(REPO)}", file=sys.stderr)
        for p in stale:
            print(f"not in crds/: {p.relative_to(REPO)}", file=sys.stderr)
        if differing or stale:
            print("run: python3 hack/sync_chart.py", file=sys.stderr)
            return 1
        return 0
    for p in differing:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(files[p])
        print(f"wrote {p.relative_to(REPO)}")
    for p in stale:
        p.unlink()
        print(f"removed {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
