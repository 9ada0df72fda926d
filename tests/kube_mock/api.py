"""The API server's verbs with the semantics the backend depends on, on top of the store.

Everything that writes, the HTTP clients and the emulated controllers alike, comes through
here, so the same rules hold for all: optimistic concurrency on resourceVersion (409),
``generation`` bumped only by changes outside metadata/status, status written only through
the status subresource, no-op writes not bumping the revision, defaulting and the
validation rules a real cluster would refuse a manifest for, graceful deletion of pods,
finalizers (``foregroundDeletion`` included), and server-side apply field ownership.

Server-side apply, simplified but with the parts that bite: each manager's applied fields
are recorded in ``metadata.managedFields`` (FieldsV1, lists are atomic leaves); a field a
manager applied before and omits now is removed unless another manager owns it (so a
dropped ``spec.replicas`` falls back to the default 1, as on a real cluster); a non-apply
write (patch, replace, the scale subresource) takes ownership of the fields it changes; an
apply that changes a field another manager owns is a 409 Conflict unless ``force=true``.
Not modelled: associative lists (``containers`` merged by name): a list is replaced whole;
strategic-merge patches behave as JSON merge patches (no ``$patch`` directives).
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import random
import uuid
from typing import Any

import jsonpatch
import kmock
import yaml

from tests.kube_mock.schema import default, selector_string, validate
from tests.kube_mock.store import (Kind, Store, already_exists, api_error, bad_request, conflict,
                                   field_selector_matches, invalid, not_found, parse_field_selector,
                                   parse_selector, selector_matches)

APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"

# metadata the server owns; never part of anybody's managed fields
_SYSTEM_META = {"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                "managedFields", "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink", "generateName"}
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the apiserver's generateName alphabet


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def random_suffix(rng: random.Random) -> str:
    return "".join(rng.choice(_NAME_CHARS) for _ in range(5))


# --- field paths (for managedFields)

Path = tuple[str, ...]


def leaves(obj: dict, prefix: Path = ()) -> dict[Path, Any]:
    """The leaf fields of an object: paths to scalars, lists (atomic) and empty maps."""
    result: dict[Path, Any] = {}
    for key, value in obj.items():
        if (not prefix and key in ("apiVersion", "kind")) or (prefix == ("metadata",) and key in _SYSTEM_META):
            continue
        if isinstance(value, dict) and value:
            result.update(leaves(value, prefix + (key,)))
        else:
            result[prefix + (key,)] = value
    return result


def _to_fields_v1(paths: set[Path]) -> dict:
    root: dict = {}
    for path in sorted(paths):
        node = root
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return root


def _from_fields_v1(fields: dict, prefix: Path = ()) -> set[Path]:
    paths: set[Path] = set()
    for key, sub in fields.items():
        path = prefix + (key[2:],)
        paths |= _from_fields_v1(sub, path) if sub else {path}
    return paths


def _delete_path(obj: dict, path: Path) -> None:
    """Remove a field and the maps it leaves empty."""
    parents = [obj]
    for key in path[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):
        if not parents[depth]:
            parents[depth - 1].pop(path[depth - 1], None)


def _managers(obj: dict | None) -> list[dict]:
    return copy.deepcopy((obj or {}).get("metadata", {}).get("managedFields") or [])


def _entry(entries: list[dict], manager: str, operation: str, subresource: str | None, api_version: str) -> dict:
    for entry in entries:
        if (entry["manager"], entry["operation"], entry.get("subresource")) == (manager, operation, subresource):
            return entry
    entry = {"manager": manager, "operation": operation, "apiVersion": api_version, "time": now(),
             "fieldsType": "FieldsV1", "fieldsV1": {}}
    if subresource:
        entry["subresource"] = subresource
    entries.append(entry)
    return entry


def _set_fields(entry: dict, paths: set[Path]) -> None:
    if _from_fields_v1(entry["fieldsV1"]) != paths:
        entry["fieldsV1"] = _to_fields_v1(paths)
        entry["time"] = now()


def _without_volatile(obj: dict) -> dict:
    """The object minus what a no-op write may change (revision, managedFields times)."""
    obj = copy.deepcopy(obj)
    obj["metadata"].pop("resourceVersion", None)
    for entry in obj["metadata"].get("managedFields") or []:
        entry.pop("time", None)
    return obj


def _spec_part(obj: dict) -> dict:
    return {key: value for key, value in obj.items() if key not in ("metadata", "status", "apiVersion", "kind")}


class Api:
    """The API verbs. Raise ``kmock.KubernetesError`` (a Status) the way the real server answers."""

    def __init__(self, store: Store, seed: int = 0) -> None:
        self.store = store
        self.rng = random.Random(seed)
        self._cluster_ips = itertools.count(1)

    # --- reads

    def read(self, kind: Kind, ns: str, name: str) -> dict:
        obj = self.store.get(kind, ns, name)
        if obj is None:
            raise not_found(kind, name)
        return obj

    def list(self, kind: Kind, ns: str | None, label_selector: str | None = None,
             field_selector: str | None = None) -> dict:
        try:
            labels, fields = parse_selector(label_selector), parse_field_selector(field_selector)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        objs, rv = self.store.list(kind, ns)
        items = []
        for obj in objs:
            if selector_matches(labels, obj["metadata"].get("labels")) and field_selector_matches(fields, obj):
                obj.pop("apiVersion", None)  # list items come without their TypeMeta, as from the API
                obj.pop("kind", None)
                items.append(obj)
        return {"kind": f"{kind.kind}List", "apiVersion": kind.api_version,
                "metadata": {"resourceVersion": str(rv)}, "items": items}

    # --- writes

    def create(self, kind: Kind, ns: str, body: dict, *, manager: str) -> dict:
        if not isinstance(body, dict):
            raise bad_request("the body of the request was not a JSON object")
        body = copy.deepcopy(body)
        meta = body.setdefault("metadata", {})
        if meta.get("namespace") not in (None, ns):
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        with self.store.lock:
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise invalid(kind, "", "metadata.name: Required value: name or generateName is required")
                meta["name"] = meta["generateName"] + random_suffix(self.rng)
            if self.store.get(kind, ns, meta["name"]) is not None:
                raise already_exists(kind, meta["name"])
            meta["namespace"] = ns
            meta.pop("resourceVersion", None)
            managed = self._take_ownership(kind, None, body, manager, None)
            return self._commit(kind, None, body, managed)

    def replace(self, kind: Kind, ns: str, name: str, body: dict, *, manager: str,
                subresource: str | None = None) -> dict:
        if not isinstance(body, dict):
            raise bad_request("the body of the request was not a JSON object")
        body = copy.deepcopy(body)
        meta = body.setdefault("metadata", {})
        if meta.get("name") not in (None, name):
            raise bad_request(f"the name of the object ({meta['name']}) does not match the name on the URL ({name})")
        with self.store.lock:
            old = self.read(kind, ns, name)
            rv = meta.get("resourceVersion")
            if rv and rv != old["metadata"]["resourceVersion"]:
                raise conflict(kind, name)
            return self._update(kind, old, body, manager, subresource)

    def patch(self, kind: Kind, ns: str, name: str, raw: bytes, content_type: str, *, manager: str | None,
              force: bool, user_agent: str = "", subresource: str | None = None) -> tuple[dict, bool]:
        """Apply a patch of any of the four content types; returns (object, created)."""
        content_type = content_type.split(";")[0].strip().lower()
        if content_type == APPLY:
            try:
                body = yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                raise bad_request(f"error decoding YAML: {exc}") from None
            return self.apply(kind, ns, name, body, manager=manager, force=force, subresource=subresource)
        if content_type not in (MERGE, STRATEGIC, JSON_PATCH):
            raise api_error(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                            f"accepted media types include: {JSON_PATCH}, {MERGE}, {APPLY}, {STRATEGIC}")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise bad_request(f"error decoding patch: {exc}") from None
        if not isinstance(body, list if content_type == JSON_PATCH else dict):
            raise bad_request(f"the body of a {content_type} request has the wrong shape")
        manager = manager or default_manager(user_agent)
        with self.store.lock:
            old = self.read(kind, ns, name)
            target = scale_of(old) if subresource == "scale" else old
            patched = _patch(target, body)
            if (patched.get("metadata") or {}).get("resourceVersion") != target["metadata"]["resourceVersion"]:
                raise conflict(kind, name)  # a patch naming a resourceVersion is a precondition on it
            if subresource == "scale":
                return self._scale_to(kind, old, patched, manager), False
            return self._update(kind, old, patched, manager, subresource), False

    def apply(self, kind: Kind, ns: str, name: str, body: Any, *, manager: str | None, force: bool,
              subresource: str | None = None) -> tuple[dict, bool]:
        if not manager:
            raise api_error(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: '
                            "Required value: is required for apply patch")
        if not isinstance(body, dict):
            raise bad_request("the body of an apply patch must be an object")
        if subresource == "scale":  # SSA on /scale: spec.replicas only
            with self.store.lock:
                old = self.read(kind, ns, name)
                return self._scale_to(kind, old, _patch(scale_of(old), body), manager), False
        if body.get("apiVersion") != kind.api_version or body.get("kind") != kind.kind:
            raise bad_request(f"the API version/kind in the data ({body.get('apiVersion')}, {body.get('kind')}) "
                              f"does not match the expected ({kind.api_version}, {kind.kind})")
        meta = body.setdefault("metadata", {})
        if meta.get("name") not in (None, name) or meta.get("namespace") not in (None, ns):
            raise bad_request(f"the name/namespace of the object does not match the URL ({ns}/{name})")
        body = copy.deepcopy(body)
        with self.store.lock:
            old = self.store.get(kind, ns, name)
            rv = meta.get("resourceVersion")
            if rv and (old is None or rv != old["metadata"]["resourceVersion"]):
                raise conflict(kind, name)
            entries = _managers(old)
            mine = _entry(entries, manager, "Apply", None, kind.api_version)
            mine_before = _from_fields_v1(mine["fieldsV1"])
            applied = leaves(body)
            current = leaves(old) if old is not None else {}
            conflicts = []
            for entry in entries:
                if entry is mine:
                    continue
                owned = _from_fields_v1(entry["fieldsV1"])
                clashing = {p for p in owned & applied.keys() if p in current and current[p] != applied[p]}
                if clashing and not force:
                    conflicts += [f'conflict with "{entry["manager"]}": .{".".join(p)}' for p in sorted(clashing)]
                _set_fields(entry, owned - clashing)
            if conflicts:
                raise api_error(409, "Conflict", f"Apply failed with {len(conflicts)} conflict(s): "
                                + "; ".join(conflicts), kind, name)
            others = set().union(*(_from_fields_v1(e["fieldsV1"]) for e in entries if e is not mine))
            base = copy.deepcopy(old) if old is not None else {"metadata": {"name": name, "namespace": ns}}
            for path in mine_before - applied.keys() - others:
                _delete_path(base, path)  # what this manager applied before and no longer does
            if kind.status_subresource:
                body.pop("status", None)
            new = _patch(base, body)
            _set_fields(mine, set(applied))
            entries = [e for e in entries if e["fieldsV1"]]
            if kind.status_subresource and old is not None:
                new["status"] = copy.deepcopy(old.get("status"))
                if new["status"] is None:
                    del new["status"]
            return self._commit(kind, old, new, entries), old is None

    def delete(self, kind: Kind, ns: str, name: str, *, propagation: str | None = None,
               grace: int | None = None) -> dict:
        """Delete as the API does: the object while it lingers (grace, finalizers), else a Status."""
        if propagation not in (None, "Foreground", "Background", "Orphan"):
            raise bad_request(f"unsupported propagationPolicy {propagation!r}")
        with self.store.lock:
            old = self.read(kind, ns, name)
            meta = old["metadata"]
            if meta.get("deletionTimestamp"):
                if kind.plural == "pods" and grace == 0 and not meta.get("finalizers"):
                    return self._removed(kind, self.store.remove(kind, ns, name))
                return old  # already being deleted
            if propagation == "Orphan":
                for dep_kind, dep in self.dependents(meta["uid"]):
                    refs = [r for r in dep["metadata"]["ownerReferences"] if r.get("uid") != meta["uid"]]
                    dep["metadata"]["ownerReferences"] = refs
                    self._update(dep_kind, self.read(dep_kind, dep["metadata"]["namespace"],
                                                     dep["metadata"]["name"]), dep, "garbage-collector", None)
            finalizers = list(meta.get("finalizers") or [])
            if propagation == "Foreground" and "foregroundDeletion" not in finalizers:
                finalizers.append("foregroundDeletion")
            period = 0
            if kind.plural == "pods" and (old.get("spec") or {}).get("nodeName"):
                period = grace if grace is not None else old["spec"].get("terminationGracePeriodSeconds", 30)
            if not finalizers and not period:
                return self._removed(kind, self.store.remove(kind, ns, name))
            new = copy.deepcopy(old)
            new["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=period)
            if finalizers:
                new["metadata"]["finalizers"] = finalizers
            return self.store.write(kind, new)

    def finish_deletion(self, kind: Kind, ns: str, name: str) -> None:
        """The last step of a graceful deletion (the kubelet's delete with grace 0)."""
        with self.store.lock:
            obj = self.store.get(kind, ns, name)
            if obj is not None and obj["metadata"].get("deletionTimestamp"):
                if obj["metadata"].get("finalizers"):
                    obj["metadata"]["deletionGracePeriodSeconds"] = 0
                    self.store.write(kind, obj)
                else:
                    self.store.remove(kind, ns, name)

    def update_status(self, kind: Kind, ns: str, name: str, status: dict, *, manager: str) -> dict:
        with self.store.lock:
            old = self.read(kind, ns, name)
            return self._update(kind, old, dict(old, status=status), manager, "status")

    def dependents(self, owner_uid: str) -> list[tuple[Kind, dict]]:
        return [(kind, obj) for kind, obj in self.store.all_objects()
                if any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or [])]

    # --- the scale subresource (autoscaling/v1 Scale)

    def read_scale(self, kind: Kind, ns: str, name: str) -> dict:
        return scale_of(self.read(kind, ns, name))

    def replace_scale(self, kind: Kind, ns: str, name: str, body: dict, *, manager: str) -> dict:
        with self.store.lock:
            old = self.read(kind, ns, name)
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if rv and rv != old["metadata"]["resourceVersion"]:
                raise conflict(kind, name)
            return self._scale_to(kind, old, body, manager)

    def _scale_to(self, kind: Kind, old: dict, scale: dict, manager: str) -> dict:
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise invalid(kind, old["metadata"]["name"],
                          f"spec.replicas: Invalid value: {replicas}: must be greater than or equal to 0")
        new = copy.deepcopy(old)
        new["spec"]["replicas"] = replicas
        return scale_of(self._update(kind, old, new, manager, "scale"))

    # --- internals

    def _update(self, kind: Kind, old: dict, new: dict, manager: str, subresource: str | None) -> dict:
        new = copy.deepcopy(new)
        if kind.status_subresource and subresource == "status":
            new = dict(copy.deepcopy(old), status=new.get("status"))  # the status subresource writes status only
        elif kind.status_subresource:
            new.pop("status", None)  # the main resource ignores status
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
        managed = self._take_ownership(kind, old, new, manager, subresource)
        return self._commit(kind, old, new, managed)

    def _take_ownership(self, kind: Kind, old: dict | None, new: dict, manager: str,
                        subresource: str | None) -> list[dict]:
        """A non-apply write owns the fields it changed; other managers lose them."""
        entries = _managers(old)
        before, after = leaves(old) if old is not None else {}, leaves(new)
        changed = {p for p, v in after.items() if before.get(p, object()) != v}
        dropped = before.keys() - after.keys()
        for entry in entries:
            _set_fields(entry, _from_fields_v1(entry["fieldsV1"]) - changed - dropped)
        if changed:
            mine = _entry(entries, manager, "Update", subresource, kind.api_version)
            _set_fields(mine, _from_fields_v1(mine["fieldsV1"]) | changed)
        return [e for e in entries if e["fieldsV1"]]

    def _commit(self, kind: Kind, old: dict | None, new: dict, managed: list[dict]) -> dict:
        meta = new.setdefault("metadata", {})
        new["apiVersion"], new["kind"] = kind.api_version, kind.kind
        if old is not None:
            for key in ("name", "namespace", "uid", "creationTimestamp", "generation",
                        "deletionTimestamp", "deletionGracePeriodSeconds"):
                if key in old["metadata"]:
                    meta[key] = old["metadata"][key]
                else:
                    meta.pop(key, None)
        else:
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
        meta["resourceVersion"] = old["metadata"]["resourceVersion"] if old is not None else ""
        if managed:
            meta["managedFields"] = managed
        else:
            meta.pop("managedFields", None)
        default(kind, new, self._cluster_ips)
        validate(kind, new, old)
        if old is not None and _spec_part(old) != _spec_part(new):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        if old is not None and _without_volatile(old) == _without_volatile(new):
            return old  # a no-op write: no new revision, no event
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not meta.get("deletionGracePeriodSeconds"):
            return self.store.remove(kind, meta["namespace"], meta["name"])  # the last finalizer went
        return self.store.write(kind, new)

    @staticmethod
    def _removed(kind: Kind, last: dict) -> dict:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": last["metadata"]["name"], "group": kind.group, "kind": kind.plural,
                            "uid": last["metadata"]["uid"]}}


def _patch(target: dict, body: dict | list) -> dict:
    """JSON merge patch (RFC 7386) for a dict body, JSON patch (RFC 6902) for a list: kmock's patcher."""
    patched = kmock.Object(copy.deepcopy(target))
    try:
        patched.patch(body)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, ValueError, TypeError, KeyError) as exc:
        raise api_error(422, "Invalid", f"the server rejected our request due to an error in our request: {exc}")
    return copy.deepcopy(dict(patched.raw))


def scale_of(obj: dict) -> dict:
    meta = obj["metadata"]
    return {"kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {key: meta[key] for key in ("name", "namespace", "uid", "resourceVersion",
                                                    "creationTimestamp") if key in meta},
            "spec": {"replicas": obj["spec"].get("replicas", 0)},
            "status": {"replicas": (obj.get("status") or {}).get("replicas", 0),
                       "selector": selector_string(obj["spec"].get("selector"))}}


def default_manager(user_agent: str) -> str:
    """The manager name the API derives for a write without fieldManager: the User-Agent's product."""
    return (user_agent or "unknown").split("/")[0] or "unknown"
