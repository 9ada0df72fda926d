"""What the deploy assets show in the Dagster UI: markdown tables, embedded plots, links (pure, no I/O).

Every builder takes plain data (dicts, lists, numbers) and returns a string or a Dagster
``MetadataValue``, so a test checks a table's rows without running a step. The Dagster UI
renders ``MetadataValue.md`` as GitHub markdown, tables included, and lets ``data:`` image
sources through its sanitizer, so a plot is a PNG embedded as a base64 data URI
(:func:`png_markdown`); a few tens of kB each, kept small by the plots' size and dpi.

>>> print(markdown_table(["group", "error %"], [["mlp", 0.61], ["attention", "a|b"]]))
| group | error % |
|---|---|
| mlp | 0.61 |
| attention | a\\|b |
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import quote

from dagster import MetadataValue

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CELL_CHARS = 160  # a table cell longer than this is cut, with an ellipsis
TOP_LAYERS = 10


def cell(value: object, limit: int = CELL_CHARS) -> str:
    """One table cell: no pipe, no line break, at most ``limit`` characters; floats to 4 significant digits.

    >>> cell("a | b\\nc"), cell(0.000123456), cell(float("nan")), cell(None), cell("x" * 5, limit=3)
    ('a \\\\| b c', '0.0001235', 'n/a', '', 'xx…')
    """
    if value is None:
        return ""
    if isinstance(value, float):
        text = "n/a" if not math.isfinite(value) else f"{value:.4g}"
    else:
        text = str(value)
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table; every row must have one cell per header."""
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"a row of {len(row)} cells under {len(headers)} headers: {row!r}")
        lines.append("| " + " | ".join(cell(v) for v in row) + " |")
    return "\n".join(lines)


def table_rows(markdown: str) -> list[dict[str, str]]:
    """The rows of the first table in ``markdown`` as ``{header: cell}`` (the inverse of :func:`markdown_table`,
    for tests and tools that read metadata back).

    >>> table_rows(markdown_table(["a", "b"], [[1, "x|y"]]))
    [{'a': '1', 'b': 'x|y'}]
    """
    def cells(line: str) -> list[str]:
        return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]

    lines = [line for line in markdown.splitlines() if line.strip().startswith("|")]
    if len(lines) < 2:
        return []
    headers = cells(lines[0])
    return [dict(zip(headers, cells(line))) for line in lines[2:]]


def is_png(data: bytes) -> bool:
    return data[:8] == PNG_SIGNATURE


def png_markdown(png: bytes, alt: str) -> MetadataValue:
    """A PNG as markdown metadata the Dagster UI shows inline."""
    if not is_png(png):
        raise ValueError("not PNG bytes")
    return MetadataValue.md(f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})")


def png_of(markdown: str) -> bytes:
    """The PNG embedded by :func:`png_markdown` (for tests and tools reading the metadata back)."""
    start = markdown.index("(data:image/png;base64,") + len("(data:image/png;base64,")
    return base64.b64decode(markdown[start: markdown.index(")", start)])


def bullet_list(lines: Iterable[str]) -> str:
    return "\n".join(f"- {line}" for line in lines)


# ---- eval gate -------------------------------------------------------------------------------

def gate_checks_table(checks: Sequence[Mapping]) -> str:
    """One row per gate check: what was compared, the values, the bound, the paired test's interval.

    ``checks``: dicts with ``name``, ``reference``, ``candidate``, ``measured``, ``bound``,
    ``passed``, ``spec_field`` and optionally ``paired`` (``PairedComparison.to_json()``).

    >>> print(gate_checks_table([{"name": "NLL vs baseline", "reference": 2.0, "candidate": 2.03,
    ...     "measured": 0.015, "bound": 0.02, "passed": True, "spec_field": "eval_gate.max_nll_increase"}]))
    | check | reference | candidate | measured | bound | set by | result | interval of the drop | p |
    |---|---|---|---|---|---|---|---|---|
    | NLL vs baseline | 2 | 2.03 | 0.015 | 0.02 | eval_gate.max_nll_increase | ✅ passed |  |  |
    """
    rows = []
    for check in checks:
        paired = check.get("paired") or {}
        interval = paired.get("interval")
        rows.append([check["name"], check.get("reference"), check["candidate"], check["measured"], check["bound"],
                     check["spec_field"], "✅ passed" if check["passed"] else "❌ failed",
                     f"{paired.get('confidence', 0.95):.0%}: {interval[0]:.3f} to {interval[1]:.3f}" if interval else "",
                     paired.get("p_value", "")])
    return markdown_table(["check", "reference", "candidate", "measured", "bound", "set by", "result",
                           "interval of the drop", "p"], rows)


