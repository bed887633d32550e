//! Source files, spans and diagnostics.
//!
//! Every diagnostic the front end emits, syntax or semantic, is a [`Diagnostic`]: a severity, a
//! message, labelled spans (the first primary label is where the error is), and notes such as
//! "did you mean". One rendering path ([`SourceMap::render`]) prints them all in the
//! `file:line:col` form with the source line and the span underlined.

use codespan_reporting::diagnostic as cs;
use codespan_reporting::files::{Error as FilesError, Files};
use codespan_reporting::term;
use codespan_reporting::term::termcolor::{Buffer, WriteColor};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Index of a file in a [`SourceMap`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct FileId(pub u32);

/// A byte range in one source file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Span {
    pub file: FileId,
    pub start: u32,
    pub end: u32,
}

impl Span {
    pub fn new(file: FileId, start: usize, end: usize) -> Self {
        Span {
            file,
            start: start as u32,
            end: end as u32,
        }
    }

    pub fn range(&self) -> Range<usize> {
        self.start as usize..self.end as usize
    }

    /// The smallest span covering both (they must be in the same file).
    pub fn to(self, other: Span) -> Span {
        Span {
            file: self.file,
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    Warning,
    Error,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Label {
    pub span: Span,
    pub message: String,
    pub primary: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    pub severity: Severity,
    pub message: String,
    pub labels: Vec<Label>,
    pub notes: Vec<String>,
}

impl Diagnostic {
    pub fn error(message: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Error,
            message: message.into(),
            labels: vec![],
            notes: vec![],
        }
    }

    pub fn warning(message: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Warning,
            message: message.into(),
            labels: vec![],
            notes: vec![],
        }
    }

    /// Where the problem is. The first primary label decides the `file:line:col` of the report.
    pub fn at(mut self, span: Span, message: impl Into<String>) -> Self {
        self.labels.push(Label {
            span,
            message: message.into(),
            primary: true,
        });
        self
    }

    /// A related place ("first defined here").
    pub fn also(mut self, span: Span, message: impl Into<String>) -> Self {
        self.labels.push(Label {
            span,
            message: message.into(),
            primary: false,
        });
        self
    }

    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.notes.push(note.into());
        self
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }

    /// The span of the first primary label, if any.
    pub fn primary_span(&self) -> Option<Span> {
        self.labels.iter().find(|l| l.primary).map(|l| l.span)
    }
}

/// One loaded source file.
#[derive(Clone, Debug)]
pub struct SourceFile {
    /// The path as it is shown in diagnostics.
    pub name: String,
    /// The path used to open it (and to resolve imports relative to it).
    pub path: PathBuf,
    pub text: String,
    line_starts: Vec<usize>,
}

impl SourceFile {
    /// The line (0-based) holding byte offset `offset`.
    fn line_of(&self, offset: usize) -> usize {
        self.line_starts.partition_point(|&s| s <= offset) - 1
    }

    /// The byte range of line `line` without its line ending.
    fn line_content(&self, line: usize) -> Range<usize> {
        let start = self.line_starts[line];
        let end = self
            .line_starts
            .get(line + 1)
            .copied()
            .unwrap_or(self.text.len());
        let trimmed = self.text[start..end].trim_end_matches(['\n', '\r']).len();
        start..start + trimmed
    }

    /// Line (0-based) and column (0-based, in characters) of a byte offset.
    pub fn line_col(&self, offset: usize) -> (usize, usize) {
        let line = self.line_starts.partition_point(|&s| s <= offset) - 1;
        let start = self.line_starts[line];
        let col = self
            .text
            .get(start..offset.min(self.text.len()))
            .map_or(0, |s| s.chars().count());
        (line, col)
    }
}

/// All files of one compilation, addressed by [`FileId`].
#[derive(Clone, Debug, Default)]
pub struct SourceMap {
    files: Vec<SourceFile>,
}

