"""Helpers that several test files share: servers and requests, deadlines, hypothesis strategies, providers that
charge a fake clock, the check every placement's report must pass."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from uhop_onnx.foundation.errors import CheckError
from uhop_onnx.providers import REGISTRY, Runner, Support
from uhop_onnx.providers.ort import OrtCpu
from uhop_onnx.providers.rknn.setup import is_ready, venv_path


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


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


class Charging(Runner):
    """A runner that computes for real (ONNX Runtime) and charges the fake clock per op and per call; with
    `fails`, it raises instead, as a runtime that cannot run its stage does."""

    def __init__(self, inner, cost: float, clock: FakeClock, fails: str | None = None):
        self.inner, self.cost, self.clock, self.device, self.fails = inner, cost, clock, "cpu", fails

    def run(self, feeds):
        if self.fails:
            raise RuntimeError(self.fails)
        self.clock.now += self.cost
        return self.inner.run(feeds)

    def to_host(self, value):
        return value

    def close(self):
        self.closed = True
        self.inner.close()


def fake_provider(ident: str, op_ms: dict[str, float], call_ms: float, clock: FakeClock, version: str = "1",
                  fails: Callable[[onnx.ModelProto], bool] = lambda model: False, refuses: frozenset = frozenset(),
                  miscompiles: frozenset = frozenset()):
    """A provider that runs everything ONNX Runtime does but the ops it `refuses`, at the given cost; its runner
    raises, at run time, on the models `fails` picks; its build check (in `compile`, as LiteRT's) fails on
    every model with an op it `miscompiles`."""

    class Fake(OrtCpu):
        id = ident

        def query(self, model):
            return {n.name: Support(False, f"{ident} has no {n.op_type}", "runtime")
                    for n in model.graph.node if n.op_type in refuses}

        def check(self, model):
            wrong = sorted({n.op_type for n in model.graph.node} & miscompiles)
            if wrong:
                raise CheckError(f"{ident}: the built stage differs from ONNX Runtime ({', '.join(wrong)})")

        @property
        def availability(self):
            available = super().availability
            return type(available)(ident, True, version, "CPU")

        def compile(self, model, *, exclusive=True):
            self.check(model)
            cost = call_ms + sum(op_ms.get(n.op_type, 0.01) for n in model.graph.node)
            failure = f"{ident} cannot run {model.graph.name}" if fails(model) else None
            return Charging(super().compile(model, exclusive=exclusive), cost / 1e3, clock, failure)

    return Fake


def install(monkeypatch, clock, conv: dict, gemm: dict, call_ms: float = 0.05):
    """Two fake providers, and a last resort that charges the clock too (and is slow at everything)."""
    monkeypatch.setitem(REGISTRY, "fake-conv", fake_provider("fake-conv", conv, call_ms, clock))
    monkeypatch.setitem(REGISTRY, "fake-gemm", fake_provider("fake-gemm", gemm, call_ms, clock))
    monkeypatch.setitem(REGISTRY, "ort-cpu", fake_provider("ort-cpu", {}, 100.0, clock))


def uhop(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """`uhop-onnx ARGS` in a process of its own, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "uhop_onnx.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


class Slowed:
    """An executor whose calls take `delay` seconds longer: a known difference for the decision rule."""

    def __init__(self, executor, delay: float):
        self._executor, self._delay = executor, delay

    def run(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._executor.run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._executor, name)


# A test in Rockchip's simulator: slow, and skipped where the toolkit's environment is absent; as a decorator
# (`needs_toolkit`) or a parameter's marks (`TOOLKIT_MARKS`).
TOOLKIT_MARKS = [pytest.mark.slow, pytest.mark.skipif(
    not is_ready(), reason=f"rknn-toolkit2 environment absent at {venv_path()}: create it with `uhop-onnx setup rknn`")]


def needs_toolkit(test):
    for mark in TOOLKIT_MARKS:
        test = mark(test)
    return test


SHAPE = (1, 3, 128, 128)


def anchored(channels: int = 32) -> onnx.ModelProto:
    """Two convolutions, then an anchor grid as exporters write one: the feature map's `Shape`, its height and
    width gathered, `Range` over each, added to the map. Batch, height and width are free."""
    rng = np.random.default_rng(0)

    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)

    def scalar(name, value):
        return numpy_helper.from_array(np.array(value, np.int64), name)

    nodes = [
        helper.make_node("Conv", ["images", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c2"], ["s"], name="sigmoid"),
        helper.make_node("Shape", ["c2"], ["dims"], name="shape"),
        helper.make_node("Gather", ["dims", "two"], ["h"], name="gather_h", axis=0),
        helper.make_node("Gather", ["dims", "three"], ["w"], name="gather_w", axis=0),
        helper.make_node("Range", ["zero", "h", "one"], ["ys"], name="range_h"),
        helper.make_node("Range", ["zero", "w", "one"], ["xs"], name="range_w"),
        helper.make_node("Cast", ["ys"], ["yf"], name="cast_h", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["xs"], ["xf"], name="cast_w", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["yf", "one_axis"], ["ycol"], name="column"),
        helper.make_node("Add", ["ycol", "xf"], ["grid"], name="grid"),
        helper.make_node("Add", ["s", "grid"], ["boxes"], name="anchored"),
    ]
    graph = helper.make_graph(
        nodes, "anchored",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["batch", channels, "height", "width"])],
        [weight("w1", channels, 3, 3, 3), weight("w2", channels, channels, 3, 3), scalar("zero", 0),
         scalar("one", 1), scalar("two", 2), scalar("three", 3),
         numpy_helper.from_array(np.array([1], np.int64), "one_axis")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def present_cpu_providers() -> list[str]:
    from uhop_onnx.providers import REGISTRY

    return [p for p in ("openvino", "litert", "kernels", "ort-cpu") if REGISTRY[p]().present]


def count_closes(monkeypatch, closed: list) -> None:
    """Every runner's `close` (the base's and each runner type's own) appends the runner to `closed` instead."""
    from uhop_onnx.providers import Runner

    kinds, found = [Runner], []
    while kinds:
        kind = kinds.pop()
        found.append(kind)
        kinds.extend(kind.__subclasses__())
    for kind in found:
        if "close" in kind.__dict__:
            monkeypatch.setattr(kind, "close", lambda runner: closed.append(runner))
