"""Fault: the OCI registry stops while a replica's image is being read lazily.

Required result: an I/O error, never wrong bytes, no hang.

With real processes: the embedded registry (``docker-registry``, a child of this process)
serves a two-layer image pushed in its seekable form, and :class:`images.mounts.ImageMounts`
mounts it as the local backend does, with its defaults: the kernel path where this machine
allows it, else the FUSE directory view; the start-up sectors (only the squashfs metadata
here: the image lists no start-up file) streamed in the background; the fill of everything
else held until ``ImageMounts.ready``, never called here, as when the registry goes down
before the first replica is ready. So most of the model's sectors (256 KiB each, random
bytes) are fetched only when read. Then:

1. reads while the registry is up must return the source's bytes;
2. ``kill``: the registry gets SIGKILL; reads of ranges not fetched yet, each in a thread of
   its own with a deadline, must end in EIO, or in the source's bytes where a cache had them.
   ``detect_s``: the kill to the first EIO. The registry restarts on the same port and data;
   the same reads must return the source's bytes: ``recover_s``, restart to first correct read;
3. ``stop``: the registry gets SIGSTOP, so it accepts connections and never
   answers; reads of other unfetched ranges are judged the same way, then SIGCONT.

The registry is killed directly (``EmbeddedRegistry.process``), not through a
``python -m images.oci.server`` wrapper: that wrapper starts ``docker-registry`` in a session
of its own, so killing the wrapper would leave the registry serving. Whatever step fails,
``finally`` unmounts and stops everything this started.

Alone: ``python -m benchmarks.reliability.registry_fault [kill] [stop]`` prints the result as JSON.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.reliability.outcomes import FaultResult, Record, Tally
from images.mounts import ImageMounts, MountsConfig
from images.oci.client import HttpRegistry
from images.oci.registry import sha256_digest
from images.oci.server import EmbeddedRegistry
from images.ref import ENV_MOUNT, MODEL_MOUNT, ImageRef, LayerRef
from images.seekable.build import build_seekable

FAULT = "registry stopped during a lazy read"
REQUIRED = "an I/O error, never wrong bytes, no hang"
REPO = "reliability/registry-fault"
SECTOR_BYTES = 256 << 10
SHARD_BYTES = 3 << 20
READ_BYTES = 64 << 10
BEFORE = [("shard-0.bin", 0, SHARD_BYTES), ("shard-1.bin", 0, 256 << 10)]  # read with the registry up
# (file, offset, length) far from everything read before: unfetched when their outage begins
DURING = {"kill": [("shard-2.bin", 1 << 20, READ_BYTES), ("shard-2.bin", 5 << 19, READ_BYTES),
                   ("shard-3.bin", 1 << 20, READ_BYTES), ("shard-3.bin", 5 << 19, READ_BYTES)],
          "stop": [("shard-4.bin", 1 << 20, READ_BYTES), ("shard-4.bin", 5 << 19, READ_BYTES),
                   ("shard-1.bin", 2 << 20, READ_BYTES)]}


@dataclass(frozen=True)
class Read:
    """One timed read of a range of a file under the model layer's mount."""

    path: str
    offset: int
    outcome: str  # ok | eio | wrong | error | hung
    sent_s: float  # wall clock
    started_s: float  # time.monotonic()
    ended_s: float | None  # None: still running at its deadline
    detail: str = ""


def outcome_of(expected: bytes, got: bytes | None, error: OSError | None, finished: bool) -> str:
    """How one read ended, judged against the source's bytes.

    >>> eio, enoent = OSError(errno.EIO, "x"), OSError(errno.ENOENT, "x")
    >>> [outcome_of(b"ab", b"ab", None, True), outcome_of(b"ab", b"a\\0", None, True),
    ...  outcome_of(b"ab", None, eio, True), outcome_of(b"ab", None, enoent, True), outcome_of(b"ab", None, None, False)]
    ['ok', 'wrong', 'eio', 'error', 'hung']
    """
    if not finished:
        return "hung"
    if error is not None:
        return "eio" if error.errno == errno.EIO else "error"
    return "ok" if got == expected else "wrong"


