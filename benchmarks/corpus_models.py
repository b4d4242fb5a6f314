"""A corpus of real architectures from timm, torchvision and transformers, exported to ONNX as users do.

Every model is built with random weights (never downloaded), small enough to export in seconds, and exported
by the TorchScript exporter (`dynamo=False`, opset 17) and the dynamo exporter (`dynamo=True`, opset 18),
with dynamic batch (and sequence) axes. Beside them, files that other tools write: an int8 QDQ model from
`onnxruntime.quantization`, an fp16 model from `onnxconverter-common`, a model saved with external data, a
model with `If` and `Loop`, and a Paddle-style model whose free dimensions are `dim_value: -1`.

An export is cached under `uhop_onnx.foundation.cache.cache_dir()/corpus/` (`$UHOP_CORPUS_CACHE` where set), in a folder named by the model, the exporter
and a hash of its spec and the libraries' versions; a failed export is cached as its error (`error.txt`), the
exporter's limit. Folders are written beside their target and renamed, so a cache entry is whole or absent.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from uhop_onnx.foundation.cache import cache_dir
from uhop_onnx.foundation.files import new_folder

EXPORTERS = {"torchscript": 17, "dynamo": 18}  # exporter -> opset
FORMATS = ("int8-qdq", "fp16", "external-data", "if-loop", "paddle-dims")  # files written by other tools
LIBRARIES = ("torch", "timm", "torchvision", "transformers", "onnx", "onnxscript", "onnxruntime",
             "onnxconverter-common")


@dataclass(frozen=True)
class Input:
    """A model input: `dims` are ints or axis names ("batch", "seq", "past"); `high` > 0 makes it int64
    token ids in [0, high), `high == -1` an int64 attention mask (every row after the first padded over its
    last quarter), else float32 noise."""

    name: str
    dims: tuple[int | str, ...]
    high: int = 0

    def array(self, sizes: dict[str, int], rng: np.random.Generator) -> np.ndarray:
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in self.dims)
        if self.high > 0:
            return rng.integers(0, self.high, shape, dtype=np.int64)
        if self.high == -1:
            mask = np.ones(shape, np.int64)
            mask[1:, shape[-1] - shape[-1] // 4:] = 0
            return mask
        return rng.standard_normal(shape).astype(np.float32)


@dataclass(frozen=True)
class Spec:
    """One corpus model: how to build it, its inputs, and the two input sizes the tests run it at (the
    first is the shape it is measured at)."""

    name: str
    library: str  # the package that defines the architecture (its absence skips the model)
    build: Callable[[], object] | None = field(repr=False)  # -> torch.nn.Module in eval mode
    inputs: tuple[Input, ...]
    outputs: dict[str, dict[int, str]]  # output name -> its dynamic axes
    sizes: tuple[dict[str, int], dict[str, int]] = ({"batch": 1}, {"batch": 2})
    export_sizes: dict[str, int] = field(default_factory=lambda: {"batch": 2, "seq": 16, "past": 8})
    default: bool = False  # in the subset that runs without UHOP_CORPUS=all

    def feeds(self, k: int, seed: int = 0) -> dict[str, np.ndarray]:
        """Inputs at `sizes[k]`, seeded."""
        rng = np.random.default_rng(seed)
        return {i.name: i.array({**self.export_sizes, **self.sizes[k]}, rng) for i in self.inputs}

    def shapes(self, k: int) -> dict[str, tuple[int, ...]]:
        return {name: a.shape for name, a in self.feeds(k).items()}


# ---------------------------------------------------------------- builders

@dataclass(frozen=True)
class Timm:
    """`timm.create_model(name, pretrained=False, **kw)`."""

    name: str
    kw: tuple = ()

    def __call__(self):
        import timm

        return timm.create_model(self.name, pretrained=False, **dict(self.kw)).eval()


@dataclass(frozen=True)
class TorchVision:
    """A torchvision classification, detection or segmentation builder called with `weights=None`."""

    name: str
    kw: tuple = ()

    def __call__(self):
        models = import_torchvision().models
        fn = getattr(models, self.name, None) or getattr(models.detection, self.name, None) \
            or getattr(models.segmentation, self.name)
        return fn(weights=None, **dict(self.kw)).eval()


@dataclass(frozen=True)
class HF:
    """A `transformers` model built from its config object (random weights), returning `fields`; `part`
    names a method that returns the part exported (`get_encoder`)."""

    model: str
    config: str
    kw: tuple = ()
    fields: tuple = ("last_hidden_state",)
    part: str | None = None

    def __call__(self):
        import transformers

        model = getattr(transformers, self.model)(getattr(transformers, self.config)(**dict(self.kw))).eval()
        return _outputs(getattr(model, self.part)() if self.part else model, self.fields)


def _timm(name: str, **kw) -> Timm:
    return Timm(name, tuple(sorted(kw.items())))


def _torchvision(name: str, **kw) -> TorchVision:
    return TorchVision(name, tuple(sorted(kw.items())))


def _hf(model: str, config: str, fields=("last_hidden_state",), part=None, **kw) -> HF:
    return HF(model, config, tuple(sorted(kw.items())), tuple(fields), part)


def import_torchvision():
    """torchvision; where its compiled ops do not load (a wheel built for another torch: PyPI's CUDA build
    beside torch's CPU build), the two ops it registers at import are defined here, `nms` in plain torch, so
    that its models build and export (`nms` becomes ONNX `NonMaxSuppression`). timm imports torchvision when
    it is installed, so this runs before timm is imported."""
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
    import torch

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.impl("nms", _nms, "CPU")
    import_torchvision.library = library  # the definitions live as long as this object
    torchvision = importlib.import_module("torchvision")
    torchvision.extension._has_ops = _has_ops  # read by torchvision's scripted detection code as it compiles
    return torchvision


def _has_ops() -> bool:
    return True


def _nms(boxes, scores, iou_threshold: float):
    import torch

    order = scores.argsort(descending=True)
    keep = []
    while order.numel():
        i = order[0]
        keep.append(i)
        if order.numel() == 1:
            break
        rest = boxes[order[1:]]
        lt = torch.maximum(boxes[i, :2], rest[:, :2])
        rb = torch.minimum(boxes[i, 2:], rest[:, 2:])
        inter = (rb - lt).clamp(min=0).prod(1)
        area = lambda b: (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])  # noqa: E731
        iou = inter / (area(boxes[i]) + area(rest) - inter)
        order = order[1:][iou <= iou_threshold]
    return torch.stack(keep) if keep else torch.empty(0, dtype=torch.int64)


def _outputs(model, fields: tuple[str, ...]):
    """`model` (a `transformers` model) as a module that returns the tuple of its output `fields`."""
    import torch

    class Outputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            out = self.model(*args, return_dict=True)
            return tuple(out[f] for f in fields)

    return Outputs().eval()


_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=1000,
              max_position_embeddings=128)


def _gpt2_with_past():
    import torch
    import transformers

    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=1000, n_positions=128)
    model = transformers.GPT2LMHeadModel(cfg).eval()

    class WithPast(torch.nn.Module):
        """input_ids and the two layers' past keys/values -> logits and the updated keys/values."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, k0, v0, k1, v1):
            cache = transformers.DynamicCache(ddp_cache_data=[(k0, v0), (k1, v1)], config=cfg)
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, return_dict=True)
            cache = out.past_key_values
            return (out.logits, *(t for layer in range(2) for t in (cache.layers[layer].keys,
                                                                    cache.layers[layer].values)))

    return WithPast().eval()


