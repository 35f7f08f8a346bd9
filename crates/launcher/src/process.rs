//! Starting one worker process so that it cannot outlive the launcher, and
//! describing how it ended. Each worker leads its own process group, so that
//! a signal reaches every process it started, and asks the kernel to SIGKILL
//! it when the launcher's spawning thread dies (even by SIGKILL). Nothing
//! here waits for a worker; the group does that.

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};

/// Starts `program args` with `vars` added to the inherited environment,
/// stdout and stderr piped, stdin closed, in a new process group, with a
/// parent-death signal.
///
/// The parent-death signal fires when the *thread* that forked the worker
/// exits, so this must be called from a thread that lives as long as the
/// worker (the launcher calls it from the thread that runs `launch`, which
/// returns only after every worker is reaped).
pub(crate) fn spawn(
    program: &Path,
    args: &[OsString],
    vars: &[(&str, String)],
) -> io::Result<Child> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(vars.iter().map(|(k, v)| (k, v)))
        // A worker in its own process group that read the terminal would be
        // stopped by SIGTTIN; workers get no stdin, as under torchrun's agent.
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    set_parent_death_signal(&mut cmd);
    cmd.spawn()
}

#[cfg(target_os = "linux")]
fn set_parent_death_signal(cmd: &mut Command) {
    // SAFETY: getpid has no preconditions.
    let launcher = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (prctl, getppid); it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // The launcher may have died between fork and prctl; then the
            // signal will never come, so give up now.
            if libc::getppid() != launcher {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn set_parent_death_signal(_cmd: &mut Command) {
    // Only Linux has PR_SET_PDEATHSIG; elsewhere a SIGKILLed launcher can
    // leave workers behind (they still stop with it on SIGINT or SIGTERM).
}

/// Sends `signal` to every process in the group that worker `pid` leads.
pub(crate) fn signal_group(pid: u32, signal: i32) {
    // SAFETY: killpg only sends a signal. It is called only for workers not
    // yet reaped, or whose group may still hold their children; a group that
    // is gone gives ESRCH, which is what we want to ignore.
    unsafe {
        libc::killpg(pid as libc::pid_t, signal);
    }
}

/// The exit code of a worker that failed in a way running it again cannot
/// fix (bad settings, missing or unusable input: sysexits' `EX_CONFIG`):
/// the launcher does not restart the workers for it.
pub const EXIT_NOT_RETRYABLE: i32 = 78;

/// The exit code of a worker that saved a checkpoint and stopped because a
/// signal asked it to (SIGUSR1, or SIGTERM under Slurm; sysexits'
/// `EX_TEMPFAIL`, "try again later"): the launcher does not restart the
/// workers for it and exits with it too, so that a requeue script can test
/// `$? -eq 75` and resubmit the same command, which resumes.
pub const EXIT_SAVED_AND_STOPPED: i32 = 75;

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitReason {
    /// It exited with this status code.
    Code(i32),
    /// It was killed by this signal.
    Signal(i32),
    /// It stopped beating for this many seconds (frozen), and the launcher
    /// stopped it.
    Silent(u64),
}

impl ExitReason {
    /// Whether the worker succeeded (exit code 0).
    pub fn success(self) -> bool {
        self == ExitReason::Code(0)
    }

    pub(crate) fn from_status(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => ExitReason::Code(code),
            (None, Some(signal)) => ExitReason::Signal(signal),
            // Neither code nor signal happens only for stopped processes,
            // which `wait` does not report.
            (None, None) => ExitReason::Code(-1),
        }
    }
}

impl fmt::Display for ExitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ExitReason::Code(code) => write!(f, "exit code {code}"),
            ExitReason::Signal(signal) => write!(f, "signal {signal} ({})", signal_name(signal)),
            ExitReason::Silent(secs) => write!(
                f,
                "no heartbeat for {secs} s (stopped or frozen; --worker-timeout)"
            ),
        }
    }
}

/// The conventional name of a signal number, as `kill -l` prints it.
pub fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return format!("SIG{signal}"),
    };
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_reasons_read_like_a_shell() {
        assert_eq!(ExitReason::Code(3).to_string(), "exit code 3");
        assert_eq!(ExitReason::Signal(9).to_string(), "signal 9 (SIGKILL)");
        assert_eq!(signal_name(libc::SIGTERM), "SIGTERM");
        assert_eq!(signal_name(77), "SIG77");
        assert!(ExitReason::Code(0).success() && !ExitReason::Signal(15).success());
    }

    #[test]
    fn a_worker_leads_its_own_process_group() {
        let mut child = spawn(Path::new("sh"), &["-c".into(), "exit 0".into()], &[]).unwrap();
        let pid = child.id() as libc::pid_t;
        // SAFETY: getpgid only reads; the child is not reaped yet.
        let pgid = unsafe { libc::getpgid(pid) };
        let status = child.wait().unwrap();
        assert_eq!(pgid, pid);
        assert_eq!(ExitReason::from_status(status), ExitReason::Code(0));
    }

    #[test]
    fn a_signalled_worker_reports_the_signal() {
        let mut child = spawn(Path::new("sleep"), &["30".into()], &[]).unwrap();
        signal_group(child.id(), libc::SIGKILL);
        let reason = ExitReason::from_status(child.wait().unwrap());
        assert_eq!(reason, ExitReason::Signal(libc::SIGKILL));
    }
}
