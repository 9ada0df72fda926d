"""The lazy fetcher: a seekable image read from the registry a sector at a time.

- :mod:`images.lazy.plan`: which Range requests fetch a set of sectors (pure).
- :mod:`images.lazy.cache`: :class:`SectorCache`, decoded sectors on local disk within a bound.
- :mod:`images.lazy.fetcher`: :class:`LazyImage` (a :class:`images.source.BlockSource`) and
  :func:`open_lazy`, which starts one from the digest of the image's index.
"""

from images.lazy.cache import SectorCache
from images.lazy.fetcher import FetchStats, LazyImage, open_lazy

__all__ = ["FetchStats", "LazyImage", "SectorCache", "open_lazy"]
