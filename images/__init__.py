"""Serving images: built without Docker, pushed to any OCI registry, started lazily.

- :mod:`images.oci`: deterministic layers, the OCI image layout, the distribution-API client
  (:class:`images.oci.registry.Registry` Protocol, an HTTP adapter and an in-memory fake) and
  the embedded registry ``modelplane up`` starts on 127.0.0.1.
- :mod:`images.seekable`: each layer as a squashfs image cut into independently compressed,
  digested sectors plus an index, pushed as an OCI artifact that refers to the image.
- :mod:`images.lazy`: the fetcher that serves reads of that image from the registry, one
  sector at a time, through a bounded local cache.
- :mod:`images.mount`: the front ends over any :class:`images.source.BlockSource` (FUSE file
  on a read-only loop device, a FUSE directory view, and a pure-Python reader).
"""
