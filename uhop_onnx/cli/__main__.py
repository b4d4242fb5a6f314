"""`python -m uhop_onnx.cli`: the command, as the console script `uhop-onnx` runs it."""

from . import main

main()
