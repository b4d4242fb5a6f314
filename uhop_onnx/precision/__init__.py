"""Precision, in one place: the precisions a stage may run at (`values`), the accuracy rule every comparison
of outputs uses (`accuracy`), calibration samples (`calibration`) and the gate a reduced-precision plan must
pass against ONNX Runtime fp32 (`gate`). A stage is built at a reduced precision by its provider
(`providers/quantize.py` quantizes one).
"""

from .accuracy import FP32_TOLERANCE, Tolerance, compare, errors, scaled, within_scaled
from .calibration import FORMS, check_samples, declared_inputs, read_calibration, read_choice, sample_error
from .gate import Precision, Verdict, gate, gate_run
from .values import CHOICES, DEFAULT_TOLERANCE, PRECISIONS, REDUCED, check_choice, lowest, wanted

__all__ = ["CHOICES", "DEFAULT_TOLERANCE", "FORMS", "FP32_TOLERANCE", "PRECISIONS", "Precision", "REDUCED",
           "Tolerance", "Verdict", "check_choice", "check_samples", "compare", "declared_inputs", "errors", "gate",
           "gate_run", "lowest", "read_calibration", "read_choice", "sample_error", "scaled", "wanted",
           "within_scaled"]