def _whisper_encoder():
    import transformers

    cfg = transformers.WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128,
                                     decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=128,
                                     num_mel_bins=80, max_source_positions=50, vocab_size=1000, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return _outputs(transformers.WhisperModel(cfg).eval().get_encoder(), ("last_hidden_state",))


def _detr():
    import transformers

    backbone = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                         out_features=["stage1", "stage2", "stage3", "stage4"])
    cfg = transformers.DetrConfig(use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False,
                                  d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                  num_queries=10, num_labels=5)
    return _outputs(transformers.DetrForObjectDetection(cfg).eval(), ("logits", "pred_boxes"))


def _speech():
    """A streaming speech recogniser's shape: a strided convolution over mel frames, a bidirectional LSTM, a
    GRU, and per-frame token logits."""
    import torch
    from torch import nn

    class Speech(nn.Module):
        def __init__(self, mels=40, hidden=64, tokens=32):
            super().__init__()
            self.conv = nn.Conv1d(mels, hidden, 3, stride=2, padding=1)
            self.lstm = nn.LSTM(hidden, hidden, batch_first=True, bidirectional=True)
            self.gru = nn.GRU(2 * hidden, hidden, batch_first=True)
            self.head = nn.Linear(hidden, tokens)

        def forward(self, mel):  # (batch, mels, frames)
            x = torch.relu(self.conv(mel)).transpose(1, 2)
            x, _ = self.lstm(x)
            x, _ = self.gru(x)
            return self.head(x).log_softmax(-1)

    torch.manual_seed(0)
    return Speech().eval()


