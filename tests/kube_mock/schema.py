"""What the API server does to a manifest before storing it: defaulting, and the validation
rules a real cluster refuses a backend's manifest for (names, labels, a Deployment's selector
against its template labels, immutable fields). A subset: the fields such manifests carry.
The defaults matter to a backend that compares its desired state with the stored one: the
stored one carries them, as on a real cluster.
"""

from __future__ import annotations

import itertools
import re

from tests.kube_mock.store import Kind, invalid, parse_selector, selector_matches

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def selector_string(selector: dict | None) -> str:
    """A LabelSelector as the API prints it (Scale.status.selector): requirements sorted by key."""
    selector = selector or {}
    terms = [(key, f"{key}={value}") for key, value in (selector.get("matchLabels") or {}).items()]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], ",".join(sorted(expr.get("values") or []))
        terms.append((key, {"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})",
                            "Exists": key, "DoesNotExist": f"!{key}"}[op]))
    return ",".join(text for _, text in sorted(terms))


def _default_pod_spec(spec: dict) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        image = container.get("image", "")
        tag = image.rsplit("/", 1)[-1].partition(":")[2] if "@" not in image else "digest"
        container.setdefault("imagePullPolicy", "Always" if tag in ("", "latest") else "IfNotPresent")
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        container.setdefault("resources", {})
        for port in container.get("ports") or []:
            port.setdefault("protocol", "TCP")


def default(kind: Kind, obj: dict, cluster_ips: itertools.count) -> None:
    spec = obj.setdefault("spec", {}) if kind.plural != "endpointslices" else {}
    if kind.plural == "deployments":
        spec.setdefault("replicas", 1)
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        strategy = spec.setdefault("strategy", {"type": "RollingUpdate"})
        if strategy.get("type", "RollingUpdate") == "RollingUpdate":
            strategy.setdefault("type", "RollingUpdate")
            strategy.setdefault("rollingUpdate", {}).setdefault("maxUnavailable", "25%")
            strategy["rollingUpdate"].setdefault("maxSurge", "25%")
        _default_pod_spec(spec.setdefault("template", {}).setdefault("spec", {}))
    elif kind.plural == "pods":
        _default_pod_spec(spec)
        obj.setdefault("status", {}).setdefault("phase", "Pending")
    elif kind.plural == "services":
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        if "clusterIP" not in spec:
            n = next(cluster_ips)
            spec["clusterIP"] = f"10.96.{n // 250}.{n % 250 + 1}"
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("internalTrafficPolicy", "Cluster")
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
    elif kind.plural == "endpointslices":
        for port in obj.get("ports") or []:
            port.setdefault("protocol", "TCP")


def validate(kind: Kind, obj: dict, old: dict | None) -> None:
    meta = obj["metadata"]
    name = meta["name"]
    name_re, limit = (_DNS_LABEL, 63) if kind.plural == "services" else (_DNS_SUBDOMAIN, 253)
    if not name_re.fullmatch(name) or len(name) > limit:
        raise invalid(kind, name, f'metadata.name: Invalid value: "{name}": a lowercase RFC 1123 name '
                      f"must consist of lower case alphanumeric characters or '-' (at most {limit})")
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if (prefix and not _DNS_SUBDOMAIN.fullmatch(prefix)) or not label or len(label) > 63 \
                or not _LABEL_VALUE.fullmatch(label):
            raise invalid(kind, name, f'metadata.labels: Invalid value: "{key}": name part must be valid')
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            raise invalid(kind, name, f'metadata.labels: Invalid value: "{value}": a valid label must be '
                          "an empty string or consist of alphanumeric characters, '-', '_' or '.' (at most 63)")
    if kind.plural == "deployments":
        spec = obj["spec"]
        replicas = spec.get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise invalid(kind, name, f"spec.replicas: Invalid value: {replicas}: must be greater than or equal to 0")
        selector = spec.get("selector")
        if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
            raise invalid(kind, name, "spec.selector: Required value")
        template_labels = (spec.get("template", {}).get("metadata") or {}).get("labels") or {}
        requirements = parse_selector(selector_string(selector))
        if not selector_matches(requirements, template_labels):
            raise invalid(kind, name, "spec.template.metadata.labels: Invalid value: "
                          f"{template_labels}: `selector` does not match template `labels`")
        if old is not None and old["spec"].get("selector") != selector:
            raise invalid(kind, name, f"spec.selector: Invalid value: {selector}: field is immutable")
    if kind.plural == "services" and old is not None:
        if old["spec"].get("clusterIP") != obj["spec"].get("clusterIP"):
            raise invalid(kind, name, "spec.clusterIP: Invalid value: field is immutable")
