"""How deep a parsed JSON value nests, found without recursion (a hostile body may nest 100,000 levels)."""

from __future__ import annotations

from collections.abc import Iterator


def walk(value) -> Iterator[tuple[object, int, str]]:
    """Every value inside ``value`` with its nesting level (1 = the top container) and its path.

    >>> [(v, level, path) for v, level, path in walk({"a": [7]}) if not isinstance(v, (dict, list))]
    [(7, 3, 'a[0]')]
    """
    stack = [(value, 1, "")]
    while stack:
        item, level, path = stack.pop()
        yield item, level, path
        if isinstance(item, dict):
            stack.extend((child, level + 1, f"{path}.{key}" if path else str(key)) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, level + 1, f"{path}[{index}]") for index, child in enumerate(item))


def depth(value) -> int:
    """Containers inside containers: ``{"a": [1, {"b": []}]}`` is 4 deep, a number 0.

    >>> depth({"a": [1, {"b": []}]}), depth(3)
    (4, 0)
    """
    return max((level for item, level, _ in walk(value) if isinstance(item, (dict, list))), default=0)
