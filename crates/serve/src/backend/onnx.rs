//! ONNX models as a backend (`platform: "onnxruntime_onnx"`, or `backend: "onnxruntime"`, as
//! Triton's configs say), executed by tract, a pure-Rust ONNX runtime: `model.onnx` in the
//! version directory. This is the fallback where the ONNX Runtime library does not serve the
//! model, or the choice when asked for ([`onnx_ort`](super::onnx_ort) picks). The model's inputs and outputs, their names, datatypes and shapes come
//! from the file; the config's `input` / `output`, when given, must agree with them. The first
//! dimension of every input and output is the batch dimension and must be dynamic in the file
//! (an ONNX `dim_param` or an unnamed dimension), so that dynamic batching can join requests:
//! the model is optimized once with that dimension symbolic and runs any batch size, and each
//! instance also optimizes it for the first few batch sizes it meets, which tract runs faster.
//! `Gemm` nodes with constant weights (dense layers) run on cohort-engine's sgemm instead, with
//! their weights packed once at load ([`onnx_dense`](super::onnx_dense)); tract runs the rest.
//! With more than one thread an instance has a private pool, which both use.
//! A profile ([`Backend::profile`]) times each node of the plan an instance would run, each
//! named after the ONNX node it was made from.
//!
//! A model using an operator tract does not implement fails its load with one line naming the
//! operator and the node. This module never reads a request off the wire and never writes to
//! the repository.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use tract_linalg::multithread::{multithread_tract_scope, Executor};
use tract_onnx::prelude::{
    DatumType, Framework, InferenceModelExt, OutletId, Symbol, TDim, TValue, TVec,
    Tensor as TractTensor, TractError, TypedFact, TypedModel, TypedSimplePlan, TypedSimpleState,
};

use super::profile::{OpProfile, Tally};
use super::{Backend, Instance, Loaded, Version};
use crate::config::ModelConfig;
use crate::error::ServeError;
use crate::tensor::{DataType, Tensor, TensorSpec};
use crate::text::TextCodec;

/// The model file of an ONNX version directory, as Triton names it.
pub const MODEL_FILE: &str = "model.onnx";

/// A loaded ONNX model.
struct OnnxBackend {
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    threads: usize,
    /// The optimized plan and the model to make concrete plans from: a profile's own state.
    plan: Arc<TypedSimplePlan>,
    decluttered: Arc<Decluttered>,
    /// ONNX node name (as tract names its nodes) -> its operator, to name a profile's rows.
    origins: HashMap<String, String>,
}

impl Backend for OnnxBackend {
    fn inputs(&self) -> &[TensorSpec] {
        &self.inputs
    }

    fn outputs(&self) -> &[TensorSpec] {
        &self.outputs
    }

    fn text(&self) -> Result<TextCodec, String> {
        Err("an ONNX model does not generate text".into())
    }

    fn describe(&self) -> String {
        format!("tract, {} thread(s) per instance", self.threads)
    }

    /// Times each node's evaluation of the plan an instance would run for this batch; a row
    /// is the ONNX operator the node was made from (tract's own name for nodes it added).
    fn profile(&self, inputs: &[Tensor], runs: usize) -> Result<OpProfile, String> {
        let rows = inputs.first().map_or(0, |t| t.shape[0]);
        let mut state = match concrete_state(&self.decluttered, rows) {
            Some(state) => state,
            None => TypedSimpleState::new(&self.plan).map_err(|e| format!("{e:#}"))?,
        };
        let values = tract_values(inputs)?;
        let executor = (self.threads > 1)
            .then(|| Executor::multithread_with_name(self.threads, "onnx-profile"));
        let mut tally = Tally::default();
        let mut run = |tally: Option<&mut Tally>| {
            let started = Instant::now();
            let ran = match tally {
                None => state.run(values.clone()).map(drop),
                Some(tally) => {
                    let ran = state
                        .run_plan_with_eval(values.clone(), |ctx, op_state, node, ins| {
                            let t = Instant::now();
                            let out = tract_onnx::tract_core::plan::eval(ctx, op_state, node, ins);
                            let (op, origin) = self.origin(&node.name, node.op().name());
                            tally.node(&op, origin, t.elapsed().as_secs_f64());
                            out
                        })
                        .map(drop);
                    tally.run(started.elapsed().as_secs_f64());
                    ran
                }
            };
            ran.map_err(|e| format!("{e:#}"))
        };
        let mut timed = || {
            run(None)?;
            for _ in 0..runs {
                run(Some(&mut tally))?;
            }
            Ok::<_, String>(())
        };
        match executor {
            Some(pool) => multithread_tract_scope(pool, timed)?,
            None => timed()?,
        }
        Ok(tally.finish("tract", rows))
    }
}

