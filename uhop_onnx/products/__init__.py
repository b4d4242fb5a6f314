"""Floor 6, the products: optimize, InferenceSession, export and verify, tune, Triton, the drop-in patch. Import any floor below."""
