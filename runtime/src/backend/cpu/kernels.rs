//! The CPU backend's kernels: each [`Action`] on one rank, reading and writing its arena at the
//! plan's offsets. Values are converted to f32 on the way in and rounded to the buffer's dtype on
//! the way out (`runtime.md`: bf16 storage, fp32 compute).

use super::RankCtx;
use crate::arena::{AccessError, Arena};
use crate::backend::{Batch, StepInput};
use crate::exec::{Action, GradPart};
use crate::math::{cross_entropy, optimizer_step, Input, OptimizerConfig, Stored};
use schedc::ir::{Region, ShardIndex};
use schedc::job::{Dtype, LayerKind};

/// Runs one compute action on `ctx`'s rank; returns the loss sum it adds (loss ops only).
pub fn run(ctx: &RankCtx, a: &Action, m: Option<u32>, input: &StepInput) -> Result<f64, String> {
    let batch = |m: Option<u32>| -> Result<&Batch, String> {
        let m = m.ok_or("a layer op without a micro-step")? as usize;
        input.batches[ctx.local]
            .get(m)
            .ok_or(format!("no batch for micro-step {m}"))
    };
    let e = |e: AccessError| e.0;
    match a {
        Action::Forward {
            layer,
            params,
            tied,
            input: hidden,
            output,
            saved,
        } => {
            let math = &ctx.plan.maths[*layer];
            let p = ctx.read_opt(params, math.params())?;
            let t = ctx.tied(*layer, tied)?;
            let x = ctx.read_opt(hidden, math.input_elements())?;
            let b = batch(m)?;
            let input = match &x {
                Some(x) => Input::Hidden(x),
                None => Input::Tokens(&b.inputs),
            };
            let mut out = ctx.scratch(math.output_elements());
            let mut keep = ctx.scratch(math.saved_elements());
            math.forward(
                p.as_deref().unwrap_or(&[]),
                t.as_deref(),
                input,
                &mut out,
                &mut keep,
            );
            if let Some(o) = output {
                ctx.write(o, &out)?;
            }
            if let Some(s) = saved {
                ctx.write_saved(*layer, s, &keep)?;
            }
            Ok(0.0)
        }
        Action::Backward {
            layer,
            params,
            tied,
            saved,
            input: hidden,
            grad_output,
            grad_input,
            grads,
            tied_grads,
        } => {
            let math = &ctx.plan.maths[*layer];
            let p = ctx.read_opt(params, math.params())?;
            let t = ctx.tied(*layer, tied)?;
            let keep = match saved {
                Some(s) => ctx.read_saved(*layer, s)?,
                None => ctx.zeros(0),
            };
            let x = ctx.read_opt(hidden, math.input_elements())?;
            let b = batch(m)?;
            let input = match &x {
                Some(x) => Input::Hidden(x),
                None => Input::Tokens(&b.inputs),
            };
            let dy = ctx.read(grad_output, math.output_elements())?;
            let mut dx = grad_input.map(|_| ctx.scratch(math.input_elements()));
            let mut dp = ctx.scratch(math.params());
            let mut dt = t.as_ref().map(|t| ctx.scratch(t.len()));
            math.backward(
                p.as_deref().unwrap_or(&[]),
                t.as_deref(),
                &keep,
                input,
                &dy,
                dx.as_deref_mut(),
                &mut dp,
                dt.as_deref_mut(),
            );
            if let (Some(r), Some(dx)) = (grad_input, &dx) {
                ctx.write(r, dx)?;
            }
            ctx.write_grads(grads, &dp)?;
            if let Some(dt) = &dt {
                ctx.write_grads(tied_grads, dt)?;
            }
            Ok(0.0)
        }
        Action::Loss { logits, grad } => {
            let b = batch(m)?;
            let n = b.targets.len();
            let vocab = match ctx.plan.job.model.layers.last().map(|l| l.kind) {
                Some(LayerKind::LmHead { vocab, .. }) => vocab as usize,
                _ => return Err("the model does not end in an lm_head".into()),
            };
            let z = ctx.read(logits, n * vocab)?;
            let mut dz = ctx.scratch(n * vocab);
            let loss = cross_entropy(&z, &b.targets, vocab, &mut dz);
            ctx.write(grad, &dz)?;
            Ok(loss)
        }
        Action::Update {
            layer,
            grad,
            state,
            param,
            sumsq,
        } => {
            let plan = ctx.plan;
            let job = &plan.job;
            let contributions = f64::from(plan.program.ranks) * f64::from(plan.program.micro_steps);
            let factor = match (sumsq, input.clip) {
                (Some(s), Some(clip)) => {
                    let norm = f64::from(ctx.read(s, 1)?[0]).sqrt() / contributions;
                    (clip / (norm + 1e-6)).min(1.0)
                }
                _ => 1.0,
            };
            let n = ctx.elements(grad) as usize;
            let g = ctx.read(grad, n)?;
            let mut st = ctx.read(state, ctx.elements(state) as usize)?;
            let first = plan.index(ctx.rank, ShardIndex::Optimizer) as usize * n;
            let cfg = OptimizerConfig::new(job.model.optimizer, input.lr);
            optimizer_step(
                &cfg,
                &mut st,
                &g,
                (factor / contributions) as f32,
                input.step,
                first,
                &plan.decay[*layer],
            );
            ctx.write(state, &st)?;
            ctx.write(param, &st[..n])?;
            Ok(0.0)
        }
        Action::GradNorm { grads, sumsq } => {
            let mut total = 0.0f64;
            for g in grads {
                let v = ctx.read(g, ctx.elements(g) as usize)?;
                total += v.iter().map(|x| f64::from(*x) * f64::from(*x)).sum::<f64>();
            }
            ctx.write(sumsq, &[total as f32])?;
            Ok(0.0)
        }
        Action::Accumulate { from, acc } => {
            let v = ctx.read(from, ctx.elements(from) as usize)?;
            let at = ctx.plan.at(ctx.rank, acc);
            ctx.arena().add(at, ctx.dtype(acc), &v).map_err(e)?;
            Ok(0.0)
        }
        Action::Copy { from, to } => {
            let mut bytes = vec![];
            for r in from {
                bytes.extend(
                    ctx.arena()
                        .read_bytes(ctx.plan.at(ctx.rank, r), r.bytes)
                        .map_err(e)?,
                );
            }
            let mut rest = &bytes[..];
            for r in to {
                let (now, later) = rest.split_at((r.bytes / 2) as usize);
                ctx.arena()
                    .write_bytes(ctx.plan.at(ctx.rank, r), now)
                    .map_err(e)?;
                rest = later;
            }
            Ok(0.0)
        }
        Action::Collectives(_) => unreachable!("collectives run through the rendezvous"),
    }
}