impl SourceMap {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn add(&mut self, name: impl Into<String>, path: impl AsRef<Path>, text: String) -> FileId {
        let line_starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        let id = FileId(self.files.len() as u32);
        self.files.push(SourceFile {
            name: name.into(),
            path: path.as_ref().to_path_buf(),
            text,
            line_starts,
        });
        id
    }

    pub fn get(&self, id: FileId) -> &SourceFile {
        &self.files[id.0 as usize]
    }

    pub fn ids(&self) -> impl Iterator<Item = FileId> {
        (0..self.files.len() as u32).map(FileId)
    }

    /// The file whose path is `path`, if loaded.
    pub fn find(&self, path: &Path) -> Option<FileId> {
        self.files
            .iter()
            .position(|f| f.path == path)
            .map(|i| FileId(i as u32))
    }

    /// `file:line:col` (1-based) of a span's start.
    pub fn location(&self, span: Span) -> String {
        let f = self.get(span.file);
        let (line, col) = f.line_col(span.start as usize);
        format!("{}:{}:{}", f.name, line + 1, col + 1)
    }

    /// Renders diagnostics as text, with colour when `writer` supports it.
    ///
    /// A diagnostic whose labels lie on a line longer than [`LONG_LINE`] bytes is rendered
    /// against an [`Excerpts`] view that shows only windows of that line around the labels, so
    /// that the output grows with the number of diagnostics, not with that number times the
    /// length of the line (a 1 MB line with 50,000 errors on it would otherwise print 50 GB).
    pub fn emit(&self, writer: &mut dyn WriteColor, diags: &[Diagnostic]) {
        let config = term::Config::default();
        for d in diags {
            // Writing to a terminal or buffer only fails when the stream is closed; nothing to report then.
            let _ = match Excerpts::of(self, d) {
                Some(view) => {
                    let cs = to_codespan(d, |span| view.map_span(span));
                    term::emit(writer, &config, &view, &cs)
                }
                None => term::emit(
                    writer,
                    &config,
                    self,
                    &to_codespan(d, |span| (span.file, span.range())),
                ),
            };
        }
    }

    /// Renders diagnostics as plain text (for tests and snapshots).
    pub fn render(&self, diags: &[Diagnostic]) -> String {
        let mut buf = Buffer::no_color();
        self.emit(&mut buf, diags);
        String::from_utf8_lossy(buf.as_slice()).into_owned()
    }
}

fn to_codespan<F>(d: &Diagnostic, place: impl Fn(Span) -> (F, Range<usize>)) -> cs::Diagnostic<F> {
    let base = match d.severity {
        Severity::Error => cs::Diagnostic::error(),
        Severity::Warning => cs::Diagnostic::warning(),
    };
    // Primary labels first, so the reported location is the primary one.
    let mut labels: Vec<&Label> = d.labels.iter().filter(|l| l.primary).collect();
    labels.extend(d.labels.iter().filter(|l| !l.primary));
    base.with_message(&d.message)
        .with_labels(
            labels
                .into_iter()
                .map(|l| {
                    let style = if l.primary {
                        cs::LabelStyle::Primary
                    } else {
                        cs::LabelStyle::Secondary
                    };
                    let (file, range) = place(l.span);
                    cs::Label::new(style, file, range).with_message(&l.message)
                })
                .collect(),
        )
        .with_notes(d.notes.clone())
}

impl<'a> Files<'a> for SourceMap {
    type FileId = FileId;
    type Name = &'a str;
    type Source = &'a str;

