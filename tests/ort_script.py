"""A user's onnxruntime script: `python ort_script.py MODULE MODEL...` runs with `import MODULE as ort`.

It prints what such a script looks at, one fact a line. Lines starting `num ` end with numbers (compared
within a tolerance); lines starting `provider ` name providers (not compared); every other line is compared
exactly between `onnxruntime` and `uhop_onnx`.
"""

import importlib
import json
import os
import sys
import threading

import numpy as np

ort = importlib.import_module(sys.argv[1])


def feeds_for(session, rng):
    """Seeded inputs; a free dimension is 2 (the first) or 3 (the others)."""
    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else (2 if axis == 0 else 3) for axis, d in enumerate(i.shape)]
        dtype = {"tensor(float)": np.float32, "tensor(int64)": np.int64}[i.type]
        feeds[i.name] = (rng.standard_normal(shape) * 2).astype(dtype)
    return feeds


def show(label, values):
    for name, value in zip(label, values):
        value = np.asarray(value)
        print("out", name, value.dtype, list(value.shape))
        flat = value.ravel().astype(np.float64)
        print("num", name, *np.round(flat[:32], 6), round(float(flat.sum()), 4))


for path in sys.argv[2:]:
    print("model", os.path.basename(path))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(os.path.dirname(path), "profile")
    session = ort.InferenceSession(path, options, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    print("provider", session.get_providers(), session.get_provider_options())
    print("threads", session.get_session_options().intra_op_num_threads)
    for arg in session.get_inputs():
        print("input", arg.name, arg.shape, arg.type)
    for arg in session.get_outputs():
        print("output", arg.name, arg.shape, arg.type)
    for arg in session.get_overridable_initializers():
        print("overridable", arg.name, arg.shape, arg.type)
    meta = session.get_modelmeta()
    print("meta", meta.producer_name, meta.graph_name, meta.domain, meta.description, meta.graph_description,
          meta.version, sorted(meta.custom_metadata_map.items()))
    names = [o.name for o in session.get_outputs()]
    feeds = feeds_for(session, np.random.default_rng(0))

    show(names, session.run(None, feeds, ort.RunOptions()))
    show(names[-1:], session.run(names[-1:], feeds))
    show(names, session.run(None, {k: v.tolist() for k, v in feeds.items()}))

    values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feeds.items()}
    results = session.run_with_ort_values(names, values)
    print("ortvalues", [type(r).__name__ for r in results], [r.shape() for r in results])
    show(names, [r.numpy() for r in results])

    binding = session.io_binding()
    for k, v in feeds.items():
        binding.bind_cpu_input(k, v)
    for name in names:
        binding.bind_output(name)
    session.run_with_iobinding(binding)
    show(names, binding.copy_outputs_to_cpu())

    done = threading.Event()
    got = {}

    def callback(outputs, user_data, error):
        got.update(outputs=outputs, user_data=user_data, error=error)
        done.set()

    session.run_async(None, feeds, callback, "tag")
    print("async", done.wait(60), got["user_data"], repr(got["error"]))
    show(names, got["outputs"])

    missing = dict(feeds)
    missing.pop(next(iter(missing)))
    try:
        session.run(None, missing)
    except ValueError:
        print("missing input: ValueError")

    trace = session.end_profiling()
    with open(trace) as handle:
        events = json.load(handle)
    print("profile", os.path.basename(trace).startswith("profile"), isinstance(events, list) and len(events) > 0,
          all({"name", "ts", "dur", "ph"} <= set(e) for e in events))
    os.remove(trace)
