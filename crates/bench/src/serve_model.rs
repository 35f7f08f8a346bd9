//! `cohort bench serve --repository DIR --model NAME`: a load test of any model of a model
//! repository, in the manner of Triton's perf_analyzer (concurrency mode): the server is
//! started in process on the repository, the model's inputs are read from its metadata, and
//! `concurrency` gRPC clients on loopback each keep one request in flight, every request
//! holding `batch_size` rows of random values of the declared shapes and datatypes (a dynamic
//! dimension other than the batch takes the size `--shape` gives, else 1). Reports inferences
//! (rows) per second, p50 / p99 request latency and the mean rows per model execution, per
//! (batch size, concurrency) cell. With profiling on, each batch size then gets the model's
//! operator time split ([`cohort_serve::OpProfile`], on a private copy of the model the server
//! makes) beside the request's latency, so that both a slow operator and the time outside the
//! model (the wire, the queue) are visible.
//!
//! Random values: floats uniform in [-1, 1), integers uniform in [0, 8) (in range for
//! token ids and class indices alike), booleans either. The load test never writes to the
//! repository and never talks to anything but the server it starts.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cohort_rng::{SplitMix64, GOLDEN_GAMMA};
use serde::Serialize;

use cohort_serve::proto::{model_infer_request, ModelInferRequest, ModelMetadataRequest};
use cohort_serve::{DataType, OpProfile, ServeError, Server, ServerOptions, Tensor};

use crate::serve::{connect, drive_infer, percentile};

/// What to measure.
#[derive(Debug, Clone)]
pub struct ModelLoad {
    /// The model repository.
    pub repository: PathBuf,
    /// The model to load-test (the repository's other models load too: an ensemble's steps).
    pub model: String,
    /// Rows per request, one cell each.
    pub batch_sizes: Vec<usize>,
    /// Concurrent clients, one cell each.
    pub concurrency: Vec<usize>,
    /// Sizes of dynamic non-batch dimensions, by input name (without the batch dimension).
    pub shapes: BTreeMap<String, Vec<usize>>,
    /// Timed requests per cell.
    pub requests: usize,
    /// Untimed requests per cell first.
    pub warmup: usize,
    /// Threads per model instance; None: cores / instances.
    pub threads: Option<usize>,
    /// Seed of the random inputs.
    pub seed: u64,
    /// Timed executions of each batch size's operator profile; 0: no profile.
    pub profile_runs: usize,
}

/// Where a request of one batch size spends its time: in the model, per operator, and outside.
#[derive(Debug, Clone, Serialize)]
pub struct ModelProfile {
    /// The model.
    pub model: String,
    /// What executes it (see [`ModelLoadRow::backend`]).
    pub backend: String,
    /// Rows per request (and per execution profiled).
    pub batch_size: usize,
    /// The model's compute per request: one execution's wall time in the runtime, ms.
    pub model_ms: f64,
    /// The request's median latency through the server at the lowest concurrency measured, ms.
    pub request_ms: f64,
    /// `request_ms - model_ms`: the wire, (de)serialization, the queue and the batcher, ms.
    pub outside_model_ms: f64,
    /// The time per operator type.
    pub profile: OpProfile,
}

/// What a load test measured.
#[derive(Debug, Clone)]
pub struct ModelLoadReport {
    /// One per (batch size, concurrency) cell.
    pub rows: Vec<ModelLoadRow>,
    /// One per batch size when profiling is on.
    pub profiles: Vec<ModelProfile>,
}

/// One measured cell.
#[derive(Debug, Clone, Serialize)]
pub struct ModelLoadRow {
    /// The model.
    pub model: String,
    /// What executes it (an ONNX model's runtime, library and threads); empty where its
    /// backend has one way only.
    pub backend: String,
    /// Rows per request.
    pub batch_size: usize,
    /// Concurrent clients.
    pub concurrency: usize,
    /// Requests timed.
    pub requests: usize,
    /// Wall time of the cell.
    pub seconds: f64,
    /// Inferences (rows) per second, as perf_analyzer counts them.
    pub infer_per_s: f64,
    /// Median request latency.
    pub p50_ms: f64,
    /// 99th percentile request latency.
    pub p99_ms: f64,
    /// Mean rows per model execution during the cell (0 for an ensemble, which executes its
    /// steps' models).
    pub mean_batch: f64,
}

/// One input as requests carry it.
#[derive(Debug, Clone)]
struct InputShape {
    name: String,
    datatype: DataType,
    /// Without the batch dimension, every size known.
    dims: Vec<usize>,
}

