//! The ONNX backend and ensembles end to end in one process, without Python: ONNX files written
//! here with the ONNX protobuf types tract reads, served from a repository on disk, answered
//! over gRPC and compared with the same arithmetic done in Rust. (The checks against
//! onnxruntime with Triton's own client are crates/serve/tests/onnx_check.py, driven by the
//! `cohort` binary's tests.)

use std::path::Path;
use std::time::Duration;

use cohort_serve::proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use cohort_serve::proto::{model_infer_request, ModelInferRequest, ModelInferResponse};
use cohort_serve::{Server, ServerOptions};
use prost::Message;
use tract_onnx::pb;

const FEATURES: usize = 3;
const CLASSES: usize = 2;
const W: [f32; FEATURES * CLASSES] = [0.5, -1.0, 2.0, 0.25, -0.75, 1.5];
const B: [f32; CLASSES] = [0.1, -0.2];
const MEAN: [f32; FEATURES] = [1.0, -2.0, 0.5];

/// A float tensor value info with a dynamic first dimension `N`.
fn value(name: &str, dims: &[i64]) -> pb::ValueInfoProto {
    typed_value(name, dims, pb::tensor_proto::DataType::Float)
}

/// A tensor value info of element type `elem` with a dynamic first dimension `N`.
fn typed_value(name: &str, dims: &[i64], elem: pb::tensor_proto::DataType) -> pb::ValueInfoProto {
    use pb::tensor_shape_proto::{dimension, Dimension};
    let mut dim = vec![Dimension {
        value: Some(dimension::Value::DimParam("N".into())),
        ..Default::default()
    }];
    dim.extend(dims.iter().map(|&d| Dimension {
        value: Some(dimension::Value::DimValue(d)),
        ..Default::default()
    }));
    pb::ValueInfoProto {
        name: name.into(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: elem as i32,
                shape: Some(pb::TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn node(op: &str, name: &str, inputs: &[&str], outputs: &[&str]) -> pb::NodeProto {
    pb::NodeProto {
        op_type: op.into(),
        name: name.into(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn constant(name: &str, dims: &[i64], values: &[f32]) -> pb::TensorProto {
    pb::TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: pb::tensor_proto::DataType::Float as i32,
        float_data: values.to_vec(),
        ..Default::default()
    }
}

/// Writes version 1 of `repo/name`: `model.onnx` of the graph, and `config`.
fn put(
    repo: &Path,
    name: &str,
    config: &str,
    graph: (
        Vec<pb::NodeProto>,
        Vec<pb::ValueInfoProto>,
        Vec<pb::ValueInfoProto>,
    ),
    initializer: Vec<pb::TensorProto>,
) {
    let (node, input, output) = graph;
    let model = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto {
            domain: String::new(),
            version: 13,
        }],
        graph: Some(pb::GraphProto {
            name: name.into(),
            node,
            input,
            output,
            initializer,
            ..Default::default()
        }),
        ..Default::default()
    };
    let dir = repo.join(name).join("1");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("model.onnx"), model.encode_to_vec()).unwrap();
    std::fs::write(repo.join(name).join("config.pbtxt"), config).unwrap();
}

/// `center` (X - MEAN), `linear` (Relu(X W + B)), the ensemble `pipeline` of the two, and
/// `fancy` (an operator no runtime has).
fn repository(repo: &Path) {
    put(
        repo,
        "center",
        "backend: \"onnxruntime\"\nmax_batch_size: 8\n",
        (
            vec![node("Sub", "sub", &["RAW", "mean"], &["CENTERED"])],
            vec![value("RAW", &[FEATURES as i64])],
            vec![value("CENTERED", &[FEATURES as i64])],
        ),
        vec![constant("mean", &[FEATURES as i64], &MEAN)],
    );
    put(
        repo,
        "linear",
        "platform: \"onnxruntime_onnx\"\nmax_batch_size: 8\n\
         input [ { name: \"X\" data_type: TYPE_FP32 dims: [ 3 ] } ]\n\
         dynamic_batching { max_queue_delay_microseconds: 100000 }\n",
        (
            vec![
                node("Gemm", "fc", &["X", "w", "b"], &["h"]),
                node("Relu", "relu", &["h"], &["Y"]),
            ],
            vec![value("X", &[FEATURES as i64])],
            vec![value("Y", &[CLASSES as i64])],
        ),
        vec![
            constant("w", &[FEATURES as i64, CLASSES as i64], &W),
            constant("b", &[CLASSES as i64], &B),
        ],
    );
    std::fs::create_dir_all(repo.join("pipeline/1")).unwrap();
    std::fs::write(
        repo.join("pipeline/config.pbtxt"),
        "platform: \"ensemble\"\nmax_batch_size: 8\n\
         input [ { name: \"RAW\" data_type: TYPE_FP32 dims: [ 3 ] } ]\n\
         output [ { name: \"SCORES\" data_type: TYPE_FP32 dims: [ 2 ] } ]\n\
         ensemble_scheduling { step [\n\
           { model_name: \"center\" model_version: -1\n\
             input_map { key: \"RAW\" value: \"RAW\" } output_map { key: \"CENTERED\" value: \"c\" } },\n\
           { model_name: \"linear\" model_version: -1\n\
             input_map { key: \"X\" value: \"c\" } output_map { key: \"Y\" value: \"SCORES\" } }\n\
         ] }\n",
    )
    .unwrap();
    put(
        repo,
        "fancy",
        "platform: \"onnxruntime_onnx\"\nmax_batch_size: 2\n",
        (
            vec![
                node("Relu", "n1", &["X"], &["r"]),
                node("FancyOp", "n3", &["r"], &["Y"]),
            ],
            vec![value("X", &[2])],
            vec![value("Y", &[2])],
        ),
        Vec::new(),
    );
}

/// Relu(x W + B) of each row of `x`.
fn linear(x: &[f32]) -> Vec<f32> {
    x.chunks(FEATURES)
        .flat_map(|row| {
            (0..CLASSES).map(move |j| {
                let dot: f32 = (0..FEATURES).map(|i| row[i] * W[i * CLASSES + j]).sum();
                (dot + B[j]).max(0.0)
            })
        })
        .collect()
}

fn request(model: &str, input: &str, x: &[f32]) -> ModelInferRequest {
    ModelInferRequest {
        model_name: model.into(),
        inputs: vec![model_infer_request::InferInputTensor {
            name: input.into(),
            datatype: "FP32".into(),
            shape: vec![(x.len() / FEATURES) as i64, FEATURES as i64],
            ..Default::default()
        }],
        raw_input_contents: vec![x.iter().flat_map(|v| v.to_le_bytes()).collect()],
        ..Default::default()
    }
}

fn floats(r: &ModelInferResponse) -> Vec<f32> {
    r.raw_output_contents[0]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (a, b) in got.iter().zip(want) {
        assert!((a - b).abs() <= 1e-5, "{got:?} vs {want:?}");
    }
}

#[test]
fn onnx_models_and_an_ensemble_serve_while_an_unsupported_operator_is_named() {
    let dir = tempfile::tempdir().unwrap();
    repository(dir.path());
    let mut opts = ServerOptions::loopback(dir.path().to_path_buf());
    opts.poll_interval = None;
    opts.instance_threads = Some(1);
    let server = Server::start(opts).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let url = format!("http://{}", server.grpc_addr().unwrap());
    let client = rt
        .block_on(GrpcInferenceServiceClient::connect(url))
        .unwrap();

    // the unsupported operator fails its model's load, named with its node; the rest serve
    let fancy = server
        .index()
        .into_iter()
        .find(|e| e.name == "fancy")
        .unwrap();
    assert!(
        fancy
            .reason
            .contains("model.onnx: unsupported ONNX operator \"FancyOp\" (node \"n3\")"),
        "{fancy:?}"
    );
    for m in ["center", "linear", "pipeline"] {
        assert!(server.is_model_ready(m), "{m}: {:?}", server.index());
    }

    // unbatched and batched requests, and concurrent ones joined by the dynamic batcher
    let xs: Vec<Vec<f32>> = (0..6)
        .map(|r| {
            (0..FEATURES * (1 + r % 3))
                .map(|i| (i as f32 - 2.0) * 0.7 + r as f32)
                .collect()
        })
        .collect();
    let answers = rt.block_on(async {
        let calls = xs.iter().map(|x| {
            let mut c = client.clone();
            let req = request("linear", "X", x);
            tokio::spawn(async move { c.model_infer(req).await })
        });
        let mut out = Vec::new();
        for call in calls.collect::<Vec<_>>() {
            out.push(call.await.unwrap().unwrap().into_inner());
        }
        out
    });
    for (x, a) in xs.iter().zip(&answers) {
        assert_eq!(a.outputs[0].name, "Y");
        assert_eq!(
            a.outputs[0].shape,
            [(x.len() / FEATURES) as i64, CLASSES as i64]
        );
        close(&floats(a), &linear(x));
    }
    let (executions, rows) = server.metrics().version("linear", 1).batches();
    assert_eq!(rows, 12);
    assert!(
        executions < 6,
        "{executions} executions: nothing was batched"
    );

    // the ensemble equals its steps in turn
    let raw = [0.5f32, 1.0, -1.0, 2.0, 0.0, 3.0];
    let mut c = client.clone();
    let centered = rt
        .block_on(c.model_infer(request("center", "RAW", &raw)))
        .unwrap()
        .into_inner();
    let stepwise = rt
        .block_on(c.model_infer(request("linear", "X", &floats(&centered))))
        .unwrap()
        .into_inner();
    let whole = rt
        .block_on(c.model_infer(request("pipeline", "RAW", &raw)))
        .unwrap()
        .into_inner();
    assert_eq!(whole.outputs[0].name, "SCORES");
    assert_eq!(floats(&whole), floats(&stepwise));
    let want: Vec<f32> = raw
        .iter()
        .enumerate()
        .map(|(i, v)| v - MEAN[i % FEATURES])
        .collect();
    close(&floats(&whole), &linear(&want));

    // a request the step model cannot take is refused before it reaches an instance
    let err = rt
        .block_on(c.model_infer(request("linear", "RAW", &raw)))
        .unwrap_err();
    assert!(err.message().contains("no input tensor \"RAW\""), "{err:?}");
    drop(c);
    drop(client);
    rt.shutdown_timeout(Duration::from_secs(1));
    server.shutdown();
}

#[test]
fn a_model_without_a_dynamic_batch_dimension_or_unlike_its_config_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let fixed = |name: &str, config: &str, first: i64| {
        use pb::tensor_shape_proto::{dimension, Dimension};
        let mut x = value("X", &[2]);
        if let Some(pb::type_proto::Value::TensorType(t)) =
            x.r#type.as_mut().and_then(|t| t.value.as_mut())
        {
            t.shape.as_mut().unwrap().dim[0] = Dimension {
                value: Some(dimension::Value::DimValue(first)),
                ..Default::default()
            };
        }
        let mut y = x.clone();
        y.name = "Y".into();
        put(
            dir.path(),
            name,
            config,
            (vec![node("Relu", "r", &["X"], &["Y"])], vec![x], vec![y]),
            Vec::new(),
        );
    };
    fixed("fixed", "platform: \"onnxruntime_onnx\"\n", 1);
    put(
        dir.path(),
        "mistyped",
        "platform: \"onnxruntime_onnx\"\ninput [ { name: \"X\" data_type: TYPE_INT64 } ]\n",
        (
            vec![node("Relu", "r", &["X"], &["Y"])],
            vec![value("X", &[2])],
            vec![value("Y", &[2])],
        ),
        Vec::new(),
    );
    let mut opts = ServerOptions::loopback(dir.path().to_path_buf());
    opts.poll_interval = None;
    let server = Server::start(opts).unwrap();
    let reason = |m: &str| {
        server
            .index()
            .into_iter()
            .find(|e| e.name == m)
            .unwrap()
            .reason
    };
    let fixed = reason("fixed");
    assert!(
        fixed.contains(
            "input \"X\" has shape [1, 2]; its first dimension must be a dynamic batch dimension"
        ),
        "{fixed}"
    );
    let mistyped = reason("mistyped");
    assert!(
        mistyped.contains("config input \"X\" has data_type TYPE_INT64; the model's is TYPE_FP32"),
        "{mistyped}"
    );
    server.shutdown();
}

/// What the FP16 model multiplies its input by, per column: halves whose products with halves
/// are exact in f32, so one rounding to half gives the correctly rounded product.
const HALF_SCALE: [f32; 4] = [0.5, -3.0, 1.25, 1000.0];

/// `half` of one input: Y = X * S, all float16.
fn half_repository(repo: &Path) {
    use pb::tensor_proto::DataType as Pb;
    let bits: Vec<u8> = HALF_SCALE
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect();
    put(
        repo,
        "half",
        "platform: \"onnxruntime_onnx\"\nmax_batch_size: 8\n\
         input [ { name: \"X\" data_type: TYPE_FP16 dims: [ 4 ] } ]\n\
         output [ { name: \"Y\" data_type: TYPE_FP16 dims: [ 4 ] } ]\n\
         dynamic_batching { max_queue_delay_microseconds: 100000 }\n",
        (
            vec![node("Mul", "scale", &["X", "s"], &["Y"])],
            vec![typed_value("X", &[4], Pb::Float16)],
            vec![typed_value("Y", &[4], Pb::Float16)],
        ),
        vec![pb::TensorProto {
            name: "s".into(),
            dims: vec![4],
            data_type: Pb::Float16 as i32,
            raw_data: bits,
            ..Default::default()
        }],
    );
}

fn half_request(x: &[half::f16]) -> ModelInferRequest {
    ModelInferRequest {
        model_name: "half".into(),
        inputs: vec![model_infer_request::InferInputTensor {
            name: "X".into(),
            datatype: "FP16".into(),
            shape: vec![(x.len() / 4) as i64, 4],
            ..Default::default()
        }],
        raw_input_contents: vec![x.iter().flat_map(|v| v.to_le_bytes()).collect()],
        ..Default::default()
    }
}

#[test]
fn fp16_tensors_pass_as_little_endian_halves_batched_and_unbatched() {
    use half::f16;
    let dir = tempfile::tempdir().unwrap();
    half_repository(dir.path());
    let mut opts = ServerOptions::loopback(dir.path().to_path_buf());
    opts.poll_interval = None;
    opts.instance_threads = Some(1);
    let server = Server::start(opts).unwrap();
    assert!(server.is_model_ready("half"), "{:?}", server.index());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let url = format!("http://{}", server.grpc_addr().unwrap());
    let client = rt
        .block_on(GrpcInferenceServiceClient::connect(url))
        .unwrap();

    // values whose products round (0.1 is not a half; x * 1000 overflows past 65504 for
    // the larger rows), in requests of 1 to 3 rows joined by the dynamic batcher
    let xs: Vec<Vec<f16>> = (0..6)
        .map(|r| {
            (0..4 * (1 + r % 3))
                .map(|i| f16::from_f32(0.1 + i as f32 * 7.3 - r as f32 * 2.9))
                .collect()
        })
        .collect();
    let answers = rt.block_on(async {
        let calls = xs.iter().map(|x| {
            let mut c = client.clone();
            let req = half_request(x);
            tokio::spawn(async move { c.model_infer(req).await })
        });
        let mut out = Vec::new();
        for call in calls.collect::<Vec<_>>() {
            out.push(call.await.unwrap().unwrap().into_inner());
        }
        out
    });
    for (x, a) in xs.iter().zip(&answers) {
        assert_eq!(
            (a.outputs[0].name.as_str(), a.outputs[0].datatype.as_str()),
            ("Y", "FP16")
        );
        assert_eq!(a.outputs[0].shape, [(x.len() / 4) as i64, 4]);
        let got: Vec<f16> = a.raw_output_contents[0]
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect();
        // a product of two halves is exact in f32, so rounding it once is the half product
        let want: Vec<f16> = x
            .iter()
            .enumerate()
            .map(|(i, v)| f16::from_f32(v.to_f32() * HALF_SCALE[i % 4]))
            .collect();
        let bits = |v: &[f16]| v.iter().map(|h| h.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{got:?} vs {want:?}");
    }
    let (executions, rows) = server.metrics().version("half", 1).batches();
    assert_eq!(rows, 12);
    assert!(
        executions < 6,
        "{executions} executions: nothing was batched"
    );

    // typed contents have no FP16 field: refused by name, not read as no elements
    let mut typed = half_request(&[f16::ONE; 4]);
    typed.raw_input_contents.clear();
    typed.inputs[0].contents = Some(cohort_serve::proto::InferTensorContents {
        fp32_contents: vec![1.0; 4],
        ..Default::default()
    });
    let mut c = client.clone();
    let err = rt.block_on(c.model_infer(typed)).unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message()
            .contains("input \"X\": FP16 has no typed contents"),
        "{err:?}"
    );
    drop(c);
    drop(client);
    rt.shutdown_timeout(Duration::from_secs(1));
    server.shutdown();
}

/// An ensemble config of one FP32 `[3]` input `i` and output `o` (dims `out`), of `steps`.
fn ensemble(repo: &Path, name: &str, out: i64, steps: &str) {
    std::fs::create_dir_all(repo.join(name).join("1")).unwrap();
    std::fs::write(
        repo.join(name).join("config.pbtxt"),
        format!(
            "platform: \"ensemble\"\nmax_batch_size: 8\n\
             input [ {{ name: \"i\" data_type: TYPE_FP32 dims: [ 3 ] }} ]\n\
             output [ {{ name: \"o\" data_type: TYPE_FP32 dims: [ {out} ] }} ]\n\
             ensemble_scheduling {{ step [ {steps} ] }}\n"
        ),
    )
    .unwrap();
}

/// A step running `model` from ensemble tensor `from` (as its input `input`) to `to` (from its
/// output `output`).
fn step(model: &str, input: &str, from: &str, output: &str, to: &str) -> String {
    format!(
        "{{ model_name: \"{model}\" model_version: -1 \
         input_map {{ key: \"{input}\" value: \"{from}\" }} \
         output_map {{ key: \"{output}\" value: \"{to}\" }} }}"
    )
}

#[test]
fn a_nested_ensemble_equals_its_steps_in_turn_and_a_cycle_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path();
    repository(repo);
    // outer: center, then the ensemble pipeline (itself center then linear)
    ensemble(
        repo,
        "outer",
        2,
        &[
            step("center", "RAW", "i", "CENTERED", "c"),
            step("pipeline", "RAW", "c", "SCORES", "o"),
        ]
        .join(", "),
    );
    // two ensembles through each other, and one through itself
    ensemble(repo, "loop_a", 3, &step("loop_b", "i", "i", "o", "o"));
    ensemble(repo, "loop_b", 3, &step("loop_a", "i", "i", "o", "o"));
    ensemble(repo, "selfish", 3, &step("selfish", "i", "i", "o", "o"));
    let mut opts = ServerOptions::loopback(repo.to_path_buf());
    opts.poll_interval = None;
    opts.instance_threads = Some(1);
    let server = Server::start(opts).unwrap();
    let reason = |m: &str| {
        server
            .index()
            .into_iter()
            .find(|e| e.name == m)
            .map(|e| e.reason)
            .unwrap_or_default()
    };
    // the loop is refused where it closes, named; whichever of the two loaded first serves
    // (and fails its requests, its step being unavailable)
    let (a, b) = (reason("loop_a"), reason("loop_b"));
    assert!(
        a.contains("reach themselves through their steps: loop_a -> loop_b -> loop_a")
            || b.contains("reach themselves through their steps: loop_b -> loop_a -> loop_b"),
        "{a:?} / {b:?}"
    );
    assert!(
        reason("selfish").contains("through their steps: selfish -> selfish"),
        "{:?}",
        server.index()
    );
    for m in ["center", "linear", "pipeline", "outer"] {
        assert!(server.is_model_ready(m), "{m}: {:?}", server.index());
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let url = format!("http://{}", server.grpc_addr().unwrap());
    let mut c = rt
        .block_on(GrpcInferenceServiceClient::connect(url))
        .unwrap();
    let mut infer = |model: &str, input: &str, x: &[f32]| {
        rt.block_on(c.model_infer(request(model, input, x)))
            .map(|r| r.into_inner())
    };
    let stats = |m: &str| server.metrics().version(m, 1).batches().1;
    let before: Vec<u64> = ["outer", "pipeline", "center", "linear"]
        .map(stats)
        .to_vec();
    let raw = [0.5f32, 1.0, -1.0, 2.0, 0.0, 3.0];
    let whole = infer("outer", "i", &raw).unwrap();
    let after: Vec<u64> = ["outer", "pipeline", "center", "linear"]
        .map(stats)
        .to_vec();
    // every model on the way counted the request's two rows: center twice (outer's step and
    // pipeline's)
    let rows: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(rows, [2, 2, 4, 2]);
    let once = infer("center", "RAW", &raw).unwrap();
    let twice = infer("center", "RAW", &floats(&once)).unwrap();
    let scores = infer("linear", "X", &floats(&twice)).unwrap();
    assert_eq!(whole.outputs[0].name, "o");
    assert_eq!(whole.outputs[0].shape, [2, 2]);
    assert_eq!(floats(&whole), floats(&scores));
    let want: Vec<f32> = raw
        .iter()
        .enumerate()
        .map(|(i, v)| v - 2.0 * MEAN[i % FEATURES])
        .collect();
    close(&floats(&whole), &linear(&want));

    // the loop's survivor fails its requests by name; the rest keep serving
    let survivor = if server.is_model_ready("loop_a") {
        "loop_a"
    } else {
        "loop_b"
    };
    let err = infer(survivor, "i", &raw).unwrap_err();
    assert!(err.message().contains("loop_"), "{err:?}");
    assert!(infer("outer", "i", &raw).is_ok());
    drop(c);
    rt.shutdown_timeout(Duration::from_secs(1));
    server.shutdown();
}

/// onnx_runtimes_check.py's CNN (made by the `onnx` package) profiled on each runtime: the
/// convolutions show as 2 nodes, every row's nodes are the graph's, and the shares sum to 1.
#[test]
fn a_cnn_profiled_on_both_runtimes_shows_its_convolutions() {
    let have = std::process::Command::new("python3")
        .args(["-c", "import onnx, onnxruntime, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        eprintln!(
            "a_cnn_profiled_on_both_runtimes_shows_its_convolutions: skipped, python3 cannot \
             import onnx, onnxruntime and numpy (pip install onnx onnxruntime numpy)"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let made = std::process::Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/onnx_runtimes_check.py"))
        .arg("make")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    // the CNN once per runtime, each named in its config
    for runtime in ["tract", "onnxruntime"] {
        let to = dir.path().join(format!("cnn_{runtime}"));
        std::fs::create_dir_all(to.join("1")).unwrap();
        std::fs::copy(dir.path().join("cnn/1/model.onnx"), to.join("1/model.onnx")).unwrap();
        let cfg = std::fs::read_to_string(dir.path().join("cnn/config.pbtxt")).unwrap();
        let param =
            format!("parameters {{ key: \"backend\" value: {{ string_value: \"{runtime}\" }} }}\n");
        std::fs::write(to.join("config.pbtxt"), cfg + &param).unwrap();
    }
    let mut opts = ServerOptions::loopback(dir.path().to_path_buf());
    opts.poll_interval = None;
    opts.instance_threads = Some(1);
    let server = Server::start(opts).unwrap();
    let rows = 2;
    let x: Vec<u8> = (0..rows * 3 * 32 * 32)
        .flat_map(|i| ((i % 17) as f32 / 17.0 - 0.5).to_le_bytes())
        .collect();
    let input = cohort_serve::Tensor {
        datatype: cohort_serve::DataType::Fp32,
        shape: vec![rows, 3, 32, 32],
        data: x,
    };
    let graph_nodes = 9;
    for runtime in ["tract", "onnxruntime"] {
        let model = format!("cnn_{runtime}");
        assert!(server.is_model_ready(&model), "{:?}", server.index());
        let p = server
            .profile(&model, std::slice::from_ref(&input), 3)
            .unwrap();
        let table: Vec<_> = p.ops.iter().map(|o| (&o.op, o.nodes, o.calls)).collect();
        assert_eq!(
            (p.runtime.as_str(), p.rows, p.runs),
            (runtime, rows, 3),
            "{table:?}"
        );
        let share: f64 = p.ops.iter().map(|o| o.share).sum();
        assert!(
            (share - 1.0).abs() < 1e-9,
            "shares sum to {share}: {table:?}"
        );
        assert!(p.op_ms > 0.0 && p.run_ms >= p.op_ms * 0.5, "{p:?}");
        // onnxruntime fuses each Conv with its Relu (FusedConv); tract names each of its
        // nodes after the ONNX node it came from
        let convs: usize = p
            .ops
            .iter()
            .filter(|o| o.op.contains("Conv"))
            .map(|o| o.nodes)
            .sum();
        assert_eq!(convs, 2, "{runtime}: {table:?}");
        let onnx_nodes: usize = p
            .ops
            .iter()
            .filter(|o| !o.op.ends_with("(tract)"))
            .map(|o| o.nodes)
            .sum();
        assert!(onnx_nodes <= graph_nodes, "{runtime}: {table:?}");
        for o in &p.ops {
            assert!(o.calls >= o.nodes * p.runs, "{runtime}: {table:?}");
        }
        if runtime == "tract" {
            let gemm = p.ops.iter().find(|o| o.op == "Gemm");
            assert_eq!(gemm.map(|o| o.nodes), Some(1), "{table:?}");
        }
        println!("{runtime}: {table:?}");
    }
    // a model whose backend does not time operators says so
    let err = server
        .profile("nope", std::slice::from_ref(&input), 1)
        .unwrap_err();
    assert!(err.to_string().contains("nope"), "{err}");
    server.shutdown();
}
