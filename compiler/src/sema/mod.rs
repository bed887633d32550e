//! Semantic analysis: from `.sched` files to resolved [`Job`]s.
//!
//! One analysis starts at a root file and owns everything reachable from it:
//! 1. **Load**: parse the root and, depth first, every file it imports (paths relative to the importing
//!    file). Files are identified by their absolute, normalised path ([`Loader::identity`]), so a
//!    file reached twice, however its path is written, is loaded once; a file reached again while
//!    it is still being loaded (itself included) is an import cycle, reported with the whole chain
//!    and every import on it.
//! 2. **Index**: every item of every loaded file goes into one namespace per kind (imports are
//!    transitive, like C includes). An unknown item kind or two items of one kind and name are
//!    errors; the latter points at both, at the root file's definition first.
//! 3. **Resolve**: clusters, then models (layers expanded, tensor shapes and exact parameter counts),
//!    then schedules (presets expanded, explicit keys overriding, meshes laid out, every rule of
//!    `dsl.md` checked) into [`Job`]s.
//!
//! Errors never stop the analysis early: every error and warning of every file is collected, sorted
//! by position, and returned with whatever resolved cleanly. A file with syntax errors is not
//! analysed further, so its broken items cause no knock-on errors.

mod cluster;
mod model;
pub mod pipeline;
mod schedule;
mod tensor;
mod values;

use sched_grammar::ast::{self, Item};
use sched_grammar::diag::{did_you_mean, Diagnostic, FileId, SourceMap, Span};
use sched_ir::job::{Cluster, Job, Model};
use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

/// Where source files come from: the file system, or memory (tests, fuzzing).
pub trait Loader {
    fn read(&self, path: &Path) -> std::io::Result<String>;

    /// What identifies the file at `path`: two paths with the same identity are one file, loaded
    /// once. By default the path made absolute (against the current directory) and normalised,
    /// so that `a.sched` and `../sub/a.sched`, read from `sub/`, are the same file.
    fn identity(&self, path: &Path) -> PathBuf {
        absolute(path)
    }
}

/// Reads files from disk.
pub struct FsLoader;

impl Loader for FsLoader {
    fn read(&self, path: &Path) -> std::io::Result<String> {
        std::fs::read_to_string(path)
    }
}

/// Files held in memory, keyed by their normalised path.
///
/// Relative paths are taken from the process's current directory, as on disk, unless
/// [`MemLoader::in_dir`] names another one.
#[derive(Default)]
pub struct MemLoader {
    pub files: HashMap<PathBuf, String>,
    /// The directory relative paths are taken from; the current directory when `None`.
    pub dir: Option<PathBuf>,
}

impl MemLoader {
    pub fn with(mut self, path: &str, text: &str) -> Self {
        self.files
            .insert(normalize(Path::new(path)), text.to_string());
        self
    }

    /// Takes relative paths from `dir` (an absolute path), as if the process ran there.
    pub fn in_dir(mut self, dir: &str) -> Self {
        self.dir = Some(PathBuf::from(dir));
        self
    }
}

impl Loader for MemLoader {
    fn read(&self, path: &Path) -> std::io::Result<String> {
        let found = self.files.get(&normalize(path)).or_else(|| {
            // The same file written another way (`../sub/a.sched` for `a.sched`).
            let id = self.identity(path);
            self.files
                .iter()
                .find(|(k, _)| self.identity(k) == id)
                .map(|(_, text)| text)
        });
        found
            .cloned()
            .ok_or_else(|| std::io::ErrorKind::NotFound.into())
    }

    fn identity(&self, path: &Path) -> PathBuf {
        match &self.dir {
            Some(dir) => normalize(&dir.join(path)),
            None => absolute(path),
        }
    }
}

/// The root file itself could not be read: a fault outside the input (exit status 2).
#[derive(Debug)]
pub struct ReadError {
    pub path: PathBuf,
    pub error: std::io::Error,
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot read {}: {}", self.path.display(), self.error)
    }
}

