"""Run by `.ci/run` in a venv with a plain `pip install .` (no extras): the shipped encoder, whose graph does
integer shape arithmetic over free batch and sequence axes, is measured at one shape and run at others, each
equal to ONNX Runtime's outputs."""

import numpy as np
import onnxruntime as ort

import uhop_onnx
from uhop_onnx.models import EXAMPLE_ENCODER

session = uhop_onnx.InferenceSession(str(EXAMPLE_ENCODER), shapes={"input_ids": (1, 16)}, threads=2)
reference = ort.InferenceSession(str(EXAMPLE_ENCODER), providers=["CPUExecutionProvider"])
for shape in [(1, 16), (2, 7), (3, 33)]:
    ids = np.random.default_rng(shape[1]).integers(0, 64, shape)
    [got], [want] = session.run(None, {"input_ids": ids}), reference.run(None, {"input_ids": ids})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
print(f"encoder: {' > '.join(f'{s.label} x{len(s.nodes)}' for s in session.plan.stages)}, measured at "
      f"{session.plan.shapes}, matches ONNX Runtime at three shapes")