impl OnnxBackend {
    /// The ONNX operator and node tract's node `name` was made from: the longest ONNX node
    /// name that is `name` or a prefix of it before a '.' (tract names the nodes it derives
    /// `node.step`); else tract's operator `op`, marked as tract's.
    fn origin<'a>(&'a self, name: &'a str, op: impl std::fmt::Display) -> (String, &'a str) {
        let mut at = name.len();
        loop {
            if let Some(onnx_op) = self.origins.get(&name[..at]) {
                return (onnx_op.clone(), &name[..at]);
            }
            match name[..at].rfind('.') {
                Some(dot) => at = dot,
                None => return (format!("{op} (tract)"), name),
            }
        }
    }
}

/// Plans an instance keeps with the batch dimension made concrete, one per batch size (tract
/// picks kernels and packs operands for a known size): the first sizes it meets; others run
/// the plan with the symbolic batch dimension.
const CONCRETE_PLANS: usize = 4;

/// The model before optimization, with its batch dimension's symbol, to make concrete plans.
struct Decluttered {
    model: TypedModel,
    batch: Option<Symbol>,
}

/// One instance: its own execution states over the shared optimized plan (and its concrete
/// plans), and its thread pool when it has more than one thread.
struct OnnxInstance {
    state: TypedSimpleState,
    /// (batch size, its plan's state; None: it could not be built, the symbolic one serves)
    concrete: Vec<(usize, Option<TypedSimpleState>)>,
    decluttered: Arc<Decluttered>,
    executor: Option<Executor>,
    /// Each output's type, checked against what the plan returns.
    outputs: Vec<TensorSpec>,
}

/// An execution state of the model with `rows` as its batch size, if it can be made.
fn concrete_state(decluttered: &Decluttered, rows: usize) -> Option<TypedSimpleState> {
    let sym = decluttered.batch.as_ref()?;
    let subs = HashMap::from([(sym.clone(), TDim::Val(rows as i64))]);
    let model = decluttered.model.set_symbols(&subs).ok()?;
    let optimized = model.into_optimized().ok()?;
    TypedSimpleState::new(&TypedSimplePlan::new(optimized).ok()?).ok()
}

/// `inputs` as tract's values.
fn tract_values(inputs: &[Tensor]) -> Result<TVec<TValue>, String> {
    let mut values: TVec<TValue> = TVec::new();
    for t in inputs {
        let dt = datum(t.datatype)
            .ok_or_else(|| format!("input of type {} reached the ONNX backend", t.datatype))?;
        let mut tt = TractTensor::zero_dt(dt, &t.shape).map_err(|e| format!("{e:#}"))?;
        tt.as_bytes_mut().copy_from_slice(&t.data);
        values.push(tt.into());
    }
    Ok(values)
}

impl OnnxInstance {
    /// The state that runs a batch of `rows`.
    fn state_for(&mut self, rows: usize) -> &mut TypedSimpleState {
        let known = self.concrete.iter().position(|(n, _)| *n == rows);
        let at = match known {
            Some(i) => Some(i),
            None if self.concrete.len() < CONCRETE_PLANS => {
                let state = concrete_state(&self.decluttered, rows);
                self.concrete.push((rows, state));
                Some(self.concrete.len() - 1)
            }
            None => None,
        };
        match at {
            Some(i) if self.concrete[i].1.is_some() => {
                self.concrete[i].1.as_mut().expect("checked")
            }
            _ => &mut self.state,
        }
    }
}

impl Instance for OnnxInstance {
    fn execute(&mut self, inputs: &[Tensor], want: &[bool]) -> Result<Vec<Option<Tensor>>, String> {
        let values = tract_values(inputs)?;
        let rows = inputs.first().map_or(0, |t| t.shape[0]);
        let executor = self.executor.clone();
        let state = self.state_for(rows);
        let ran = match executor {
            Some(pool) => multithread_tract_scope(pool, || state.run(values)),
            None => state.run(values),
        };
        let outs = ran.map_err(|e| format!("{e:#}"))?;
        let mut answer = Vec::with_capacity(outs.len());
        for ((out, spec), &wanted) in outs.iter().zip(&self.outputs).zip(want) {
            if !wanted {
                answer.push(None);
                continue;
            }
            if Some(out.datum_type()) != datum(spec.datatype) {
                return Err(format!(
                    "output {:?} came out as {:?}, the model declares {}",
                    spec.name,
                    out.datum_type(),
                    spec.datatype
                ));
            }
            if out.shape().first() != Some(&rows) {
                return Err(format!(
                    "output {:?} has shape {:?}, not {rows} rows like the inputs",
                    spec.name,
                    out.shape()
                ));
            }
            answer.push(Some(Tensor {
                datatype: spec.datatype,
                shape: out.shape().to_vec(),
                data: out.as_bytes().to_vec(),
            }));
        }
        Ok(answer)
    }
}

