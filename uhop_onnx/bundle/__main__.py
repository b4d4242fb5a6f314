"""`python -m uhop_onnx.bundle run BUNDLE --inputs in.npz [--output out.npz] [--threads N] [--key PUB]` on a
board."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from uhop_onnx.foundation.errors import UhopError
from uhop_onnx.foundation.files import read_npz

from . import load_bundle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m uhop_onnx.bundle", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a bundle on the arrays of an .npz file")
    run.add_argument("bundle", help="a bundle folder or .tar.gz")
    run.add_argument("--inputs", required=True, help="an .npz with one array per model input")
    run.add_argument("--output", help="write the outputs to this .npz")
    run.add_argument("--threads", type=int, default=None)
    run.add_argument("--key", help="the signer's public key (PEM): the bundle must be signed by it")
    args = parser.parse_args(argv)
    try:
        bundle = load_bundle(args.bundle, args.threads, key=args.key)
        feeds = read_npz(args.inputs)
        names = [o.name for o in bundle.get_outputs()]
        results = dict(zip(names, bundle.run(None, feeds), strict=True))
    except (UhopError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return getattr(error, "exit_code", 2)
    if args.output:
        np.savez(args.output, **results)
    for name, value in results.items():
        print(f"{name}: {value.dtype} {list(value.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
