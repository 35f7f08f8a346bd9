"""ONNX models and an ensemble served by `cohort serve`, checked with Triton's Python client
against onnxruntime on the same inputs.

Driven by crates/cohort/tests/serve.rs in two steps:

    python3 onnx_check.py make REPO         writes the model repository
    python3 onnx_check.py SPEC.json         checks the server the spec describes

The repository holds `preprocess` (standardizes 16 features), `classifier` (an MLP,
Gemm/Relu/Gemm/Softmax, two outputs), `pipeline` (an ensemble: preprocess -> classifier),
`half_mlp` (float16 in and out: Cast to float, Gemm/Relu, Cast to float16, a float16 Mul) and
`unsupported` (a node with an operator no runtime implements), all made here with the `onnx`
package. The checks: metadata and config from the model file; outputs equal to onnxruntime's
within 1e-5 over HTTP (binary and JSON) and gRPC, batched and unbatched; concurrent requests
joined by the dynamic batcher; the ensemble equal to calling its steps in turn, with
per-step statistics; FP16 outputs equal to onnxruntime's within one half-precision rounding
(HALF_RTOL) over HTTP and gRPC, batched and unbatched, and an FP16 JSON value beyond the half
range refused by name; the unsupported operator named in the load error while the others keep
serving. Prints one line per check and "onnx checks: N passed, M failed"; exits 1 if any failed.
"""

import concurrent.futures
import json
import os
import sys
import traceback

import numpy as np

FEATURES, HIDDEN, CLASSES = 16, 32, 4
TOL = 1e-5
# half_mlp does its sums in float32 and rounds them to float16 (Cast), then multiplies by
# float16 constants, rounding again. onnxruntime's CPU provider has no float16 Mul: it runs the
# Mul in float32 and drops the Cast between, rounding once, so about one output in ten differs
# by one unit in the last place from the graph as ONNX defines it (tract runs it as written).
# One unit is 2**-10 relative at most, under HALF_RTOL. Against numpy evaluating the graph as
# defined, the halves are equal but where two float32 sums straddle a rounding boundary (rare).
HALF_RTOL = 1e-3
HALF_IN, HALF_OUT = 8, 6


