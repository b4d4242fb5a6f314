"""Writes `example_encoder.onnx`: a two-layer transformer encoder (token ids -> hidden states), random weights
(seeded), exported by PyTorch's TorchScript exporter at opset 17 with free `batch` and `sequence` axes, so
the graph carries the Shape -> Gather -> Concat -> Reshape chains exporters emit.

    python models/make_example_encoder.py   # needs torch
"""

from __future__ import annotations

import math
from pathlib import Path

OUTPUT = Path(__file__).with_name("example_encoder.onnx")
VOCAB, HIDDEN, HEADS, LAYERS, MAX_SEQUENCE = 64, 32, 4, 2, 128
OPSET = 17
# name, ONNX element type, dimensions (str: a free axis of that name), as the exported file declares them
INPUTS = [("input_ids", "int64", ["batch", "sequence"])]
OUTPUTS = [("hidden_states", "float", ["batch", "sequence", HIDDEN])]


def build():
    """The encoder as a `torch.nn.Module` in eval mode."""
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
            self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
            self.ff = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

        def forward(self, x):
            batch, sequence, hidden = x.shape
            q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
            q, k, v = (t.reshape(batch, sequence, HEADS, hidden // HEADS).transpose(1, 2) for t in (q, k, v))
            attention = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HIDDEN // HEADS), dim=-1) @ v
            x = x + self.proj(attention.transpose(1, 2).reshape(batch, sequence, hidden))
            return x + self.ff(self.norm2(x))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(VOCAB, HIDDEN)
            self.positions = nn.Parameter(torch.randn(MAX_SEQUENCE, HIDDEN) * 0.02)
            self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
            self.norm = nn.LayerNorm(HIDDEN)

        def forward(self, input_ids):
            x = self.tokens(input_ids) + self.positions[: input_ids.shape[1]]
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    torch.manual_seed(0)
    return Encoder().eval()


def main(path: Path = OUTPUT) -> Path:
    import torch

    dynamic = {name: {axis: dim for axis, dim in enumerate(dims) if isinstance(dim, str)}
               for name, _, dims in (*INPUTS, *OUTPUTS)}
    example = torch.zeros(2, 8, dtype=torch.int64)
    torch.onnx.export(build(), (example,), str(path), input_names=[n for n, _, _ in INPUTS],
                      output_names=[n for n, _, _ in OUTPUTS], dynamic_axes=dynamic, opset_version=OPSET,
                      dynamo=False)
    return path


if __name__ == "__main__":
    print(main())