/// Runs every (batch size, concurrency) cell, calling `on_row` as each finishes, then profiles
/// each batch size if asked.
pub fn run(
    t: &ModelLoad,
    mut on_row: impl FnMut(&ModelLoadRow),
) -> Result<ModelLoadReport, ServeError> {
    if t.requests == 0 || t.batch_sizes.contains(&0) || t.concurrency.contains(&0) {
        return Err(ServeError::parameter(
            "load test",
            "requests, batch sizes and concurrency must be at least 1",
        ));
    }
    let mut opts = ServerOptions::loopback(t.repository.clone());
    opts.poll_interval = None;
    opts.metrics = None;
    opts.instance_threads = t.threads;
    opts.default_queue_size = t.concurrency.iter().copied().max().unwrap_or(1) * 2;
    let server = Server::start(opts)?;
    if !server.is_model_ready(&t.model) {
        let why: Vec<_> = server
            .index()
            .into_iter()
            .filter(|e| e.name == t.model)
            .map(|e| e.reason)
            .collect();
        server.shutdown();
        return Err(ServeError::NotReady {
            model: t.model.clone(),
            reason: format!("it did not load from the repository: {why:?}"),
        });
    }
    let backend = server.backend_of(&t.model).unwrap_or_default();
    let url = format!(
        "http://{}",
        server.grpc_addr().expect("loopback options serve gRPC")
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|source| ServeError::Io {
            op: "start the client runtime for",
            path: t.repository.clone(),
            source,
        })?;
    let result = (|| {
        let inputs = rt.block_on(input_shapes(&url, &t.model, &t.shapes))?;
        let mut rows = Vec::new();
        for &batch_size in &t.batch_sizes {
            for &concurrency in &t.concurrency {
                let cell = Cell {
                    url: url.clone(),
                    model: t.model.clone(),
                    inputs: inputs.clone(),
                    batch_size,
                    concurrency,
                    seed: t.seed,
                };
                rt.block_on(cell.drive(t.warmup.max(concurrency)))?;
                let metrics = server
                    .metrics()
                    .version(&t.model, latest(&server, &t.model));
                let before = metrics.batches();
                let started = Instant::now();
                let mut lat = rt.block_on(cell.drive(t.requests))?;
                let seconds = started.elapsed().as_secs_f64();
                let after = metrics.batches();
                let row = ModelLoadRow {
                    model: t.model.clone(),
                    backend: backend.clone(),
                    batch_size,
                    concurrency,
                    requests: t.requests,
                    seconds,
                    infer_per_s: (t.requests * batch_size) as f64 / seconds,
                    p50_ms: percentile(&mut lat, 0.50),
                    p99_ms: percentile(&mut lat, 0.99),
                    mean_batch: (after.1 - before.1) as f64 / (after.0 - before.0).max(1) as f64,
                };
                on_row(&row);
                rows.push(row);
            }
        }
        let mut profiles = Vec::new();
        for &batch_size in t.batch_sizes.iter().filter(|_| t.profile_runs > 0) {
            let mut rng = SplitMix64::new(t.seed);
            let inputs: Vec<Tensor> = inputs
                .iter()
                .map(|i| {
                    let mut shape = vec![batch_size];
                    shape.extend(&i.dims);
                    let n = shape.iter().product();
                    Tensor {
                        datatype: i.datatype,
                        shape,
                        data: random_bytes(i.datatype, n, &mut rng),
                    }
                })
                .collect();
            let profile = server.profile(&t.model, &inputs, t.profile_runs)?;
            let request_ms = rows
                .iter()
                .filter(|r| r.batch_size == batch_size)
                .min_by_key(|r| r.concurrency)
                .map_or(0.0, |r| r.p50_ms);
            profiles.push(ModelProfile {
                model: t.model.clone(),
                backend: backend.clone(),
                batch_size,
                model_ms: profile.run_ms,
                request_ms,
                outside_model_ms: request_ms - profile.run_ms,
                profile,
            });
        }
        Ok::<_, ServeError>(ModelLoadReport { rows, profiles })
    })();
    rt.shutdown_timeout(Duration::from_secs(1));
    server.shutdown();
    result
}

/// The newest ready version of `model`.
fn latest(server: &Server, model: &str) -> u64 {
    server
        .index()
        .iter()
        .filter(|e| e.name == model && e.state == "READY")
        .filter_map(|e| e.version.parse().ok())
        .max()
        .unwrap_or(1)
}

