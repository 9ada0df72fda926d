"""Which checkpoint a version serves: its quantized candidate, or the baseline the gate fell back to.

The ``eval_gate`` check writes one verdict per candidate checkpoint beside the version's
evaluation results (``<version>/eval/gate.<checkpoint>.json``, with the candidate's
fingerprint, written atomically); ``cost_model`` and ``served_endpoint`` read it through
:func:`serving_checkpoint`. So a candidate the gate refused never serves, and with
``eval_gate.on_failure: serve_baseline`` the first revision of an endpoint serves the
unquantized checkpoint the gate has just measured, with the refusal named wherever the
checkpoint is (asset metadata, revision details, ``modelplane endpoints show``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dagster import Failure

from evaluation.engine_run import fingerprint

Serve = Literal["candidate", "baseline", "none"]


@dataclass(frozen=True)
class ServingCheckpoint:
    model_dir: str
    label: str  # e.g. "int8-w8a8-channel", "as registered", "baseline (unquantized; the gate refused int8-…)"
    quantized: bool
    gate: str  # one line: what the gate decided and why this checkpoint serves
    reasons: tuple[str, ...] = ()  # the gate's reasons when it refused the candidate


def verdict_path(candidate_dir: str | Path) -> Path:
    """``…/gec/v3/quantized-int8-w8a8-channel`` → ``…/gec/v3/eval/gate.quantized-int8-w8a8-channel.json``."""
    candidate_dir = Path(candidate_dir)
    return candidate_dir.parent / "eval" / f"gate.{candidate_dir.name}.json"


def record_verdict(candidate: dict, serve: Serve, reasons: list[str], kernels: str) -> None:
    """Write what the gate decided for ``candidate`` (the ``quantized_checkpoint`` value)."""
    path = verdict_path(candidate["serve_dir"])
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps({"fingerprint": fingerprint(Path(candidate["serve_dir"])), "serve": serve,
                                   "scheme": candidate["scheme"], "reasons": reasons, "kernels": kernels}))
    staging.replace(path)


def serving_checkpoint(quantized_checkpoint: dict) -> ServingCheckpoint:
    """The checkpoint to benchmark and serve for this version, by the gate's verdict."""
    candidate = quantized_checkpoint
    if not candidate["quantized"]:
        return ServingCheckpoint(candidate["serve_dir"], "as registered", False,
                                 f"not gated: {candidate.get('reason', 'not quantized')}")
    path = verdict_path(candidate["serve_dir"])
    stored = json.loads(path.read_text()) if path.is_file() else None
    if stored is None or stored.get("fingerprint") != fingerprint(Path(candidate["serve_dir"])):
        raise Failure(description=f"the eval gate has not judged {candidate['serve_dir']} (no current verdict at "
                                  f"{path}); materialize quantized_checkpoint with its eval_gate check first")
    reasons = tuple(stored["reasons"])
    if stored["serve"] == "candidate":
        return ServingCheckpoint(candidate["serve_dir"], candidate["scheme"], True,
                                 f"passed ({stored['kernels']})")
    if stored["serve"] == "baseline":
        return ServingCheckpoint(candidate["source_dir"], f"baseline (unquantized; the gate refused {candidate['scheme']})",
                                 False, f"refused {candidate['scheme']}, serving the unquantized baseline "
                                        "(eval_gate.on_failure: serve_baseline)", reasons)
    raise Failure(description=f"the eval gate refused {candidate['scheme']}: " + "; ".join(reasons))
