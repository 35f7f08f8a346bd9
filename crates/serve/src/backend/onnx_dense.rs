//! ONNX `Gemm` nodes whose B is a constant (a dense layer's weights), run on cohort-engine's
//! sgemm with B packed once at load ([`PackedMatrix`]) instead of by tract.
//!
//! tract's matrix products on this kind of layer ran at about half of onnxruntime's speed (a
//! batch-1 MLP request spent most of its time there); the engine's kernel reads each packed
//! weight once per product. The replacement happens as tract turns the parsed model into its
//! typed graph: this module registers its own `Gemm` in place of tract-onnx's (private there),
//! which wires [`EngineDense`] for the cases it supports (FP32, `transA = 0`, B a constant
//! matrix, C absent or a constant broadcast along rows, any alpha, beta and `transB`) and
//! wires everything else exactly as tract-onnx's own `Gemm` does. tract still plans and runs
//! the graph and every other operator.
//!
//! This module never changes what a model computes beyond floating-point rounding (the
//! products sum in another order, and alpha is folded into the weights), and never reads
//! anything but the graph it is given.

use std::sync::Arc;

use cohort_engine::cpu::{packed_matmul_forward, PackedMatrix};
use tract_onnx::model::ParsingContext;
use tract_onnx::pb::NodeProto;
use tract_onnx::tract_hir::internal::*;
use tract_onnx::tract_hir::ops as hir_ops;
use tract_onnx::tract_hir::tract_core::ops::einsum::EinSum;
use tract_onnx::Onnx;

/// Makes `onnx` parse `Gemm` nodes into [`Gemm`], which runs constant-weight layers on the
/// engine.
pub(crate) fn register(onnx: &mut Onnx) {
    onnx.op_register.insert("Gemm", gemm);
}

/// The ONNX builder of `Gemm`: its attributes, with ONNX's defaults.
fn gemm(
    _ctx: &ParsingContext,
    node: &NodeProto,
) -> TractResult<(Box<dyn InferenceOp>, Vec<String>)> {
    let alpha = node.get_attr_opt("alpha")?.unwrap_or(1.);
    let beta = node.get_attr_opt("beta")?.unwrap_or(1.);
    let trans_a = node.get_attr_opt("transA")?.unwrap_or(false);
    let trans_b = node.get_attr_opt("transB")?.unwrap_or(false);
    Ok((
        expand(Gemm {
            alpha,
            beta,
            trans_a,
            trans_b,
        }),
        vec![],
    ))
}

/// ONNX's `Gemm`: Y = alpha · A' · B' + beta · C, A' and B' transposed as the attributes say.
#[derive(Debug, Clone)]
pub(crate) struct Gemm {
    alpha: f32,
    beta: f32,
    trans_a: bool,
    trans_b: bool,
}

impl Expansion for Gemm {
    fn name(&self) -> StaticName {
        "Gemm".into()
    }