# ---------------------------------------------------------------- the corpus

def _image(size: int, default: bool = False, **kw) -> dict:
    return dict(inputs=(Input("pixels", ("batch", 3, size, size)),), outputs={"y": {0: "batch"}}, default=default, **kw)


_TEXT = dict(inputs=(Input("input_ids", ("batch", "seq"), 1000), Input("attention_mask", ("batch", "seq"), -1)),
             outputs={"hidden": {0: "batch", 1: "seq"}}, sizes=({"batch": 1, "seq": 16}, {"batch": 2, "seq": 24}))
_IDS = dict(inputs=(Input("input_ids", ("batch", "seq"), 1000),), outputs={"hidden": {0: "batch", 1: "seq"}}, sizes=({"batch": 1, "seq": 16}, {"batch": 2, "seq": 24}))
_PAST = tuple(Input(f"{kv}{layer}", ("batch", 2, "past", 32)) for layer in range(2) for kv in "kv")

TORCH_MODELS: list[Spec] = [
    # CNNs
    Spec("timm-resnet18", "timm", _timm("resnet18"), **_image(64, default=True)),
    Spec("timm-mobilenetv3", "timm", _timm("mobilenetv3_small_100"), **_image(64)),
    Spec("timm-efficientnet-b0", "timm", _timm("efficientnet_b0"), **_image(64)),
    Spec("timm-convnext-atto", "timm", _timm("convnext_atto"), **_image(64)),
    Spec("timm-regnetx-002", "timm", _timm("regnetx_002"), **_image(64)),
    Spec("timm-ghostnet", "timm", _timm("ghostnet_100"), **_image(64)),
    Spec("timm-densenet121", "timm", _timm("densenet121"), **_image(64)),
    Spec("timm-repvgg-a0", "timm", _timm("repvgg_a0"), **_image(64)),
    # vision transformers
    Spec("timm-vit-tiny", "timm", _timm("vit_tiny_patch16_224", img_size=64), **_image(64)),
    Spec("timm-deit-tiny", "timm", _timm("deit_tiny_patch16_224", img_size=64), **_image(64)),
    Spec("timm-swin-tiny", "timm", _timm("swin_tiny_patch4_window7_224", embed_dim=24, depths=(1, 1, 2, 1),
                                         num_heads=(1, 2, 3, 4)), **_image(224)),
    Spec("timm-mobilevit-xxs", "timm", _timm("mobilevit_xxs"), **_image(128)),
    Spec("timm-levit-128s", "timm", _timm("levit_128s"), **_image(224)),
    Spec("timm-mixer", "timm", _timm("mixer_s16_224", img_size=64), **_image(64)),
    Spec("tv-resnet18", "torchvision", _torchvision("resnet18"), **_image(64)),
    Spec("tv-mobilenet-v3-small", "torchvision", _torchvision("mobilenet_v3_small"), **_image(64)),
    Spec("tv-squeezenet", "torchvision", _torchvision("squeezenet1_1"), **_image(64)),
    Spec("tv-shufflenet-v2", "torchvision", _torchvision("shufflenet_v2_x0_5"), **_image(64)),
    Spec("tv-mnasnet", "torchvision", _torchvision("mnasnet0_5"), **_image(64)),
    Spec("tv-vit-b16-small", "torchvision", _torchvision("vit_b_16", image_size=64), **_image(64)),
    # detectors and segmentation
    Spec("tv-ssdlite320", "torchvision", _torchvision("ssdlite320_mobilenet_v3_large", weights_backbone=None,
                                                      num_classes=5),
         inputs=(Input("pixels", ("batch", 3, 320, 320)),), outputs={"boxes": {0: "boxes"}, "scores": {0: "boxes"}, "labels": {0: "boxes"}},
         sizes=({"batch": 1}, {"batch": 1}), export_sizes={"batch": 1}),
    Spec("tv-deeplabv3-mobilenet", "torchvision", _torchvision("deeplabv3_mobilenet_v3_large", weights_backbone=None,
                                                               num_classes=5, aux_loss=False),
         inputs=(Input("pixels", ("batch", 3, 64, 64)),), outputs={"out": {0: "batch"}}),
    Spec("hf-detr", "transformers", _detr, inputs=(Input("pixels", ("batch", 3, 64, 64)),),
         outputs={"logits": {0: "batch"}, "pred_boxes": {0: "batch"}}),
    # text encoders and decoders
    Spec("hf-bert", "transformers", _hf("BertModel", "BertConfig", **_SMALL), **_TEXT, default=True),
    Spec("hf-distilbert", "transformers", _hf("DistilBertModel", "DistilBertConfig", dim=64, n_layers=2, n_heads=2,
                                              hidden_dim=128, vocab_size=1000, max_position_embeddings=128), **_TEXT),
    Spec("hf-roberta", "transformers", _hf("RobertaModel", "RobertaConfig", **{**_SMALL, "max_position_embeddings": 130}),
         **_TEXT),
    Spec("hf-albert", "transformers", _hf("AlbertModel", "AlbertConfig", embedding_size=32, **_SMALL), **_TEXT),
    Spec("hf-electra", "transformers", _hf("ElectraModel", "ElectraConfig", embedding_size=32, **_SMALL), **_TEXT),
    Spec("hf-gpt2", "transformers", _hf("GPT2Model", "GPT2Config", n_embd=64, n_layer=2, n_head=2, vocab_size=1000,
                                        n_positions=128), **_IDS),
    Spec("hf-gpt2-past", "transformers", _gpt2_with_past,
         inputs=(Input("input_ids", ("batch", "seq"), 1000), *_PAST),
         outputs={"logits": {0: "batch", 1: "seq"}, **{f"{n}_out": {0: "batch", 2: "total"} for n in ("k0", "v0", "k1", "v1")}},
         sizes=({"batch": 1, "seq": 1, "past": 8}, {"batch": 2, "seq": 1, "past": 12}),
         export_sizes={"batch": 2, "seq": 3, "past": 8}, default=True),
    Spec("hf-t5-encoder", "transformers", _hf("T5EncoderModel", "T5Config", d_model=64, d_kv=32, d_ff=128,
                                              num_layers=2, num_heads=2, vocab_size=1000), **_IDS),
    Spec("hf-bart-encoder", "transformers", _hf("BartModel", "BartConfig", part="get_encoder", d_model=64,
                                                encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
                                                decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                                vocab_size=1000, max_position_embeddings=128), **_IDS),
    # audio
    Spec("hf-whisper-encoder", "transformers", _whisper_encoder, inputs=(Input("features", ("batch", 80, 100)),),
         outputs={"hidden": {0: "batch"}}),
    Spec("hf-wav2vec2", "transformers", _hf("Wav2Vec2Model", "Wav2Vec2Config", hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, intermediate_size=128, conv_dim=(32, 32),
                                            conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                            num_conv_pos_embedding_groups=4, do_stable_layer_norm=True),
         inputs=(Input("audio", ("batch", "seq")),), outputs={"hidden": {0: "batch", 1: "frames"}},
         sizes=({"batch": 1, "seq": 1600}, {"batch": 2, "seq": 2400}), export_sizes={"batch": 2, "seq": 2000}),
    Spec("torch-lstm-gru-speech", "torch", _speech, inputs=(Input("mel", ("batch", 40, "seq")),), outputs={"logp": {0: "batch", 1: "frames"}},
         sizes=({"batch": 1, "seq": 50}, {"batch": 2, "seq": 80}), export_sizes={"batch": 2, "seq": 64}, default=True),
]


