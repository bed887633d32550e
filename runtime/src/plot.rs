//! The loss curve of a run as an SVG (`schedrun --plot loss.svg`).
//!
//! Training loss per step as a line and, when the run computed one, the validation loss at the
//! steps it was computed as a line with a dot at each, over a step axis and a loss axis, with a
//! legend. Drawn with `plotters`' SVG backend (its text is SVG `<text>`, so no fonts are read at
//! build or run time) into a string and written atomically.

use plotters::prelude::*;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot draw the loss curve: {0}")]
    Draw(String),
    #[error("cannot write {}: {error}", path.display())]
    Write {
        path: std::path::PathBuf,
        error: std::io::Error,
    },
}

/// The losses of a run: (step, loss) pairs, steps 1-based and increasing.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossCurve {
    pub train: Vec<(u64, f64)>,
    pub val: Vec<(u64, f64)>,
}

const TRAIN_COLOR: RGBColor = RGBColor(31, 119, 180);
const VAL_COLOR: RGBColor = RGBColor(214, 39, 40);

impl LossCurve {
    /// The curve as an SVG document titled `title`.
    pub fn svg(&self, title: &str) -> Result<String, PlotError> {
        let mut out = String::new();
        self.draw(title, &mut out)
            .map_err(|e| PlotError::Draw(e.to_string()))?;
        Ok(out)
    }

    /// Writes [`LossCurve::svg`] to `path` (atomically: a reader never sees half a file).
    pub fn write(&self, path: &Path, title: &str) -> Result<(), PlotError> {
        let svg = self.svg(title)?;
        sched_ir::files::write_atomically(path, svg.as_bytes()).map_err(|error| PlotError::Write {
            path: path.to_path_buf(),
            error,
        })
    }

    fn draw(&self, title: &str, out: &mut String) -> Result<(), Box<dyn std::error::Error>> {
        let points = || self.train.iter().chain(&self.val);
        let finite = || points().map(|p| p.1).filter(|l| l.is_finite());
        let lo = finite().fold(f64::INFINITY, f64::min);
        let hi = finite().fold(f64::NEG_INFINITY, f64::max);
        let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
        let pad = ((hi - lo) * 0.05).max(1e-3);
        let last = points().map(|p| p.0).max().unwrap_or(1).max(1);
        let first = points().map(|p| p.0).min().unwrap_or(0).min(last - 1);
        {
            let root = SVGBackend::with_string(out, (800, 500)).into_drawing_area();
            root.fill(&WHITE)?;
            let mut chart = ChartBuilder::on(&root)
                .caption(title, ("sans-serif", 22))
                .margin(16)
                .x_label_area_size(48)
                .y_label_area_size(64)
                .build_cartesian_2d(first..last, (lo - pad)..(hi + pad))?;
            chart
                .configure_mesh()
                .x_desc("step")
                .y_desc("loss (nats per token)")
                .axis_desc_style(("sans-serif", 16))
                .label_style(("sans-serif", 13))
                .light_line_style(WHITE.mix(0.0))
                .draw()?;
            chart
                .draw_series(LineSeries::new(
                    self.train.iter().copied(),
                    TRAIN_COLOR.stroke_width(2),
                ))?
                .label("training loss")
                .legend(|(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], TRAIN_COLOR.stroke_width(2))
                });
            if !self.val.is_empty() {
                chart
                    .draw_series(
                        LineSeries::new(self.val.iter().copied(), VAL_COLOR.stroke_width(2))
                            .point_size(3),
                    )?
                    .label("validation loss")
                    .legend(|(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], VAL_COLOR.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.9))
                .border_style(BLACK)
                .label_font(("sans-serif", 14))
                .draw()?;
            root.present()?;
        }
        Ok(())
    }
}
