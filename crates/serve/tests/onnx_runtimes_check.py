"""Convolutional and attention models served by `cohort serve` on either ONNX runtime
(onnxruntime's library or tract), checked with Triton's Python client against onnxruntime in
this process on the same inputs.

Driven by crates/cohort/tests/serve.rs in two steps:

    python3 onnx_runtimes_check.py make REPO     writes the model repository
    python3 onnx_runtimes_check.py SPEC.json     checks the server the spec describes

The repository holds, made here with the `onnx` package (opset 17, dynamic batch dimension
"N"): `cnn` (Conv 3->16 3x3, Relu, MaxPool, Conv 16->32 3x3, Relu, GlobalAveragePool,
Flatten, Gemm, Softmax; input [N, 3, 32, 32]), `dwsep` (a depthwise-separable block: depthwise
Conv 3x3 with group = channels; input [N, 8, 12, 12], BatchNormalization, Relu, pointwise Conv 1x1, Relu) and
`encoder` (a transformer encoder block: LayerNormalization, one attention head of MatMul chains
and Softmax, a residual, LayerNormalization, a Relu MLP, a residual). The checks: each model's
outputs equal to onnxruntime's within TOL over HTTP (binary) and gRPC, unbatched (1 row) and
batched (5 rows, and concurrent requests the dynamic batcher joins). Prints one line per check
and "onnx runtime checks: N passed, M failed"; exits 1 if any failed.
"""

import json
import os
import sys
import traceback

import numpy as np

TOL = 1e-4
SEQ, D, FF = 8, 32, 64
MODELS = {
    # name: (input shape without the batch dimension, output name)
    "cnn": ((3, 32, 32), "PROBS"),
    "dwsep": ((8, 12, 12), "Y"),
    "encoder": ((SEQ, D), "Y"),
}


