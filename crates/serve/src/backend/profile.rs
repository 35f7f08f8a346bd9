//! Where a model's execution time goes, per operator type: what `cohort bench serve --profile`
//! prints so that a slow operator is visible. A backend that can time its operators (both ONNX
//! runtimes: onnxruntime's own profiler, tract node by node) executes a batch a few times on a
//! private copy of the model and hands each operator's time to a [`Tally`], which sums them per
//! operator type into an [`OpProfile`].
//!
//! Profiling never touches the instances that serve requests (it builds its own session or
//! execution state), so a profile taken while the server runs changes no answer.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

/// One operator type's share of a model's executions.
#[derive(Debug, Clone, Serialize)]
pub struct OpTime {
    /// The operator as the runtime names it: the ONNX operator a tract node was made from
    /// (with the operators tract fused into it), onnxruntime's kernel (`FusedConv` is a `Conv`
    /// with its activation).
    pub op: String,
    /// Nodes of the graph of this type.
    pub nodes: usize,
    /// Evaluations over all the timed runs (a node may take several steps in tract).
    pub calls: usize,
    /// Time in the operator over all the timed runs, ms.
    pub ms: f64,
    /// Share of the time in all operators, 0 to 1.
    pub share: f64,
}

/// A model's operator times over `runs` executions of a batch of `rows`.
#[derive(Debug, Clone, Serialize)]
pub struct OpProfile {
    /// The runtime that executed the model: "onnxruntime" or "tract".
    pub runtime: String,
    /// Rows of the batch executed.
    pub rows: usize,
    /// Timed executions (after an untimed one).
    pub runs: usize,
    /// Mean wall time of one execution, as the runtime's run call takes it, ms.
    pub run_ms: f64,
    /// Mean time inside operators per execution, ms (the rest of `run_ms` is the runtime's
    /// own bookkeeping).
    pub op_ms: f64,
    /// Per operator type, most time first.
    pub ops: Vec<OpTime>,
}

/// Operator times as a runtime reports them, summed per operator type.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// op -> (the nodes seen, calls, seconds)
    by_op: BTreeMap<String, (BTreeSet<String>, usize, f64)>,
    runs: usize,
    run_seconds: f64,
}

impl Tally {
    /// One evaluation of node `node` (a name unique in the graph) of type `op`.
    pub fn node(&mut self, op: &str, node: &str, seconds: f64) {
        let entry = self.by_op.entry(op.to_string()).or_default();
        if !entry.0.contains(node) {
            entry.0.insert(node.to_string());
        }
        entry.1 += 1;
        entry.2 += seconds;
    }

    /// One whole execution of the model.
    pub fn run(&mut self, seconds: f64) {
        self.runs += 1;
        self.run_seconds += seconds;
    }

    /// The profile of what was tallied.
    pub fn finish(self, runtime: &str, rows: usize) -> OpProfile {
        let runs = self.runs.max(1);
        let total: f64 = self.by_op.values().map(|v| v.2).sum();
        let mut ops: Vec<OpTime> = self
            .by_op
            .into_iter()
            .map(|(op, (nodes, calls, seconds))| OpTime {
                op,
                nodes: nodes.len(),
                calls,
                ms: seconds * 1e3,
                share: if total > 0.0 { seconds / total } else { 0.0 },
            })
            .collect();
        ops.sort_by(|a, b| b.ms.total_cmp(&a.ms).then_with(|| a.op.cmp(&b.op)));
        OpProfile {
            runtime: runtime.to_string(),
            rows,
            runs: self.runs,
            run_ms: self.run_seconds * 1e3 / runs as f64,
            op_ms: total * 1e3 / runs as f64,
            ops,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_sum_to_one_and_nodes_are_distinct() {
        let mut t = Tally::default();
        for _ in 0..2 {
            t.node("Conv", "c1", 0.003);
            t.node("Conv", "c2", 0.001);
            t.node("Relu", "r1", 0.0);
            t.run(0.005);
        }
        let p = t.finish("tract", 4);
        assert_eq!(p.ops[0].op, "Conv");
        assert_eq!((p.ops[0].nodes, p.ops[0].calls), (2, 4));
        assert!((p.ops.iter().map(|o| o.share).sum::<f64>() - 1.0).abs() < 1e-12);
        assert!((p.run_ms - 5.0).abs() < 1e-9 && (p.op_ms - 4.0).abs() < 1e-9);
    }
}