def worst_examples_table(rows: Sequence[Mapping]) -> str:
    """The examples the candidate answers worse than the baseline, worst first (``WorstExample.to_row()``)."""
    if not rows:
        return "(none: the candidate is never worse than the baseline)"
    return markdown_table(
        ["id", "input", "reference", "baseline", "candidate", "baseline similarity", "candidate similarity"],
        [[r.get("id", ""), r.get("input", ""), r.get("reference", ""), r.get("baseline", ""), r.get("candidate", ""),
          r.get("baseline_similarity"), r.get("candidate_similarity")] for r in rows])


def scores_table(results: Mapping[str, Mapping | None], metric: str) -> str:
    """Task metric and NLL of each evaluated checkpoint: ``{"candidate": {"task": .., "nll": ..}, ...}``."""
    return markdown_table(["checkpoint", metric, "NLL per token"],
                          [[role, r["task"], r["nll"]] for role, r in results.items() if r])


# ---- quantization ----------------------------------------------------------------------------

def layer_group_table(groups: Mapping[str, float], layers: Mapping[str, float], group_of) -> str:
    """Relative weight error per layer group, with its layer count and worst layer.

    ``groups``/``layers``: relative RMS errors (0.01 = 1 %) as the quantization worker reports
    them; ``group_of(layer)`` names a layer's group (``quantization.reconstruction.layer_group``).

    >>> group = lambda name: "mlp" if ".mlp." in name else "attention"
    >>> print(layer_group_table({"mlp": 0.01, "attention": 0.02},
    ...                         {"l.0.mlp.up": 0.01, "l.0.attn.q": 0.015, "l.1.attn.q": 0.025}, group))
    | layer group | layers | weight error % | worst layer | its error % |
    |---|---|---|---|---|
    | attention | 2 | 2 | l.1.attn.q | 2.5 |
    | mlp | 1 | 1 | l.0.mlp.up | 1 |
    """
    rows = []
    for name, error in sorted(groups.items()):
        members = {layer: e for layer, e in layers.items() if group_of(layer) == name}
        worst = max(members, key=members.get) if members else None
        rows.append([name, len(members), 100 * error, worst, 100 * members[worst] if worst else None])
    return markdown_table(["layer group", "layers", "weight error %", "worst layer", "its error %"], rows)


def quantization_sizes_table(report: Mapping) -> str:
    """Sizes before and after, the layers quantized and the time it took (the quantization worker's report).

    >>> print(quantization_sizes_table({"size_before_bytes": 4_000_000, "size_after_bytes": 1_100_000,
    ...                                 "weight_error": {"quantized_layers": 14}, "quantize_s": 3.2}))
    | size before MB | size after MB | after / before | quantized layers | quantize s |
    |---|---|---|---|---|
    | 4 | 1.1 | 0.275 | 14 | 3.2 |
    """
    before, after = report["size_before_bytes"], report["size_after_bytes"]
    return markdown_table(["size before MB", "size after MB", "after / before", "quantized layers", "quantize s"],
                          [[before / 1e6, after / 1e6, after / max(1, before),
                            report["weight_error"]["quantized_layers"], report.get("quantize_s")]])


def worst_layers_table(layers: Mapping[str, float], limit: int = TOP_LAYERS) -> str:
    """The ``limit`` layers with the largest relative weight error, largest first."""
    ranked = sorted(layers.items(), key=lambda item: -item[1])[:limit]
    return markdown_table(["layer", "weight error %"], [[layer, 100 * error] for layer, error in ranked])


# ---- cost model ------------------------------------------------------------------------------

def cost_levels_table(levels: Sequence[Mapping], target_concurrency: int, example: tuple[int, int] = (128, 32)) -> str:
    """α, β, γ per swept concurrency (``CostModel.to_json()["levels"]``), the target marked, with the
    latency and model units of an ``example`` (input, output) request at each level.

    >>> print(cost_levels_table([{"concurrency": 4, "alpha_ms_per_input_token": 0.5,
    ...                           "beta_ms_per_output_token": 20.0, "gamma_ms": 30.0}], 4, (100, 10)))
    | concurrency | α ms/input token | β ms/output token | γ ms | latency ms (100 in, 10 out) | model units (100 in, 10 out) | target |
    |---|---|---|---|---|---|---|
    | 4 | 0.5 | 20 | 30 | 280 | 70 | ◀ target |
    """
    i, o = example
    rows = []
    for level in sorted(levels, key=lambda lv: lv["concurrency"]):
        c = level["concurrency"]
        latency = level["alpha_ms_per_input_token"] * i + level["beta_ms_per_output_token"] * o + level["gamma_ms"]
        rows.append([c, level["alpha_ms_per_input_token"], level["beta_ms_per_output_token"], level["gamma_ms"],
                     float(latency), latency / c, "◀ target" if c == target_concurrency else ""])
    return markdown_table(["concurrency", "α ms/input token", "β ms/output token", "γ ms",
                           f"latency ms ({i} in, {o} out)", f"model units ({i} in, {o} out)", "target"], rows)


