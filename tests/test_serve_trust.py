"""The server under what a red team sent it: an empty batch, slow bodies, a large JSON document, more shapes
than a fixed-shape runtime should convert, and floats JSON has no number for. Each on a real server on
loopback, with bounded clients."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest

from uhop_onnx.models import cnn
from uhop_onnx.products.optimizer import optimize
from uhop_onnx.serve.limits import Limits

from .conftest import assert_matches, reference
from .support import adder, ask, local_server, post, send_slowly, status_of, tower

httpclient = pytest.importorskip("tritonclient.http")


def free_batch(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its first dimension free on every input and output."""
    del model.graph.value_info[:]
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    return model


def raw_post(url: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` to the adder; the status and the answer's bytes, not decoded."""
    host, port = url.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", "/v2/models/adder/infer", body)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_an_empty_batch_on_openvino_leaves_every_later_request_served():
    """OpenVINO's CPU plugin fails an empty batch through MaxPool, and then, on the compiled model it failed
    on, every later call at the shape it last ran: the runner must serve the next caller from a sound one."""
    model = free_batch(cnn())
    plan = optimize(model, providers=["openvino"], profile=False)
    assert [s.provider for s in plan.stages] == ["openvino"]
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    expected = reference(model, {"input": x})
    with local_server(plan, "cnn") as (url, _):
        assert_matches([ask(url, x, "cnn")[1]], expected)
        code, _ = ask(url, np.zeros((0, 3, 32, 32), np.float32), "cnn")
        assert code == 500  # ONNX Runtime answers shape (0, 10); OpenVINO cannot run MaxPool on it
        answers = [ask(url, x, "cnn") for _ in range(20)]
    assert [code for code, _ in answers] == [200] * 20
    for _, got in answers:
        assert_matches([got], expected)


def test_a_runner_pool_never_hands_out_what_a_failed_call_used():
    from uhop_onnx.providers.runner import Pool

    made = iter(range(100))
    pool = Pool(lambda: next(made))
    with pytest.raises(RuntimeError), pool.borrow() as broken:
        raise RuntimeError("the call failed")
    with pool.borrow() as fresh:
        assert fresh != broken
    with pool.borrow() as again:
        assert again == fresh  # one whose call succeeded is reused


@pytest.fixture(scope="module")
def tower_plan():
    return optimize(tower(64, 2), providers=["ort-cpu"], profile=False, threads=1)


def test_slow_bodies_hold_no_place_an_honest_request_needs(tower_plan):
    """Twelve connections that never finish their bodies, against a queue of one: honest requests are all
    answered meanwhile, and each slow one is cut off (503) or timed out (408), never left hanging."""
    limits = Limits(max_queue=1, body_timeout_s=1.0, max_receiving=8)
    x = np.ones((2, 64), np.float32)
    with local_server(tower_plan, "tower", limits=limits) as (url, _):
        slow = [send_slowly(url) for _ in range(12)]
        time.sleep(0.2)  # all of them are arriving
        honest = [ask(url, x)[0] for _ in range(5)]
        with ThreadPoolExecutor(12) as pool:
            statuses = list(pool.map(status_of, slow))
    assert honest == [200] * 5
    assert set(statuses) <= {408, 503} and statuses.count(408) >= 3 and statuses.count(503) >= 4, statuses


@pytest.mark.slow
def test_health_answers_at_once_while_a_large_json_request_is_decoded():
    """A 23 MiB JSON request (and its 12 MiB JSON answer): the event loop decodes and encodes none of it, so
    /v2/health/live keeps answering within milliseconds."""
    plan = optimize(adder(), providers=["ort-cpu"], profile=False)
    n = 600_000
    a, b = (np.random.default_rng(k).standard_normal(n).astype(np.float32) for k in (1, 2))
    body = json.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": [n], "data": value.tolist()}
                                  for name, value in (("a", a), ("b", b))]}).encode()
    assert len(body) > 23 * 2**20
    with local_server(plan, "adder") as (url, _), ThreadPoolExecutor(1) as pool:
        host, port = url.split(":")
        health = http.client.HTTPConnection(host, int(port), timeout=30)
        answer = pool.submit(raw_post, url, body)  # the server runs in this process: its client decodes nothing
        waits = []
        while not answer.done():
            start = time.perf_counter()
            health.request("GET", "/v2/health/live")
            assert health.getresponse().read() == b'{"live": true}'
            waits.append(time.perf_counter() - start)
            time.sleep(0.005)
        code, raw = answer.result()
        health.close()
    assert code == 200 and len(waits) > 20
    result = json.loads(raw)
    np.testing.assert_allclose(result["outputs"][0]["data"][:1000], (a + b)[:1000], rtol=1e-6)
    assert max(waits) < 0.25, f"health waited up to {max(waits) * 1e3:.0f} ms (median {np.median(waits) * 1e3:.1f})"


def test_non_finite_floats_travel_as_json_strings_and_back():
    """JSON has no NaN or infinity: the answer spells them "NaN", "Infinity", "-Infinity" (strict JSON that
    tritonclient reads back as floats), and a request may spell them so too."""
    plan = optimize(adder(), providers=["ort-cpu"], profile=False)
    data = ["NaN", "Infinity", "-Infinity", 1.5]
    body = json.dumps({"inputs": [{"name": "a", "datatype": "FP32", "shape": [4], "data": data},
                                  {"name": "b", "datatype": "FP32", "shape": [4], "data": [0, 0, 0, 1]}]}).encode()

    def strict(text: str):
        raise ValueError(f"{text} is not JSON")

    with local_server(plan, "adder") as (url, _):
        request = urllib.request.Request(f"http://{url}/v2/models/adder/infer", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
        assert json.loads(raw, parse_constant=strict)["outputs"][0]["data"] == ["NaN", "Infinity", "-Infinity", 2.5]
        tensor = httpclient.InferInput("a", [4], "FP32")
        tensor.set_data_from_numpy(np.array([np.nan, np.inf, -np.inf, 1.5], np.float32), binary_data=False)
        other = httpclient.InferInput("b", [4], "FP32")
        other.set_data_from_numpy(np.zeros(4, np.float32), binary_data=False)
        wanted = [httpclient.InferRequestedOutput("sum", binary_data=False)]
        got = httpclient.InferenceServerClient(url).infer("adder", [tensor, other], outputs=wanted).as_numpy("sum")
    np.testing.assert_array_equal(got, np.array([np.nan, np.inf, -np.inf, 1.5], np.float32))


def test_a_fixed_shape_stage_converts_for_a_bounded_set_of_shapes(tower_plan):
    """LiteRT builds a stage per input shape, each a conversion kept in the cache: a server converts for at
    most `max_shapes` of them, and a request at one more gets a 400 that says why."""
    model = tower(64, 2)
    plan = optimize(model, providers=["litert"], profile=False)
    assert [s.provider for s in plan.stages] == ["litert"]
    rng = np.random.default_rng(3)
    inputs = {n: rng.standard_normal((n, 64)).astype(np.float32) for n in (1, 2, 3)}
    with local_server(plan, "tower", limits=Limits(max_shapes=2)) as (url, _):
        assert_matches([ask(url, inputs[1])[1]], reference(model, {"input": inputs[1]}))
        assert_matches([ask(url, inputs[2])[1]], reference(model, {"input": inputs[2]}))
        code, answer = post(url, "/v2/models/tower/infer", json.dumps({"inputs": [
            {"name": "input", "datatype": "FP32", "shape": [3, 64], "data": inputs[3].ravel().tolist()}]}).encode())
        assert code == 400 and "built for at most 2 input shapes" in answer["error"], answer
        assert_matches([ask(url, inputs[1])[1]], reference(model, {"input": inputs[1]}))


def test_beyond_its_shapes_a_session_with_fallback_runs_the_stage_on_onnx_runtime(monkeypatch):
    from uhop_onnx.runtime.compile import compile_plan

    monkeypatch.setenv("UHOP_MAX_SHAPES", "1")
    model = tower(64, 2)
    plan = optimize(model, providers=["litert"], profile=False)
    rng = np.random.default_rng(4)
    with compile_plan(plan, fallback=True) as executor:
        for n in (1, 2):
            x = rng.standard_normal((n, 64)).astype(np.float32)
            if n == 1:
                got = executor.run(None, {"input": x})
            else:
                with pytest.warns(RuntimeWarning, match="at most 1 input shapes"):
                    got = executor.run(None, {"input": x})
            assert_matches(got, reference(model, {"input": x}))
    assert plan.fallbacks[0]["provider"] == "ort-cpu"


def test_the_conversions_new_shapes_cost_stay_under_the_cache_cap(monkeypatch, tmp_path):
    """Each shape a LiteRT stage runs at is a conversion kept in the cache (33 KiB here): six of them stay
    under a cap of 100 KiB, the least recently used dropped."""
    from uhop_onnx.runtime.compile import compile_plan

    monkeypatch.setenv("UHOP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("UHOP_CACHE_MAX", "100K")
    model = tower(64, 2)
    plan = optimize(model, providers=["litert"], profile=False)
    rng = np.random.default_rng(5)
    with compile_plan(plan) as executor:
        for n in range(1, 7):
            x = rng.standard_normal((n, 64)).astype(np.float32)
            assert_matches(executor.run(None, {"input": x}), reference(model, {"input": x}))
    kept = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert len([f for f in kept if f.suffix == ".tflite"]) >= 1
    assert sum(f.stat().st_size for f in kept) <= 100 * 1024
