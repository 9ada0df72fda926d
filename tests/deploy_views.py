"""What the deploy job shows, read back for the tests: its metadata values, the size of its PNG plots,
and the last day of autoscaler decisions a redeploy finds (so ``served_endpoint`` has a plot to draw)."""

import io
from datetime import datetime, timedelta

from PIL import Image

from assets.metadata import png_of
from controlplane.scaling import ScalingStore

STEPS = ("source_model", "quantized_checkpoint", "cost_model", "serving_image", "served_endpoint")


def decoded_png(markdown: str) -> tuple[int, int]:
    with Image.open(io.BytesIO(png_of(markdown))) as image:
        image.load()
        return image.size


def record_last_day(engine, endpoint: str, now: datetime) -> None:
    """What an autoscaler would have left: a few replica decisions and a peak in flight per minute."""
    for hours_ago, replicas in ((20, 1), (8, 2), (1, 1)):
        at = now - timedelta(hours=hours_ago)
        ScalingStore(engine, now=lambda at=at: at).record(endpoint, f"{endpoint}-v0-old", "horizontal",
                                                          rule="test", reason="recorded by the test", inputs={},
                                                          replicas=replicas)
    now_minute = int(now.timestamp() // 60)
    for minutes_ago in range(0, 24 * 60, 10):
        ScalingStore(engine).save_demand(endpoint, now_minute - minutes_ago, 1.0 + (minutes_ago // 60) % 5)


def metadata_of(result) -> dict:
    return {step: {k: v.value for k, v in result.asset_materializations_for_node(step)[0].metadata.items()}
            for step in STEPS}
