"""The model classes of Rockchip's rknn_model_zoo (`uhop_onnx.models.zoo`), and models as PyPI packages ship
them (`SHIPPED`), on the RK3588.

`python -m benchmarks.rknn_zoo` exports each zoo class at the zoo's input size for `rk3588`, and prints per
model: the share of its FLOPs on the NPU, the static cost model's int8 estimate beside the frame rate Rockchip
publishes for RK3588 (one core, int8; `uhop_onnx.models.zoo.ZOO_README`), and the simulator's error at fp16 and
at int8 against ONNX Runtime fp32. `tests/test_rknn_zoo.py` runs the same classes at small input sizes.

`python benchmarks/rknn_zoo.py --shipped` does the same for the ONNX files of installed packages as their
authors ship them (free dimensions, opset 11), at a fixed input shape, on pictures scikit-image ships where
the model reads pictures, and prints a table: nodes and FLOPs on the NPU, estimated latency, and the
simulator's fp16 (and int8) error against ONNX Runtime. `tests/test_npu_shipped.py` runs them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from uhop_onnx.models.zoo import ZOO, ZooModel, available, calibration, export_onnx


def npu_figures(onnx_path: Path, bundle: Path, precision: str = "int8") -> dict:
    """The bundle's nodes and FLOPs on its RKNN stages (counted on the model as the bundle holds it: at the
    shapes it was exported at, what is computed from shapes folded), and the static cost model's latency of its
    stages, its RKNN stages at `precision`."""
    from uhop_onnx import load
    from uhop_onnx.foundation.graph import Graph
    from uhop_onnx.partitioner.static_cost import estimate_ms, flops
    from uhop_onnx.model.simplify import at_fixed_shapes
    from uhop_onnx.products.targets import load_target

    manifest = json.loads((bundle / "manifest.json").read_text())
    loaded = load(onnx_path)
    graph = Graph.from_model(at_fixed_shapes(loaded, manifest["shapes"]))
    stages = manifest["stages"]
    on_npu = {n for s in stages if s["provider"] == "rknn" for n in s["nodes"]}
    counts = {n.name: flops(graph, n) for n in graph.nodes}
    models = {p.id: p for p in load_target("rk3588").providers}
    total = 0.0
    for stage in stages:
        entry = models[stage["provider"]]
        entry = entry.at(precision) if precision in entry.precisions else entry
        total += estimate_ms(entry, graph, [graph.nodes[graph.index_of[n]] for n in stage["nodes"]])
    share = sum(v for n, v in counts.items() if n in on_npu) / max(sum(counts.values()), 1.0)
    return {"shipped_nodes": len(loaded.graph.node), "nodes": len(graph.nodes), "npu_nodes": len(on_npu),
            "gflops": round(sum(counts.values()) / 1e9, 3), "npu_flops_share": round(share, 4),
            f"estimated_{precision}_ms": round(total, 2)}


def row(model: ZooModel, shape: tuple[int, ...], folder: Path, int8: bool = True) -> dict:
    """Export `model` at `shape` for rk3588 (fp16, and with `int8` an int8 bundle too), verify in the
    simulator, and report its figures."""
    import uhop_onnx

    onnx_path = export_onnx(model, folder / f"{model.name}.onnx")
    fp16 = uhop_onnx.export_bundle(onnx_path, "rk3588", folder / f"{model.name}-fp16", shapes={"images": shape})
    verified = uhop_onnx.verify_bundle(fp16)
    figures = npu_figures(onnx_path, fp16)
    result = {
        "model": model.name, "shape": list(shape), "npu_flops_share": figures["npu_flops_share"],
        "estimated_int8_ms": figures["estimated_int8_ms"],
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


# -- models as PyPI packages ship them ---------------------------------------------------------------------------

Samples = Callable[[], list[dict[str, np.ndarray]]]


@dataclass(frozen=True)
class Shipped:
    """An ONNX file as an installed package ships it, the input shapes the board runs it at, and real inputs for
    it (the first is the bundle's sample, all of them int8's calibration); None: seeded random ones."""

    name: str
    package: str  # the import name of the package that ships it
    file: str  # its path inside the package's folder
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    samples: Samples | None = None

    def path(self) -> Path | None:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / self.file
        return path if path.is_file() else None

    def missing(self) -> str | None:
        """Why this model is not here (its package, or the file in it, is missing); None when it is."""
        if importlib.util.find_spec(self.package) is None:
            return f"the package {self.package} is not installed"
        return None if self.path() else f"{self.package} does not ship {self.file}"


def pictures(names: list[str], height: int, width: int) -> list[np.ndarray]:
    """scikit-image's bundled pictures (`skimage.data`) as HxWx3 uint8 at height x width (grey ones repeated)."""
    import cv2
    import skimage.data

    out = []
    for name in names:
        image = getattr(skimage.data, name)()
        image = np.repeat(image[..., None], 3, axis=2) if image.ndim == 2 else image
        out.append(cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA))
    return out


