"""Serving a plan over the Open Inference Protocol (KServe v2 REST): locally or on Ray Serve.

Modules: `protocol` (the JSON and binary tensor codec), `replicas` (a plan's executors, run off the event
loop), `batching` (dynamic batching), `app` (the Starlette app), `limits` (what it promises under load),
`bodies` (request bodies read under a deadline before a request waits), `offload` (the codec off the event
loop) and `workers` (the processes large JSON goes to), `local` and `ray_engine` (the engines), `metrics`
(Prometheus, OpenTelemetry), `source` (a plan, a plan folder or a model), `cli` (`serve`, mounted as
`uhop-onnx serve`). Needs the `serve` extra: `pip install uhop-onnx[serve]`.
"""
