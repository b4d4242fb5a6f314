"""A bundle closes what it loaded: `close()` (or a `with` block) closes its runners and removes an archive's
unpacked files, and a stage that fails to load closes the runners loaded before it."""

from __future__ import annotations

import pytest

import uhop_onnx
from uhop_onnx.foundation.errors import UhopError
from uhop_onnx.models import mlp
from uhop_onnx.providers import REGISTRY

from .conftest import assert_matches, random_feeds, reference


def closing_recorded(monkeypatch, ident: str) -> list[list[bool]]:
    """Each runner `ident`'s provider loads from a bundle, as `[closed]`, set when it is closed."""
    provider, loaded = REGISTRY[ident], []
    load = provider.load_artifact

    def recorded(*args, **kwargs):
        runner, state = load(*args, **kwargs), [False]
        close = runner.close
        runner.close = lambda: (state.__setitem__(0, True), close())[1]
        loaded.append(state)
        return runner

    monkeypatch.setattr(provider, "load_artifact", recorded)
    return loaded


def test_close_releases_the_runners_and_the_unpacked_archive(tmp_path, monkeypatch):
    archive = uhop_onnx.export_bundle(mlp(), "x86-64", tmp_path / "b.tar.gz", providers=["ort-cpu"])
    loaded = closing_recorded(monkeypatch, "ort-cpu")
    feeds = random_feeds(mlp())
    with uhop_onnx.load_bundle(archive) as bundle:
        assert_matches(bundle.run(None, feeds), reference(mlp(), feeds))
        unpacked = bundle.folder
        assert unpacked.is_dir() and loaded == [[False]]
    assert loaded == [[True]] and not unpacked.exists()


def test_a_stage_that_fails_to_load_closes_those_loaded_before_it(tmp_path, monkeypatch):
    assign = {node.name: "ort-cuda" if node.name == "/fc2/Gemm" else "ort-cpu" for node in mlp().graph.node}
    bundle = uhop_onnx.export_bundle(mlp(), "jetson-orin", tmp_path / "b", providers=["ort-cuda", "ort-cpu"],
                                     assign=assign)  # a CUDA stage after an ONNX Runtime CPU one
    if REGISTRY["ort-cuda"]().present:
        pytest.skip("CUDA is here: its stage loads")
    loaded = closing_recorded(monkeypatch, "ort-cpu")
    with pytest.raises(UhopError):
        uhop_onnx.load_bundle(bundle)
    assert loaded and all(state == [True] for state in loaded), loaded
