//! Resolving `schedule` blocks into [`Job`]s: names, presets, meshes and the rules of `dsl.md`.
//!
//! Order: look up the model and cluster, and check every value that needs neither (choices,
//! blocks, the preset, the syntax of each shard mesh), so that an unknown model or cluster hides
//! no other error; fix the ranks used (G GPUs per node × N nodes, each at most the cluster's);
//! expand the preset into defaults; let explicit keys override them one by one
//! (`shard { params = … }` overrides only s_p); lay every mesh out as `a x b` (a plain integer
//! `n` is `n x 1` up to G, else `G x n/G`; `full` is `G x N`); then check mesh rule 1
//! (divisibility), rule 2 (s_p | s_g | s_os per dimension) and warn on rule 3 (a mesh that
//! crosses nodes without filling them). A preset's partition, which sets all three factors, is
//! checked once and named as the preset's. A few checks beyond the spec protect later stages:
//! hpZ's secondary shard size divides G, and a `max_live` cap holds at least the largest
//! gathered layer (which needs the model, so it comes last).
//!
//! A `pipeline { … }` block (module [`super::pipeline`]) is read with the other values; once the
//! ranks are known its rule 2 gives each stage's data-parallel mesh, and the meshes (`full`,
//! presets, rules 1 to 3, hpZ's secondary shard) are laid out over that mesh instead of G x N;
//! once the job is built, its chunks and order are resolved.
//!
//! A `tensor { … }` block (module [`super::tensor`]) is read beside it; once the ranks are known
//! its rule 1 (t divides G) is checked, and t enters rule 2: a stage is d·t ranks and the
//! data-parallel mesh holds the ranks of one tensor index (`G/t x …`, also without a pipeline);
//! once the model is known, its rule 3 (what t must divide) is checked.

use super::pipeline;
use super::tensor;
use super::values::*;
use super::Ctx;
use sched_grammar::ast::{BlockItem, Value, ValueKind};
use sched_grammar::diag::{did_you_mean, Diagnostic, SourceMap, Span};
use sched_ir::job::*;
use std::sync::Arc;

const KEYS: &[(&str, Shape)] = &[
    ("model", Shape::Value),
    ("cluster", Shape::Value),
    ("nodes", Shape::Value),
    ("gpus_per_node", Shape::Value),
    ("micro_steps", Shape::Value),
    ("preset", Shape::Value),
    ("shard", Shape::Block),
    ("reshard_after_forward", Shape::Value),
    ("grad_sync", Shape::Value),
    ("all_gather", Shape::Value),
    ("prefetch", Shape::Block),
    ("buckets", Shape::Block),
    ("recompute", Shape::Value),
    ("streams", Shape::Value),
    ("overlap", Shape::Block),
    ("train", Shape::Block),
    ("pipeline", Shape::Block),
    ("tensor", Shape::Block),
];
const SHARD_KEYS: &[(&str, Shape)] = &[
    ("params", Shape::Value),
    ("grads", Shape::Value),
    ("optimizer", Shape::Value),
];
const PREFETCH_KEYS: &[(&str, Shape)] = &[
    ("forward", Shape::Value),
    ("backward", Shape::Value),
    ("max_live", Shape::Value),
];
const BUCKET_KEYS: &[(&str, Shape)] = &[("gather", Shape::Value), ("reduce", Shape::Value)];
const OVERLAP_KEYS: &[(&str, Shape)] = &[
    ("gather", Shape::Value),
    ("reduce", Shape::Value),
    ("sync", Shape::Value),
    ("refresh", Shape::Value),
];
const TRAIN_KEYS: &[(&str, Shape)] = &[
    ("steps", Shape::Value),
    ("lr", Shape::Value),
    ("seed", Shape::Value),
    ("data", Shape::Value),
    ("clip", Shape::Value),
    ("checkpoints", Shape::Value),
    ("save_every", Shape::Value),
    ("keep", Shape::Value),
    ("warmup", Shape::Value),
    ("decay", Shape::Value),
    ("min_lr", Shape::Value),
    ("weight_decay", Shape::Value),
    ("betas", Shape::Value),
    ("eps", Shape::Value),
    ("val", Shape::Value),
    ("eval_every", Shape::Value),
    ("eval_batches", Shape::Value),
];
const PRESETS: [&str; 8] = [
    "ddp", "zero1", "zero2", "zero3", "fsdp", "mics", "hsdp", "hpz",
];

/// Items visible to schedules, with what resolved of them.
pub(crate) struct Env<'a> {
    pub clusters: &'a [(&'a BlockItem, Option<Arc<Cluster>>)],
    pub models: &'a [(&'a BlockItem, Option<Arc<Model>>)],
    pub sources: &'a SourceMap,
}

/// A mesh as written, before the ranks used are known.
#[derive(Clone, Copy, PartialEq, Eq)]
enum MeshSpec {
    Explicit(u64, u64),
    Int(u64),
    Full,
    None,
}

/// The shard factors and other knobs a preset sets.
struct PresetDefaults {
    name: &'static str,
    shard: [(MeshSpec, Span); 3],
    /// The span of the `partition` argument of `mics` and `hsdp`, which sets all three factors.
    partition: Option<Span>,
    grad_sync: Option<GradSync>,
    all_gather: Option<AllGatherAlgo>,
    /// hpZ's secondary shard and the span of its `secondary` argument.
    reshard: Option<(ReshardAfterForward, Span)>,
}

const SHARD: [&str; 3] = ["params", "grads", "optimizer"];

