"""ONNX Runtime's execution provider names and options, read as ONNX Runtime reads them.

Each name maps to a provider id and the device it names (`device`: "cpu", "gpu", or None for a runtime on
the device its options give). Its options are of three kinds: mapped (honoured, converted to the provider's
option), ignored (options ONNX Runtime documents for that EP that mean nothing here: one warning each; the
EP options that would compute in fp16, whose warning says how uhop-onnx's fp16 is asked for), and any other,
which ONNX Runtime itself would refuse for that EP: `InputError`. ONNX Runtime's CPU EP reads no
options and refuses none, so every option given to it is ignored.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from uhop_onnx.foundation.errors import InputError, outside


def _device_id(value: Any) -> int:
    """A device index (`0`, `"1"`)."""
    if isinstance(value, bool) or not str(value).strip().isdigit():
        raise ValueError("expected a non-negative integer")
    return int(value)


def _path(value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError("expected a path")
    return os.fspath(value)


def _device_type(value: Any) -> str:
    """OpenVINO EP's `device_type` (`"CPU"`, `"GPU_FP16"`, `"GPU.0"`) as an OpenVINO device."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected an OpenVINO device name such as 'CPU', 'GPU' or 'NPU'")
    return value.strip().split("_FP")[0]


def _qnn_backend(value: Any) -> str:
    """QNN EP's `backend_type` among the backends uhop-onnx runs stages on."""
    if str(value).lower() not in ("htp", "gpu", "cpu"):
        raise ValueError("expected 'htp', 'gpu' or 'cpu'")
    return str(value).lower()


@dataclass(frozen=True)
class OrtName:
    """What one of ONNX Runtime's EP names means here."""

    ident: str  # the provider id it is an alias of
    device: str | None  # "cpu", "gpu" or "npu" (its own provider, then the CPU ones), None: exactly `ident`
    mapped: dict[str, tuple[str, Callable[[Any], Any]]] = field(default_factory=dict)  # EP option -> ours
    ignored: frozenset[str] | None = frozenset()  # None: every other option (ONNX Runtime refuses none)


_CUDA_IGNORED = frozenset("""
    arena_extend_strategy cudnn_conv1d_pad_to_nc1d cudnn_conv_algo_search cudnn_conv_use_max_workspace
    default_memory_arena_cfg do_copy_in_default_stream enable_cuda_graph enable_skip_layer_norm_strict_mode
    fuse_conv_bias gpu_external_alloc gpu_external_empty_cache gpu_external_free gpu_mem_limit
    has_user_compute_stream prefer_nhwc sdpa_kernel tunable_op_enable tunable_op_max_tuning_duration_ms
    tunable_op_tuning_enable use_ep_level_unified_stream use_tf32 user_compute_stream""".split())
_TENSORRT_IGNORED = frozenset("""
    has_user_compute_stream user_compute_stream trt_auxiliary_streams trt_bf16_enable trt_build_heuristics_enable
    trt_builder_optimization_level trt_context_memory_sharing_enable trt_cuda_graph_enable trt_detailed_build_log
    trt_dla_core trt_dla_enable trt_dump_ep_context_model trt_dump_subgraphs
    trt_engine_cache_built_with_explicit_precision trt_engine_cache_enable trt_engine_cache_prefix
    trt_engine_decryption_enable trt_engine_decryption_lib_path trt_engine_hw_compatible trt_ep_context_embed_mode
    trt_ep_context_file_path trt_extra_plugin_lib_paths trt_force_sequential_engine_build trt_force_timing_cache
    trt_fp16_enable trt_int8_calibration_table_name trt_int8_enable trt_int8_use_native_calibration_table
    trt_layer_norm_fp32_fallback trt_load_user_initializer trt_max_partition_iterations trt_max_workspace_size
    trt_min_subgraph_size trt_onnx_model_folder_path trt_op_types_to_exclude trt_preview_features
    trt_profile_max_shapes trt_profile_min_shapes trt_profile_opt_shapes trt_sparsity_enable trt_tactic_sources
    trt_timing_cache_enable trt_timing_cache_path trt_weight_stripped_engine_enable""".split())
