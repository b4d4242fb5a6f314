"""Reference models built with onnx.helper: deterministic weights (seeded), opset 17, IR version 8.

Each builder returns an `onnx.ModelProto` whose nodes have names in the style of PyTorch exports
(`/block1/conv/Conv`), so tests see what users' models look like.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8


class _Builder:
    """Collects nodes and initializers; names every node `/{scope}/{Op}`."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def weight(self, name: str, shape: tuple[int, ...], scale: float | None = None) -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        scale = scale if scale is not None else 1.0 / np.sqrt(max(fan_in, 1))
        self.initializers.append(numpy_helper.from_array((self.rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def const(self, name: str, value) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], scope: str, outputs: int = 1, **attrs) -> str:
        names = [f"{scope}/{op_type}_output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=f"{scope}/{op_type}", **attrs))
        return names[0]

    def conv(self, x: str, scope: str, cin: int, cout: int, k: int = 3, stride: int = 1, group: int = 1,
             relu: bool = True) -> str:
        w = self.weight(f"{scope}.weight", (cout, cin // group, k, k))
        b = self.weight(f"{scope}.bias", (cout,), scale=0.1)
        y = self.op("Conv", [x, w, b], f"{scope}/conv", kernel_shape=[k, k], strides=[stride, stride],
                    pads=[k // 2] * 4, group=group)
        return self.op("Relu", [y], f"{scope}/relu") if relu else y

    def model(self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                                  producer_name="uhop-onnx.models")
        onnx.checker.check_model(model)
        return onnx.shape_inference.infer_shapes(model)


def _io(name: str, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def mlp(batch: int = 4, sizes: tuple[int, ...] = (64, 128, 128, 10), seed: int = 0) -> onnx.ModelProto:
    """Gemm/MatMul + Add + Relu layers, softmax at the end."""
    b = _Builder(seed)
    x = "input"
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        scope = f"/fc{i}"
        if i % 2 == 0:
            x = b.op("Gemm", [x, b.weight(f"fc{i}.weight", (n_out, n_in)), b.weight(f"fc{i}.bias", (n_out,), 0.1)],
                     scope, transB=1)
        else:
            x = b.op("MatMul", [x, b.weight(f"fc{i}.weight", (n_in, n_out))], scope)
            x = b.op("Add", [x, b.weight(f"fc{i}.bias", (n_out,), 0.1)], scope)
        if i < len(sizes) - 2:
            x = b.op("Relu", [x], f"{scope}/relu")
    b.nodes.append(helper.make_node("Softmax", [x], ["output"], name="/softmax/Softmax", axis=-1))
    return b.model("mlp", [_io("input", [batch, sizes[0]])], [_io("output", [batch, sizes[-1]])])


def cnn(size: int = 32, channels: tuple[int, ...] = (3, 16, 32, 32), classes: int = 10, seed: int = 1) -> onnx.ModelProto:
    """Conv + Relu + MaxPool blocks, global average pool, flatten, Gemm."""
    b = _Builder(seed)
    x = "input"
    for i, (cin, cout) in enumerate(zip(channels, channels[1:])):
        x = b.conv(x, f"/block{i}", cin, cout)
        x = b.op("MaxPool", [x], f"/block{i}/pool", kernel_shape=[2, 2], strides=[2, 2])
    return _head(b, x, channels[-1], classes, "cnn", [1, channels[0], size, size])


def resnet(size: int = 32, width: int = 16, blocks: int = 3, classes: int = 10, seed: int = 2) -> onnx.ModelProto:
    """A stem conv, then residual blocks (conv-relu-conv, add the skip, relu), then the head."""
    b = _Builder(seed)
    x = b.conv("input", "/stem", 3, width)
    for i in range(blocks):
        y = b.conv(x, f"/layer{i}/conv1", width, width)
        y = b.conv(y, f"/layer{i}/conv2", width, width, relu=False)
        x = b.op("Relu", [b.op("Add", [x, y], f"/layer{i}/add")], f"/layer{i}/relu")
    return _head(b, x, width, classes, "resnet", [1, 3, size, size])


def resnet50(size: int = 224, classes: int = 1000, seed: int = 6) -> onnx.ModelProto:
    """ResNet-50's shape: a 7x7 stem, bottleneck blocks 3-4-6-3 (1x1, 3x3, 1x1 convs; a 1x1 projection where
    the width or stride changes), 25.6 M weights (100 MB), 224x224 by default."""
    b = _Builder(seed)
    x = b.conv("input", "/stem", 3, 64, k=7, stride=2)
    x = b.op("MaxPool", [x], "/stem/pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for i, (width, count) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for j in range(count):
            scope, stride = f"/layer{i + 1}/{j}", 2 if j == 0 and i > 0 else 1
            y = b.conv(x, f"{scope}/conv1", cin, width, k=1)
            y = b.conv(y, f"{scope}/conv2", width, width, stride=stride)
            y = b.conv(y, f"{scope}/conv3", width, 4 * width, k=1, relu=False)
            skip = b.conv(x, f"{scope}/downsample", cin, 4 * width, k=1, stride=stride, relu=False) if j == 0 else x
            x = b.op("Relu", [b.op("Add", [skip, y], f"{scope}/add")], f"{scope}/relu")
            cin = 4 * width
    return _head(b, x, cin, classes, "resnet50", [1, 3, size, size])


def mobilenet(size: int = 32, widths: tuple[int, ...] = (16, 32, 64), classes: int = 10, seed: int = 3) -> onnx.ModelProto:
    """Depthwise-separable blocks: depthwise 3x3 conv + Clip(0, 6), pointwise 1x1 conv + Clip(0, 6)."""
    b = _Builder(seed)
    lo, hi = b.const("relu6.min", np.float32(0.0)), b.const("relu6.max", np.float32(6.0))
    x = b.conv("input", "/stem", 3, widths[0], stride=2, relu=False)
    x = b.op("Clip", [x, lo, hi], "/stem/relu6")
    for i, (cin, cout) in enumerate(zip(widths, widths[1:])):
        x = b.conv(x, f"/dw{i}", cin, cin, group=cin, relu=False)
        x = b.op("Clip", [x, lo, hi], f"/dw{i}/relu6")
        x = b.conv(x, f"/pw{i}", cin, cout, k=1, relu=False)
        x = b.op("Clip", [x, lo, hi], f"/pw{i}/relu6")
    return _head(b, x, widths[-1], classes, "mobilenet", [1, 3, size, size])


def mobilenetv2(size: int = 224, classes: int = 1000, seed: int = 7) -> onnx.ModelProto:
    """MobileNetV2's shape: a stride-2 stem, inverted residual blocks (1x1 expand + Clip(0, 6), depthwise 3x3 +
    Clip(0, 6), linear 1x1 projection; a residual where stride and width allow), a 1x1 conv to 1280, the head."""
    b = _Builder(seed)
    lo, hi = b.const("relu6.min", np.float32(0.0)), b.const("relu6.max", np.float32(6.0))

    def conv6(x: str, scope: str, cin: int, cout: int, **kw) -> str:
        return b.op("Clip", [b.conv(x, scope, cin, cout, relu=False, **kw), lo, hi], f"{scope}/relu6")

    x, cin = conv6("input", "/stem", 3, 32, stride=2), 32
    for i, (t, c, n, s) in enumerate(((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                                      (6, 160, 3, 2), (6, 320, 1, 1))):
        for j in range(n):
            scope, stride, hidden = f"/features{i}/{j}", s if j == 0 else 1, cin * t
            y = conv6(x, f"{scope}/expand", cin, hidden, k=1) if t != 1 else x
            y = conv6(y, f"{scope}/dw", hidden, hidden, stride=stride, group=hidden)
            y = b.conv(y, f"{scope}/project", hidden, c, k=1, relu=False)
            x, cin = (b.op("Add", [x, y], f"{scope}/add") if stride == 1 and cin == c else y), c
    x = conv6(x, "/last", cin, 1280, k=1)
    return _head(b, x, 1280, classes, "mobilenetv2", [1, 3, size, size])


def encoder(layers: int = 4, seq: int = 128, hidden: int = 256, heads: int = 4, seed: int = 8) -> onnx.ModelProto:
    """A BERT-like encoder over embeddings: `layers` encoder blocks, as `transformer` builds one."""
    b = _Builder(seed)
    x = "input"
    for i in range(layers):
        x = _encoder(b, x, seq, hidden, heads, scope=f"/layer{i}")
    b.nodes.append(helper.make_node("Identity", [x], ["output"], name="/output/Identity"))
    return b.model("encoder", [_io("input", [1, seq, hidden])], [_io("output", [1, seq, hidden])])


def transformer(seq: int = 16, hidden: int = 64, heads: int = 4, seed: int = 4) -> onnx.ModelProto:
    """One encoder block: multi-head self-attention and a Gelu (Erf) MLP, each with a residual and LayerNorm."""
    b = _Builder(seed)
    out = _encoder(b, "input", seq, hidden, heads)
    b.nodes.append(helper.make_node("Identity", [out], ["output"], name="/output/Identity"))
    return b.model("transformer", [_io("input", [1, seq, hidden])], [_io("output", [1, seq, hidden])])


def hybrid(size: int = 64, hidden: int = 64, heads: int = 4, blocks: int = 2, seed: int = 5) -> onnx.ModelProto:
    """A convolutional stem (two stride-2 convs and two more at a quarter of the size) whose feature map becomes
    tokens for encoder blocks: the CNN part and the attention part favour different runtimes."""
    b = _Builder(seed)
    x = b.conv("input", "/stem1", 3, hidden // 2, stride=2)
    x = b.conv(x, "/stem2", hidden // 2, hidden, stride=2)
    for i in range(2):
        x = b.conv(x, f"/features{i}", hidden, hidden)
    seq = (size // 4) ** 2
    tokens = b.op("Reshape", [x, b.const("tokens.shape", np.array([1, hidden, seq], np.int64))], "/tokens")
    x = b.op("Transpose", [tokens], "/tokens", perm=[0, 2, 1])
    for i in range(blocks):
        x = _encoder(b, x, seq, hidden, heads, scope=f"/encoder{i}")
    b.nodes.append(helper.make_node("Identity", [x], ["output"], name="/output/Identity"))
    return b.model("hybrid", [_io("input", [1, 3, size, size])], [_io("output", [1, seq, hidden])])


def speech(frames: int = 16, mels: int = 16, hidden: int = 32, heads: int = 2, blocks: int = 1,
           seed: int = 6) -> onnx.ModelProto:
    """Filterbank frames through a GRU (ONNX's default linear_before_reset=0, as Keras's reset_after=False
    exports), whose states become tokens for encoder blocks: the recurrence and the attention favour
    different runtimes, and LiteRT has no GRU."""
    b = _Builder(seed)
    weights = [b.weight("gru.W", (1, 3 * hidden, mels)), b.weight("gru.R", (1, 3 * hidden, hidden)),
               b.weight("gru.B", (1, 6 * hidden), 0.1)]
    states = b.op("GRU", ["input", *weights], "/gru", hidden_size=hidden)  # (frames, 1, 1, hidden)
    x = b.op("Reshape", [states, b.const("tokens.shape", np.array([1, frames, hidden], np.int64))], "/tokens")
    for i in range(blocks):
        x = _encoder(b, x, frames, hidden, heads, scope=f"/encoder{i}")
    b.nodes.append(helper.make_node("Identity", [x], ["output"], name="/output/Identity"))
    return b.model("speech", [_io("input", [frames, 1, mels])], [_io("output", [1, frames, hidden])])


def _encoder(b: _Builder, x: str, seq: int, hidden: int, heads: int, scope: str = "") -> str:
    """Self-attention and a Gelu MLP, each with a residual and LayerNorm; node and weight names under `scope`."""
    head = hidden // heads
    key = scope.strip("/").replace("/", ".") + "." if scope else ""

    def project(src: str, name: str, n_in: int, n_out: int) -> str:
        y = b.op("MatMul", [src, b.weight(f"{key}{name}.weight", (n_in, n_out))], f"{scope}/attn/{name}")
        return b.op("Add", [y, b.weight(f"{key}{name}.bias", (n_out,), 0.1)], f"{scope}/attn/{name}")

    split = b.const(f"{key}heads.shape", np.array([1, seq, heads, head], np.int64))
    q, k, v = (
        b.op("Transpose", [b.op("Reshape", [project(x, n, hidden, hidden), split], f"{scope}/attn/{n}/split")],
             f"{scope}/attn/{n}/heads", perm=perm)
        for n, perm in (("query", [0, 2, 1, 3]), ("key", [0, 2, 3, 1]), ("value", [0, 2, 1, 3]))
    )
    scale = b.const(f"{key}scale", np.float32(1 / np.sqrt(head)))
    scores = b.op("Mul", [b.op("MatMul", [q, k], f"{scope}/attn/scores"), scale], f"{scope}/attn/scale")
    context = b.op("MatMul", [b.op("Softmax", [scores], f"{scope}/attn/softmax", axis=-1), v], f"{scope}/attn/context")
    merged = b.op("Reshape", [b.op("Transpose", [context], f"{scope}/attn/merge", perm=[0, 2, 1, 3]),
                              b.const(f"{key}merge.shape", np.array([1, seq, hidden], np.int64))], f"{scope}/attn/merge")
    x = _layer_norm(b, b.op("Add", [x, project(merged, "out", hidden, hidden)], f"{scope}/attn/residual"),
                    f"{scope}/ln1", hidden)
    h = project(x, "fc1", hidden, 4 * hidden)
    sqrt2 = b.const(f"{key}sqrt2", np.float32(np.sqrt(2)))
    erf = b.op("Erf", [b.op("Div", [h, sqrt2], f"{scope}/mlp/gelu")], f"{scope}/mlp/gelu")
    gate = b.op("Mul", [b.op("Add", [erf, b.const(f"{key}one", np.float32(1))], f"{scope}/mlp/gelu"),
                        b.const(f"{key}half", np.float32(0.5))], f"{scope}/mlp/gelu/half")
    gelu = b.op("Mul", [h, gate], f"{scope}/mlp/gelu")
    y = b.op("Add", [x, project(gelu, "fc2", 4 * hidden, hidden)], f"{scope}/mlp/residual")
    return _layer_norm(b, y, f"{scope}/ln2", hidden)


def _layer_norm(b: _Builder, x: str, scope: str, hidden: int) -> str:
    scale = b.const(f"{scope}.weight", np.ones(hidden, np.float32))
    bias = b.const(f"{scope}.bias", np.zeros(hidden, np.float32))
    return b.op("LayerNormalization", [x, scale, bias], scope, axis=-1, epsilon=1e-5)


def _head(b: _Builder, x: str, width: int, classes: int, name: str, input_shape: list) -> onnx.ModelProto:
    x = b.op("GlobalAveragePool", [x], "/head/pool")
    x = b.op("Flatten", [x], "/head/flatten", axis=1)
    fc = b.op("Gemm", [x, b.weight("fc.weight", (classes, width)), b.weight("fc.bias", (classes,), 0.1)], "/head/fc",
              transB=1)
    b.nodes.append(helper.make_node("Identity", [fc], ["output"], name="/output/Identity"))
    return b.model(name, [_io("input", input_shape)], [_io("output", [input_shape[0], classes])])


def yolo_like(size: int = 32, anchors: int = 2, classes: int = 3) -> onnx.ModelProto:
    """A YOLOv5-style detector: Conv+SiLU backbone with a split/concat block, SPPF max pools, nearest
    upsampling into a second scale, and heads decoded with sigmoid, grid and anchors; a TopK picks the
    best scores at the end."""
    rng = np.random.default_rng(5)
    nodes, inits = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op, inputs, name, **attrs):
        nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def conv(x, name, cin, cout, k=3, stride=1):
        w = const(f"{name}.w", (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32))
        b = const(f"{name}.b", (rng.standard_normal(cout) * 0.1).astype(np.float32))
        y = node("Conv", [x, w, b], f"{name}/conv", kernel_shape=[k, k], strides=[stride] * 2, pads=[k // 2] * 4)
        return node("Mul", [y, node("Sigmoid", [y], f"{name}/sigmoid")], f"{name}/silu")

    x = conv("images", "stem", 3, 16, stride=2)
    x = conv(x, "down1", 16, 32, stride=2)
    nodes.append(helper.make_node("Split", ["down1/silu", const("split", np.array([16, 16], np.int64))],
                                  ["c3/a", "c3/b"], name="c3/split", axis=1))
    x = node("Concat", [conv("c3/a", "c3/m", 16, 16), "c3/b"], "c3/concat", axis=1)
    p3 = conv(x, "c3/out", 32, 32, k=1)
    x = conv(p3, "down2", 32, 32, stride=2)
    pools = [x]
    for i in range(3):
        pools.append(node("MaxPool", [pools[-1]], f"sppf/pool{i}", kernel_shape=[5, 5], pads=[2] * 4))
    p4 = conv(node("Concat", pools, "sppf/concat", axis=1), "sppf/out", 128, 32, k=1)
    up = node("Resize", [p4, "", const("scales", np.array([1, 1, 2, 2], np.float32))], "up", mode="nearest")
    p3 = conv(node("Concat", [up, p3], "fpn/concat", axis=1), "fpn/out", 64, 32)
    outputs = []
    for level, (feature, stride) in enumerate(((p3, 4), (p4, 8))):
        grid_size = size // stride
        fields = 5 + classes
        w = const(f"head{level}.w", (rng.standard_normal((anchors * fields, 32, 1, 1)) * 0.2).astype(np.float32))
        y = node("Conv", [feature, w], f"head{level}/conv")
        y = node("Reshape", [y, const(f"head{level}.shape", np.array([1, anchors, fields, grid_size, grid_size]))],
                 f"head{level}/reshape")
        y = node("Sigmoid", [node("Transpose", [y], f"head{level}/transpose", perm=[0, 1, 3, 4, 2])],
                 f"head{level}/sigmoid")
        nodes.append(helper.make_node("Split", [y, const(f"head{level}.parts", np.array([2, 2, fields - 4]))],
                                      [f"head{level}/xy", f"head{level}/wh", f"head{level}/conf"],
                                      name=f"head{level}/split", axis=4))
        gy, gx = np.meshgrid(np.arange(grid_size), np.arange(grid_size), indexing="ij")
        grid = np.stack([gx, gy], -1).reshape(1, 1, grid_size, grid_size, 2).astype(np.float32) - 0.5
        xy = node("Mul", [node("Add", [node("Mul", [f"head{level}/xy", const(f"two{level}", np.float32(2))],
                                             f"head{level}/xy2"), const(f"grid{level}", grid)], f"head{level}/xyg"),
                          const(f"stride{level}", np.float32(stride))], f"head{level}/xyout")
        anchor = (rng.uniform(1, 3, (1, anchors, 1, 1, 2)) * stride).astype(np.float32)
        wh = node("Mul", [node("Pow", [node("Mul", [f"head{level}/wh", const(f"two_{level}", np.float32(2))],
                                             f"head{level}/wh2"), const(f"sq{level}", np.float32(2))],
                               f"head{level}/whsq"), const(f"anchor{level}", anchor)], f"head{level}/whout")
        box = node("Concat", [xy, wh, f"head{level}/conf"], f"head{level}/box", axis=4)
        outputs.append(node("Reshape", [box, const(f"flat{level}", np.array([1, -1, fields]))], f"head{level}/flat"))
    detections = node("Concat", outputs, "detections", axis=1)
    score = node("ReduceMax", [detections, const("last", np.array([2]))], "score", keepdims=0)
    nodes.append(helper.make_node("TopK", [score, const("k", np.array([5]))], ["best", "best_index"], name="topk",
                                  axis=1))
    graph = helper.make_graph(nodes, "yolo_like", [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                                                                   [1, 3, size, size])],
                              [helper.make_tensor_value_info("detections", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("best", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("best_index", TensorProto.INT64, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


BUILDERS = {"mlp": mlp, "cnn": cnn, "resnet": resnet, "mobilenet": mobilenet, "transformer": transformer,
            "hybrid": hybrid, "speech": speech}