def sweep_table(points: Sequence[Mapping]) -> str:
    """Every sweep point (``SweepPoint.to_json()``): shape, concurrency, latency percentiles, throughput."""
    ordered = sorted(points, key=lambda p: (p["input_tokens"], p["output_tokens"], p["concurrency"]))
    return markdown_table(["input", "output", "concurrency", "ok", "failed", "p50 ms", "p99 ms", "requests/s"],
                          [[p["input_tokens"], p["output_tokens"], p["concurrency"], p["n_ok"], p["n_failed"],
                            p.get("p50_latency_ms"), p.get("p99_latency_ms"), p.get("throughput_rps")]
                           for p in ordered])


# ---- serving ---------------------------------------------------------------------------------

def endpoints_table(served: Sequence[Mapping]) -> str:
    """One row per endpoint the version serves (the ``served_endpoint`` value)."""
    return markdown_table(["endpoint", "revision", "replaced", "runtime", "replicas", "target concurrency", "URL"],
                          [[s["endpoint"], s["revision"], s.get("previous_revision") or "", s["runtime"],
                            s["replicas"], s["target_concurrency"], s["url"]] for s in served])


def image_layers_table(layers: Mapping[str, Mapping]) -> str:
    """An image's layers (``build_serving_image``'s ``facts["layers"]``): digest, size, and its timings in s.

    >>> print(image_layers_table({"model": {"digest": "sha256:ab", "bytes": 2_500_000, "squash_s": 0.4}}))
    | layer | digest | MB | squash s |
    |---|---|---|---|
    | model | sha256:ab | 2.5 | 0.4 |
    """
    timings = sorted({key for layer in layers.values() for key in layer if key.endswith("_s")})
    return markdown_table(["layer", "digest", "MB", *(key.replace("_s", " s") for key in timings)],
                          [[role, layer["digest"], layer["bytes"] / 1e6, *(layer.get(key) for key in timings)]
                           for role, layer in layers.items()])


def image_digest_url(registry: str, repo: str, digest: str) -> str:
    """The registry's manifest URL of an image by digest (the OCI distribution API).

    >>> image_digest_url("http://127.0.0.1:5050", "modelplane/iris", "sha256:ab")
    'http://127.0.0.1:5050/v2/modelplane/iris/manifests/sha256:ab'
    """
    return f"{registry.rstrip('/')}/v2/{repo}/manifests/{digest}"


def mlflow_web(tracking_uri: str, ui_url: str | None = None) -> str | None:
    """The MLflow UI's base URL: ``ui_url`` when set, else the tracking URI when it is a server
    (None for a file or SQL store, which has no UI).

    >>> mlflow_web("http://mlflow:5000/"), mlflow_web("sqlite:///m.db"), mlflow_web("sqlite:///m.db", "http://ui")
    ('http://mlflow:5000', None, 'http://ui')
    """
    if ui_url:
        return ui_url.rstrip("/")
    return tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else None


def mlflow_run_url(web: str | None, run_id: str | None) -> str | None:
    """The MLflow UI's page of a run (its ``/runs/<id>`` route finds the experiment itself).

    >>> mlflow_run_url("http://127.0.0.1:5000", "abc"), mlflow_run_url(None, "abc")
    ('http://127.0.0.1:5000/#/runs/abc', None)
    """
    return f"{web}/#/runs/{run_id}" if web and run_id else None


def mlflow_version_url(web: str | None, model: str, version: str) -> str | None:
    """The MLflow UI's page of a registered model version.

    >>> mlflow_version_url("http://127.0.0.1:5000", "tiny llm", "3")
    'http://127.0.0.1:5000/#/models/tiny%20llm/versions/3'
    """
    return f"{web}/#/models/{quote(model, safe='')}/versions/{version}" if web else None


def links(**urls: str | None) -> dict[str, MetadataValue]:
    """``{name: MetadataValue.url}`` for each URL that exists; a store with no UI gives none."""
    return {name: MetadataValue.url(url) for name, url in urls.items() if url}
