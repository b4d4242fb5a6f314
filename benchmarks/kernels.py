"""GFLOP/s of our kernels beside numpy (OpenBLAS), ONNX Runtime (MLAS) and a naive loop; see
`uhop_onnx.custom_ops.bench` for the method. Usage: python benchmarks/kernels.py [--threads 1,2] [--rounds 3]."""

from uhop_onnx.custom_ops.cli import bench

if __name__ == "__main__":
    import typer

    typer.run(bench)
