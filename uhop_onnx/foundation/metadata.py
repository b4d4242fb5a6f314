"""A model's own description: plain data, read without onnx."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def model_name(source: object, graph_name: str) -> str:
    """A model's name for plans and logs: its file's stem, else its graph's name."""
    if isinstance(source, (str, os.PathLike)):
        return os.path.splitext(os.path.basename(os.fspath(source)))[0]
    return graph_name or "model"


@dataclass(frozen=True)
class ModelMetadata:
    """The model's own description, as onnxruntime's `ModelMetadata` gives it."""

    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    graph_description: str = ""
    version: int = 0
    custom_metadata_map: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model) -> ModelMetadata:
        """The metadata of an `onnx.ModelProto`; an unset version is the largest int64, as onnxruntime says."""
        version = model.model_version if model.HasField("model_version") else 2**63 - 1
        return cls(model.producer_name, model.graph.name, model.domain, model.doc_string, model.graph.doc_string,
                   version, {p.key: p.value for p in model.metadata_props})