impl RankCtx<'_> {
    pub fn arena(&self) -> &Arena {
        &self.arenas[self.rank as usize]
    }

    fn dtype(&self, r: &Region) -> Dtype {
        self.plan.program.buffers[r.buffer].dtype
    }

    fn elements(&self, r: &Region) -> u64 {
        r.bytes / self.dtype(r).bytes()
    }

    /// A zeroed scratch vector of `n` values from the stream's pool.
    fn zeros(&self, n: usize) -> Buf<'_> {
        let mut v = self.scratch(n);
        v.fill(0.0);
        v
    }

    /// A scratch vector of `n` values from the stream's pool, holding stale values: only for
    /// outputs the math overwrites completely (its contract).
    fn scratch(&self, n: usize) -> Buf<'_> {
        let mut v = self.scratch.borrow_mut().pop().unwrap_or_default();
        v.resize(n, 0.0);
        Buf {
            v,
            pool: &self.scratch,
        }
    }

    /// The first `n` values of `r`.
    fn read(&self, r: &Region, n: usize) -> Result<Buf<'_>, String> {
        if (n as u64) > self.elements(r) {
            return Err(format!(
                "reads {n} values from a region of {}",
                self.elements(r)
            ));
        }
        let mut v = self.scratch(n);
        self.arena()
            .read_into(self.plan.at(self.rank, r), self.dtype(r), &mut v)
            .map_err(|e| e.0)?;
        Ok(v)
    }

    fn read_opt(&self, r: &Option<Region>, n: usize) -> Result<Option<Buf<'_>>, String> {
        r.as_ref().map(|r| self.read(r, n)).transpose()
    }

    /// A tied head's embedding matrix: the first vocab × hidden values of the embedding's
    /// parameters (zeros for a recompute, which needs only the saved activations).
    fn tied(&self, layer: usize, r: &Option<Region>) -> Result<Option<Buf<'_>>, String> {
        let LayerKind::LmHead {
            tied: true,
            vocab,
            hidden,
            ..
        } = self.plan.job.model.layers[layer].kind
        else {
            return Ok(None);
        };
        let n = (vocab * hidden) as usize;
        match r {
            Some(r) => self.read(r, n).map(Some),
            None => Ok(Some(self.zeros(n))),
        }
    }

    fn write(&self, r: &Region, v: &[f32]) -> Result<(), String> {
        if v.len() as u64 > self.elements(r) {
            return Err(format!(
                "writes {} values into a region of {}",
                v.len(),
                self.elements(r)
            ));
        }
        self.arena()
            .write(self.plan.at(self.rank, r), self.dtype(r), v)
            .map_err(|e| e.0)
    }

    /// Writes (or adds) a layer's gradient into its parts; elements past the gradient (the
    /// padding up to a multiple of the optimizer shards) are zero.
    fn write_grads(&self, parts: &[GradPart], grad: &[f32]) -> Result<(), String> {
        for part in parts {
            let n = self.elements(&part.region) as usize;
            let mut v = self.zeros(n);
            let lo = part.first.min(grad.len());
            let hi = (part.first + n).min(grad.len());
            v[..hi - lo].copy_from_slice(&grad[lo..hi]);
            let at = self.plan.at(self.rank, &part.region);
            let d = self.dtype(&part.region);
            if part.accumulate {
                self.arena().add(at, d, &v)
            } else {
                self.arena().write(at, d, &v)
            }
            .map_err(|e| e.0)?;
        }
        Ok(())
    }

    /// Saved activations, segment by segment: model-dtype segments in the buffer's dtype, fp32
    /// statistics as fp32 (at any 2-byte offset).
    fn write_saved(&self, layer: usize, r: &Region, v: &[f32]) -> Result<(), String> {
        let mut at = self.plan.at(self.rank, r);
        let d = self.dtype(r);
        let mut rest = v;
        for seg in self.plan.maths[layer].saved_segments() {
            let (now, later) = rest.split_at(seg.elements);
            match seg.stored {
                Stored::Model => self.arena().write(at, d, now),
                Stored::F32 => self.arena().write_bytes(at, &f32_halves(now)),
            }
            .map_err(|e| e.0)?;
            at += seg.elements as u64 * stored_bytes(seg.stored, d);
            rest = later;
        }
        Ok(())
    }

    fn read_saved(&self, layer: usize, r: &Region) -> Result<Buf<'_>, String> {
        let mut at = self.plan.at(self.rank, r);
        let d = self.dtype(r);
        let mut out = self.scratch(self.plan.maths[layer].saved_elements());
        let mut rest = &mut out[..];
        for seg in self.plan.maths[layer].saved_segments() {
            let bytes = seg.elements as u64 * stored_bytes(seg.stored, d);
            let (now, later) = rest.split_at_mut(seg.elements);
            match seg.stored {
                Stored::Model => self.arena().read_into(at, d, now).map_err(|e| e.0)?,
                Stored::F32 => {
                    let h = self.arena().read_bytes(at, bytes).map_err(|e| e.0)?;
                    for (x, p) in now.iter_mut().zip(h.chunks_exact(2)) {
                        *x = f32::from_bits(u32::from(p[0]) | (u32::from(p[1]) << 16));
                    }
                }
            }
            at += bytes;
            rest = later;
        }
        Ok(out)
    }
}

fn stored_bytes(s: Stored, model: Dtype) -> u64 {
    match s {
        Stored::Model => model.bytes(),
        Stored::F32 => 4,
    }
}

fn f32_halves(v: &[f32]) -> Vec<u16> {
    v.iter()
        .flat_map(|x| {
            let b = x.to_bits();
            [b as u16, (b >> 16) as u16]
        })
        .collect()
}

/// A scratch vector borrowed from a stream's pool; it goes back when dropped, so steady-state
/// steps allocate nothing.
pub struct Buf<'a> {
    v: Vec<f32>,
    pool: &'a std::cell::RefCell<Vec<Vec<f32>>>,
}

impl std::ops::Deref for Buf<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.v
    }
}

impl std::ops::DerefMut for Buf<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.v
    }
}

impl Drop for Buf<'_> {
    fn drop(&mut self) {
        self.pool.borrow_mut().push(std::mem::take(&mut self.v));
    }
}
