"""Which endpoint specs a model version is deployed for, and the settings they agree on.

A deploy run is for one version; the specs it serves are those whose alias points at that
version now. Quantization and the eval gate produce one checkpoint per version, so the
specs must agree on those sections; when they do not, the run fails and says which.
"""

from __future__ import annotations

from collections.abc import Callable

from dagster import Failure

from controlplane.specs import EndpointSpec, EvalGate, Quantization


def serving_specs(specs: list[EndpointSpec], model: str, version: str,
                  alias_version: Callable[[str, str], str | None]) -> tuple[list[EndpointSpec], list[EndpointSpec]]:
    """(specs whose alias points at ``version``, specs of the same model whose alias points elsewhere)."""
    mine = [s for s in specs if s.registered_model == model]
    current = [s for s in mine if alias_version(model, s.alias) == version]
    return current, [s for s in mine if s not in current]


def _agreed(specs: list[EndpointSpec], section: str, default):
    values = {spec.name: getattr(spec, section) for spec in specs}
    distinct = {value.model_dump_json() for value in values.values()}
    if len(distinct) > 1:
        listing = "; ".join(f"{name}: {value.model_dump(mode='json')}" for name, value in values.items())
        raise Failure(description=f"the endpoints serving this version disagree on `{section}` ({listing}); "
                                  "one checkpoint is built per version, so give them the same section")
    return next(iter(values.values()), default)


def agreed_quantization(specs: list[EndpointSpec]) -> Quantization:
    """The ``quantization`` section all ``specs`` share (the default when there are none)."""
    return _agreed(specs, "quantization", Quantization())


def agreed_eval_gate(specs: list[EndpointSpec]) -> EvalGate:
    """The ``eval_gate`` section all ``specs`` share (the default when there are none)."""
    return _agreed(specs, "eval_gate", EvalGate())
