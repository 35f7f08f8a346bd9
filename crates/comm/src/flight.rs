//! The flight recorder: each group keeps a ring of its last collectives
//! (op, sequence number, bytes, dtype, state issued / started / completed,
//! the training phase and step they were called from, times), on by
//! default, so that a hang can be explained after the fact: [`verdict`]
//! reads every rank's ring and names the rank that never issued the
//! collective the others wait in, or the ranks that disagree on a
//! collective's op or size.
//!
//! Cost: one uncontended mutex lock and a copy of a small record into a
//! preallocated ring at issue, start and end of each collective (no
//! allocation, no system call): about 200 ns per collective for the three
//! (the ignored test `flight_recorder_cost`, on a shared 2-core machine),
//! against collectives that cost microseconds at least and a config A step
//! of tens of milliseconds. `COHORT_FLIGHT_RECORDER=0` turns it off.
//! The phase and step come from [`set_context`], two relaxed atomic stores
//! the training loop makes at each phase.
//!
//! This module records and explains; it never talks to peers or the store
//! itself (its [`live`] part publishes and gathers rings through the store,
//! off the collectives' path) and never blocks a collective beyond the lock
//! of its own ring.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::element::DType;
use crate::kinds::OpKind;

pub mod live;

/// Records kept per group unless `COHORT_FLIGHT_RECORDER` says otherwise.
pub const DEFAULT_ENTRIES: usize = 2048;

/// The phases [`set_context`] knows; anything else records as "".
pub const PHASES: [&str; 8] = [
    "",
    "forward",
    "backward",
    "optimizer",
    "eval",
    "save",
    "log",
    "init",
];

static PHASE: AtomicUsize = AtomicUsize::new(0);
static DUMP_DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Where the rings are written as JSON when a collective fails
/// (`flight-<group>-rank<N>.json`): the first directory set here, else
/// `COHORT_FLIGHT_DIR`, else nowhere.
pub fn set_dump_dir(dir: impl Into<std::path::PathBuf>) {
    let _ = DUMP_DIR.set(dir.into());
}

/// The directory [`set_dump_dir`] or `COHORT_FLIGHT_DIR` names.
pub fn dump_dir() -> Option<std::path::PathBuf> {
    DUMP_DIR
        .get()
        .cloned()
        .or_else(|| std::env::var_os("COHORT_FLIGHT_DIR").map(Into::into))
}
static STEP: AtomicU64 = AtomicU64::new(0);

/// Says which phase (one of [`PHASES`]) and step this process is in; every
/// collective issued from now on records them.
pub fn set_context(phase: &str, step: u64) {
    let index = PHASES.iter().position(|p| *p == phase).unwrap_or(0);
    PHASE.store(index, Ordering::Relaxed);
    STEP.store(step, Ordering::Relaxed);
}

/// A test hook: `COHORT_TEST_SKIP_ALL_REDUCE=R:N` makes the process that is
/// rank `R` of the calling group skip its `N`-th blocking all-reduce
/// (counting from 0 over the groups where it is rank `R`), as host code
/// that diverged would, so that tests can make a real hang. Read once.
pub(crate) fn skip_this_all_reduce(rank: usize) -> bool {
    static HOOK: std::sync::OnceLock<Option<(usize, u64)>> = std::sync::OnceLock::new();
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let hook = HOOK.get_or_init(|| {
        let v = std::env::var("COHORT_TEST_SKIP_ALL_REDUCE").ok()?;
        let (r, n) = v.split_once(':')?;
        Some((r.trim().parse().ok()?, n.trim().parse().ok()?))
    });
    match hook {
        Some((r, n)) if *r == rank => CALLS.fetch_add(1, Ordering::Relaxed) == *n,
        _ => false,
    }
}

/// Where a collective is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Called, waiting for its turn behind earlier collectives.
    Issued,
    /// On the wire.
    Started,
    /// Finished (well or not).
    Completed,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Issued => "issued",
            State::Started => "started",
            State::Completed => "completed",
        }
    }
}

