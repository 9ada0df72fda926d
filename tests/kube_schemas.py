"""Validate Kubernetes objects against the API server's own OpenAPI schemas, offline.

The schemas are the ones kubernetes-validate ships (``kubernetes_validate/kubernetes-json-schema/
v<version>-local-strict``), generated from each Kubernetes release's OpenAPI document. The
*strict* variant forbids properties a kind does not define, so a misspelt or misplaced field
(``readOnlyRootFileSystem``, ``imagePullPolicy`` on the pod instead of its container) is an error
instead of being dropped by the API server without a word.

    >>> validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}, K8S_VERSIONS[-1])
    []
    >>> validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "dta": {}}, K8S_VERSIONS[-1])
    ["(root): Additional properties are not allowed ('dta' was unexpected)"]
"""

from __future__ import annotations

import functools
import re

import jsonschema
import referencing
from kubernetes_validate import utils as kv
from packaging.version import Version


def _shipped_versions() -> list[str]:
    """Versions with strict schemas, oldest first (``all_versions`` lists each twice: the
    ``-local`` and the ``-local-strict`` folders)."""
    return sorted(set(kv.all_versions()), key=Version)


#: The three most recent minor versions kubernetes-validate has schemas for, oldest first.
K8S_VERSIONS: tuple[str, ...] = tuple(_shipped_versions()[-3:])


@functools.lru_cache(maxsize=None)
def _definitions(version: str) -> referencing.Resource:
    return referencing.Resource.from_contents(
        kv.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version))


@functools.lru_cache(maxsize=None)
def _validator(version: str, kind: str, api_version: str) -> jsonschema.Draft202012Validator | None:
    # rbac.authorization.k8s.io/v1 -> rbac-v1, apps/v1 -> apps-v1, v1 -> v1 (kubernetes-validate's file names)
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = kv.schema_contents(
            f"kubernetes-json-schema/v{version}-local-strict/{kind.lower()}-{group_version}.json", version)
    except FileNotFoundError:
        return None
    registry = referencing.Registry().with_resources([("", referencing.Resource.from_contents(schema))])
    registry = _definitions(version) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(obj: dict, version: str) -> list[str]:
    """Every schema violation of ``obj`` for Kubernetes ``version`` ("1.37.0"), one line each
    with the path to the offending field; empty when the object is valid. Unknown fields are
    errors (strict schemas); so is a kind or apiVersion the release does not serve."""
    if version not in _shipped_versions():
        raise ValueError(f"no schemas for Kubernetes {version}; kubernetes-validate has {', '.join(_shipped_versions())}")
    if not isinstance(obj, dict) or not obj.get("kind") or not obj.get("apiVersion"):
        return ["(root): not a Kubernetes object (no kind or apiVersion)"]
    validator = _validator(version, obj["kind"], obj["apiVersion"])
    if validator is None:
        return [f"(root): Kubernetes {version} has no kind {obj['kind']} in {obj['apiVersion']}"]
    errors = sorted(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}" for e in errors]


__all__ = ["K8S_VERSIONS", "validate"]
