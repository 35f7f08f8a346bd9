//! Per model-version counters, kept for two readers: Prometheus' text format under Triton's
//! `nv_inference_*` names where one fits (success / failure counts, inference and execution
//! counts, cumulative request, queue and compute-phase microseconds, pending requests) and
//! `cohort_*` names for what Triton does not export by default (a histogram of executed batch
//! sizes, generated tokens), plus the process host's `nv_cpu_*` gauges read from /proc; and
//! Triton's statistics extension (`ModelStatistics`: per-version counts and nanoseconds, per
//! batch size). Counters are atomics updated on the hot path without locks, except the
//! per-batch-size table, locked once per execution. A version's counters live while it is
//! loaded; unloading it removes its series, as Triton does. This module never decides what is
//! counted when; the batcher and front ends call it.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde_json::{json, Value};

use crate::proto;

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
    /// The client went away or its deadline passed before the answer.
    Cancelled,
}

/// How long the three compute phases of one execution took, as Triton splits them: gathering
/// the requests' inputs into one batch, the model itself, and cutting each request's outputs
/// out of the batch's.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ComputeTimes {
    pub input: Duration,
    pub infer: Duration,
    pub output: Duration,
}

/// A count and a cumulative duration.
#[derive(Debug, Default)]
struct Timed {
    count: AtomicU64,
    ns: AtomicU64,
}

impl Timed {
    fn add(&self, n: u64, d: Duration) {
        self.count.fetch_add(n, Relaxed);
        self.ns.fetch_add(n * d.as_nanos() as u64, Relaxed);
    }
    fn us(&self) -> u64 {
        self.ns.load(Relaxed) / 1000
    }
    fn proto(&self) -> proto::StatisticDuration {
        proto::StatisticDuration {
            count: self.count.load(Relaxed),
            ns: self.ns.load(Relaxed),
        }
    }
}

/// Executions of one batch size: (count, ns) of each compute phase.
#[derive(Debug, Default, Clone, Copy)]
struct BatchStat {
    count: u64,
    input_ns: u64,
    infer_ns: u64,
    output_ns: u64,
}

/// The counters of one model version.
#[derive(Debug, Default)]
pub struct VersionMetrics {
    success: Timed,
    fail_rejected: AtomicU64,
    fail_invalid: AtomicU64,
    fail_backend: AtomicU64,
    fail_cancelled: AtomicU64,
    /// Failed requests and their cumulative duration.
    fail: Timed,
    /// Rows inferred (Triton counts each batch element).
    inference_count: AtomicU64,
    /// Executions (batches).
    exec_count: AtomicU64,
    queue: Timed,
    /// Compute phases per request: each request of a batch is charged the batch's time.
    compute_input: Timed,
    compute_infer: Timed,
    compute_output: Timed,
    /// Milliseconds since the Unix epoch of the last execution.
    last_inference_ms: AtomicU64,
    pending: AtomicI64,
    batch_buckets: [AtomicU64; BATCH_BUCKETS.len()],
    batch_sum: AtomicU64,
    by_batch_size: Mutex<BTreeMap<u64, BatchStat>>,
    generated_tokens: AtomicU64,
    /// Batched decode steps run, and the generations they advanced (their ratio is the mean
    /// in-flight batch).
    decode_steps: AtomicU64,
    decode_rows: AtomicU64,
}

impl VersionMetrics {
    pub(crate) fn success(&self, total: Duration) {
        self.success.add(1, total);
    }

    pub(crate) fn failure(&self, why: Failure, total: Duration) {
        let c = match why {
            Failure::Rejected => &self.fail_rejected,
            Failure::Invalid => &self.fail_invalid,
            Failure::Backend => &self.fail_backend,
            Failure::Cancelled => &self.fail_cancelled,
        };
        c.fetch_add(1, Relaxed);
        self.fail.add(1, total);
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
        self.queue.add(1, waited);
    }

