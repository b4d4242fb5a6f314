"""The rknn-toolkit2 end of the converter. It runs under the toolkit's own Python (its virtual
environment) and imports only the standard library, numpy and `rknn`; uhop-onnx never imports it.

Protocol version 1: one JSON request per line on stdin, one JSON reply per line on stdout. The
toolkit's own messages go to stderr. Arrays travel as `.npy`/`.npz` files named in the requests.

  {"protocol": 1, "op": "info"}
      -> {"ok": true, "toolkit": "2.5.0"}
  {"protocol": 1, "op": "build", "onnx": PATH, "target": "rk3588", "dtype": "fp16" | "int8",
   "dataset": PATH | null, "rknn": PATH | null, "simulate": false, "disable_rules": [NAMES]}
      -> {"ok": true, "seconds": BUILD_SECONDS}
      `dataset` is the toolkit's calibration list (one line per sample, the .npy of each input
      separated by spaces); `rknn` is where to export; `simulate` keeps the model in the simulator;
      `disable_rules` are graph-fusion rules of the toolkit to skip (a failing one names itself in the log).
  {"protocol": 1, "op": "run", "inputs": NPZ, "order": [NAMES], "outputs": NPZ}
      -> {"ok": true}; runs the model built last with "simulate", outputs saved as arr_0, arr_1, ...
Every failure: {"ok": false, "error": MESSAGE}.
"""

import json
import os
import sys
import time

PROTOCOL = 1


class Failed(Exception):
    pass


def check(code, step):
    if code != 0:
        raise Failed(f"{step} returned {code} (the toolkit's log above says why)")


class Worker:
    def __init__(self):
        self.simulated = None

    def info(self, request):
        from importlib.metadata import version

        return {"toolkit": version("rknn-toolkit2")}

    def build(self, request):
        from rknn.api import RKNN

        self.release()
        rknn = RKNN(verbose=False)
        try:
            rules = request.get("disable_rules") or []
            rknn.config(target_platform=request["target"], **({"disable_rules": rules} if rules else {}))
            check(rknn.load_onnx(model=request["onnx"]), "load_onnx")
            start = time.perf_counter()
            quantize = request["dtype"] == "int8"
            check(rknn.build(do_quantization=quantize, dataset=request.get("dataset") if quantize else None), "build")
            seconds = time.perf_counter() - start
            if request.get("rknn"):
                check(rknn.export_rknn(request["rknn"]), "export_rknn")
            if request.get("simulate"):
                check(rknn.init_runtime(), "init_runtime (simulator)")
                self.simulated, rknn = rknn, None
        finally:
            if rknn is not None:
                rknn.release()
        return {"seconds": seconds}

    def run(self, request):
        import numpy as np

        if self.simulated is None:
            raise Failed("no model is loaded in the simulator: send a build with simulate first")
        feeds = np.load(request["inputs"])
        inputs = [feeds[name] for name in request["order"]]
        formats = ["nchw"] * len(inputs)
        outputs = self.simulated.inference(inputs=inputs, data_format=formats)
        if outputs is None:
            raise Failed("inference returned nothing (the toolkit's log above says why)")
        np.savez(request["outputs"], *outputs)
        return {}

    def release(self):
        if self.simulated is not None:
            self.simulated.release()
            self.simulated = None


def serve(requests, reply):
    worker = Worker()
    for line in requests:
        try:
            request = json.loads(line)
            if request.get("protocol") != PROTOCOL:
                raise Failed(f"protocol {request.get('protocol')!r} requested; this worker speaks {PROTOCOL}")
            op = request.get("op")
            if op not in ("info", "build", "run"):
                raise Failed(f"unknown op {op!r}; valid: info, build, run")
            answer = {"ok": True, **getattr(worker, op)(request)}
        except Exception as error:  # noqa: BLE001 - every failure becomes a reply; the host raises it
            lines = str(error).strip().splitlines()  # the toolkit puts a traceback in its messages
            answer = {"ok": False, "error": f"{type(error).__name__}: {lines[-1] if lines else ''}"}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
    worker.release()


def main():
    # The toolkit prints to stdout (some of it from C): keep stdout for replies only.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.stdin, reply)


if __name__ == "__main__":
    main()
