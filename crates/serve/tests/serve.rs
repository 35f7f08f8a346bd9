//! The server end to end in one process: a real repository on disk, real sockets on loopback,
//! raw HTTP/1.1 and the generated gRPC client; results compared with cohort's own forward pass.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use cohort_gpt::checkpoint::{self, Checkpoint};
use cohort_gpt::{Forward, GPTConfig, GPT};
use cohort_serve::proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use cohort_serve::proto::{model_infer_request, ModelInferRequest};
use cohort_serve::{Server, ServerOptions};
use serde_json::{json, Value};

fn tiny() -> GPTConfig {
    GPTConfig {
        vocab_size: 23,
        max_position_embeddings: 16,
        n_layers: 2,
        n_heads: 2,
        d_model: 16,
        d_ff: 32,
        dropout: 0.0,
        ..GPTConfig::default()
    }
}

fn model(seed: u64) -> GPT {
    let mut m = GPT::new(tiny(), seed).unwrap();
    // sharper logits than the init's, so next-token choices differ between rows
    for p in m.params_mut() {
        *p *= 8.0;
    }
    m
}

/// Saves `m` as version `version` of `repo/name` (a checkpoint root with `latest`).
fn put_version(repo: &Path, name: &str, version: u64, m: &GPT) {
    checkpoint::save(
        &repo.join(name).join(version.to_string()),
        "step-1",
        &Checkpoint {
            model: Some(m),
            ..Default::default()
        },
    )
    .unwrap();
}

/// cohort's forward: logits (rows * seq, vocab) of `ids`.
fn forward(m: &mut GPT, ids: &[u32], rows: usize, seq: usize) -> Vec<f32> {
    m.forward(Forward::new(ids, rows, seq)).unwrap();
    m.logits().to_vec()
}

fn close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs().max(1.0),
            "logit {i}: {a} vs {b}"
        );
    }
}

struct HttpResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl HttpResponse {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&self.body)))
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request on a fresh connection.
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: &[u8],
) -> HttpResponse {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head += &format!("{k}: {v}\r\n");
    }
    head += "\r\n";
    s.write_all(head.as_bytes()).unwrap();
    // the server may answer (413) before reading everything; a reset write is fine then
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("header end");
    let text = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = text.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        let mut out = Vec::new();
        let mut rest = &body[..];
        loop {
            let nl = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let n = usize::from_str_radix(std::str::from_utf8(&rest[..nl]).unwrap().trim(), 16)
                .unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&rest[nl + 2..nl + 2 + n]);
            rest = &rest[nl + 4 + n..];
        }
        body = out;
    }
    HttpResponse {
        status,
        headers,
        body,
    }
}

fn post_json(addr: SocketAddr, path: &str, v: &Value) -> HttpResponse {
    http(addr, "POST", path, &[], v.to_string().as_bytes())
}

fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    http(addr, "GET", path, &[], b"")
}

fn infer_json(ids: &[u32], rows: usize, seq: usize) -> Value {
    json!({
        "id": "r1",
        "inputs": [{"name": "input_ids", "shape": [rows, seq], "datatype": "INT64", "data": ids}]
    })
}

fn start(repo: &Path, tweak: impl FnOnce(&mut ServerOptions)) -> Server {
    let mut opts = ServerOptions::loopback(repo.to_path_buf());
    opts.poll_interval = None;
    opts.instance_threads = Some(1);
    tweak(&mut opts);
    Server::start(opts).unwrap()
}

fn grpc_client(
    server: &Server,
) -> (
    tokio::runtime::Runtime,
    GrpcInferenceServiceClient<tonic::transport::Channel>,
) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = format!("http://{}", server.grpc_addr().unwrap());
    let client = rt
        .block_on(GrpcInferenceServiceClient::connect(url))
        .unwrap();
    (rt, client)
}

