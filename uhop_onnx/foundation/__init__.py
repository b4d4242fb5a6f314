"""Floor 1, the foundation: errors, files, the cache, dtypes, the graph, samples and inputs, host facts. Imports nothing of uhop_onnx but uhop_onnx.precision's accuracy rule."""
