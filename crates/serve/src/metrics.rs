//! Per model-version counters, rendered in Prometheus' text format under Triton's
//! `nv_inference_*` names where one fits (success / failure counts, inference and execution
//! counts, cumulative request, queue and compute microseconds, pending requests) and `cohort_*`
//! names for what Triton does not export by default (a histogram of executed batch sizes,
//! generated tokens). Counters are atomics updated on the hot path without locks; a version's
//! counters outlive its unloading so that they never go backwards. This module never decides
//! what is counted when; the batcher and front ends call it.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Upper bounds of the batch-size histogram's buckets (rows per execution).
const BATCH_BUCKETS: [u64; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// Why a request failed, Triton's `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Refused before queueing: the queue was full or the version was going away.
    Rejected,
    /// The request itself was invalid.
    Invalid,
    /// The model failed executing it.
    Backend,
}

/// The counters of one model version.
#[derive(Debug, Default)]
pub struct VersionMetrics {
    success: AtomicU64,
    fail_rejected: AtomicU64,
    fail_invalid: AtomicU64,
    fail_backend: AtomicU64,
    /// Rows inferred (Triton counts each batch element).
    inference_count: AtomicU64,
    /// Executions (batches).
    exec_count: AtomicU64,
    request_us: AtomicU64,
    queue_us: AtomicU64,
    compute_us: AtomicU64,
    pending: AtomicI64,
    batch_buckets: [AtomicU64; BATCH_BUCKETS.len()],
    batch_sum: AtomicU64,
    generated_tokens: AtomicU64,
}

impl VersionMetrics {
    pub(crate) fn success(&self, total: Duration) {
        self.success.fetch_add(1, Relaxed);
        self.request_us.fetch_add(total.as_micros() as u64, Relaxed);
    }

    pub(crate) fn failure(&self, why: Failure, total: Duration) {
        let c = match why {
            Failure::Rejected => &self.fail_rejected,
            Failure::Invalid => &self.fail_invalid,
            Failure::Backend => &self.fail_backend,
        };
        c.fetch_add(1, Relaxed);
        self.request_us.fetch_add(total.as_micros() as u64, Relaxed);
    }

    pub(crate) fn enqueued(&self) {
        self.pending.fetch_add(1, Relaxed);
    }

    /// A request counted by `enqueued` was refused after all.
    pub(crate) fn unqueued(&self) {
        self.pending.fetch_sub(1, Relaxed);
    }

    /// A request left the queue after waiting `waited`.
    pub(crate) fn dequeued(&self, waited: Duration) {
        self.pending.fetch_sub(1, Relaxed);
        self.queue_us.fetch_add(waited.as_micros() as u64, Relaxed);
    }

    /// One execution of `rows` rows that took `compute`.
    pub(crate) fn executed(&self, rows: usize, compute: Duration) {
        self.exec_count.fetch_add(1, Relaxed);
        self.inference_count.fetch_add(rows as u64, Relaxed);
        self.compute_us
            .fetch_add(compute.as_micros() as u64, Relaxed);
        self.batch_sum.fetch_add(rows as u64, Relaxed);
        for (b, c) in BATCH_BUCKETS.iter().zip(&self.batch_buckets) {
            if rows as u64 <= *b {
                c.fetch_add(1, Relaxed);
            }
        }
    }

    pub(crate) fn generated(&self, tokens: usize) {
        self.generated_tokens.fetch_add(tokens as u64, Relaxed);
    }

    /// (executions, rows) so far: their ratio is the mean batch size.
    pub fn batches(&self) -> (u64, u64) {
        (
            self.exec_count.load(Relaxed),
            self.inference_count.load(Relaxed),
        )
    }
}

/// Every version's counters, by (model, version).
#[derive(Debug, Default)]
pub struct Metrics {
    versions: Mutex<BTreeMap<(String, u64), Arc<VersionMetrics>>>,
}

impl Metrics {
    /// The counters of `model` version `version` (created at first use, kept forever).
    pub fn version(&self, model: &str, version: u64) -> Arc<VersionMetrics> {
        let mut map = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        map.entry((model.to_string(), version)).or_default().clone()
    }

