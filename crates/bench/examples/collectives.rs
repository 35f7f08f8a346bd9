//! The collectives benchmark without the `cohort` binary: starts N local
//! ranks of itself (spawn::processes) and prints rank 0's table.
//!
//! cargo run --release -p cohort-bench --example collectives -- [WORLD] [MIN_BYTES] [MAX_BYTES] [FACTOR] [--json] [--op NAME]

use cohort_bench::collectives::{self as bench, BenchOptions};
use cohort_comm::spawn::{self, ProcessOptions};
use cohort_comm::{init_process_group, InitOptions, OpKind};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let op = args
        .iter()
        .position(|a| a == "--op")
        .and_then(|i| args.get(i + 1))
        .map(|s| OpKind::parse(s).ok_or(format!("unknown op {s}")))
        .transpose()?
        .unwrap_or(OpKind::AllReduce);
    let nums: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let opts = BenchOptions {
        ops: vec![op],
        min_bytes: nums.get(1).copied().unwrap_or(4096),
        max_bytes: nums.get(2).copied().unwrap_or(64 << 20),
        factor: nums.get(3).copied().unwrap_or(4),
        ..BenchOptions::default()
    };
    if std::env::var("RANK").is_err() {
        let world = nums.first().copied().unwrap_or(2);
        return Ok(spawn::processes(
            world,
            &ProcessOptions::current_exe(args)?,
        )?);
    }
    let pg = init_process_group("tcp", "env://", InitOptions::default())?;
    let lead = pg.rank() == 0;
    if lead && !json {
        println!(
            "{}",
            bench::text_header(pg.size(), &opts, pg.backend_name())
        );
    }
    bench::run(&pg, &opts, |row| {
        if lead {
            println!(
                "{}",
                if json {
                    row.to_json()
                } else {
                    bench::text_row(row)
                }
            );
        }
    })?;
    Ok(())
}