_MIGRAPHX_IGNORED = frozenset("""
    migraphx_arena_extend_strategy migraphx_bf16_enable migraphx_exhaustive_tune migraphx_external_alloc
    migraphx_external_empty_cache migraphx_external_free migraphx_fp16_enable migraphx_fp8_enable
    migraphx_int8_calibration_table_name migraphx_int8_enable migraphx_load_compiled_model
    migraphx_load_model_path migraphx_mem_limit migraphx_model_cache_dir migraphx_save_compiled_model
    migraphx_save_model_path migraphx_use_native_calibration_table""".split())
_QNN_IGNORED = frozenset("""
    backend_path device_id dump_json_qnn_graph enable_htp_fp16_precision enable_htp_shared_memory_allocator
    enable_htp_spill_fill_buffer enable_htp_weight_sharing htp_arch htp_graph_finalization_optimization_mode
    htp_performance_mode json_qnn_graph_dir offload_graph_io_quantization profiling_file_path profiling_level
    qnn_context_priority qnn_saver_path rpc_control_latency soc_model vtcm_mb""".split())
_OPENVINO_IGNORED = frozenset("""
    cache_dir context device_id device_luid disable_dynamic_shapes enable_causallm enable_npu_fast_compile
    enable_opencl_throttling enable_qdq_optimizer layout load_config model_priority num_of_threads num_streams
    precision reshape_input""".split())

# Ignored EP options that would compute a stage in fp16: here fp16 is a precision (`precision="fp16"`), which
# labels the stage and checks it at its tolerance; an option would build fp16 under an fp32 label.
_FP16_OPTIONS = frozenset({"trt_fp16_enable", "enable_htp_fp16_precision"})

ORT_NAMES: dict[str, OrtName] = {
    "CPUExecutionProvider": OrtName("ort-cpu", "cpu", ignored=None),
    "CUDAExecutionProvider": OrtName("ort-cuda", "gpu", {"device_id": ("device_id", _device_id)}, _CUDA_IGNORED),
    "TensorrtExecutionProvider": OrtName("ort-tensorrt", "gpu", {
        "device_id": ("device_id", _device_id), "trt_engine_cache_path": ("engine_cache", _path)}, _TENSORRT_IGNORED),
    "MIGraphXExecutionProvider": OrtName("ort-rocm", "gpu", {"device_id": ("device_id", _device_id)}, _MIGRAPHX_IGNORED),
    "QNNExecutionProvider": OrtName("ort-qnn", "npu", {"backend_type": ("backend_type", _qnn_backend)}, _QNN_IGNORED),
    "OpenVINOExecutionProvider": OrtName("openvino", None, {"device_type": ("device", _device_type)}, _OPENVINO_IGNORED),
}


def from_ort(name: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """An ONNX Runtime EP name and its options -> (provider id, options); ids and unknown names pass as they
    are. Mapped options are converted (a malformed value: `InputError`), ignored ones dropped with one
    warning each, and an option ONNX Runtime does not know for that EP is an `InputError`."""
    if name not in ORT_NAMES:
        return name, dict(options)
    entry = ORT_NAMES[name]
    unknown = sorted(k for k in options if k not in entry.mapped and entry.ignored is not None
                     and k not in entry.ignored)
    if unknown:
        raise InputError(f"{name}: unknown option(s) {', '.join(unknown)}, which ONNX Runtime refuses too; "
                         f"its options are: {', '.join(sorted({*entry.mapped, *entry.ignored}))}")
    converted = {}
    for key, value in options.items():
        if key in entry.mapped:
            ours, convert = entry.mapped[key]
            try:
                converted[ours] = convert(value)
            except (TypeError, ValueError) as error:
                raise InputError(f"{name}: option {key}={value!r} is malformed: {error}") from None
        elif key in _FP16_OPTIONS:
            warn(f"{name}: option {key!r} is ignored: the stage runs at fp32; for fp16, pass precision='fp16' "
                 f"(or --precision fp16) to uhop-onnx, which labels the stage fp16 and checks it at fp16's "
                 f"tolerance")
        else:
            warn(f"{name}: option {key!r} has no meaning in uhop-onnx; ignored")
    return entry.ident, converted


def warn(message: str) -> None:
    """A `UserWarning` about the providers asked for, pointed at the user's line."""
    warnings.warn(message, UserWarning, stacklevel=outside())