/// The model's inputs from its metadata, with every non-batch dimension sized.
async fn input_shapes(
    url: &str,
    model: &str,
    given: &BTreeMap<String, Vec<usize>>,
) -> Result<Vec<InputShape>, ServeError> {
    let mut client = connect(url, model).await?;
    let meta = client
        .model_metadata(ModelMetadataRequest {
            name: model.into(),
            version: String::new(),
        })
        .await
        .map_err(|s| ServeError::malformed(format!("metadata of {model}: {}", s.message())))?
        .into_inner();
    if let Some(unknown) = given
        .keys()
        .find(|k| !meta.inputs.iter().any(|i| &i.name == *k))
    {
        return Err(ServeError::parameter(
            "--shape",
            format!(
                "model {model} has no input {unknown:?} (it has {})",
                meta.inputs
                    .iter()
                    .map(|i| i.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    meta.inputs
        .iter()
        .map(|i| {
            let datatype = DataType::from_name(&i.datatype).ok_or_else(|| {
                ServeError::malformed(format!(
                    "input {:?} has datatype {}, which the load test cannot generate",
                    i.name, i.datatype
                ))
            })?;
            let declared = &i.shape[1..];
            let dims = match given.get(&i.name) {
                Some(d) => {
                    let fits = d.len() == declared.len()
                        && d.iter()
                            .zip(declared)
                            .all(|(&g, &m)| m < 0 || g as i64 == m);
                    if !fits {
                        return Err(ServeError::parameter(
                            "--shape",
                            format!(
                                "{}: {d:?} does not fit the model's {declared:?} (without the \
                                 batch dimension)",
                                i.name
                            ),
                        ));
                    }
                    d.clone()
                }
                None => declared.iter().map(|&d| d.max(1) as usize).collect(),
            };
            Ok(InputShape {
                name: i.name.clone(),
                datatype,
                dims,
            })
        })
        .collect()
}

/// Little-endian bytes of `n` random values of `dt` (BYTES: one-letter texts, a to h, each
/// after its 4-byte length as Triton serializes them).
fn random_bytes(dt: DataType, n: usize, rng: &mut SplitMix64) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dt.size().unwrap_or(5));
    for _ in 0..n {
        let small = rng.below(8) as i64;
        let uniform = (rng.below(1 << 24) as f64 / f64::from(1 << 23)) - 1.0;
        match dt {
            DataType::Bool => out.push((small & 1) as u8),
            DataType::Uint8 => out.push(small as u8),
            DataType::Int8 => out.push(small as u8),
            DataType::Int16 => out.extend_from_slice(&(small as i16).to_le_bytes()),
            DataType::Int32 => out.extend_from_slice(&(small as i32).to_le_bytes()),
            DataType::Int64 => out.extend_from_slice(&small.to_le_bytes()),
            DataType::Uint16 => out.extend_from_slice(&(small as u16).to_le_bytes()),
            DataType::Uint32 => out.extend_from_slice(&(small as u32).to_le_bytes()),
            DataType::Uint64 => out.extend_from_slice(&(small as u64).to_le_bytes()),
            DataType::Fp16 => out.extend_from_slice(&half::f16::from_f64(uniform).to_le_bytes()),
            DataType::Fp32 => out.extend_from_slice(&(uniform as f32).to_le_bytes()),
            DataType::Fp64 => out.extend_from_slice(&uniform.to_le_bytes()),
            DataType::Bytes => {
                out.extend_from_slice(&1u32.to_le_bytes());
                out.push(b'a' + small as u8);
            }
        }
    }
    out
}

/// One (batch size, concurrency) measurement.
struct Cell {
    url: String,
    model: String,
    inputs: Vec<InputShape>,
    batch_size: usize,
    concurrency: usize,
    seed: u64,
}

impl Cell {
    /// Sends `total` requests from `concurrency` clients; returns each latency in ms.
    async fn drive(&self, total: usize) -> Result<Vec<f64>, ServeError> {
        drive_infer(&self.url, &self.model, 0, self.concurrency, total, |c| {
            let mut rng = SplitMix64::new(self.seed ^ (c as u64).wrapping_mul(GOLDEN_GAMMA));
            // one random request per client, sent again and again (as perf_analyzer does by
            // default): the measure is the server, not the generator
            let mut req = ModelInferRequest {
                model_name: self.model.clone(),
                ..Default::default()
            };
            for i in &self.inputs {
                let mut shape = vec![self.batch_size as i64];
                shape.extend(i.dims.iter().map(|&d| d as i64));
                let n = self.batch_size * i.dims.iter().product::<usize>();
                req.inputs.push(model_infer_request::InferInputTensor {
                    name: i.name.clone(),
                    datatype: i.datatype.name().into(),
                    shape,
                    ..Default::default()
                });
                req.raw_input_contents
                    .push(random_bytes(i.datatype, n, &mut rng));
            }
            Box::new(move || req.clone())
        })
        .await
    }
}