    fn name(&'a self, id: FileId) -> Result<&'a str, FilesError> {
        self.files
            .get(id.0 as usize)
            .map(|f| f.name.as_str())
            .ok_or(FilesError::FileMissing)
    }

    fn source(&'a self, id: FileId) -> Result<&'a str, FilesError> {
        self.files
            .get(id.0 as usize)
            .map(|f| f.text.as_str())
            .ok_or(FilesError::FileMissing)
    }

    fn line_index(&'a self, id: FileId, byte_index: usize) -> Result<usize, FilesError> {
        let f = self
            .files
            .get(id.0 as usize)
            .ok_or(FilesError::FileMissing)?;
        Ok(f.line_starts.partition_point(|&s| s <= byte_index) - 1)
    }

    fn line_range(&'a self, id: FileId, line_index: usize) -> Result<Range<usize>, FilesError> {
        let f = self
            .files
            .get(id.0 as usize)
            .ok_or(FilesError::FileMissing)?;
        let start = *f
            .line_starts
            .get(line_index)
            .ok_or(FilesError::LineTooLarge {
                given: line_index,
                max: f.line_starts.len() - 1,
            })?;
        let end = f
            .line_starts
            .get(line_index + 1)
            .copied()
            .unwrap_or(f.text.len());
        Ok(start..end)
    }
}

/// Source lines up to this many bytes are shown whole in a rendered diagnostic.
pub const LONG_LINE: usize = 240;
/// Bytes of a long line shown on each side of a label's start and end.
const CONTEXT: usize = 40;

/// What one diagnostic shows of its files when a label lies on a long line: for each file, only
/// the lines that the rendering shows (the labels' lines and the context lines of multi-line
/// labels), long ones cut down to windows around the labels' ends with `…` where text is left
/// out. Line numbers and the `file:line:col` header still refer to the original file.
struct Excerpts<'m> {
    map: &'m SourceMap,
    files: Vec<Excerpt>,
}

struct Excerpt {
    file: FileId,
    text: String,
    line_starts: Vec<usize>,
    /// The original (1-based) line number of each line of `text`.
    numbers: Vec<usize>,
    /// Runs of the original text copied into `text`: (start in `text`, start in the original,
    /// length), in increasing order of both starts.
    pieces: Vec<(usize, usize, usize)>,
}

impl<'m> Excerpts<'m> {
    /// The view for `d`, or `None` when none of its labels lies on a long line.
    fn of(map: &'m SourceMap, d: &Diagnostic) -> Option<Excerpts<'m>> {
        let ends = |l: &Label| [l.span.start as usize, l.span.end as usize];
        let long = d.labels.iter().any(|l| {
            let f = map.files.get(l.span.file.0 as usize);
            f.is_some_and(|f| {
                ends(l)
                    .into_iter()
                    .any(|p| f.line_content(f.line_of(p)).len() > LONG_LINE)
            })
        });
        if !long {
            return None;
        }
        let mut files: Vec<Excerpt> = vec![];
        for l in &d.labels {
            if map.files.get(l.span.file.0 as usize).is_none()
                || files.iter().any(|e| e.file == l.span.file)
            {
                continue;
            }
            let labels: Vec<&Label> = d
                .labels
                .iter()
                .filter(|m| m.span.file == l.span.file)
                .collect();
            files.push(Excerpt::new(map.get(l.span.file), l.span.file, &labels));
        }
        Some(Excerpts { map, files })
    }

    /// Where an original span lies in the view.
    fn map_span(&self, span: Span) -> (usize, Range<usize>) {
        match self.files.iter().position(|e| e.file == span.file) {
            Some(i) => {
                let e = &self.files[i];
                let start = e.to_view(span.start as usize);
                (i, start..e.to_view(span.end as usize).max(start))
            }
            None => (0, 0..0),
        }
    }
}

impl Excerpt {
    fn new(src: &SourceFile, file: FileId, labels: &[&Label]) -> Excerpt {
        let clamp = |p: u32| (p as usize).min(src.text.len());
        let mut points: Vec<usize> = labels
            .iter()
            .flat_map(|l| [clamp(l.span.start), clamp(l.span.end)])
            .collect();
        points.sort_unstable();
        points.dedup();
        // The lines codespan shows: each label's first and last line, and for a label over
        // several lines the context it shows (three lines after the start, one before the end).
        let mut shown = std::collections::BTreeSet::new();
        for l in labels {
            let (first, last) = (
                src.line_of(clamp(l.span.start)),
                src.line_of(clamp(l.span.end)),
            );
            shown.insert(first);
            shown.insert(last);
            if last > first + 1 {
                shown.extend(first + 1..=(first + 3).min(last - 1));
                shown.insert(last - 1);
            }
        }
        let mut e = Excerpt {
            file,
            text: String::new(),
            line_starts: vec![],
            numbers: vec![],
            pieces: vec![],
        };
        let mut prev: Option<usize> = None;
        for &line in &shown {
            match prev.map(|p| line - p) {
                // One line between two shown ones is shown too (as codespan does); more become a
                // gap of two empty lines, which codespan renders as a `·` break.
                Some(2) => e.push_line(src, line - 1, &[]),
                Some(gap) if gap > 2 => {
                    for _ in 0..2 {
                        e.line_starts.push(e.text.len());
                        e.numbers.push(line);
                        e.text.push('\n');
                    }
                }
                _ => {}
            }
            let on_line: Vec<usize> = points
                .iter()
                .copied()
                .filter(|&p| src.line_of(p) == line)
                .collect();
            e.push_line(src, line, &on_line);
            prev = Some(line);
        }
        e
    }