/// Where a shard factor comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    /// Written in `shard { … }`.
    Written,
    /// Set by the preset.
    Preset,
    /// Neither: `none`.
    Default,
}

/// A shard factor laid out, and where it comes from (no span when defaulted).
#[derive(Clone, Copy)]
struct Factor {
    key: &'static str,
    mesh: Mesh,
    span: Option<Span>,
    source: Source,
}

pub(crate) fn resolve(ctx: &mut Ctx, env: &Env, item: &BlockItem) -> Option<Job> {
    let what = format!("schedule `{}`", item.name.name);
    let r = BlockReader::new(ctx, &what, &item.body.entries, KEYS, Extras::default());
    r.require(
        ctx,
        &item.name,
        &what,
        &[("model", "model = NAME"), ("cluster", "cluster = NAME")],
    );
    let model = named(ctx, &r, "model", env.models);
    let cluster = named(ctx, &r, "cluster", env.clusters);

    // Everything that needs neither the model nor the cluster is checked before either is
    // needed, so that an unknown model or cluster hides no other error.
    let micro_steps = opt(ctx, r.value("micro_steps"), 1, |ctx, v| {
        expect_int(ctx, v, 1, 1 << 20, "`micro_steps`")
    });
    let nodes = r
        .value("nodes")
        .map(|v| (v, expect_int(ctx, v, 1, u64::MAX, "`nodes`")));
    let gpus = r
        .value("gpus_per_node")
        .map(|v| (v, expect_int(ctx, v, 1, u64::MAX, "`gpus_per_node`")));
    let preset = r.value("preset").map(|v| preset(ctx, v));
    let shard_block = r
        .block("shard")
        .map(|b| BlockReader::for_nested(ctx, "`shard`", b, SHARD_KEYS));
    let written = SHARD.map(|key| {
        shard_block
            .as_ref()
            .and_then(|s| s.value(key))
            .map(|v| (mesh_spec(ctx, v), v.span))
    });
    let grad_sync = r.value("grad_sync").map(|v| {
        expect_choice(ctx, v, &["two_hop", "flat"], "gradient synchronisation")
            .map(|i| [GradSync::TwoHop, GradSync::Flat][i])
    });
    let all_gather = r.value("all_gather").map(|v| {
        expect_choice(ctx, v, &["flat", "hierarchical"], "all-gather algorithm")
            .map(|i| [AllGatherAlgo::Flat, AllGatherAlgo::Hierarchical][i])
    });
    let reshard = r.value("reshard_after_forward").map(|v| {
        expect_key_choice(
            ctx,
            v,
            &["true", "false", "node"],
            "`reshard_after_forward`",
        )
    });
    let opt_blocks = OptionalBlocks::read(ctx, &r);
    // `None`: no pipeline block; `Some(None)`: one with errors, reported.
    let pipeline = r
        .block("pipeline")
        .map(|b| pipeline::read(ctx, b, micro_steps.map(|m| m as u32)));
    // The same for the tensor block.
    let tensor = r.block("tensor").map(|b| tensor::read(ctx, b));

    // The ranks used: G GPUs per node x N nodes, each at most the cluster's.
    let cluster = cluster?;
    let nodes = used(ctx, nodes, u64::from(cluster.nodes), "nodes", &cluster.name);
    let gpus = used(
        ctx,
        gpus,
        u64::from(cluster.gpus_per_node),
        "GPUs per node",
        &cluster.name,
    );
    let ranks = Ranks {
        g: gpus?,
        n: nodes?,
        over: Over::All,
    };
    // Rule 1 of tensor parallelism: t divides G. A tensor block with errors, or breaking the
    // rule, counts as t = 1 below, which reports no more than it would.
    let rule1 = match &tensor {
        Some(Some(spec)) => spec.rule1(ctx, ranks.g),
        _ => true,
    };
    let t = match &tensor {
        Some(Some(spec)) if rule1 && spec.size > 1 => Some(spec),
        _ => None,
    };
    // Rule 2 of pipelines: the shard meshes are laid out over each stage's data-parallel mesh
    // (with tensor parallelism, the ranks of one tensor index). A pipeline block with errors
    // leaves the whole cluster (or its ranks of one tensor index), which reports no more than it
    // would.
    let mut rule2 = true;
    let shard_ranks = match (&pipeline, t) {
        (Some(Some(spec)), t) => {
            match spec.data_parallel(ctx, ranks.g, ranks.n, t.map(|t| (t.size, t.size_span))) {
                Some((g, n)) => Ranks {
                    g,
                    n,
                    over: Over::Stage,
                },
                None => {
                    rule2 = false;
                    ranks
                }
            }
        }
        (_, Some(t)) => {
            let (g, n) = t.data_parallel(ranks.g, ranks.n);
            Ranks {
                g,
                n,
                over: Over::DataParallel,
            }
        }
        _ => ranks,
    };

    let factors = shard_factors(ctx, &shard_ranks, &written, preset.as_ref(), item);
    let grad_sync = match grad_sync {
        Some(g) => g,
        None => Some(preset_value(&preset, |p| p.grad_sync).unwrap_or(GradSync::TwoHop)),
    };
    let all_gather = match all_gather {
        Some(a) => a,
        None => Some(preset_value(&preset, |p| p.all_gather).unwrap_or(AllGatherAlgo::Flat)),
    };
    let reshard = reshard_after_forward(ctx, reshard, &preset, shard_ranks.g);
    // Rule 3 of tensor parallelism, on the model (pointing at its definition too).
    let rule3 = match (&tensor, &model) {
        (Some(Some(spec)), Some(model)) => {
            let item = env
                .models
                .iter()
                .find(|(_, m)| m.as_ref().is_some_and(|m| Arc::ptr_eq(m, model)))
                .map(|(item, _)| *item);
            spec.rule3(ctx, model, item)
        }
        _ => true,
    };
    let [params, grads, optimizer] = factors?;
    let model = model?;
    let prefetch = opt_blocks.prefetch?;
    check_max_live(ctx, &prefetch, opt_blocks.max_live, &model, params);

    let mut job = Job {
        schedule: Schedule {
            name: item.name.name.clone(),
            preset: r
                .value("preset")
                .map(|v| env.sources.get(v.span.file).text[v.span.range()].to_string()),
            nodes: ranks.n as u32,
            gpus_per_node: ranks.g as u32,
            micro_steps: micro_steps? as u32,
            shard: Shard {
                params: params.mesh,
                grads: grads.mesh,
                optimizer: optimizer.mesh,
            },
            reshard_after_forward: reshard?,
            grad_sync: grad_sync?,
            all_gather: all_gather?,
            prefetch,
            buckets: opt_blocks.buckets?,
            recompute: opt_blocks.recompute?,
            streams: opt_blocks.streams?,
            overlap: opt_blocks.overlap?,
            train: opt_blocks.train(env.sources, item)?,
            tensor: match &tensor {
                Some(spec) => spec.as_ref()?.resolve(),
                None => Tensor::default(),
            },
            pipeline: Pipeline::default(),
        },
        model,
        cluster,
    };
    if let Some(spec) = pipeline {
        job.schedule.pipeline = spec?.resolve(ctx, &job)?;
    }
    (rule1 && rule2 && rule3).then_some(job)
}

