"""``ImageRef``: what a revision's replicas start from, as stored with the revision (JSON).

The ordinary OCI image (any runtime can pull and run it) and, per layer, its seekable form
(index and data blobs) that modelplane's local backend mounts lazily. ``python`` is the
interpreter the environment layer's venv runs on (its ``pyvenv.cfg`` home).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

ENV_MOUNT = "opt/modelplane/env"
MODEL_MOUNT = "opt/modelplane/model"


@dataclass(frozen=True)
class LayerRef:
    role: str  # "env" | "model"
    path: str  # where the layer's tree sits in the image root (ENV_MOUNT, MODEL_MOUNT)
    layer_digest: str  # the ordinary tar+gzip layer
    layer_bytes: int
    index_digest: str  # the seekable index blob
    data_digest: str  # the seekable sectors blob
    data_bytes: int
    filesystem_bytes: int  # the squashfs image the sectors cut
    prefetch_sectors: int


@dataclass(frozen=True)
class ImageRef:
    registry: str  # http://127.0.0.1:5000
    repo: str
    tag: str
    manifest_digest: str
    seekable_digest: str  # the artifact manifest whose subject is manifest_digest
    runtime: str
    python: str  # the interpreter the environment runs on
    python_version: str
    layers: tuple[LayerRef, ...]

    def layer(self, role: str) -> LayerRef:
        for layer in self.layers:
            if layer.role == role:
                return layer
        raise KeyError(f"image {self.reference} has no {role} layer")

    @property
    def reference(self) -> str:
        host = self.registry.split("://", 1)[-1]
        return f"{host}/{self.repo}@{self.manifest_digest}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ImageRef:
        return cls(**{**data, "layers": tuple(LayerRef(**layer) for layer in data["layers"])})