    /// Appends original line `line`, whole when short, else as windows around `points`.
    fn push_line(&mut self, src: &SourceFile, line: usize, points: &[usize]) {
        self.line_starts.push(self.text.len());
        self.numbers.push(line + 1);
        let content = src.line_content(line);
        let (start, end) = (content.start, content.end);
        if end - start <= LONG_LINE {
            self.pieces.push((self.text.len(), start, end - start));
            self.text.push_str(&src.text[content]);
            self.text.push('\n');
            return;
        }
        let floor = |mut i: usize| {
            while !src.text.is_char_boundary(i) {
                i -= 1;
            }
            i
        };
        let ceil = |mut i: usize| {
            while !src.text.is_char_boundary(i) {
                i += 1;
            }
            i
        };
        let mut windows: Vec<(usize, usize)> = vec![];
        let centres = if points.is_empty() {
            vec![start + CONTEXT]
        } else {
            points.to_vec()
        };
        for p in centres {
            let p = p.clamp(start, end);
            let w = (
                floor(p.saturating_sub(CONTEXT).max(start)),
                ceil((p + CONTEXT).min(end)),
            );
            match windows.last_mut() {
                Some(last) if w.0 <= last.1 + 8 => last.1 = last.1.max(w.1),
                _ => windows.push(w),
            }
        }
        for (i, &(a, b)) in windows.iter().enumerate() {
            if i > 0 {
                self.text.push_str(" … ");
            } else if a > start {
                self.text.push('…');
            }
            self.pieces.push((self.text.len(), a, b - a));
            self.text.push_str(&src.text[a..b]);
        }
        if windows.last().is_some_and(|&(_, b)| b < end) {
            self.text.push('…');
        }
        self.text.push('\n');
    }

    /// The offset in the view of original offset `p` (which lies on a shown line).
    fn to_view(&self, p: usize) -> usize {
        let i = self.pieces.partition_point(|&(_, orig, _)| orig <= p);
        match i.checked_sub(1).map(|i| self.pieces[i]) {
            Some((view, orig, len)) => view + (p - orig).min(len),
            None => 0,
        }
    }

    /// The original offset of view offset `v`.
    fn to_original(&self, v: usize) -> usize {
        let i = self.pieces.partition_point(|&(view, _, _)| view <= v);
        match i.checked_sub(1).map(|i| self.pieces[i]) {
            Some((view, orig, len)) => orig + (v - view).min(len),
            None => 0,
        }
    }

    fn line_of(&self, v: usize) -> usize {
        self.line_starts
            .partition_point(|&s| s <= v)
            .saturating_sub(1)
    }
}

impl<'a> Files<'a> for Excerpts<'_> {
    type FileId = usize;
    type Name = &'a str;
    type Source = &'a str;