    /// One execution of `rows` rows for `requests` requests, whose phases took `t`.
    pub(crate) fn executed(&self, rows: usize, requests: usize, t: ComputeTimes) {
        let (rows, requests) = (rows as u64, requests as u64);
        self.exec_count.fetch_add(1, Relaxed);
        self.inference_count.fetch_add(rows, Relaxed);
        self.compute_input.add(requests, t.input);
        self.compute_infer.add(requests, t.infer);
        self.compute_output.add(requests, t.output);
        self.batch_sum.fetch_add(rows, Relaxed);
        for (b, c) in BATCH_BUCKETS.iter().zip(&self.batch_buckets) {
            if rows <= *b {
                c.fetch_add(1, Relaxed);
            }
        }
        {
            let mut by = self.by_batch_size.lock().unwrap_or_else(|e| e.into_inner());
            let s = by.entry(rows).or_default();
            s.count += 1;
            s.input_ns += t.input.as_nanos() as u64;
            s.infer_ns += t.infer.as_nanos() as u64;
            s.output_ns += t.output.as_nanos() as u64;
        }
        let now_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.last_inference_ms.fetch_max(now_ms, Relaxed);
    }

    pub(crate) fn generated(&self, tokens: usize) {
        self.generated_tokens.fetch_add(tokens as u64, Relaxed);
    }

    /// One decode step that advanced `rows` generations together.
    pub(crate) fn decode_step(&self, rows: usize) {
        self.decode_steps.fetch_add(1, Relaxed);
        self.decode_rows.fetch_add(rows as u64, Relaxed);
    }

    /// (decode steps, generations advanced) so far under in-flight batching: their ratio is
    /// the mean number of generations sharing a step.
    pub fn decode_steps(&self) -> (u64, u64) {
        (
            self.decode_steps.load(Relaxed),
            self.decode_rows.load(Relaxed),
        )
    }

    /// (executions, rows) so far: their ratio is the mean batch size.
    pub fn batches(&self) -> (u64, u64) {
        (
            self.exec_count.load(Relaxed),
            self.inference_count.load(Relaxed),
        )
    }

    /// Tokens generated so far (cancelled generations count what they produced).
    pub fn generated_tokens(&self) -> u64 {
        self.generated_tokens.load(Relaxed)
    }

    /// Triton's `ModelStatistics` of this version.
    pub(crate) fn statistics(&self, model: &str, version: u64) -> proto::ModelStatistics {
        let by = self.by_batch_size.lock().unwrap_or_else(|e| e.into_inner());
        let d = |count, ns| Some(proto::StatisticDuration { count, ns });
        proto::ModelStatistics {
            name: model.to_string(),
            version: version.to_string(),
            last_inference: self.last_inference_ms.load(Relaxed),
            inference_count: self.inference_count.load(Relaxed),
            execution_count: self.exec_count.load(Relaxed),
            inference_stats: Some(proto::InferStatistics {
                success: Some(self.success.proto()),
                fail: Some(self.fail.proto()),
                queue: Some(self.queue.proto()),
                compute_input: Some(self.compute_input.proto()),
                compute_infer: Some(self.compute_infer.proto()),
                compute_output: Some(self.compute_output.proto()),
                // no response cache: zero, as Triton reports without one
                cache_hit: Some(Default::default()),
                cache_miss: Some(Default::default()),
            }),
            batch_stats: by
                .iter()
                .map(|(&size, s)| proto::InferBatchStatistics {
                    batch_size: size,
                    compute_input: d(s.count, s.input_ns),
                    compute_infer: d(s.count, s.infer_ns),
                    compute_output: d(s.count, s.output_ns),
                })
                .collect(),
        }
    }
}

