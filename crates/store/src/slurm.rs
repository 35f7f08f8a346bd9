//! What Slurm tells a task of an `srun` step about its job: rank, world
//! size, local rank, node count, node rank, the first host of the step's
//! node list (Slurm's compressed host-list syntax, `node[01-04,07]`,
//! `a1,b[2-3]`) and a store port derived from the job id, so that `srun
//! cohort train` and `srun cohort run` need no `MASTER_ADDR` set by hand.
//!
//! A task counts as inside an `srun` step when `SLURM_PROCID` and
//! `SLURM_STEP_ID` (or the older `SLURM_STEPID`) are set: a batch script's
//! own shell has `SLURM_PROCID=0` and the job's node list too, but no step,
//! and must not believe it is one rank of many. Step variables
//! (`SLURM_STEP_NODELIST`, `SLURM_STEP_NUM_TASKS`, ...) win over the job's,
//! since a step may run on fewer nodes than the job holds.
//!
//! This module only reads variables through a lookup it is given; it never
//! sets one, and never decides precedence against torchrun's variables or
//! flags (its callers do: those always win).

/// A malformed Slurm variable: its name, its value and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?}: {expected}")]
pub struct SlurmError {
    /// The variable.
    pub name: String,
    /// Its value.
    pub value: String,
    /// What it should have looked like.
    pub expected: String,
}

/// The lowest port [`SlurmTask::master_port`] returns; below Linux's
/// ephemeral range (32768..), so that no outgoing connection holds it.
pub const SLURM_PORT_BASE: u16 = 15000;
/// How many ports the job id is spread over.
pub const SLURM_PORT_SPAN: u64 = 10000;

/// One task of an `srun` step, as its Slurm variables describe it. Each
/// field is `None` when Slurm did not set its variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmTask {
    /// `SLURM_JOB_ID` (or `SLURM_JOBID`).
    pub job_id: Option<u64>,
    /// The task's rank in the step, `SLURM_PROCID`.
    pub rank: usize,
    /// Tasks in the step: `SLURM_STEP_NUM_TASKS`, else `SLURM_NTASKS`.
    pub world_size: Option<usize>,
    /// The task's rank on its node, `SLURM_LOCALID`.
    pub local_rank: Option<usize>,
    /// Tasks on this node: this node's entry of `SLURM_STEP_TASKS_PER_NODE`
    /// (else `SLURM_TASKS_PER_NODE`), e.g. `2(x3),1`.
    pub local_world_size: Option<usize>,
    /// Nodes in the step: `SLURM_STEP_NUM_NODES`, else `SLURM_NNODES`, else
    /// `SLURM_JOB_NUM_NODES`.
    pub nnodes: Option<usize>,
    /// This node's rank in the step, `SLURM_NODEID`.
    pub node_rank: Option<usize>,
    /// The first host of the node list and the variable it came from
    /// (`SLURM_STEP_NODELIST`, `SLURM_JOB_NODELIST`, `SLURM_NODELIST`).
    pub first_host: Option<(String, &'static str)>,
}

impl SlurmTask {
    /// The task described by the process's environment, `None` outside an
    /// `srun` step.
    pub fn from_process_env() -> Result<Option<SlurmTask>, SlurmError> {
        SlurmTask::from_env(|name| std::env::var(name).ok())
    }

