"""Helpers that several test files share: servers and requests, deadlines, hypothesis strategies."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper


HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_ready(url: str, seconds: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}: {process.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"server at {url} not ready within {seconds} s")


def post(url: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{url}{path}", data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@contextlib.contextmanager
def local_server(plan, name: str, **options):
    """`local_app(plan, ...)` under uvicorn in a thread of this process; yields its host:port and the server."""
    import uvicorn

    from uhop_onnx.serve.local import local_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(local_app(plan, name, **options), host=HOST, port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"{HOST}:{port}"
    try:
        wait_ready(url, 30)
        yield url, server
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def adder() -> onnx.ModelProto:
    """a + b, each of any length: lengths that do not broadcast fail in the runtime."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [d]) for n, d in (("a", "n"), ("b", "m"))]
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["sum"], name="add")], "adder", inputs,
                              [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["k"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def tower(width: int, layers: int) -> onnx.ModelProto:
    """`layers` MatMul + Relu of `width` on input [N, width], N free: the batch size sets the work."""
    rng = np.random.default_rng(11)
    nodes, weights, x = [], [], "input"
    for k in range(layers):
        weights.append(numpy_helper.from_array(
            (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), f"w{k}"))
        nodes += [helper.make_node("MatMul", [x, f"w{k}"], [f"h{k}"], name=f"/l{k}/MatMul"),
                  helper.make_node("Relu", [f"h{k}"], [f"r{k}"], name=f"/l{k}/Relu")]
        x = f"r{k}"
    nodes.append(helper.make_node("Identity", [x], ["output"], name="/out/Identity"))
    graph = helper.make_graph(nodes, "tower", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", width])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def ask(url: str, x: np.ndarray, name: str = "tower") -> tuple[int, np.ndarray | None]:
    """One binary request with its own client: (HTTP status, output or None)."""
    from tritonclient import http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(url, network_timeout=60)
    tensor = httpclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    try:
        return 200, client.infer(name, [tensor]).as_numpy("output")
    except InferenceServerException as error:
        return int(error.status()), None


def send_slowly(url: str, path: str = "/v2/models/tower/infer") -> socket.socket:
    """A connection that sends the headers of a 9000-byte request and one byte of its body, then nothing."""
    host, port = url.split(":")
    connection = socket.create_connection((host, int(port)), timeout=30)
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 9000\r\n\r\n{{".encode())
    return connection


def status_of(connection: socket.socket, closed: bool = True) -> int:
    """The status of the answer that arrives on `connection`; with `closed`, once the server has closed it (a
    client still sending must hold nothing of the server's)."""
    with connection, connection.makefile("rb") as answer:
        line = answer.readline()
        try:
            if closed:
                answer.read()  # to the end
        except ConnectionResetError:  # closed with the client's last bytes unread
            pass
    return int(line.split()[1])


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging) when the block takes longer than `seconds`."""

    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


@st.composite
def broadcast_pair(draw):
    """A shape and a shape that broadcasts against it (fewer axes, or ones)."""
    shape = draw(shapes)
    drop = draw(st.integers(0, len(shape) - 1))
    other = tuple(1 if draw(st.booleans()) else d for d in shape[drop:])
    return (shape, other) if draw(st.booleans()) else (other, shape)


MARGIN = 0.01  # what `measure.faster` allows the noise


def plans_below_the_chosen(profile: dict) -> list[str]:
    """The timed plans the gate did not reject whose every round median was faster, beyond the noise margin,
    than the chosen plan's fastest: what a report must never show beside its choice."""
    chosen = profile["candidates"][profile["chosen"]]
    if chosen["ms"] is None:
        return []
    return [f"{name} ({c['interval']}) lies below the chosen {profile['chosen']} ({chosen['interval']})"
            for name, c in profile["candidates"].items()
            if c["ms"] is not None and not c.get("rejected") and c["interval"][1] < chosen["interval"][0] * (1 - MARGIN)]


def assert_no_plan_below_the_chosen(profile: dict | None) -> None:
    """Fails when a report (a plan's `profile`) shows a plan below its chosen one (`plans_below_the_chosen`)."""
    wrong = plans_below_the_chosen(profile) if profile else []
    assert not wrong, "; ".join(wrong)
