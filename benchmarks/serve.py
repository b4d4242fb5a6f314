"""Serving throughput and latency under load: a plain ONNX Runtime loop, `serve --engine local` with and without
dynamic batching, and `--engine ray` (whole-plan replicas, and every stage its own deployment), at a few
concurrency levels.

    python benchmarks/serve.py [--model mobilenetv2|encoder] [--concurrency 1,4,16] [--requests 200] [--rounds 2]
    python benchmarks/serve.py --hop     # a deployment-handle round trip carrying arrays of 4 KB to 60 MB

Models (PyTorch, exported to ONNX with a free batch axis): MobileNetV2 at 224x224, and a BERT-sized encoder
(2 layers, hidden 128, 4 heads, sequence 128). The plan is split into three stages (OpenVINO, ONNX Runtime,
OpenVINO), so `ray-stages` crosses two deployment hops. Each candidate runs in its own process (a server
started with `uhop_onnx.serve.cli.serve`, or the ONNX Runtime loop), one after the other in alternating rounds;
`tritonclient.http` clients in this process (one per thread) send `--requests` requests per level (bounded by
`--seconds`). Reported per candidate and level: the best round's requests/s, and the minimum over rounds of
the round's p50 and p99 latency.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import typer

HOST = "127.0.0.1"
BATCH = {"max_batch": 8}
CANDIDATES = {"ort": {}, "local": {"engine": "local"}, "local-batch": {"engine": "local", **BATCH},
              "ray": {"engine": "ray", "replicas": 2}, "ray-batch": {"engine": "ray", "replicas": 2, **BATCH},
              "ray-stages": {"engine": "ray", "per_stage": True}}


def mobilenetv2():
    """MobileNetV2 (inverted residuals, ReLU6, width 1.0), 1000 classes, seeded weights; input 1x3x224x224."""
    import torch

    nn = torch.nn

    def conv(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, act: bool = True):
        layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, *([nn.ReLU6()] if act else []))

    class Inverted(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int):
            super().__init__()
            hidden = cin * expand
            self.residual = stride == 1 and cin == cout
            self.body = nn.Sequential(*([conv(cin, hidden, 1)] if expand != 1 else []),
                                      conv(hidden, hidden, 3, stride, hidden), conv(hidden, cout, 1, act=False))

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    layers, cin = [conv(3, 32, 3, 2)], 32
    for expand, cout, repeats, stride in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                                          (6, 160, 3, 2), (6, 320, 1, 1)]:
        for i in range(repeats):
            layers.append(Inverted(cin, cout, stride if i == 0 else 1, expand))
            cin = cout
    layers += [conv(cin, 1280, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, 1000)]
    return nn.Sequential(*layers), (1, 3, 224, 224)


def encoder(layers: int = 2, hidden: int = 128, heads: int = 4, seq: int = 128):
    """A BERT-style encoder over token embeddings: self-attention and a GELU MLP, each with a residual and
    LayerNorm; input 1 x seq x hidden."""
    import torch

    nn = torch.nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)

        def forward(self, x):
            q, k, v = (t.reshape(x.shape[0], seq, heads, hidden // heads).transpose(1, 2)
                       for t in self.qkv(x).chunk(3, dim=-1))
            attention = torch.softmax(q @ k.transpose(-1, -2) / (hidden // heads) ** 0.5, dim=-1) @ v
            x = self.ln1(x + self.out(attention.transpose(1, 2).reshape(x.shape[0], seq, hidden)))
            return self.ln2(x + self.mlp(x))

    return nn.Sequential(*[Layer() for _ in range(layers)]), (1, seq, hidden)


MODELS = {"mobilenetv2": mobilenetv2, "encoder": encoder}


def export(name: str, path: Path) -> onnx.ModelProto:
    """The model as ONNX with a free batch axis, written to `path`."""
    import torch

    torch.manual_seed(0)
    net, shape = MODELS[name]()
    torch.onnx.export(net.eval(), (torch.randn(*shape),), str(path), input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, opset_version=17, dynamo=False)
    return onnx.load(path)


def load(call, concurrency: int, count: int, seconds: float) -> dict[str, float]:
    """`count` calls from `concurrency` threads (stopping early after `seconds`): requests/s, p50, p99 (ms)."""
    latencies: list[float] = []
    lock = threading.Lock()
    issued = [0]
    deadline = time.monotonic() + seconds

    def worker() -> None:
        state: dict = {}
        while time.monotonic() < deadline:
            with lock:
                if issued[0] >= count:
                    return
                issued[0] += 1
            start = time.perf_counter()
            call(state)
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ms = np.array(latencies) * 1e3
    return {"rps": len(ms) / wall, "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "n": len(ms)}


def feeds_for(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {i.name: rng.standard_normal([d.dim_value or 1 for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in model.graph.input}


def ort_worker(model_file: str, levels: list[int], count: int, seconds: float) -> None:
    """The ONNX Runtime loop: one session, `concurrency` threads calling it; prints JSON results."""
    import onnxruntime as ort

    model = onnx.load(model_file)
    session = ort.InferenceSession(model_file, providers=["CPUExecutionProvider"])
    feeds = feeds_for(model)
    session.run(None, feeds)
    print(json.dumps({c: load(lambda _: session.run(None, feeds), c, count, seconds) for c in levels}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(plan_dir: Path, options: dict, port: int) -> subprocess.Popen:
    code = (f"from uhop_onnx.serve.cli import serve; serve({str(plan_dir)!r}, host={HOST!r}, port={port}, "
            f"model_name={plan_dir.name!r}, "
            + ", ".join(f"{k}={v!r}" for k, v in options.items()) + ")")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {process.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/v2/models/{plan_dir.name}/ready", timeout=2):
                return process
        except OSError:
            time.sleep(0.5)
    stop_server(process)
    raise RuntimeError("server not ready within 240 s")


def stop_server(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def measure_server(plan_dir: Path, options: dict, model: onnx.ModelProto, levels: list[int], count: int,
                   seconds: float) -> dict[int, dict[str, float]]:
    import tritonclient.http as httpclient

    port = free_port()
    process = start_server(plan_dir, options, port)
    try:
        (name, x), = feeds_for(model).items()
        tensor = httpclient.InferInput(name, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        url, model_name = f"{HOST}:{port}", plan_dir.name

        def call(state: dict):
            if "client" not in state:
                state["client"] = httpclient.InferenceServerClient(url, network_timeout=60)
            return state["client"].infer(model_name, [tensor])

        import onnxruntime as ort

        expected = ort.InferenceSession(model.SerializeToString()).run(None, {name: x})[0]
        got = call({}).as_numpy(model.graph.output[0].name)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
        load(call, max(levels), 2 * max(levels), seconds)  # warm up every replica
        figures = {c: load(call, c, count, seconds) for c in levels}
        print(f"  {options}: mean ms inside the server: {breakdown(url)}", file=sys.stderr)
        return figures
    finally:
        stop_server(process)


def breakdown(url: str) -> str:
    """Mean time per request at the server's entry and per stage on its provider, from `/metrics`."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    sums: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("uhop_request_seconds", "uhop_stage_seconds"):
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                labels = sample.labels
                key = f"stage {labels['stage']} {labels['provider']}" if "stage" in labels else "request"
                sums.setdefault(key, [0.0, 0.0])[sample.name.endswith("_count")] += sample.value
    return ", ".join(f"{key} {1e3 * total / count:.2f}" for key, (total, count) in sums.items() if count)


