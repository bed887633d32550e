//! Communicators: the rank groups each kind of collective runs over, built from the shard
//! layout on first use and shared by every op of that kind (lowering spec §3).
//!
//! Group member orders follow the shard indices (member `j` holds shard `j`), which is what the
//! verifier's chunk-placement proof checks. Gradient clipping's norm reuses any communicator that
//! already has its groups.

use super::Builder;
use sched_ir::ir::*;

/// Which group structure a communicator has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum CommKind {
    /// The s_p groups, by param shard index.
    Params,
    /// The s_g groups, by grad shard index.
    Grads,
    /// Ranks of one s_os group holding the same grad shard, by optimizer index inside it.
    OptimizerInGrad,
    /// Ranks holding the same optimizer shard.
    Replicas,
    /// Ranks of one s_os group holding the same param shard, by optimizer index inside it.
    Refresh,
    /// Every rank.
    All,
    /// The s_os groups, by optimizer shard index (gradient clipping's norm).
    Optimizer,
    /// hpZ: the GPUs of a node sharing a secondary copy.
    Secondary,
    /// Hierarchical all-gather stage 1: the params group's ranks with the same local index.
    HierInter,
    /// Hierarchical all-gather stage 3: the params group's ranks on one node.
    HierIntra,
    /// Pipeline transfers from stage `from` to stage `to` of the hidden state entering layer
    /// `boundary` (its gradient with `grad`): pairs of ranks with the same data-parallel index,
    /// the sender first; only the ranks of the two stages are members. One communicator per
    /// boundary and direction, so that each carries one chunk's transfers in micro-batch order
    /// on both ends (a V schedule sends activations and gradients between the same two stages,
    /// in orders that differ between its ends).
    P2p {
        from: u32,
        to: u32,
        boundary: u32,
        grad: bool,
    },
    /// Megatron's embedding group: pairs of ranks with the same data-parallel and tensor
    /// indices on the stages of the embedding (`first`) and of the tied head keeping its replica
    /// (`last`),
    /// which all-reduce the two copies' gradients.
    EmbeddingGroup { first: u32, last: u32 },
    /// Gradient clipping's norm across pipeline stages and tensor indices: the s_os groups of
    /// every stage and tensor index at the same data-parallel position, joined stage after
    /// stage, tensor index after tensor index within a stage.
    NormAcrossStages,
    /// A tensor group: the t consecutive ranks of one stage and data-parallel index, by tensor
    /// index (a tensor-parallel layer's all-reduces of partial sums).
    Tensor,
}

