"""Triton's official Python client (tritonclient[http,grpc]) against a running `cohort serve`.

Driven by crates/cohort/tests/serve.rs, which starts the server, computes the expected answers
with cohort itself (forward pass, `cohort sample`) and passes them in a JSON spec:

    python3 tritonclient_check.py SPEC.json

Checks health, metadata, the model configuration (the same over HTTP and gRPC), inference over
HTTP (binary and JSON tensors, compressed or not) and gRPC (compressed or not) against cohort's
forward pass, statistics over both, the metrics port, generate / generate_stream against
`cohort sample`, bad inputs, a new model version dropped into the repository while serving, and
load_model with a configuration override (honoured, or refused by name). Prints one line per check and
"tritonclient checks: N passed, M failed"; exits 1 if any failed.
"""

import json
import os
import sys
import time
import traceback
import urllib.error
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

spec = json.load(open(sys.argv[1]))
HTTP, GRPC, METRICS, MODEL = spec["http"], spec["grpc"], spec["metrics"], spec["model"]
IDS = np.array(spec["ids"], dtype=np.int64)
VOCAB = spec["vocab"]

http = httpclient.InferenceServerClient(url=HTTP)
grpc = grpcclient.InferenceServerClient(url=GRPC)
passed, failed = 0, 0


def check(fn):
    global passed, failed
    try:
        fn()
        passed += 1
        print(f"ok   {fn.__name__}")
    except Exception:
        failed += 1
        print(f"FAIL {fn.__name__}")
        traceback.print_exc(file=sys.stdout)
    return fn


def expected(which):
    rows, seq = IDS.shape
    logits = np.array(spec[which], dtype=np.float32).reshape(rows, seq, VOCAB)
    return logits, logits[:, -1, :].argmax(axis=1).astype(np.int64)


def same_logits(got, want):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)


def infer(client, mod, version="", binary=True, ids=IDS, **kw):
    inp = mod.InferInput("input_ids", list(ids.shape), "INT64")
    if mod is httpclient:
        inp.set_data_from_numpy(ids, binary_data=binary)
        outs = [mod.InferRequestedOutput(n, binary_data=binary) for n in ("logits", "next_token")]
    else:
        inp.set_data_from_numpy(ids)
        outs = [mod.InferRequestedOutput(n) for n in ("logits", "next_token")]
    return client.infer(MODEL, [inp], model_version=version, outputs=outs, **kw)


