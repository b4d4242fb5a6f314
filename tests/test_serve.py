"""`uhop-onnx serve`: the Open Inference Protocol on loopback, driven by tritonclient, checked against
ONNX Runtime, on the local engine and on Ray Serve."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest

from uhop_onnx.models import mlp
from uhop_onnx.products.optimizer import optimize
from uhop_onnx.serve.limits import Limits

from .conftest import assert_matches, reference
from .support import (HOST, adder, ask, count_closes, free_port, local_server, post, send_slowly, status_of, tower,
                      wait_ready)

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402 - after the skip
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

LIMIT = 64 * 1024  # the request size limit the test servers get
SPLIT = {"/fc1/MatMul": "ort-cpu", "/fc1/Add": "ort-cpu"}  # three stages: openvino, ort-cpu, openvino


def infer(client, x: np.ndarray, binary: bool = True, name: str = "mlp") -> np.ndarray:
    tensor = httpclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("output", binary_data=binary)]
    return client.infer(name, [tensor], outputs=outputs).as_numpy("output")


def burst(url: str, model: onnx.ModelProto, count: int = 200, threads: int = 16, seconds: float = 90) -> None:
    """`count` requests from `threads` threads, distinct inputs each, every answer checked."""
    inputs = np.random.default_rng(7).standard_normal((count, 4, 64)).astype(np.float32)
    local = threading.local()

    def one(k: int) -> np.ndarray:
        if not hasattr(local, "client"):
            local.client = httpclient.InferenceServerClient(url, network_timeout=30)
        return infer(local.client, inputs[k], binary=k % 4 != 0)

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(one, k) for k in range(count)]
        deadline = time.monotonic() + seconds
        answers = [f.result(timeout=max(0.1, deadline - time.monotonic())) for f in futures]
    expected = reference_batch(model, inputs)
    for got, want in zip(answers, expected):
        assert_matches([got], [want])


def reference_batch(model: onnx.ModelProto, inputs: np.ndarray) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [session.run(None, {"input": x})[0] for x in inputs]


def json_request(x: np.ndarray, name: str = "input", datatype: str = "FP32", shape=None) -> bytes:
    return json.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": shape or list(x.shape),
                                   "data": x.reshape(-1).tolist()}]}).encode()


def binary_request(declared: int, size: int) -> tuple[bytes, dict]:
    """An input claiming `declared` bytes of binary data, followed by `size` bytes."""
    header = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [4, 64],
                                     "parameters": {"binary_data_size": declared}}]}).encode()
    return header + bytes(size), {"Inference-Header-Content-Length": str(len(header))}


def metric(url: str, name: str, **labels) -> float:
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return mlp()


@pytest.fixture(scope="module")
def plan(model):
    return optimize(model, providers=["openvino", "ort-cpu"], assign=SPLIT, profile=False)


@pytest.fixture(scope="module")
def spans():
    """Spans the servers in this process record, in memory."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture(scope="module")
def local_url(plan, spans):
    with local_server(plan, "mlp", replicas=2, limits=Limits(max_request_bytes=LIMIT)) as (url, _):
        yield url


