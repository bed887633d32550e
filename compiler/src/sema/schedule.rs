//! Resolving `schedule` blocks into [`Job`]s: names, presets, meshes and the rules of `dsl.md`.
//!
//! Order: find the model and cluster; fix the ranks used (G GPUs per node × N nodes, each at most
//! the cluster's); expand the preset into defaults; let explicit keys override them one by one
//! (`shard { params = … }` overrides only s_p); lay every mesh out as `a x b` (a plain integer
//! `n` is `n x 1` up to G, else `G x n/G`; `full` is `G x N`); then check mesh rule 1
//! (divisibility), rule 2 (s_p | s_g | s_os per dimension) and warn on rule 3 (a mesh that
//! crosses nodes without filling them). A few checks beyond the spec protect later stages:
//! hpZ's secondary shard size divides G, and a `max_live` cap holds at least the largest
//! gathered layer.

use super::values::*;
use super::Ctx;
use crate::job::*;
use sched_grammar::ast::{BlockItem, Value, ValueKind};
use sched_grammar::diag::{did_you_mean, Diagnostic, SourceMap, Span};
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
];
const SHARD_KEYS: &[(&str, Shape)] = &[("params", Shape::Value), ("grads", Shape::Value), ("optimizer", Shape::Value)];
const PREFETCH_KEYS: &[(&str, Shape)] =
    &[("forward", Shape::Value), ("backward", Shape::Value), ("max_live", Shape::Value)];
const BUCKET_KEYS: &[(&str, Shape)] = &[("gather", Shape::Value), ("reduce", Shape::Value)];
const OVERLAP_KEYS: &[(&str, Shape)] =
    &[("gather", Shape::Value), ("reduce", Shape::Value), ("sync", Shape::Value), ("refresh", Shape::Value)];
const TRAIN_KEYS: &[(&str, Shape)] = &[
    ("steps", Shape::Value),
    ("lr", Shape::Value),
    ("seed", Shape::Value),
    ("data", Shape::Value),
    ("clip", Shape::Value),
];
const PRESETS: [&str; 8] = ["ddp", "zero1", "zero2", "zero3", "fsdp", "mics", "hsdp", "hpz"];

/// Items visible to schedules, with what resolved of them.
pub(crate) struct Env<'a> {
    pub clusters: &'a [(&'a BlockItem, Option<Arc<Cluster>>)],
    pub models: &'a [(&'a BlockItem, Option<Arc<Model>>)],
    pub sources: &'a SourceMap,
}

/// A mesh as written, before the ranks used are known.
#[derive(Clone, Copy)]
enum MeshSpec {
    Explicit(u64, u64),
    Int(u64),
    Full,
    None,
}

/// The shard factors and other knobs a preset sets.
struct PresetDefaults {
    shard: [(MeshSpec, Span); 3],
    grad_sync: Option<GradSync>,
    all_gather: Option<AllGatherAlgo>,
    reshard: Option<ReshardAfterForward>,
}

