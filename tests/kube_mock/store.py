"""The mock API server's storage: kinds, errors, label selectors, and a versioned object store.

The store plays etcd: one global revision counter (``resourceVersion`` on every object and
list), a log of changes that watches replay from a revision, and ``compact()`` that drops
the log so that older revisions answer 410 Gone. It knows nothing of API semantics (those
live in ``api.py``); it only stores snapshots, bumps the revision and tells subscribers.
Stored dicts are never mutated in place: every write stores a fresh copy, so the snapshots
held by the log and by open watches stay as they were.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kmock


@dataclass(frozen=True)
class Kind:
    plural: str
    group: str
    version: str
    kind: str
    status_subresource: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """The name the API uses in its messages: ``deployments.apps``, ``pods``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


KINDS: dict[str, Kind] = {k.plural: k for k in [
    Kind("deployments", "apps", "v1", "Deployment"),
    Kind("services", "", "v1", "Service"),
    Kind("pods", "", "v1", "Pod"),
    Kind("poddisruptionbudgets", "policy", "v1", "PodDisruptionBudget"),
    Kind("endpointslices", "discovery.k8s.io", "v1", "EndpointSlice", status_subresource=False),
]}


def kind_of(name: str | Kind) -> Kind:
    """A kind by its plural (``deployments``) or its kind name (``Deployment``)."""
    if isinstance(name, Kind):
        return name
    for kind in KINDS.values():
        if name.lower() in (kind.plural, kind.kind.lower()):
            return kind
    raise KeyError(f"kube_mock serves no kind {name!r}; it serves {sorted(KINDS)}")


# --- errors, rendered by the server as a v1 Status with the same code/reason/message/details


def api_error(code: int, reason: str, message: str, kind: Kind | None = None,
              name: str | None = None) -> kmock.KubernetesError:
    details: dict[str, Any] = {}
    if name is not None:
        details["name"] = name
    if kind is not None:
        details.update(group=kind.group, kind=kind.plural)
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details or None)


def not_found(kind: Kind, name: str) -> kmock.KubernetesError:
    return api_error(404, "NotFound", f'{kind.qualified} "{name}" not found', kind, name)


def conflict(kind: Kind, name: str) -> kmock.KubernetesError:
    return api_error(409, "Conflict", f'Operation cannot be fulfilled on {kind.qualified} "{name}": the object '
                     "has been modified; please apply your changes to the latest version and try again",
                     kind, name)


def already_exists(kind: Kind, name: str) -> kmock.KubernetesError:
    return api_error(409, "AlreadyExists", f'{kind.qualified} "{name}" already exists', kind, name)


def invalid(kind: Kind, name: str, message: str) -> kmock.KubernetesError:
    return api_error(422, "Invalid", f'{kind.kind} "{name}" is invalid: {message}', kind, name)


def bad_request(message: str) -> kmock.KubernetesError:
    return api_error(400, "BadRequest", message)


class Expired(Exception):
    """A watch asked for a revision older than the retained history (410 Gone)."""

    def __init__(self, requested: int, oldest: int) -> None:
        super().__init__(f"too old resource version: {requested} ({oldest})")


# --- label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``, ``a in (x,y)``, ``a notin (x,y)``

_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_SET_TERM = re.compile(rf"\s*({_KEY})\s+(in|notin)\s+\(([^)]*)\)\s*")
_CMP_TERM = re.compile(rf"\s*({_KEY})\s*(==|!=|=)\s*([-A-Za-z0-9_.]*)\s*")
_EXISTS_TERM = re.compile(rf"\s*(!?)\s*({_KEY})\s*")

Requirement = tuple[str, str, frozenset[str]]  # (key, operator, values)


def parse_selector(text: str | None) -> list[Requirement]:
    """Parse a label selector as the API does; ValueError on a malformed one."""
    terms, depth, current = [], 0, ""
    for char in text or "":
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    requirements: list[Requirement] = []
    for term in terms:
        if not term.strip():
            if text and text.strip():
                raise ValueError(f"empty term in label selector {text!r}")
            continue
        if match := _SET_TERM.fullmatch(term):
            values = frozenset(v.strip() for v in match[3].split(",") if v.strip())
            requirements.append((match[1], match[2], values))
        elif match := _CMP_TERM.fullmatch(term):
            requirements.append((match[1], "!=" if match[2] == "!=" else "=", frozenset([match[3]])))
        elif match := _EXISTS_TERM.fullmatch(term):
            requirements.append((match[2], "!" if match[1] else "exists", frozenset()))
        else:
            raise ValueError(f"unable to parse requirement {term.strip()!r} in label selector {text!r}")
    return requirements


def selector_matches(requirements: list[Requirement], labels: dict[str, str] | None) -> bool:
    labels = labels or {}
    for key, op, values in requirements:
        present = key in labels
        ok = {
            "=": present and labels.get(key) in values,
            "!=": not present or labels.get(key) not in values,
            "in": present and labels.get(key) in values,
            "notin": not present or labels.get(key) not in values,
            "exists": present,
            "!": not present,
        }[op]
        if not ok:
            return False
    return True