def spec(name: str) -> Spec:
    return next(s for s in TORCH_MODELS if s.name == name)


# ---------------------------------------------------------------- exporting and caching

def versions() -> dict[str, str | None]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def missing(s: Spec) -> str | None:
    """Why `s` cannot be built here (a package is absent), or None."""
    for package in ("torch", "torchvision", s.library) if s.library != "onnx" else ():
        try:
            import_torchvision() if package == "torchvision" else importlib.import_module(package)
        except ImportError as e:
            if package == s.library or package == "torch":
                return f"{package} is not installed ({e}); pip install {package}"
    return None


def _folder(name: str, exporter: str, text: str) -> Path:
    key = hashlib.sha256(f"{text}\0{sorted(versions().items())}".encode()).hexdigest()[:12]
    return Path(os.environ.get("UHOP_CORPUS_CACHE") or cache_dir() / "corpus") / f"{name}-{exporter}-{key}"


def _spec_text(s: Spec, exporter: str) -> str:
    """What an export depends on: the spec, how the model is built (a builder's fields, or a function's
    source), the exporter and its opset."""
    build = inspect.getsource(s.build) if inspect.isfunction(s.build) else repr(s.build)
    return repr((s, build, exporter, EXPORTERS.get(exporter), inspect.getsource(_export)))