    // The same rules as tract-onnx's Gemm.
    fn rules<'r, 'p: 'r, 's: 'r>(
        &'s self,
        s: &mut Solver<'r>,
        inputs: &'p [TensorProxy],
        outputs: &'p [TensorProxy],
    ) -> InferenceResult {
        if inputs.len() < 2 {
            bail!(
                "Wrong input number. Rules expect at least 2, node has {}.",
                inputs.len()
            );
        }
        if inputs.len() == 3 {
            s.equals(&inputs[2].datum_type, &outputs[0].datum_type)?;
        }
        s.equals(&inputs[0].rank, 2)?;
        s.equals(&inputs[1].rank, 2)?;
        check_output_arity(outputs, 1)?;
        s.equals(&outputs[0].rank, 2)?;
        s.equals(&inputs[0].datum_type, &outputs[0].datum_type)?;
        s.equals(&inputs[1].datum_type, &outputs[0].datum_type)?;
        let (ca, ra) = if self.trans_a { (0, 1) } else { (1, 0) };
        let (cb, rb) = if self.trans_b { (0, 1) } else { (1, 0) };
        s.equals(&inputs[0].shape[ra], &outputs[0].shape[0])?;
        s.equals(&inputs[0].shape[ca], &inputs[1].shape[rb])?;
        s.equals(&inputs[1].shape[cb], &outputs[0].shape[1])?;
        Ok(())
    }

    fn wire(
        &self,
        name: &str,
        model: &mut TypedModel,
        inputs: &[OutletId],
    ) -> TractResult<TVec<OutletId>> {
        if let Some(dense) = self.dense(model, inputs)? {
            return model.wire_node(name, dense, &[inputs[0]]);
        }
        // What tract-onnx's Gemm wires: an EinSum, times alpha, plus beta times C.
        let (a, b, c) = (inputs[0], inputs[1], inputs.get(2));
        let axes = AxesMapping::for_numpy_matmul(2, self.trans_a, self.trans_b, false)?;
        let mut wire = model.wire_node(
            format!("{name}.ab"),
            EinSum::new(axes, model.outlet_fact(a)?.datum_type),
            [a, b].as_ref(),
        )?[0];
        if self.alpha != 1.0 {
            let alpha = tensor0(self.alpha).broadcast_into_rank(model.outlet_fact(wire)?.rank())?;
            let alpha = model.add_const(name.to_string() + ".alpha_ab.cst", alpha)?;
            wire = model.wire_node(
                name.to_string() + ".alpha_ab",
                hir_ops::math::mul(),
                &[alpha, wire],
            )?[0];
        }
        if let (true, Some(&c)) = (self.beta != 0.0, c) {
            let mut c = c;
            while model.outlet_fact(wire)?.rank() > model.outlet_fact(c)?.rank() {
                c = model.wire_node(
                    format!("{}.c_add_axis_{}", name, model.outlet_fact(c)?.rank()),
                    AxisOp::Add(0),
                    &[c],
                )?[0];
            }
            let beta = tensor0(self.beta).broadcast_into_rank(model.outlet_fact(wire)?.rank())?;
            let beta = model.add_const(name.to_string() + ".beta_c.cst", beta)?;
            let beta_c = model.wire_node(
                name.to_string() + ".beta_c",
                hir_ops::math::mul(),
                &[beta, c],
            )?[0];
            wire = model.wire_node(name, hir_ops::math::add(), &[wire, beta_c])?[0];
        }
        Ok(tvec!(wire))
    }
}

/// A constant's floats, when it is an f32 tensor held in plain memory.
fn f32_values(t: &Tensor) -> Option<Vec<f32>> {
    let view = t.try_as_plain_ram().ok()?;
    view.as_slice::<f32>().ok().map(<[f32]>::to_vec)
}

impl Gemm {
    /// The engine op computing this node, if it is a case the engine runs: FP32, A not
    /// transposed, B a constant matrix, C absent, unused (beta = 0) or a constant of N, 1 x N
    /// or one element.
    fn dense(&self, model: &TypedModel, inputs: &[OutletId]) -> TractResult<Option<EngineDense>> {
        if self.trans_a || inputs.len() < 2 {
            return Ok(None);
        }
        let a = model.outlet_fact(inputs[0])?;
        let b = model.outlet_fact(inputs[1])?;
        if a.datum_type != f32::datum_type() || a.rank() != 2 || b.datum_type != f32::datum_type() {
            return Ok(None);
        }
        let Some(w) = b.konst.as_ref().filter(|w| w.rank() == 2) else {
            return Ok(None);
        };
        let (k, n) = if self.trans_b {
            (w.shape()[1], w.shape()[0])
        } else {
            (w.shape()[0], w.shape()[1])
        };
        if a.shape[1].to_usize().ok() != Some(k) {
            return Ok(None);
        }
        let Some(values) = f32_values(w) else {
            return Ok(None);
        };
        let bias = match inputs.get(2) {
            Some(&c) if self.beta != 0.0 => {
                let c = model.outlet_fact(c)?;
                let Some(c) = c
                    .konst
                    .as_ref()
                    .filter(|_| c.datum_type == f32::datum_type())
                else {
                    return Ok(None);
                };
                let Some(cv) = f32_values(c) else {
                    return Ok(None);
                };
                let row: Vec<f32> = match (c.shape(), cv.len()) {
                    (_, 1) if c.rank() <= 2 => vec![cv[0]; n],
                    ([len], _) | ([1, len], _) if *len == n => cv,
                    _ => return Ok(None),
                };
                Some(Arc::new(row.into_iter().map(|x| self.beta * x).collect()))
            }
            _ => None,
        };
        let scaled: Vec<f32> = if self.alpha == 1.0 {
            values
        } else {
            values.into_iter().map(|x| self.alpha * x).collect()
        };
        Ok(Some(EngineDense {
            w: Arc::new(PackedMatrix::new(&scaled, k, n, self.trans_b)),
            bias,
        }))
    }
}

/// Y (M, N) = X (M, K) · W (K, N) + bias (N) on the engine, W packed at load. On the tract
/// executor's pool when the plan runs in a multi-threaded scope, else on the calling thread.
#[derive(Debug, Clone)]
pub(crate) struct EngineDense {
    w: Arc<PackedMatrix>,
    bias: Option<Arc<Vec<f32>>>,
}