impl std::error::Error for ReadError {}

/// Collected diagnostics of one analysis. A diagnostic identical in message and place to one
/// already collected (the same fact reached twice) is dropped.
#[derive(Default)]
pub(crate) struct Ctx {
    diags: Vec<Diagnostic>,
    seen: std::collections::HashSet<(String, Option<Span>)>,
    /// Layers expanded so far, over every model of the analysis (see [`model::MAX_TOTAL_LAYERS`]).
    pub layers_expanded: u64,
}

impl Ctx {
    pub fn error(&mut self, d: Diagnostic) {
        self.push(d);
    }

    pub fn warn(&mut self, d: Diagnostic) {
        self.push(d);
    }

    fn push(&mut self, d: Diagnostic) {
        if self.seen.insert((d.message.clone(), d.primary_span())) {
            self.diags.push(d);
        }
    }
}

/// The outcome of analysing one root file.
pub struct Analysis {
    pub sources: SourceMap,
    /// Every error and warning, sorted by file and position.
    pub diagnostics: Vec<Diagnostic>,
    pub clusters: Vec<Arc<Cluster>>,
    pub models: Vec<Arc<Model>>,
    /// Schedules defined in the root file, in source order (imported files' schedules are checked
    /// but not listed here).
    pub jobs: Vec<Job>,
    /// For each job of [`Analysis::jobs`] that checks but cannot be compiled yet, by schedule
    /// name, the error that says why ([`Analysis::not_lowered`]).
    not_lowered: Vec<(String, Diagnostic)>,
}

impl Analysis {
    pub fn has_errors(&self) -> bool {
        self.diagnostics.iter().any(|d| d.is_error())
    }

    /// The diagnostics rendered as plain text.
    pub fn render(&self) -> String {
        self.sources.render(&self.diagnostics)
    }

    /// Why `job` (one of [`Analysis::jobs`]) cannot be compiled yet although it checks: an error
    /// at what asks for a lowering that does not exist. Today that is tensor parallelism
    /// (`tensor { size = t }` with t > 1, at `size`). `schedc check` accepts such a job; every
    /// command that compiles one (`compile`, `simulate`, `plan`, `schedrun`) reports this error
    /// instead, as an error in the input.
    pub fn not_lowered(&self, job: &Job) -> Option<&Diagnostic> {
        self.not_lowered
            .iter()
            .find(|(name, _)| *name == job.schedule.name)
            .map(|(_, d)| d)
    }

    /// The job to act on: the one named, or the only one. Lists the choices otherwise.
    pub fn select(&self, name: Option<&str>) -> Result<&Job, SelectError> {
        let names = || self.jobs.iter().map(|j| j.schedule.name.clone()).collect();
        match name {
            Some(n) => self
                .jobs
                .iter()
                .find(|j| j.schedule.name == n)
                .ok_or_else(|| SelectError::NoSuch {
                    name: n.to_string(),
                    did_you_mean: did_you_mean(
                        n,
                        self.jobs.iter().map(|j| j.schedule.name.as_str()),
                    )
                    .map(str::to_string),
                    has: names(),
                }),
            None => match self.jobs.as_slice() {
                [one] => Ok(one),
                [] => Err(SelectError::NoSchedule),
                _ => Err(SelectError::Several(names())),
            },
        }
    }
}

/// Why [`Analysis::select`] found no job to act on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    #[error(
        "no schedule `{name}` in this file{} (it has: {})",
        did_you_mean.as_ref().map(|s| format!("; did you mean `{s}`?")).unwrap_or_default(),
        has.join(", ")
    )]
    NoSuch {
        name: String,
        did_you_mean: Option<String>,
        has: Vec<String>,
    },
    #[error("this file defines no schedule")]
    NoSchedule,
    #[error(
        "this file defines several schedules; pick one with --schedule NAME: {}",
        .0.join(", ")
    )]
    Several(Vec<String>),
}

