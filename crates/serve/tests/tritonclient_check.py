"""Triton's official Python client (tritonclient[http,grpc]) against a running `cohort serve`.

Driven by crates/cohort/tests/serve.rs, which starts the server, computes the expected answers
with cohort itself (forward pass, `cohort sample`) and passes them in a JSON spec:

    python3 tritonclient_check.py SPEC.json

Checks health, metadata, inference over HTTP (binary and JSON tensors) and gRPC against cohort's
forward pass, generate / generate_stream against `cohort sample`, bad inputs, and a new model
version dropped into the repository while serving. Prints one line per check and
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
HTTP, GRPC, MODEL = spec["http"], spec["grpc"], spec["model"]
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


def infer(client, mod, version="", binary=True, ids=IDS):
    inp = mod.InferInput("input_ids", list(ids.shape), "INT64")
    if mod is httpclient:
        inp.set_data_from_numpy(ids, binary_data=binary)
        outs = [mod.InferRequestedOutput(n, binary_data=binary) for n in ("logits", "next_token")]
    else:
        inp.set_data_from_numpy(ids)
        outs = [mod.InferRequestedOutput(n) for n in ("logits", "next_token")]
    return client.infer(MODEL, [inp], model_version=version, outputs=outs)


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
    assert f'nv_inference_request_success{{model="{MODEL}",version="1"}}' in text, text
    assert "nv_inference_queue_duration_us" in text and "nv_inference_exec_count" in text


print(f"tritonclient checks: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
