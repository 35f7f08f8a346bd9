//! The request queue of one model version and its dynamic batcher, as Triton's: instances
//! (threads, each owning a copy of the model) take work from one bounded queue; with dynamic
//! batching, an instance combines queued inference requests whose inputs have the same shapes
//! beyond the batch dimension (for a GPT, the same sequence length) into one execution of up to
//! `max_batch_size` rows.
//!
//! Batching rule: the oldest request decides the shapes; every queued request of those shapes
//! joins in arrival order until the next would overflow `max_batch_size`. The batch runs
//! at once when it is full (max_batch_size rows, or the largest preferred batch size), else when
//! the oldest request has waited `max_queue_delay`; then, with preferred sizes, it is cut to the
//! largest preferred size it reaches. Without dynamic batching every request runs alone.
//! A generate request goes to an instance in queue order. With in-flight batching (the
//! default) that instance then also takes every queued generate request, wherever it waits,
//! between its decode steps (up to `max_batch_size` in flight; see the `model` module), and
//! takes inference work that is ready between steps without waiting for any.
//!
//! The queue never blocks a caller: a full queue is an immediate [`ServeError::QueueFull`].
//! Closing it lets the instances drain what is queued, then they exit; nothing accepted is
//! dropped. This module never parses requests and never touches the network.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::error::ServeError;
use crate::tensor::{InferResult, Request};

/// An inference request waiting for an instance.
pub(crate) struct InferJob {
    pub input: Request,
    /// The outputs asked for, by index into the model's outputs, in answer order.
    pub want: Vec<usize>,
    pub reply: oneshot::Sender<Result<InferResult, ServeError>>,
    pub enqueued: Instant,
}

/// A generation request waiting for an instance.
pub(crate) struct GenerateJob {
    pub prompt: Vec<u32>,
    pub opts: cohort_gpt::sample::SampleOptions,
    /// Ids that end the generation (the one generated is its last token).
    pub stop: std::sync::Arc<[u32]>,
    /// Each token as it is produced (the receiver may be gone: the client left).
    pub tokens: mpsc::UnboundedSender<u32>,
    /// All generated tokens, or why generation failed.
    pub done: oneshot::Sender<Result<Vec<u32>, ServeError>>,
    pub enqueued: Instant,
}

pub(crate) enum Job {
    Infer(InferJob),
    Generate(GenerateJob),
}

impl Job {
    fn enqueued(&self) -> Instant {
        match self {
            Job::Infer(j) => j.enqueued,
            Job::Generate(j) => j.enqueued,
        }
    }
}

/// What an instance executes next.
pub(crate) enum Work {
    /// Inference requests of the same shapes beyond the batch dimension, in arrival order.
    Infer(Vec<InferJob>),
    Generate(GenerateJob),
}

/// How an instance forms batches.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BatchPolicy {
    pub max_batch_size: usize,
    /// None: no dynamic batching.
    pub dynamic: Option<Dynamic>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Dynamic {
    /// Ascending.
    pub preferred: Vec<usize>,
    pub max_delay: Duration,
}