impl EngineDense {
    /// The op's name in tract's graph (and its dumps).
    const NAME: &'static str = "CohortEngineDense";
}

// tract compares ops to merge identical nodes: two are the same only if they share weights.
impl PartialEq for EngineDense {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.w, &other.w)
            && match (&self.bias, &other.bias) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            }
    }
}
impl Eq for EngineDense {}

impl Op for EngineDense {
    fn name(&self) -> StaticName {
        EngineDense::NAME.into()
    }

    fn info(&self) -> TractResult<Vec<String>> {
        Ok(vec![format!(
            "K={} N={} bias={}",
            self.w.k(),
            self.w.n(),
            self.bias.is_some()
        )])
    }

    op_as_typed_op!();
}

impl EvalOp for EngineDense {
    op_out_of_plan!();

    fn eval(&self, _ctx: &EvalContext, inputs: TVec<TValue>) -> TractResult<TVec<TValue>> {
        let x = args_1!(inputs);
        let (k, n) = (self.w.k(), self.w.n());
        let &[m, xk] = x.shape() else {
            bail!("dense layer input has shape {:?}, not a matrix", x.shape());
        };
        ensure!(
            xk == k,
            "dense layer input has {xk} columns, its weights {k} rows"
        );
        let view = x.try_as_plain_ram()?;
        let inp = view.as_slice::<f32>()?;
        // SAFETY: every element of the output is written by packed_matmul_forward below
        // before the tensor is read.
        let mut y = unsafe { Tensor::uninitialized::<f32>(&[m, n])? };
        {
            let mut out_view = y.try_as_plain_ram_mut()?;
            let out = out_view.as_slice_mut::<f32>()?;
            let bias = self.bias.as_ref().map(|b| b.as_slice());
            let mut run = || packed_matmul_forward(out, inp, &self.w, bias, m);
            match tract_linalg::multithread::current_tract_executor() {
                // within the instance's pool, the engine splits the product over its threads
                tract_linalg::multithread::Executor::MultiThread(pool) => pool.install(run),
                _ => run(),
            }
        }
        Ok(tvec!(y.into_tvalue()))
    }
}

impl TypedOp for EngineDense {
    fn output_facts(&self, inputs: &[&TypedFact]) -> TractResult<TVec<TypedFact>> {
        let x = inputs[0];
        ensure!(
            x.datum_type == f32::datum_type() && x.rank() == 2,
            "dense layer input is {:?}, not an f32 matrix",
            x
        );
        Ok(tvec!(f32::fact([x.shape[0].clone(), self.w.n().into()])))
    }

    as_op!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_onnx::pb;
    use tract_onnx::prelude::{Framework, InferenceModelExt, TypedSimplePlan, TypedSimpleState};

    /// Deterministic values in [-1, 1).
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn initializer(name: &str, dims: &[usize], seed: u64) -> pb::TensorProto {
        pb::TensorProto {
            name: name.into(),
            dims: dims.iter().map(|&d| d as i64).collect(),
            data_type: 1, // FLOAT
            float_data: values(dims.iter().product(), seed),
            ..Default::default()
        }
    }

    fn float_attr(name: &str, f: f32) -> pb::AttributeProto {
        pb::AttributeProto {
            name: name.into(),
            r#type: pb::attribute_proto::AttributeType::Float as i32,
            f,
            ..Default::default()
        }
    }

    fn int_attr(name: &str, i: i64) -> pb::AttributeProto {
        pb::AttributeProto {
            name: name.into(),
            r#type: pb::attribute_proto::AttributeType::Int as i32,
            i,
            ..Default::default()
        }
    }

    /// One case: a Gemm of X (M, K) with a constant B (K x N, or N x K with transB) and C.
    struct Case {
        k: usize,
        n: usize,
        trans_a: bool,
        trans_b: bool,
        alpha: f32,
        beta: f32,
        bias: Option<Vec<usize>>,
    }

    impl Case {
        /// X's dimensions for `m` rows.
        fn x_dims(&self, m: usize) -> [usize; 2] {
            if self.trans_a {
                [self.k, m]
            } else {
                [m, self.k]
            }
        }

