"""Which environment variables a block of imports looked up by name (a zygote's preload,
:mod:`serving.runtime.zygote`). Standard library only: it runs under any python a replica uses."""

from __future__ import annotations

import os
import sys


class EnvReads:
    """Records the variables looked up by name in ``os.environ`` while installed.

    Each read is filed under the code that made it (the first frame outside ``os`` and
    ``collections.abc``). A place that read nearly every variable present copied or scanned the
    environment (``dict(os.environ, LC_ALL="C")`` in ``platform``, tqdm's prefix scan) rather
    than depending on any one value, and is left out (:data:`SCAN_SHARE`).
    """

    # A place that read this share of the variables present (and at least SCAN_MIN_PRESENT) was
    # scanning: one line that needs many values reads mostly absent ones (tqdm read 35 of 43 here).
    SCAN_SHARE = 0.5
    SCAN_MIN_PRESENT = 8
    LIBRARY_FILES = ("<frozen os>", "<frozen _collections_abc>", os.__file__, getattr(os.path, "__file__", ""))

    def __init__(self) -> None:
        self.by_place: dict[tuple[str, int], dict[str, str | None]] = {}
        self._original = os._Environ.__getitem__

    @property
    def reads(self) -> dict[str, str | None]:
        present = len(os.environ)
        merged: dict[str, str | None] = {}
        for found in self.by_place.values():
            present_read = sum(v is not None for v in found.values())
            if present_read >= max(self.SCAN_MIN_PRESENT, self.SCAN_SHARE * present):
                continue
            for key, value in found.items():
                merged.setdefault(key, value)
        return merged

    def __enter__(self) -> EnvReads:
        original, by_place, library = self._original, self.by_place, self.LIBRARY_FILES

        def getitem(environ, key):
            if environ is os.environ and isinstance(key, str):
                frame = sys._getframe(1)
                while frame.f_back is not None and frame.f_code.co_filename in library:
                    frame = frame.f_back
                found = by_place.setdefault((frame.f_code.co_filename, frame.f_lineno), {})
                if key not in found:
                    try:
                        found[key] = original(environ, key)
                    except KeyError:
                        found[key] = None  # looked up and absent: setting it later changes what was read
            return original(environ, key)

        os._Environ.__getitem__ = getitem
        return self

    def __exit__(self, *exc: object) -> None:
        os._Environ.__getitem__ = self._original
