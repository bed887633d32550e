//! The layer math on plain f32 slices: [`LayerMath::forward`] and [`LayerMath::backward`] run
//! the device layer's one layer math ([`super::layers`]) on the host device over slices the
//! caller owns. The reference trainer and the tests use them; backends run the same layer math
//! on their own primitives through `run_action`.
//!
//! They panic when a slice has the wrong length or the input kind does not fit the layer: those
//! are the caller's bugs, not the plan's.

use super::host::{Host, HostPtr, HostTokens};
use super::layers::{self, In};
use crate::math::{Input, LayerMath, SliceGrads};

impl LayerMath {
    /// Runs the layer forward: overwrites `output` and `saved`.
    ///
    /// Panics when a buffer has the wrong length, or when the input kind or `tied_wte` does not
    /// fit the layer: those are the caller's bugs.
    pub fn forward(
        &self,
        params: &[f32],
        tied_wte: Option<&[f32]>,
        input: Input<'_>,
        output: &mut [f32],
        saved: &mut [f32],
    ) {
        self.check(params, tied_wte, input, output.len(), saved.len());
        let done = Host::with_slices(|d| {
            let (p, tied) = (HostPtr::read_only(params), tied_wte.map(HostPtr::read_only));
            let x = host_input(input);
            layers::forward(d, self, p, tied, x, HostPtr::of(output), HostPtr::of(saved))
        });
        done.unwrap_or_else(|e| panic!("{}: {e}", self.name()));
    }

    /// Runs the layer backward from `grads.output`: overwrites `grads.input` (when given; never
    /// for an embedding), `grads.params` and, for a tied lm_head, `grads.tied` (the gradient of
    /// the embedding's `wte`).
    pub fn backward(
        &self,
        params: &[f32],
        tied_wte: Option<&[f32]>,
        saved: &[f32],
        input: Input<'_>,
        grads: SliceGrads<'_>,
    ) {
        let SliceGrads {
            output: grad_output,
            input: grad_input,
            params: grad_params,
            tied: grad_tied,
        } = grads;
        self.check(params, tied_wte, input, grad_output.len(), saved.len());
        assert_eq!(
            grad_params.len(),
            self.params(),
            "{}: grad_params length",
            self.name()
        );
        if let Some(gi) = &grad_input {
            assert!(
                !self.takes_tokens(),
                "{}: an embedding has no input gradient",
                self.name()
            );
            assert_eq!(
                gi.len(),
                self.input_elements(),
                "{}: grad_input length",
                self.name()
            );
        }
        assert_eq!(
            grad_tied.as_ref().map(|g| g.len()),
            self.is_tied().then_some(self.tied_elements()),
            "{}: grad_tied must be given exactly for a tied lm_head, with vocab·hidden elements",
            self.name()
        );
        let done = Host::with_slices(|d| {
            let (p, tied) = (HostPtr::read_only(params), tied_wte.map(HostPtr::read_only));
            layers::backward(
                d,
                self,
                layers::Weights { params: p, tied },
                HostPtr::read_only(saved),
                host_input(input),
                layers::Grads {
                    dy: HostPtr::read_only(grad_output),
                    gi: grad_input.map(HostPtr::of),
                    gp: HostPtr::of(grad_params),
                    gt: grad_tied.map(HostPtr::of),
                },
                true,
            )
        });
        done.unwrap_or_else(|e| panic!("{}: {e}", self.name()));
    }

    fn check(
        &self,
        params: &[f32],
        tied: Option<&[f32]>,
        input: Input<'_>,
        out: usize,
        saved: usize,
    ) {
        let n = self.name();
        assert_eq!(params.len(), self.params(), "{n}: params length");
        assert_eq!(out, self.output_elements(), "{n}: output length");
        assert_eq!(saved, self.saved_elements(), "{n}: saved length");
        match input {
            Input::Tokens(t) => {
                assert!(self.takes_tokens(), "{n}: takes hidden states, not tokens");
                assert_eq!(t.len(), self.input_elements(), "{n}: token count");
            }
            Input::Hidden(x) => {
                assert!(!self.takes_tokens(), "{n}: takes tokens, not hidden states");
                assert_eq!(x.len(), self.input_elements(), "{n}: input length");
            }
        }
        assert_eq!(
            tied.map(<[f32]>::len),
            self.is_tied().then_some(self.tied_elements()),
            "{n}: tied_wte must be given exactly for a tied lm_head, with vocab·hidden elements"
        );
    }
}

/// A slice input as the host device takes it.
fn host_input<'h>(input: Input<'_>) -> In<Host<'h>> {
    match input {
        Input::Tokens(t) => In::Tokens(HostTokens::of(t)),
        Input::Hidden(x) => In::Hidden(HostPtr::read_only(x)),
    }
}