/// Analyses `root` and everything it imports.
pub fn analyze(root: &Path, loader: &dyn Loader) -> Result<Analysis, ReadError> {
    let text = loader.read(root).map_err(|error| ReadError {
        path: root.to_path_buf(),
        error,
    })?;
    let mut sources = SourceMap::new();
    let mut ctx = Ctx::default();
    let root_id = sources.add(root.display().to_string(), normalize(root), text);
    let mut files = Files {
        loader,
        asts: HashMap::new(),
        identities: HashMap::new(),
        stack: vec![],
        syntax_errors: false,
    };
    files.identities.insert(loader.identity(root), root_id);
    files.load(&mut sources, &mut ctx, root_id, None);

    let mut analysis = Analysis {
        sources,
        diagnostics: vec![],
        clusters: vec![],
        models: vec![],
        jobs: vec![],
        not_lowered: vec![],
    };
    if !files.syntax_errors {
        resolve(&mut ctx, &mut analysis, &files.asts, root_id);
    }
    ctx.diags
        .sort_by_key(|d| d.primary_span().map(|s| (s.file, s.start)));
    analysis.diagnostics = ctx.diags;
    Ok(analysis)
}

/// The import graph walk.
struct Files<'l> {
    loader: &'l dyn Loader,
    asts: HashMap<FileId, ast::File>,
    /// Every file loaded, by [`Loader::identity`].
    identities: HashMap<PathBuf, FileId>,
    /// The files being loaded, root first, each with the import that led to it (for cycle
    /// reports); the last is the file being loaded now.
    stack: Vec<(FileId, Option<Span>)>,
    syntax_errors: bool,
}

impl Files<'_> {
    /// Parses file `id`, reached through the import `via`, and loads what it imports.
    fn load(&mut self, sources: &mut SourceMap, ctx: &mut Ctx, id: FileId, via: Option<Span>) {
        let parsed = sched_grammar::parse(id, &sources.get(id).text);
        self.syntax_errors |= !parsed.errors.is_empty();
        parsed.errors.into_iter().for_each(|e| ctx.error(e));
        self.stack.push((id, via));
        let dir = sources
            .get(id)
            .path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        for item in &parsed.file.items {
            let Item::Import(imp) = item else { continue };
            let path = normalize(&dir.join(&imp.path.value));
            let identity = self.loader.identity(&path);
            if let Some(&seen) = self.identities.get(&identity) {
                if let Some(pos) = self.stack.iter().position(|(f, _)| *f == seen) {
                    ctx.error(cycle_error(sources, &self.stack[pos..], imp.span));
                }
                continue; // already loaded through another import
            }
            match self.loader.read(&path) {
                Ok(text) => {
                    let child = sources.add(display_path(&path), &path, text);
                    self.identities.insert(identity, child);
                    self.load(sources, ctx, child, Some(imp.span));
                }
                Err(e) => ctx.error(
                    Diagnostic::error(format!("cannot import `{}`: {e}", imp.path.value))
                        .at(imp.path.span, format!("looked for {}", display_path(&path))),
                ),
            }
        }
        self.stack.pop();
        self.asts.insert(id, parsed.file);
    }
}

/// An import cycle: `chain` holds the files from the one imported again to the one importing it,
/// each with the import that led to it; `closing` is the import that leads back.
fn cycle_error(sources: &SourceMap, chain: &[(FileId, Option<Span>)], closing: Span) -> Diagnostic {
    let mut names: Vec<&str> = chain
        .iter()
        .map(|(f, _)| sources.get(*f).name.as_str())
        .collect();
    names.push(&sources.get(chain[0].0).name);
    let d = Diagnostic::error(format!("import cycle: {}", names.join(" → ")));
    // Every import on the cycle, in order: the first one (in the file imported again) is where
    // the cycle is reported.
    let imports: Vec<Span> = chain
        .iter()
        .skip(1)
        .filter_map(|(_, via)| *via)
        .chain([closing])
        .collect();
    match imports.as_slice() {
        [only] => d.at(*only, "the file imports itself"),
        [first, middle @ .., last] => {
            let d = d.at(*first, "the cycle starts here");
            let d = middle.iter().fold(d, |d, s| d.also(*s, "continues here"));
            d.also(*last, "and closes here")
        }
        [] => d,
    }
}