pub(crate) fn resolve(ctx: &mut Ctx, env: &Env, item: &BlockItem) -> Option<Job> {
    let what = format!("schedule `{}`", item.name.name);
    let r = BlockReader::new(ctx, &what, &item.body.entries, KEYS, Extras::default());
    let model = named(ctx, &r, "model", item, &what, env.models);
    let cluster = named(ctx, &r, "cluster", item, &what, env.clusters);
    let micro_steps = opt(ctx, r.value("micro_steps"), 1, |ctx, v| expect_int(ctx, v, 1, 1 << 20, "`micro_steps`"));
    let preset = r.value("preset").map(|v| preset(ctx, v));
    let opt_blocks = OptionalBlocks::read(ctx, &r);
    let (model, cluster) = (model?, cluster?);

    let nodes = used(ctx, &r, "nodes", u64::from(cluster.nodes), &cluster.name)?;
    let gpus = used(ctx, &r, "gpus_per_node", u64::from(cluster.gpus_per_node), &cluster.name)?;
    let ranks = Ranks { g: gpus, n: nodes };
    let preset = match preset {
        Some(p) => Some(p?),
        None => None,
    };

    // Shard factors: explicit keys over the preset over `none`.
    let shard_block = r.block("shard").map(|b| BlockReader::for_nested(ctx, "`shard`", b, SHARD_KEYS));
    let mut meshes = [None; 3];
    for (i, key) in ["params", "grads", "optimizer"].into_iter().enumerate() {
        let written = shard_block.as_ref().and_then(|s| s.value(key));
        let (spec, span) = match written {
            Some(v) => (mesh_spec(ctx, v)?, v.span),
            None => preset.as_ref().map_or((MeshSpec::None, item.name.span), |p| p.shard[i]),
        };
        meshes[i] = ranks.layout(ctx, spec, span, key).map(|m| (m, span));
    }
    let [(params, sp_span), (grads, sg_span), (optimizer, so_span)] = [meshes[0]?, meshes[1]?, meshes[2]?];
    check_nesting(ctx, ("params", params, sp_span), ("grads", grads, sg_span))?;
    check_nesting(ctx, ("grads", grads, sg_span), ("optimizer", optimizer, so_span))?;
    for (key, mesh, span) in [("params", params, sp_span), ("grads", grads, sg_span), ("optimizer", optimizer, so_span)] {
        if mesh.inter > 1 && u64::from(mesh.intra) < gpus {
            ctx.warn(
                Diagnostic::warning(format!(
                    "rule 3: the {key} mesh {mesh} crosses nodes without filling them ({} of {gpus} GPUs per node)",
                    mesh.intra
                ))
                .at(span, "partial-node mesh")
                .note("it sends across nodes what could stay inside one (AMSP eq. 7); consider a mesh with a = gpus_per_node"),
            );
        }
    }

    let grad_sync = match r.value("grad_sync") {
        Some(v) => expect_choice(ctx, v, &["two_hop", "flat"], "gradient synchronisation")
            .map(|i| [GradSync::TwoHop, GradSync::Flat][i]),
        None => Some(preset.as_ref().and_then(|p| p.grad_sync).unwrap_or(GradSync::TwoHop)),
    };
    let all_gather = match r.value("all_gather") {
        Some(v) => expect_choice(ctx, v, &["flat", "hierarchical"], "all-gather algorithm")
            .map(|i| [AllGatherAlgo::Flat, AllGatherAlgo::Hierarchical][i]),
        None => Some(preset.as_ref().and_then(|p| p.all_gather).unwrap_or(AllGatherAlgo::Flat)),
    };
    let reshard = reshard(ctx, &r, preset.as_ref(), gpus)?;
    let prefetch = opt_blocks.prefetch?;
    check_max_live(ctx, &r, &prefetch, &model, params);

    Some(Job {
        schedule: Schedule {
            name: item.name.name.clone(),
            preset: r.value("preset").map(|v| env.sources.get(v.span.file).text[v.span.range()].to_string()),
            nodes: nodes as u32,
            gpus_per_node: gpus as u32,
            micro_steps: micro_steps? as u32,
            shard: Shard { params, grads, optimizer },
            reshard_after_forward: reshard,
            grad_sync: grad_sync?,
            all_gather: all_gather?,
            prefetch,
            buckets: opt_blocks.buckets?,
            recompute: opt_blocks.recompute?,
            streams: opt_blocks.streams?,
            overlap: opt_blocks.overlap?,
            train: opt_blocks.train(env.sources, item)?,
        },
        model,
        cluster,
    })
}

/// Applies `f` to the value when present, else gives `default`.
fn opt<T>(ctx: &mut Ctx, v: Option<&Value>, default: T, f: impl FnOnce(&mut Ctx, &Value) -> Option<T>) -> Option<T> {
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
    item: &BlockItem,
    what: &str,
    items: &[(&BlockItem, Option<Arc<T>>)],
) -> Option<Arc<T>> {
    let v = r.required(ctx, key, &item.name, what, "NAME")?;
    let ValueKind::Ident(id) = &v.kind else {
        ctx.error(
            Diagnostic::error(format!("expected the name of a {key}, found {}", v.kind.describe()))
                .at(v.span, format!("write the {key}'s name")),
        );
        return None;
    };
    match items.iter().find(|(b, _)| b.name.name == id.name) {
        Some((_, resolved)) => resolved.clone(), // None: its own errors are already reported
        None => {
            let mut d = Diagnostic::error(format!("unknown {key} `{}`", id.name)).at(id.span, format!("no {key} of this name"));
            d = match did_you_mean(&id.name, items.iter().map(|(b, _)| b.name.name.as_str())) {
                Some(s) => d.note(format!("did you mean `{s}`?")),
                None if items.is_empty() => d.note(format!("no {key} is defined; did you forget an `import`?")),
                None => d.note(format!(
                    "the {key}s in scope are {}",
                    list(items.iter().map(|(b, _)| b.name.name.as_str()))
                )),
            };
            ctx.error(d);
            None
        }
    }
}

