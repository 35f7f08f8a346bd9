//! Loss curves of training runs as a PNG picture: what `cohort plot DIR...`
//! draws from each run's `metrics.jsonl` (written by `cohort train` in its
//! log directory).
//!
//! The picture has two panels side by side: the loss against the step and
//! against the run's wall-clock time. Each run has its own colour, its
//! training loss a solid line and its validation loss a dashed line with
//! markers; the data's loss floor, when known, is a grey dashed line, and a
//! restart by the launcher a thin vertical line in the run's colour. The
//! legend names each run by its directory. Text is drawn with an embedded
//! font (DejaVu Sans), so the picture needs no fonts on the machine.
//!
//! This crate reads metrics files and writes pictures; it knows nothing of
//! how the runs trained.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use serde_json::Value;

/// The metrics file a run's log directory holds.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlotError {
    /// A directory has no metrics file (neither in it nor in its `logs`).
    #[error(
        "{dir}: no {METRICS_FILE} here or in {dir}/logs (train with --log-dir DIR or --out DIR)"
    )]
    NoMetrics {
        /// The directory.
        dir: PathBuf,
    },
    /// Reading a metrics file failed.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A line of a metrics file is not a JSON object with a step.
    #[error("{path}:{line}: not a metrics line (a JSON object with a \"step\")")]
    BadLine {
        /// The file.
        path: PathBuf,
        /// The line number, from 1.
        line: usize,
    },
    /// A run has no loss to draw.
    #[error("{path}: no train_loss or val_loss in any line")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The picture's size is unusable.
    #[error("picture size {width}x{height}: each side must be 200 to 8000 pixels")]
    Size {
        /// Width asked for.
        width: u32,
        /// Height asked for.
        height: u32,
    },
    /// The picture's file cannot be written (its directory missing, no permission).
    #[error("{path}: cannot write the picture: {source}")]
    Write {
        /// The picture.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Drawing or writing the picture failed.
    #[error("drawing {path}: {detail}")]
    Draw {
        /// The picture.
        path: PathBuf,
        /// What the drawing library said.
        detail: String,
    },
}

/// One point of a run's curves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// The step.
    pub step: u64,
    /// Seconds since the run began (continuing across resumes).
    pub elapsed_s: f64,
    /// The loss.
    pub loss: f64,
}

/// One run's curves.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// The legend's name for it.
    pub label: String,
    /// Training losses, by step.
    pub train: Vec<Point>,
    /// Validation losses, by step.
    pub val: Vec<Point>,
    /// The data's best possible loss, when known.
    pub floor: Option<f64>,
    /// Where the launcher restarted the run, as `(step, elapsed_s)`.
    pub restarts: Vec<(u64, f64)>,
}

/// Reads the run whose log directory (or output directory, holding `logs`)
/// is `dir`, labelled by the directory's name.
pub fn read_run(dir: &Path) -> Result<Run, PlotError> {
    let path = [dir.join(METRICS_FILE), dir.join("logs").join(METRICS_FILE)]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| PlotError::NoMetrics {
            dir: dir.to_path_buf(),
        })?;
    let text = std::fs::read_to_string(&path).map_err(|source| PlotError::Read {
        path: path.clone(),
        source,
    })?;
    let mut run = Run {
        label: label_of(dir),
        train: Vec::new(),
        val: Vec::new(),
        floor: None,
        restarts: Vec::new(),
    };
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = || PlotError::BadLine {
            path: path.clone(),
            line: i + 1,
        };
        let v: Value = serde_json::from_str(line).map_err(|_| bad())?;
        let step = v["step"].as_u64().ok_or_else(bad)?;
        let elapsed_s = v["elapsed_s"].as_f64().unwrap_or(0.0);
        let point = |key: &str| {
            v[key].as_f64().filter(|x| x.is_finite()).map(|loss| Point {
                step,
                elapsed_s,
                loss,
            })
        };
        run.train.extend(point("train_loss"));
        run.val.extend(point("val_loss"));
        if let Some(f) = v["floor"].as_f64() {
            run.floor = Some(f);
        }
        if v["restart"].as_u64().is_some() {
            run.restarts.push((step, elapsed_s));
        }
    }
    if run.train.is_empty() && run.val.is_empty() {
        return Err(PlotError::Empty { path });
    }
    Ok(run)
}