/// Lexically normalises a path (removes `.` and resolves `..` against earlier components).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir
                if matches!(out.components().next_back(), Some(Component::Normal(_))) =>
            {
                out.pop();
            }
            c => out.push(c.as_os_str()),
        }
    }
    out
}

/// `path` made absolute against the current directory, and normalised.
fn absolute(path: &Path) -> PathBuf {
    match path.is_absolute() {
        true => normalize(path),
        false => normalize(&std::env::current_dir().unwrap_or_default().join(path)),
    }
}

fn display_path(path: &Path) -> String {
    path.display().to_string()
}

const ITEM_KINDS: [&str; 3] = ["cluster", "model", "schedule"];

/// Builds the namespaces and resolves every item.
fn resolve(ctx: &mut Ctx, out: &mut Analysis, asts: &HashMap<FileId, ast::File>, root: FileId) {
    let mut ids: Vec<&FileId> = asts.keys().collect();
    ids.sort();
    let mut items: [Vec<&ast::BlockItem>; 3] = Default::default();
    let mut names: [HashMap<&str, &ast::BlockItem>; 3] = Default::default();
    for id in ids {
        for item in &asts[id].items {
            let Item::Block(b) = item else { continue };
            if let Some(k) = values::choice(ctx, &b.kind, &ITEM_KINDS, "item kind") {
                match names[k].get(b.name.name.as_str()) {
                    Some(first) => ctx.error(duplicate_item(ITEM_KINDS[k], first, b, root)),
                    None => {
                        names[k].insert(&b.name.name, b);
                        items[k].push(b);
                    }
                }
            }
        }
    }
    let [clusters, models, schedules] = items;
    let clusters: Vec<(&ast::BlockItem, Option<Arc<Cluster>>)> = clusters
        .into_iter()
        .map(|c| (c, cluster::resolve(ctx, c).map(Arc::new)))
        .collect();
    let models: Vec<(&ast::BlockItem, Option<Arc<Model>>)> = models
        .into_iter()
        .map(|m| (m, model::resolve(ctx, m).map(Arc::new)))
        .collect();
    let env = schedule::Env {
        clusters: &clusters,
        models: &models,
        sources: &out.sources,
    };
    for s in schedules {
        if let Some(job) = schedule::resolve(ctx, &env, s) {
            if s.span.file == root {
                if let Some(d) = tensor::not_lowered(s, &job) {
                    out.not_lowered.push((job.schedule.name.clone(), d));
                }
                out.jobs.push(job);
            }
        }
    }
    out.clusters = clusters.into_iter().filter_map(|(_, c)| c).collect();
    out.models = models.into_iter().filter_map(|(_, m)| m).collect();
}

/// Two items of one kind and name; `first` was indexed before `again`. Across files, the one in
/// the root file (the file being checked) is where the error is, the imported one a related place.
fn duplicate_item(
    kind: &str,
    first: &ast::BlockItem,
    again: &ast::BlockItem,
    root: FileId,
) -> Diagnostic {
    let d = Diagnostic::error(format!("{kind} `{}` is defined twice", again.name.name));
    let (a, b) = (first.name.span, again.name.span);
    if a.file == b.file {
        return d.at(b, "defined again here").also(a, "first defined here");
    }
    let (here, other) = if a.file == root { (a, b) } else { (b, a) };
    let d = d.at(here, "defined here");
    match here.file == root {
        true => d.also(other, "and in an imported file"),
        false => d.also(other, "and here"),
    }
    .note("the items of every imported file share one namespace per kind; rename one of them")
}

#[cfg(test)]
#[path = "../../tests/unit/sema.rs"]
mod tests;