def make(repo):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)

    def save(name, graph, config):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8
        os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
        onnx.save(model, os.path.join(repo, name, "1", "model.onnx"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(config)

    def const(name, a):
        return numpy_helper.from_array(np.asarray(a, dtype=np.float32), name)

    mean = rng.normal(size=FEATURES).astype(np.float32)
    scale = (1.0 / rng.uniform(0.5, 2.0, size=FEATURES)).astype(np.float32)
    save(
        "preprocess",
        helper.make_graph(
            [
                helper.make_node("Sub", ["RAW", "mean"], ["centered"], name="center"),
                helper.make_node("Mul", ["centered", "scale"], ["FEATURES"], name="scale"),
            ],
            "preprocess",
            [helper.make_tensor_value_info("RAW", TensorProto.FLOAT, ["N", FEATURES])],
            [helper.make_tensor_value_info("FEATURES", TensorProto.FLOAT, ["N", FEATURES])],
            [const("mean", mean), const("scale", scale)],
        ),
        # no input/output sections: the backend reads them from model.onnx
        'backend: "onnxruntime"\nmax_batch_size: 8\n',
    )
    w1 = rng.normal(size=(FEATURES, HIDDEN)) / 4
    w2 = rng.normal(size=(HIDDEN, CLASSES)) / 4
    save(
        "classifier",
        helper.make_graph(
            [
                helper.make_node("Gemm", ["INPUT", "w1", "b1"], ["h"], name="fc1"),
                helper.make_node("Relu", ["h"], ["hr"], name="relu"),
                helper.make_node("Gemm", ["hr", "w2", "b2"], ["LOGITS"], name="fc2"),
                helper.make_node("Softmax", ["LOGITS"], ["PROBS"], name="softmax", axis=1),
            ],
            "classifier",
            [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["N", FEATURES])],
            [
                helper.make_tensor_value_info("LOGITS", TensorProto.FLOAT, ["N", CLASSES]),
                helper.make_tensor_value_info("PROBS", TensorProto.FLOAT, ["N", CLASSES]),
            ],
            [
                const("w1", w1),
                const("b1", rng.normal(size=HIDDEN) / 4),
                const("w2", w2),
                const("b2", rng.normal(size=CLASSES) / 4),
            ],
        ),
        f"""name: "classifier"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
output [
  {{ name: "LOGITS" data_type: TYPE_FP32 dims: [ {CLASSES} ] }},
  {{ name: "PROBS" data_type: TYPE_FP32 dims: [ -1 ] }}
]
dynamic_batching {{ max_queue_delay_microseconds: 50000 }}
instance_group [ {{ count: 2 kind: KIND_CPU }} ]
""",
    )
    os.makedirs(os.path.join(repo, "pipeline", "1"), exist_ok=True)
    with open(os.path.join(repo, "pipeline", "config.pbtxt"), "w") as f:
        f.write(
            f"""name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "RAW" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
output [ {{ name: "CLASS_PROBS" data_type: TYPE_FP32 dims: [ {CLASSES} ] }} ]
ensemble_scheduling {{
  step [
    {{
      model_name: "classifier"
      model_version: -1
      input_map {{ key: "INPUT" value: "features" }}
      output_map {{ key: "PROBS" value: "CLASS_PROBS" }}
    }},
    {{
      model_name: "preprocess"
      model_version: 1
      input_map {{ key: "RAW" value: "RAW" }}
      output_map {{ key: "FEATURES" value: "features" }}
    }}
  ]
}}
"""
        )
    w = rng.normal(size=(HALF_IN, HALF_OUT)) / 2
    save(
        "half_mlp",
        helper.make_graph(
            [
                helper.make_node("Cast", ["X16"], ["x"], name="up", to=TensorProto.FLOAT),
                helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc"),
                helper.make_node("Relu", ["h"], ["hr"], name="relu"),
                helper.make_node("Cast", ["hr"], ["h16"], name="down", to=TensorProto.FLOAT16),
                helper.make_node("Mul", ["h16", "s16"], ["Y16"], name="scale"),
            ],
            "half_mlp",
            [helper.make_tensor_value_info("X16", TensorProto.FLOAT16, ["N", HALF_IN])],
            [helper.make_tensor_value_info("Y16", TensorProto.FLOAT16, ["N", HALF_OUT])],
            [
                const("w", w),
                const("b", rng.normal(size=HALF_OUT) / 4),
                numpy_helper.from_array(
                    np.array([0.5, -2.0, 3.0, 0.1, 100.0, -7.0], dtype=np.float16), "s16"
                ),
            ],
        ),
        f"""platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "X16" data_type: TYPE_FP16 dims: [ {HALF_IN} ] }} ]
output [ {{ name: "Y16" data_type: TYPE_FP16 dims: [ {HALF_OUT} ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 50000 }}
""",
    )
    save(
        "unsupported",
        helper.make_graph(
            [
                helper.make_node("Relu", ["X"], ["r"], name="n1"),
                helper.make_node("Relu", ["r"], ["s"], name="n2"),
                helper.make_node("FancyOp", ["s"], ["Y"], name="n3"),
            ],
            "unsupported",
            [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4])],
        ),
        'platform: "onnxruntime_onnx"\nmax_batch_size: 4\n',
    )


