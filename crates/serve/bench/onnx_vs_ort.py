"""cohort's ONNX backend against onnxruntime on the same model, batch sizes and threads.

    python3 crates/serve/bench/onnx_vs_ort.py [--cohort target/release/cohort] [--requests N]

Builds an MLP classifier (256 -> 1024 -> 1024 -> 10, Gemm/Relu/Gemm/Relu/Gemm/Softmax, FP32)
with the `onnx` package into a temporary model repository (`mlp`, platform onnxruntime_onnx,
max_batch_size 32, one instance), then measures at batch 1 and 32 with one client:

- onnxruntime (Python, CPUExecutionProvider, intra_op_num_threads=1, inter_op_num_threads=1,
  sequential execution): `session.run` in a loop, in process;
- with --cohort, `cohort bench serve --repository R --model mlp --threads 1`: requests over
  gRPC on loopback to an in-process server (protocol, queue and copies included).

Prints inferences (rows) per second and p99 latency of each, and cohort's throughput as a
ratio of onnxruntime's. Needs numpy, onnx and onnxruntime.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def build(repo, sizes=(256, 1024, 1024, 10)):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "INPUT"
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        w = (rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
        b = (rng.normal(size=n_out) / 10).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        last = i == len(sizes) - 2
        y = "LOGITS" if last else f"h{i}"
        nodes.append(helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [y], name=f"fc{i}"))
        if not last:
            nodes.append(helper.make_node("Relu", [y], [f"r{i}"], name=f"relu{i}"))
            y = f"r{i}"
        x = y
    nodes.append(helper.make_node("Softmax", ["LOGITS"], ["PROBS"], name="softmax", axis=1))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["N", sizes[0]])],
        [helper.make_tensor_value_info("PROBS", TensorProto.FLOAT, ["N", sizes[-1]])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    os.makedirs(os.path.join(repo, "mlp", "1"))
    path = os.path.join(repo, "mlp", "1", "model.onnx")
    onnx.save(model, path)
    with open(os.path.join(repo, "mlp", "config.pbtxt"), "w") as f:
        f.write(
            'platform: "onnxruntime_onnx"\nmax_batch_size: 32\n'
            "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        )
    return path


def onnxruntime_rows(path, batches, requests):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    rows = {}
    for b in batches:
        x = np.random.default_rng(1).uniform(-1, 1, size=(b, 256)).astype(np.float32)
        for _ in range(16):
            sess.run(["PROBS"], {"INPUT": x})
        lat = []
        start = time.perf_counter()
        for _ in range(requests):
            t0 = time.perf_counter()
            sess.run(["PROBS"], {"INPUT": x})
            lat.append((time.perf_counter() - t0) * 1e3)
        seconds = time.perf_counter() - start
        rows[b] = {"infer_per_s": requests * b / seconds, "p99_ms": float(np.percentile(lat, 99))}
    return rows


def cohort_rows(cohort, repo, batches, requests):
    cmd = [
        cohort, "bench", "serve", "--repository", repo, "--model", "mlp",
        "--batch-size", ",".join(map(str, batches)), "--concurrency", "1",
        "--threads", "1", "--requests", str(requests), "--json",
    ]
    print("$", " ".join(cmd), file=sys.stderr)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {r["batch_size"]: r for r in rows}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cohort", help="the cohort binary (omit: onnxruntime only)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--batches", default="1,32")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    with tempfile.TemporaryDirectory() as repo:
        path = build(repo)
        ort_rows = onnxruntime_rows(path, batches, a.requests)
        ours = cohort_rows(a.cohort, repo, batches, a.requests) if a.cohort else {}
    print(f"{'batch':>5} {'ort infer/s':>12} {'ort p99 ms':>11} {'cohort infer/s':>15} "
          f"{'cohort p99 ms':>14} {'ratio':>6}")
    for b in batches:
        o, c = ort_rows[b], ours.get(b)
        line = f"{b:>5} {o['infer_per_s']:>12.1f} {o['p99_ms']:>11.3f}"
        if c:
            ratio = c["infer_per_s"] / o["infer_per_s"]
            line += f" {c['infer_per_s']:>15.1f} {c['p99_ms']:>14.3f} {ratio:>5.2f}x"
        print(line)


if __name__ == "__main__":
    main()
