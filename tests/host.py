"""What this host's CPU computes, as the runtimes detect it: tests whose expectations depend on the CPU derive
them from here, so that the suite holds on every x86-64 CPU (and aarch64) the package supports. Light to import:
`test_cpu_avx2.py` runs it in an emulated CPU."""

from __future__ import annotations

import functools
import os
import platform

from uhop_onnx.foundation.host import cpu_features


@functools.cache
def openvino_capabilities() -> frozenset[str]:
    """OpenVINO's `OPTIMIZATION_CAPABILITIES` for the CPU (`BF16`, `FP16`, `INT8`...); empty without OpenVINO."""
    try:
        import openvino
    except ImportError:
        return frozenset()
    return frozenset(openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def int8_saturates() -> bool:
    """Whether the int8 kernels of ONNX Runtime and OpenVINO may saturate here: on x86-64 without AVX-512 VNNI
    they sum pairs of u8 x s8 products in int16 (`vpmaddubsw`, as ONNX Runtime's documentation says), and a
    CNN's int8 error grows several times. Measured on the test CNN, worst of 8 inputs, in an emulated Haswell:
    ONNX Runtime's QDQ cosine 0.9975 and 0.069 of the gate's scale, OpenVINO's NNCF model 0.9964 and 0.086;
    with VNNI 0.9999 and 0.013, 0.9997 and 0.021. OpenVINO's kernels saturate too where oneDNN is held below
    VNNI (`ONEDNN_MAX_CPU_ISA=AVX2`: cosine 0.9974)."""
    held = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ("SSE41", "AVX", "AVX2", "AVX512_CORE")
    return platform.machine().lower() in ("x86_64", "amd64") and ("avx512vnni" not in cpu_features() or held)


# What int8 of the test CNN keeps here, on either runtime: its lowest cosine to fp32, and a gate's tolerance it
# passes (about twice the worst error measured)
INT8_COSINE, INT8_TOLERANCE = (0.99, 0.15) if int8_saturates() else (0.999, 5e-2)
