"""The model classes of Rockchip's rknn_model_zoo (`uhop_onnx.models.zoo`) on the RK3588.

`python -m benchmarks.rknn_zoo` exports each at the zoo's input size for `rk3588`, and prints per model: the
share of its FLOPs on the NPU, the static cost model's int8 estimate beside the frame rate Rockchip publishes
for RK3588 (one core, int8; `uhop_onnx.models.zoo.ZOO_README`), and the simulator's error at fp16 and at int8
against ONNX Runtime fp32. `tests/test_rknn_zoo.py` runs the same classes at small input sizes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

from uhop_onnx.models.zoo import ZOO, ZooModel, available, calibration, export_onnx


def npu_figures(onnx_path: Path, shape: tuple[int, ...], bundle: Path, precision: str = "int8") -> tuple[float, float]:
    """The share of the model's FLOPs (at `shape`) that the bundle's RKNN stages run, and the static cost model's
    latency of the bundle's stages there, its RKNN stages at `precision`."""
    from uhop_onnx import load
    from uhop_onnx.graph import Graph
    from uhop_onnx.inputs import at_shapes
    from uhop_onnx.partitioner.static_cost import estimate_ms, flops
    from uhop_onnx.simplify import simplify
    from uhop_onnx.targets import load_target

    graph = Graph.from_model(at_shapes(simplify(load(onnx_path)), {"images": list(shape)}))
    stages = json.loads((bundle / "manifest.json").read_text())["stages"]
    on_npu = {n for s in stages if s["provider"] == "rknn" for n in s["nodes"]}
    counts = {n.name: flops(graph, n) for n in graph.nodes}
    share = sum(v for n, v in counts.items() if n in on_npu) / max(sum(counts.values()), 1.0)
    models = {p.id: p for p in load_target("rk3588").providers}
    total = 0.0
    for stage in stages:
        entry = models[stage["provider"]]
        entry = entry.at(precision) if precision in entry.precisions else entry
        total += estimate_ms(entry, graph, [graph.nodes[graph.index_of[n]] for n in stage["nodes"]])
    return share, total


def row(model: ZooModel, shape: tuple[int, ...], folder: Path, int8: bool = True) -> dict:
    """Export `model` at `shape` for rk3588 (fp16, and with `int8` an int8 bundle too), verify in the
    simulator, and report its figures."""
    import uhop_onnx

    onnx_path = export_onnx(model, folder / f"{model.name}.onnx")
    fp16 = uhop_onnx.export_bundle(onnx_path, "rk3588", folder / f"{model.name}-fp16", shapes={"images": shape})
    verified = uhop_onnx.verify_bundle(fp16)
    share, estimated = npu_figures(onnx_path, shape, fp16)
    result = {
        "model": model.name, "shape": list(shape), "npu_flops_share": round(share, 4),
        "estimated_int8_ms": round(estimated, 2),
        "published_ms": round(1e3 / model.published_fps, 2) if model.published_fps else None,
        "zoo_model": model.zoo_model, "fp16_ok": verified["ok"], "fp16_max_abs_error": worst(verified),
        "off_npu": json.loads((fp16 / "manifest.json").read_text()).get("off_accelerator", {}).get("nodes", []),
    }
    if int8:
        bundle = uhop_onnx.export_bundle(onnx_path, "rk3588", folder / f"{model.name}-int8", shapes={"images": shape},
                                         precision="int8", calibration=calibration(shape), tolerance=0.05)
        gate = json.loads((bundle / "manifest.json").read_text()).get("precision") or {}
        result["int8_accuracy"] = gate.get("accuracy")
    return result


def worst(report: dict) -> float | None:
    errors = [o.get("max_abs_error") for s in report["stages"] if s.get("ran") for o in s.get("outputs", {}).values()]
    return max((e for e in errors if e is not None), default=None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the tests' input sizes instead of the zoo's")
    parser.add_argument("--no-int8", action="store_true", help="skip the int8 bundles")
    parser.add_argument("--only", nargs="*", help="model names")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torchvision") is not None:
        from benchmarks.corpus_models import import_torchvision

        import_torchvision()  # the zoo's torchvision and timm classes import it
    with tempfile.TemporaryDirectory() as folder:
        for model in ZOO:
            if args.only and model.name not in args.only:
                continue
            missing = available(model)
            if missing:
                print(json.dumps({"model": model.name, "skipped": missing}), flush=True)
                continue
            result = row(model, model.small if args.small else model.shape, Path(folder), not args.no_int8)
            result["off_npu"] = len(result["off_npu"])
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