def test_health_and_metadata_through_tritonclient(local_url):
    client = httpclient.InferenceServerClient(local_url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mlp")
    assert not client.is_model_ready("other")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    metadata = client.get_model_metadata("mlp")
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [4, 64]}]
    assert metadata["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [4, 10]}]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_matches_onnx_runtime(local_url, model, binary):
    client = httpclient.InferenceServerClient(local_url)
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    assert_matches([infer(client, x, binary)], reference(model, {"input": x}))


def test_default_request_and_compressed_body(local_url, model):
    client = httpclient.InferenceServerClient(local_url)
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    tensor = httpclient.InferInput("input", [4, 64], "FP32")
    tensor.set_data_from_numpy(x)
    expected = reference(model, {"input": x})
    assert_matches([client.infer("mlp", [tensor], request_id="r1").as_numpy("output")], expected)
    zipped = client.infer("mlp", [tensor], request_compression_algorithm="gzip")
    assert_matches([zipped.as_numpy("output")], expected)


def test_burst_of_concurrent_requests_all_answered_correctly(local_url, model, spans):
    before = metric(local_url, "uhop_requests_total", code="200")
    burst(local_url, model)
    assert metric(local_url, "uhop_requests_total", code="200") - before == 200
    for k, provider in enumerate(["openvino", "ort-cpu", "openvino"]):
        assert metric(local_url, "uhop_stage_seconds_count", stage=k, provider=provider) >= 200
    stage_spans = [s for s in spans.get_finished_spans() if s.name.startswith("stage ")]
    assert {(s.attributes["stage"], s.attributes["provider"]) for s in stage_spans} == {
        (0, "openvino"), (1, "ort-cpu"), (2, "openvino")}


def test_spans_continue_the_callers_trace(local_url, spans):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    got, _ = post(local_url, "/v2/models/mlp/infer", json_request(np.zeros((4, 64), np.float32)),
                  {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert got == 200
    joined = [s for s in spans.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]
    assert sorted(s.name for s in joined) == ["infer", "stage 0", "stage 1", "stage 2"]


@pytest.mark.parametrize(("path", "body", "headers", "status", "message"), [
    ("/v2/models/nope/infer", json_request(np.zeros((4, 64))), {}, 404,
     "unknown model 'nope'; this server serves: mlp"),
    ("/v2/models/mlp/versions/2/infer", json_request(np.zeros((4, 64))), {}, 404, "no version '2'"),
    ("/v2/models/mlp/infer", json_request(np.zeros((4, 64)), name="x"), {}, 400,
     "unknown input 'x'; the model's inputs: input (FP32 [4, 64])"),
    ("/v2/models/mlp/infer", json_request(np.zeros((4, 64)), datatype="FP64"), {}, 400,
     "datatype 'FP64'; the model expects FP32"),
    ("/v2/models/mlp/infer", json_request(np.zeros((2, 64))), {}, 400, "shape [2, 64]; the model expects [4, 64]"),
    ("/v2/models/mlp/infer", json_request(np.zeros((4, 64)), shape=[4, 32]), {}, 400, "shape [4, 32]"),
    ("/v2/models/mlp/infer", json_request(np.zeros((4, 32)), shape=[4, 64]), {}, 400, "128 values for shape [4, 64]"),
    ("/v2/models/mlp/infer", b'{"inputs": [', {}, 400, "malformed JSON"),
    ("/v2/models/mlp/infer", b'{"inputs": ' + b"[" * 50_000, {}, 400, "nested too deeply"),
    ("/v2/models/mlp/infer", b'{"inputs": []}', {}, 400, "missing input(s) 'input'"),
    ("/v2/models/mlp/infer", b"x" * (LIMIT + 1), {}, 413, f"limit of {LIMIT} bytes"),
    ("/v2/models/mlp/infer", gzip.compress(b" " * (LIMIT + 1)), {"Content-Encoding": "gzip"}, 413, "limit"),
    ("/v2/models/mlp/infer", b"{}", {"Content-Encoding": "br"}, 415, "'br' is not supported"),
    ("/v2/models/mlp/infer", *binary_request(1024, 1000), 400, "binary_data_size 1024 exceeds the 1000 bytes"),
    ("/v2/models/mlp/infer", *binary_request(1024, 1030), 400, "6 bytes of binary data that no input claims"),
    ("/v2/models/mlp/infer", *binary_request(1020, 1020), 400, "1020 bytes of binary data for shape [4, 64]"),
    ("/v2/models/mlp/infer", json.dumps({"inputs": json.loads(json_request(np.zeros((4, 64))))["inputs"],
                                         "outputs": [{"name": "logits"}]}).encode(), {}, 400,
     "unknown output 'logits'; the model's outputs: output"),
    ("/v2/models/mlp/infer", json.dumps({"inputs": json.loads(json_request(np.zeros((4, 64))))["inputs"],
                                         "outputs": [{"name": ["output"]}]}).encode(), {}, 400,
     "unknown output ['output']; the model's outputs: output"),
], ids=["model", "version", "input-name", "dtype", "shape", "declared-shape", "count", "json", "deep-json", "missing",
        "oversized", "gzip-bomb", "encoding", "binary-short", "binary-extra", "binary-count", "output-name",
        "output-unhashable"])
def test_bad_requests_get_protocol_errors_and_the_server_keeps_serving(local_url, model, path, body, headers,
                                                                       status, message):
    before = metric(local_url, "uhop_requests_total", code=status)
    got, answer = post(local_url, path, body, headers)
    assert got == status and message in answer["error"], answer
    assert metric(local_url, "uhop_requests_total", code=status) == before + 1
    x = np.ones((4, 64), np.float32)
    assert_matches([infer(httpclient.InferenceServerClient(local_url), x)], reference(model, {"input": x}))


def test_wrong_dtype_from_tritonclient_is_an_inference_server_exception(local_url):
    tensor = httpclient.InferInput("input", [4, 64], "FP64")
    tensor.set_data_from_numpy(np.zeros((4, 64)))
    with pytest.raises(InferenceServerException, match="the model expects FP32") as caught:
        httpclient.InferenceServerClient(local_url).infer("mlp", [tensor])
    assert caught.value.status() == "400"


def test_wrong_method_and_path_are_json_errors(local_url):
    for path, status in (("/v2/models/mlp/infer", 405), ("/v3", 404)):
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"http://{local_url}{path}", timeout=10)
        assert caught.value.code == status and "error" in json.loads(caught.value.read())


def test_a_failing_stage_is_a_500_error_and_counted(tmp_path):
    plan = optimize(adder(), providers=["ort-cpu"], profile=False)
    with local_server(plan, "adder") as (url, _):
        client = httpclient.InferenceServerClient(url)
        assert client.get_model_metadata("adder")["inputs"][0]["shape"] == [-1]
        feeds = [httpclient.InferInput(n, [k], "FP32") for n, k in (("a", 3), ("b", 2))]
        for tensor, k in zip(feeds, (3, 2)):
            tensor.set_data_from_numpy(np.ones(k, np.float32))
        failed = r"stage 0 \(ort-cpu, 1 nodes from 'add'\) failed"
        with pytest.raises(InferenceServerException, match=failed) as caught:
            client.infer("adder", feeds)
        assert caught.value.status() == "500"
        assert metric(url, "uhop_stage_errors_total", stage=0, provider="ort-cpu") == 1
        feeds[1] = httpclient.InferInput("b", [3], "FP32")
        feeds[1].set_data_from_numpy(np.full(3, 2, np.float32))
        np.testing.assert_array_equal(client.infer("adder", feeds).as_numpy("sum"), np.full(3, 3, np.float32))


def test_the_local_app_closes_every_stage_runner_of_its_replicas(plan, monkeypatch):
    from uhop_onnx.providers import Runner
    from uhop_onnx.serve.local import local_app

    closed: list[Runner] = []
    count_closes(monkeypatch, closed)
    app = local_app(plan, "mlp", replicas=2)
    assert not closed
    app.state.replicas.close()  # as `run_local` does once the server stopped
    assert len(closed) == 2 * len(plan.stages) == len(set(map(id, closed)))


@pytest.mark.slow
def test_serve_command_on_a_model_file_names_the_model_after_its_stem(tmp_path, model):
    path = tmp_path / "tiny_mlp.onnx"
    onnx.save(model, path)
    port = free_port()
    code = f"from uhop_onnx.serve.cli import serve; serve({str(path)!r}, host={HOST!r}, port={port}, threads=1)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
    try:
        wait_ready(f"{HOST}:{port}", 60, process)
        client = httpclient.InferenceServerClient(f"{HOST}:{port}")
        assert client.get_model_metadata("tiny_mlp")["name"] == "tiny_mlp"
        x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
        assert_matches([infer(client, x, name="tiny_mlp")], reference(model, {"input": x}))
    finally:
        process.terminate()
        process.wait(timeout=20)
        process.stderr.close()


SLOW = 4000  # rows of the slow tower that keep a replica busy for about a second


@pytest.fixture(scope="module")
def batch_model() -> onnx.ModelProto:
    return tower(64, 4)


@pytest.fixture(scope="module")
def slow_plan():
    return optimize(tower(512, 32), providers=["ort-cpu"], profile=False, threads=1)


def raw_post(url: str, x: np.ndarray, name: str = "tower") -> tuple[int, str | None]:
    """A JSON infer request: its status and Retry-After header."""
    request = urllib.request.Request(f"http://{url}/v2/models/{name}/infer", data=json_request(x), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("Retry-After")
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Retry-After")


def wait_for_metric(url: str, name: str, value: float, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while metric(url, name) < value:
        assert time.monotonic() < deadline, f"{name} did not reach {value}"
        time.sleep(0.02)


def concurrent_answers(url: str, inputs: list[np.ndarray], threads: int = 8, name: str = "tower") -> list:
    """Every input sent at once from `threads` threads, one client per thread; the outputs in order."""
    local = threading.local()

    def one(x: np.ndarray) -> np.ndarray:
        if not hasattr(local, "client"):
            local.client = httpclient.InferenceServerClient(url, network_timeout=60)
        tensor = httpclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return local.client.infer(name, [tensor]).as_numpy("output")

    with ThreadPoolExecutor(threads) as pool:
        return [f.result(timeout=120) for f in [pool.submit(one, x) for x in inputs]]


def test_batched_answers_equal_unbatched_ones(batch_model):
    plan = optimize(batch_model, providers=["openvino", "ort-cpu"], profile=False,
                    assign={"/l2/MatMul": "ort-cpu", "/l2/Relu": "ort-cpu", "/l3/MatMul": "ort-cpu"})
    assert [s.provider for s in plan.stages] == ["openvino", "ort-cpu", "openvino"]
    rng = np.random.default_rng(8)
    inputs = [rng.standard_normal((1 + k % 3, 64)).astype(np.float32) for k in range(48)]
    with local_server(plan, "tower", limits=Limits(max_batch=8, max_delay_ms=20)) as (url, _):
        answers = concurrent_answers(url, inputs)
        runs = metric(url, "uhop_batch_size_count")
        assert metric(url, "uhop_batch_size_sum") == 48 and runs < 48  # some runs answered several requests
        assert metric(url, "uhop_queue_seconds_count") == 48
        assert metric(url, "uhop_stage_seconds_count", stage=1, provider="ort-cpu") == runs
    for x, got in zip(inputs, answers):
        assert_matches([got], reference(batch_model, {"input": x}))


def test_a_request_that_cannot_join_a_batch_runs_alone():
    plan = optimize(adder(), providers=["ort-cpu"], profile=False)
    good = {"a": np.arange(3, dtype=np.float32), "b": np.ones(3, np.float32)}
    bad = {"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)}  # joined, a and b would not broadcast
    with local_server(plan, "adder", limits=Limits(max_batch=4, max_delay_ms=300)) as (url, _):
        def send(feeds):
            tensors = []
            for name, value in feeds.items():
                tensors.append(httpclient.InferInput(name, list(value.shape), "FP32"))
                tensors[-1].set_data_from_numpy(value)
            try:
                return httpclient.InferenceServerClient(url).infer("adder", tensors).as_numpy("sum")
            except InferenceServerException as error:
                return error.status()

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(send, [good, bad, good]))
    np.testing.assert_array_equal(answers[0], good["a"] + 1)
    np.testing.assert_array_equal(answers[2], good["a"] + 1)
    assert answers[1] == "500"


def test_a_full_queue_answers_503_with_retry_after_and_the_server_stays_up(slow_plan):
    x = np.ones((1, 512), np.float32)
    with local_server(slow_plan, "tower", limits=Limits(max_queue=1)) as (url, _), ThreadPoolExecutor(4) as pool:
        slow = pool.submit(ask, url, np.ones((SLOW, 512), np.float32))
        wait_for_metric(url, "uhop_queue_seconds_count", 1)  # the slow one is running
        answers = list(pool.map(lambda _: raw_post(url, x), range(3)))
        assert sorted(answers) == [(200, None), (503, "1"), (503, "1")]
        assert slow.result(timeout=120)[0] == 200
        assert ask(url, x)[0] == 200 and metric(url, "uhop_requests_total", code=503) == 2


def test_a_request_past_the_timeout_answers_504(slow_plan):
    with local_server(slow_plan, "tower", limits=Limits(timeout_s=0.2)) as (url, _):
        tensor = httpclient.InferInput("input", [SLOW, 512], "FP32")
        tensor.set_data_from_numpy(np.ones((SLOW, 512), np.float32))
        with pytest.raises(InferenceServerException, match="no answer within the server's timeout of 0.2 s") as caught:
            httpclient.InferenceServerClient(url).infer("tower", [tensor])
        assert caught.value.status() == "504"
        deadline = time.monotonic() + 60
        while ask(url, np.ones((1, 512), np.float32))[0] != 200:  # once the slow run is over
            assert time.monotonic() < deadline


def test_shutdown_answers_what_it_accepted(slow_plan):
    x = np.random.default_rng(4).standard_normal((SLOW, 512)).astype(np.float32)
    with local_server(slow_plan, "tower") as (url, server), ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(ask, url, x)
        wait_for_metric(url, "uhop_queue_seconds_count", 1)
        server.should_exit = True
        code, got = accepted.result(timeout=120)
    assert code == 200 and got.shape == (SLOW, 512)
    assert_matches([got[:4]], reference(tower(512, 32), {"input": x[:4]}))


def test_clients_that_disconnect_are_one_log_line_each(local_url, caplog):
    caplog.set_level(logging.INFO)
    host, port = local_url.split(":")
    for _ in range(20):
        with socket.create_connection((host, int(port))) as connection:
            connection.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 9000\r\n\r\n{")
            time.sleep(0.01)
    deadline = time.monotonic() + 10
    while sum("disconnected" in r.getMessage() for r in caplog.records) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum("disconnected" in r.getMessage() for r in caplog.records) == 20
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert httpclient.InferenceServerClient(local_url).is_server_ready()


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray head and a second node advertising {"npu": 1}, on this machine; Serve on the head only.
    Yields the Serve URL."""
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.cluster_utils import Cluster

    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        pytest.skip("needs a Ray instance of its own")
    common = {"node_ip_address": HOST, "include_dashboard": False, "object_store_memory": 80 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, **common})
    patch = pytest.MonkeyPatch()
    try:
        # Both nodes listen on loopback only; without this the driver would dial the host's own address.
        patch.setattr("ray._private.ray_constants.ENABLE_RAY_CLUSTER", False)
        cluster.add_node(num_cpus=2, resources={"npu": 1}, **common)  # room for a plan replica beside the NPU stage
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": HOST, "port": port, "location": "HeadOnly"})
        yield f"{HOST}:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        patch.undo()


def deploy_in_time(app, name: str) -> None:
    from uhop_onnx.serve.ray_engine import deploy

    pool = ThreadPoolExecutor(1)
    try:
        pool.submit(deploy, app, name).result(timeout=180)
    finally:
        pool.shutdown(wait=False)


@pytest.mark.slow
def test_ray_whole_plan_replicas_batch_and_an_npu_stage_lands_on_its_node(two_nodes, batch_model):
    import ray
    from ray import serve

    from uhop_onnx.serve.ray_engine import ray_app

    plan = optimize(batch_model, providers=["openvino", "ort-cpu"], profile=False,
                    assign={"/l2/MatMul": "ort-cpu", "/l2/Relu": "ort-cpu"})
    assert len(plan.stages) == 3
    for stage in plan.stages:  # all three run on ort-cpu here; the middle one stands in for an NPU stage
        stage.provider, stage.options = "ort-cpu", {}
    npu = {1: {"resources": {"npu": 0.5}}}  # the stand-in asks for what only the second node has (2 replicas)
    deploy_in_time(ray_app(plan, "tower", replicas=2, num_cpus=0.5, limits=Limits(max_batch=4, max_delay_ms=20),
                           stage_options=npu), "tower")
    try:
        status = serve.status().applications["tower"].deployments
        assert sorted(status) == ["plan", "stage_1_ort-cpu"]  # the CPU stages run inside the plan's replicas
        assert status["plan"].replica_states == {"RUNNING": 2}
        assert ray.cluster_resources()["npu"] == 1 and ray.available_resources().get("npu", 0) == 0
        rng = np.random.default_rng(9)
        inputs = [rng.standard_normal((1 + k % 2, 64)).astype(np.float32) for k in range(32)]
        answers = concurrent_answers(two_nodes, inputs)
        for x, got in zip(inputs, answers):
            assert_matches([got], reference(batch_model, {"input": x}))
        assert metric(two_nodes, "uhop_batch_size_sum") >= 1
    finally:
        serve.delete("tower")


@pytest.mark.slow
def test_ray_full_queue_answers_503_and_stays_up(two_nodes, slow_plan):
    from uhop_onnx.serve.ray_engine import ray_app

    deploy_in_time(ray_app(slow_plan, "tower", num_cpus=0.5, limits=Limits(max_queue=1)), "tower")
    from ray import serve

    try:
        with ThreadPoolExecutor(8) as pool:
            slow = pool.submit(ask, two_nodes, np.ones((SLOW, 512), np.float32))
            time.sleep(0.5)
            answers = list(pool.map(lambda _: raw_post(two_nodes, np.ones((1, 512), np.float32)), range(6)))
            assert slow.result(timeout=120)[0] == 200
        assert (200, None) in answers and (503, "1") in answers and set(answers) <= {(200, None), (503, "1")}
        assert ask(two_nodes, np.ones((1, 512), np.float32))[0] == 200
    finally:
        serve.delete("tower")


@pytest.mark.slow
def test_ray_slow_bodies_hold_no_place_an_honest_request_needs(two_nodes, batch_model):
    """Ray Serve hands a request to a replica before its body has arrived: twelve bodies that never finish,
    against a queue of one, leave honest requests answered, and each slow one is cut off or timed out."""
    from ray import serve

    from uhop_onnx.serve.ray_engine import ray_app


    plan = optimize(batch_model, providers=["ort-cpu"], profile=False, threads=1)
    limits = Limits(max_queue=1, body_timeout_s=1.0, max_receiving=8)
    deploy_in_time(ray_app(plan, "tower", num_cpus=0.5, limits=limits), "tower")
    try:
        slow = [send_slowly(two_nodes) for _ in range(12)]
        time.sleep(0.5)  # all of them are arriving
        honest = [ask(two_nodes, np.ones((2, 64), np.float32))[0] for _ in range(5)]
        with ThreadPoolExecutor(12) as pool:  # Ray Serve's proxy, not the app, decides when to close
            statuses = list(pool.map(lambda connection: status_of(connection, closed=False), slow))
        assert honest == [200] * 5
        assert set(statuses) <= {408, 503} and 408 in statuses, statuses
    finally:
        serve.delete("tower")


@pytest.mark.parametrize(("provider", "options", "expected"), [
    ("ort-cpu", {}, {"num_cpus": 0.5}),
    ("openvino", {"device": "CPU"}, {"num_cpus": 0.5}),
    ("ort-cuda", {"device_id": 0}, {"num_cpus": 0.5, "num_gpus": 0.25}),
    ("ort-tensorrt", {}, {"num_cpus": 0.5, "num_gpus": 0.25}),
    ("openvino", {"device": "GPU.1"}, {"num_cpus": 0.5, "num_gpus": 0.25}),
    ("openvino", {"device": "NPU"}, {"num_cpus": 0.5, "resources": {"npu": 0.25}}),
    ("rknn", {}, {"num_cpus": 0.5, "resources": {"rknn": 0.25}}),
])
def test_stage_resources_follow_the_provider(provider, options, expected):
    pytest.importorskip("ray")
    from uhop_onnx.runtime.plan import Stage
    from uhop_onnx.serve.ray_engine import stage_resources

    stage = Stage(provider=provider, options=options, nodes=["n"], inputs=["x"], outputs=["y"], file="s.onnx")
    assert stage_resources(stage, 0.5, 0.25) == expected


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_codec_round_trips_every_datatype_through_tritonclient(binary):
    """tritonclient's own request encoder and response parser against our codec, one tensor per datatype."""
    from uhop_onnx.foundation.dtypes import TensorSig
    from uhop_onnx.serve.protocol import decode_request, encode_response

    rng = np.random.default_rng(5)
    values = {
        "FP32": rng.standard_normal((2, 3)).astype(np.float32), "FP16": rng.standard_normal(4).astype(np.float16),
        "FP64": rng.standard_normal((1, 2)), "INT64": rng.integers(-9, 9, (3,)), "INT8": np.array([-3, 4], np.int8),
        "UINT8": np.array([[0, 255]], np.uint8), "BOOL": np.array([True, False, True]),
        "BYTES": np.array([b"a", b"", "naïve".encode()], dtype=np.object_),
    }
    onnx_types = {"FP32": "float", "FP16": "float16", "FP64": "double", "INT64": "int64", "INT8": "int8",
                  "UINT8": "uint8", "BOOL": "bool", "BYTES": "string"}
    signatures = [TensorSig(f"t_{k}", f"tensor({onnx_types[k]})", [-1] * v.ndim) for k, v in values.items()]
    inputs = []
    for kind, value in values.items():
        tensor = httpclient.InferInput(f"t_{kind}", list(value.shape), kind)
        tensor.set_data_from_numpy(value, binary_data=binary)
        inputs.append(tensor)
    outputs = [httpclient.InferRequestedOutput(s.name, binary_data=binary) for s in signatures]
    body, header_length = httpclient.InferenceServerClient.generate_request_body(inputs, outputs, request_id="7")
    request = decode_request(body, None if header_length is None else str(header_length), signatures, signatures)
    assert request.id == "7" and request.outputs == [(s.name, binary) for s in signatures]
    content, headers = encode_response("m", request, request.feeds, signatures)
    result = httpclient.InferResult.from_response_body(content, header_length=headers.get(
        "Inference-Header-Content-Length") and int(headers["Inference-Header-Content-Length"]))
    for kind, value in values.items():
        got = result.as_numpy(f"t_{kind}")
        assert got.shape == value.shape and result.get_output(f"t_{kind}")["datatype"] == kind
        if kind == "BYTES":
            assert [g if isinstance(g, bytes) else g.encode() for g in got.reshape(-1)] == list(value.reshape(-1))
        else:
            np.testing.assert_array_equal(got.astype(value.dtype), value)