def text_lines(height: int, width: int) -> list[np.ndarray]:
    """The lines of scikit-image's `text` picture, cut apart and each resized to height x width."""
    import cv2
    import skimage.data

    page = skimage.data.text()
    return [cv2.resize(np.repeat(page[top:top + 60, :, None], 3, axis=2), (width, height), interpolation=cv2.INTER_AREA)
            for top in (0, 56, 112)]


def nchw(images: list[np.ndarray], name: str, mean: float = 0.0, std: float = 1.0) -> list[dict[str, np.ndarray]]:
    """One feed per image: `name` as 1x3xHxW float32 of `(pixel / 255 - mean) / std`."""
    return [{name: ((image.astype(np.float32) / 255 - mean) / std).transpose(2, 0, 1)[None].copy()}
            for image in images]


def file_bytes(size: int = 2048) -> list[dict[str, np.ndarray]]:
    """Magika's input for a few real files: their first and last `size // 2` bytes, padded with its token 256."""
    import magika

    half, out = size // 2, []
    for path in sorted(Path(magika.__file__).parent.rglob("*"))[:8]:
        if not path.is_file() or path.stat().st_size < 64:
            continue
        data = np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32)
        start, end = np.full(half, 256, np.int32), np.full(half, 256, np.int32)
        start[:min(half, len(data))] = data[:half]
        end[half - min(half, len(data)):] = data[-half:]
        out.append({"bytes": np.concatenate([start, end])[None]})
    return out


PHOTOS = ["astronaut", "coffee", "chelsea", "rocket"]
SHIPPED = [
    Shipped("nudenet-yolov8n", "nudenet", "320n.onnx", {"images": (1, 3, 320, 320)},
            lambda: nchw(pictures(PHOTOS, 320, 320), "images")),
    Shipped("ppocr-det", "rapidocr", "models/PP-OCRv6_det_small.onnx", {"x": (1, 3, 640, 640)},
            lambda: nchw(pictures(["page", "text", "camera"], 640, 640), "x", 0.5, 0.5)),
    Shipped("ppocr-rec", "rapidocr", "models/PP-OCRv6_rec_small.onnx", {"x": (1, 3, 48, 320)},
            lambda: nchw(text_lines(48, 320), "x", 0.5, 0.5)),
    Shipped("ppocr-cls", "rapidocr", "models/ch_ppocr_mobile_v2.0_cls_mobile.onnx", {"x": (1, 3, 48, 192)},
            lambda: nchw(text_lines(48, 192), "x", 0.5, 0.5)),
    Shipped("magika", "magika", "models/standard_v3_3/model.onnx", {"bytes": (1, 2048)}, file_bytes),
    Shipped("silero-vad", "silero_vad", "data/silero_vad_openvino_16k.onnx"),
]


def accuracy(report: dict) -> dict:
    """The simulator's worst error of a verified bundle's outputs: absolute, scaled (over `1 + max|reference|`)
    and the lowest cosine, and whether every stage matched."""
    outputs = [o for s in report["stages"] if s.get("ran") for o in s.get("outputs", {}).values()
               if o.get("max_abs_error") is not None]
    return {"fp16_ok": report["ok"], "fp16_max_abs_error": max((o["max_abs_error"] for o in outputs), default=None),
            "fp16_scaled_error": max((o["max_abs_error"] / o["scale"] for o in outputs), default=None),
            "fp16_cosine": min((o["cosine"] for o in outputs), default=None)}


