"""How the deploy steps read in the Dagster catalog: one group, an owner, kinds and tags per step.

Tag values follow Dagster's strict form (letters, digits, ``_``, ``-``, ``.``; at most 63
characters), so the catalog can filter on them: ``modelplane/step`` orders the five steps
(``1-source`` … ``5-serve``), ``modelplane/changes-traffic`` marks the one step that moves an
endpoint's requests, ``modelplane/measures`` the steps that share the measurement pool.
docs/pipeline-metadata.md shows the table.

>>> step_tags(5, "serve", changes_traffic=True)
{'modelplane/step': '5-serve', 'modelplane/changes-traffic': 'true'}
"""

from __future__ import annotations

GROUP = "deploy"
#: Who answers for the deploy steps: the platform engineers who run modelplane.
OWNERS = ["team:ml-platform"]


def step_tags(number: int, name: str, *, measures: bool = False, changes_traffic: bool = False) -> dict[str, str]:
    tags = {"modelplane/step": f"{number}-{name}"}
    if measures:
        tags["modelplane/measures"] = "true"
    if changes_traffic:
        tags["modelplane/changes-traffic"] = "true"
    return tags