/// Triton's HTTP statistics JSON of `stats`: the gRPC message's fields, by the same names.
pub(crate) fn statistics_json(stats: &[proto::ModelStatistics]) -> Value {
    let d = |x: &Option<proto::StatisticDuration>| {
        let x = x.unwrap_or_default();
        json!({"count": x.count, "ns": x.ns})
    };
    let models: Vec<Value> = stats
        .iter()
        .map(|m| {
            let i = m.inference_stats.unwrap_or_default();
            json!({
                "name": m.name,
                "version": m.version,
                "last_inference": m.last_inference,
                "inference_count": m.inference_count,
                "execution_count": m.execution_count,
                "inference_stats": {
                    "success": d(&i.success),
                    "fail": d(&i.fail),
                    "queue": d(&i.queue),
                    "compute_input": d(&i.compute_input),
                    "compute_infer": d(&i.compute_infer),
                    "compute_output": d(&i.compute_output),
                    "cache_hit": d(&i.cache_hit),
                    "cache_miss": d(&i.cache_miss),
                },
                "batch_stats": m.batch_stats.iter().map(|b| json!({
                    "batch_size": b.batch_size,
                    "compute_input": d(&b.compute_input),
                    "compute_infer": d(&b.compute_infer),
                    "compute_output": d(&b.compute_output),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "model_stats": models })
}

/// Every version's counters, by (model, version), and what the host gauges need.
#[derive(Debug, Default)]
pub struct Metrics {
    versions: Mutex<BTreeMap<(String, u64), Arc<VersionMetrics>>>,
    /// /proc/stat's (busy, total) jiffies at the previous render: utilization is the change.
    cpu_prev: Mutex<Option<(u64, u64)>>,
}

impl Metrics {
    /// The counters of `model` version `version` (created at first use, kept until removed).
    pub fn version(&self, model: &str, version: u64) -> Arc<VersionMetrics> {
        let mut map = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        map.entry((model.to_string(), version)).or_default().clone()
    }

    /// Drops the series of `model` version `version` (it was unloaded). Requests still
    /// finishing on it count into the dropped counters, which nobody renders any more.
    pub(crate) fn remove(&self, model: &str, version: u64) {
        let mut map = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&(model.to_string(), version));
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
            &|n, l, vm| sample(n, l, vm.success.count.load(Relaxed)),
        );
        family(
            "nv_inference_request_failure",
            "counter",
            "Number of failed inference requests, all batch sizes",
            &|n, l, vm| {
                [
                    ("REJECTED", &vm.fail_rejected),
                    ("CANCELED", &vm.fail_cancelled),
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
            &|n, l, vm| sample(n, l, vm.success.us() + vm.fail.us()),
        );
        family(
            "nv_inference_queue_duration_us",
            "counter",
            "Cumulative inference queuing duration in microseconds",
            &|n, l, vm| sample(n, l, vm.queue.us()),
        );
        family(
            "nv_inference_compute_input_duration_us",
            "counter",
            "Cumulative compute input duration in microseconds",
            &|n, l, vm| sample(n, l, vm.compute_input.us()),
        );
        family(
            "nv_inference_compute_infer_duration_us",
            "counter",
            "Cumulative compute inference duration in microseconds",
            &|n, l, vm| sample(n, l, vm.compute_infer.us()),
        );
        family(
            "nv_inference_compute_output_duration_us",
            "counter",
            "Cumulative inference compute output duration in microseconds",
            &|n, l, vm| sample(n, l, vm.compute_output.us()),
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
        family(
            "cohort_generate_decode_steps",
            "counter",
            "Batched decode steps of in-flight generation",
            &|n, l, vm| sample(n, l, vm.decode_steps.load(Relaxed)),
        );
        family(
            "cohort_generate_decode_rows",
            "counter",
            "Generations advanced by those steps (rows / steps: the mean in-flight batch)",
            &|n, l, vm| sample(n, l, vm.decode_rows.load(Relaxed)),
        );
        drop(map);
        self.render_host(&mut out);
        out
    }

    /// Triton's CPU gauges, from /proc (left out where /proc cannot be read).
    fn render_host(&self, out: &mut String) {
        if let Some((busy, total)) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| cpu_jiffies(&s))
        {
            let mut prev = self.cpu_prev.lock().unwrap_or_else(|e| e.into_inner());
            // since the previous scrape; the first one sees the average since boot
            let (b0, t0) = prev.unwrap_or((0, 0));
            let util = if total > t0 {
                busy.saturating_sub(b0) as f64 / (total - t0) as f64
            } else {
                0.0
            };
            *prev = Some((busy, total));
            let _ = writeln!(
                out,
                "# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]\n\
                 # TYPE nv_cpu_utilization gauge\nnv_cpu_utilization {util}"
            );
        }
        if let Some((total, used)) = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| memory_bytes(&s))
        {
            let _ = writeln!(
                out,
                "# HELP nv_cpu_memory_total_bytes CPU total memory (RAM), in bytes\n\
                 # TYPE nv_cpu_memory_total_bytes gauge\nnv_cpu_memory_total_bytes {total}\n\
                 # HELP nv_cpu_memory_used_bytes CPU used memory (RAM), in bytes\n\
                 # TYPE nv_cpu_memory_used_bytes gauge\nnv_cpu_memory_used_bytes {used}"
            );
        }
    }
}

/// (busy, total) jiffies of /proc/stat's aggregate `cpu` line; idle and iowait are not busy.
fn cpu_jiffies(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 4 {
        return None;
    }
    // user nice system idle iowait irq softirq steal [guest guest_nice, already in user/nice]
    let total: u64 = v.iter().take(8).sum();
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// (total, used) bytes from /proc/meminfo: used is MemTotal - MemAvailable, as Triton reports.
fn memory_bytes(meminfo: &str) -> Option<(u64, u64)> {
    let kb = |key: &str| -> Option<u64> {
        let line = meminfo.lines().find(|l| l.starts_with(key))?;
        line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    };
    let total = kb("MemTotal:")? * 1024;
    let available = kb("MemAvailable:")? * 1024;
    Some((total, total.saturating_sub(available)))
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

    fn phases(input: u64, infer: u64, output: u64) -> ComputeTimes {
        ComputeTimes {
            input: Duration::from_micros(input),
            infer: Duration::from_micros(infer),
            output: Duration::from_micros(output),
        }
    }

    #[test]
    fn renders_triton_names_with_model_and_version_labels() {
        let m = Metrics::default();
        let v = m.version("gpt", 2);
        v.enqueued();
        v.dequeued(Duration::from_micros(30));
        // 3 rows for 2 requests, then 8 rows for 1 request
        v.executed(3, 2, phases(10, 500, 20));
        v.executed(8, 1, phases(5, 900, 7));
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
            // each request is charged its batch's time: 2 * 500 + 900
            "nv_inference_compute_infer_duration_us{model=\"gpt\",version=\"2\"} 1900",
            "nv_inference_compute_input_duration_us{model=\"gpt\",version=\"2\"} 25",
            "nv_inference_compute_output_duration_us{model=\"gpt\",version=\"2\"} 47",
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
        m.remove("gpt", 2);
        assert!(!m.render().contains("model=\"gpt\""));
    }

    #[test]
    fn statistics_follow_tritons_fields_per_batch_size() {
        let v = VersionMetrics::default();
        v.dequeued(Duration::from_nanos(700));
        v.executed(4, 2, phases(1, 2, 3));
        v.executed(4, 1, phases(1, 2, 3));
        v.executed(1, 1, phases(0, 5, 0));
        v.success(Duration::from_micros(9));
        v.failure(Failure::Cancelled, Duration::from_micros(4));
        let s = v.statistics("m", 3);
        assert_eq!((s.inference_count, s.execution_count), (9, 3));
        assert!(s.last_inference > 1_600_000_000_000, "{}", s.last_inference);
        let j = statistics_json(&[s]);
        let m = &j["model_stats"][0];
        assert_eq!(m["version"], "3");
        let i = &m["inference_stats"];
        assert_eq!(i["success"], json!({"count": 1, "ns": 9000}));
        assert_eq!(i["fail"], json!({"count": 1, "ns": 4000}));
        assert_eq!(i["queue"], json!({"count": 1, "ns": 700}));
        assert_eq!(
            i["compute_infer"],
            json!({"count": 4, "ns": 2 * 2000 + 2000 + 5000})
        );
        assert_eq!(
            m["batch_stats"],
            json!([
                {"batch_size": 1, "compute_input": {"count": 1, "ns": 0},
                 "compute_infer": {"count": 1, "ns": 5000}, "compute_output": {"count": 1, "ns": 0}},
                {"batch_size": 4, "compute_input": {"count": 2, "ns": 2000},
                 "compute_infer": {"count": 2, "ns": 4000}, "compute_output": {"count": 2, "ns": 6000}},
            ])
        );
    }

    #[test]
    fn host_gauges_parse_proc() {
        let stat = "cpu  100 5 50 800 45 0 0 0 0 0\ncpu0 1 2 3 4\n";
        assert_eq!(cpu_jiffies(stat), Some((155, 1000)));
        let meminfo = "MemTotal:       1000 kB\nMemFree:  10 kB\nMemAvailable:    250 kB\n";
        assert_eq!(memory_bytes(meminfo), Some((1_024_000, 768_000)));
        assert_eq!(cpu_jiffies("intr 1 2"), None);
        if std::path::Path::new("/proc/stat").exists() {
            let text = Metrics::default().render();
            let util: f64 = text
                .lines()
                .find_map(|l| l.strip_prefix("nv_cpu_utilization "))
                .expect("nv_cpu_utilization rendered")
                .parse()
                .unwrap();
            assert!((0.0..=1.0).contains(&util), "{util}");
            assert!(text.contains("nv_cpu_memory_total_bytes "));
        }
    }
}