def shipped_row(model: Shipped, folder: Path, int8: bool = False) -> dict:
    """Export `model` for rk3588 at its shapes on its first sample, verify it in the simulator, and report its
    figures; with `int8`, an int8 bundle calibrated on its samples too, and the precision gate's errors."""
    import uhop_onnx

    samples = model.samples() if model.samples else None
    where = {"inputs": samples[0]} if samples else {"shapes": model.shapes or None}
    fp16 = uhop_onnx.export_bundle(model.path(), "rk3588", folder / f"{model.name}-fp16", **where)
    manifest = json.loads((fp16 / "manifest.json").read_text())
    result = {"model": model.name, "shapes": manifest["shapes"], **npu_figures(model.path(), fp16, "fp16"),
              "estimated_int8_ms": npu_figures(model.path(), fp16)["estimated_int8_ms"],
              **accuracy(uhop_onnx.verify_bundle(fp16)),
              "off_npu": manifest.get("off_accelerator", {}).get("nodes", [])}
    if int8 and samples:
        stacked = {name: np.concatenate([s[name] for s in samples]) for name in samples[0]}
        bundle = uhop_onnx.export_bundle(model.path(), "rk3588", folder / f"{model.name}-int8", inputs=samples[0],
                                         precision="int8", calibration=stacked, tolerance=0.05)
        int8 = json.loads((bundle / "manifest.json").read_text())
        gate = int8.get("precision") or {}
        result["int8_stages"] = sorted({s["precision"] for s in int8["stages"] if s["provider"] == "rknn"})
        checked = gate.get("accuracy") if result["int8_stages"] == ["int8"] else next(
            (r["accuracy"] for r in gate.get("rejected", []) if r.get("gave_up") == "int8"), None)
        result["int8_rel_error"], result["int8_cosine"] = worst_of(checked or {})
        result["int8_failed"] = (checked or {}).get("error")
    return result


def worst_of(accuracy: dict) -> tuple[float | None, float | None]:
    """The precision gate's worst error of any output, relative to its largest reference value, and lowest
    cosine."""
    figures = [e for e in accuracy.values() if isinstance(e, dict) and e.get("max_rel_error") is not None]
    return (max((e["max_rel_error"] for e in figures), default=None),
            min((e["cosine"] for e in figures), default=None))


def table(rows: list[dict]) -> str:
    """The shipped corpus's rows as a Markdown table."""
    lines = ["| model | nodes on NPU | FLOPs on NPU | GFLOPs | est. fp16 ms | est. int8 ms | fp16 scaled error "
             "(cosine) | int8 relative error (cosine) | off the NPU |", "|" + "---|" * 9]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['model']} | skipped: {r['skipped']} |" + " |" * 7)
            continue
        off = ", ".join(sorted({f"{e['op']} ({e['kind']})" for e in r["off_npu"]})) or "none"
        int8 = "" if r.get("int8_rel_error") is None else (
            f"{'' if r['int8_stages'] == ['int8'] else 'rejected: '}{r['int8_rel_error']:.2g} ({r['int8_cosine']:.4f})")
        int8 = f"failed: {r['int8_failed'][:60]}" if r.get("int8_failed") else int8
        lines.append(
            f"| {r['model']} {'x'.join(map(str, next(iter(r['shapes'].values()))))} | {r['npu_nodes']}/{r['nodes']} "
            f"(shipped {r['shipped_nodes']}) | {100 * r['npu_flops_share']:.1f}% | {r['gflops']:.3g} | "
            f"{r['estimated_fp16_ms']} | {r['estimated_int8_ms']} | {r['fp16_scaled_error']:.2g} "
            f"({r['fp16_cosine']:.6f}){'' if r['fp16_ok'] else ' MISMATCH'} | {int8} | {off} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the tests' input sizes instead of the zoo's")
    parser.add_argument("--no-int8", action="store_true", help="skip the int8 bundles")
    parser.add_argument("--shipped", action="store_true", help="the models installed packages ship (SHIPPED), "
                        "then a Markdown table of them")
    parser.add_argument("--only", nargs="*", help="model names")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        if args.shipped:
            rows = []
            for model in SHIPPED:
                if args.only and model.name not in args.only:
                    continue
                missing = model.missing()
                row = {"model": model.name, "skipped": missing} if missing else shipped_row(
                    model, Path(folder), not args.no_int8)
                rows.append(row)
                print(json.dumps(row), flush=True)
            print(table(rows))
            return
        if importlib.util.find_spec("torchvision") is not None:
            from benchmarks.corpus_models import import_torchvision

            import_torchvision()  # the zoo's torchvision and timm classes import it
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