def check(spec_file):
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    spec = json.load(open(spec_file))
    repo = spec["repo"]
    http = httpclient.InferenceServerClient(url=spec["http"], concurrency=16)
    grpc = grpcclient.InferenceServerClient(url=spec["grpc"])
    passed, failed = 0, 0
    rng = np.random.default_rng(11)

    def session(name):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        return ort.InferenceSession(
            os.path.join(repo, name, "1", "model.onnx"), opts, providers=["CPUExecutionProvider"]
        )

    pre, cls, half = session("preprocess"), session("classifier"), session("half_mlp")

    def as_defined(x):
        """half_mlp in numpy as ONNX defines it: float32 Gemm/Relu, Cast, float16 Mul."""
        import onnx
        from onnx import numpy_helper

        m = onnx.load(os.path.join(repo, "half_mlp", "1", "model.onnx"))
        p = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
        h = np.maximum(x.astype(np.float32) @ p["w"] + p["b"], 0).astype(np.float16)
        # a product of two halves is exact in float32: one rounding gives the float16 product
        return (h.astype(np.float32) * p["s16"].astype(np.float32)).astype(np.float16)

    def ort_classifier(x):
        logits, probs = cls.run(["LOGITS", "PROBS"], {"INPUT": x})
        return logits, probs

    def ort_pipeline(x):
        (features,) = pre.run(["FEATURES"], {"RAW": x})
        return ort_classifier(features)[1]

    def run(fn):
        nonlocal passed, failed
        try:
            fn()
            passed += 1
            print(f"ok   {fn.__name__}")
        except Exception:
            failed += 1
            print(f"FAIL {fn.__name__}")
            traceback.print_exc(file=sys.stdout)

    def dt(x):
        return "FP16" if x.dtype == np.float16 else "FP32"

    def http_infer(model, name, x, outputs, binary=True):
        inp = httpclient.InferInput(name, list(x.shape), dt(x))
        inp.set_data_from_numpy(x, binary_data=binary)
        outs = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in outputs]
        r = http.infer(model, [inp], outputs=outs)
        return [r.as_numpy(o) for o in outputs]

    def grpc_infer(model, name, x, outputs):
        inp = grpcclient.InferInput(name, list(x.shape), dt(x))
        inp.set_data_from_numpy(x)
        outs = [grpcclient.InferRequestedOutput(o) for o in outputs]
        r = grpc.infer(model, [inp], outputs=outs)
        return [r.as_numpy(o) for o in outputs]

    def close(got, want):
        assert got.shape == want.shape, (got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL)

    def metadata_and_config_come_from_the_model_file():
        for m in (
            http.get_model_metadata("classifier"),
            grpc.get_model_metadata("classifier", as_json=True),
        ):
            assert m["platform"] == "onnxruntime_onnx", m
            assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in m["inputs"]] == [
                ("INPUT", "FP32", [-1, FEATURES])
            ], m
            assert [t["name"] for t in m["outputs"]] == ["LOGITS", "PROBS"], m
        c = http.get_model_config("preprocess")
        assert c["backend"] == "onnxruntime" and c["platform"] == "onnxruntime_onnx", c
        assert c["input"][0]["name"] == "RAW" and c["input"][0]["data_type"] == "TYPE_FP32", c
        assert [int(d) for d in c["output"][0]["dims"]] == [FEATURES], c

    def http_matches_onnxruntime_batched_and_unbatched():
        for rows in (1, 5, 8):
            x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
            want = ort_classifier(x)
            for binary in (True, False):
                got = http_infer("classifier", "INPUT", x, ["LOGITS", "PROBS"], binary)
                close(got[0], want[0])
                close(got[1], want[1])
            (probs,) = http_infer("classifier", "INPUT", x, ["PROBS"])
            close(probs, want[1])

    def grpc_matches_onnxruntime_batched_and_unbatched():
        for rows in (1, 3, 8):
            x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
            want = ort_classifier(x)
            got = grpc_infer("classifier", "INPUT", x, ["LOGITS", "PROBS"])
            close(got[0], want[0])
            close(got[1], want[1])

    def concurrent_requests_are_batched_and_each_gets_its_rows():
        before = http.get_inference_statistics("classifier")["model_stats"][0]
        xs = [rng.normal(size=(1 + i % 2, FEATURES)).astype(np.float32) for i in range(12)]
        pending = []
        for x in xs:
            inp = httpclient.InferInput("INPUT", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            pending.append(http.async_infer("classifier", [inp]))
        for x, p in zip(xs, pending):
            close(p.get_result().as_numpy("PROBS"), ort_classifier(x)[1])
        after = http.get_inference_statistics("classifier")["model_stats"][0]
        requests = int(after["inference_stats"]["success"]["count"]) - int(
            before["inference_stats"]["success"]["count"]
        )
        executions = int(after["execution_count"]) - int(before["execution_count"])
        assert requests == 12, (before, after)
        assert executions < requests, f"{executions} executions for {requests} requests"

    def a_bad_input_is_refused_by_name():
        x = np.zeros((1, FEATURES + 1), dtype=np.float32)
        try:
            http_infer("classifier", "INPUT", x, ["PROBS"])
        except InferenceServerException as e:
            assert "INPUT" in str(e) and "dimension 1 must be 16" in str(e), e
        else:
            raise AssertionError("a wrong feature count was accepted")
        try:
            http_infer("classifier", "FEATURES", x[:, :FEATURES], ["PROBS"])
        except InferenceServerException as e:
            assert "no input tensor \"FEATURES\"" in str(e), e
        else:
            raise AssertionError("a wrong input name was accepted")

    def the_ensemble_equals_its_steps_in_turn():
        for rows in (1, 4):
            x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
            (features,) = http_infer("preprocess", "RAW", x, ["FEATURES"])
            (probs,) = http_infer("classifier", "INPUT", features, ["PROBS"])
            for got in (
                http_infer("pipeline", "RAW", x, ["CLASS_PROBS"])[0],
                grpc_infer("pipeline", "RAW", x, ["CLASS_PROBS"])[0],
            ):
                np.testing.assert_array_equal(got, probs)
                close(got, ort_pipeline(x))

    def the_ensemble_and_each_step_keep_statistics():
        def count(model):
            s = http.get_inference_statistics(model)["model_stats"][0]
            return int(s["inference_stats"]["success"]["count"])

        before = {m: count(m) for m in ("pipeline", "preprocess", "classifier")}
        x = rng.normal(size=(2, FEATURES)).astype(np.float32)
        http_infer("pipeline", "RAW", x, ["CLASS_PROBS"])
        after = {m: count(m) for m in before}
        assert all(after[m] == before[m] + 1 for m in before), (before, after)
        m = http.get_model_metadata("pipeline")
        assert m["platform"] == "ensemble", m

    def half_close(got, want):
        assert got.dtype == np.float16 and got.shape == want.shape, (got.dtype, got.shape)
        np.testing.assert_allclose(
            got.astype(np.float32), want.astype(np.float32), rtol=HALF_RTOL, atol=0
        )

    def fp16_matches_onnxruntime_over_http_and_grpc_batched_and_unbatched():
        m = http.get_model_metadata("half_mlp")
        assert [(t["name"], t["datatype"]) for t in m["inputs"] + m["outputs"]] == [
            ("X16", "FP16"),
            ("Y16", "FP16"),
        ], m
        c = grpc.get_model_config("half_mlp", as_json=True)["config"]
        assert c["input"][0]["data_type"] == "TYPE_FP16", c
        equal = ort_equal = total = 0
        for rows in (1, 3, 8, 8, 8):
            x = (rng.normal(size=(rows, HALF_IN)) * 3).astype(np.float16)
            (want,) = half.run(["Y16"], {"X16": x})
            assert want.dtype == np.float16
            defined = as_defined(x)
            got = grpc_infer("half_mlp", "X16", x, ["Y16"])[0]
            half_close(got, want)
            # the three encodings carry the same halves, bit for bit
            for other in (
                http_infer("half_mlp", "X16", x, ["Y16"])[0],
                http_infer("half_mlp", "X16", x, ["Y16"], binary=False)[0],
            ):
                assert other.dtype == np.float16
                np.testing.assert_array_equal(other.view(np.uint16), got.view(np.uint16))
            equal += int((got == defined).sum())
            ort_equal += int((got == want).sum())
            total += got.size
        # tract runs the graph as written; the ONNX Runtime library (cohort's runtime where it
        # loads) rounds as onnxruntime in this process does
        assert max(equal, ort_equal) >= 0.99 * total, (
            f"only {equal} of {total} halves equal the graph's, {ort_equal} onnxruntime's"
        )
        print(
            f"     fp16: {equal} of {total} outputs bit-equal to the graph as defined, "
            f"{ort_equal} to onnxruntime's (which rounds once, see HALF_RTOL)"
        )

    def concurrent_fp16_requests_are_batched_and_each_gets_its_rows():
        before = http.get_inference_statistics("half_mlp")["model_stats"][0]
        xs = [(rng.normal(size=(1 + i % 3, HALF_IN)) * 3).astype(np.float16) for i in range(9)]
        pending = []
        for x in xs:
            inp = httpclient.InferInput("X16", list(x.shape), "FP16")
            inp.set_data_from_numpy(x)
            pending.append(http.async_infer("half_mlp", [inp]))
        for x, p in zip(xs, pending):
            half_close(p.get_result().as_numpy("Y16"), half.run(["Y16"], {"X16": x})[0])
        after = http.get_inference_statistics("half_mlp")["model_stats"][0]
        executions = int(after["execution_count"]) - int(before["execution_count"])
        assert executions < len(xs), f"{executions} executions for {len(xs)} requests"

    def an_fp16_json_value_beyond_the_half_range_is_refused_by_name():
        import urllib.error
        import urllib.request

        data = [1.0] * HALF_IN
        data[3] = 70000.0  # the largest half is 65504
        body = {"inputs": [{"name": "X16", "shape": [1, HALF_IN], "datatype": "FP16", "data": data}]}
        req = urllib.request.Request(
            f"http://{spec['http']}/v2/models/half_mlp/infer",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(req)
        except urllib.error.HTTPError as e:
            text = e.read().decode()
            assert e.code == 400 and "X16[3] = 70000.0" in text and "FP16" in text, (e.code, text)
        else:
            raise AssertionError("an FP16 value of 70000 was accepted")
        # 3.0004 is no half; the nearest is 3 (the next is 3.001953125)
        data[3] = 3.0004
        body["inputs"][0]["data"] = data
        x = np.array([data], dtype=np.float16)
        assert x[0, 3] == 3
        (want,) = half.run(["Y16"], {"X16": x})
        req = urllib.request.Request(
            f"http://{spec['http']}/v2/models/half_mlp/infer",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        got = json.load(urllib.request.urlopen(req))["outputs"][0]
        assert got["datatype"] == "FP16", got
        got = np.array(got["data"], dtype=np.float16).reshape(want.shape)
        half_close(got, want)
        np.testing.assert_array_equal(got, as_defined(x))

    def an_unsupported_operator_fails_its_load_by_name_and_the_others_serve():
        assert not http.is_model_ready("unsupported")
        index = {e["name"]: e for e in http.get_model_repository_index()}
        reason = index["unsupported"].get("reason", "")
        want = 'model.onnx: unsupported ONNX operator "FancyOp" (node "n3")'
        assert want in reason, index["unsupported"]
        try:
            http.load_model("unsupported")
        except InferenceServerException as e:
            assert want in str(e), e
        else:
            raise AssertionError("loading a model with an unsupported operator succeeded")
        assert http.is_model_ready("classifier") and http.is_model_ready("pipeline")
        x = rng.normal(size=(2, FEATURES)).astype(np.float32)
        close(grpc_infer("classifier", "INPUT", x, ["PROBS"])[0], ort_classifier(x)[1])

    for fn in (
        metadata_and_config_come_from_the_model_file,
        http_matches_onnxruntime_batched_and_unbatched,
        grpc_matches_onnxruntime_batched_and_unbatched,
        concurrent_requests_are_batched_and_each_gets_its_rows,
        a_bad_input_is_refused_by_name,
        the_ensemble_equals_its_steps_in_turn,
        the_ensemble_and_each_step_keep_statistics,
        fp16_matches_onnxruntime_over_http_and_grpc_batched_and_unbatched,
        concurrent_fp16_requests_are_batched_and_each_gets_its_rows,
        an_fp16_json_value_beyond_the_half_range_is_refused_by_name,
        an_unsupported_operator_fails_its_load_by_name_and_the_others_serve,
    ):
        run(fn)
    print(f"onnx checks: {passed} passed, {failed} failed")
    return failed == 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["make"]:
        make(sys.argv[2])
    elif len(sys.argv) == 2:
        sys.exit(0 if check(sys.argv[1]) else 1)
    else:
        sys.exit(f"usage: {sys.argv[0]} make REPO | SPEC.json")