fn grpc_request(
    model: &str,
    version: &str,
    ids: &[u32],
    rows: usize,
    seq: usize,
) -> ModelInferRequest {
    ModelInferRequest {
        model_name: model.into(),
        model_version: version.into(),
        inputs: vec![model_infer_request::InferInputTensor {
            name: "input_ids".into(),
            datatype: "INT64".into(),
            shape: vec![rows as i64, seq as i64],
            ..Default::default()
        }],
        raw_input_contents: vec![ids.iter().flat_map(|&x| (x as i64).to_le_bytes()).collect()],
        ..Default::default()
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn argmax_last(logits: &[f32], rows: usize, seq: usize, v: usize) -> Vec<i64> {
    (0..rows)
        .map(|r| {
            let last = &logits[(r * seq + seq - 1) * v..(r * seq + seq) * v];
            cohort_gpt::sample::argmax(last) as i64
        })
        .collect()
}

#[test]
fn http_and_grpc_answer_what_the_forward_pass_computes_and_batching_changes_nothing() {
    let repo = tempfile::tempdir().unwrap();
    let mut m = model(3);
    put_version(repo.path(), "gpt", 1, &m);
    std::fs::write(
        repo.path().join("gpt/config.pbtxt"),
        "name: \"gpt\"\nmax_batch_size: 8\n\
         dynamic_batching { max_queue_delay_microseconds: 20000 }\n\
         instance_group [ { count: 2 kind: KIND_CPU } ]\n",
    )
    .unwrap();
    let server = start(repo.path(), |_| {});
    let addr = server.http_addr();
    let v = tiny().vocab_size;

    assert_eq!(get(addr, "/v2/health/live").status, 200);
    assert_eq!(get(addr, "/v2/health/ready").status, 200);
    assert_eq!(get(addr, "/v2/models/gpt/ready").status, 200);
    assert_eq!(get(addr, "/v2/models/gpt/versions/1/ready").status, 200);
    let meta = get(addr, "/v2/models/gpt").json();
    assert_eq!(meta["versions"], json!(["1"]));
    assert_eq!(
        meta["inputs"][0],
        json!({"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]})
    );
    assert_eq!(meta["outputs"][0]["shape"], json!([-1, -1, v]));
    assert_eq!(get(addr, "/v2").json()["name"], "cohort");
    assert_eq!(
        get(addr, "/v2/models/gpt/config").json()["max_batch_size"],
        8
    );

    // JSON in, JSON out
    let (rows, seq) = (2, 5);
    let ids: Vec<u32> = (0..10).map(|i| (i * 7 % 23) as u32).collect();
    let want = forward(&mut m, &ids, rows, seq);
    let r = post_json(addr, "/v2/models/gpt/infer", &infer_json(&ids, rows, seq));
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let j = r.json();
    assert_eq!(j["id"], "r1");
    assert_eq!(j["model_version"], "1");
    assert_eq!(j["outputs"][0]["shape"], json!([rows, seq, v]));
    let got: Vec<f32> = j["outputs"][0]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    close(&got, &want);
    assert_eq!(
        j["outputs"][1]["data"],
        json!(argmax_last(&want, rows, seq, v))
    );

    // Triton's binary tensor extension, as tritonclient.http sends it by default
    let head = json!({
        "inputs": [{"name": "input_ids", "shape": [rows, seq], "datatype": "INT64",
                    "parameters": {"binary_data_size": rows * seq * 8}}],
        "outputs": [{"name": "logits", "parameters": {"binary_data": true}}]
    })
    .to_string();
    let mut body = head.clone().into_bytes();
    body.extend(ids.iter().flat_map(|&x| (x as i64).to_le_bytes()));
    let r = http(
        addr,
        "POST",
        "/v2/models/gpt/versions/1/infer",
        &[("Inference-Header-Content-Length", head.len().to_string())],
        &body,
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let n: usize = r
        .header("inference-header-content-length")
        .unwrap()
        .parse()
        .unwrap();
    let j: Value = serde_json::from_slice(&r.body[..n]).unwrap();
    assert_eq!(
        j["outputs"][0]["parameters"]["binary_data_size"],
        rows * seq * v * 4
    );
    close(&f32s(&r.body[n..]), &want);

    // gRPC with raw contents
    let (rt, mut client) = grpc_client(&server);
    let resp = rt
        .block_on(client.model_infer(grpc_request("gpt", "", &ids, rows, seq)))
        .unwrap()
        .into_inner();
    assert_eq!(resp.outputs[0].name, "logits");
    assert_eq!(resp.outputs[0].shape, [rows as i64, seq as i64, v as i64]);
    close(&f32s(&resp.raw_output_contents[0]), &want);
    assert_eq!(
        i64s(&resp.raw_output_contents[1]),
        argmax_last(&want, rows, seq, v)
    );

    // 16 concurrent single-row requests are batched (the 20 ms delay gathers them) and each
    // gets exactly its own row's answer
    let rows_in: Vec<Vec<u32>> = (0..16)
        .map(|r| {
            (0..6)
                .map(|i| ((r * 5 + i * 3 + r * i) % 23) as u32)
                .collect()
        })
        .collect();
    let wants: Vec<Vec<f32>> = rows_in
        .iter()
        .map(|ids| forward(&mut m, ids, 1, 6))
        .collect();
    let got: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = rows_in
            .iter()
            .map(|ids| {
                s.spawn(move || {
                    let r = post_json(addr, "/v2/models/gpt/infer", &infer_json(ids, 1, 6));
                    assert_eq!(r.status, 200);
                    r.json()["outputs"][0]["data"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_f64().unwrap() as f32)
                        .collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (g, w) in got.iter().zip(&wants) {
        close(g, w);
    }
    let metrics = String::from_utf8(get(addr, "/metrics").body).unwrap();
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{model=\"gpt\",version=\"1\"}}")))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap_or_else(|| panic!("{name} missing:\n{metrics}"))
            .parse()
            .unwrap()
    };
    assert_eq!(value("nv_inference_request_success"), 19.0);
    assert_eq!(value("nv_inference_count"), 16.0 + 3.0 * rows as f64);
    let execs = value("nv_inference_exec_count");
    assert!(
        execs < 3.0 + 16.0 - 4.0,
        "16 requests in {} executions: no batching?",
        execs - 3.0
    );
    // an idle connection whose runtime is not running would hold up the graceful shutdown
    drop((rt, client));
    server.shutdown();
}

#[test]
fn bad_requests_are_4xx_with_a_json_error_and_never_take_the_server_down() {
    let repo = tempfile::tempdir().unwrap();
    put_version(repo.path(), "gpt", 1, &model(1));
    let server = start(repo.path(), |o| o.max_body_bytes = 4096);
    let addr = server.http_addr();
    let ok_body = infer_json(&[1, 2, 3], 1, 3);
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = ok_body.clone();
        f(&mut v);
        v.to_string().into_bytes()
    };
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "/v2/models/gpt/infer",
            b"{not json".to_vec(),
            400,
            "malformed",
        ),
        (
            "/v2/models/gpt/infer",
            with(&|v| v["inputs"][0]["datatype"] = json!("FP32")),
            400,
            "datatype FP32",
        ),
        (
            "/v2/models/gpt/infer",
            with(&|v| v["inputs"][0]["shape"] = json!([3])),
            400,
            "2 dimensions",
        ),
        (
            "/v2/models/gpt/infer",
            with(&|v| v["inputs"][0]["shape"] = json!([1, 4])),
            400,
            "needs 4 elements",
        ),
        (
            "/v2/models/gpt/infer",
            with(&|v| v["inputs"][0]["data"] = json!([1, 2, 99])),
            400,
            "outside the vocabulary",
        ),
        (
            "/v2/models/gpt/infer",
            with(&|v| v["inputs"][0]["shape"] = json!([9, 3])),
            400,
            "max_batch_size",
        ),
        (
            "/v2/models/gpt/infer",
            with(&|v| v["inputs"][0]["name"] = json!("ids")),
            400,
            "no input tensor",
        ),
        (
            "/v2/models/gpt/infer",
            with(&|v| v["outputs"] = json!([{"name": "probs"}])),
            400,
            "no output tensor",
        ),
        (
            "/v2/models/nope/infer",
            ok_body.to_string().into_bytes(),
            404,
            "unknown model",
        ),
        (
            "/v2/models/gpt/versions/7/infer",
            ok_body.to_string().into_bytes(),
            404,
            "no ready version \"7\"",
        ),
        (
            "/v2/models/gpt/infer",
            vec![b' '; 5000],
            413,
            "over the limit",
        ),
        (
            "/v2/models/gpt/generate",
            br#"{"text_input": "1 2", "parameters": {"max_tokens": 0}}"#.to_vec(),
            400,
            "max_tokens",
        ),
        (
            "/v2/models/gpt/generate",
            br#"{"text_input": "1 2", "parameters": {"temp": 1}}"#.to_vec(),
            400,
            "unknown",
        ),
        (
            "/v2/models/gpt/generate",
            br#"{"text_input": "1 x"}"#.to_vec(),
            400,
            "token ids",
        ),
        (
            "/v2/models/gpt/generate",
            br#"{"text_input": "1 99"}"#.to_vec(),
            400,
            "outside the vocabulary",
        ),
        (
            "/v2/nothing",
            Vec::new(),
            404,
            "no such endpoint /v2/nothing",
        ),
        ("/nothing", Vec::new(), 404, "serves the KServe v2 protocol"),
        (
            "/v1/embeddings",
            br#"{"model": "gpt", "input": "x"}"#.to_vec(),
            404,
            "serves /v1/completions, /v1/chat/completions and /v1/models only",
        ),
    ];
    for (path, body, status, needle) in cases {
        let r = http(addr, "POST", path, &[], &body);
        let err = r.json()["error"].as_str().unwrap_or_default().to_string();
        assert_eq!(r.status, status, "{path}: {err}");
        assert!(err.contains(needle), "{path}: {needle:?} not in {err:?}");
    }
    // a lying binary header
    let r = http(
        addr,
        "POST",
        "/v2/models/gpt/infer",
        &[("Inference-Header-Content-Length", "9999".into())],
        b"{}",
    );
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]
        .as_str()
        .unwrap()
        .contains("says 9999 bytes"));

    // gRPC: statuses, not crashes
    let (rt, mut client) = grpc_client(&server);
    let code = |req| {
        rt.block_on(client.clone().model_infer(req))
            .unwrap_err()
            .code()
    };
    assert_eq!(
        code(grpc_request("nope", "", &[1], 1, 1)),
        tonic::Code::NotFound
    );
    assert_eq!(
        code(grpc_request("gpt", "", &[1, 99], 1, 2)),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        code(grpc_request("gpt", "", &[1, 2], 1, 3)),
        tonic::Code::InvalidArgument
    );
    let mut bad = grpc_request("gpt", "", &[1, 2], 1, 2);
    bad.inputs[0].datatype = "INT32".into();
    assert_eq!(code(bad), tonic::Code::InvalidArgument);
    let ok = rt.block_on(client.model_infer(grpc_request("gpt", "1", &[1, 2], 1, 2)));
    assert!(ok.is_ok());
    assert_eq!(get(addr, "/v2/health/live").status, 200);
    let metrics = String::from_utf8(get(addr, "/metrics").body).unwrap();
    assert!(
        metrics.contains(
            "nv_inference_request_failure{model=\"gpt\",version=\"1\",reason=\"OTHER\"} 16"
        ),
        "{metrics}"
    );
    // an idle connection whose runtime is not running would hold up the graceful shutdown
    drop((rt, client));
    server.shutdown();
}

#[test]
fn a_full_queue_answers_503_and_the_queued_request_still_completes() {
    let repo = tempfile::tempdir().unwrap();
    put_version(repo.path(), "slow", 1, &model(2));
    // the first request waits 600 ms for company, holding the only queue slot
    std::fs::write(
        repo.path().join("slow/config.toml"),
        "max_batch_size = 4\n[dynamic_batching]\nmax_queue_delay_microseconds = 600000\n\
         default_queue_policy = { max_queue_size = 1 }\n",
    )
    .unwrap();
    let server = start(repo.path(), |_| {});
    let addr = server.http_addr();
    std::thread::scope(|s| {
        let first =
            s.spawn(|| post_json(addr, "/v2/models/slow/infer", &infer_json(&[1, 2], 1, 2)));
        std::thread::sleep(Duration::from_millis(150));
        let second = post_json(addr, "/v2/models/slow/infer", &infer_json(&[3], 1, 1));
        assert_eq!(second.status, 503);
        assert!(second.json()["error"]
            .as_str()
            .unwrap()
            .contains("queue is full"));
        assert_eq!(first.join().unwrap().status, 200);
    });
    server.shutdown();
}

#[test]
fn new_versions_are_picked_up_by_polling_and_in_flight_requests_finish_on_the_old_one() {
    let repo = tempfile::tempdir().unwrap();
    let (mut v1, mut v2) = (model(10), model(20));
    put_version(repo.path(), "gpt", 1, &v1);
    std::fs::write(
        repo.path().join("gpt/config.pbtxt"),
        "dynamic_batching { max_queue_delay_microseconds: 400000 preferred_batch_size: 8 }",
    )
    .unwrap();
    let server = start(repo.path(), |o| {
        o.poll_interval = Some(Duration::from_millis(100))
    });
    let addr = server.http_addr();
    let ids = [4u32, 5, 6];
    let (want1, want2) = (forward(&mut v1, &ids, 1, 3), forward(&mut v2, &ids, 1, 3));
    let logits = |r: &HttpResponse| -> Vec<f32> {
        r.json()["outputs"][0]["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    std::thread::scope(|s| {
        // queued on version 1 for 400 ms while version 2 arrives and replaces it
        let in_flight =
            s.spawn(|| post_json(addr, "/v2/models/gpt/infer", &infer_json(&ids, 1, 3)));
        std::thread::sleep(Duration::from_millis(50));
        // written aside and renamed in, as a deployment would
        let staging = repo.path().join("gpt/.staging");
        put_version(&staging, "x", 1, &v2);
        std::fs::rename(staging.join("x/1"), repo.path().join("gpt/2")).unwrap();
        let r = in_flight.join().unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.json()["model_version"], "1");
        close(&logits(&r), &want1);
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(addr, "/v2/models/gpt").json()["versions"] != json!(["2"]) {
        assert!(
            Instant::now() < deadline,
            "version 2 never replaced version 1"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = post_json(addr, "/v2/models/gpt/infer", &infer_json(&ids, 1, 3));
    assert_eq!(r.json()["model_version"], "2");
    close(&logits(&r), &want2);
    assert_eq!(get(addr, "/v2/models/gpt/versions/1/ready").status, 404);
    server.shutdown();
}

#[test]
fn models_load_and_unload_through_the_repository_api() {
    let repo = tempfile::tempdir().unwrap();
    put_version(repo.path(), "a", 1, &model(1));
    put_version(repo.path(), "b", 3, &model(2));
    std::fs::create_dir_all(repo.path().join("broken/1")).unwrap();
    let server = start(repo.path(), |o| o.load_models = Some(vec!["a".into()]));
    let addr = server.http_addr();
    let index = post_json(addr, "/v2/repository/index", &json!({})).json();
    assert_eq!(
        index,
        json!([
            {"name": "a", "version": "1", "state": "READY"},
            {"name": "b"},
            {"name": "broken"},
        ])
    );
    assert_eq!(get(addr, "/v2/models/b/ready").status, 404);
    assert_eq!(
        post_json(addr, "/v2/repository/models/b/load", &json!({})).status,
        200
    );
    assert_eq!(get(addr, "/v2/models/b/versions/3/ready").status, 200);
    let r = post_json(addr, "/v2/repository/models/broken/load", &json!({}));
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]
            .as_str()
            .unwrap()
            .contains("not a checkpoint"),
        "{}",
        r.json()
    );
    assert_eq!(
        post_json(addr, "/v2/repository/models/a/unload", &json!({})).status,
        200
    );
    assert_eq!(get(addr, "/v2/models/a/ready").status, 404);
    assert_eq!(
        post_json(addr, "/v2/repository/models/zzz/load", &json!({})).status,
        404
    );
    let index = post_json(addr, "/v2/repository/index", &json!({"ready": true})).json();
    assert_eq!(
        index,
        json!([{"name": "b", "version": "3", "state": "READY"}])
    );
    // an unloaded model stays unloaded across polls
    server.poll_repository();
    assert_eq!(get(addr, "/v2/models/a/ready").status, 404);
    server.shutdown();
}

fn gzip(b: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut w = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    w.write_all(b).unwrap();
    w.finish().unwrap()
}

fn zlib(b: &[u8]) -> Vec<u8> {
    use std::io::Write as _;
    let mut w = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    w.write_all(b).unwrap();
    w.finish().unwrap()
}

fn gunzip(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(b)
        .read_to_end(&mut out)
        .unwrap();
    out
}

fn unzlib(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::ZlibDecoder::new(b)
        .read_to_end(&mut out)
        .unwrap();
    out
}

/// The value of the sample `name{labels}` in Prometheus text `text`.
fn sample(text: &str, name_labels: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name_labels) && l[name_labels.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn config_and_statistics_agree_over_http_and_grpc_and_metrics_have_their_own_port() {
    let repo = tempfile::tempdir().unwrap();
    put_version(repo.path(), "gpt", 1, &model(4));
    std::fs::write(
        repo.path().join("gpt/config.pbtxt"),
        "max_batch_size: 4\n\
         input [ { name: \"input_ids\" data_type: TYPE_INT64 dims: [ -1 ] } ]\n\
         dynamic_batching { preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 30000 }\n\
         instance_group [ { count: 1 kind: KIND_CPU } ]\n",
    )
    .unwrap();
    let server = start(repo.path(), |_| {});
    let addr = server.http_addr();
    let (rt, mut client) = grpc_client(&server);

    // the same configuration both ways
    let http_cfg = get(addr, "/v2/models/gpt/config").json();
    let grpc_cfg = rt
        .block_on(
            client.model_config(cohort_serve::proto::ModelConfigRequest {
                name: "gpt".into(),
                version: String::new(),
            }),
        )
        .unwrap()
        .into_inner()
        .config
        .unwrap();
    assert_eq!(http_cfg["name"], "gpt");
    assert_eq!(grpc_cfg.name, "gpt");
    assert_eq!(http_cfg["max_batch_size"], 4);
    assert_eq!(grpc_cfg.max_batch_size, 4);
    assert_eq!(http_cfg["platform"], grpc_cfg.platform.as_str());
    assert_eq!(
        http_cfg["dynamic_batching"]["preferred_batch_size"],
        json!([2, 4])
    );
    let Some(cohort_serve::proto::model_config::SchedulingChoice::DynamicBatching(db)) =
        &grpc_cfg.scheduling_choice
    else {
        panic!("no dynamic_batching in {grpc_cfg:?}")
    };
    assert_eq!(db.preferred_batch_size, [2, 4]);
    assert_eq!(db.max_queue_delay_microseconds, 30000);
    assert_eq!(
        http_cfg["input"],
        json!([{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]}])
    );
    assert_eq!(grpc_cfg.input[0].name, "input_ids");
    assert_eq!(grpc_cfg.output[0].dims, [-1, tiny().vocab_size as i64]);
    assert_eq!(
        http_cfg["output"][0]["dims"],
        json!([-1, tiny().vocab_size])
    );
    assert_eq!(http_cfg["instance_group"][0]["kind"], "KIND_CPU");
    assert_eq!(grpc_cfg.instance_group[0].kind, 2);
    let missing = rt.block_on(
        client.model_config(cohort_serve::proto::ModelConfigRequest {
            name: "nope".into(),
            version: String::new(),
        }),
    );
    assert_eq!(missing.unwrap_err().code(), tonic::Code::NotFound);

    // 4 concurrent single-row requests (batched: preferred size 4) and one of 2 rows
    std::thread::scope(|s| {
        for r in 0..4u32 {
            s.spawn(move || {
                let resp = post_json(addr, "/v2/models/gpt/infer", &infer_json(&[r, 1, 2], 1, 3));
                assert_eq!(resp.status, 200);
            });
        }
    });
    let r = post_json(
        addr,
        "/v2/models/gpt/infer",
        &infer_json(&[1, 2, 3, 4], 2, 2),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        post_json(addr, "/v2/models/gpt/infer", &infer_json(&[1, 99], 1, 2)).status,
        400
    );

    let all = get(addr, "/v2/models/stats");
    assert_eq!(all.status, 200);
    let one = get(addr, "/v2/models/gpt/stats").json();
    assert_eq!(all.json(), one);
    assert_eq!(get(addr, "/v2/models/gpt/versions/1/stats").json(), one);
    assert_eq!(get(addr, "/v2/models/gpt/versions/5/stats").status, 404);
    assert_eq!(get(addr, "/v2/models/nope/stats").status, 404);
    let m = &one["model_stats"][0];
    assert_eq!(
        (m["name"].as_str(), m["version"].as_str()),
        (Some("gpt"), Some("1"))
    );
    assert_eq!(m["inference_count"], 6);
    let execs = m["execution_count"].as_u64().unwrap();
    assert!((2..=5).contains(&execs), "{m}");
    let i = &m["inference_stats"];
    assert_eq!(i["success"]["count"], 5);
    assert_eq!(i["fail"]["count"], 1);
    assert_eq!(i["queue"]["count"], 5);
    for phase in [
        "success",
        "queue",
        "compute_input",
        "compute_infer",
        "compute_output",
    ] {
        assert!(i[phase]["ns"].as_u64().unwrap() > 0, "{phase}: {i}");
    }
    assert_eq!(i["compute_infer"]["count"], 5);
    let batches = m["batch_stats"].as_array().unwrap();
    let per_size: u64 = batches
        .iter()
        .map(|b| b["compute_infer"]["count"].as_u64().unwrap())
        .sum();
    assert_eq!(per_size, execs);
    let rows: u64 = batches
        .iter()
        .map(|b| b["batch_size"].as_u64().unwrap() * b["compute_infer"]["count"].as_u64().unwrap())
        .sum();
    assert_eq!(rows, 6);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let last = m["last_inference"].as_u64().unwrap();
    assert!(
        last <= now_ms && now_ms - last < 60_000,
        "{last} vs {now_ms}"
    );

    let g = rt
        .block_on(
            client.model_statistics(cohort_serve::proto::ModelStatisticsRequest {
                name: "gpt".into(),
                version: String::new(),
            }),
        )
        .unwrap()
        .into_inner();
    assert_eq!(g.model_stats.len(), 1);
    let gs = &g.model_stats[0];
    assert_eq!((gs.inference_count, gs.execution_count), (6, execs));
    let gi = gs.inference_stats.unwrap();
    assert_eq!(gi.success.unwrap().count, 5);
    assert_eq!(
        gi.compute_infer.unwrap().ns,
        i["compute_infer"]["ns"].as_u64().unwrap()
    );
    assert_eq!(gs.batch_stats.len(), batches.len());

    // the metrics port: /metrics alone, with the compute phases and the host's gauges
    let maddr = server.metrics_addr().unwrap();
    assert_ne!(maddr, addr);
    let text = String::from_utf8(get(maddr, "/metrics").body).unwrap();
    let labels = "{model=\"gpt\",version=\"1\"}";
    assert_eq!(
        sample(&text, &format!("nv_inference_request_success{labels}")),
        Some(5.0)
    );
    for family in [
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
    ] {
        let v = sample(&text, &format!("{family}{labels}"));
        assert!(v.is_some_and(|v| v >= 0.0), "{family}: {text}");
    }
    let util = sample(&text, "nv_cpu_utilization").expect("nv_cpu_utilization");
    assert!((0.0..=1.0).contains(&util), "{util}");
    let total = sample(&text, "nv_cpu_memory_total_bytes").unwrap();
    let used = sample(&text, "nv_cpu_memory_used_bytes").unwrap();
    assert!(
        total > 0.0 && used > 0.0 && used <= total,
        "{used} / {total}"
    );
    assert_eq!(get(maddr, "/v2/health/live").status, 404);
    assert!(String::from_utf8(get(addr, "/metrics").body)
        .unwrap()
        .contains("nv_inference_compute_output_duration_us{"));

    // an unloaded version's series go away
    assert_eq!(
        post_json(addr, "/v2/repository/models/gpt/unload", &json!({})).status,
        200
    );
    let text = String::from_utf8(get(maddr, "/metrics").body).unwrap();
    assert!(!text.contains("model=\"gpt\""), "{text}");
    assert_eq!(
        get(addr, "/v2/models/stats").json(),
        json!({"model_stats": []})
    );
    // an idle connection whose runtime is not running would hold up the graceful shutdown
    drop((rt, client));
    server.shutdown();
}

#[test]
fn compressed_bodies_both_ways_deadlines_and_oversized_grpc_messages() {
    let repo = tempfile::tempdir().unwrap();
    let mut m = model(7);
    put_version(repo.path(), "gpt", 1, &m);
    // a lone request waits up to 1 s for company
    put_version(repo.path(), "slow", 1, &model(8));
    std::fs::write(
        repo.path().join("slow/config.pbtxt"),
        "max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 1000000 }",
    )
    .unwrap();
    let server = start(repo.path(), |o| o.max_body_bytes = 64 << 10);
    let addr = server.http_addr();
    let ids = [3u32, 1, 4, 1, 5];
    let want = forward(&mut m, &ids, 1, 5);
    let body = infer_json(&ids, 1, 5).to_string();
    let logits = |j: &Value| -> Vec<f32> {
        j["outputs"][0]["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };

    // gzip in, gzip out; deflate (zlib) in, deflate out
    for (name, pack, unpack) in [
        (
            "gzip",
            gzip as fn(&[u8]) -> Vec<u8>,
            gunzip as fn(&[u8]) -> Vec<u8>,
        ),
        ("deflate", zlib, unzlib),
    ] {
        let r = http(
            addr,
            "POST",
            "/v2/models/gpt/infer",
            &[
                ("Content-Encoding", name.to_string()),
                ("Accept-Encoding", name.to_string()),
            ],
            &pack(body.as_bytes()),
        );
        assert_eq!(
            r.status,
            200,
            "{name}: {:?}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.header("content-encoding"), Some(name));
        let j: Value = serde_json::from_slice(&unpack(&r.body)).unwrap();
        close(&logits(&j), &want);
    }
    // without Accept-Encoding the answer is plain
    let r = http(
        addr,
        "POST",
        "/v2/models/gpt/infer",
        &[("Content-Encoding", "gzip".into())],
        &gzip(body.as_bytes()),
    );
    assert_eq!(r.header("content-encoding"), None);
    close(&logits(&r.json()), &want);
    // what inflates past the limit is refused without inflating it all; a coding cohort does
    // not know, or a body that is not what it says, is a clear 400
    let bomb = gzip(&vec![b' '; 8 << 20]);
    assert!(bomb.len() < 64 << 10);
    for (coding, body, status, needle) in [
        ("gzip", bomb, 413, "over the limit"),
        (
            "br",
            body.clone().into_bytes(),
            400,
            "Content-Encoding \"br\"",
        ),
        ("gzip", body.clone().into_bytes(), 400, "does not inflate"),
    ] {
        let r = http(
            addr,
            "POST",
            "/v2/models/gpt/infer",
            &[("Content-Encoding", coding.into())],
            &body,
        );
        let err = r.json()["error"].as_str().unwrap_or_default().to_string();
        assert_eq!(r.status, status, "{coding}: {err}");
        assert!(err.contains(needle), "{needle:?} not in {err:?}");
    }

    // gRPC, compressed both ways
    let (rt, client) = grpc_client(&server);
    use tonic::codec::CompressionEncoding::{Deflate, Gzip};
    for (enc, name) in [(Gzip, "gzip"), (Deflate, "deflate")] {
        let mut c = client.clone().send_compressed(enc).accept_compressed(enc);
        let resp = rt
            .block_on(c.model_infer(grpc_request("gpt", "", &ids, 1, 5)))
            .unwrap();
        let enc_header = resp
            .metadata()
            .get("grpc-encoding")
            .map(|v| v.to_str().unwrap().to_string());
        assert_eq!(enc_header.as_deref(), Some(name));
        close(&f32s(&resp.into_inner().raw_output_contents[0]), &want);
    }

    // a message over the limit (20 MB against 64 KiB) is RESOURCE_EXHAUSTED
    let mut big = grpc_request("gpt", "", &[1], 1, 1);
    big.raw_input_contents[0] = vec![0; 20 << 20];
    let err = rt
        .block_on(
            client
                .clone()
                .max_encoding_message_size(usize::MAX)
                .model_infer(big),
        )
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");

    // the caller's deadline: DEADLINE_EXCEEDED when it passes, not after the 1 s batch delay
    let mut req = tonic::Request::new(grpc_request("slow", "", &[1, 2], 1, 2));
    req.set_timeout(Duration::from_millis(200));
    let t0 = Instant::now();
    let err = rt.block_on(client.clone().model_infer(req)).unwrap_err();
    let took = t0.elapsed();
    // The server answers DEADLINE_EXCEEDED just before the deadline; on a loaded machine the
    // client's own timer (tonic enforces the grpc-timeout it sends) may fire first and report
    // CANCELLED "Timeout expired". Either way nobody waited for the batch delay, and what the
    // server did is checked below (the request is counted as cancelled, never run).
    let client_gave_up =
        err.code() == tonic::Code::Cancelled && err.message().contains("Timeout expired");
    assert!(
        err.code() == tonic::Code::DeadlineExceeded || client_gave_up,
        "{err:?}"
    );
    assert!(took < Duration::from_millis(900), "{took:?}");
    // the abandoned request is skipped when its batch would run, and counted as cancelled
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = String::from_utf8(get(addr, "/metrics").body).unwrap();
        let cancelled = sample(
            &text,
            "nv_inference_request_failure{model=\"slow\",version=\"1\",reason=\"CANCELED\"}",
        );
        if cancelled == Some(1.0) {
            assert_eq!(
                sample(
                    &text,
                    "nv_inference_exec_count{model=\"slow\",version=\"1\"}"
                ),
                Some(0.0)
            );
            break;
        }
        assert!(Instant::now() < deadline, "{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // an idle connection whose runtime is not running would hold up the graceful shutdown
    drop((rt, client));
    server.shutdown();
}

#[test]
fn a_load_with_a_config_override_is_honoured_or_refused_by_name() {
    let repo = tempfile::tempdir().unwrap();
    put_version(repo.path(), "gpt", 1, &model(5));
    put_version(repo.path(), "odd", 1, &model(6));
    std::fs::write(
        repo.path().join("odd/config.pbtxt"),
        "input [ { name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 16 ] } ]",
    )
    .unwrap();
    let server = start(repo.path(), |o| o.load_models = Some(vec!["gpt".into()]));
    let addr = server.http_addr();
    let load = |model: &str, params: Value| {
        post_json(
            addr,
            &format!("/v2/repository/models/{model}/load"),
            &json!({ "parameters": params }),
        )
    };
    assert_eq!(
        get(addr, "/v2/models/gpt/config").json()["max_batch_size"],
        8
    );
    let override_cfg = json!({"max_batch_size": 2, "instance_group": [{"count": 2}],
                              "dynamic_batching": {"max_queue_delay_microseconds": "100"}});
    let r = load("gpt", json!({"config": override_cfg.to_string()}));
    assert_eq!(r.status, 200, "{}", r.json());
    let cfg = get(addr, "/v2/models/gpt/config").json();
    assert_eq!(cfg["max_batch_size"], 2);
    assert_eq!(cfg["instance_group"][0]["count"], 2);
    assert_eq!(cfg["dynamic_batching"]["max_queue_delay_microseconds"], 100);
    // honoured, not only reported: 3 rows are now over the limit
    let r = post_json(addr, "/v2/models/gpt/infer", &infer_json(&[1, 2, 3], 3, 1));
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]
        .as_str()
        .unwrap()
        .contains("max_batch_size"));
    // and it survives a poll
    server.poll_repository();
    assert_eq!(
        get(addr, "/v2/models/gpt/config").json()["max_batch_size"],
        2
    );

    for (params, needle) in [
        (
            json!({"config": "{\"sequence_batching\": {}}"}),
            "field sequence_batching",
        ),
        (json!({"config": "{\"max_batch_size\": "}), "JSON"),
        (json!({"config": 7}), "not a string of JSON"),
        (
            json!({"file:1/model.safetensors": "AAAA"}),
            "override files",
        ),
        (json!({"priority": 1}), "parameter \"priority\""),
        (
            json!({"config": "{\"output\": [{\"name\": \"probs\"}]}"}),
            "output \"probs\" is not a tensor",
        ),
    ] {
        let r = load("gpt", params.clone());
        let err = r.json()["error"].as_str().unwrap_or_default().to_string();
        assert_eq!(r.status, 400, "{params}: {err}");
        assert!(err.contains(needle), "{params}: {needle:?} not in {err:?}");
    }
    // refused overrides changed nothing
    assert_eq!(
        get(addr, "/v2/models/gpt/config").json()["max_batch_size"],
        2
    );
    // a load without the override goes back to the repository's configuration
    assert_eq!(load("gpt", json!({})).status, 200);
    assert_eq!(
        get(addr, "/v2/models/gpt/config").json()["max_batch_size"],
        8
    );

    // config.pbtxt declaring a tensor the model does not have is refused at load, naming it
    let r = load("odd", json!({}));
    let err = r.json()["error"].as_str().unwrap_or_default().to_string();
    assert_eq!(r.status, 400, "{err}");
    assert!(
        err.contains("input \"INPUT0\" is not a tensor") && err.contains("config.pbtxt"),
        "{err}"
    );

    // gRPC likewise
    let (rt, mut client) = grpc_client(&server);
    use cohort_serve::proto::{model_repository_parameter::ParameterChoice, *};
    let grpc_load = |params: Vec<(&str, ParameterChoice)>| RepositoryModelLoadRequest {
        model_name: "gpt".into(),
        parameters: params
            .into_iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    ModelRepositoryParameter {
                        parameter_choice: Some(v),
                    },
                )
            })
            .collect(),
        ..Default::default()
    };
    let ok = rt.block_on(client.repository_model_load(grpc_load(vec![(
        "config",
        ParameterChoice::StringParam("{\"max_batch_size\": 3}".into()),
    )])));
    assert!(ok.is_ok(), "{ok:?}");
    let cfg = rt
        .block_on(client.model_config(ModelConfigRequest {
            name: "gpt".into(),
            version: String::new(),
        }))
        .unwrap()
        .into_inner()
        .config
        .unwrap();
    assert_eq!(cfg.max_batch_size, 3);
    let err = rt
        .block_on(client.repository_model_load(grpc_load(vec![(
            "config",
            ParameterChoice::StringParam("{\"optimization\": {}}".into()),
        )])))
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("field optimization"), "{err:?}");
    // an idle connection whose runtime is not running would hold up the graceful shutdown
    drop((rt, client));
    server.shutdown();
}

