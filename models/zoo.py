"""The model classes of Rockchip's rknn_model_zoo, built by their own libraries (torchvision, timm, ultralytics) or
written in plain PyTorch after the zoo's architectures (a PP-OCR-like det/rec pair, a RetinaFace-style detector),
with random weights, and exported with free batch, height and width, as users export them. Used by
`benchmarks/rknn_zoo.py` (at the zoo's input sizes) and `tests/test_rknn_zoo.py` (at small ones).

The libraries are imported when a model is built (`available` says which is missing). A torchvision wheel built
for another torch fails at import: make it importable first (`benchmarks.corpus_models.import_torchvision`, as
the tests' conftest does).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ZOO_README = ("https://github.com/airockchip/rknn_model_zoo/blob/eaa94d6f57ca553d493bf3bd7399a070452d2774/"
              "README.md")  # "Model performance benchmark(FPS)", column RK3588 @single_core


@dataclass(frozen=True)
class ZooModel:
    name: str
    build: Callable[[], object]  # -> a torch.nn.Module in eval mode
    shape: tuple[int, ...]  # the zoo's input size
    small: tuple[int, ...]  # the test's
    published_fps: float | None = None  # RK3588, one NPU core, int8 (the zoo's README)
    zoo_model: str = ""  # the zoo's model it is compared with
    library: str = "torch"  # what must be importable to build it


def _torchvision(name: str, **kw):
    def build():
        return getattr(importlib.import_module("torchvision").models, name)(weights=None, **kw).eval()
    return build


def _timm(name: str):
    def build():
        import timm

        return timm.create_model(name, pretrained=False).eval()
    return build


def _ultralytics(config: str):
    def build():
        from ultralytics.nn.tasks import DetectionModel

        model = DetectionModel(config, verbose=False).eval()
        for module in model.modules():  # as ultralytics' own ONNX export sets its head
            if hasattr(module, "export"):
                module.export, module.format, module.dynamic = True, "onnx", True
        return model
    return build


def _own(name: str):
    def build():
        return globals()[f"_{name}"]().eval()
    return build


def _backbone(name: str, cuts: list[int], **kw):
    """A torchvision backbone's feature stages, cut after the given layer indices, and each stage's channels."""
    import torch

    features = getattr(importlib.import_module("torchvision").models, name)(weights=None, **kw).features
    stages = torch.nn.ModuleList(features[a:b] for a, b in zip([0, *cuts], [*cuts, len(features)]))
    x, channels = torch.zeros(1, 3, 64, 64), []
    for stage in stages:
        x = stage(x)
        channels.append(x.shape[1])
    return stages, channels


def _laterals(stages, laterals, x) -> list:
    """The lateral convolution of each backbone stage's output, shallowest first (an FPN's inputs)."""
    levels = []
    for stage, lateral in zip(stages, laterals):
        x = stage(x)
        levels.append(lateral(x))
    return levels


def _conv(c1: int, c2: int, k: int = 3, s: int | tuple[int, int] = 1):
    from torch import nn

    return nn.Sequential(nn.Conv2d(c1, c2, k, s, k // 2, bias=False), nn.BatchNorm2d(c2), nn.ReLU())


def _RetinaFace(width: int = 64, anchors: int = 2):
    """RetinaFace-mobile: MobileNet (x0.25) stages at strides 8, 16, 32, an FPN, SSH context modules, and per
    level class, box and landmark heads, reshaped and concatenated per anchor, class scores by softmax."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class RetinaFace(nn.Module):
        def __init__(self):
            super().__init__()
            self.stages, channels = _backbone("mobilenet_v2", [7, 14], width_mult=0.25)
            self.lateral = nn.ModuleList(_conv(c, width, 1) for c in channels)
            self.smooth = nn.ModuleList(_conv(width, width) for _ in channels[:-1])
            self.ssh = nn.ModuleList(nn.ModuleList([_conv(width, width // 2), _conv(width, width // 4),
                                                    _conv(width // 4, width // 4), _conv(width // 4, width // 4)])
                                     for _ in channels)
            self.heads = nn.ModuleList(nn.ModuleList(nn.Conv2d(width, anchors * k, 1) for k in (2, 4, 10))
                                       for _ in channels)

        def forward(self, x):
            levels = _laterals(self.stages, self.lateral, x)
            for k in (1, 0):  # top-down
                up = F.interpolate(levels[k + 1], size=levels[k].shape[-2:], mode="nearest")
                levels[k] = self.smooth[k](levels[k] + up)
            outs = [[], [], []]
            for f, (a, b, c, d), heads in zip(levels, self.ssh, self.heads):
                b1 = b(f)
                f = F.relu(torch.cat([a(f), c(b1), d(c(b1))], 1))
                for out, head in zip(outs, heads):
                    y = head(f).permute(0, 2, 3, 1)
                    out.append(y.reshape(y.shape[0], -1, head.out_channels // anchors))
            boxes, scores, marks = (torch.cat(o, 1) for o in (outs[1], outs[0], outs[2]))
            return boxes, F.softmax(scores, -1), marks

    return RetinaFace()


def _TextDetector(width: int = 96):
    """PP-OCR-like text detection (DB): MobileNetV3-small stages at strides 4 to 32, an FPN whose levels are
    upsampled to stride 4 and concatenated, and a head of convolutions and two transposed convolutions to a
    probability map."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class TextDetector(nn.Module):
        def __init__(self):
            super().__init__()
            self.stages, channels = _backbone("mobilenet_v3_small", [2, 4, 9])
            self.lateral = nn.ModuleList(nn.Conv2d(c, width, 1) for c in channels)
            self.smooth = nn.ModuleList(nn.Conv2d(width, width // 4, 3, padding=1) for _ in channels)
            self.head = nn.Sequential(_conv(width, width // 4), nn.ConvTranspose2d(width // 4, width // 4, 2, 2),
                                      nn.BatchNorm2d(width // 4), nn.ReLU(), nn.ConvTranspose2d(width // 4, 1, 2, 2),
                                      nn.Sigmoid())

        def forward(self, x):
            levels = _laterals(self.stages, self.lateral, x)
            for k in (2, 1, 0):
                levels[k] = levels[k] + F.interpolate(levels[k + 1], size=levels[k].shape[-2:], mode="nearest")
            size = levels[0].shape[-2:]
            fused = torch.cat([F.interpolate(smooth(f), size=size, mode="nearest")
                               for smooth, f in zip(self.smooth, levels)], 1)
            return self.head(fused)

    return TextDetector()


def _TextRecognizer(width: int = 128, classes: int = 97):
    """PP-OCR-like text recognition (SVTR-style): a convolution stack that keeps the width, the height
    averaged away, one self-attention block over the columns, and per-column class probabilities."""
    from torch import nn
    from torch.nn import functional as F

    class TextRecognizer(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.Sequential(_conv(3, 32, s=2), _conv(32, 64, s=2), _conv(64, width, s=(2, 1)),
                                       _conv(width, width, s=(2, 1)))
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            self.classify = nn.Linear(width, classes)

        def forward(self, x):
            x = self.convs(x).mean(2).permute(0, 2, 1)  # [batch, columns, width]
            q, k, v = self.qkv(self.norm1(x)).chunk(3, -1)
            attention = F.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, -1)
            x = x + self.proj(attention @ v)
            x = x + self.mlp(self.norm2(x))
            return F.softmax(self.classify(x), -1)

    return TextRecognizer()


ZOO = [
    ZooModel("mobilenetv2", _torchvision("mobilenet_v2"), (1, 3, 224, 224), (1, 3, 96, 96), 433.0,
             "mobilenetv2-12", "torchvision"),
    ZooModel("resnet50", _torchvision("resnet50"), (1, 3, 224, 224), (1, 3, 64, 64), 108.6, "resnet50-v2-7",
             "torchvision"),
    ZooModel("resnet18-timm", _timm("resnet18"), (1, 3, 224, 224), (1, 3, 64, 64), None, "", "timm"),
    ZooModel("yolov8n", _ultralytics("yolov8n.yaml"), (1, 3, 640, 640), (1, 3, 160, 160), 59.6, "yolov8n",
             "ultralytics"),
    ZooModel("yolov8s", _ultralytics("yolov8s.yaml"), (1, 3, 640, 640), (1, 3, 160, 160), 32.8, "yolov8s",
             "ultralytics"),
    ZooModel("yolo11n", _ultralytics("yolo11n.yaml"), (1, 3, 640, 640), (1, 3, 160, 160), None, "",
             "ultralytics"),
    ZooModel("retinaface-mobile", _own("RetinaFace"), (1, 3, 320, 320), (1, 3, 160, 160), 234.7,
             "RetinaFace_mobile320", "torchvision"),
    ZooModel("ppocr-det", _own("TextDetector"), (1, 3, 480, 480), (1, 3, 96, 96), 43.0, "ppocrv4_det",
             "torchvision"),
    ZooModel("ppocr-rec", _own("TextRecognizer"), (1, 3, 48, 320), (1, 3, 32, 128), None, "", "torch"),
]


def available(model: ZooModel) -> str | None:
    """Why `model` cannot be built here (its library is missing), or None."""
    for library in ("torch", model.library):
        if importlib.util.find_spec(library) is None:
            return f"{library} is not installed"
    return None


def export_onnx(model: ZooModel, path: Path) -> Path:
    """`model` exported by PyTorch's TorchScript exporter (opset 17) with free batch, height and width."""
    import torch

    module = model.build()
    example = torch.zeros(model.small)
    with torch.no_grad():
        outputs = module(example)
    count = len(outputs) if isinstance(outputs, (tuple, list)) else 1
    names = [f"output{k}" for k in range(count)]
    torch.onnx.export(module, example, str(path), input_names=["images"], output_names=names, opset_version=17,
                      dynamic_axes={"images": {0: "batch", 2: "height", 3: "width"}}, dynamo=False)
    return path


def calibration(shape: tuple[int, ...], count: int = 4) -> dict[str, np.ndarray]:
    """Calibration samples: smooth random images in [0, 1] (a sample axis first)."""
    rng = np.random.default_rng(0)
    return {"images": rng.random((count, *shape)).astype(np.float32)}