/// What a preset that resolved sets with `f`; `None` without a preset (or with a broken one).
fn preset_value<T>(
    preset: &Option<Option<PresetDefaults>>,
    f: impl Fn(&PresetDefaults) -> Option<T>,
) -> Option<T> {
    preset.as_ref().and_then(|p| p.as_ref()).and_then(f)
}

/// The three shard factors: explicit keys over the preset over `none`, laid out and checked
/// against rules 1 to 3. A preset's partition sets all three factors and is checked once.
fn shard_factors(
    ctx: &mut Ctx,
    ranks: &Ranks,
    written: &[Option<(Option<MeshSpec>, Span)>; 3],
    preset: Option<&Option<PresetDefaults>>,
    item: &BlockItem,
) -> Option<[Factor; 3]> {
    let mut factors: [Option<Factor>; 3] = [None; 3];
    let mut ok = true;
    // Preset factors already laid out: (spec, span) and the result.
    let mut from_preset: Vec<((MeshSpec, Span), Option<Mesh>)> = vec![];
    for (i, key) in SHARD.into_iter().enumerate() {
        let (spec, span, source) = match (&written[i], preset) {
            (Some((spec, span)), _) => match spec {
                Some(spec) => (*spec, Some(*span), Source::Written),
                None => {
                    ok = false; // reported
                    continue;
                }
            },
            (None, Some(Some(p))) => (p.shard[i].0, Some(p.shard[i].1), Source::Preset),
            (None, Some(None)) => {
                ok = false; // the preset's error is reported
                continue;
            }
            (None, None) => (MeshSpec::None, None, Source::Default),
        };
        let layout = |ctx: &mut Ctx, name: &str| {
            ranks.layout(ctx, spec, span.unwrap_or(item.name.span), name)
        };
        let mesh = match (source, preset) {
            (Source::Preset, Some(Some(p))) => {
                let at = (spec, p.shard[i].1);
                match from_preset.iter().find(|(k, _)| *k == at) {
                    Some((_, m)) => *m,
                    None => {
                        let name = match p.partition == span {
                            true => format!("`{}` partition", p.name),
                            false => format!("{key} mesh of `{}`", p.name),
                        };
                        let m = layout(ctx, &name);
                        from_preset.push((at, m));
                        m
                    }
                }
            }
            _ => layout(ctx, &format!("{key} mesh")),
        };
        match mesh {
            Some(mesh) => {
                factors[i] = Some(Factor {
                    key,
                    mesh,
                    span,
                    source,
                })
            }
            None => ok = false,
        }
    }
    rule3(ctx, ranks, &factors, preset.and_then(|p| p.as_ref()));
    let [Some(params), Some(grads), Some(optimizer)] = factors else {
        return None;
    };
    let nested =
        check_nesting(ctx, &params, &[grads, optimizer]) & check_nesting(ctx, &grads, &[optimizer]);
    (ok && nested).then_some([params, grads, optimizer])
}

/// Rule 3, a warning: a mesh that crosses nodes without filling them. A preset's partition is
/// warned about once, as the preset's.
fn rule3(
    ctx: &mut Ctx,
    ranks: &Ranks,
    factors: &[Option<Factor>; 3],
    preset: Option<&PresetDefaults>,
) {
    for (i, f) in factors.iter().enumerate() {
        let Some(f) = f else { continue };
        if f.mesh.inter <= 1 || u64::from(f.mesh.intra) >= ranks.g {
            continue;
        }
        let same = |g: &Option<Factor>| {
            g.is_some_and(|g| g.source == f.source && g.span == f.span && g.mesh == f.mesh)
        };
        if f.source == Source::Preset && factors[..i].iter().any(same) {
            continue;
        }
        let name = match preset {
            Some(p) if f.source == Source::Preset && p.partition == f.span => {
                format!("`{}` partition", p.name)
            }
            _ => format!("{} mesh", f.key),
        };
        let mut d = Diagnostic::warning(format!(
            "rule 3: the {name} {} crosses nodes without filling them ({} of {} GPUs per node)",
            f.mesh, f.mesh.intra, ranks.g
        ))
        .note(format!(
            "it sends across nodes what could stay inside one (AMSP eq. 7); consider a mesh with a = {} (the GPUs per node used)",
            ranks.g
        ));
        if let Some(span) = f.span {
            d = d.at(span, "partial-node mesh");
        }
        ctx.warn(d);
    }
}

