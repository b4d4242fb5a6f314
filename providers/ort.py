"""ONNX Runtime providers: one class over ONNX Runtime's execution providers, configured by EP name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from .base import Absent, Provider, Runner
from .capability import CapabilityTable, Support

if TYPE_CHECKING:
    import onnx

ORT_TABLE = CapabilityTable(
    provider="onnxruntime",
    rules=(),
    dtypes=frozenset(
        "float float16 bfloat16 double int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool string".split()
        + "float8e4m3fn float8e4m3fnuz float8e5m2 float8e5m2fnuz int4 uint4".split()
    ),
    domains={"": (7, 28), "ai.onnx.ml": (1, 5), "com.microsoft": (1, 1), "ai.onnx.preview.training": (1, 1)},
    any_op=True,
)


def session_options(threads: int | None, exclusive: bool, optimize: bool = True):
    """ONNX Runtime session options for a stage that may share the process with other stages."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads or 0
    so.inter_op_num_threads = 1
    if not exclusive:
        # Spinning workers of several sessions in one process steal each other's cores.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return so


class OrtRunner(Runner):
    """An ONNX Runtime session over one stage."""

    def __init__(self, model_bytes: bytes, providers: list, threads: int | None, exclusive: bool):
        import onnxruntime as ort

        self.session = ort.InferenceSession(model_bytes, session_options(threads, exclusive), providers=providers)
        self.outputs = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        return dict(zip(self.outputs, self.session.run(self.outputs, dict(feeds)), strict=True))


class OrtProvider(Provider):
    """ONNX Runtime with one execution provider (and no silent CPU fallback)."""

    ep: ClassVar[str]
    table = ORT_TABLE

    def probe(self) -> tuple[str, str]:
        try:
            import onnxruntime as ort
        except ImportError as error:
            raise Absent(f"onnxruntime is not installed ({error})") from None
        if self.ep not in ort.get_available_providers():
            raise Absent(f"{self.ep} is not in this onnxruntime build ({ort.__version__})")
        return ort.__version__, self.ep.removesuffix("ExecutionProvider")

    def ep_entry(self) -> Any:
        return (self.ep, dict(self.options)) if self.options else self.ep

    def query(self, model: onnx.ModelProto) -> dict[str, Support]:
        """Which nodes ONNX Runtime assigns to this EP, read from the session's assignment record."""
        import onnxruntime as ort

        so = session_options(self.threads, exclusive=False, optimize=False)
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        providers = [self.ep_entry()] + (["CPUExecutionProvider"] if self.ep != "CPUExecutionProvider" else [])
        session = ort.InferenceSession(model.SerializeToString(), so, providers=providers)
        taken = {
            node.name: info.ep_name for info in session.get_provider_graph_assignment_info() for node in info.get_nodes()
        }
        return {
            n.name: Support(False, f"ONNX Runtime assigned it to {taken[n.name]}", "runtime")
            for n in model.graph.node
            if n.name in taken and taken[n.name] != self.ep
        }

    def compile(self, model: onnx.ModelProto, *, exclusive: bool = True) -> Runner:
        self.require()
        return OrtRunner(model.SerializeToString(), [self.ep_entry()], self.threads, exclusive)


class OrtCpu(OrtProvider):
    id = "ort-cpu"
    ep = "CPUExecutionProvider"
    install = "pip install onnxruntime"