class ExportFailed(Exception):
    """The exporter could not export the model: its limit, with its error."""


def exported(s: Spec, exporter: str) -> Path:
    """The cached ONNX file of `s` exported by `exporter` (building it first); `ExportFailed` with the
    exporter's error where it cannot."""
    folder = _folder(s.name, exporter, _spec_text(s, exporter))
    return _cached(folder, lambda out: _export(s, exporter, out))


def _cached(folder: Path, write: Callable[[Path], None]) -> Path:
    if not folder.exists():
        try:
            with new_folder(folder) as staging:
                try:
                    write(staging / "model.onnx")
                except Exception as e:  # noqa: BLE001 -- every exporter error is the exporter's limit
                    for f in staging.iterdir():
                        f.unlink()
                    (staging / "error.txt").write_text(_describe(e))
        except Exception:
            if not folder.exists():  # another process finished first: theirs stands
                raise
    if (folder / "error.txt").exists():
        raise ExportFailed((folder / "error.txt").read_text())
    return folder / "model.onnx"


def _describe(e: BaseException) -> str:
    """The innermost error of the chain (where exporters say why) and, after it, the outermost one's first line."""
    inner = e
    while inner.__cause__ or inner.__context__:
        inner = inner.__cause__ or inner.__context__
    lines = [f"{type(x).__name__}: {(str(x).strip().splitlines() or [''])[0]}" for x in dict.fromkeys((inner, e))]
    return re.sub(r"\x1b\[[0-9;]*m", "", " (from ".join(lines) + ")" * (len(lines) - 1))[:1000]


def _export(s: Spec, exporter: str, path: Path) -> None:
    import_torchvision()  # before the model's library imports it
    import torch

    torch.manual_seed(0)
    model = s.build()
    rng = np.random.default_rng(0)
    example = tuple(torch.from_numpy(i.array(s.export_sizes, rng)) for i in s.inputs)
    axes = {i.name: {k: d for k, d in enumerate(i.dims) if isinstance(d, str)} for i in s.inputs}
    axes.update(s.outputs)
    with torch.no_grad():
        if exporter == "torchscript":
            torch.onnx.export(model, example, str(path), input_names=[i.name for i in s.inputs],
                              output_names=list(s.outputs), dynamic_axes=axes, opset_version=17, dynamo=False)
        else:
            dims = {d: torch.export.Dim(d) for i in s.inputs for d in i.dims if isinstance(d, str)}
            shapes = tuple({k: dims[d] for k, d in enumerate(i.dims) if isinstance(d, str)} for i in s.inputs)
            if any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(model.forward).parameters.values()):
                shapes = (shapes,)  # the shapes of `forward(*args)` are those of its one parameter, args
            program = torch.onnx.export(model, example, input_names=[i.name for i in s.inputs],
                                        output_names=list(s.outputs), dynamic_shapes=shapes, opset_version=18,
                                        dynamo=True, verbose=False)
            program.save(str(path))
    onnx.checker.check_model(str(path))


# ---------------------------------------------------------------- files other tools write

