"""cohort serve's ONNX backend on both runtimes against onnxruntime in process, in one run:
the same models, batch sizes and threads, one client.

    python3 crates/serve/bench/onnx_models_vs_ort.py --cohort target/release/cohort \
        [--threads 1] [--requests 500] [--backends onnxruntime,tract]

Models (made here with the `onnx` package, FP32, dynamic batch):
- `cnn`: onnx_runtimes_check.py's small CNN (Conv/Relu/MaxPool/Conv/Relu/GlobalAveragePool/
  Flatten/Gemm/Softmax), input [N, 3, 32, 32], batch 1 and 8;
- `resnet18`: ResNet-18's shape at 64x64 (7x7/2 stem, BatchNormalization unfolded, max pool,
  four stages of two basic blocks, 64-128-256-512 channels, global average pool, Gemm to 1000),
  input [N, 3, 64, 64], batch 1 and 8;
- `mlp`: onnx_vs_ort.py's MLP (256 -> 1024 -> 1024 -> 10), batch 1 and 32.

For each model and batch size: onnxruntime (Python, CPUExecutionProvider,
intra_op_num_threads = --threads, otherwise onnxruntime's defaults) `session.run` in a loop;
then for each backend, `cohort serve --instance-threads T` started with COHORT_ONNX_BACKEND set
to it, and `tritonclient.http` requests (binary tensors, one client, one at a time). Prints
inferences (rows) per second and p50 latency of each, and each backend's throughput as a ratio
of onnxruntime's. The server's load lines (which runtime, which library) go to stderr. Needs
numpy, onnx, onnxruntime and tritonclient[http].
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def build_resnet18(repo, size=64):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    nodes, inits = [], []
    count = [0]

    def fresh(p):
        count[0] += 1
        return f"{p}{count[0]}"

    def conv_bn(x, cin, cout, k, stride, relu):
        w, c = fresh("w"), fresh("c")
        a = (rng.normal(size=(cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))).astype(np.float32)
        inits.append(numpy_helper.from_array(a, w))
        p = k // 2
        nodes.append(helper.make_node("Conv", [x, w], [c], kernel_shape=[k, k],
                                      strides=[stride, stride], pads=[p, p, p, p]))
        names = [fresh(s) for s in ("g", "b", "m", "v")]
        vals = [rng.uniform(0.5, 1.0, cout), rng.normal(size=cout) * 0.1,
                rng.normal(size=cout) * 0.1, rng.uniform(0.5, 1.5, cout)]
        inits.extend(numpy_helper.from_array(v.astype(np.float32), n) for n, v in zip(names, vals))
        y = fresh("bn")
        nodes.append(helper.make_node("BatchNormalization", [c] + names, [y]))
        if relu:
            r = fresh("r")
            nodes.append(helper.make_node("Relu", [y], [r]))
            y = r
        return y

    x = conv_bn("X", 3, 64, 7, 2, True)
    p = fresh("pool")
    nodes.append(helper.make_node("MaxPool", [x], [p], kernel_shape=[3, 3], strides=[2, 2],
                                  pads=[1, 1, 1, 1]))
    x, cin = p, 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            s = stride if block == 0 else 1
            h = conv_bn(x, cin, cout, 3, s, True)
            h = conv_bn(h, cout, cout, 3, 1, False)
            short = conv_bn(x, cin, cout, 1, s, False) if (s != 1 or cin != cout) else x
            a, r = fresh("add"), fresh("r")
            nodes.append(helper.make_node("Add", [h, short], [a]))
            nodes.append(helper.make_node("Relu", [a], [r]))
            x, cin = r, cout
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"]))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], axis=1))
    fc = (rng.normal(size=(1000, 512)) / np.sqrt(512)).astype(np.float32)
    inits += [numpy_helper.from_array(fc, "fc"),
              numpy_helper.from_array(np.zeros(1000, np.float32), "fcb")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc", "fcb"], ["LOGITS"], transB=1))
    graph = helper.make_graph(
        nodes, "resnet18",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3, size, size])],
        [helper.make_tensor_value_info("LOGITS", TensorProto.FLOAT, ["N", 1000])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    os.makedirs(os.path.join(repo, "resnet18", "1"))
    onnx.save(model, os.path.join(repo, "resnet18", "1", "model.onnx"))
    with open(os.path.join(repo, "resnet18", "config.pbtxt"), "w") as f:
        f.write('platform: "onnxruntime_onnx"\nmax_batch_size: 8\n')


def build(repo):
    """The repository; (model, input name, input shape, output name, batch sizes) per model."""
    import onnx_runtimes_check
    import onnx_vs_ort

    with tempfile.TemporaryDirectory() as others:
        onnx_runtimes_check.make(others)
        shutil.move(os.path.join(others, "cnn"), os.path.join(repo, "cnn"))
    # one client, one request at a time: no batcher delay
    with open(os.path.join(repo, "cnn", "config.pbtxt"), "w") as f:
        f.write('platform: "onnxruntime_onnx"\nmax_batch_size: 8\n')
    build_resnet18(repo)
    onnx_vs_ort.build(repo)
    return [
        ("cnn", "X", (3, 32, 32), "PROBS", (1, 8)),
        ("resnet18", "X", (3, 64, 64), "LOGITS", (1, 8)),
        ("mlp", "INPUT", (256,), "PROBS", (1, 32)),
    ]


def timed(fn, requests, warmup=20):
    for _ in range(warmup):
        fn()
    lat = []
    start = time.perf_counter()
    for _ in range(requests):
        t0 = time.perf_counter()
        fn()
        lat.append((time.perf_counter() - t0) * 1e3)
    return time.perf_counter() - start, float(np.percentile(lat, 50))


def serve(cohort, repo, threads, backend):
    env = dict(os.environ, COHORT_ONNX_BACKEND=backend, COHORT_LOG="info")
    cmd = [cohort, "serve", "--model-repository", repo, "--address", "127.0.0.1",
           "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
           "--instance-threads", str(threads), "--repository-poll-secs", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    addr = next(w.rstrip(",") for w in line.split() if w.startswith("127.0.0.1:"))
    return proc, addr


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cohort", help="the cohort binary (omit: onnxruntime only)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--backends", default="onnxruntime,tract")
    a = p.parse_args()
    import onnxruntime as ort

    backends = [b for b in a.backends.split(",") if b] if a.cohort else []
    results = {}
    with tempfile.TemporaryDirectory() as repo:
        models = build(repo)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = a.threads
        inputs = {}
        for model, inp, shape, out, batches in models:
            path = os.path.join(repo, model, "1", "model.onnx")
            sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
            for b in batches:
                x = np.random.default_rng(1).uniform(-1, 1, size=(b, *shape)).astype(np.float32)
                inputs[(model, b)] = x
                results[(model, b, "ort")] = timed(lambda: sess.run([out], {inp: x}), a.requests)
        for backend in backends:
            import tritonclient.http as httpclient

            proc, addr = serve(a.cohort, repo, a.threads, backend)
            try:
                client = httpclient.InferenceServerClient(addr)
                for model, inp, shape, out, batches in models:
                    for b in batches:
                        x = inputs[(model, b)]
                        i = httpclient.InferInput(inp, list(x.shape), "FP32")
                        i.set_data_from_numpy(x, binary_data=True)
                        o = [httpclient.InferRequestedOutput(out, binary_data=True)]
                        results[(model, b, backend)] = timed(
                            lambda: client.infer(model, [i], outputs=o), a.requests)
            finally:
                proc.terminate()
                proc.wait()
    cols = ["ort"] + backends
    head = f"{'model':>9} {'batch':>5}" + "".join(f" {c + ' infer/s':>18} {'p50 ms':>7}" for c in cols)
    head += "".join(f" {c + '/ort':>15}" for c in backends)
    print(f"threads {a.threads}, {a.requests} requests per cell, 1 client "
          f"(cohort: tritonclient over HTTP)")
    print(head)
    for model, _, _, _, batches in models:
        for b in batches:
            line = f"{model:>9} {b:>5}"
            rate = {}
            for c in cols:
                seconds, p50 = results[(model, b, c)]
                rate[c] = a.requests * b / seconds
                line += f" {rate[c]:>18.1f} {p50:>7.3f}"
            line += "".join(f" {rate[c] / rate['ort']:>14.2f}x" for c in backends)
            print(line)


if __name__ == "__main__":
    main()