/// `nodes` or `gpus_per_node` used, at most the cluster's.
fn used(ctx: &mut Ctx, r: &BlockReader, key: &str, available: u64, cluster: &str) -> Option<u64> {
    let Some(v) = r.value(key) else { return Some(available) };
    let n = expect_int(ctx, v, 1, u64::MAX, &format!("`{key}`"))?;
    if n > available {
        ctx.error(
            Diagnostic::error(format!("the schedule uses {n} {} but cluster `{cluster}` has {available}", key.replace('_', " ")))
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
                Diagnostic::error(format!("expected a preset such as `zero3` or `mics(partition = 8)`, found {}", v.kind.describe()))
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
            ctx.error(Diagnostic::error(format!("preset `{name}` takes no arguments")).at(c.span, format!("write `{name}`")));
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
    Some(match name {
        "ddp" => PresetDefaults::shard([none, none, none]),
        "zero1" => PresetDefaults::shard([none, none, full]),
        "zero2" => PresetDefaults::shard([none, full, full]),
        "zero3" | "fsdp" => PresetDefaults::shard([full, full, full]),
        "mics" | "hsdp" => {
            let arg = arg.expect("partition is required");
            let p = (mesh_spec(ctx, arg)?, arg.span);
            let mut d = PresetDefaults::shard([p, p, p]);
            d.grad_sync = Some(GradSync::TwoHop);
            if name == "mics" {
                d.all_gather = Some(AllGatherAlgo::Hierarchical);
            }
            d
        }
        _ => {
            let arg = arg.expect("secondary is required");
            let k = expect_int(ctx, arg, 1, u64::from(u32::MAX), "`secondary`")?;
            let mut d = PresetDefaults::shard([full, full, full]);
            d.reshard = Some(ReshardAfterForward::Node { secondary: k as u32 });
            d
        }
    })
}

impl PresetDefaults {
    fn shard(shard: [(MeshSpec, Span); 3]) -> Self {
        PresetDefaults { shard, grad_sync: None, all_gather: None, reshard: None }
    }
}

fn mesh_spec(ctx: &mut Ctx, v: &Value) -> Option<MeshSpec> {
    match &v.kind {
        ValueKind::Mesh(m) => match (m.a.value(), m.b.value()) {
            (Some(a), Some(b)) => Some(MeshSpec::Explicit(a, b)),
            _ => {
                ctx.error(Diagnostic::error("mesh factor is too large").at(v.span, "too large"));
                None
            }
        },
        ValueKind::Number(_) => expect_int(ctx, v, 1, u64::MAX, "a mesh size").map(MeshSpec::Int),
        ValueKind::Ident(id) => choice(ctx, id, &["full", "none"], "mesh").map(|i| [MeshSpec::Full, MeshSpec::None][i]),
        _ => {
            ctx.error(
                Diagnostic::error(format!("expected a mesh such as `8 x 2`, `16`, `full` or `none`, found {}", v.kind.describe()))
                    .at(v.span, "not a mesh"),
            );
            None
        }
    }
}

/// The ranks a schedule uses: G GPUs per node × N nodes.
struct Ranks {
    g: u64,
    n: u64,
}

impl Ranks {
    /// Lays a mesh out as `a x b` and checks rule 1 (a | G, b | N).
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
                        "the {key} mesh {n} cannot be laid out: it is more than the {} GPUs per node used and not a multiple of it",
                        self.g
                    ))
                    .at(span, format!("{n} ranks"))
                    .note("write it as `a x b`: a GPUs per node times b nodes"),
                );
                return None;
            }
        };
        let mut ok = true;
        if a == 0 || self.g % a != 0 {
            ctx.error(
                Diagnostic::error(format!(
                    "rule 1: the {key} mesh {a} x {b} needs a to divide the {} GPUs per node used",
                    self.g
                ))
                .at(span, format!("{a} does not divide {}", self.g)),
            );
            ok = false;
        }
        if b == 0 || self.n % b != 0 {
            ctx.error(
                Diagnostic::error(format!("rule 1: the {key} mesh {a} x {b} needs b to divide the {} nodes used", self.n))
                    .at(span, format!("{b} does not divide {}", self.n)),
            );
            ok = false;
        }
        ok.then_some(Mesh { intra: a as u32, inter: b as u32 })
    }
}