/// Applies `f` to the value when present, else gives `default`.
fn opt<T>(
    ctx: &mut Ctx,
    v: Option<&Value>,
    default: T,
    f: impl FnOnce(&mut Ctx, &Value) -> Option<T>,
) -> Option<T> {
    match v {
        Some(v) => f(ctx, v),
        None => Some(default),
    }
}

/// Looks up the model or cluster a schedule names.
fn named<T>(
    ctx: &mut Ctx,
    r: &BlockReader,
    key: &str,
    items: &[(&BlockItem, Option<Arc<T>>)],
) -> Option<Arc<T>> {
    let v = r.value(key)?; // a missing key is reported by the caller
    let ValueKind::Ident(id) = &v.kind else {
        ctx.error(
            Diagnostic::error(format!(
                "expected the name of a {key}, found {}",
                v.kind.describe()
            ))
            .at(v.span, format!("write the {key}'s name")),
        );
        return None;
    };
    match items.iter().find(|(b, _)| b.name.name == id.name) {
        Some((_, resolved)) => resolved.clone(), // None: its own errors are already reported
        None => {
            let mut d = Diagnostic::error(format!("unknown {key} `{}`", id.name))
                .at(id.span, format!("no {key} of this name"));
            d = match did_you_mean(&id.name, items.iter().map(|(b, _)| b.name.name.as_str())) {
                Some(s) => d.note(format!("did you mean `{s}`?")),
                None if items.is_empty() => {
                    d.note(format!("no {key} is defined; did you forget an `import`?"))
                }
                None => d.note(format!(
                    "the {key}s in scope are {}",
                    list_some(items.iter().map(|(b, _)| b.name.name.as_str()), 12)
                )),
            };
            ctx.error(d);
            None
        }
    }
}

/// `nodes` or `gpus_per_node` used (as written, and checked as an integer), at most the cluster's.
fn used(
    ctx: &mut Ctx,
    written: Option<(&Value, Option<u64>)>,
    available: u64,
    noun: &str,
    cluster: &str,
) -> Option<u64> {
    let Some((v, n)) = written else {
        return Some(available);
    };
    let n = n?;
    if n > available {
        ctx.error(
            Diagnostic::error(format!(
                "the schedule uses {n} {noun} but cluster `{cluster}` has {available}"
            ))
            .at(v.span, format!("at most {available}")),
        );
        return None;
    }
    Some(n)
}

fn preset(ctx: &mut Ctx, v: &Value) -> Option<PresetDefaults> {
    let (id, args) = match &v.kind {
        ValueKind::Ident(id) => (id, None),
        ValueKind::Call(c) => (&c.callee, Some(c)),
        _ => {
            ctx.error(
                Diagnostic::error(format!(
                    "expected a preset such as `zero3` or `mics(partition = 8)`, found {}",
                    v.kind.describe()
                ))
                .at(v.span, "not a preset"),
            );
            return None;
        }
    };
    let k = choice(ctx, id, &PRESETS, "preset")?;
    let name = PRESETS[k];
    let param = match name {
        "mics" | "hsdp" => Some("partition"),
        "hpz" => Some("secondary"),
        _ => None,
    };
    let arg = match (param, args) {
        (None, None) => None,
        (None, Some(c)) => {
            ctx.error(
                Diagnostic::error(format!("preset `{name}` takes no arguments"))
                    .at(c.span, format!("write `{name}`")),
            );
            return None;
        }
        (Some(p), None) => {
            ctx.error(
                Diagnostic::error(format!("preset `{name}` needs `{p}`"))
                    .at(v.span, format!("write `{name}({p} = …)`"))
                    .note(format!("for example `{name}({p} = 8)`")),
            );
            return None;
        }
        (Some(p), Some(c)) => {
            let keys = [(p, Shape::Value)];
            let r = BlockReader::for_args(ctx, &format!("preset `{name}`"), &c.args, &keys);
            Some(r.required(ctx, p, &c.callee, &format!("preset `{name}`"), "8")?)
        }
    };
    let full = (MeshSpec::Full, v.span);
    let none = (MeshSpec::None, v.span);
    let shard = |shard| PresetDefaults {
        name,
        shard,
        partition: None,
        grad_sync: None,
        all_gather: None,
        reshard: None,
    };
    Some(match name {
        "ddp" => shard([none, none, none]),
        "zero1" => shard([none, none, full]),
        "zero2" => shard([none, full, full]),
        "zero3" | "fsdp" => shard([full, full, full]),
        "mics" | "hsdp" => {
            let arg = arg.expect("partition is required");
            let p = (mesh_spec(ctx, arg)?, arg.span);
            let mut d = shard([p, p, p]);
            d.partition = Some(arg.span);
            d.grad_sync = Some(GradSync::TwoHop);
            if name == "mics" {
                d.all_gather = Some(AllGatherAlgo::Hierarchical);
            }
            d
        }
        _ => {
            let arg = arg.expect("secondary is required");
            let k = expect_int(ctx, arg, 1, u64::from(u32::MAX), "`secondary`")?;
            let mut d = shard([full, full, full]);
            d.reshard = Some((
                ReshardAfterForward::Node {
                    secondary: k as u32,
                },
                arg.span,
            ));
            d
        }
    })
}

