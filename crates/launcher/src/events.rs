//! What the launcher's loop waits for: a signal asking the launcher to stop,
//! one to pass on to the workers (SIGUSR1), or a child that exited (SIGCHLD), delivered through one channel so the
//! loop sleeps until something happens instead of polling. Signal handlers
//! only write to a pipe (signal-hook); everything else runs on normal threads.

use std::io;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use signal_hook::consts::signal::{SIGCHLD, SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1};
use signal_hook::iterator::{Handle, Signals};

/// Something the launcher must react to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// A child changed state: time to reap.
    ChildExited,
    /// The launcher was asked to stop by this signal.
    Stop(i32),
    /// A signal for the workers, not the launcher (SIGUSR1, Slurm's "time
    /// is nearly up": a cohort worker saves at its next step and stops).
    Forward(i32),
}

/// The launcher's signal subscription and the channel its events arrive on.
pub(crate) struct Events {
    rx: Receiver<Event>,
    handle: Handle,
    thread: Option<JoinHandle<()>>,
}

impl Events {
    /// Subscribes to SIGCHLD, to the signals torchrun's agent handles
    /// (SIGINT, SIGTERM, SIGHUP, SIGQUIT) and to SIGUSR1, which it forwards.
    /// From here until the process exits, those no longer kill the process:
    /// this launcher decides.
    pub fn install() -> io::Result<Self> {
        let mut signals = Signals::new([SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1])?;
        let handle = signals.handle();
        let (tx, rx) = mpsc::channel();
        let thread = thread::Builder::new()
            .name("launcher signals".into())
            .spawn(move || {
                for signal in signals.forever() {
                    let event = match signal {
                        SIGCHLD => Event::ChildExited,
                        SIGUSR1 => Event::Forward(SIGUSR1),
                        other => Event::Stop(other),
                    };
                    if tx.send(event).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Events {
            rx,
            handle,
            thread: Some(thread),
        })
    }

    /// The next event, or `None` after `timeout`.
    pub fn next(&self, timeout: Duration) -> Option<Event> {
        match self.rx.recv_timeout(timeout) {
            Ok(event) => Some(event),
            Err(RecvTimeoutError::Timeout) => None,
            // The signal thread never ends while `self` lives.
            Err(RecvTimeoutError::Disconnected) => None,
        }
    }

    /// A stop signal that arrived since the last call, without waiting.
    pub fn pending_stop(&self) -> Option<i32> {
        self.rx.try_iter().find_map(|event| match event {
            Event::Stop(signal) => Some(signal),
            Event::ChildExited | Event::Forward(_) => None,
        })
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        self.handle.close();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