    /// The task described by `lookup`, `None` outside an `srun` step (no
    /// `SLURM_PROCID`, or no step id); a malformed value is an error naming it.
    pub fn from_env(
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<SlurmTask>, SlurmError> {
        let first = |names: &[&'static str]| {
            names
                .iter()
                .find_map(|&n| lookup(n).filter(|v| !v.trim().is_empty()).map(|v| (n, v)))
        };
        let num = |names: &[&'static str]| -> Result<Option<usize>, SlurmError> {
            first(names)
                .map(|(n, v)| parse_num(n, &v, "a non-negative integer"))
                .transpose()
        };
        let in_step = first(&["SLURM_STEP_ID", "SLURM_STEPID"]).is_some();
        let Some(rank) = num(&["SLURM_PROCID"])? else {
            return Ok(None);
        };
        if !in_step {
            return Ok(None);
        }
        let job_id = first(&["SLURM_JOB_ID", "SLURM_JOBID"])
            .map(|(n, v)| parse_num::<u64>(n, &v, "a job id (an integer)"))
            .transpose()?;
        let node_rank = num(&["SLURM_NODEID"])?;
        let local_world_size = match first(&["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]) {
            Some((name, value)) => {
                let counts = tasks_per_node(&value).map_err(|expected| SlurmError {
                    name: name.into(),
                    value: value.clone(),
                    expected,
                })?;
                node_rank.and_then(|node| counts.get(node).copied())
            }
            None => None,
        };
        let first_host = match first(&[
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ]) {
            Some((name, value)) => {
                let hosts = expand_hostlist(&value).map_err(|expected| SlurmError {
                    name: name.into(),
                    value: value.clone(),
                    expected,
                })?;
                hosts.into_iter().next().map(|h| (h, name))
            }
            None => None,
        };
        Ok(Some(SlurmTask {
            job_id,
            rank,
            world_size: num(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"])?,
            local_rank: num(&["SLURM_LOCALID"])?,
            local_world_size,
            nnodes: num(&[
                "SLURM_STEP_NUM_NODES",
                "SLURM_NNODES",
                "SLURM_JOB_NUM_NODES",
            ])?,
            node_rank,
            first_host,
        }))
    }

    /// The job's store port: [`SLURM_PORT_BASE`] + job id mod
    /// [`SLURM_PORT_SPAN`], the same on every node of the job and different
    /// for jobs that share a node (unless their ids are 10000 apart).
    pub fn master_port(&self) -> Option<u16> {
        self.job_id.map(port_for_job)
    }

    /// One line saying what was `taken` from Slurm (`from Slurm: rank 3,
    /// world size 4, ..., master address node07 (first host of
    /// SLURM_JOB_NODELIST), port 18456 (from job 123456)`); `None` when
    /// nothing was.
    pub fn note(&self, taken: Taken) -> Option<String> {
        let mut parts = Vec::new();
        let mut push = |on: bool, value: Option<String>| {
            if let (true, Some(v)) = (on, value) {
                parts.push(v);
            }
        };
        push(taken.rank, Some(format!("rank {}", self.rank)));
        push(
            taken.world_size,
            self.world_size.map(|w| format!("world size {w}")),
        );
        push(
            taken.local_rank,
            self.local_rank.map(|r| format!("local rank {r}")),
        );
        push(taken.nnodes, self.nnodes.map(|n| format!("{n} node(s)")));
        push(
            taken.node_rank,
            self.node_rank.map(|n| format!("node rank {n}")),
        );
        push(
            taken.master_addr,
            self.first_host
                .as_ref()
                .map(|(host, var)| format!("master address {host} (first host of {var})")),
        );
        push(
            taken.master_port,
            self.job_id
                .map(|id| format!("port {} (from job {id})", port_for_job(id))),
        );
        (!parts.is_empty()).then(|| format!("from Slurm: {}", parts.join(", ")))
    }
}

/// Which of a task's values a caller took from Slurm, for [`SlurmTask::note`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Taken {
    /// The rank.
    pub rank: bool,
    /// The world size.
    pub world_size: bool,
    /// The local rank.
    pub local_rank: bool,
    /// The node count.
    pub nnodes: bool,
    /// The node rank.
    pub node_rank: bool,
    /// The master address.
    pub master_addr: bool,
    /// The master port.
    pub master_port: bool,
}

/// The store port of Slurm job `job_id` (see [`SlurmTask::master_port`]).
pub fn port_for_job(job_id: u64) -> u16 {
    // The span keeps the sum below 25000, inside u16.
    SLURM_PORT_BASE + (job_id % SLURM_PORT_SPAN) as u16
}

fn parse_num<T: std::str::FromStr>(
    name: &str,
    value: &str,
    expected: &str,
) -> Result<T, SlurmError> {
    value.trim().parse().map_err(|_| SlurmError {
        name: name.into(),
        value: value.into(),
        expected: expected.into(),
    })
}

/// Expands Slurm's compressed host list: `node[01-04,07]` is node01,
/// node02, node03, node04, node07 (zero padding kept), `a1,b[2-3]` is a1,
/// b2, b3; several brackets in one name multiply out (`r[1-2]n[1-2]`). The
/// error says what is wrong with the list.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        if item.is_empty() {
            return Err("an empty host name (two commas in a row?)".into());
        }
        expand_item(item, &mut hosts)?;
    }
    if hosts.is_empty() {
        return Err("no host in the list".into());
    }
    Ok(hosts)
}