/// One collective as the recorder saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Record {
    /// Its sequence number in the group.
    pub seq: u64,
    /// The collective.
    pub op: OpKind,
    /// Bytes of this rank's buffer (0 where not recorded).
    pub bytes: u64,
    /// Element type, where it has one.
    pub dtype: Option<DType>,
    /// Where it is.
    pub state: State,
    /// The phase it was issued in (see [`PHASES`]).
    pub phase: &'static str,
    /// The step it was issued at.
    pub step: u64,
    /// Microseconds since the ring was made, when it was issued.
    pub issued_us: u64,
    /// When it started, if it did.
    pub started_us: Option<u64>,
    /// When it completed, if it did.
    pub completed_us: Option<u64>,
}

/// One group's ring on one rank.
#[derive(Debug)]
pub struct Ring {
    records: Mutex<VecDeque<Record>>,
    capacity: usize,
    epoch: Instant,
}

impl Ring {
    /// A ring of `capacity` records (0: records nothing).
    pub fn new(capacity: usize) -> Ring {
        Ring {
            records: Mutex::new(VecDeque::with_capacity(capacity)),
            capacity,
            epoch: Instant::now(),
        }
    }

    /// A ring sized by `COHORT_FLIGHT_RECORDER` (a count; 0 turns it off),
    /// else [`DEFAULT_ENTRIES`].
    pub fn from_env() -> Ring {
        let capacity = std::env::var("COHORT_FLIGHT_RECORDER")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(DEFAULT_ENTRIES);
        Ring::new(capacity)
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Collective `seq` was called.
    pub fn issued(&self, seq: u64, op: OpKind, bytes: u64, dtype: Option<DType>) {
        if self.capacity == 0 {
            return;
        }
        let record = Record {
            seq,
            op,
            bytes,
            dtype,
            state: State::Issued,
            phase: PHASES[PHASE.load(Ordering::Relaxed).min(PHASES.len() - 1)],
            step: STEP.load(Ordering::Relaxed),
            issued_us: self.now_us(),
            started_us: None,
            completed_us: None,
        };
        let mut records = self.records.lock().unwrap_or_else(|e| e.into_inner());
        if records.len() == self.capacity {
            records.pop_front();
        }
        records.push_back(record);
    }

    fn update(&self, seq: u64, f: impl FnOnce(&mut Record, u64)) {
        if self.capacity == 0 {
            return;
        }
        let now = self.now_us();
        let mut records = self.records.lock().unwrap_or_else(|e| e.into_inner());
        // The record is at or near the back: collectives run in issue order.
        if let Some(r) = records.iter_mut().rev().find(|r| r.seq == seq) {
            f(r, now);
        }
    }

    /// Collective `seq` went on the wire.
    pub fn started(&self, seq: u64) {
        self.update(seq, |r, now| {
            r.state = State::Started;
            r.started_us = Some(now);
        });
    }

    /// Collective `seq` ended.
    pub fn completed(&self, seq: u64) {
        self.update(seq, |r, now| {
            r.state = State::Completed;
            r.completed_us = Some(now);
        });
    }

    /// This rank's ring now, oldest first, for `rank`.
    pub fn dump(&self, rank: usize) -> Dump {
        self.tail(rank, usize::MAX)
    }

    /// The newest `n` records of [`Ring::dump`] (a live publication copies only these
    /// under the lock).
    pub fn tail(&self, rank: usize, n: usize) -> Dump {
        let records = self.records.lock().unwrap_or_else(|e| e.into_inner());
        Dump {
            rank,
            now_us: self.now_us(),
            records: records
                .iter()
                .skip(records.len().saturating_sub(n))
                .copied()
                .collect(),
        }
    }

    /// Whether it records anything (`COHORT_FLIGHT_RECORDER=0` turns it off).
    pub fn is_on(&self) -> bool {
        self.capacity > 0
    }
}

/// One rank's ring at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Dump {
    /// The rank.
    pub rank: usize,
    /// When it was taken, on the ring's clock.
    pub now_us: u64,
    /// Its records, oldest first.
    pub records: Vec<Record>,
}