fn mesh_spec(ctx: &mut Ctx, v: &Value) -> Option<MeshSpec> {
    match &v.kind {
        ValueKind::Mesh(m) => match (m.a.value(), m.b.value()) {
            (Some(a), Some(b)) if a >= 1 && b >= 1 => Some(MeshSpec::Explicit(a, b)),
            (Some(_), Some(_)) => {
                ctx.error(
                    Diagnostic::error(format!(
                        "mesh factors must be at least 1, found {} x {}",
                        m.a.text, m.b.text
                    ))
                    .at(v.span, "a zero factor")
                    .note("`a x b` is a GPUs per node times b nodes; `none` is `1 x 1`"),
                );
                None
            }
            _ => {
                ctx.error(
                    Diagnostic::error(format!(
                        "mesh factor is too large: the limit is {}, found {} x {}",
                        u64::MAX,
                        m.a.text,
                        m.b.text
                    ))
                    .at(v.span, "too large"),
                );
                None
            }
        },
        ValueKind::Number(_) => expect_int(ctx, v, 1, u64::MAX, "a mesh size").map(MeshSpec::Int),
        ValueKind::Ident(id) => {
            choice(ctx, id, &["full", "none"], "mesh").map(|i| [MeshSpec::Full, MeshSpec::None][i])
        }
        _ => {
            ctx.error(
                Diagnostic::error(format!(
                    "expected a mesh such as `8 x 2`, `16`, `full` or `none`, found {}",
                    v.kind.describe()
                ))
                .at(v.span, "not a mesh"),
            );
            None
        }
    }
}

/// The ranks a schedule uses: G GPUs per node × N nodes; with a pipeline or tensor parallelism,
/// those of one stage's data-parallel mesh.
#[derive(Clone, Copy)]
struct Ranks {
    g: u64,
    n: u64,
    /// What the ranks are, for messages.
    over: Over,
}

/// Which ranks the shard meshes are laid out over.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Over {
    /// All the ranks used.
    All,
    /// A pipeline stage's data-parallel mesh.
    Stage,
    /// The data-parallel mesh of tensor parallelism without a pipeline: the ranks of one
    /// tensor index.
    DataParallel,
}

impl Ranks {
    /// "the 8 GPUs per node used", or of a (stage's) data-parallel mesh.
    fn gpus(&self) -> String {
        match self.over {
            Over::Stage => format!(
                "the {} GPUs per node of a stage's data-parallel mesh",
                self.g
            ),
            Over::DataParallel => {
                format!("the {} GPUs per node of the data-parallel mesh", self.g)
            }
            Over::All => format!("the {} GPUs per node used", self.g),
        }
    }

    /// "the 4 nodes used", or of a (stage's) data-parallel mesh.
    fn nodes(&self) -> String {
        match self.over {
            Over::Stage => format!("the {} nodes of a stage's data-parallel mesh", self.n),
            Over::DataParallel => format!("the {} nodes of the data-parallel mesh", self.n),
            Over::All => format!("the {} nodes used", self.n),
        }
    }

    /// Lays a mesh out as `a x b` and checks rule 1 (a | G, b | N); `key` names the mesh in
    /// messages ("params mesh", "`mics` partition").
    fn layout(&self, ctx: &mut Ctx, spec: MeshSpec, span: Span, key: &str) -> Option<Mesh> {
        let (a, b) = match spec {
            MeshSpec::Explicit(a, b) => (a, b),
            MeshSpec::None => (1, 1),
            MeshSpec::Full => (self.g, self.n),
            MeshSpec::Int(n) if n <= self.g => (n, 1),
            MeshSpec::Int(n) if n % self.g == 0 => (self.g, n / self.g),
            MeshSpec::Int(n) => {
                ctx.error(
                    Diagnostic::error(format!(
                        "the {key} {n} cannot be laid out: it is more than {} and not a multiple of it",
                        self.gpus()
                    ))
                    .at(span, format!("{n} ranks"))
                    .note("write it as `a x b`: a GPUs per node times b nodes"),
                );
                return None;
            }
        };
        let mut ok = true;
        // `checked_rem` rather than `%`: a zero factor does not divide either (and the crate
        // keeps to Rust 1.80, before `is_multiple_of`).
        if self.g.checked_rem(a) != Some(0) {
            ctx.error(
                Diagnostic::error(format!(
                    "rule 1: the {key} {a} x {b} needs a to divide {}",
                    self.gpus()
                ))
                .at(span, format!("{a} does not divide {}", self.g)),
            );
            ok = false;
        }
        if self.n.checked_rem(b) != Some(0) {
            ctx.error(
                Diagnostic::error(format!(
                    "rule 1: the {key} {a} x {b} needs b to divide {}",
                    self.nodes()
                ))
                .at(span, format!("{b} does not divide {}", self.n)),
            );
            ok = false;
        }
        ok.then_some(Mesh {
            intra: a as u32,
            inter: b as u32,
        })
    }
}