def as_record(read: Read, deadline_s: float) -> Record:
    """A read as a request of the reliability table: ok, failed (EIO or worse) or lost (hung)."""
    outcome = {"ok": "ok", "hung": "lost"}.get(read.outcome, "failed")
    latency_s = deadline_s if read.ended_s is None else read.ended_s - read.started_s
    return Record(read.sent_s, latency_s, 0, outcome, detail=read.detail)


def read_all(root: Path, source: Path, ranges: list[tuple[str, int, int]], deadline_s: float) -> list[Read]:
    """Read ``ranges`` at once, a thread each; a read still running at ``deadline_s`` is ``hung``
    (its thread is left behind: it ends when the registry answers or the mount goes)."""
    slots: list[dict] = [{} for _ in ranges]

    def one(slot: dict, name: str, offset: int, length: int) -> None:
        try:
            with open(root / name, "rb", buffering=0) as file:
                slot["got"] = os.pread(file.fileno(), length, offset)
        except OSError as exc:
            slot["error"] = exc
        slot["ended_s"] = time.monotonic()

    sent_s, started = time.time(), time.monotonic()
    threads = [threading.Thread(target=one, args=(slot, *each), daemon=True) for slot, each in zip(slots, ranges)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, started + deadline_s - time.monotonic()))
    reads = []
    for slot, (name, offset, length) in zip(slots, ranges):
        with open(source / name, "rb") as file:
            expected = os.pread(file.fileno(), length, offset)
        outcome = outcome_of(expected, slot.get("got"), slot.get("error"), "ended_s" in slot)
        reads.append(Read(name, offset, outcome, sent_s, started, slot.get("ended_s"),
                          repr(slot["error"])[:160] if "error" in slot else ""))
    return reads


def read_until_correct(root: Path, source: Path, ranges: list, deadline_s: float) -> list[Read]:
    """Read ``ranges`` again and again until every read is correct or ``deadline_s`` has passed."""
    deadline = time.monotonic() + deadline_s
    while True:
        reads = read_all(root, source, ranges, max(1.0, deadline - time.monotonic()))
        if all(read.outcome == "ok" for read in reads) or time.monotonic() >= deadline:
            return reads
        time.sleep(0.2)


def first_after(reads: list[Read], outcome: str, since_s: float) -> float | None:
    """Seconds from ``since_s`` to the end of the first read with ``outcome`` (None: none)."""
    ends = [read.ended_s for read in reads if read.outcome == outcome and read.ended_s is not None]
    return min(ends) - since_s if ends else None


def sample_image(workdir: Path, client: HttpRegistry) -> tuple[ImageRef, Path]:
    """Build and push an env and a model layer, seekable form only (the lazy path reads nothing
    else); returns the image and the model layer's source tree."""
    rng = random.Random(16)
    trees = {"env": workdir / "src-env", "model": workdir / "src-model"}
    (trees["env"] / "bin").mkdir(parents=True)
    (trees["env"] / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).parent}\n")
    (trees["env"] / "bin" / "serve").write_bytes(rng.randbytes(300_000))
    trees["model"].mkdir()
    (trees["model"] / "config.json").write_text('{"hidden_size": 64}\n')
    for number in range(5):
        (trees["model"] / f"shard-{number}.bin").write_bytes(rng.randbytes(SHARD_BYTES))
    layers = []
    for role, path in (("env", ENV_MOUNT), ("model", MODEL_MOUNT)):
        built = build_seekable(trees[role], workdir / f"build-{role}", sector_bytes=SECTOR_BYTES)
        data_digest, data_bytes = client.push_blob(REPO, built.data_path)
        index_digest, _ = client.push_blob(REPO, built.index.to_json())
        layers.append(LayerRef(role, path, data_digest, data_bytes, index_digest, data_digest, data_bytes,
                               built.image_path.stat().st_size, len(built.index.prefetch)))
    image = ImageRef(client.url, REPO, "v1", sha256_digest(b"no ordinary image"), sha256_digest(b"no artifact"),
                     "pyfunc", sys.executable, ".".join(map(str, sys.version_info[:3])), tuple(layers))
    return image, trees["model"]


