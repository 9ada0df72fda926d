"""What the supervisor starts replicas with, from the settings: image mounts and the warm pool."""

from __future__ import annotations

import logging

from cluster.local.warm_pool import WarmPool, WarmPoolConfig
from images.mounts import ImageMounts, MountsConfig

log = logging.getLogger("modelplane.supervisor")


def image_mounts(settings) -> ImageMounts | None:
    """The mounts replicas start from, unless images are off or this machine cannot mount FUSE."""
    from images.mount.system import fuse_available

    if settings.images == "off":
        return None
    usable, why = fuse_available()
    if not usable:
        log.warning("serving images cannot be mounted here (%s): replicas start in place", why)
        return None
    return ImageMounts(settings.images_dir / "runtime", MountsConfig(
        mode=settings.image_mount, max_cache_bytes=int(settings.image_cache_gib * (1 << 30))))


def warm_pool(settings) -> WarmPool | None:
    """``settings.warm_pool`` pre-started runtime processes per runtime kind and environment in
    use (none for a kind until its first replica starts); None when it is 0."""
    if settings.warm_pool <= 0:
        return None
    return WarmPool(WarmPoolConfig(size_per_kind=settings.warm_pool, log_dir=settings.logs_dir / "zygotes"))