struct State {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// How long an idle instance keeps checking for new work before it sleeps on the condition
/// variable, and how long a request's task keeps checking for its answer before it awaits it.
///
/// A thread that sleeps has to be woken by another, and on a small (virtual) machine a wake-up
/// costs tens of microseconds before the thread runs again: with one client sending request
/// after request, each request paid for two (the instance woken by the request, the request's
/// async worker woken by the answer), as much as a small model's execution. One round trip
/// from the answer to the client's next request (through both ends' protocol stacks) takes
/// a few hundred microseconds, hence this bound. Both waits yield the CPU between checks
/// ([`std::thread::yield_now`]) rather than spin in place, so that on a busy host they give
/// way to threads with work (measured: spinning in place lost throughput there); after the
/// bound they sleep as before, and an idle server uses no CPU.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(500);

/// The longest a request's task checks for its answer when the model's recent answers took
/// longer than [`SPIN_BEFORE_SLEEP`] (a batch of 32 rows through a small MLP takes about
/// 550 us): checking until just before such an answer and then sleeping paid for the wake-up
/// after all, a quarter of the request's time. Past this bound a wake-up (tens of
/// microseconds) is a few percent of the answer, not worth holding an async worker for.
const MAX_REPLY_SPIN: Duration = Duration::from_millis(2);

/// One model version's bounded request queue.
pub(crate) struct Queue {
    state: Mutex<State>,
    ready: Condvar,
    /// Jobs ever pushed: what an instance checking for work before it sleeps watches.
    pushed: AtomicU64,
    /// A request's task is checking for its answer (see [`Queue::spin_for_reply`]).
    reply_spinning: AtomicBool,
    /// How long recent inference batches took from being taken off the queue to their answers
    /// (a running average, microseconds; 0 before the first): how long
    /// [`Queue::spin_for_reply`] keeps checking.
    answer_us: AtomicU64,
    policy: BatchPolicy,
    capacity: usize,
}

impl Queue {
    pub fn new(policy: BatchPolicy, capacity: usize) -> Queue {
        let mut policy = policy;
        if let Some(d) = &mut policy.dynamic {
            d.preferred.sort_unstable();
            d.preferred.dedup();
        }
        Queue {
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
            pushed: AtomicU64::new(0),
            reply_spinning: AtomicBool::new(false),
            answer_us: AtomicU64::new(0),
            policy,
            capacity: capacity.max(1),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // a panicking instance is caught before it could poison this lock; recover anyway
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `job`, or hands it back with why it was refused (the queue is full or closed).
    pub fn push(&self, job: Job) -> Result<(), (Job, Refused)> {
        let mut st = self.lock();
        if st.closed {
            return Err((job, Refused::Closed));
        }
        if st.jobs.len() >= self.capacity {
            return Err((job, Refused::Full));
        }
        st.jobs.push_back(job);
        self.pushed.fetch_add(1, Ordering::Release);
        drop(st);
        // every waiting instance re-evaluates: one may now have a full batch
        self.ready.notify_all();
        Ok(())
    }

    /// Stops accepting work; instances finish what is queued, then `next` returns None.
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// Blocks until there is work for an instance; None once the queue is closed and empty.
    pub fn next(&self) -> Option<Work> {
        self.next_within(true)
    }

    /// The work that is ready now, without waiting (an instance with generations in flight
    /// asks between decode steps); None when nothing is ready yet.
    pub fn try_next(&self) -> Option<Work> {
        self.next_within(false)
    }

    /// Removes up to `max` queued generation requests, oldest first, from wherever they are in
    /// the queue: they join the generations an instance is already stepping.
    pub fn take_generates(&self, max: usize) -> Vec<GenerateJob> {
        let mut out = Vec::new();
        if max == 0 {
            return out;
        }
        let mut st = self.lock();
        let mut i = 0;
        while i < st.jobs.len() && out.len() < max {
            if matches!(st.jobs[i], Job::Generate(_)) {
                if let Some(Job::Generate(g)) = st.jobs.remove(i) {
                    out.push(g);
                }
            } else {
                i += 1;
            }
        }
        out
    }

    fn next_within(&self, block: bool) -> Option<Work> {
        let mut st = self.lock();
        let mut checked = false;
        loop {
            let Some(front) = st.jobs.front() else {
                if st.closed || !block {
                    return None;
                }
                if !checked {
                    // before sleeping, keep checking a while: the next request usually comes
                    // soon, and then no one has to wake this thread (see SPIN_BEFORE_SLEEP)
                    checked = true;
                    let seen = self.pushed.load(Ordering::Acquire);
                    drop(st);
                    spin_until(SPIN_BEFORE_SLEEP, || {
                        self.pushed.load(Ordering::Acquire) != seen
                    });
                    st = self.lock();
                    continue;
                }
                st = self.ready.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            };
            let key = match front {
                Job::Generate(_) => {
                    let Some(Job::Generate(g)) = st.jobs.pop_front() else {
                        unreachable!("front is a generate job")
                    };
                    return Some(Work::Generate(g));
                }
                Job::Infer(j) => &j.input,
            };
            let Some(dynamic) = &self.policy.dynamic else {
                let Some(Job::Infer(j)) = st.jobs.pop_front() else {
                    unreachable!("front is an infer job")
                };
                return Some(Work::Infer(vec![j]));
            };
            let (picked, rows) = self.gather(&st.jobs, key);
            let full = rows >= self.policy.max_batch_size
                || dynamic.preferred.last().is_some_and(|&p| rows >= p);
            let deadline = front.enqueued() + dynamic.max_delay;
            let now = Instant::now();
            if full || now >= deadline || st.closed {
                let picked = cut_to_preferred(&st.jobs, picked, rows, &dynamic.preferred);
                return Some(Work::Infer(take(&mut st.jobs, &picked)));
            }
            if !block {
                return None;
            }
            st = self
                .ready
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Records that an instance answered a batch `took` after taking it off the queue.
    pub fn answered_after(&self, took: Duration) {
        let took = (took.as_micros() as u64).max(1);
        // a running average over about four batches: one slow batch (a page fault, a
        // preempted thread) barely moves it
        let _ = self
            .answer_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |avg| {
                Some(if avg == 0 { took } else { (3 * avg + took) / 4 })
            });
    }

    /// How long [`Queue::spin_for_reply`] checks: [`SPIN_BEFORE_SLEEP`], or half as long
    /// again as recent answers took where that is longer, up to [`MAX_REPLY_SPIN`]; where
    /// answers take longer than that bound, checking would not reach them, so the bound is
    /// [`SPIN_BEFORE_SLEEP`] again (as for an answer that is late for its model).
    fn reply_spin(&self) -> Duration {
        let expected = Duration::from_micros(self.answer_us.load(Ordering::Relaxed));
        let bound = expected + expected / 2;
        if expected > MAX_REPLY_SPIN {
            SPIN_BEFORE_SLEEP
        } else {
            bound.clamp(SPIN_BEFORE_SLEEP, MAX_REPLY_SPIN)
        }
    }

    /// The answer on `rx` if it comes within [`Queue::reply_spin`], checked without
    /// registering a waker: the caller awaits `rx` only when this returns None. Awaiting at once
    /// would have the instance's answer wake the async worker thread, which has usually gone to
    /// sleep by then. It blocks the calling async worker meanwhile, so only one request of this
    /// queue checks at a time; the others await at once.
    pub fn spin_for_reply<T>(&self, rx: &mut oneshot::Receiver<T>) -> Option<T> {
        if self.reply_spinning.swap(true, Ordering::Acquire) {
            return None;
        }
        let mut answer = None;
        spin_until(self.reply_spin(), || match rx.try_recv() {
            Ok(v) => {
                answer = Some(v);
                true
            }
            Err(oneshot::error::TryRecvError::Empty) => false,
            // the instance dropped the sender: awaiting reports it
            Err(oneshot::error::TryRecvError::Closed) => true,
        });
        self.reply_spinning.store(false, Ordering::Release);
        answer
    }

    /// Indices of the queued inference jobs that can join `key` in one batch (same shapes
    /// beyond the batch dimension) and fit, in order, and their rows.
    fn gather(&self, jobs: &VecDeque<Job>, key: &Request) -> (Vec<usize>, usize) {
        let mut picked = Vec::new();
        let mut rows = 0;
        for (i, job) in jobs.iter().enumerate() {
            if let Job::Infer(j) = job {
                if !j.input.batches_with(key) {
                    continue;
                }
                if rows + j.input.batch > self.policy.max_batch_size {
                    break;
                }
                rows += j.input.batch;
                picked.push(i);
            }
        }
        (picked, rows)
    }
}

/// Checks `done` until it holds or `bound` has passed, yielding the CPU between checks.
fn spin_until(bound: Duration, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + bound;
    while !done() && Instant::now() < until {
        std::thread::yield_now();
    }
}

/// Why a job was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    Full,
    Closed,
}

/// The prefix of `picked` that makes the largest preferred size `rows` reaches (all of it
/// without preferred sizes, or when none is reached).
fn cut_to_preferred(
    jobs: &VecDeque<Job>,
    picked: Vec<usize>,
    rows: usize,
    preferred: &[usize],
) -> Vec<usize> {
    let Some(&target) = preferred.iter().rev().find(|&&p| p <= rows) else {
        return picked;
    };
    let mut acc = 0;
    let mut keep = 0;
    for &i in &picked {
        let Job::Infer(j) = &jobs[i] else { break };
        if acc + j.input.batch > target {
            break;
        }
        acc += j.input.batch;
        keep += 1;
    }
    let mut picked = picked;
    picked.truncate(keep.max(1));
    picked
}

/// Removes the jobs at `picked` (ascending indices, all inference jobs) in order.
fn take(jobs: &mut VecDeque<Job>, picked: &[usize]) -> Vec<InferJob> {
    let mut out = Vec::with_capacity(picked.len());
    for &i in picked.iter().rev() {
        match jobs.remove(i) {
            Some(Job::Infer(j)) => out.push(j),
            _ => unreachable!("picked indices are inference jobs"),
        }
    }
    out.reverse();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;
    use std::sync::Arc;

    fn job(batch: usize, seq: usize) -> (Job, oneshot::Receiver<Result<InferResult, ServeError>>) {
        let (tx, rx) = oneshot::channel();
        let j = Job::Infer(InferJob {
            input: Request {
                batch,
                inputs: vec![Tensor::from_i64(vec![batch, seq], &vec![0; batch * seq])],
            },
            want: vec![0],
            reply: tx,
            enqueued: Instant::now(),
        });
        (j, rx)
    }

    fn sizes(w: Work) -> Vec<(usize, usize)> {
        match w {
            Work::Infer(js) => js
                .iter()
                .map(|j| (j.input.batch, j.input.inputs[0].shape[1]))
                .collect(),
            Work::Generate(_) => panic!("expected inference work"),
        }
    }

    fn queue(max: usize, preferred: &[usize], delay_ms: u64, cap: usize) -> Queue {
        Queue::new(
            BatchPolicy {
                max_batch_size: max,
                dynamic: Some(Dynamic {
                    preferred: preferred.to_vec(),
                    max_delay: Duration::from_millis(delay_ms),
                }),
            },
            cap,
        )
    }

    #[test]
    fn batches_same_length_requests_up_to_max_batch_size() {
        let q = queue(4, &[], 0, 100);
        let mut keep = Vec::new();
        for (b, t) in [(1, 8), (2, 8), (1, 5), (2, 8), (1, 8)] {
            let (j, rx) = job(b, t);
            keep.push(rx);
            assert!(q.push(j).is_ok());
        }
        // 1 + 2 rows of length 8; the next length-8 request (2 rows) would overflow 4
        assert_eq!(sizes(q.next().unwrap()), [(1, 8), (2, 8)]);
        assert_eq!(sizes(q.next().unwrap()), [(1, 5)]);
        assert_eq!(sizes(q.next().unwrap()), [(2, 8), (1, 8)]);
    }

    #[test]
    fn without_dynamic_batching_each_request_runs_alone() {
        let q = Queue::new(
            BatchPolicy {
                max_batch_size: 8,
                dynamic: None,
            },
            10,
        );
        let rxs: Vec<_> = (0..3)
            .map(|_| {
                let (j, rx) = job(1, 4);
                assert!(q.push(j).is_ok());
                rx
            })
            .collect();
        for _ in &rxs {
            assert_eq!(sizes(q.next().unwrap()), [(1, 4)]);
        }
    }

    #[test]
    fn waits_up_to_the_delay_for_a_fuller_batch_then_cuts_to_a_preferred_size() {
        let q = Arc::new(queue(8, &[2, 4], 300, 100));
        let (j, _r0) = job(1, 3);
        let t0 = Instant::now();
        assert!(q.push(j).is_ok());
        let q2 = q.clone();
        let pusher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let rxs: Vec<_> = (0..2)
                .map(|_| {
                    let (j, rx) = job(1, 3);
                    assert!(q2.push(j).is_ok());
                    rx
                })
                .collect();
            rxs
        });
        // 3 rows by the deadline: not the largest preferred size (4), so the batcher waits the
        // whole delay, then cuts to the largest preferred size reached (2)
        let first = sizes(q.next().unwrap());
        let waited = t0.elapsed();
        let _rxs = pusher.join().unwrap();
        assert_eq!(first, [(1, 3), (1, 3)]);
        assert!(waited >= Duration::from_millis(290), "{waited:?}");
        assert_eq!(sizes(q.next().unwrap()), [(1, 3)]);

        // reaching the largest preferred size runs at once, without waiting for the delay, cut
        // to that size
        let rxs: Vec<_> = (0..5)
            .map(|_| {
                let (j, rx) = job(1, 3);
                assert!(q.push(j).is_ok());
                rx
            })
            .collect();
        let t1 = Instant::now();
        assert_eq!(sizes(q.next().unwrap()).len(), 4);
        assert!(t1.elapsed() < Duration::from_millis(200));
        drop(rxs);
    }

