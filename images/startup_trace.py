"""The files a runtime reads while it starts: recorded from the real runtime under strace.

The image builder places these files first in each layer's filesystem image, so that the
start-up set is a few long runs of sectors instead of thousands of scattered ones (fewer,
larger Range requests; less of each fetched sector wasted). The runtime is started exactly as
a replica would be, from the staged environment and the model directory, until it has
answered its warm-up request; every ``open``/``openat``/``execve`` of a file under one of the
``roots`` is kept, in first-open order.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import httpx

from serving.runtime.base import ProbeRequest, ReplicaLaunch
from serving.runtime.process import running_server

# `1234 openat(AT_FDCWD, "/x/y", O_RDONLY|O_CLOEXEC) = 3`, `execve("/usr/bin/python", [...`
_OPEN = re.compile(r'(?:open|openat|openat2|execve)\((?:AT_FDCWD|\d+)?(?:<[^>]*>)?,? ?"((?:[^"\\]|\\.)*)"')


def _unescape(text: str) -> str:
    r"""strace's C escapes back to the path.

    >>> _unescape(r"/a\"b/\303\251")
    '/a"b/é'
    """
    raw = re.sub(rb"\\([0-7]{1,3})", lambda m: bytes([int(m.group(1), 8)]), text.encode("latin-1"))
    return raw.replace(b'\\"', b'"').replace(b"\\\\", b"\\").decode("utf-8", "surrogateescape")


def opened_files(trace_lines: Iterable[str], roots: dict[str, Path]) -> dict[str, list[str]]:
    """Per root, the regular files under it the trace opened, relative, in first-open order.

    >>> import tempfile; d = Path(tempfile.mkdtemp()); (d / "a.py").write_text("")
    0
    >>> opened_files(['7 openat(AT_FDCWD, "%s/a.py", O_RDONLY) = 3' % d,
    ...               '7 openat(AT_FDCWD, "%s/gone.py", O_RDONLY) = -1 ENOENT' % d,
    ...               '8 openat(AT_FDCWD, "%s/a.py", O_RDONLY) = 4' % d], {"env": d})
    {'env': ['a.py']}
    """
    resolved = {name: Path(root).resolve() for name, root in roots.items()}
    found: dict[str, dict[str, None]] = {name: {} for name in roots}
    for line in trace_lines:
        match = _OPEN.search(line)
        if not match:
            continue
        path = Path(os.path.normpath(_unescape(match.group(1))))
        if not path.is_absolute():
            continue
        for name, root in resolved.items():
            try:
                relative = path.relative_to(root)
            except ValueError:
                continue
            if (root / relative).is_file():
                found[name].setdefault(str(relative), None)
            break
    return {name: list(files) for name, files in found.items()}


def trace_startup(launch: ReplicaLaunch, probe: ProbeRequest | None, roots: dict[str, Path], work_dir: Path,
                  port: int, timeout_s: float = 900.0) -> dict[str, list[str]]:
    """Run ``launch`` under strace until it answers ``probe`` (None: until it is healthy); the
    files it opened under each root.

    ``launch`` must listen on ``port``. Raises RuntimeError when strace is missing (Debian package
    ``strace``) or the runtime does not start."""
    strace = shutil.which("strace")
    if strace is None:
        raise RuntimeError("strace is not installed (Debian package strace): the start-up trace needs it")
    work_dir.mkdir(parents=True, exist_ok=True)
    trace_path = work_dir / "startup.strace"
    # --seccomp-bpf: the traced processes stop only at the calls traced here, not at every
    # system call (an engine's threads make millions of futex and read calls while it starts):
    # the vLLM start-up trace took 145 s and 87 CPU-seconds without it on 2 cores.
    argv = [strace, "-f", "--seccomp-bpf", "-qq", "-e", "trace=open,openat,openat2,execve", "-e", "signal=none",
            "-o", str(trace_path), *launch.argv]
    with running_server(argv, launch.env, port, work_dir / "startup.log", startup_timeout_s=timeout_s) as (base, _):
        if probe is not None:
            answer = httpx.post(f"{base}{probe.path}", json=probe.json, timeout=timeout_s, trust_env=False)
            if not answer.is_success:
                raise RuntimeError(f"the traced runtime answered its warm-up request with {answer.status_code}: "
                                   f"{answer.text[:300]}")
    with trace_path.open(errors="replace") as lines:
        return opened_files(lines, roots)