/// Rule 2: the inner factor divides the outer in both dimensions.
fn check_nesting(ctx: &mut Ctx, inner: (&str, Mesh, Span), outer: (&str, Mesh, Span)) -> Option<()> {
    if inner.1.divides(outer.1) {
        return Some(());
    }
    ctx.error(
        Diagnostic::error(format!(
            "rule 2: the factors must nest (s_p divides s_g divides s_os in each dimension), but {} {} does not divide {} {}",
            inner.0, inner.1, outer.0, outer.1
        ))
        .at(inner.2, format!("{} {}", inner.0, inner.1))
        .also(outer.2, format!("{} {}", outer.0, outer.1)),
    );
    None
}

fn reshard(ctx: &mut Ctx, r: &BlockReader, preset: Option<&PresetDefaults>, gpus: u64) -> Option<ReshardAfterForward> {
    let value = match r.value("reshard_after_forward") {
        Some(v) => match expect_choice(ctx, v, &["true", "false", "node"], "value for `reshard_after_forward`")? {
            0 => ReshardAfterForward::True,
            1 => ReshardAfterForward::False,
            _ => match preset.and_then(|p| p.reshard) {
                Some(node) => node,
                None => ReshardAfterForward::Node { secondary: gpus as u32 },
            },
        },
        None => preset.and_then(|p| p.reshard).unwrap_or(ReshardAfterForward::True),
    };
    if let ReshardAfterForward::Node { secondary } = value {
        if gpus % u64::from(secondary) != 0 {
            let span = r.key_span("preset").or(r.key_span("reshard_after_forward")).unwrap_or_default();
            ctx.error(
                Diagnostic::error(format!(
                    "hpZ's secondary shard spans {secondary} GPUs, which must divide the {gpus} GPUs per node used"
                ))
                .at(span, format!("secondary = {secondary}")),
            );
            return None;
        }
    }
    Some(value)
}

/// A `max_live` cap smaller than one layer's gathered parameters could never be met.
fn check_max_live(ctx: &mut Ctx, r: &BlockReader, prefetch: &Prefetch, model: &Model, params: Mesh) {
    let (Some(cap), true) = (prefetch.max_live, params.size() > 1) else { return };
    let Some(big) = model.layers.iter().max_by_key(|l| l.params) else { return };
    let bytes = big.params.saturating_mul(model.dtype.bytes());
    if bytes > cap {
        let span = r.block("prefetch").map_or_else(Span::default, |b| b.key.span);
        ctx.error(
            Diagnostic::error(format!(
                "`max_live` is {cap} bytes but layer `{}` alone gathers {bytes} bytes of parameters",
                big.name
            ))
            .at(span, "cap too small")
            .note("raise `max_live` to at least the largest layer's gathered parameters"),
        );
    }
}

/// The optional knobs of a schedule, each with its default; `None` where an error was reported.
struct OptionalBlocks<'a> {
    prefetch: Option<Prefetch>,
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
}