/// The name of the directory a run is in, skipping a trailing `logs`.
fn label_of(dir: &Path) -> String {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
    match name(&dir) {
        Some(n) if n == "logs" => dir.parent().and_then(name).unwrap_or(n),
        Some(n) => n,
        None => dir.display().to_string(),
    }
}

/// Run colours, distinct on white and for most colour blindness (Okabe-Ito).
const COLORS: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
];

/// The colour of run `i`.
pub fn run_color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

const FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// Draws `runs` into a PNG of `width` x `height` pixels at `out`.
pub fn draw(runs: &[Run], out: &Path, width: u32, height: u32) -> Result<(), PlotError> {
    if !(200..=8000).contains(&width) || !(200..=8000).contains(&height) {
        return Err(PlotError::Size { width, height });
    }
    let err = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: out.to_path_buf(),
        detail: e.to_string(),
    };
    // The drawing library reports a file it cannot write as nested Rust values: try the file
    // first, so the error is one line naming it.
    std::fs::File::create(out).map_err(|source| PlotError::Write {
        path: out.to_path_buf(),
        source,
    })?;
    // Registering twice (a second picture in one process) is harmless.
    let _ = register_font("sans-serif", FontStyle::Normal, FONT);
    let root = BitMapBackend::new(out, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(width / 2);
    panel(&left, runs, "loss against steps", "step", |p| p.step as f64).map_err(|e| err(&e))?;
    panel(&right, runs, "loss against wall time", "seconds", |p| {
        p.elapsed_s
    })
    .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// One chart: every run's curves against `x`.
fn panel(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    runs: &[Run],
    title: &str,
    x_label: &str,
    x: impl Fn(&Point) -> f64,
) -> Result<(), Box<dyn std::error::Error>> {
    let points = || runs.iter().flat_map(|r| r.train.iter().chain(&r.val));
    let x_max = points().map(&x).fold(0.0f64, f64::max).max(1e-9);
    let floors = runs.iter().filter_map(|r| r.floor);
    let y_max = points().map(|p| p.loss).fold(f64::MIN, f64::max);
    let y_min = points()
        .map(|p| p.loss)
        .chain(floors)
        .fold(f64::MAX, f64::min);
    let pad = ((y_max - y_min) * 0.05).max(1e-3);
    let (_, h) = area.dim_in_pixel();
    let text = (h / 40).clamp(12, 28);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", text + 4))
        .margin(text / 2 + 4)
        .x_label_area_size(text * 3)
        .y_label_area_size(text * 4)
        .build_cartesian_2d(0.0..x_max * 1.02, (y_min - pad)..(y_max + pad))?;
    let whole = x_label == "step";
    chart
        .configure_mesh()
        .x_label_formatter(&|v| {
            if whole {
                format!("{v:.0}")
            } else {
                format!("{v:.1}")
            }
        })
        .x_desc(x_label)
        .y_desc("loss")
        .label_style(("sans-serif", text))
        .axis_desc_style(("sans-serif", text))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    for (i, run) in runs.iter().enumerate() {
        let color = run_color(i);
        let solid = color.stroke_width(2);
        chart
            .draw_series(LineSeries::new(
                run.train.iter().map(|p| (x(p), p.loss)),
                solid,
            ))?
            .label(format!("{} train", run.label))
            .legend(move |(lx, ly)| PathElement::new([(lx, ly), (lx + 20, ly)], solid));
        if !run.val.is_empty() {
            let dashed = color.stroke_width(2);
            chart
                .draw_series(DashedLineSeries::new(
                    run.val.iter().map(|p| (x(p), p.loss)),
                    8,
                    5,
                    dashed,
                ))?
                .label(format!("{} val", run.label))
                .legend(move |(lx, ly)| Circle::new((lx + 10, ly), 4, color.filled()));
            chart.draw_series(
                run.val
                    .iter()
                    .map(|p| Circle::new((x(p), p.loss), 4, color.filled())),
            )?;
        }
    }
    for (i, run) in runs.iter().enumerate() {
        let thin = run_color(i).stroke_width(1);
        for (k, &(step, elapsed_s)) in run.restarts.iter().enumerate() {
            let at = x(&Point {
                step,
                elapsed_s,
                loss: 0.0,
            });
            let line = chart.draw_series(DashedLineSeries::new(
                [(at, y_min - pad), (at, y_max + pad)],
                3,
                3,
                thin,
            ))?;
            if k == 0 {
                line.label(format!("{} restarted", run.label))
                    .legend(move |(lx, ly)| {
                        PathElement::new([(lx + 10, ly - 6), (lx + 10, ly + 6)], thin)
                    });
            }
        }
    }
    let grey = RGBColor(120, 120, 120).stroke_width(2);
    for floor in runs.iter().filter_map(|r| r.floor).take(1) {
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, floor), (x_max * 1.02, floor)],
                4,
                4,
                grey,
            ))?
            .label(format!("loss floor {floor:.4}"))
            .legend(move |(lx, ly)| PathElement::new([(lx, ly), (lx + 20, ly)], grey));
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", text))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(label: &str, scale: f64, floor: Option<f64>) -> Run {
        let pts = |offset: f64| -> Vec<Point> {
            (1..=10)
                .map(|i| Point {
                    step: i * 10,
                    elapsed_s: i as f64 * 0.5,
                    loss: offset + scale * 4.0 / i as f64,
                })
                .collect()
        };
        Run {
            label: label.into(),
            train: pts(1.0),
            val: pts(1.1).into_iter().step_by(3).collect(),
            floor,
            restarts: vec![(50, 2.5)],
        }
    }

    /// Pixels within a small distance of `c`.
    fn count(img: &image::RgbImage, c: RGBColor) -> usize {
        img.pixels()
            .filter(|p| {
                let d = |a: u8, b: u8| (a as i32 - b as i32).abs();
                d(p[0], c.0) + d(p[1], c.1) + d(p[2], c.2) < 30
            })
            .count()
    }

    #[test]
    fn each_run_gets_its_colour_and_the_floor_is_drawn() {
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("c.png");
        draw(
            &[run("a", 1.0, Some(1.0)), run("b", 0.5, None)],
            &png,
            900,
            420,
        )
        .unwrap();
        let img = image::open(&png).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (900, 420));
        let (a, b) = (count(&img, run_color(0)), count(&img, run_color(1)));
        assert!(a > 500 && b > 500, "run pixels: {a}, {b}");
        assert!(count(&img, RGBColor(120, 120, 120)) > 200, "no floor line");
        // Text was rendered: black pixels beyond the axes' lines.
        assert!(count(&img, BLACK) > 2000, "no text");

        draw(&[run("a", 1.0, None)], &png, 640, 300).unwrap();
        let img = image::open(&png).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (640, 300));
        assert!(count(&img, run_color(0)) > 300);
        assert_eq!(
            count(&img, run_color(1)),
            0,
            "a second run's colour with one run"
        );
    }

    /// r43: a picture that cannot be written is one line naming its path.
    #[test]
    fn a_picture_in_a_missing_directory_is_one_line_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("nonexistent").join("x.png");
        let e = draw(&[run("a", 1.0, None)], &png, 900, 420)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("{}: cannot write the picture: ", png.display())),
            "{e}"
        );
        assert!(!e.contains("IoError") && !e.contains("Os {"), "{e}");
    }

    #[test]
    fn metrics_are_read_from_a_log_or_output_directory_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join("run1").join("logs");
        std::fs::create_dir_all(&logs).unwrap();
        std::fs::write(
            logs.join(METRICS_FILE),
            "{\"step\":5,\"elapsed_s\":1.0,\"train_loss\":3.0}\n\
             {\"step\":10,\"elapsed_s\":2.0,\"train_loss\":2.0,\"val_loss\":2.5,\"floor\":1.0}\n\
             {\"step\":12,\"restart\":1}\n",
        )
        .unwrap();
        let r = read_run(&dir.path().join("run1")).unwrap();
        assert_eq!(r.label, "run1");
        assert_eq!(r.train.len(), 2);
        assert_eq!(
            r.val,
            [Point {
                step: 10,
                elapsed_s: 2.0,
                loss: 2.5
            }]
        );
        assert_eq!(r.floor, Some(1.0));
        assert_eq!(r.restarts, [(12, 0.0)]);
        assert_eq!(read_run(&logs).unwrap().label, "run1");

        let e = read_run(dir.path()).unwrap_err().to_string();
        assert!(e.contains("no metrics.jsonl"), "{e}");
        std::fs::write(logs.join(METRICS_FILE), "{\"step\":1}\nnot json\n").unwrap();
        let e = read_run(&logs).unwrap_err().to_string();
        assert!(
            e.ends_with("metrics.jsonl:2: not a metrics line (a JSON object with a \"step\")"),
            "{e}"
        );
        assert!(draw(&[r], &dir.path().join("x.png"), 10, 300).is_err());
    }
}