    /// Everything in Prometheus' text exposition format.
    pub fn render(&self) -> String {
        let map = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        // lines(name, labels, counters) renders one version's samples of a family
        type Lines<'a> = &'a dyn Fn(&str, &str, &VersionMetrics) -> String;
        let mut family = |name: &str, kind: &str, help: &str, lines: Lines<'_>| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for ((m, v), vm) in map.iter() {
                let labels = format!("model=\"{}\",version=\"{v}\"", escape(m));
                out.push_str(&lines(name, &labels, vm));
            }
        };
        fn sample(n: &str, l: &str, value: impl std::fmt::Display) -> String {
            format!("{n}{{{l}}} {value}\n")
        }
        family(
            "nv_inference_request_success",
            "counter",
            "Number of successful inference requests, all batch sizes",
            &|n, l, vm| sample(n, l, vm.success.load(Relaxed)),
        );
        family(
            "nv_inference_request_failure",
            "counter",
            "Number of failed inference requests, all batch sizes",
            &|n, l, vm| {
                [
                    ("REJECTED", &vm.fail_rejected),
                    ("OTHER", &vm.fail_invalid),
                    ("BACKEND", &vm.fail_backend),
                ]
                .iter()
                .map(|(r, c)| sample(n, &format!("{l},reason=\"{r}\""), c.load(Relaxed)))
                .collect()
            },
        );
        family(
            "nv_inference_count",
            "counter",
            "Number of inferences performed (each batch row counts)",
            &|n, l, vm| sample(n, l, vm.inference_count.load(Relaxed)),
        );
        family(
            "nv_inference_exec_count",
            "counter",
            "Number of model executions performed (each batch counts once)",
            &|n, l, vm| sample(n, l, vm.exec_count.load(Relaxed)),
        );
        family(
            "nv_inference_request_duration_us",
            "counter",
            "Cumulative inference request duration in microseconds (queue and compute included)",
            &|n, l, vm| sample(n, l, vm.request_us.load(Relaxed)),
        );
        family(
            "nv_inference_queue_duration_us",
            "counter",
            "Cumulative inference queuing duration in microseconds",
            &|n, l, vm| sample(n, l, vm.queue_us.load(Relaxed)),
        );
        family(
            "nv_inference_compute_infer_duration_us",
            "counter",
            "Cumulative compute inference duration in microseconds",
            &|n, l, vm| sample(n, l, vm.compute_us.load(Relaxed)),
        );
        family(
            "nv_inference_pending_request_count",
            "gauge",
            "Instantaneous number of pending requests awaiting execution",
            &|n, l, vm| sample(n, l, vm.pending.load(Relaxed).max(0)),
        );
        family(
            "cohort_inference_batch_size",
            "histogram",
            "Rows per model execution",
            &|n, l, vm| {
                let mut s = String::new();
                for (b, c) in BATCH_BUCKETS.iter().zip(&vm.batch_buckets) {
                    s += &sample(
                        &format!("{n}_bucket"),
                        &format!("{l},le=\"{b}\""),
                        c.load(Relaxed),
                    );
                }
                let count = vm.exec_count.load(Relaxed);
                s += &sample(&format!("{n}_bucket"), &format!("{l},le=\"+Inf\""), count);
                s += &sample(&format!("{n}_sum"), l, vm.batch_sum.load(Relaxed));
                s += &sample(&format!("{n}_count"), l, count);
                s
            },
        );
        family(
            "cohort_generate_tokens",
            "counter",
            "Tokens produced by the generate endpoints",
            &|n, l, vm| sample(n, l, vm.generated_tokens.load(Relaxed)),
        );
        out
    }
}

/// Prometheus label-value escaping.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_triton_names_with_model_and_version_labels() {
        let m = Metrics::default();
        let v = m.version("gpt", 2);
        v.enqueued();
        v.dequeued(Duration::from_micros(30));
        v.executed(3, Duration::from_micros(500));
        v.executed(8, Duration::from_micros(900));
        v.success(Duration::from_micros(1000));
        v.failure(Failure::Rejected, Duration::ZERO);
        m.version("a\"b", 1);
        let text = m.render();
        for want in [
            "# TYPE nv_inference_request_success counter",
            "nv_inference_request_success{model=\"gpt\",version=\"2\"} 1",
            "nv_inference_request_failure{model=\"gpt\",version=\"2\",reason=\"REJECTED\"} 1",
            "nv_inference_request_failure{model=\"gpt\",version=\"2\",reason=\"OTHER\"} 0",
            "nv_inference_count{model=\"gpt\",version=\"2\"} 11",
            "nv_inference_exec_count{model=\"gpt\",version=\"2\"} 2",
            "nv_inference_queue_duration_us{model=\"gpt\",version=\"2\"} 30",
            "nv_inference_compute_infer_duration_us{model=\"gpt\",version=\"2\"} 1400",
            "nv_inference_pending_request_count{model=\"gpt\",version=\"2\"} 0",
            "cohort_inference_batch_size_bucket{model=\"gpt\",version=\"2\",le=\"2\"} 0",
            "cohort_inference_batch_size_bucket{model=\"gpt\",version=\"2\",le=\"4\"} 1",
            "cohort_inference_batch_size_bucket{model=\"gpt\",version=\"2\",le=\"8\"} 2",
            "cohort_inference_batch_size_bucket{model=\"gpt\",version=\"2\",le=\"+Inf\"} 2",
            "cohort_inference_batch_size_sum{model=\"gpt\",version=\"2\"} 11",
            "nv_inference_count{model=\"a\\\"b\",version=\"1\"} 0",
        ] {
            assert!(text.contains(want), "{want:?} missing from\n{text}");
        }
        assert_eq!(v.batches(), (2, 11));
    }
}