def hop_costs(sizes: tuple[int, ...] = (1024, 150_528, 1_505_280, 15_052_800), calls: int = 30) -> None:
    """Median time of a Ray Serve handle call from one deployment to another carrying a float32 array (as a
    stage deployment is called), by size: what passing tensors between deployments costs."""
    import ray
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0.5})
    class Sink:
        def __call__(self, feeds: dict) -> dict:
            return {name: np.float32(value.reshape(-1)[0]) for name, value in feeds.items()}

    @serve.deployment(ray_actor_options={"num_cpus": 0.5})
    class Caller:
        def __init__(self, sink):
            self.sink = sink

        async def __call__(self, n: int) -> float:
            feeds = {"x": np.ones(n, np.float32)}
            await self.sink.remote(feeds)
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                await self.sink.remote(feeds)
                times.append(time.perf_counter() - start)
            return float(np.median(times)) * 1e3

    ray.init(address="local", _node_ip_address=HOST, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": HOST, "port": free_port()})
        handle = serve.run(Caller.bind(Sink.bind()), name="hop", route_prefix=None)
        for n in sizes:
            print(f"{4 * n / 1e6:8.3f} MB: {handle.remote(n).result():6.2f} ms per round trip (median of {calls})")
    finally:
        serve.shutdown()
        ray.shutdown()


def main(
    model: str = typer.Option("mobilenetv2", help="Which model: " + ", ".join(MODELS)),
    concurrency: str = typer.Option("1,4,16", help="Concurrent clients, comma-separated."),
    requests: int = typer.Option(200, help="Requests per level and round."),
    rounds: int = typer.Option(2, help="Alternating rounds over the candidates."),
    seconds: float = typer.Option(60.0, help="Time bound per level and round."),
    candidates: str = typer.Option(",".join(CANDIDATES), help="Which of: " + ", ".join(CANDIDATES)),
    max_delay_ms: float = typer.Option(None, help="The batching candidates' --max-delay-ms (default: serve's)."),
    hop: bool = typer.Option(False, help="Only time a handle call between deployments, by tensor size."),
    worker: str = typer.Option("", hidden=True),
    model_file: str = typer.Option("", hidden=True),
) -> None:
    if hop:
        hop_costs()
        return
    levels = [int(c) for c in concurrency.split(",")]
    if max_delay_ms is not None:
        for options in CANDIDATES.values():
            if "max_batch" in options:
                options["max_delay_ms"] = max_delay_ms
    if worker == "ort":
        ort_worker(model_file, levels, requests, seconds)
        return
    from uhop_onnx.products.optimizer import optimize

    chosen = candidates.split(",")
    results: dict[str, list] = {c: [] for c in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = Path(tmp) / f"{model}.onnx"
        onnx_model = export(model, model_path)
        nodes = optimize(onnx_model, providers=["ort-cpu"], profile=False).stages[0].nodes  # the loaded names
        middle = {n: "ort-cpu" for n in nodes[len(nodes) // 3: 2 * len(nodes) // 3]}
        plan = optimize(onnx_model, providers=["openvino", "ort-cpu"], assign=middle, profile=False)
        plan_dir = plan.save(Path(tmp) / model)
        print(f"{model}: {len(plan.stages)} stages ({', '.join(s.label for s in plan.stages)}); "
              f"{os.cpu_count()} CPUs", file=sys.stderr)
        for r in range(rounds):
            for name in chosen:
                if name == "ort":
                    out = subprocess.run([sys.executable, __file__, "--worker", "ort", "--model-file", str(model_path),
                                          "--concurrency", concurrency, "--requests", str(requests),
                                          "--seconds", str(seconds)], check=True, capture_output=True, text=True)
                    figures = {int(k): v for k, v in json.loads(out.stdout).items()}
                else:
                    figures = measure_server(plan_dir, CANDIDATES[name], onnx_model, levels, requests, seconds)
                results[name].append(figures)
                print(f"round {r + 1} {name}: " + "  ".join(f"c={c} {f['rps']:.0f}/s p50 {f['p50']:.2f} ms"
                                                            for c, f in figures.items()), file=sys.stderr)
    print(f"\n{'candidate':<10}{'clients':>8}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for name in chosen:
        for c in levels:
            rounds_c = [r[c] for r in results[name]]
            print(f"{name:<10}{c:>8}{max(f['rps'] for f in rounds_c):>10.0f}"
                  f"{min(f['p50'] for f in rounds_c):>10.2f}{min(f['p99'] for f in rounds_c):>10.2f}")


if __name__ == "__main__":
    typer.run(main)