#[test]
fn a_stream_whose_client_left_stops_generating_and_frees_the_instance() {
    let repo = tempfile::tempdir().unwrap();
    // big enough that a long generation takes seconds (a sliding window re-reads 63 tokens
    // every 63 steps)
    let cfg = GPTConfig {
        vocab_size: 23,
        max_position_embeddings: 64,
        n_layers: 4,
        n_heads: 4,
        d_model: 128,
        d_ff: 512,
        dropout: 0.0,
        ..GPTConfig::default()
    };
    put_version(repo.path(), "gen", 1, &GPT::new(cfg, 1).unwrap());
    // one instance: a generation that does not stop holds everything behind it
    let server = start(repo.path(), |_| {});
    let addr = server.http_addr();
    let long = |stream: bool| json!({"text_input": "1 2 3", "parameters": {"max_tokens": 1024, "stream": stream}});
    let t0 = Instant::now();
    let r = post_json(addr, "/v2/models/gen/generate", &long(false));
    let full = t0.elapsed();
    assert_eq!(r.status, 200, "{}", r.json());
    assert!(
        full > Duration::from_millis(300),
        "too fast to tell: {full:?}"
    );

    // start a long stream, read its first event, and hang up
    let mut s = TcpStream::connect(addr).unwrap();
    let body = long(true).to_string();
    write!(
        s,
        "POST /v2/models/gen/generate_stream HTTP/1.1\r\nHost: {addr}\r\nContent-Type: \
         application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 512];
    let n = s.read(&mut first).unwrap();
    assert!(
        String::from_utf8_lossy(&first[..n]).contains("200 OK"),
        "{:?}",
        String::from_utf8_lossy(&first[..n])
    );
    drop(s);

    // the next request is served at once, not after the abandoned generation's 1024 tokens
    let t1 = Instant::now();
    let r = post_json(
        addr,
        "/v2/models/gen/generate",
        &json!({"text_input": "4 5", "parameters": {"max_tokens": 3}}),
    );
    let waited = t1.elapsed();
    assert_eq!(r.status, 200, "{}", r.json());
    println!("full generation {full:?}; after the hang-up the next request took {waited:?}");
    assert!(
        waited < full / 4,
        "waited {waited:?} (a full generation takes {full:?})"
    );
    let text = String::from_utf8(get(addr, "/metrics").body).unwrap();
    let labels = "{model=\"gen\",version=\"1\"}";
    let tokens = sample(&text, &format!("cohort_generate_tokens{labels}")).unwrap();
    assert!(
        tokens < 1024.0 + 3.0 + 512.0,
        "{tokens} tokens: the stream ran on"
    );
    assert_eq!(
        sample(
            &text,
            "nv_inference_request_failure{model=\"gen\",version=\"1\",reason=\"CANCELED\"}"
        ),
        Some(1.0),
        "{text}"
    );

    // likewise a gRPC stream (decoupled generation) the client drops after its first response
    let (rt, client) = grpc_client(&server);
    use cohort_serve::proto::{infer_parameter::ParameterChoice, InferParameter};
    let prompt = b"1 2 3";
    let mut raw = (prompt.len() as u32).to_le_bytes().to_vec();
    raw.extend_from_slice(prompt);
    let request = ModelInferRequest {
        model_name: "gen".into(),
        id: "long".into(),
        inputs: vec![model_infer_request::InferInputTensor {
            name: "text_input".into(),
            datatype: "BYTES".into(),
            shape: vec![1],
            ..Default::default()
        }],
        raw_input_contents: vec![raw],
        parameters: [(
            "max_tokens".to_string(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::Int64Param(1024)),
            },
        )]
        .into(),
        ..Default::default()
    };
    rt.block_on(async {
        let mut c = client.clone();
        let mut responses = c
            .model_stream_infer(tokio_stream::iter(vec![request]))
            .await
            .unwrap()
            .into_inner();
        let first = responses.message().await.unwrap().unwrap();
        assert_eq!(first.error_message, "");
        let r = first.infer_response.unwrap();
        assert_eq!(
            (r.id.as_str(), r.outputs[0].name.as_str()),
            ("long", "text_output")
        );
        // dropping the response stream cancels the call; the client's connection task (on this
        // runtime, which only runs inside block_on) sends the reset
        drop(responses);
        tokio::time::sleep(Duration::from_millis(20)).await;
    });
    let t2 = Instant::now();
    let r = post_json(
        addr,
        "/v2/models/gen/generate",
        &json!({"text_input": "4 5", "parameters": {"max_tokens": 3}}),
    );
    let waited = t2.elapsed();
    assert_eq!(r.status, 200, "{}", r.json());
    println!("after the gRPC stream was dropped the next request took {waited:?}");
    assert!(
        waited < full / 4,
        "waited {waited:?} (a full generation takes {full:?})"
    );
    drop((rt, client));
    server.shutdown();
}