/// Rule 2: the inner factor divides the outer (`outer[0]`) in both dimensions. The factors after
/// the outer one are only for the suggestion when the outer one is defaulted.
fn check_nesting(ctx: &mut Ctx, inner: &Factor, outer: &[Factor]) -> bool {
    let Some(o) = outer.first() else { return true };
    if inner.mesh.divides(o.mesh) {
        return true;
    }
    let mut d = Diagnostic::error(format!(
        "rule 2: the factors must nest (s_p divides s_g divides s_os in each dimension), but {} {} does not divide {} {}",
        inner.key, inner.mesh, o.key, o.mesh
    ));
    for (f, primary) in [(inner, true), (o, false)] {
        let Some(span) = f.span else { continue };
        let label = format!("{} {}", f.key, f.mesh);
        d = match primary || d.labels.is_empty() {
            true => d.at(span, label),
            false => d.also(span, label),
        };
    }
    if o.source == Source::Default {
        // Suggest the inner mesh for it and for every later factor that is defaulted too.
        let defaulted: Vec<String> = outer
            .iter()
            .take_while(|f| f.source == Source::Default)
            .map(|f| format!("{} = {}", f.key, inner.mesh))
            .collect();
        d = d
            .note(format!(
                "`{}` is not written, so it defaults to `none` (1 x 1)",
                o.key
            ))
            .note(format!(
                "write `{}` in `shard {{ … }}`, or a mesh that {} divides",
                defaulted.join("  "),
                inner.mesh
            ));
    }
    ctx.error(d);
    false
}

/// `reshard_after_forward`: as written (its choice already checked, `None` after an error), else
/// the preset's, else `true`. hpZ's secondary shard must divide the GPUs per node used.
fn reshard_after_forward(
    ctx: &mut Ctx,
    written: Option<Option<usize>>,
    preset: &Option<Option<PresetDefaults>>,
    gpus: u64,
) -> Option<ReshardAfterForward> {
    let from_preset = preset_value(preset, |p| p.reshard);
    let value = match written {
        Some(choice) => match choice? {
            0 => ReshardAfterForward::True,
            1 => ReshardAfterForward::False,
            _ => from_preset.map_or(
                ReshardAfterForward::Node {
                    secondary: gpus as u32,
                },
                |(node, _)| node,
            ),
        },
        None => from_preset.map_or(ReshardAfterForward::True, |(node, _)| node),
    };
    if let (ReshardAfterForward::Node { secondary }, Some((_, span))) = (value, from_preset) {
        if gpus.checked_rem(u64::from(secondary)) != Some(0) {
            ctx.error(
                Diagnostic::error(format!(
                    "hpZ's secondary shard spans {secondary} GPUs, which must divide the {gpus} GPUs per node used"
                ))
                .at(span, format!("{secondary} does not divide {gpus}")),
            );
            return None;
        }
    }
    Some(value)
}

/// A `max_live` cap smaller than one layer's gathered parameters could never be met.
fn check_max_live(
    ctx: &mut Ctx,
    prefetch: &Prefetch,
    span: Option<Span>,
    model: &Model,
    params: Factor,
) {
    let (Some(cap), Some(span), true) = (prefetch.max_live, span, params.mesh.size() > 1) else {
        return;
    };
    // The first of the largest layers (the first to be gathered).
    let Some(big) = model.layers.iter().rev().max_by_key(|l| l.params) else {
        return;
    };
    let bytes = big.params.saturating_mul(model.dtype.bytes());
    if bytes > cap {
        ctx.error(
            Diagnostic::error(format!(
                "`max_live` is {} but layer `{}` alone gathers {} of parameters",
                human_bytes(cap),
                big.name,
                human_bytes(bytes)
            ))
            .at(span, "cap too small")
            .note(format!(
                "raise `max_live` to at least the largest layer's gathered parameters ({bytes} bytes), or write `max_live = unlimited`"
            )),
        );
    }
}

/// The optional knobs of a schedule, each with its default; `None` where an error was reported.
struct OptionalBlocks<'a> {
    prefetch: Option<Prefetch>,
    /// Where `prefetch.max_live` is written.
    max_live: Option<Span>,
    buckets: Option<Buckets>,
    recompute: Option<Recompute>,
    streams: Option<Streams>,
    overlap: Option<Overlap>,
    train: Option<TrainSpec<'a>>,
}

struct TrainSpec<'a> {
    steps: u64,
    lr: f64,
    seed: u64,
    data: Option<&'a sched_grammar::ast::StringLit>,
    clip: Option<f64>,
    checkpoints: Option<&'a sched_grammar::ast::StringLit>,
    save_every: Option<u64>,
    keep: Option<u64>,
    warmup: u64,
    decay: Decay,
    min_lr: f64,
    weight_decay: Option<f64>,
    betas: Option<[f64; 2]>,
    eps: Option<f64>,
    val: Option<&'a sched_grammar::ast::StringLit>,
    eval_every: Option<u64>,
    eval_batches: Option<u64>,
}

impl<'a> OptionalBlocks<'a> {
    fn read(ctx: &mut Ctx, r: &BlockReader<'a>) -> Self {
        let max_live = r
            .block("prefetch")
            .and_then(|b| b.entries.iter().find(|a| a.key.name == "max_live"))
            .map(|a| a.value.span);
        OptionalBlocks {
            prefetch: prefetch(ctx, r),
            max_live,
            buckets: buckets(ctx, r),
            recompute: opt(ctx, r.value("recompute"), Recompute::None, |ctx, v| {
                expect_choice(ctx, v, &["none", "full"], "recompute mode")
                    .map(|i| [Recompute::None, Recompute::Full][i])
            }),
            streams: opt(ctx, r.value("streams"), Streams::PerRole, |ctx, v| {
                expect_choice(ctx, v, &["single", "per_role", "per_link"], "stream layout")
                    .map(|i| [Streams::Single, Streams::PerRole, Streams::PerLink][i])
            }),
            overlap: overlap(ctx, r),
            train: train(ctx, r),
        }
    }