/// tract's type of `d`; None for BYTES, which this backend does not take (tract's strings are
/// not laid out as bytes, and ONNX models that take text are rare next to tokenizers in front
/// of them).
fn datum(d: DataType) -> Option<DatumType> {
    Some(match d {
        DataType::Bool => DatumType::Bool,
        DataType::Uint8 => DatumType::U8,
        DataType::Int8 => DatumType::I8,
        DataType::Int16 => DatumType::I16,
        DataType::Int32 => DatumType::I32,
        DataType::Int64 => DatumType::I64,
        DataType::Uint16 => DatumType::U16,
        DataType::Uint32 => DatumType::U32,
        DataType::Uint64 => DatumType::U64,
        DataType::Fp16 => DatumType::F16,
        DataType::Fp32 => DatumType::F32,
        DataType::Fp64 => DatumType::F64,
        DataType::Bytes => return None,
    })
}

/// The served type of tract's `d`, if cohort serves it.
fn served(d: DatumType) -> Option<DataType> {
    DataType::ALL.into_iter().find(|&t| datum(t) == Some(d))
}

/// The spec of a model tensor `name` with `fact`, checking that its first dimension is a
/// dynamic batch dimension.
fn spec(direction: &str, name: &str, fact: &TypedFact) -> Result<TensorSpec, String> {
    let datatype = served(fact.datum_type).ok_or_else(|| {
        unserved(
            direction,
            name,
            &format!("{:?}", fact.datum_type),
            DataType::ALL.into_iter().filter(|&t| datum(t).is_some()),
        )
    })?;
    let shape: Vec<i64> = fact
        .shape
        .iter()
        .map(|d| d.to_i64().unwrap_or(-1))
        .collect();
    batch_spec(direction, name, datatype, shape)
}

/// Why `direction` `name` of element type `ty` cannot be served; `served` are the types that
/// can.
pub(super) fn unserved(
    direction: &str,
    name: &str,
    ty: &str,
    served: impl Iterator<Item = DataType>,
) -> String {
    let names: Vec<&str> = served.map(DataType::name).collect();
    format!(
        "{direction} {name:?} has element type {ty}, which cohort does not serve (it serves {})",
        names.join(", ")
    )
}

/// The spec of model tensor `name` (`shape` from the file, -1 where dynamic), checking that its
/// first dimension is a dynamic batch dimension: both ONNX runtimes' tensors pass here.
pub(super) fn batch_spec(
    direction: &str,
    name: &str,
    datatype: DataType,
    shape: Vec<i64>,
) -> Result<TensorSpec, String> {
    match shape.first() {
        Some(-1) => Ok(TensorSpec {
            name: name.to_string(),
            datatype,
            shape,
        }),
        _ => Err(format!(
            "{direction} {name:?} has shape {shape:?}; its first dimension must be a dynamic \
             batch dimension (an ONNX dim_param such as \"N\"), since max_batch_size > 0"
        )),
    }
}

