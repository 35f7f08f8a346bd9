//! `cohort plot`: the loss curves of one or more training runs as a PNG. Wiring only: read
//! each run's metrics with cohort-plot and draw them.

use std::path::PathBuf;

use anyhow::Context;

/// Draw the loss curves (train and validation, against steps and wall time) of training runs.
#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// The runs: their log directories (--log-dir) or output directories (--out, whose logs/
    /// is read); each is labelled by its directory's name.
    #[arg(required = true, value_name = "DIR")]
    dirs: Vec<PathBuf>,
    /// The picture to write.
    #[arg(short, long, default_value = "curves.png")]
    output: PathBuf,
    /// Width in pixels.
    #[arg(long, default_value_t = 1400)]
    width: u32,
    /// Height in pixels.
    #[arg(long, default_value_t = 560)]
    height: u32,
}

pub fn main(a: PlotArgs) -> anyhow::Result<()> {
    let runs = a
        .dirs
        .iter()
        .map(|d| cohort_plot::read_run(d))
        .collect::<Result<Vec<_>, _>>()
        .context("cohort plot")?;
    cohort_plot::draw(&runs, &a.output, a.width, a.height).context("cohort plot")?;
    println!(
        "wrote {} ({} run(s), {}x{})",
        a.output.display(),
        runs.len(),
        a.width,
        a.height
    );
    Ok(())
}