def make(repo):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)

    def w(name, *shape, fan_in=None):
        fan = fan_in or int(np.prod(shape[1:])) or 1
        a = (rng.normal(size=shape) / np.sqrt(fan)).astype(np.float32)
        return numpy_helper.from_array(a, name)

    def b(name, n, scale=0.1):
        return numpy_helper.from_array((rng.normal(size=n) * scale).astype(np.float32), name)

    def save(name, nodes, inits, out_dims):
        shape, out = MODELS[name]
        graph = helper.make_graph(
            nodes,
            name,
            [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", *shape])],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", *out_dims])],
            inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.checker.check_model(model)
        os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
        onnx.save(model, os.path.join(repo, name, "1", "model.onnx"))
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(
                'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
                "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
            )

    n = helper.make_node
    save(
        "cnn",
        [
            n("Conv", ["X", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            n("Relu", ["c1"], ["r1"]),
            n("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
            n("Conv", ["p1", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            n("Relu", ["c2"], ["r2"]),
            n("GlobalAveragePool", ["r2"], ["g"]),
            n("Flatten", ["g"], ["f"], axis=1),
            n("Gemm", ["f", "w3", "b3"], ["logits"], transB=1),
            n("Softmax", ["logits"], ["PROBS"], axis=1),
        ],
        [w("w1", 16, 3, 3, 3), b("b1", 16), w("w2", 32, 16, 3, 3), b("b2", 32)]
        + [w("w3", 10, 32), b("b3", 10)],
        [10],
    )
    save(
        "dwsep",
        [
            n("Conv", ["X", "dw"], ["d"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=8),
            n("BatchNormalization", ["d", "gamma", "beta", "mean", "var"], ["bn"]),
            n("Relu", ["bn"], ["r"]),
            n("Conv", ["r", "pw", "pb"], ["c"], kernel_shape=[1, 1]),
            n("Relu", ["c"], ["Y"]),
        ],
        [w("dw", 8, 1, 3, 3), w("pw", 16, 8, 1, 1), b("pb", 16)]
        + [
            numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), "gamma"),
            b("beta", 8),
            b("mean", 8),
            numpy_helper.from_array(rng.uniform(0.5, 2.0, 8).astype(np.float32), "var"),
        ],
        [16, 12, 12],
    )
    ln = lambda x, g, bb, y: n("LayerNormalization", [x, g, bb], [y], axis=-1, epsilon=1e-5)
    lin = lambda x, wn, bn, y: [n("MatMul", [x, wn], [y + "_m"]), n("Add", [y + "_m", bn], [y])]
    save(
        "encoder",
        [ln("X", "g1", "be1", "h")]
        + lin("h", "wq", "bq", "q")
        + lin("h", "wk", "bk", "k")
        + lin("h", "wv", "bv", "v")
        + [
            n("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
            n("MatMul", ["q", "kt"], ["s"]),
            n("Mul", ["s", "scale"], ["ss"]),
            n("Softmax", ["ss"], ["a"], axis=-1),
            n("MatMul", ["a", "v"], ["o"]),
        ]
        + lin("o", "wo", "bo", "proj")
        + [n("Add", ["X", "proj"], ["res1"]), ln("res1", "g2", "be2", "h2")]
        + lin("h2", "w1", "b1", "f1")
        + [n("Relu", ["f1"], ["f1r"])]
        + lin("f1r", "w2", "b2", "f2")
        + [n("Add", ["res1", "f2"], ["Y"])],
        [w(x, D, D, fan_in=D) for x in ("wq", "wk", "wv", "wo")]
        + [b(x, D) for x in ("bq", "bk", "bv", "bo", "be1", "be2", "b2")]
        + [numpy_helper.from_array(np.ones(D, np.float32), x) for x in ("g1", "g2")]
        + [w("w1", D, FF, fan_in=D), b("b1", FF), w("w2", FF, D, fan_in=FF)]
        + [numpy_helper.from_array(np.array(1 / np.sqrt(D), np.float32), "scale")],
        [SEQ, D],
    )


def check(spec_file):
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    with open(spec_file) as f:
        spec = json.load(f)
    http = httpclient.InferenceServerClient(spec["http"], concurrency=8)
    grpc = grpcclient.InferenceServerClient(spec["grpc"])
    results = []

    def run(name, fn):
        try:
            fn()
            results.append(True)
            print(f"ok   {name}")
        except Exception:
            results.append(False)
            print(f"FAIL {name}\n{traceback.format_exc()}")

    rng = np.random.default_rng(3)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    for model, (shape, out) in MODELS.items():
        path = os.path.join(spec["repo"], model, "1", "model.onnx")
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])

        def expect(x, sess=sess, out=out):
            return sess.run([out], {"X": x})[0]

        def close(got, want, what):
            assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
            err = float(np.max(np.abs(got - want)))
            assert err <= TOL, f"{what}: max |difference| {err:.3g} > {TOL}"

        def over_http(x, model=model, out=out):
            i = httpclient.InferInput("X", list(x.shape), "FP32")
            i.set_data_from_numpy(x, binary_data=True)
            o = httpclient.InferRequestedOutput(out, binary_data=True)
            return http.infer(model, [i], outputs=[o]).as_numpy(out)

        def over_grpc(x, model=model, out=out):
            i = grpcclient.InferInput("X", list(x.shape), "FP32")
            i.set_data_from_numpy(x)
            return grpc.infer(model, [i]).as_numpy(out)

        for rows in (1, 5):
            x = rng.normal(size=(rows, *shape)).astype(np.float32)
            run(
                f"{model}: {rows} row(s) over HTTP equal onnxruntime within {TOL}",
                lambda x=x: close(over_http(x), expect(x), "HTTP"),
            )
            run(
                f"{model}: {rows} row(s) over gRPC equal onnxruntime within {TOL}",
                lambda x=x: close(over_grpc(x), expect(x), "gRPC"),
            )

        def joined(model=model, out=out, expect=expect, close=close, shape=shape):
            xs = [rng.normal(size=(1, *shape)).astype(np.float32) for _ in range(8)]
            pending = []
            for x in xs:
                i = httpclient.InferInput("X", list(x.shape), "FP32")
                i.set_data_from_numpy(x, binary_data=True)
                pending.append(http.async_infer(model, [i]))
            for x, p in zip(xs, pending):
                close(p.get_result().as_numpy(out), expect(x), "concurrent")

        run(f"{model}: 8 concurrent requests (dynamic batching) equal onnxruntime", joined)

    passed = sum(results)
    print(f"onnx runtime checks: {passed} passed, {len(results) - passed} failed")
    return passed == len(results)


if __name__ == "__main__":
    if sys.argv[1:2] == ["make"]:
        make(sys.argv[2])
    elif len(sys.argv) == 2:
        sys.exit(0 if check(sys.argv[1]) else 1)
    else:
        sys.exit(f"usage: {sys.argv[0]} make REPO | SPEC.json")