    /// The train settings, with `data` resolved against the schedule's file.
    fn train(&self, sources: &SourceMap, item: &BlockItem) -> Option<Train> {
        let t = self.train.as_ref()?;
        let dir = sources
            .get(item.span.file)
            .path
            .parent()
            .map(|p| p.to_path_buf())
            .unwrap_or_default();
        Some(Train {
            steps: t.steps,
            lr: t.lr,
            seed: t.seed,
            data: t.data.map(|s| dir.join(&s.value)),
            clip: t.clip,
            checkpoints: t.checkpoints.map(|s| dir.join(&s.value)),
            save_every: t.save_every,
            keep: t.keep,
            warmup: t.warmup,
            decay: t.decay,
            min_lr: t.min_lr,
            weight_decay: t.weight_decay,
            betas: t.betas,
            eps: t.eps,
            val: t.val.map(|s| dir.join(&s.value)),
            eval_every: t.eval_every,
            eval_batches: t.eval_batches,
        })
    }
}

fn prefetch(ctx: &mut Ctx, r: &BlockReader) -> Option<Prefetch> {
    let Some(b) = r.block("prefetch") else {
        return Some(Prefetch {
            forward: 1,
            backward: 1,
            max_live: None,
        });
    };
    let p = BlockReader::for_nested(ctx, "`prefetch`", b, PREFETCH_KEYS);
    let depth = |ctx: &mut Ctx, k: &str| {
        opt(ctx, p.value(k), 1, |ctx, v| {
            expect_int(ctx, v, 0, 1 << 20, &format!("`prefetch.{k}`"))
        })
    };
    let forward = depth(ctx, "forward");
    let backward = depth(ctx, "backward");
    let max_live = match p.value("max_live") {
        None => Some(None),
        Some(Value {
            kind: ValueKind::Ident(id),
            ..
        }) if id.name == "unlimited" => Some(None),
        Some(Value {
            kind: ValueKind::Ident(id),
            ..
        }) => {
            let mut d = Diagnostic::error(format!(
                "`prefetch.max_live` must be a size such as `4 GiB`, or `unlimited`, found `{}`",
                id.name
            ))
            .at(id.span, "expected a size or `unlimited`");
            if did_you_mean(&id.name, ["unlimited"]).is_some() {
                d = d.note("did you mean `unlimited`?");
            }
            ctx.error(d);
            None
        }
        Some(v) => match expect_bytes(ctx, v) {
            Some(0) => {
                ctx.error(
                    Diagnostic::error("`max_live` must be more than 0 bytes").at(v.span, "zero"),
                );
                None
            }
            b => b.map(Some),
        },
    };
    Some(Prefetch {
        forward: forward? as u32,
        backward: backward? as u32,
        max_live: max_live?,
    })
}

fn buckets(ctx: &mut Ctx, r: &BlockReader) -> Option<Buckets> {
    let Some(b) = r.block("buckets") else {
        return Some(Buckets {
            gather: 0,
            reduce: 0,
        });
    };
    let p = BlockReader::for_nested(ctx, "`buckets`", b, BUCKET_KEYS);
    let gather = opt(ctx, p.value("gather"), 0, expect_bytes);
    let reduce = opt(ctx, p.value("reduce"), 0, expect_bytes);
    Some(Buckets {
        gather: gather?,
        reduce: reduce?,
    })
}

fn overlap(ctx: &mut Ctx, r: &BlockReader) -> Option<Overlap> {
    let Some(b) = r.block("overlap") else {
        return Some(Overlap {
            gather: true,
            reduce: true,
            sync: true,
            refresh: Refresh::Overlap(true),
        });
    };
    let p = BlockReader::for_nested(ctx, "`overlap`", b, OVERLAP_KEYS);
    let flag = |ctx: &mut Ctx, k: &str| {
        opt(ctx, p.value(k), true, |ctx, v| {
            expect_bool(ctx, v, &format!("`overlap.{k}`"))
        })
    };
    let gather = flag(ctx, "gather");
    let reduce = flag(ctx, "reduce");
    let sync = flag(ctx, "sync");
    let refresh = opt(ctx, p.value("refresh"), Refresh::Overlap(true), |ctx, v| {
        expect_choice(ctx, v, &["false", "true", "next_forward"], "refresh mode").map(|i| match i {
            2 => Refresh::NextForward,
            i => Refresh::Overlap(i == 1),
        })
    });
    Some(Overlap {
        gather: gather?,
        reduce: reduce?,
        sync: sync?,
        refresh: refresh?,
    })
}