/// The generated ids of an ids-codec model's answer (` 3 1 4` -> [3, 1, 4]).
fn ids_of(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect()
}

/// The text of a generate_stream answer: every event's `text_output`, concatenated.
fn stream_text(r: &HttpResponse) -> String {
    let body = String::from_utf8(r.body.clone()).unwrap();
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| {
            let v: Value = serde_json::from_str(d).unwrap();
            assert!(v.get("error").is_none(), "{v}");
            v["text_output"].as_str().unwrap().to_string()
        })
        .collect()
}

#[test]
fn concurrent_generations_share_decode_steps_and_get_exactly_their_solo_tokens() {
    use cohort_gpt::sample::{generate, SampleOptions};
    let repo = tempfile::tempdir().unwrap();
    // slow enough per step that the requests overlap; a 64-token window that the longer ones
    // slide past
    let cfg = GPTConfig {
        vocab_size: 23,
        max_position_embeddings: 64,
        n_layers: 3,
        n_heads: 4,
        d_model: 128,
        d_ff: 512,
        dropout: 0.0,
        ..GPTConfig::default()
    };
    let gpt = GPT::new(cfg, 3).unwrap();
    put_version(repo.path(), "batched", 1, &gpt);
    put_version(repo.path(), "solo", 1, &gpt);
    std::fs::write(
        repo.path().join("solo/config.pbtxt"),
        "parameters { key: \"inflight_batching\" value: { string_value: \"false\" } }\n",
    )
    .unwrap();
    let server = start(repo.path(), |_| {});
    let addr = server.http_addr();
    // (prompt, max_tokens, temperature, top_k, seed, streamed)
    let reqs: Vec<(&str, usize, f64, i64, u64, bool)> = vec![
        ("1 2 3", 150, 0.0, 0, 0, false),
        ("4", 20, 0.9, 5, 11, true),
        ("5 6 7 8 9 10 11", 90, 1.2, 0, 12, false),
        ("2 2", 1, 0.7, 3, 13, false),
        ("7 1 7 1 7 1 7 1 7 1", 60, 0.8, 10, 14, true),
        ("3", 110, 0.0, 0, 0, true),
    ];
    let run_all = |model: &'static str| -> Vec<Vec<u32>> {
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(reqs.len()));
        let handles: Vec<_> = reqs
            .iter()
            .map(|&(prompt, n, t, k, seed, stream)| {
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    let body = json!({"text_input": prompt, "parameters": {
                        "max_tokens": n, "temperature": t, "top_k": k, "seed": seed,
                        "exclude_input_in_output": true}});
                    barrier.wait();
                    let endpoint = if stream {
                        "generate_stream"
                    } else {
                        "generate"
                    };
                    let r = post_json(addr, &format!("/v2/models/{model}/{endpoint}"), &body);
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                    if stream {
                        ids_of(&stream_text(&r))
                    } else {
                        ids_of(r.json()["text_output"].as_str().unwrap())
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    };
    let batched = run_all("batched");
    let solo = run_all("solo");
    for ((prompt, n, t, k, seed, _), (got, alone)) in reqs.iter().zip(batched.iter().zip(&solo)) {
        let opts = SampleOptions {
            max_new_tokens: *n,
            temperature: *t as f32,
            top_k: (*k > 0).then_some(*k as usize),
            top_p: 1.0,
            seed: *seed,
        };
        let want = generate(&gpt, &ids_of(prompt), &opts, |_| {}).unwrap();
        assert_eq!(got, &want, "in-flight batched {prompt:?} {opts:?}");
        assert_eq!(alone, &want, "alone {prompt:?} {opts:?}");
    }
    let (steps, rows) = server.metrics().version("batched", 1).decode_steps();
    println!("in-flight: {rows} generation steps in {steps} decode steps");
    assert!(
        rows > steps,
        "no step had two generations: {rows} rows in {steps} steps"
    );
    assert_eq!(server.metrics().version("solo", 1).decode_steps(), (0, 0));
    // inference is served between decode steps, not after a long generation on the instance
    let long = std::thread::spawn(move || {
        let t0 = Instant::now();
        let body = json!({"text_input": "1 2 3", "parameters": {"max_tokens": 600}});
        let r = post_json(addr, "/v2/models/batched/generate", &body);
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        t0.elapsed()
    });
    std::thread::sleep(Duration::from_millis(50));
    let t1 = Instant::now();
    let r = post_json(
        addr,
        "/v2/models/batched/infer",
        &infer_json(&[1, 2, 3], 1, 3),
    );
    let infer_took = t1.elapsed();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let long_took = long.join().unwrap();
    println!("an inference during a {long_took:?} generation took {infer_took:?}");
    assert!(
        infer_took < long_took / 4,
        "inference waited {infer_took:?} (the generation took {long_took:?})"
    );
    // the parameter shows in the model's configuration
    let c = get(addr, "/v2/models/solo/config").json();
    assert_eq!(
        c["parameters"]["inflight_batching"]["string_value"],
        "false"
    );
    server.shutdown();
}

#[test]
fn a_bf16_kv_cache_serves_its_own_tokens_and_a_bad_kv_cache_dtype_is_refused_at_load() {
    use cohort_gpt::sample::{generate, generate_while_with, KvDtype, SampleOptions};
    let repo = tempfile::tempdir().unwrap();
    let cfg = GPTConfig {
        vocab_size: 23,
        max_position_embeddings: 32,
        n_layers: 2,
        n_heads: 4,
        d_model: 64,
        d_ff: 256,
        dropout: 0.0,
        ..GPTConfig::default()
    };
    // large weights: attention is sharp, so bf16's rounding of keys shows in the tokens
    let mut gpt = GPT::new(cfg, 7).unwrap();
    for p in gpt.params_mut() {
        *p *= 20.0;
    }
    let bf16 = "parameters { key: \"kv_cache_dtype\" value: { string_value: \"bf16\" } }\n";
    let solo = "parameters { key: \"inflight_batching\" value: { string_value: \"false\" } }\n";
    for (name, config) in [
        ("bf16", bf16.to_string()),
        ("bf16_solo", format!("{bf16}{solo}")),
        (
            "fp16",
            "parameters { key: \"kv_cache_dtype\" value: { string_value: \"fp16\" } }\n".into(),
        ),
    ] {
        put_version(repo.path(), name, 1, &gpt);
        std::fs::write(repo.path().join(name).join("config.pbtxt"), config).unwrap();
    }
    let server = start(repo.path(), |o| {
        o.load_models = Some(vec!["bf16".into(), "bf16_solo".into()])
    });
    let addr = server.http_addr();
    // (prompt, max_tokens, temperature, top_k, seed), all at once
    let reqs: Vec<(&str, usize, f64, i64, u64)> = vec![
        ("1 2 3", 50, 0.0, 0, 0),
        ("4", 20, 0.9, 5, 11),
        ("5 6 7 8 9 10 11", 40, 1.2, 0, 12),
        ("7 1 7 1 7 1", 45, 0.8, 10, 14),
    ];
    let mut differs = false;
    for model in ["bf16", "bf16_solo"] {
        let handles: Vec<_> = reqs
            .iter()
            .map(|&(prompt, n, t, k, seed)| {
                std::thread::spawn(move || {
                    let body = json!({"text_input": prompt, "parameters": {
                        "max_tokens": n, "temperature": t, "top_k": k, "seed": seed,
                        "exclude_input_in_output": true}});
                    let r = post_json(addr, &format!("/v2/models/{model}/generate"), &body);
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                    ids_of(r.json()["text_output"].as_str().unwrap())
                })
            })
            .collect();
        for (&(prompt, n, t, k, seed), h) in reqs.iter().zip(handles) {
            let got = h.join().unwrap();
            let opts = SampleOptions {
                max_new_tokens: n,
                temperature: t as f32,
                top_k: (k > 0).then_some(k as usize),
                top_p: 1.0,
                seed,
            };
            let want = generate_while_with(&gpt, &ids_of(prompt), &opts, KvDtype::Bf16, |_| {
                std::ops::ControlFlow::Continue(())
            })
            .unwrap();
            assert_eq!(got, want, "{model} {prompt:?} {opts:?}");
            differs |= got != generate(&gpt, &ids_of(prompt), &opts, |_| {}).unwrap();
        }
    }
    assert!(
        differs,
        "every request got its f32-cache tokens: was the cache bf16?"
    );
    let (steps, rows) = server.metrics().version("bf16", 1).decode_steps();
    assert!(
        rows > steps,
        "no step had two generations: {rows} rows in {steps} steps"
    );
    // a value other than fp32 or bf16 fails that model's load, in one line naming the model,
    // the key and the values it takes; the others keep serving
    let r = post_json(addr, "/v2/repository/models/fp16/load", &json!({}));
    assert_eq!(r.status, 400);
    let err = r.json()["error"].as_str().unwrap().to_string();
    assert!(
        err.contains("fp16/config.pbtxt")
            && err.contains("parameter kv_cache_dtype is \"fp16\"")
            && err.contains("\"fp32\" (the default) or \"bf16\"")
            && !err.contains('\n'),
        "{err}"
    );
    assert_ne!(get(addr, "/v2/models/fp16/ready").status, 200);
    assert_eq!(get(addr, "/v2/models/bf16/ready").status, 200);
    let c = get(addr, "/v2/models/bf16/config").json();
    assert_eq!(c["parameters"]["kv_cache_dtype"]["string_value"], "bf16");
    server.shutdown();
}

#[test]
fn decode_weights_serve_their_copys_tokens_batched_or_alone_and_a_bad_format_is_refused() {
    use cohort_gpt::sample::{
        generate, generate_while_in, DecodeWeights, KvDtype, SampleOptions, WeightFormat, Workspace,
    };
    let repo = tempfile::tempdir().unwrap();
    let cfg = GPTConfig {
        vocab_size: 23,
        max_position_embeddings: 32,
        n_layers: 2,
        n_heads: 4,
        d_model: 64,
        d_ff: 256,
        dropout: 0.0,
        ..GPTConfig::default()
    };
    // large weights: sharp attention, so the copies' rounding shows in the tokens
    let mut gpt = GPT::new(cfg, 9).unwrap();
    for p in gpt.params_mut() {
        *p *= 20.0;
    }
    let weights = |w: &str| {
        format!("parameters {{ key: \"decode_weights\" value: {{ string_value: \"{w}\" }} }}\n")
    };
    let solo = "parameters { key: \"inflight_batching\" value: { string_value: \"false\" } }\n";
    for (name, config) in [
        ("q8", weights("q8")),
        ("q8_solo", format!("{}{solo}", weights("q8"))),
        ("bf16", weights("bf16")),
        ("q4", weights("q4")),
    ] {
        put_version(repo.path(), name, 1, &gpt);
        std::fs::write(repo.path().join(name).join("config.pbtxt"), config).unwrap();
    }
    let server = start(repo.path(), |o| {
        o.load_models = Some(vec!["q8".into(), "q8_solo".into(), "bf16".into()])
    });
    let addr = server.http_addr();
    let mut differs = false;
    let reqs: Vec<(&str, usize, f64, u64)> = vec![
        ("1 2 3", 30, 0.0, 0),
        ("4", 20, 0.9, 11),
        ("5 6 7 8", 25, 1.1, 12),
    ];
    for (model, format) in [
        ("q8", WeightFormat::Q8),
        ("q8_solo", WeightFormat::Q8),
        ("bf16", WeightFormat::Bf16),
    ] {
        let copy = std::sync::Arc::new(DecodeWeights::new(&gpt, format.decode_format().unwrap()));
        let handles: Vec<_> = reqs
            .iter()
            .map(|&(prompt, n, t, seed)| {
                std::thread::spawn(move || {
                    let body = json!({"text_input": prompt, "parameters": {
                        "max_tokens": n, "temperature": t, "seed": seed,
                        "exclude_input_in_output": true}});
                    let r = post_json(addr, &format!("/v2/models/{model}/generate"), &body);
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                    ids_of(r.json()["text_output"].as_str().unwrap())
                })
            })
            .collect();
        for (&(prompt, n, t, seed), h) in reqs.iter().zip(handles) {
            let opts = SampleOptions {
                max_new_tokens: n,
                temperature: t as f32,
                top_k: None,
                top_p: 1.0,
                seed,
            };
            let mut ws = Workspace::with_weights(&gpt, copy.clone()).unwrap();
            let go = |_| std::ops::ControlFlow::Continue(());
            let want =
                generate_while_in(&mut ws, &gpt, &ids_of(prompt), &opts, KvDtype::F32, go).unwrap();
            assert_eq!(h.join().unwrap(), want, "{model} {prompt:?} {opts:?}");
            differs |= want != generate(&gpt, &ids_of(prompt), &opts, |_| {}).unwrap();
        }
    }
    assert!(
        differs,
        "every request got the f32 weights' tokens: was a copy read?"
    );
    // another value fails that model's load in one line naming the key and the values
    let r = post_json(addr, "/v2/repository/models/q4/load", &json!({}));
    assert_eq!(r.status, 400);
    let err = r.json()["error"].as_str().unwrap().to_string();
    assert!(
        err.contains("parameter decode_weights is \"q4\"")
            && err.contains("\"bf16\" or \"q8\"")
            && !err.contains('\n'),
        "{err}"
    );
    server.shutdown();
}

/// r43: a model that cannot load is never hidden. Each is named with why (no version
/// directory, a `v1` directory, a broken config.pbtxt) in the model table, in the error that
/// stops the start with `exit_on_error`, and by readiness, which with `strict_readiness`
/// answers not ready while a model asked for is not.
#[test]
fn models_that_fail_at_start_are_named_and_readiness_waits_for_them() {
    let repo = tempfile::tempdir().unwrap();
    let m = model(3);
    put_version(repo.path(), "gpt", 1, &m);
    put_version(repo.path(), "broken", 1, &m);
    std::fs::write(
        repo.path().join("broken/config.pbtxt"),
        "max_batch_size: [[",
    )
    .unwrap();
    std::fs::create_dir_all(repo.path().join("empty")).unwrap();
    checkpoint::save(
        &repo.path().join("named_v1/v1"),
        "step-1",
        &Checkpoint {
            model: Some(&m),
            ..Default::default()
        },
    )
    .unwrap();

    let err = Server::start(ServerOptions {
        exit_on_error: true,
        poll_interval: None,
        ..ServerOptions::loopback(repo.path().to_path_buf())
    })
    .err()
    .expect("a start with models that fail to load fails")
    .to_string();
    for want in [
        "\"broken\": ",
        "config.pbtxt",
        "\"empty\": no version directory",
        "\"named_v1\": no version directory",
        "it has v1",
    ] {
        assert!(err.contains(want), "{want:?} in {err}");
    }
    assert!(!err.contains("\"gpt\""), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");

    let server = start(repo.path(), |o| o.strict_readiness = true);
    let addr = server.http_addr();
    assert_eq!(get(addr, "/v2/models/gpt/ready").status, 200);
    assert_eq!(get(addr, "/v2/health/ready").status, 503);
    let failed: Vec<String> = server.not_ready().into_iter().map(|(m, _)| m).collect();
    assert_eq!(failed, ["broken", "empty", "named_v1"]);
    let table = server.model_table();
    eprintln!("{table}");
    for want in ["| gpt ", "READY", "| broken ", "UNAVAILABLE", "it has v1"] {
        assert!(table.contains(want), "{want:?} in\n{table}");
    }
    server.shutdown();

    // Readiness without strictness, or with only the model that loads asked for.
    let server = start(repo.path(), |_| {});
    assert_eq!(get(server.http_addr(), "/v2/health/ready").status, 200);
    server.shutdown();
    let server = start(repo.path(), |o| {
        o.strict_readiness = true;
        o.exit_on_error = true;
        o.load_models = Some(vec!["gpt".into()]);
    });
    assert_eq!(get(server.http_addr(), "/v2/health/ready").status, 200);
    server.shutdown();
    let missing = Server::start(ServerOptions {
        exit_on_error: true,
        load_models: Some(vec!["nope".into()]),
        ..ServerOptions::loopback(repo.path().to_path_buf())
    })
    .err()
    .unwrap()
    .to_string();
    assert!(
        missing.contains("\"nope\": no model directory"),
        "{missing}"
    );
}