def post(path, body, headers=None):
    req = urllib.request.Request(f"http://{HTTP}{path}", data=body, method="POST",
                                 headers=headers or {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def status_of(fn):
    try:
        fn()
    except InferenceServerException as e:
        return e.status(), e.message()
    raise AssertionError("the request succeeded but should have failed")


@check
def health_and_metadata():
    assert http.is_server_live() and http.is_server_ready()
    assert grpc.is_server_live() and grpc.is_server_ready()
    assert http.is_model_ready(MODEL) and grpc.is_model_ready(MODEL, "1")
    assert not http.is_model_ready("no_such_model")
    assert not grpc.is_model_ready(MODEL, "9")
    assert http.get_server_metadata()["name"] == "cohort"
    assert grpc.get_server_metadata().name == "cohort"
    m = http.get_model_metadata(MODEL)
    assert m["versions"] == ["1"], m
    assert m["inputs"] == [{"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}], m
    g = grpc.get_model_metadata(MODEL)
    assert [o.name for o in g.outputs] == ["logits", "next_token"], g
    assert list(g.outputs[0].shape) == [-1, -1, VOCAB], g


@check
def http_infer_binary_and_json_equal_the_forward_pass():
    logits, nxt = expected("logits_v1")
    for binary in (True, False):
        r = infer(http, httpclient, binary=binary)
        same_logits(r.as_numpy("logits"), logits)
        np.testing.assert_array_equal(r.as_numpy("next_token"), nxt)
        assert r.get_response()["model_version"] == "1"


@check
def grpc_infer_equals_the_forward_pass():
    logits, nxt = expected("logits_v1")
    r = infer(grpc, grpcclient, version="1")
    same_logits(r.as_numpy("logits"), logits)
    np.testing.assert_array_equal(r.as_numpy("next_token"), nxt)


@check
def model_config_is_the_same_over_http_and_grpc():
    h = http.get_model_config(MODEL)
    # protobuf's JSON (what as_json gives) writes 64-bit integers as strings
    g = grpc.get_model_config(MODEL, as_json=True)["config"]
    assert g["name"] == h["name"] == MODEL, (g, h)
    assert g["max_batch_size"] == h["max_batch_size"] == 4, (g, h)
    tensors = lambda ts: [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in ts]
    assert tensors(g["input"]) == tensors(h["input"]) == [("input_ids", "TYPE_INT64", [-1])], (g, h)
    assert tensors(g["output"]) == tensors(h["output"]), (g, h)
    assert tensors(h["output"])[0] == ("logits", "TYPE_FP32", [-1, VOCAB]), h
    db_g, db_h = g["dynamic_batching"], h["dynamic_batching"]
    assert db_g["preferred_batch_size"] == db_h["preferred_batch_size"] == [2, 4], (g, h)
    assert int(db_g["max_queue_delay_microseconds"]) == db_h["max_queue_delay_microseconds"] == 2000
    groups = lambda gs: [(x["kind"], int(x["count"])) for x in gs]
    assert groups(g["instance_group"]) == groups(h["instance_group"]) == [("KIND_CPU", 2)], (g, h)
    assert grpc.get_model_config(MODEL).config.max_batch_size == 4
    status, msg = status_of(lambda: grpc.get_model_config("no_such_model"))
    assert status == "StatusCode.NOT_FOUND", (status, msg)


@check
def compressed_requests_and_answers():
    logits, nxt = expected("logits_v1")
    for req, resp in (("gzip", "deflate"), ("deflate", "gzip"), (None, "gzip")):
        for binary in (True, False):
            r = infer(http, httpclient, binary=binary, request_compression_algorithm=req,
                      response_compression_algorithm=resp)
            same_logits(r.as_numpy("logits"), logits)
            np.testing.assert_array_equal(r.as_numpy("next_token"), nxt)
    for alg in ("gzip", "deflate"):
        r = infer(grpc, grpcclient, compression_algorithm=alg)
        same_logits(r.as_numpy("logits"), logits)


@check
def statistics_over_http_and_grpc_and_the_metrics_port():
    infer(http, httpclient)
    infer(grpc, grpcclient)
    h = {m["version"]: m for m in http.get_inference_statistics(MODEL)["model_stats"]}
    g = {m["version"]: m for m in grpc.get_inference_statistics(MODEL, as_json=True)["model_stats"]}
    assert list(h) == list(g) == ["1"], (h, g)
    hm, gm = h["1"], g["1"]
    assert hm["name"] == gm["name"] == MODEL
    assert int(gm["inference_count"]) == hm["inference_count"] >= 4, (hm, gm)
    assert int(gm["execution_count"]) == hm["execution_count"] >= 2, (hm, gm)
    assert hm["last_inference"] > 0
    for phase in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        hs, gs = hm["inference_stats"][phase], gm["inference_stats"][phase]
        assert int(gs["count"]) == hs["count"] >= 2, (phase, hs, gs)
        assert int(gs["ns"]) == hs["ns"] > 0, (phase, hs, gs)
    assert sum(b["compute_infer"]["count"] for b in hm["batch_stats"]) == hm["execution_count"]
    assert http.get_inference_statistics()["model_stats"] == [hm]
    with urllib.request.urlopen(f"http://{METRICS}/metrics", timeout=30) as r:
        text = r.read().decode()
    for family in ("nv_inference_compute_input_duration_us", "nv_inference_compute_output_duration_us",
                   "nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes"):
        assert f"\n{family}" in text, (family, text)


@check
def generate_equals_cohort_sample():
    for case in spec["generate"]:
        status, body = post(f"/v2/models/{MODEL}/generate",
                            json.dumps({"text_input": case["text_input"],
                                        "parameters": case["parameters"]}).encode())
        assert status == 200, body
        out = json.loads(body)
        assert out["text_output"] == case["text_output"], (out, case)
        # the stream carries the generated text only, piece by piece
        status, body = post(f"/v2/models/{MODEL}/generate_stream",
                            json.dumps({"text_input": case["text_input"],
                                        "parameters": dict(case["parameters"], stream=True)}).encode())
        assert status == 200, body
        pieces = [json.loads(line[len("data:"):]) for line in body.decode().splitlines()
                  if line.startswith("data:")]
        assert all("error" not in p for p in pieces), pieces
        streamed = "".join(p["text_output"] for p in pieces)
        assert case["text_input"] + streamed == case["text_output"], (streamed, case)


@check
def grpc_stream_generates_one_response_per_piece():
    import queue
    results = queue.Queue()
    grpc.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for n, case in enumerate(spec["generate"]):
            prompt = grpcclient.InferInput("text_input", [1], "BYTES")
            prompt.set_data_from_numpy(np.array([case["text_input"].encode()], dtype=np.object_))
            empty_final = n % 2 == 0
            grpc.async_stream_infer(MODEL, [prompt], request_id=f"g{n}",
                                    parameters=case["parameters"],
                                    enable_empty_final_response=empty_final)
            pieces = []
            while True:
                result, error = results.get(timeout=60)
                assert error is None, error
                r = result.get_response()
                assert r.id == f"g{n}", r
                out = result.as_numpy("text_output")
                if out is not None:
                    pieces.append(out[0].decode())
                if r.parameters["triton_final_response"].bool_param:
                    break
            assert len(pieces) > 1, pieces
            assert case["text_input"] + "".join(pieces) == case["text_output"], (pieces, case)
        # a bad request answers an error on the stream, which goes on
        bad = grpcclient.InferInput("text_input", [1], "BYTES")
        bad.set_data_from_numpy(np.array([b"a"], dtype=np.object_))
        grpc.async_stream_infer(MODEL, [bad], parameters={"max_tokens": 0})
        result, error = results.get(timeout=60)
        assert result is None and "max_tokens" in str(error), (result, error)
    finally:
        grpc.stop_stream()


@check
def bad_inputs_are_client_errors():
    bad_type = httpclient.InferInput("input_ids", [1, 3], "FP32")
    bad_type.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
    status, msg = status_of(lambda: http.infer(MODEL, [bad_type]))
    assert status == "400" and "datatype FP32" in msg, (status, msg)

    out_of_range = np.array([[1, VOCAB + 5]], dtype=np.int64)
    status, msg = status_of(lambda: infer(http, httpclient, ids=out_of_range))
    assert status == "400" and "outside the vocabulary" in msg, (status, msg)
    status, msg = status_of(lambda: infer(grpc, grpcclient, ids=out_of_range))
    assert status == "StatusCode.INVALID_ARGUMENT" and "outside the vocabulary" in msg, (status, msg)

    flat = np.array([1, 2, 3], dtype=np.int64)
    status, msg = status_of(lambda: infer(grpc, grpcclient, ids=flat))
    assert status == "StatusCode.INVALID_ARGUMENT" and "2 dimensions" in msg, (status, msg)

    status, msg = status_of(lambda: http.get_model_metadata("no_such_model"))
    assert status == "404", (status, msg)
    inp = grpcclient.InferInput("input_ids", [1, 2], "INT64")
    inp.set_data_from_numpy(np.array([[1, 2]], dtype=np.int64))
    status, msg = status_of(lambda: grpc.infer("no_such_model", [inp]))
    assert status == "StatusCode.NOT_FOUND", (status, msg)

    status, body = post(f"/v2/models/{MODEL}/infer", b"{\"inputs\": [")
    assert status == 400 and "error" in json.loads(body), body
    status, body = post(f"/v2/models/{MODEL}/infer", b" " * (spec["max_body_bytes"] + 1))
    assert status == 413 and "error" in json.loads(body), (status, body)
    # the server is still serving
    assert http.is_server_live()


@check
def a_new_version_is_served_without_a_restart():
    os.rename(spec["new_version"]["from"], spec["new_version"]["to"])
    deadline = time.time() + 20
    while not http.is_model_ready(MODEL, "2"):
        assert time.time() < deadline, "version 2 was not picked up"
        time.sleep(0.1)
    while http.get_model_metadata(MODEL)["versions"] != ["2"]:
        assert time.time() < deadline, "version 1 was not retired"
        time.sleep(0.1)
    logits, nxt = expected("logits_v2")
    for r in (infer(http, httpclient), infer(grpc, grpcclient)):
        same_logits(r.as_numpy("logits"), logits)
        np.testing.assert_array_equal(r.as_numpy("next_token"), nxt)


@check
def repository_api_and_metrics():
    index = http.get_model_repository_index()
    assert {"name": MODEL, "version": "2", "state": "READY"} in index, index
    g = grpc.get_model_repository_index()
    assert any(m.name == MODEL and m.state == "READY" for m in g.models), g
    with urllib.request.urlopen(f"http://{HTTP}/metrics", timeout=30) as r:
        text = r.read().decode()
    assert f'nv_inference_request_success{{model="{MODEL}",version="2"}}' in text, text
    # version 1 was unloaded: its series went with it, as Triton's do
    assert 'version="1"' not in text, text
    assert "nv_inference_queue_duration_us" in text and "nv_inference_exec_count" in text


@check
def load_model_with_a_config_override():
    http.load_model(MODEL, config=json.dumps({"max_batch_size": 1}))
    assert http.get_model_config(MODEL)["max_batch_size"] == 1
    # honoured: two rows are now too many
    status, msg = status_of(lambda: infer(http, httpclient))
    assert status == "400" and "max_batch_size" in msg, (status, msg)
    status, msg = status_of(lambda: grpc.load_model(MODEL, config=json.dumps(
        {"max_batch_size": 2, "sequence_batching": {}})))
    assert status == "StatusCode.INVALID_ARGUMENT" and "sequence_batching" in msg, (status, msg)
    status, msg = status_of(lambda: grpc.load_model(
        MODEL, config=json.dumps({"max_batch_size": 2}), files={"file:2/model.bin": b"x"}))
    assert status == "StatusCode.INVALID_ARGUMENT" and "override files" in msg, (status, msg)
    assert http.get_model_config(MODEL)["max_batch_size"] == 1
    # without an override, the repository's config.pbtxt again
    grpc.load_model(MODEL)
    assert grpc.get_model_config(MODEL).config.max_batch_size == 4
    logits, nxt = expected("logits_v2")
    same_logits(infer(http, httpclient).as_numpy("logits"), logits)


print(f"tritonclient checks: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