fn train<'a>(ctx: &mut Ctx, r: &BlockReader<'a>) -> Option<TrainSpec<'a>> {
    let Some(b) = r.block("train") else {
        return Some(TrainSpec {
            steps: 10,
            lr: 3e-4,
            seed: 0,
            data: None,
            clip: None,
            checkpoints: None,
            save_every: None,
            keep: None,
            warmup: 0,
            decay: Decay::Constant,
            min_lr: 0.0,
            weight_decay: None,
            betas: None,
            eps: None,
            val: None,
            eval_every: None,
            eval_batches: None,
        });
    };
    let p = BlockReader::for_nested(ctx, "`train`", b, TRAIN_KEYS);
    let steps = opt(ctx, p.value("steps"), 10, |ctx, v| {
        expect_int(ctx, v, 1, 1 << 40, "`train.steps`")
    });
    let lr = opt(ctx, p.value("lr"), 3e-4, |ctx, v| {
        positive(ctx, v, "`train.lr`")
    });
    let seed = opt(ctx, p.value("seed"), 0, |ctx, v| {
        expect_int(ctx, v, 0, u64::MAX, "`train.seed`")
    });
    let data = match p.value("data") {
        Some(v) => expect_string(ctx, v).map(Some),
        None => Some(None),
    };
    let clip = opt(ctx, p.value("clip"), None, |ctx, v| {
        positive(ctx, v, "`train.clip`").map(Some)
    });
    let checkpoints = match p.value("checkpoints") {
        Some(v) => expect_string(ctx, v).map(Some),
        None => Some(None),
    };
    let save_every = opt(ctx, p.value("save_every"), None, |ctx, v| {
        expect_int(ctx, v, 1, 1 << 40, "`train.save_every`").map(Some)
    });
    let keep = opt(ctx, p.value("keep"), None, |ctx, v| {
        expect_int(ctx, v, 1, 1 << 20, "`train.keep`").map(Some)
    });
    let warmup = opt(ctx, p.value("warmup"), 0, |ctx, v| {
        expect_int(ctx, v, 0, 1 << 40, "`train.warmup`")
    });
    let decay = opt(ctx, p.value("decay"), Decay::Constant, |ctx, v| {
        expect_choice(
            ctx,
            v,
            &["constant", "linear", "cosine"],
            "learning-rate decay",
        )
        .map(|i| [Decay::Constant, Decay::Linear, Decay::Cosine][i])
    });
    let min_lr = opt(ctx, p.value("min_lr"), 0.0, |ctx, v| {
        let x = expect_number(ctx, v)?;
        if x < 0.0 {
            ctx.error(
                Diagnostic::error(format!("`train.min_lr` must not be negative, found {x}"))
                    .at(v.span, "negative"),
            );
            return None;
        }
        Some(x)
    });
    if let (Some(lo), Some(hi), Some(v)) = (min_lr, lr, p.value("min_lr")) {
        if lo > hi {
            ctx.error(
                Diagnostic::error(format!(
                    "`train.min_lr` ({lo}) is above `train.lr` ({hi}): the decay would raise the rate"
                ))
                .at(v.span, "above lr"),
            );
        }
    }
    let weight_decay = opt(ctx, p.value("weight_decay"), None, |ctx, v| {
        let x = expect_number(ctx, v)?;
        if x < 0.0 {
            ctx.error(
                Diagnostic::error(format!(
                    "`train.weight_decay` must not be negative, found {x}"
                ))
                .at(v.span, "negative"),
            );
            return None;
        }
        Some(Some(x))
    });
    let betas = opt(ctx, p.value("betas"), None, |ctx, v| {
        let ValueKind::List(items) = &v.kind else {
            ctx.error(
                Diagnostic::error("`train.betas` is a list of two numbers, as [0.9, 0.95]")
                    .at(v.span, "not a list"),
            );
            return None;
        };
        let xs: Vec<f64> = items
            .iter()
            .map(|i| expect_number(ctx, i))
            .collect::<Option<_>>()?;
        match xs.as_slice() {
            [a, b] if (0.0..1.0).contains(a) && (0.0..1.0).contains(b) => Some(Some([*a, *b])),
            _ => {
                ctx.error(
                    Diagnostic::error(format!(
                        "`train.betas` must be two numbers in [0, 1), found {xs:?}"
                    ))
                    .at(v.span, "not two betas"),
                );
                None
            }
        }
    });
    let eps = opt(ctx, p.value("eps"), None, |ctx, v| {
        positive(ctx, v, "`train.eps`").map(Some)
    });
    let val = match p.value("val") {
        Some(v) => expect_string(ctx, v).map(Some),
        None => Some(None),
    };
    let eval_every = opt(ctx, p.value("eval_every"), None, |ctx, v| {
        expect_int(ctx, v, 1, 1 << 40, "`train.eval_every`").map(Some)
    });
    let eval_batches = opt(ctx, p.value("eval_batches"), None, |ctx, v| {
        expect_int(ctx, v, 1, 1 << 20, "`train.eval_batches`").map(Some)
    });
    if p.value("val").is_none() {
        for key in ["eval_every", "eval_batches"] {
            if let Some(v) = p.value(key) {
                ctx.error(
                    Diagnostic::error(format!(
                        "`train.{key}` sets the validation loss, but there is no `train.val` file"
                    ))
                    .at(v.span, "without `val`"),
                );
            }
        }
    }
    Some(TrainSpec {
        weight_decay: weight_decay?,
        betas: betas?,
        eps: eps?,
        val: val?,
        eval_every: eval_every?,
        eval_batches: eval_batches?,
        warmup: warmup?,
        decay: decay?,
        min_lr: min_lr?,
        steps: steps?,
        lr: lr?,
        seed: seed?,
        data: data?,
        clip: clip?,
        checkpoints: checkpoints?,
        save_every: save_every?,
        keep: keep?,
    })
}

fn positive(ctx: &mut Ctx, v: &Value, what: &str) -> Option<f64> {
    let x = expect_number(ctx, v)?;
    if x > 0.0 {
        Some(x)
    } else {
        ctx.error(
            Diagnostic::error(format!("{what} must be positive, found {x}"))
                .at(v.span, "not positive"),
        );
        None
    }
}