def parse_field_selector(text: str | None) -> list[tuple[str, str, str]]:
    """Only ``metadata.name`` and ``metadata.namespace`` with ``=``, ``==``, ``!=``, as the API allows."""
    result = []
    for term in filter(None, (t.strip() for t in (text or "").split(","))):
        match = re.fullmatch(r"(metadata\.name|metadata\.namespace)\s*(==|!=|=)\s*(.*)", term)
        if not match:
            raise ValueError(f'field label not supported: "{term}"')
        result.append((match[1].split(".")[1], "!=" if match[2] == "!=" else "=", match[3]))
    return result


def field_selector_matches(requirements: list[tuple[str, str, str]], obj: dict) -> bool:
    meta = obj.get("metadata", {})
    return all((meta.get(field) == value) == (op == "=") for field, op, value in requirements)


# --- the store


@dataclass(frozen=True)
class Event:
    rv: int
    type: str  # ADDED | MODIFIED | DELETED
    kind: Kind
    old: dict | None  # the state before (None for ADDED)
    new: dict  # the state after; for DELETED the last state, carrying the deletion's revision


Listener = Callable[[Event], None]


class Store:
    """Objects keyed by (plural, namespace, name), one revision counter, a change log.

    Thread-safe: every method takes ``lock`` (re-entrant), which callers also hold to make
    a read-modify-write atomic. Listeners are called under the lock, in revision order.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.rv = 1  # etcd's revision; never reused, shared by all kinds
        self.oldest = 1  # the oldest revision a watch may start from (raised by compact())
        self._objects: dict[tuple[str, str, str], dict] = {}
        self._log: list[Event] = []
        self._listeners: list[Listener] = []

    # reads: deep copies, so callers may change what they get

    def get(self, kind: Kind, namespace: str, name: str) -> dict | None:
        with self.lock:
            obj = self._objects.get((kind.plural, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, kind: Kind, namespace: str | None = None) -> tuple[list[dict], int]:
        """The objects of a kind (in one namespace, or all), sorted by namespace/name, and the revision."""
        with self.lock:
            items = [copy.deepcopy(obj) for (plural, ns, _), obj in sorted(self._objects.items())
                     if plural == kind.plural and namespace in (None, ns)]
            return items, self.rv

    def all_objects(self) -> list[tuple[Kind, dict]]:
        with self.lock:
            return [(KINDS[plural], copy.deepcopy(obj)) for (plural, _, _), obj in sorted(self._objects.items())]

    def by_uid(self, uid: str) -> tuple[Kind, dict] | None:
        with self.lock:
            for (plural, _, _), obj in self._objects.items():
                if obj["metadata"].get("uid") == uid:
                    return KINDS[plural], copy.deepcopy(obj)
            return None

    # writes: the caller prepares the full new state; the store versions and announces it

    def write(self, kind: Kind, obj: dict) -> dict:
        """Store ``obj`` as the current state (ADDED when new, MODIFIED otherwise); a new revision."""
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        key = (kind.plural, meta["namespace"], meta["name"])
        with self.lock:
            old = self._objects.get(key)
            self.rv += 1
            meta["resourceVersion"] = str(self.rv)
            self._objects[key] = obj
            self._emit(Event(self.rv, "MODIFIED" if old is not None else "ADDED", kind, old, obj))
            return copy.deepcopy(obj)

    def remove(self, kind: Kind, namespace: str, name: str) -> dict:
        """Remove the object; the DELETED event carries its last state at a new revision."""
        with self.lock:
            old = self._objects.pop((kind.plural, namespace, name))
            self.rv += 1
            last = copy.deepcopy(old)
            last["metadata"]["resourceVersion"] = str(self.rv)
            self._emit(Event(self.rv, "DELETED", kind, old, last))
            return copy.deepcopy(last)

    def _emit(self, event: Event) -> None:
        self._log.append(event)
        for listener in list(self._listeners):
            listener(event)

    # watches

    def subscribe(self, listener: Listener, since: int | None) -> list[Event]:
        """Register ``listener`` for every later change and return what it missed, atomically.

        ``since=None`` (a watch without resourceVersion, or "0"): synthetic ADDED events for the
        current objects, as the API sends. Otherwise the logged changes after ``since``, or
        :class:`Expired` when ``since`` is older than the retained history.
        """
        with self.lock:
            if since is None:
                backlog = [Event(self.rv, "ADDED", KINDS[plural], None, obj)
                           for (plural, _, _), obj in sorted(self._objects.items())]
            elif since < self.oldest:
                raise Expired(since, self.oldest)
            else:
                backlog = [event for event in self._log if event.rv > since]
            self._listeners.append(listener)
            return backlog

    def unsubscribe(self, listener: Listener) -> None:
        with self.lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def compact(self) -> int:
        """Drop the change history (etcd compaction): watches from an older revision get 410."""
        with self.lock:
            self._log.clear()
            self.oldest = self.rv
            return self.rv