impl Dump {
    /// As JSON (`{"rank":0,"now_us":..,"records":[{"seq":..,"op":"all_reduce",..}]}`).
    pub fn to_json(&self) -> String {
        let mut s = format!(
            "{{\"rank\":{},\"now_us\":{},\"records\":[",
            self.rank, self.now_us
        );
        for (i, r) in self.records.iter().enumerate() {
            let opt = |v: Option<u64>| v.map_or("null".to_string(), |v| v.to_string());
            let _ = write!(
                s,
                "{}{{\"seq\":{},\"op\":\"{}\",\"bytes\":{},\"dtype\":{},\"state\":\"{}\",\
                 \"phase\":\"{}\",\"step\":{},\"issued_us\":{},\"started_us\":{},\
                 \"completed_us\":{}}}",
                if i == 0 { "" } else { "," },
                r.seq,
                r.op.name(),
                r.bytes,
                r.dtype
                    .map_or("null".to_string(), |d| format!("\"{d:?}\"").to_lowercase()),
                r.state.name(),
                r.phase,
                r.step,
                r.issued_us,
                opt(r.started_us),
                opt(r.completed_us),
            );
        }
        s.push_str("]}");
        s
    }

    /// As lines for the store, `now_us` first, then one record a line
    /// (`seq op bytes dtype state phase step issued started completed`,
    /// `-` for none), which [`Dump::from_lines`] reads back.
    pub fn to_lines(&self) -> String {
        let mut s = format!("{}\n", self.now_us);
        let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
        for r in &self.records {
            let _ = writeln!(
                s,
                "{} {} {} {} {} {} {} {} {} {}",
                r.seq,
                r.op.name(),
                r.bytes,
                r.dtype.map_or("-".to_string(), |d| format!("{d:?}")),
                r.state.name(),
                if r.phase.is_empty() { "-" } else { r.phase },
                r.step,
                r.issued_us,
                opt(r.started_us),
                opt(r.completed_us),
            );
        }
        s
    }

    /// Reads [`Dump::to_lines`] back (records it cannot read are left out).
    pub fn from_lines(rank: usize, text: &str) -> Option<Dump> {
        let mut lines = text.lines();
        let now_us = lines.next()?.trim().parse().ok()?;
        let records = lines.filter_map(parse_record).collect();
        Some(Dump {
            rank,
            now_us,
            records,
        })
    }

    /// The oldest collective not completed.
    pub fn pending(&self) -> Option<&Record> {
        self.records.iter().find(|r| r.state != State::Completed)
    }

    fn at(&self, seq: u64) -> Option<&Record> {
        self.records.iter().find(|r| r.seq == seq)
    }

    fn last_before(&self, seq: u64) -> Option<&Record> {
        self.records.iter().rev().find(|r| r.seq < seq)
    }
}

fn parse_record(line: &str) -> Option<Record> {
    let f: Vec<&str> = line.split(' ').collect();
    let [seq, op, bytes, dtype, state, phase, step, issued, started, completed] = f[..] else {
        return None;
    };
    let opt = |v: &str| -> Option<Option<u64>> {
        match v {
            "-" => Some(None),
            v => v.parse().ok().map(Some),
        }
    };
    let dtype = match dtype {
        "-" => None,
        "F32" => Some(DType::F32),
        "F64" => Some(DType::F64),
        "I32" => Some(DType::I32),
        "I64" => Some(DType::I64),
        "U8" => Some(DType::U8),
        "BF16" => Some(DType::BF16),
        _ => return None,
    };
    let state = match state {
        "issued" => State::Issued,
        "started" => State::Started,
        "completed" => State::Completed,
        _ => return None,
    };
    Some(Record {
        seq: seq.parse().ok()?,
        op: OpKind::parse(op)?,
        bytes: bytes.parse().ok()?,
        dtype,
        state,
        phase: PHASES.iter().find(|p| **p == phase).copied().unwrap_or(""),
        step: step.parse().ok()?,
        issued_us: issued.parse().ok()?,
        started_us: opt(started)?,
        completed_us: opt(completed)?,
    })
}