/// Splits at the commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("nested '[' at byte {i}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("']' without '[' at byte {i}")),
            ',' if depth == 0 => {
                items.push(list[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a '[' is never closed".into());
    }
    items.push(list[start..].trim());
    Ok(items)
}

/// Appends the hosts of one name with zero or more bracket groups.
fn expand_item(item: &str, hosts: &mut Vec<String>) -> Result<(), String> {
    let Some(open) = item.find('[') else {
        hosts.push(item.to_string());
        return Ok(());
    };
    let close = open + item[open..].find(']').ok_or("a '[' is never closed")?;
    let (prefix, rest) = (&item[..open], &item[close + 1..]);
    for number in expand_ranges(&item[open + 1..close])? {
        expand_item(&format!("{prefix}{number}{rest}"), hosts)?;
    }
    Ok(())
}

/// `01-04,07` as 01, 02, 03, 04, 07: each range keeps the width of its
/// lower bound, as Slurm writes zero-padded names.
fn expand_ranges(ranges: &str) -> Result<Vec<String>, String> {
    /// A bound on one range, so that a typo cannot ask for billions of names.
    const MAX_RANGE: u64 = 1 << 20;
    let mut out = Vec::new();
    for part in ranges.split(',') {
        let part = part.trim();
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(format!("[{ranges}]: {part:?} is not N or N-M"));
        }
        let (a, b): (u64, u64) = (
            lo.parse().map_err(|_| format!("{lo:?} is too large"))?,
            hi.parse().map_err(|_| format!("{hi:?} is too large"))?,
        );
        if b < a || b - a >= MAX_RANGE {
            return Err(format!("[{ranges}]: {part:?} is not an increasing range"));
        }
        let width = lo.len();
        out.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

/// Slurm's tasks per node, `2(x3),1` as [2, 2, 2, 1].
pub fn tasks_per_node(text: &str) -> Result<Vec<usize>, String> {
    let mut counts = Vec::new();
    for part in text.split(',') {
        let part = part.trim();
        let (count, times) = match part.split_once('(') {
            Some((count, rest)) => {
                let times = rest
                    .strip_prefix('x')
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or_else(|| format!("{part:?} is not N or N(xM)"))?;
                (count, times)
            }
            None => (part, "1"),
        };
        let count: usize = count
            .parse()
            .map_err(|_| format!("{part:?} is not N or N(xM)"))?;
        let times: usize = times
            .parse()
            .map_err(|_| format!("{part:?} is not N or N(xM)"))?;
        counts.extend(std::iter::repeat_n(count, times.min(1 << 20)));
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &str) -> Vec<String> {
        expand_hostlist(list).unwrap_or_else(|e| panic!("{list}: {e}"))
    }

    #[test]
    fn host_lists_expand_as_slurm_writes_them() {
        assert_eq!(
            hosts("node[01-04,07]"),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(hosts("a1,b[2-3]"), ["a1", "b2", "b3"]);
        assert_eq!(hosts("gpu17"), ["gpu17"]);
        assert_eq!(hosts("n[9-11]"), ["n9", "n10", "n11"]);
        assert_eq!(hosts("n[008-010]"), ["n008", "n009", "n010"]);
        assert_eq!(hosts("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(
            hosts("x[1,3],y-login,z[05]"),
            ["x1", "x3", "y-login", "z05"]
        );
    }

    #[test]
    fn malformed_host_lists_say_what_is_wrong() {
        for (bad, says) in [
            ("node[01-", "never closed"),
            ("node[4-2]", "increasing"),
            ("node[a-b]", "not N or N-M"),
            ("a,,b", "empty host"),
            ("", "empty host"),
            ("n]", "without '['"),
        ] {
            let err = expand_hostlist(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn tasks_per_node_expands_repeats() {
        assert_eq!(tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(tasks_per_node("4").unwrap(), [4]);
        assert!(tasks_per_node("2(3)").is_err());
    }

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn an_srun_task_reads_its_job() {
        let vars = [
            ("SLURM_PROCID", "3"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_NODELIST", "node[07-08]"),
        ];
        let task = SlurmTask::from_env(env(&vars)).unwrap().unwrap();
        assert_eq!(
            task,
            SlurmTask {
                job_id: Some(123456),
                rank: 3,
                world_size: Some(4),
                local_rank: Some(1),
                local_world_size: Some(2),
                nnodes: Some(2),
                node_rank: Some(1),
                first_host: Some(("node07".into(), "SLURM_JOB_NODELIST")),
            }
        );
        assert_eq!(task.master_port(), Some(15000 + 3456));
        let all = Taken {
            rank: true,
            world_size: true,
            master_addr: true,
            master_port: true,
            ..Taken::default()
        };
        assert_eq!(
            task.note(all).unwrap(),
            "from Slurm: rank 3, world size 4, master address node07 (first host of \
             SLURM_JOB_NODELIST), port 18456 (from job 123456)"
        );
        assert_eq!(task.note(Taken::default()), None);
        // The step's own list wins over the job's.
        let mut with_step = vars.to_vec();
        with_step.push(("SLURM_STEP_NODELIST", "node08"));
        let task = SlurmTask::from_env(env(&with_step)).unwrap().unwrap();
        assert_eq!(task.first_host.unwrap().0, "node08");
    }

    #[test]
    fn a_batch_shell_is_no_task_and_bad_values_are_named() {
        let batch = [("SLURM_PROCID", "0"), ("SLURM_JOB_NODELIST", "n[1-4]")];
        assert_eq!(SlurmTask::from_env(env(&batch)).unwrap(), None);
        assert_eq!(SlurmTask::from_env(env(&[])).unwrap(), None);
        let bad = [
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_NODELIST", "n[1-"),
        ];
        let err = SlurmTask::from_env(env(&bad)).unwrap_err().to_string();
        assert!(err.starts_with("SLURM_JOB_NODELIST=\"n[1-\""), "{err}");
        let bad = [("SLURM_PROCID", "x"), ("SLURM_STEP_ID", "0")];
        let err = SlurmTask::from_env(env(&bad)).unwrap_err().to_string();
        assert!(err.contains("SLURM_PROCID"), "{err}");
    }
}