impl<'a> OptionalBlocks<'a> {
    fn read(ctx: &mut Ctx, r: &BlockReader<'a>) -> Self {
        OptionalBlocks {
            prefetch: prefetch(ctx, r),
            buckets: buckets(ctx, r),
            recompute: opt(ctx, r.value("recompute"), Recompute::None, |ctx, v| {
                expect_choice(ctx, v, &["none", "full"], "recompute mode").map(|i| [Recompute::None, Recompute::Full][i])
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
        let dir = sources.get(item.span.file).path.parent().map(|p| p.to_path_buf()).unwrap_or_default();
        Some(Train { steps: t.steps, lr: t.lr, seed: t.seed, data: t.data.map(|s| dir.join(&s.value)), clip: t.clip })
    }
}

fn prefetch(ctx: &mut Ctx, r: &BlockReader) -> Option<Prefetch> {
    let Some(b) = r.block("prefetch") else {
        return Some(Prefetch { forward: 1, backward: 1, max_live: None });
    };
    let p = BlockReader::for_nested(ctx, "`prefetch`", b, PREFETCH_KEYS);
    let depth =
        |ctx: &mut Ctx, k: &str| opt(ctx, p.value(k), 1, |ctx, v| expect_int(ctx, v, 0, 1 << 20, &format!("`prefetch.{k}`")));
    let forward = depth(ctx, "forward");
    let backward = depth(ctx, "backward");
    let max_live = match p.value("max_live") {
        None => Some(None),
        Some(Value { kind: ValueKind::Ident(id), .. }) => choice(ctx, id, &["unlimited"], "limit").map(|_| None),
        Some(v) => match expect_bytes(ctx, v) {
            Some(0) => {
                ctx.error(Diagnostic::error("`max_live` must be more than 0 bytes").at(v.span, "zero"));
                None
            }
            b => b.map(Some),
        },
    };
    Some(Prefetch { forward: forward? as u32, backward: backward? as u32, max_live: max_live? })
}

fn buckets(ctx: &mut Ctx, r: &BlockReader) -> Option<Buckets> {
    let Some(b) = r.block("buckets") else { return Some(Buckets { gather: 0, reduce: 0 }) };
    let p = BlockReader::for_nested(ctx, "`buckets`", b, BUCKET_KEYS);
    let gather = opt(ctx, p.value("gather"), 0, expect_bytes);
    let reduce = opt(ctx, p.value("reduce"), 0, expect_bytes);
    Some(Buckets { gather: gather?, reduce: reduce? })
}

fn overlap(ctx: &mut Ctx, r: &BlockReader) -> Option<Overlap> {
    let Some(b) = r.block("overlap") else {
        return Some(Overlap { gather: true, reduce: true, sync: true, refresh: Refresh::Overlap(true) });
    };
    let p = BlockReader::for_nested(ctx, "`overlap`", b, OVERLAP_KEYS);
    let flag = |ctx: &mut Ctx, k: &str| opt(ctx, p.value(k), true, |ctx, v| expect_bool(ctx, v, "overlap switch"));
    let gather = flag(ctx, "gather");
    let reduce = flag(ctx, "reduce");
    let sync = flag(ctx, "sync");
    let refresh = opt(ctx, p.value("refresh"), Refresh::Overlap(true), |ctx, v| {
        expect_choice(ctx, v, &["false", "true", "next_forward"], "refresh mode").map(|i| match i {
            2 => Refresh::NextForward,
            i => Refresh::Overlap(i == 1),
        })
    });
    Some(Overlap { gather: gather?, reduce: reduce?, sync: sync?, refresh: refresh? })
}

fn train<'a>(ctx: &mut Ctx, r: &BlockReader<'a>) -> Option<TrainSpec<'a>> {
    let Some(b) = r.block("train") else {
        return Some(TrainSpec { steps: 10, lr: 3e-4, seed: 0, data: None, clip: None });
    };
    let p = BlockReader::for_nested(ctx, "`train`", b, TRAIN_KEYS);
    let steps = opt(ctx, p.value("steps"), 10, |ctx, v| expect_int(ctx, v, 1, 1 << 40, "`train.steps`"));
    let lr = opt(ctx, p.value("lr"), 3e-4, |ctx, v| positive(ctx, v, "`train.lr`"));
    let seed = opt(ctx, p.value("seed"), 0, |ctx, v| expect_int(ctx, v, 0, u64::MAX, "`train.seed`"));
    let data = match p.value("data") {
        Some(v) => expect_string(ctx, v).map(Some),
        None => Some(None),
    };
    let clip = opt(ctx, p.value("clip"), None, |ctx, v| positive(ctx, v, "`train.clip`").map(Some));
    Some(TrainSpec { steps: steps?, lr: lr?, seed: seed?, data: data?, clip: clip? })
}

fn positive(ctx: &mut Ctx, v: &Value, what: &str) -> Option<f64> {
    let x = expect_number(ctx, v)?;
    if x > 0.0 {
        Some(x)
    } else {
        ctx.error(Diagnostic::error(format!("{what} must be positive, found {x}")).at(v.span, "not positive"));
        None
    }
}