fn where_(r: &Record) -> String {
    match r.phase {
        "" => format!("at step {}", r.step),
        phase => format!("in {phase} at step {}", r.step),
    }
}

fn ranks(list: &[usize]) -> String {
    let names: Vec<String> = list.iter().map(|r| r.to_string()).collect();
    match names.len() {
        1 => format!("rank {}", names[0]),
        _ => format!("ranks {}", names.join(", ")),
    }
}

fn shape(r: &Record) -> String {
    match r.dtype {
        Some(d) => format!("{} #{} of {} B {d:?}", r.op, r.seq, r.bytes),
        None => format!("{} #{}", r.op, r.seq),
    }
}

/// One line explaining a hang of group `group` of `world` ranks from the
/// rings that could be gathered (`dumps`; a rank missing published none):
/// the rank that never issued the collective the others wait in, the ranks
/// whose collective at the same sequence number differs in op or size, or
/// the ranks that sent nothing. `None` when the rings show no collective
/// waiting.
pub fn verdict(group: &str, world: usize, dumps: &[Dump]) -> Option<String> {
    let waiting: Vec<(&Dump, &Record)> = dumps
        .iter()
        .filter_map(|d| d.pending().map(|r| (d, r)))
        .collect();
    let seq = waiting.iter().map(|(_, r)| r.seq).min()?;
    let mut parts = Vec::new();
    // The collective most ranks issued at `seq`: the one the odd rank missed.
    let issued: Vec<(&Dump, &Record)> = dumps
        .iter()
        .filter_map(|d| d.at(seq).map(|r| (d, r)))
        .collect();
    let key = |r: &Record| (r.op, r.bytes, r.dtype);
    let majority = issued
        .iter()
        .max_by_key(|(_, r)| issued.iter().filter(|(_, o)| key(o) == key(r)).count())
        .map(|(_, r)| **r)?;
    let never: Vec<&Dump> = dumps.iter().filter(|d| d.at(seq).is_none()).collect();
    for d in &never {
        let last = d.last_before(seq).map_or("nothing".to_string(), |r| {
            format!("{} #{}, {}", r.op, r.seq, where_(r))
        });
        parts.push(format!(
            "rank {} never issued {} #{seq} of group {group} (its last: {last})",
            d.rank, majority.op
        ));
    }
    let odd: Vec<(&Dump, &Record)> = issued
        .iter()
        .filter(|(_, r)| key(r) != key(&majority))
        .copied()
        .collect();
    if !odd.is_empty() && odd.len() * 2 >= issued.len() {
        // No majority to call the others odd against: list every side.
        let sides: Vec<String> = issued
            .iter()
            .map(|(d, r)| format!("rank {} {}", d.rank, shape(r)))
            .collect();
        parts.push(format!(
            "ranks disagree on collective #{seq} of group {group}: {}",
            sides.join(", ")
        ));
    }
    for (d, r) in odd.iter().filter(|_| odd.len() * 2 < issued.len()) {
        let before = d.last_before(seq).map_or(String::new(), |p| {
            format!("; its previous: {} #{}, {}", p.op, p.seq, where_(p))
        });
        parts.push(format!(
            "rank {} issued {} where the others issued {} (a skipped, extra or reordered \
             collective{before})",
            d.rank,
            shape(r),
            shape(&majority)
        ));
    }
    let published: Vec<usize> = dumps.iter().map(|d| d.rank).collect();
    let silent: Vec<usize> = (0..world).filter(|r| !published.contains(r)).collect();
    if !silent.is_empty() {
        parts.push(format!(
            "{} published no record (dead or unreachable)",
            ranks(&silent)
        ));
    }
    let tie = odd.len() * 2 >= issued.len();
    let stuck: Vec<(&Dump, &Record)> = waiting
        .iter()
        .filter(|(_, r)| r.seq == seq && (tie || key(r) == key(&majority)))
        .copied()
        .collect();
    if !stuck.is_empty() {
        let longest = stuck
            .iter()
            .map(|(d, r)| d.now_us.saturating_sub(r.issued_us))
            .max()
            .unwrap_or(0);
        let who: Vec<usize> = stuck.iter().map(|(d, _)| d.rank).collect();
        parts.push(format!(
            "{} waited in {} #{seq} for {:.1} s",
            ranks(&who),
            majority.op,
            longest as f64 / 1e6
        ));
    }
    Some(parts.join("; "))
}