def registry_stopped_during_lazy_read(workdir: Path, *, log=print, faults: tuple[str, ...] = ("kill", "stop"),
                                      read_deadline_s: float = 60.0, recover_deadline_s: float = 60.0) -> FaultResult:
    """Run the scenario under ``workdir``: ``faults`` (``kill``, ``stop``) one after the other."""
    if not faults or not set(faults) <= {"kill", "stop"}:
        raise ValueError(f"faults must name kill and/or stop, not {faults!r}")
    workdir = Path(workdir)
    registry = EmbeddedRegistry(workdir / "registry").start()
    mounts: ImageMounts | None = None
    during: dict[str, list[Read]] = {}
    timings: dict[str, tuple[float | None, float | None]] = {}  # fault → (detect_s, recover_s)
    checks: dict[str, bool] = {}
    try:
        with HttpRegistry(registry.url) as client:
            image, source = sample_image(workdir, client)
        mounts = ImageMounts(workdir / "mounts", MountsConfig(fill="ready"))  # the fill waits for ready()
        model = mounts.acquire(image).model_dir
        before = read_all(model, source, BEFORE, read_deadline_s)
        checks["reads correct while the registry is up"] = all(read.outcome == "ok" for read in before)
        stats = mounts.fetch_stats(image).get("model", {})
        log(f"{mounts.mode} mount of {image.reference} at {model}; {stats.get('sectors_fetched')} model sectors "
            f"fetched before the fault")
        for fault in faults:
            faulted_s = time.monotonic()
            registry.process.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            try:
                during[fault] = read_all(model, source, DURING[fault], read_deadline_s)
            finally:
                restored_s = time.monotonic()
                if fault == "kill":
                    registry.process.wait()
                    registry = EmbeddedRegistry(workdir / "registry", port=registry.port).start()
                else:
                    registry.process.send_signal(signal.SIGCONT)
            after = read_until_correct(model, source, DURING[fault], recover_deadline_s)
            timings[fault] = (first_after(during[fault], "eio", faulted_s), first_after(after, "ok", restored_s))
            checks[f"reads correct again after the {fault}"] = all(read.outcome == "ok" for read in after)
            log(f"{fault}: reads {[read.outcome for read in during[fault]]}, after restoring "
                f"{[read.outcome for read in after]}; (detect_s, recover_s) {timings[fault]}")
    finally:
        if registry.process is not None and registry.process.poll() is None:
            registry.process.send_signal(signal.SIGCONT)  # a stopped process would sit out stop()'s SIGTERM
        try:
            if mounts is not None:
                mounts.close()
        finally:
            registry.stop()
    outage = [read for reads in during.values() for read in reads]
    checks["every read during the outage ended in EIO or correct bytes"] = bool(outage) and all(
        read.outcome in ("ok", "eio") for read in outage)
    checks["no wrong bytes"] = not any(read.outcome == "wrong" for read in outage)
    checks["no read hung past its deadline"] = not any(read.outcome == "hung" for read in outage)
    checks["the outage was noticed (an EIO)"] = all(timings[fault][0] is not None for fault in faults)
    detect_s, recover_s = timings[faults[0]]
    notes = "; ".join(f"{fault}: " + ", ".join(f"{sum(r.outcome == o for r in during[fault])} {o}"
                                                for o in ("ok", "eio", "wrong", "error", "hung"))
                      + f", detect {_round(timings[fault][0])} s, recover {_round(timings[fault][1])} s"
                      for fault in during)
    notes += f"; {mounts.mode if mounts else '?'} mount, {read_deadline_s:.0f} s deadline per read"
    return FaultResult.judged(FAULT, REQUIRED, Tally.of(as_record(r, read_deadline_s) for r in outage), checks,
                              detect_s=detect_s, recover_s=recover_s, notes=notes)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


if __name__ == "__main__":
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="registry-fault-") as scratch:
        chosen = tuple(sys.argv[1:]) or ("kill",)
        print(json.dumps(registry_stopped_during_lazy_read(Path(scratch), faults=chosen).as_dict(), indent=2))
