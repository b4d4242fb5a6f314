"""A LiteRT conversion checked on this machine is kept: the same stage compiles again without converting,
and a kept file that is not the bytes that were checked is converted again."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import uhop_onnx
from uhop_onnx.models import cnn

from .conftest import assert_matches, random_feeds, reference


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "litert"


def _compile(caplog) -> tuple[uhop_onnx.InferenceSession, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="uhop_onnx.providers.litert"):
        session = uhop_onnx.InferenceSession(cnn(seed=21), providers=["litert"], profile=False)
    return session, [r.getMessage() for r in caplog.records if r.name == "uhop_onnx.providers.litert"]


def test_a_checked_conversion_is_reused_and_a_damaged_one_redone(fresh_cache, caplog):
    pytest.importorskip("ai_edge_litert")
    first, said = _compile(caplog)
    assert said and all("converted in" in m for m in said)
    again, said = _compile(caplog)
    assert said and all("converted and verified earlier on this machine" in m for m in said)
    feeds = random_feeds(cnn(seed=21))
    assert_matches(again.run(None, feeds), reference(cnn(seed=21), feeds))
    for kept in fresh_cache.glob("*.tflite"):
        kept.write_bytes(kept.read_bytes()[:-8] + np.zeros(8, np.uint8).tobytes())
    third, said = _compile(caplog)
    assert any("not the conversion that was checked" in m for m in said)
    assert any("converted in" in m for m in said)
    assert_matches(third.run(None, feeds), reference(cnn(seed=21), feeds))
