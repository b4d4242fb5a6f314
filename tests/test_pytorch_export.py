"""A model exported from PyTorch, as users bring them: `/layer1/...` names, folded batch norms, a dynamic batch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import uhop_onnx

from .conftest import assert_matches, reference

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
nn = torch.nn

PROVIDERS = ["openvino", "ort-cpu"]


class Block(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(x + self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.layer1 = nn.Sequential(Block(16), Block(16))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.layer1(torch.relu(self.conv(x)))
        return torch.softmax(self.fc(torch.flatten(self.pool(x), 1)), -1)


@pytest.fixture(scope="module", params=["torchscript", "dynamo"])
def exported(request, tmp_path_factory):
    torch.manual_seed(0)
    net = Net().eval()
    path = tmp_path_factory.mktemp("torch") / f"net_{request.param}.onnx"
    torch.onnx.export(net, (torch.randn(1, 3, 32, 32),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, dynamo=request.param == "dynamo")
    return path


def _feeds(path):
    name = onnx.load(path).graph.input[0].name
    return {name: np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)}


def test_runs_whole(exported):
    feeds = _feeds(exported)
    session = uhop_onnx.InferenceSession(str(exported), providers=PROVIDERS, profile=False)
    assert session.get_providers() == ["openvino"]
    assert_matches(session.run(None, feeds), reference(onnx.load(exported), feeds))


def test_runs_under_a_forced_alternating_assignment(exported):
    feeds = _feeds(exported)
    names = [n.name for n in uhop_onnx.load(exported).graph.node]
    assign = {name: PROVIDERS[i % 2] for i, name in enumerate(names)}
    session = uhop_onnx.InferenceSession(str(exported), providers=PROVIDERS, assign=assign, profile=False)
    assert len(session.plan.stages) > 2
    assert_matches(session.run(None, feeds), reference(onnx.load(exported), feeds))


@pytest.mark.parametrize("provider", ["litert", "openvino"])
def test_a_torchscript_encoder_runs_whole_once_its_shape_arithmetic_folds(tmp_path, provider):
    """TorchScript exports attention with Shape -> Gather -> Concat -> Reshape chains; at a static input shape
    they fold to constants, so a runtime that compiles static graphs takes the whole encoder."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    net = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    path = tmp_path / "encoder.onnx"
    torch.onnx.export(net, (torch.randn(1, 16, 32),), str(path), input_names=["x"], output_names=["y"], dynamo=False)
    assert "Shape" in {node.op_type for node in onnx.load(path).graph.node}
    session = uhop_onnx.InferenceSession(str(path), providers=[provider], profile=False)
    assert session.get_providers() == [provider]
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 16, 32)).astype(np.float32)}
    assert_matches(session.run(None, feeds), reference(onnx.load(path), feeds))