        fn model(&self, m: usize) -> pb::ModelProto {
            use pb::tensor_shape_proto::{dimension, Dimension};
            let dim = self
                .x_dims(m)
                .iter()
                .map(|&d| Dimension {
                    value: Some(dimension::Value::DimValue(d as i64)),
                    ..Default::default()
                })
                .collect();
            let x_type = pb::TypeProto {
                value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                    elem_type: pb::tensor_proto::DataType::Float as i32,
                    shape: Some(pb::TensorShapeProto { dim }),
                })),
                ..Default::default()
            };
            let (k, n) = (self.k, self.n);
            let w_dims = if self.trans_b { [n, k] } else { [k, n] };
            let mut inits = vec![initializer("w", &w_dims, 2)];
            let mut inputs = vec!["x".to_string(), "w".to_string()];
            if let Some(dims) = &self.bias {
                inits.push(initializer("c", dims, 3));
                inputs.push("c".into());
            }
            let node = pb::NodeProto {
                name: "fc".into(),
                op_type: "Gemm".into(),
                input: inputs,
                output: vec!["y".into()],
                attribute: vec![
                    float_attr("alpha", self.alpha),
                    float_attr("beta", self.beta),
                    int_attr("transA", self.trans_a as i64),
                    int_attr("transB", self.trans_b as i64),
                ],
                ..Default::default()
            };
            let graph = pb::GraphProto {
                name: "gemm".into(),
                node: vec![node],
                initializer: inits,
                input: vec![pb::ValueInfoProto {
                    name: "x".into(),
                    r#type: Some(x_type),
                    ..Default::default()
                }],
                output: vec![pb::ValueInfoProto {
                    name: "y".into(),
                    ..Default::default()
                }],
                ..Default::default()
            };
            pb::ModelProto {
                ir_version: 8,
                opset_import: vec![pb::OperatorSetIdProto {
                    domain: String::new(),
                    version: 13,
                }],
                graph: Some(graph),
                ..Default::default()
            }
        }

        /// Y for `m` rows, and whether the engine computed it.
        fn run(&self, onnx: &Onnx, m: usize) -> (Vec<f32>, bool) {
            let x_dims = self.x_dims(m);
            let model = onnx
                .model_for_proto_model(&self.model(m))
                .and_then(|model| model.into_optimized())
                .expect("the model optimizes");
            let engine = model
                .nodes()
                .iter()
                .any(|node| node.op.name() == EngineDense::NAME);
            let x = Tensor::from_shape(&x_dims, &values(m * self.k, 1)).expect("x");
            let plan = TypedSimplePlan::new(model).expect("plan");
            let mut state = TypedSimpleState::new(&plan).expect("state");
            let y = state.run(tvec!(x.into_tvalue())).expect("runs");
            let y = y[0].try_as_plain_ram().expect("plain");
            (y.as_slice::<f32>().expect("f32").to_vec(), engine)
        }
    }

    #[test]
    fn engine_gemm_matches_tract_and_runs_only_what_it_supports() {
        let mut ours = tract_onnx::onnx();
        register(&mut ours);
        let stock = tract_onnx::onnx();
        let case = |k, n, trans_b, alpha, beta, bias: Option<&[usize]>| Case {
            k,
            n,
            trans_a: false,
            trans_b,
            alpha,
            beta,
            bias: bias.map(<[usize]>::to_vec),
        };
        let mut cases = vec![];
        for trans_b in [false, true] {
            cases.push(case(70, 45, trans_b, 1.0, 1.0, Some(&[45])));
            cases.push(case(300, 33, trans_b, 0.5, 2.0, Some(&[1, 33])));
            cases.push(case(16, 64, trans_b, 1.0, 1.0, None));
            cases.push(case(40, 10, trans_b, 1.5, 0.0, Some(&[10])));
            cases.push(case(40, 10, trans_b, 1.0, -1.0, Some(&[1])));
        }
        for case in &cases {
            for m in [1, 5, 32] {
                let (want, tract_engine) = case.run(&stock, m);
                let (got, engine) = case.run(&ours, m);
                assert!(!tract_engine && engine, "the engine runs this Gemm");
                assert_eq!(got.len(), want.len());
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "K={} N={} transB={} M={m}: element {i}: {g} against tract's {w}",
                        case.k,
                        case.n,
                        case.trans_b
                    );
                }
            }
        }
        // A transposed A, and a C that varies along rows, stay with tract (and still agree).
        let mut left = case(20, 12, false, 1.0, 1.0, Some(&[12]));
        left.trans_a = true;
        let rows = case(20, 12, true, 1.0, 1.0, Some(&[3, 12]));
        for (case, m) in [(&left, 4), (&rows, 3)] {
            let (want, _) = case.run(&stock, m);
            let (got, engine) = case.run(&ours, m);
            assert!(!engine, "tract runs this Gemm");
            assert_eq!(got, want);
        }
    }
}