impl Builder<'_> {
    pub(super) fn comm(&mut self, kind: CommKind) -> CommId {
        if let Some(&c) = self.comms.get(&kind) {
            return c;
        }
        let l = self.layout;
        let sh = self.shard();
        // Shard indices and group keys by rank (the keys and member orders below read them for
        // every rank).
        let index = |idx| l.index_table(idx);
        let key = |m| l.group_key_table(m);
        let (name, groups) = match kind {
            CommKind::Params => {
                let (group, param) = (key(sh.params), index(ShardIndex::Param));
                (
                    format!("params {}", sh.params),
                    l.groups_by(|r| group[r as usize], |r| param[r as usize]),
                )
            }
            CommKind::Grads => {
                let (group, grad) = (key(sh.grads), index(ShardIndex::Grad));
                (
                    format!("grads {}", sh.grads),
                    l.groups_by(|r| group[r as usize], |r| grad[r as usize]),
                )
            }
            CommKind::OptimizerInGrad => {
                let (group, grad, inside) = (
                    key(sh.optimizer),
                    index(ShardIndex::Grad),
                    index(ShardIndex::OptimizerInGrad),
                );
                (
                    "optimizer shards of one grad shard".to_string(),
                    l.groups_by(
                        |r| group[r as usize] ^ grad[r as usize] << 48,
                        |r| inside[r as usize],
                    ),
                )
            }
            CommKind::Replicas => {
                let optimizer = index(ShardIndex::Optimizer);
                (
                    "replicas of an optimizer shard".to_string(),
                    l.groups_by(|r| optimizer[r as usize], u64::from),
                )
            }
            CommKind::Refresh => {
                let (group, param, inside) = (
                    key(sh.optimizer),
                    index(ShardIndex::Param),
                    index(ShardIndex::OptimizerInParam),
                );
                (
                    "optimizer shards of one param shard".to_string(),
                    l.groups_by(
                        |r| group[r as usize] ^ param[r as usize] << 48,
                        |r| inside[r as usize],
                    ),
                )
            }
            CommKind::Optimizer => {
                let (group, optimizer) = (key(sh.optimizer), index(ShardIndex::Optimizer));
                (
                    format!("optimizer {}", sh.optimizer),
                    l.groups_by(|r| group[r as usize], |r| optimizer[r as usize]),
                )
            }
            CommKind::All => (
                match l.stages {
                    1 => "all ranks".to_string(),
                    _ => "all ranks of a stage".to_string(),
                },
                l.groups_by(|_| 0, u64::from),
            ),
            CommKind::Secondary => {
                let k = l.secondary.unwrap_or(1);
                let secondary = index(ShardIndex::Secondary);
                (
                    format!("secondary shards over {k} GPUs"),
                    l.groups_by(|r| u64::from(r / k), |r| secondary[r as usize]),
                )
            }
            CommKind::P2p {
                from,
                to,
                boundary,
                grad,
            } => (
                format!(
                    "stage {from} to stage {to}, {} layer {boundary}",
                    if grad {
                        "the gradient entering"
                    } else {
                        "the input of"
                    }
                ),
                // The pairs with the same data-parallel and tensor indices, in rank order.
                (0..l.dp_size())
                    .flat_map(|dp| (0..l.tensor.max(1)).map(move |tp| (dp, tp)))
                    .map(|(dp, tp)| vec![l.rank_of(from, dp, tp), l.rank_of(to, dp, tp)])
                    .collect(),
            ),
            CommKind::EmbeddingGroup { first, last } => (
                format!("embedding group of stages {first} and {last}"),
                (0..l.dp_size())
                    .flat_map(|dp| (0..l.tensor.max(1)).map(move |tp| (dp, tp)))
                    .map(|(dp, tp)| vec![l.rank_of(first, dp, tp), l.rank_of(last, dp, tp)])
                    .collect(),
            ),
            CommKind::NormAcrossStages => {
                let (group, optimizer) = (key(sh.optimizer), index(ShardIndex::Optimizer));
                let in_stage = l.groups_by(|r| group[r as usize], |r| optimizer[r as usize]);
                let t = l.tensor.max(1);
                let name = match (l.stages > 1, t > 1) {
                    (true, true) => "of every stage and tensor index",
                    (false, true) => "of every tensor index",
                    _ => "of every stage",
                };
                (
                    format!("optimizer {} {name}", sh.optimizer),
                    in_stage
                        .iter()
                        .filter(|g| l.stage(g[0]) == 0 && l.tp_index(g[0]) == 0)
                        .map(|g| {
                            (0..l.stages)
                                .flat_map(|s| (0..t).map(move |tp| (s, tp)))
                                .flat_map(|(s, tp)| {
                                    g.iter().map(move |&r| l.rank_of(s, l.dp_index(r), tp))
                                })
                                .collect()
                        })
                        .collect(),
                )
            }
            CommKind::Tensor => (format!("tensor {}", l.tensor), l.tp_groups()),
            CommKind::HierInter => {
                let group = key(sh.params);
                (
                    format!("params {} across nodes", sh.params),
                    l.groups_by(
                        |r| group[r as usize] ^ u64::from(l.dp_local(r)) << 48,
                        |r| u64::from(l.dp_node(r)),
                    ),
                )
            }
            CommKind::HierIntra => (
                format!("params {} within a node", sh.params),
                l.groups_by(
                    |r| u64::from(l.dp_node(r)) << 32 | u64::from(l.dp_local(r) / sh.params.intra),
                    |r| l.index(ShardIndex::ParamLocal, r),
                ),
            ),
        };
        // The norm's groups often equal a communicator the step already has: reuse it.
        if kind == CommKind::Optimizer {
            if let Some((id, _)) = self.p.comms.iter().find(|(_, c)| c.groups == groups) {
                self.comms.insert(kind, id);
                return id;
            }
        }
        let scope = l.scope(&groups);
        let id = self.p.comms.push(Communicator {
            name,
            groups,
            scope,
        });
        self.comms.insert(kind, id);
        id
    }
}
