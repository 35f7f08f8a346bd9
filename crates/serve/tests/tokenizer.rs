//! BYTES tensors and tokenizer models end to end in one process, without Python: a repository
//! on disk holding a GPT, an encoding and two decoding `cohort_tokenizer` models and the
//! ensemble text -> ids -> GPT -> next token -> text of them, answered over HTTP (JSON and the
//! binary extension) and gRPC (raw and typed contents) and compared with the steps called one
//! by one and with cohort's own forward pass. (The same pipeline checked with Triton's own
//! client is crates/serve/tests/tokenizer_check.py, driven by the `cohort` binary's tests.)

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use cohort_gpt::checkpoint::{self, Checkpoint};
use cohort_gpt::{Forward, GPTConfig, GPT};
use cohort_serve::proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use cohort_serve::proto::{model_infer_request, InferTensorContents, ModelInferRequest};
use cohort_serve::{Server, ServerOptions};
use cohort_tokenizer::{Tokenizer, TOKENIZER_FILE};
use serde_json::{json, Value};

/// The tokenizer's characters; the GPT's vocabulary is exactly these.
const CHARS: &str = " abcdefghé.";

fn gpt() -> GPT {
    let cfg = GPTConfig {
        vocab_size: CHARS.chars().count(),
        max_position_embeddings: 32,
        n_layers: 2,
        n_heads: 2,
        d_model: 16,
        d_ff: 32,
        dropout: 0.0,
        ..GPTConfig::default()
    };
    let mut m = GPT::new(cfg, 11).unwrap();
    // sharper logits than the init's, so that prompts get different next tokens
    for p in m.params_mut() {
        *p *= 10.0;
    }
    m
}

/// The GPT, the tokenizer models and the ensemble `textgen` of them.
fn repository(repo: &Path, m: &GPT, tok: &Tokenizer) {
    let json = tok.to_json().unwrap();
    checkpoint::save(
        &repo.join("gpt/1"),
        "step-1",
        &Checkpoint {
            model: Some(m),
            ..Default::default()
        },
    )
    .unwrap();
    std::fs::write(repo.join("gpt/config.pbtxt"), "max_batch_size: 4\n").unwrap();
    let tokenizer = |name: &str, config: &str| {
        std::fs::create_dir_all(repo.join(name).join("1")).unwrap();
        std::fs::write(repo.join(name).join("1").join(TOKENIZER_FILE), &json).unwrap();
        std::fs::write(
            repo.join(name).join("config.pbtxt"),
            format!("backend: \"cohort_tokenizer\"\nmax_batch_size: 4\n{config}"),
        )
        .unwrap();
    };
    tokenizer(
        "tokenizer",
        "input [ { name: \"TEXT\" data_type: TYPE_STRING dims: [ 1 ] } ]\n\
         output [ { name: \"input_ids\" data_type: TYPE_INT64 dims: [ -1 ] } ]\n",
    );
    // an input named as the generate extension's is still this model's input
    tokenizer(
        "encoder",
        "input [ { name: \"text_input\" data_type: TYPE_STRING dims: [ 1 ] } ]\n\
         output [ { name: \"ids\" data_type: TYPE_INT64 dims: [ -1 ] } ]\n",
    );
    // one id per row: the GPT's next_token, INT64 [batch]
    tokenizer(
        "detokenizer",
        "input [ { name: \"ids\" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } } ]\n\
         output [ { name: \"TEXT\" data_type: TYPE_STRING dims: [ 1 ] } ]\n",
    );
    tokenizer(
        "detokenizer_seq",
        "input [ { name: \"ids\" data_type: TYPE_INT64 dims: [ -1 ] } ]\n\
         output [ { name: \"TEXT\" data_type: TYPE_STRING dims: [ 1 ] } ]\n\
         dynamic_batching { max_queue_delay_microseconds: 50000 }\n",
    );
    std::fs::create_dir_all(repo.join("textgen/1")).unwrap();
    std::fs::write(
        repo.join("textgen/config.pbtxt"),
        "platform: \"ensemble\"\nmax_batch_size: 4\n\
         input [ { name: \"PROMPT\" data_type: TYPE_STRING dims: [ 1 ] } ]\n\
         output [\n\
           { name: \"NEXT_TEXT\" data_type: TYPE_STRING dims: [ 1 ] },\n\
           { name: \"NEXT_ID\" data_type: TYPE_INT64 dims: [ 1 ] },\n\
           { name: \"ECHO\" data_type: TYPE_STRING dims: [ 1 ] }\n\
         ]\n\
         ensemble_scheduling { step [\n\
           { model_name: \"tokenizer\" model_version: -1\n\
             input_map { key: \"TEXT\" value: \"PROMPT\" }\n\
             output_map { key: \"input_ids\" value: \"ids\" } },\n\
           { model_name: \"gpt\" model_version: -1\n\
             input_map { key: \"input_ids\" value: \"ids\" }\n\
             output_map { key: \"next_token\" value: \"NEXT_ID\" } },\n\
           { model_name: \"detokenizer\" model_version: -1\n\
             input_map { key: \"ids\" value: \"NEXT_ID\" }\n\
             output_map { key: \"TEXT\" value: \"NEXT_TEXT\" } },\n\
           { model_name: \"detokenizer_seq\" model_version: -1\n\
             input_map { key: \"ids\" value: \"ids\" }\n\
             output_map { key: \"TEXT\" value: \"ECHO\" } }\n\
         ] }\n",
    )
    .unwrap();
}