    #[test]
    fn a_full_queue_refuses_and_a_closed_queue_drains_then_ends() {
        let q = queue(4, &[], 0, 2);
        let (a, _ra) = job(1, 2);
        let (b, _rb) = job(1, 2);
        let (c, _rc) = job(1, 2);
        assert!(q.push(a).is_ok());
        assert!(q.push(b).is_ok());
        assert!(matches!(q.push(c), Err((_, Refused::Full))));
        q.close();
        let (d, _rd) = job(1, 2);
        assert!(matches!(q.push(d), Err((_, Refused::Closed))));
        assert_eq!(sizes(q.next().unwrap()).len(), 2);
        assert!(q.next().is_none());
    }

    #[test]
    fn a_request_checks_for_its_answer_about_as_long_as_recent_answers_took() {
        let us = Duration::from_micros;
        let q = queue(4, &[], 0, 10);
        assert_eq!(q.reply_spin(), SPIN_BEFORE_SLEEP, "nothing answered yet");
        q.answered_after(us(600));
        assert_eq!(q.reply_spin(), us(900));
        // one slow batch moves the average a quarter of the way: (3 * 600 + 1400) / 4 = 800
        q.answered_after(us(1400));
        assert_eq!(q.reply_spin(), us(1200));
        for _ in 0..40 {
            q.answered_after(us(1800));
        }
        assert_eq!(q.reply_spin(), MAX_REPLY_SPIN, "capped");
        for _ in 0..40 {
            q.answered_after(Duration::from_millis(10));
        }
        assert_eq!(
            q.reply_spin(),
            SPIN_BEFORE_SLEEP,
            "answers past the cap are slept for"
        );
        for _ in 0..40 {
            q.answered_after(us(100));
        }
        assert_eq!(
            q.reply_spin(),
            SPIN_BEFORE_SLEEP,
            "never below the base bound"
        );

        // an answer later than the base bound but within the model's usual time is caught by
        // checking (no waker registered); timing on a busy host varies, so a few tries
        let caught = (0..5).any(|_| {
            let q = queue(4, &[], 0, 10);
            for _ in 0..40 {
                q.answered_after(us(1800));
            }
            let (tx, mut rx) = oneshot::channel::<u32>();
            let sender = std::thread::spawn(move || {
                std::thread::sleep(us(900));
                let _ = tx.send(7);
            });
            let got = q.spin_for_reply(&mut rx);
            sender.join().unwrap();
            got == Some(7)
        });
        assert!(
            caught,
            "an answer at 0.9 ms was never caught within a 2 ms bound"
        );
    }
}