/// Serialises the tests that set the process-wide phase and step and read
/// them back: tests of one binary run in parallel threads.
#[cfg(test)]
pub(crate) static CONTEXT_TEST_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank `rank` ran `ops` (op, bytes) in order; the last `pending` of
    /// them never completed.
    fn dump(rank: usize, ops: &[(OpKind, u64)], pending: usize) -> Dump {
        let _context = CONTEXT_TEST_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let ring = Ring::new(16);
        for (seq, &(op, bytes)) in ops.iter().enumerate() {
            let seq = seq as u64;
            set_context(if seq == 2 { "eval" } else { "forward" }, 400);
            ring.issued(seq, op, bytes, Some(DType::F32));
            ring.started(seq);
            if (seq as usize) < ops.len() - pending {
                ring.completed(seq);
            }
        }
        ring.dump(rank)
    }

    #[test]
    fn a_rank_that_skipped_a_collective_is_named_with_the_op_and_number() {
        use OpKind::{AllReduce, Broadcast};
        let all = [
            (AllReduce, 16),
            (AllReduce, 16),
            (Broadcast, 8),
            (AllReduce, 16),
        ];
        let dumps = [dump(0, &all, 1), dump(1, &all[..3], 0), dump(2, &all, 1)];
        let line = verdict("0", 3, &dumps).unwrap();
        assert!(
            line.starts_with(
                "rank 1 never issued all_reduce #3 of group 0 (its last: broadcast #2, in eval \
                 at step 400); ranks 0, 2 waited in all_reduce #3 for"
            ),
            "{line}"
        );
        assert!(dumps[0].to_json().contains("\"op\":\"all_reduce\""));
        let back = Dump::from_lines(0, &dumps[0].to_lines()).unwrap();
        assert_eq!(back, dumps[0]);
    }

    #[test]
    fn ranks_that_disagree_on_a_size_are_named() {
        use OpKind::AllReduce;
        let dumps = [
            dump(0, &[(AllReduce, 16), (AllReduce, 64)], 1),
            dump(1, &[(AllReduce, 16), (AllReduce, 32)], 1),
            dump(2, &[(AllReduce, 16), (AllReduce, 64)], 1),
        ];
        let line = verdict("g", 3, &dumps).unwrap();
        assert!(
            line.starts_with("rank 1 issued all_reduce #1 of 32 B F32 where the others issued all_reduce #1 of 64 B F32"),
            "{line}"
        );
        // Two ranks and a dead third: the silent rank is named too.
        let line = verdict("g", 3, &dumps[..2]).unwrap();
        assert!(line.contains("rank 2 published no record"), "{line}");
        assert_eq!(verdict("g", 1, &[dump(0, &[(AllReduce, 4)], 0)]), None);
    }

    /// The recorder's cost per collective (issue, start, completion on a full ring), for
    /// the module doc's figure: `cargo test -p cohort-comm --lib flight_recorder_cost --
    /// --ignored --nocapture`. Ignored: a measurement, not a check.
    #[test]
    #[ignore]
    fn flight_recorder_cost() {
        let ring = Ring::new(DEFAULT_ENTRIES);
        let n = 1_000_000u64;
        let t = Instant::now();
        for seq in 0..n {
            ring.issued(seq, OpKind::AllReduce, 4096, Some(DType::F32));
            ring.started(seq);
            ring.completed(seq);
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        println!("flight recorder: {ns:.0} ns per collective (issued + started + completed)");
        assert_eq!(ring.dump(0).records.len(), DEFAULT_ENTRIES);
    }
}