struct HttpResponse {
    status: u16,
    head_len: Option<usize>,
    body: Vec<u8>,
}

impl HttpResponse {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).to_string()
    }
    fn json(&self) -> Value {
        let end = self.head_len.unwrap_or(self.body.len());
        serde_json::from_slice(&self.body[..end]).unwrap_or_else(|e| panic!("{e}: {}", self.text()))
    }
}

/// One HTTP/1.1 request on a fresh connection (answers here are never chunked).
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    head_len: Option<usize>,
    body: &[u8],
) -> HttpResponse {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(n) = head_len {
        head += &format!("Inference-Header-Content-Length: {n}\r\n");
    }
    head += "\r\n";
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).to_lowercase();
    assert!(!head.contains("chunked"), "{head}");
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let head_len = head
        .lines()
        .find_map(|l| l.strip_prefix("inference-header-content-length:"))
        .map(|v| v.trim().parse().unwrap());
    HttpResponse {
        status,
        head_len,
        body: raw[split + 4..].to_vec(),
    }
}

/// Triton's serialized form of BYTES elements.
fn serialize(elements: &[&[u8]]) -> Vec<u8> {
    elements
        .iter()
        .flat_map(|e| {
            (e.len() as u32)
                .to_le_bytes()
                .into_iter()
                .chain(e.iter().copied())
        })
        .collect()
}

fn deserialize(mut b: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let n = u32::from_le_bytes(b[..4].try_into().unwrap()) as usize;
        out.push(String::from_utf8(b[4..4 + n].to_vec()).unwrap());
        b = &b[4 + n..];
    }
    out
}

fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// An HTTP JSON inference of `model`.
fn infer_json(addr: SocketAddr, model: &str, inputs: Value) -> Value {
    let body = json!({ "inputs": inputs }).to_string();
    let r = http(
        addr,
        "POST",
        &format!("/v2/models/{model}/infer"),
        None,
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{model}: {}", r.text());
    r.json()
}

/// The `data` of output `name` of a JSON answer.
fn output<'v>(answer: &'v Value, name: &str) -> &'v Value {
    let o = answer["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["name"] == name)
        .unwrap_or_else(|| panic!("no output {name} in {answer}"));
    &o["data"]
}

/// The success count of `model`'s statistics.
fn successes(addr: SocketAddr, model: &str) -> u64 {
    let r = http(addr, "GET", &format!("/v2/models/{model}/stats"), None, b"");
    assert_eq!(r.status, 200, "{}", r.text());
    let s = &r.json()["model_stats"][0]["inference_stats"]["success"]["count"];
    s.as_u64()
        .or_else(|| s.as_str().and_then(|s| s.parse().ok()))
        .unwrap()
}