    fn name(&'a self, id: usize) -> Result<&'a str, FilesError> {
        let e = self.files.get(id).ok_or(FilesError::FileMissing)?;
        Ok(self.map.get(e.file).name.as_str())
    }

    fn source(&'a self, id: usize) -> Result<&'a str, FilesError> {
        self.files
            .get(id)
            .map(|e| e.text.as_str())
            .ok_or(FilesError::FileMissing)
    }

    fn line_index(&'a self, id: usize, byte_index: usize) -> Result<usize, FilesError> {
        Ok(self
            .files
            .get(id)
            .ok_or(FilesError::FileMissing)?
            .line_of(byte_index))
    }

    fn line_number(&'a self, id: usize, line_index: usize) -> Result<usize, FilesError> {
        let e = self.files.get(id).ok_or(FilesError::FileMissing)?;
        Ok(e.numbers
            .get(line_index)
            .or(e.numbers.last())
            .copied()
            .unwrap_or(1))
    }

    fn location(
        &'a self,
        id: usize,
        byte_index: usize,
    ) -> Result<codespan_reporting::files::Location, FilesError> {
        let e = self.files.get(id).ok_or(FilesError::FileMissing)?;
        let (line, col) = self.map.get(e.file).line_col(e.to_original(byte_index));
        Ok(codespan_reporting::files::Location {
            line_number: line + 1,
            column_number: col + 1,
        })
    }

    fn line_range(&'a self, id: usize, line_index: usize) -> Result<Range<usize>, FilesError> {
        let e = self.files.get(id).ok_or(FilesError::FileMissing)?;
        let start = *e
            .line_starts
            .get(line_index)
            .ok_or(FilesError::LineTooLarge {
                given: line_index,
                max: e.line_starts.len().saturating_sub(1),
            })?;
        let end = e
            .line_starts
            .get(line_index + 1)
            .copied()
            .unwrap_or(e.text.len());
        Ok(start..end)
    }
}

/// The closest candidate to `word` by edit distance, when it is close enough to be a likely typo:
/// at most one edit per three characters (case aside), and, in a word of up to five characters,
/// not a change of the first letter. Typos rarely hit the first letter, and in a short word one
/// changed letter more likely makes another word than a typo (`relu` is not a misspelt `gelu`,
/// while `bf61`, `flsh` and `gib` are `bf16`, `flash` and `GiB`).
pub fn did_you_mean<'a>(
    word: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let lower = word.to_ascii_lowercase();
    let len = word.chars().count();
    let limit = (len / 3).max(1);
    // No one mistypes a name this long; and comparing two such names would take quadratic time.
    if len > MAX_SUGGESTED {
        return None;
    }
    candidates
        .into_iter()
        // The edit distance is at least the difference in length.
        .filter(|&c| {
            c != word
                && c.len().abs_diff(word.len()) <= limit * 4
                && c.chars().count().abs_diff(len) <= limit
        })
        .map(|c| {
            let c_lower = c.to_ascii_lowercase();
            (edit_distance(&lower, &c_lower), c, c_lower)
        })
        .filter(|(d, _, c_lower)| {
            *d <= limit && (*d == 0 || len > 5 || keeps_first_letter(&lower, c_lower))
        })
        .min_by_key(|&(d, ..)| d)
        .map(|(_, c, _)| c)
}

/// Longest word (in characters) that [`did_you_mean`] looks for a correction of.
const MAX_SUGGESTED: usize = 100;

/// Whether `b` starts like `a`: the same first letter, or the first two letters swapped.
fn keeps_first_letter(a: &str, b: &str) -> bool {
    let (mut x, mut y) = (a.chars(), b.chars());
    match (x.next(), y.next()) {
        (Some(a0), Some(b0)) if a0 == b0 => true,
        (Some(a0), Some(b0)) => x.next() == Some(b0) && y.next() == Some(a0),
        _ => false,
    }
}

/// Levenshtein distance with adjacent transpositions counted as one edit.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut prev2: Vec<usize> = vec![0; b.len() + 1];
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut cur = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            cur[j] = (prev[j] + 1).min(cur[j - 1] + 1).min(prev[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                cur[j] = cur[j].min(prev2[j - 2] + 1);
            }
        }
        prev2 = std::mem::replace(&mut prev, cur);
    }
    prev[b.len()]
}

#[cfg(test)]
#[path = "../tests/unit/diag.rs"]
mod tests;