/// Reads `model.onnx` from `version_dir`, checks it against `cfg`, optimizes it once and
/// builds `count` instances of `threads` threads each.
pub(crate) fn load(
    what: &Version<'_>,
    version_dir: &Path,
    cfg: &ModelConfig,
    count: usize,
    threads: usize,
) -> Result<Loaded, ServeError> {
    let path = version_dir.join(MODEL_FILE);
    let err = |reason: String| what.error(format!("{MODEL_FILE}: {reason}"));
    if !path.is_file() {
        return Err(err(format!("not found in {}", version_dir.display())));
    }
    let mut onnx = tract_onnx::onnx();
    super::onnx_dense::register(&mut onnx);
    let mut proto = onnx
        .proto_model_for_path(&path)
        .map_err(|e| err(format!("{e:#}")))?;
    let graph = proto
        .graph
        .as_mut()
        .ok_or_else(|| err("the file holds no graph".into()))?;
    // tract would read an operator it lacks into a placeholder and fail later, without its
    // name: name it here, with the node, as the file has them
    if let Some(node) = graph
        .node
        .iter()
        .find(|n| !onnx.op_register.0.contains_key(&n.op_type))
    {
        return Err(err(format!(
            "unsupported ONNX operator {:?} (node {:?})",
            node.op_type, node.name
        )));
    }
    distinct_node_names(graph);
    // the names tract gives the graph's nodes (their own, else their first output's)
    let origins: HashMap<String, String> = graph
        .node
        .iter()
        .filter_map(|n| {
            let name = (!n.name.is_empty())
                .then(|| n.name.clone())
                .or_else(|| n.output.first().filter(|o| !o.is_empty()).cloned())?;
            Some((name, n.op_type.clone()))
        })
        .collect();
    let dir = version_dir.to_str();
    let parsed = onnx.parse(&proto, dir).map_err(|e| err(format!("{e:#}")))?;
    if let Some(name) = parsed.unresolved_inputs.first() {
        return Err(err(format!(
            "tensor {name:?} is used by a node but is no input, initializer or node output"
        )));
    }
    let inference = parsed.model;
    let decluttered = inference
        .into_typed()
        .and_then(|m| m.into_decluttered())
        .map_err(|e| err(format!("{e:#}")))?;
    let batch = decluttered
        .input_fact(0)
        .ok()
        .and_then(|f| f.shape.iter().next().cloned())
        .and_then(|d| match d {
            TDim::Sym(s) => Some(s),
            _ => None,
        });
    let typed = decluttered
        .clone()
        .into_optimized()
        .map_err(|e| err(format!("{e:#}")))?;
    let decluttered = Arc::new(Decluttered {
        model: decluttered,
        batch,
    });
    let (inputs, outputs) = tensors(&typed).map_err(err)?;
    let plan: Arc<TypedSimplePlan> =
        TypedSimplePlan::new(typed).map_err(|e| err(format!("{e:#}")))?;
    let backend = OnnxBackend {
        inputs,
        outputs,
        threads,
        plan: plan.clone(),
        decluttered: decluttered.clone(),
        origins,
    };
    super::check_declared(cfg, &backend).map_err(|e| err(format!("config {e}")))?;
    let mut instances: Vec<Box<dyn Instance>> = Vec::with_capacity(count);
    for i in 0..count {
        let state =
            TypedSimpleState::new(&plan).map_err(|e| err(format!("instance {i}: {e:#}")))?;
        let executor = (threads > 1)
            .then(|| Executor::multithread_with_name(threads, &format!("onnx-{}", what.model)));
        instances.push(Box::new(OnnxInstance {
            state,
            concrete: Vec::new(),
            decluttered: decluttered.clone(),
            executor,
            outputs: backend.outputs.clone(),
        }));
    }
    Ok(Loaded {
        backend: Box::new(backend),
        instances,
    })
}

/// Renames nodes whose name is also an input's or an initializer's, or another node's. ONNX
/// keeps node and tensor names apart, but tract names its graph nodes after both, and refuses
/// the model on a clash ("duplicate name for node").
fn distinct_node_names(graph: &mut tract_onnx::pb::GraphProto) {
    use std::collections::HashSet;
    let mut taken: HashSet<String> = graph
        .input
        .iter()
        .map(|i| i.name.clone())
        .chain(graph.initializer.iter().map(|t| t.name.clone()))
        .collect();
    for node in &mut graph.node {
        if node.name.is_empty() {
            continue;
        }
        if taken.contains(&node.name) {
            let mut i = 1;
            while taken.contains(&format!("{}.{i}", node.name)) {
                i += 1;
            }
            node.name = format!("{}.{i}", node.name);
        }
        taken.insert(node.name.clone());
    }
}

/// The specs of `model`'s inputs and outputs.
fn tensors(model: &TypedModel) -> Result<(Vec<TensorSpec>, Vec<TensorSpec>), String> {
    let name = |o: &OutletId| {
        model
            .outlet_label(*o)
            .map_or_else(|| model.node(o.node).name.clone(), str::to_string)
    };
    let text = |e: TractError| format!("{e:#}");
    let mut inputs = Vec::new();
    for (i, o) in model.input_outlets().map_err(text)?.iter().enumerate() {
        // an input's node is named after the graph input
        let n = model.node(o.node).name.clone();
        inputs.push(spec("input", &n, model.input_fact(i).map_err(text)?)?);
    }
    let mut outputs = Vec::new();
    for (i, o) in model.output_outlets().map_err(text)?.iter().enumerate() {
        outputs.push(spec(
            "output",
            &name(o),
            model.output_fact(i).map_err(text)?,
        )?);
    }
    if inputs.is_empty() {
        return Err("the model has no inputs".into());
    }
    Ok((inputs, outputs))
}