#[test]
fn text_goes_through_tokenizer_gpt_and_detokenizer_as_one_ensemble() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = gpt();
    let tok = Tokenizer::char_level(CHARS.chars());
    repository(dir.path(), &m, &tok);
    let mut opts = ServerOptions::loopback(dir.path().to_path_buf());
    opts.poll_interval = None;
    opts.instance_threads = Some(1);
    let server = Server::start(opts).unwrap();
    for name in [
        "gpt",
        "tokenizer",
        "encoder",
        "detokenizer",
        "detokenizer_seq",
        "textgen",
    ] {
        assert!(server.is_model_ready(name), "{name}: {:?}", server.index());
    }
    let addr = server.http_addr();

    // metadata and config say BYTES / TYPE_STRING
    let r = http(addr, "GET", "/v2/models/tokenizer", None, b"");
    assert_eq!(
        r.json()["inputs"][0],
        json!({"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]})
    );
    let r = http(addr, "GET", "/v2/models/textgen/config", None, b"");
    assert_eq!(r.json()["input"][0]["data_type"], "TYPE_STRING");

    // what the pipeline must answer, computed here: encode, forward, argmax, decode
    let prompts = ["bad cafe.", "é a déché", "hé"];
    let want: Vec<(Vec<i64>, i64, String)> = prompts
        .iter()
        .map(|p| {
            let ids = tok.encode(p).unwrap();
            m.forward(Forward::new(&ids, 1, ids.len())).unwrap();
            let vocab = m.config().vocab_size;
            let next = cohort_gpt::sample::argmax(&m.logits()[(ids.len() - 1) * vocab..]);
            let text = tok.decode(&[next as u32]).unwrap();
            (ids.into_iter().map(i64::from).collect(), next as i64, text)
        })
        .collect();
    assert!(
        want.iter().any(|w| w.1 != want[0].1),
        "every prompt has the same next token: a wrong row would go unnoticed"
    );

    for (prompt, (ids, next, text)) in prompts.iter().zip(&want) {
        // the steps one by one, over HTTP JSON
        let a = infer_json(
            addr,
            "tokenizer",
            json!([{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [prompt]}]),
        );
        assert_eq!(output(&a, "input_ids"), &json!(ids), "{prompt}");
        let a = infer_json(
            addr,
            "gpt",
            json!([{"name": "input_ids", "datatype": "INT64", "shape": [1, ids.len()], "data": ids}]),
        );
        assert_eq!(output(&a, "next_token"), &json!([next]), "{prompt}");
        let a = infer_json(
            addr,
            "detokenizer",
            json!([{"name": "ids", "datatype": "INT64", "shape": [1], "data": [next]}]),
        );
        assert_eq!(output(&a, "TEXT"), &json!([text]), "{prompt}");
        let a = infer_json(
            addr,
            "detokenizer_seq",
            json!([{"name": "ids", "datatype": "INT64", "shape": [1, ids.len()], "data": ids}]),
        );
        assert_eq!(
            output(&a, "TEXT"),
            &json!([prompt]),
            "round trip of {prompt}"
        );

        // the ensemble over HTTP JSON
        let a = infer_json(
            addr,
            "textgen",
            json!([{"name": "PROMPT", "datatype": "BYTES", "shape": [1, 1], "data": [prompt]}]),
        );
        assert_eq!(output(&a, "NEXT_TEXT"), &json!([text]), "{prompt}");
        assert_eq!(output(&a, "NEXT_ID"), &json!([next]), "{prompt}");
        assert_eq!(output(&a, "ECHO"), &json!([prompt]), "{prompt}");
    }

    // the ensemble over the binary extension, two rows of the same length in one request
    let two = ["bad cafe.", "hé ab.cdé"];
    assert_eq!(
        tok.encode(two[1]).unwrap().len(),
        tok.encode(two[0]).unwrap().len()
    );
    let wants2: Vec<(i64, String)> = two
        .iter()
        .map(|p| {
            let ids = tok.encode(p).unwrap();
            m.forward(Forward::new(&ids, 1, ids.len())).unwrap();
            let vocab = m.config().vocab_size;
            let next = cohort_gpt::sample::argmax(&m.logits()[(ids.len() - 1) * vocab..]);
            (next as i64, tok.decode(&[next as u32]).unwrap())
        })
        .collect();
    let data = serialize(&two.map(str::as_bytes));
    let head = json!({
        "inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [2, 1],
                    "parameters": {"binary_data_size": data.len()}}],
        "outputs": [{"name": "NEXT_TEXT", "parameters": {"binary_data": true}},
                    {"name": "ECHO", "parameters": {"binary_data": true}}]
    })
    .to_string();
    let mut body = head.clone().into_bytes();
    body.extend_from_slice(&data);
    let r = http(
        addr,
        "POST",
        "/v2/models/textgen/infer",
        Some(head.len()),
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let j = r.json();
    let n = r.head_len.unwrap();
    let sizes: Vec<usize> = (0..2)
        .map(|o| {
            j["outputs"][o]["parameters"]["binary_data_size"]
                .as_u64()
                .unwrap() as usize
        })
        .collect();
    assert_eq!(j["outputs"][0]["datatype"], "BYTES");
    assert_eq!(j["outputs"][0]["shape"], json!([2, 1]));
    let next_texts = deserialize(&r.body[n..n + sizes[0]]);
    assert_eq!(
        next_texts,
        wants2.iter().map(|w| w.1.clone()).collect::<Vec<_>>()
    );
    assert_eq!(
        deserialize(&r.body[n + sizes[0]..n + sizes[0] + sizes[1]]),
        two
    );

    // gRPC: raw contents, then typed bytes_contents
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = format!("http://{}", server.grpc_addr().unwrap());
    let mut client = rt
        .block_on(GrpcInferenceServiceClient::connect(url))
        .unwrap();
    let prompt_input = model_infer_request::InferInputTensor {
        name: "PROMPT".into(),
        datatype: "BYTES".into(),
        shape: vec![2, 1],
        ..Default::default()
    };
    let raw = ModelInferRequest {
        model_name: "textgen".into(),
        inputs: vec![prompt_input.clone()],
        raw_input_contents: vec![data.clone()],
        ..Default::default()
    };
    let typed = ModelInferRequest {
        model_name: "textgen".into(),
        inputs: vec![model_infer_request::InferInputTensor {
            contents: Some(InferTensorContents {
                bytes_contents: two.iter().map(|p| p.as_bytes().to_vec()).collect(),
                ..Default::default()
            }),
            ..prompt_input
        }],
        ..Default::default()
    };
    for req in [raw, typed] {
        let resp = rt.block_on(client.model_infer(req)).unwrap().into_inner();
        let at = |name: &str| {
            let i = resp.outputs.iter().position(|o| o.name == name).unwrap();
            (&resp.outputs[i], &resp.raw_output_contents[i])
        };
        let (o, b) = at("NEXT_TEXT");
        assert_eq!((o.datatype.as_str(), &o.shape[..]), ("BYTES", &[2, 1][..]));
        assert_eq!(
            deserialize(b),
            wants2.iter().map(|w| w.1.clone()).collect::<Vec<_>>()
        );
        assert_eq!(
            i64s(at("NEXT_ID").1),
            wants2.iter().map(|w| w.0).collect::<Vec<_>>()
        );
        assert_eq!(deserialize(at("ECHO").1), two);
    }

    // bad BYTES input: 400 naming the tensor and what is wrong, and the server goes on
    let before = successes(addr, "textgen");
    let bad = |data: &[u8], shape: Value| {
        let head = json!({"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": shape,
                                      "parameters": {"binary_data_size": data.len()}}]})
        .to_string();
        let mut body = head.clone().into_bytes();
        body.extend_from_slice(data);
        http(
            addr,
            "POST",
            "/v2/models/textgen/infer",
            Some(head.len()),
            &body,
        )
    };
    let cut = &data[..data.len() - 3];
    let r = bad(cut, json!([2, 1]));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.json()["error"]
            .as_str()
            .unwrap()
            .contains("tensor \"PROMPT\": BYTES element 1's length prefix says"),
        "{}",
        r.text()
    );
    let r = bad(&data[..2], json!([1, 1]));
    assert_eq!(r.status, 400);
    assert!(
        r.text().contains("4-byte length prefix is cut short"),
        "{}",
        r.text()
    );
    let r = bad(&data, json!([3, 1]));
    assert_eq!(r.status, 400);
    assert!(
        r.text().contains("needs 3 elements, the request holds 2"),
        "{}",
        r.text()
    );
    let r = bad(&serialize(&[b"ab\xffc"]), json!([1, 1]));
    assert_eq!(r.status, 400);
    assert!(
        r.text().contains("\\\"TEXT\\\": element 0 is not UTF-8"),
        "{}",
        r.text()
    );
    let r = bad(&serialize(&[b"ab", b"abc"]), json!([2, 1]));
    assert_eq!(r.status, 400);
    assert!(
        r.text().contains("row 0 encodes to 2 ids and row 1 to 3"),
        "{}",
        r.text()
    );
    let r = bad(&serialize(&[b"xyz"]), json!([1, 1]));
    assert_eq!(r.status, 400);
    assert!(r.text().contains("TEXT[0]"), "{}", r.text());
    let grpc_bad = ModelInferRequest {
        model_name: "tokenizer".into(),
        inputs: vec![model_infer_request::InferInputTensor {
            name: "TEXT".into(),
            datatype: "BYTES".into(),
            shape: vec![1, 1],
            ..Default::default()
        }],
        raw_input_contents: vec![vec![9, 0, 0, 0, b'a']],
        ..Default::default()
    };
    let status = rt.block_on(client.model_infer(grpc_bad)).unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains(
            "tensor \"TEXT\": BYTES element 0's length prefix says 9 bytes, only 1 follow"
        ),
        "{status:?}"
    );
    let a = infer_json(
        addr,
        "textgen",
        json!([{"name": "PROMPT", "datatype": "BYTES", "shape": [1, 1], "data": [prompts[0]]}]),
    );
    assert_eq!(output(&a, "NEXT_TEXT"), &json!([want[0].2]));

    // each step's model counted the ensemble's requests (the failed ones never reached a step
    // past the tokenizer)
    assert_eq!(successes(addr, "textgen"), before + 1);
    let ensemble_requests = prompts.len() as u64 + 3 + 1;
    let direct = prompts.len() as u64;
    for step in ["tokenizer", "gpt", "detokenizer", "detokenizer_seq"] {
        assert_eq!(successes(addr, step), ensemble_requests + direct, "{step}");
    }

    // concurrent decodes are joined by the dynamic batcher, and each request gets exactly its
    // own rows of the BYTES output back (cut by walking the length prefixes)
    let executions = || {
        let r = http(addr, "GET", "/v2/models/detokenizer_seq/stats", None, b"");
        let n = &r.json()["model_stats"][0]["execution_count"];
        n.as_u64()
            .or_else(|| n.as_str().and_then(|s| s.parse().ok()))
            .unwrap()
    };
    let before = executions();
    let words: Vec<String> = (0..8)
        .map(|i| CHARS.chars().cycle().skip(i).take(3 + i % 2 * 2).collect())
        .collect();
    std::thread::scope(|s| {
        let calls: Vec<_> = words
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let ids: Vec<i64> = tok.encode(w).unwrap().into_iter().map(i64::from).collect();
                // rows of one request are the same word, so a row cut wrongly shows
                let rows = 1 + i % 3;
                let data: Vec<i64> = (0..rows).flat_map(|_| ids.clone()).collect();
                s.spawn(move || {
                    let inputs = json!([{"name": "ids", "datatype": "INT64",
                                         "shape": [rows, ids.len()], "data": data}]);
                    (rows, infer_json(addr, "detokenizer_seq", inputs))
                })
            })
            .collect();
        for (w, call) in words.iter().zip(calls) {
            let (rows, a) = call.join().unwrap();
            assert_eq!(output(&a, "TEXT"), &json!(vec![w; rows]), "{w:?}");
        }
    });
    let ran = executions() - before;
    assert!(
        ran < words.len() as u64,
        "8 requests in {ran} executions: no batching?"
    );

    // on a gRPC stream, a model whose own input is text_input is inferred, not generated with
    let request = ModelInferRequest {
        model_name: "encoder".into(),
        id: "enc".into(),
        inputs: vec![model_infer_request::InferInputTensor {
            name: "text_input".into(),
            datatype: "BYTES".into(),
            shape: vec![1, 1],
            ..Default::default()
        }],
        raw_input_contents: vec![serialize(&[b"bad"])],
        ..Default::default()
    };
    let resp = rt.block_on(async {
        let mut responses = client
            .model_stream_infer(tokio_stream::iter(vec![request]))
            .await
            .unwrap()
            .into_inner();
        responses.message().await.unwrap().unwrap()
    });
    assert_eq!(resp.error_message, "");
    let r = resp.infer_response.unwrap();
    assert_eq!((r.id.as_str(), r.outputs[0].name.as_str()), ("enc", "ids"));
    let want: Vec<i64> = tok
        .encode("bad")
        .unwrap()
        .into_iter()
        .map(i64::from)
        .collect();
    assert_eq!(i64s(&r.raw_output_contents[0]), want);
    drop((rt, client));
    server.shutdown();
}