def _qdq(base: Path, out: Path, s: Spec) -> None:
    """Static int8 quantization (QDQ format), calibrated on a few seeded samples."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Samples(CalibrationDataReader):
        def __init__(self):
            self.left = [s.feeds(k % 2, seed=k) for k in range(8)]

        def get_next(self):
            return self.left.pop() if self.left else None

    quantize_static(str(base), str(out), Samples(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8)


def _fp16(base: Path, out: Path, s: Spec) -> None:
    """Every float tensor in fp16, the inputs and outputs kept fp32 (onnxconverter-common's usual call)."""
    from onnxconverter_common import float16

    onnx.save(float16.convert_float_to_float16(onnx.load(base), keep_io_types=True), out)


def _external(base: Path, out: Path, s: Spec) -> None:
    """The same model with every initializer in one external data file beside it."""
    onnx.save(onnx.load(base), out, save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=0)


def _paddle_dims(base: Path, out: Path, s: Spec) -> None:
    """Free dimensions as Paddle's exporter writes them: `dim_value: -1` (shape information inside dropped)."""
    model = onnx.load(base)
    del model.graph.value_info[:]
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.Clear()
                dim.dim_value = -1
    onnx.save(model, out)


def _if_loop(base: Path | None, out: Path, s: Spec) -> None:
    """x (batch, 8) -> If(sum(x) > 0: relu(x) else -x), then a Loop of 3 steps y = tanh(y @ W + x)."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32) * 0.3, "W")
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    orelse = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    body = helper.make_graph(
        [helper.make_node("MatMul", ["y_in", "W"], ["m"]), helper.make_node("Add", ["m", "x"], ["a"]),
         helper.make_node("Tanh", ["a"], ["y_out"]), helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("y_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("y_out", TensorProto.FLOAT, None)])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["chosen"], then_branch=then, else_branch=orelse),
        helper.make_node("Constant", [], ["steps"], value=helper.make_tensor("steps", TensorProto.INT64, [], [3])),
        helper.make_node("Constant", [], ["true"], value=helper.make_tensor("true", TensorProto.BOOL, [], [True])),
        helper.make_node("Loop", ["steps", "true", "chosen"], ["y"], body=body),
    ]
    graph = helper.make_graph(nodes, "if_loop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, out)


@dataclass(frozen=True)
class FileSpec:
    """A corpus file written by another tool: `convert(base, out, spec)` rewrites the TorchScript export of
    `base` (None: built from nothing); `tolerance` is (rtol, atol) against ONNX Runtime on the same file."""

    name: str
    base: str | None
    convert: Callable[[Path | None, Path, Spec], None]
    tolerance: tuple[float, float]
    why: str  # what the tolerance allows for
    spec: Spec | None = None  # inputs of a file built from nothing

    @property
    def inputs_spec(self) -> Spec:
        return self.spec or spec(self.base)


_FP32 = (1e-4, 1e-5)
FILES: list[FileSpec] = [
    # An int8 plan's providers each requantize between QDQ pairs with their own integer kernels (OpenVINO fuses
    # the pairs into integer convolutions, ONNX Runtime runs QLinear ops): a value on a rounding boundary can land
    # one step apart and later layers carry it. The logits here are within +-0.3 (scale about 0.002 a step):
    # 0.02 allows about ten steps.
    FileSpec("int8-qdq", "timm-resnet18", _qdq, (0.0, 2e-2), "about ten int8 steps of the logits' scale"),
    # fp16 arithmetic differs by provider (fp16 or fp32 accumulation, fused or per-op rounding): fp16's 1e-3
    # relative precision per op, over the network's depth.
    FileSpec("fp16", "timm-resnet18", _fp16, (1e-2, 1e-3), "fp16 rounding per op, fp32 or fp16 accumulation"),
    FileSpec("external-data", "hf-bert", _external, _FP32, "fp32"),
    FileSpec("if-loop", None, _if_loop, _FP32, "fp32",
             Spec("if-loop", "onnx", None, (Input("x", ("batch", 8)),), {"y": {0: "batch"}})),
    FileSpec("paddle-dims", "timm-mobilenetv3", _paddle_dims, _FP32, "fp32"),
]


def file_spec(name: str) -> FileSpec:
    return next(f for f in FILES if f.name == name)


def written(f: FileSpec) -> Path:
    """The cached file of `f` (its base exported first); `ExportFailed` where the base or the tool failed."""
    base = exported(spec(f.base), "torchscript") if f.base else None
    text = repr((f.name, f.base, inspect.getsource(f.convert), f.inputs_spec, _spec_text(spec(f.base), "torchscript")
                 if f.base else None))
    return _cached(_folder(f.name, "file", text), lambda out: f.convert(base, out, f.inputs_spec))


def case(name: str) -> tuple[Path, dict[str, np.ndarray]]:
    """A corpus model's file and its inputs at its first size, by name: a model (`timm-resnet18`, exported by
    TorchScript, or `hf-bert@dynamo`) or a file other tools write (`int8-qdq`, ...). Exported on first use."""
    model, _, exporter = name.partition("@")
    if model in FORMATS:
        f = file_spec(model)
        return written(f), f.inputs_spec.feeds(0)
    import_torchvision()
    s = spec(model)
    return exported(s, exporter or "torchscript"), s.feeds(0)

