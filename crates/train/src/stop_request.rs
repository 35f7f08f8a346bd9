//! A request to save and stop, from a signal: SIGUSR1 (Slurm's "time is
//! nearly up", `sbatch --signal=USR1@90`) and, when asked, SIGTERM (what
//! Slurm sends at the time limit or on preemption). The signal handler only
//! stores the signal's number in an atomic (signal-hook); the training loop
//! reads it at each step boundary, agrees with the other ranks (the flag
//! rides on the step's existing non-finite check all-reduce, so all ranks
//! stop after the same step), saves and ends with
//! [`TrainError::Stopped`](crate::TrainError::Stopped). A second SIGTERM
//! ends the process at once (exit 143), for a rank stuck where no step
//! boundary comes. This module never saves or exits by itself otherwise.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use signal_hook::consts::signal::{SIGTERM, SIGUSR1};

/// The signal that asked to stop (0: none yet).
fn requested_signal() -> &'static Arc<AtomicUsize> {
    static SIGNAL: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    SIGNAL.get_or_init(|| Arc::new(AtomicUsize::new(0)))
}

/// From here on, SIGUSR1 (and SIGTERM when `sigterm`) no longer end the
/// process: they ask the training loop to save at the next step boundary and
/// stop. Idempotent enough: calling it again registers the handlers again,
/// which store the same value.
pub fn stop_on_signals(sigterm: bool) -> io::Result<()> {
    let flag = requested_signal();
    signal_hook::flag::register_usize(SIGUSR1, Arc::clone(flag), SIGUSR1 as usize)?;
    if sigterm {
        // Handlers run in the order registered: the exit checks whether an
        // earlier SIGTERM already set `seen`, before this one sets it.
        let seen = Arc::new(AtomicBool::new(false));
        signal_hook::flag::register_conditional_shutdown(
            SIGTERM,
            128 + SIGTERM,
            Arc::clone(&seen),
        )?;
        signal_hook::flag::register(SIGTERM, seen)?;
        signal_hook::flag::register_usize(SIGTERM, Arc::clone(flag), SIGTERM as usize)?;
    }
    Ok(())
}

/// The signal that asked this process to save and stop, if one did.
pub(crate) fn requested() -> Option<i32> {
    match requested_signal().load(Ordering::Relaxed) {
        0 => None,
        signal => Some(signal as i32),
    }
}

/// Signal's name for messages (`SIGUSR1`).
pub(crate) fn name(signal: i32) -> String {
    match signal {
        SIGUSR1 => "SIGUSR1".into(),
        SIGTERM => "SIGTERM".into(),
        other => format!("signal {other}"),
    }
}
