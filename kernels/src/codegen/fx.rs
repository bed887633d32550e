//! The function builder kernel bodies are written with: typed loads and stores through a
//! tensor's storage dtype, f32/f64 arithmetic without fast-math flags, the Rust math's `exp`,
//! `tanh`, `gelu` and `sigmoid` operation for operation, counted loops and stack accumulators
//! (promoted to registers by the optimiser).
//!
//! Builder calls fail only when the builder is misused (no insertion point, a wrong operand
//! type), never on a kernel's sizes, so they are unwrapped with one message.

use super::Target;
use crate::{Kernel, Param, WARP};
use inkwell::basic_block::BasicBlock;
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::Module;
use inkwell::types::{BasicType, BasicTypeEnum};
use inkwell::values::{
    BasicMetadataValueEnum, BasicValue, BasicValueEnum, FloatValue, FunctionValue, IntValue,
    PhiValue, PointerValue,
};
use inkwell::{FloatPredicate, IntPredicate};
use sched_ir::job::Dtype;
use std::cell::RefCell;

const BUILD: &str = "the kernel builder is used as LLVM expects";

/// A value of a kernel: f32 unless said otherwise.
pub type F<'c> = FloatValue<'c>;
pub type I<'c> = IntValue<'c>;

pub struct Fx<'c, 'm> {
    pub ctx: &'c Context,
    module: &'m Module<'c>,
    pub b: Builder<'c>,
    func: FunctionValue<'c>,
    params: Vec<Param>,
    target: Target,
    entry: BasicBlock<'c>,
    /// Lanes sharing an index: the op's on the GPU, 1 on the host.
    lanes: u64,
    /// This thread's lane (a body's second index parameter; 0 until set). On the host a column
    /// op's is the row: see [`Fx::column_rows`].
    lane: Option<I<'c>>,
    /// Whether the entry walks a column op's rows itself, outside its columns (the host's
    /// column ops; [`Fx::column_rows`]).
    rows_outside: bool,
    /// The iteration [`Fx::unrolled_loop`] is emitting, if any.
    iteration: RefCell<Option<Iteration<'c>>>,
}

/// An iteration of [`Fx::unrolled_loop`] being emitted: loads at its indices go to `loads`, ahead
/// of every index's arithmetic; stores wait in `stores` until all the bodies are emitted.
struct Iteration<'c> {
    loads: BasicBlock<'c>,
    at: Vec<I<'c>>,
    stores: Vec<(String, I<'c>, F<'c>)>,
}

impl<'c, 'm> Fx<'c, 'm> {
    pub fn new(
        ctx: &'c Context,
        module: &'m Module<'c>,
        func: FunctionValue<'c>,
        k: &Kernel,
        target: Target,
    ) -> Self {
        let b = ctx.create_builder();
        let entry = ctx.append_basic_block(func, "entry");
        b.position_at_end(entry);
        Fx {
            ctx,
            module,
            b,
            func,
            params: k.params(),
            target,
            entry,
            lanes: match target {
                Target::Host => 1,
                Target::Ptx { .. } | Target::Warp => k.op.lanes_on_gpu(),
            },
            lane: None,
            rows_outside: target.walks_rows_outside(k.op),
            iteration: RefCell::new(None),
        }
    }

    pub fn ret(&self) {
        self.b.build_return(None).expect(BUILD);
    }

    // ----- parameters -----

    pub fn param_int(&self, i: usize) -> I<'c> {
        self.func
            .get_nth_param(i as u32)
            .expect(BUILD)
            .into_int_value()
    }

    fn index_of(&self, name: &str) -> usize {
        self.params
            .iter()
            .position(|p| p.name() == name)
            .unwrap_or_else(|| panic!("the kernel has no parameter `{name}`"))
    }

    fn param(&self, name: &str) -> (Param, BasicValueEnum<'c>) {
        let i = self.index_of(name);
        (
            self.params[i],
            self.func.get_nth_param(i as u32).expect(BUILD),
        )
    }

    pub fn scalar(&self, name: &str) -> F<'c> {
        self.param(name).1.into_float_value()
    }

    pub fn int_param(&self, name: &str) -> I<'c> {
        self.param(name).1.into_int_value()
    }

    pub fn params_as_args(&self) -> Vec<BasicMetadataValueEnum<'c>> {
        self.func
            .get_param_iter()
            .map(BasicMetadataValueEnum::from)
            .collect()
    }

    /// Slot `i` of an array of u64 words.
    pub fn slot(&self, slots: PointerValue<'c>, i: u64) -> I<'c> {
        let t = self.ctx.i64_type();
        let p = self.gep(slots, t.into(), self.i64c(i));
        self.b.build_load(t, p, "").expect(BUILD).into_int_value()
    }

    /// The f32 whose bits are the low half of `word`.
    pub fn low_f32(&self, word: I<'c>) -> F<'c> {
        let w = self
            .b
            .build_int_truncate(word, self.ctx.i32_type(), "")
            .expect(BUILD);
        self.float_of_bits(w)
    }

    /// The f64 whose bits are `word`.
    pub fn f64_of_bits(&self, word: I<'c>) -> F<'c> {
        self.b
            .build_bit_cast(word, self.ctx.f64_type(), "")
            .expect(BUILD)
            .into_float_value()
    }

    pub fn int_to_ptr(&self, word: I<'c>) -> PointerValue<'c> {
        self.b
            .build_int_to_ptr(
                word,
                self.ctx.ptr_type(inkwell::AddressSpace::default()),
                "",
            )
            .expect(BUILD)
    }

    // ----- constants and integer arithmetic -----

    pub fn f(&self, v: f32) -> F<'c> {
        self.ctx.f32_type().const_float(f64::from(v))
    }

    pub fn f64c(&self, v: f64) -> F<'c> {
        self.ctx.f64_type().const_float(v)
    }

    pub fn i64c(&self, v: u64) -> I<'c> {
        self.ctx.i64_type().const_int(v, false)
    }

    pub fn i32c(&self, v: u64) -> I<'c> {
        self.ctx.i32_type().const_int(v, false)
    }

    /// The constant `v` of `like`'s integer type.
    pub fn int_like(&self, like: I<'c>, v: u64) -> I<'c> {
        like.get_type().const_int(v, false)
    }

    /// `v` truncated to i32.
    pub fn narrowed(&self, v: I<'c>) -> I<'c> {
        self.b
            .build_int_truncate(v, self.ctx.i32_type(), "")
            .expect(BUILD)
    }

    /// `i` zero-extended to i64 (an index counted in fewer bits), or `i` itself.
    pub fn widened(&self, i: I<'c>) -> I<'c> {
        if i.get_type().get_bit_width() >= 64 {
            return i;
        }
        self.b
            .build_int_z_extend(i, self.ctx.i64_type(), "")
            .expect(BUILD)
    }

    pub fn iadd(&self, a: I<'c>, b: I<'c>) -> I<'c> {
        self.b.build_int_add(a, b, "").expect(BUILD)
    }

    pub fn imul(&self, a: I<'c>, b: I<'c>) -> I<'c> {
        self.b.build_int_mul(a, b, "").expect(BUILD)
    }

    pub fn udiv(&self, a: I<'c>, b: I<'c>) -> I<'c> {
        self.b.build_int_unsigned_div(a, b, "").expect(BUILD)
    }

    pub fn urem(&self, a: I<'c>, b: I<'c>) -> I<'c> {
        self.b.build_int_unsigned_rem(a, b, "").expect(BUILD)
    }

    pub fn umin(&self, a: I<'c>, b: I<'c>) -> I<'c> {
        let lt = self.icmp(IntPredicate::ULT, a, b);
        self.b
            .build_select(lt, a, b, "")
            .expect(BUILD)
            .into_int_value()
    }

    /// `a & b` (of two conditions, say).
    pub fn and(&self, a: I<'c>, b: I<'c>) -> I<'c> {
        self.b.build_and(a, b, "").expect(BUILD)
    }

    /// `a | b` (of two conditions, say).
    pub fn or(&self, a: I<'c>, b: I<'c>) -> I<'c> {
        self.b.build_or(a, b, "").expect(BUILD)
    }

    pub fn icmp(&self, p: IntPredicate, a: I<'c>, b: I<'c>) -> I<'c> {
        self.b.build_int_compare(p, a, b, "").expect(BUILD)
    }

    // ----- float arithmetic (f32 or f64, no flags) -----

    pub fn add(&self, a: F<'c>, b: F<'c>) -> F<'c> {
        self.b.build_float_add(a, b, "").expect(BUILD)
    }

    pub fn sub(&self, a: F<'c>, b: F<'c>) -> F<'c> {
        self.b.build_float_sub(a, b, "").expect(BUILD)
    }

    pub fn mul(&self, a: F<'c>, b: F<'c>) -> F<'c> {
        self.b.build_float_mul(a, b, "").expect(BUILD)
    }

    pub fn div(&self, a: F<'c>, b: F<'c>) -> F<'c> {
        self.b.build_float_div(a, b, "").expect(BUILD)
    }

    pub fn fcmp(&self, p: FloatPredicate, a: F<'c>, b: F<'c>) -> I<'c> {
        self.b.build_float_compare(p, a, b, "").expect(BUILD)
    }

    pub fn select<V: BasicValue<'c>>(&self, c: I<'c>, a: V, b: V) -> BasicValueEnum<'c> {
        self.b.build_select(c, a, b, "").expect(BUILD)
    }

    pub fn fselect(&self, c: I<'c>, a: F<'c>, b: F<'c>) -> F<'c> {
        self.select(c, a, b).into_float_value()
    }

    pub fn iselect(&self, c: I<'c>, a: I<'c>, b: I<'c>) -> I<'c> {
        self.select(c, a, b).into_int_value()
    }

    pub fn to_f64(&self, x: F<'c>) -> F<'c> {
        self.b
            .build_float_ext(x, self.ctx.f64_type(), "")
            .expect(BUILD)
    }

    /// f64 to f32, rounded to nearest even (Rust's `as f32`).
    pub fn to_f32(&self, x: F<'c>) -> F<'c> {
        self.b
            .build_float_trunc(x, self.ctx.f32_type(), "")
            .expect(BUILD)
    }

    fn intrinsic(
        &self,
        name: &str,
        types: &[BasicTypeEnum<'c>],
        args: &[BasicValueEnum<'c>],
    ) -> BasicValueEnum<'c> {
        self.call(self.intrinsic_fn(name, types), args)
    }

    /// The module's declaration of LLVM intrinsic `name` overloaded on `types`.
    fn intrinsic_fn(&self, name: &str, types: &[BasicTypeEnum<'c>]) -> FunctionValue<'c> {
        Intrinsic::find(name)
            .unwrap_or_else(|| panic!("LLVM has no intrinsic {name}"))
            .get_declaration(self.module, types)
            .unwrap_or_else(|| panic!("no declaration of {name} for {types:?}"))
    }

    fn call(&self, f: FunctionValue<'c>, args: &[BasicValueEnum<'c>]) -> BasicValueEnum<'c> {
        let args: Vec<BasicMetadataValueEnum> = args.iter().map(|&a| a.into()).collect();
        self.b
            .build_call(f, &args, "")
            .expect(BUILD)
            .try_as_basic_value()
            .basic()
            .expect("the call returns a value")
    }

    /// The module's declaration of `name` (an NVVM intrinsic, declared by name as LLVM's
    /// intrinsic table does not list them), added on first use.
    fn declared(&self, name: &str, t: inkwell::types::FunctionType<'c>) -> FunctionValue<'c> {
        self.module
            .get_function(name)
            .unwrap_or_else(|| self.module.add_function(name, t, None))
    }

    /// The f32 → f32 NVVM intrinsic `name` of `x`.
    fn nvvm_f32(&self, name: &str, x: F<'c>) -> F<'c> {
        let t = self.ctx.f32_type();
        let f = self.declared(name, t.fn_type(&[t.into()], false));
        self.call(f, &[x.into()]).into_float_value()
    }

    pub fn call_void(&self, f: FunctionValue<'c>, args: &[BasicMetadataValueEnum<'c>]) {
        self.b.build_call(f, args, "").expect(BUILD);
    }

    /// A float intrinsic overloaded on its first argument's type (f32 or f64).
    fn f32_intrinsic(&self, name: &str, args: &[F<'c>]) -> F<'c> {
        let t = args[0].get_type().as_basic_type_enum();
        let args: Vec<BasicValueEnum> = args.iter().map(|&a| a.into()).collect();
        self.intrinsic(name, &[t], &args).into_float_value()
    }

    pub fn sqrt(&self, x: F<'c>) -> F<'c> {
        self.f32_intrinsic("llvm.sqrt", &[x])
    }

    pub fn fabs(&self, x: F<'c>) -> F<'c> {
        self.f32_intrinsic("llvm.fabs", &[x])
    }

    pub fn copysign(&self, x: F<'c>, s: F<'c>) -> F<'c> {
        self.f32_intrinsic("llvm.copysign", &[x, s])
    }

    /// IEEE maxNum: the other operand when one is NaN (Rust's `f32::max`).
    pub fn maxnum(&self, a: F<'c>, b: F<'c>) -> F<'c> {
        self.f32_intrinsic("llvm.maxnum", &[a, b])
    }

    /// IEEE minNum: the other operand when one is NaN (Rust's `f64::min`).
    pub fn minnum(&self, a: F<'c>, b: F<'c>) -> F<'c> {
        self.f32_intrinsic("llvm.minnum", &[a, b])
    }

    pub fn roundeven(&self, x: F<'c>) -> F<'c> {
        self.f32_intrinsic("llvm.roundeven", &[x])
    }

    /// Natural log: libm's `logf` on the host (what Rust's `f32::ln` calls), `lg2.approx`
    /// times ln 2 on the GPU.
    pub fn ln(&self, x: F<'c>) -> F<'c> {
        match self.target {
            Target::Host | Target::Warp => self.f32_intrinsic("llvm.log", &[x]),
            Target::Ptx { .. } => {
                let l2 = self.nvvm_f32("llvm.nvvm.lg2.approx.f", x);
                self.mul(l2, self.f(std::f32::consts::LN_2))
            }
        }
    }

    fn bits(&self, x: F<'c>) -> I<'c> {
        self.b
            .build_bit_cast(x, self.ctx.i32_type(), "")
            .expect(BUILD)
            .into_int_value()
    }

    fn float_of_bits(&self, x: I<'c>) -> F<'c> {
        self.b
            .build_bit_cast(x, self.ctx.f32_type(), "")
            .expect(BUILD)
            .into_float_value()
    }

    // ----- the Rust math's functions, operation for operation -----

    /// eˣ: on the host `schedrun::math::ops::exp` (Cephes' reduction and degree-6 polynomial,
    /// the CPU's bits); on the GPU `ex2.approx` of x·log₂e, one special-function instruction
    /// (relative error about 2⁻²² plus x's rounding times log₂e), as `ln` uses `lg2.approx`.
    pub fn exp(&self, x: F<'c>) -> F<'c> {
        if let Target::Ptx { .. } = self.target {
            let x2 = self.mul(x, self.f(std::f32::consts::LOG2_E));
            return self.nvvm_f32("llvm.nvvm.ex2.approx.f", x2);
        }
        let lo = self.f(-87.33);
        let hi = self.f(88.37);
        // x.clamp(lo, hi): `if x < lo { lo }`, then `if x > hi { hi }`; NaN passes.
        let xc = self.fselect(self.fcmp(FloatPredicate::OLT, x, lo), lo, x);
        let xc = self.fselect(self.fcmp(FloatPredicate::OGT, xc, hi), hi, xc);
        let round = self.f(12_582_912.0);
        let t = self.add(self.mul(xc, self.f(std::f32::consts::LOG2_E)), round);
        let n = self.sub(t, round);
        let r = self.sub(
            self.sub(xc, self.mul(n, self.f(0.693_359_4))),
            self.mul(n, self.f(-2.121_944_4e-4)),
        );
        let mut p = self.f(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = self.add(self.mul(p, r), self.f(c));
        }
        let y = self.add(self.add(self.mul(self.mul(p, r), r), r), self.f(1.0));
        // n as an integer from t's low mantissa bits (2²² + n), clamped as the Rust math does:
        // a saturating conversion would not vectorise on the host.
        let k = self
            .b
            .build_int_sub(self.bits(t), self.bits(round), "")
            .expect(BUILD);
        let (lo_k, hi_k) = (self.i32c((-126i32) as u32 as u64), self.i32c(127));
        let k = self.iselect(self.icmp(IntPredicate::SLT, k, lo_k), lo_k, k);
        let k = self.iselect(self.icmp(IntPredicate::SGT, k, hi_k), hi_k, k);
        let e = self.b.build_int_add(k, self.i32c(127), "").expect(BUILD);
        let e = self.b.build_left_shift(e, self.i32c(23), "").expect(BUILD);
        let v = self.mul(y, self.float_of_bits(e));
        let v = self.fselect(self.fcmp(FloatPredicate::OLT, x, lo), self.f(0.0), v);
        self.fselect(
            self.fcmp(FloatPredicate::OGT, x, hi),
            self.f(f32::INFINITY),
            v,
        )
    }

    /// tanh through one `exp`: (1 − e)/(1 + e), e = exp(−2|u|), with u's sign.
    pub fn tanh(&self, u: F<'c>) -> F<'c> {
        let e = self.exp(self.mul(self.f(-2.0), self.fabs(u)));
        let one = self.f(1.0);
        self.copysign(self.div(self.sub(one, e), self.add(one, e)), u)
    }

    fn gelu_inner(&self, x: F<'c>) -> F<'c> {
        // GELU_C * (x + GELU_A * x * x * x)
        let cube = self.mul(self.mul(self.mul(self.f(GELU_A), x), x), x);
        self.tanh(self.mul(self.f(GELU_C), self.add(x, cube)))
    }

    pub fn gelu(&self, x: F<'c>) -> F<'c> {
        let t = self.gelu_inner(x);
        self.mul(self.mul(self.f(0.5), x), self.add(self.f(1.0), t))
    }

    pub fn gelu_grad(&self, x: F<'c>) -> F<'c> {
        let t = self.gelu_inner(x);
        let one = self.f(1.0);
        let a = self.mul(self.f(0.5), self.add(one, t));
        let b = self.mul(self.mul(self.f(0.5), x), self.sub(one, self.mul(t, t)));
        let b = self.mul(b, self.f(GELU_C));
        let c = self.add(one, self.mul(self.mul(self.f(3.0 * GELU_A), x), x));
        self.add(a, self.mul(b, c))
    }

    pub fn sigmoid(&self, x: F<'c>) -> F<'c> {
        let e = self.exp(self.b.build_float_neg(x, "").expect(BUILD));
        self.div(self.f(1.0), self.add(self.f(1.0), e))
    }

    // ----- memory -----

    fn gep(&self, ptr: PointerValue<'c>, elem: BasicTypeEnum<'c>, i: I<'c>) -> PointerValue<'c> {
        // SAFETY (of the generated code): indices are within the tensors the caller passes;
        // the kernel's contract.
        unsafe {
            self.b
                .build_in_bounds_gep(elem, ptr, &[i], "")
                .expect(BUILD)
        }
    }

    fn ptr(&self, name: &str) -> (Param, PointerValue<'c>) {
        let (p, v) = self.param(name);
        (p, v.into_pointer_value())
    }

    /// Element `i` of tensor `name`, widened to f32. Inside [`Fx::unrolled_loop`], a load at
    /// one of the iteration's indices is emitted in the iteration's loads block, before any
    /// index's arithmetic.
    pub fn load(&self, name: &str, i: I<'c>) -> F<'c> {
        let early = self
            .iteration
            .borrow()
            .as_ref()
            .filter(|it| it.at.contains(&i))
            .map(|it| it.loads);
        let Some(block) = early else {
            return self.load_here(name, i);
        };
        let here = self.b.get_insert_block().expect(BUILD);
        self.b.position_at_end(block);
        let v = self.load_here(name, i);
        self.b.position_at_end(here);
        v
    }

    fn load_here(&self, name: &str, i: I<'c>) -> F<'c> {
        let (p, ptr) = self.ptr(name);
        match p {
            Param::Tensor(_, Dtype::Fp32) | Param::F32s(_) => self.load_f32(ptr, i),
            Param::Tensor(_, Dtype::Bf16) => {
                let h = self.load_i16(ptr, i);
                let w = self
                    .b
                    .build_int_z_extend(h, self.ctx.i32_type(), "")
                    .expect(BUILD);
                let w = self.b.build_left_shift(w, self.i32c(16), "").expect(BUILD);
                self.float_of_bits(w)
            }
            Param::Tensor(_, Dtype::Fp16) => {
                let h = self.load_i16(ptr, i);
                self.f16_to_f32(h)
            }
            Param::Halves(_) => {
                let i32t = self.ctx.i32_type();
                let two_i = self.imul(i, self.i64c(2));
                let lo = self.load_i16(ptr, two_i);
                let hi = self.load_i16(ptr, self.iadd(two_i, self.i64c(1)));
                let lo = self.b.build_int_z_extend(lo, i32t, "").expect(BUILD);
                let hi = self.b.build_int_z_extend(hi, i32t, "").expect(BUILD);
                let hi = self.b.build_left_shift(hi, self.i32c(16), "").expect(BUILD);
                self.float_of_bits(self.b.build_or(hi, lo, "").expect(BUILD))
            }
            other => panic!("`{name}` ({other:?}) is not an f32-valued tensor"),
        }
    }

    /// Element `i` of `name` as f64: an f64 tensor's value, or an f32-valued one's widened.
    pub fn load_wide(&self, name: &str, i: I<'c>) -> F<'c> {
        match self.param(name).0 {
            Param::F64s(_) => self.load_f64(name, i),
            _ => self.to_f64(self.load(name, i)),
        }
    }

    /// `x` rounded to `to`'s precision and widened back (`Precision::round`): the store's
    /// rounding then the load's widening; an fp16 NaN keeps its bits (`round_f16` returns it).
    pub fn round_to(&self, x: F<'c>, to: Dtype) -> F<'c> {
        match to {
            Dtype::Fp32 => x,
            Dtype::Bf16 => {
                let h = self.f32_to_bf16(x);
                let w = self
                    .b
                    .build_int_z_extend(h, self.ctx.i32_type(), "")
                    .expect(BUILD);
                self.float_of_bits(self.b.build_left_shift(w, self.i32c(16), "").expect(BUILD))
            }
            Dtype::Fp16 => {
                let r = self.f16_to_f32(self.f32_to_f16(x));
                let is_nan = self.fcmp(FloatPredicate::UNO, x, x);
                self.fselect(is_nan, x, r)
            }
        }
    }

    /// Element `i` of the f64 tensor `name`.
    pub fn load_f64(&self, name: &str, i: I<'c>) -> F<'c> {
        let (_, ptr) = self.ptr(name);
        let t = self.ctx.f64_type();
        let p = self.gep(ptr, t.into(), i);
        self.b.build_load(t, p, "").expect(BUILD).into_float_value()
    }

    fn load_f32(&self, ptr: PointerValue<'c>, i: I<'c>) -> F<'c> {
        let t = self.ctx.f32_type();
        let p = self.gep(ptr, t.into(), i);
        self.b.build_load(t, p, "").expect(BUILD).into_float_value()
    }

    fn load_i16(&self, ptr: PointerValue<'c>, i: I<'c>) -> I<'c> {
        let t = self.ctx.i16_type();
        let p = self.gep(ptr, t.into(), i);
        self.b.build_load(t, p, "").expect(BUILD).into_int_value()
    }

    /// Element `i` of a u32 tensor, zero-extended to i64.
    pub fn load_index(&self, name: &str, i: I<'c>) -> I<'c> {
        let (_, ptr) = self.ptr(name);
        let t = self.ctx.i32_type();
        let p = self.gep(ptr, t.into(), i);
        let v = self.b.build_load(t, p, "").expect(BUILD).into_int_value();
        self.b
            .build_int_z_extend(v, self.ctx.i64_type(), "")
            .expect(BUILD)
    }

    /// Stores f32 `v` as element `i` of `name`, rounded to its dtype (at the end of the
    /// iteration inside [`Fx::unrolled_loop`]).
    pub fn store(&self, name: &str, i: I<'c>, v: F<'c>) {
        if let Some(it) = self.iteration.borrow_mut().as_mut() {
            it.stores.push((name.to_owned(), i, v));
            return;
        }
        let (p, ptr) = self.ptr(name);
        match p {
            Param::Tensor(_, Dtype::Fp32) | Param::F32s(_) => {
                let q = self.gep(ptr, self.ctx.f32_type().into(), i);
                self.b.build_store(q, v).expect(BUILD);
            }
            Param::Tensor(_, Dtype::Bf16) => {
                let h = self.f32_to_bf16(v);
                let q = self.gep(ptr, self.ctx.i16_type().into(), i);
                self.b.build_store(q, h).expect(BUILD);
            }
            Param::Tensor(_, Dtype::Fp16) => {
                let h = self.f32_to_f16(v);
                let q = self.gep(ptr, self.ctx.i16_type().into(), i);
                self.b.build_store(q, h).expect(BUILD);
            }
            Param::Halves(_) => {
                let i16t = self.ctx.i16_type();
                let b = self.bits(v);
                let hi = self
                    .b
                    .build_right_shift(b, self.i32c(16), false, "")
                    .expect(BUILD);
                let two_i = self.imul(i, self.i64c(2));
                for (half, at) in [(b, two_i), (hi, self.iadd(two_i, self.i64c(1)))] {
                    let h = self.b.build_int_truncate(half, i16t, "").expect(BUILD);
                    let q = self.gep(ptr, i16t.into(), at);
                    self.b.build_store(q, h).expect(BUILD);
                }
            }
            other => panic!("`{name}` ({other:?}) is not an f32-valued tensor"),
        }
    }

    /// `name[i] += v` for an fp32 tensor that several lanes add into: an atomic add on the GPU
    /// (whose order between lanes is unspecified), a load, add and store on the host, whose one
    /// lane adds in its order.
    pub fn add_into(&self, name: &str, i: I<'c>, v: F<'c>) {
        match self.target {
            Target::Host => self.store(name, i, self.add(self.load(name, i), v)),
            Target::Ptx { .. } | Target::Warp => {
                let (p, ptr) = self.ptr(name);
                assert!(
                    matches!(p, Param::Tensor(_, Dtype::Fp32) | Param::F32s(_)),
                    "`{name}` is added into atomically: it must be fp32"
                );
                let q = self.gep(ptr, self.ctx.f32_type().into(), i);
                // inkwell's `build_atomicrmw` takes integers only; LLVM's C API takes the float.
                use inkwell::llvm_sys::core::LLVMBuildAtomicRMW;
                use inkwell::llvm_sys::{LLVMAtomicOrdering, LLVMAtomicRMWBinOp};
                use inkwell::values::AsValueRef;
                // SAFETY: the builder is positioned (every body's is), `q` points to f32 and
                // `v` is an f32 value of this context; LLVM checks the types in `verify`.
                unsafe {
                    LLVMBuildAtomicRMW(
                        self.b.as_mut_ptr(),
                        LLVMAtomicRMWBinOp::LLVMAtomicRMWBinOpFAdd,
                        q.as_value_ref(),
                        v.as_value_ref(),
                        LLVMAtomicOrdering::LLVMAtomicOrderingMonotonic,
                        0,
                    );
                }
            }
        }
    }

    /// Stores f64 `v` as element `i` of the f64 tensor `name`.
    pub fn store_f64(&self, name: &str, i: I<'c>, v: F<'c>) {
        let (_, ptr) = self.ptr(name);
        let q = self.gep(ptr, self.ctx.f64_type().into(), i);
        self.b.build_store(q, v).expect(BUILD);
    }

    /// Copies element `s` of `src` to element `d` of `dst` as raw bits of the dtype.
    pub fn copy_bits(&self, src: &str, s: I<'c>, dst: &str, d: I<'c>) {
        let (p, sp) = self.ptr(src);
        let (_, dp) = self.ptr(dst);
        let t: BasicTypeEnum = match p {
            Param::Tensor(_, Dtype::Fp32) => self.ctx.i32_type().into(),
            _ => self.ctx.i16_type().into(),
        };
        let v = self.b.build_load(t, self.gep(sp, t, s), "").expect(BUILD);
        self.b.build_store(self.gep(dp, t, d), v).expect(BUILD);
    }

    /// `schedrun::math::f32_to_bf16_bits`: round to nearest even, NaN kept quiet. In integer IR
    /// on the host; on the GPU the hardware's conversion (`cvt.rn.bf16.f32`, the same IEEE
    /// rounding in one instruction instead of five), NaN still mapped as the host maps it.
    fn f32_to_bf16(&self, x: F<'c>) -> I<'c> {
        let b = self.bits(x);
        let hi = self
            .b
            .build_right_shift(b, self.i32c(16), false, "")
            .expect(BUILD);
        let rounded = match self.target {
            Target::Ptx { .. } => self.converted(x, self.ctx.bf16_type()),
            Target::Host | Target::Warp => {
                let lsb = self.b.build_and(hi, self.i32c(1), "").expect(BUILD);
                let bias = self.iadd(self.i32c(0x7fff), lsb);
                let rounded = self.iadd(b, bias);
                self.b
                    .build_right_shift(rounded, self.i32c(16), false, "")
                    .expect(BUILD)
            }
        };
        let nan = self.b.build_or(hi, self.i32c(0x40), "").expect(BUILD);
        let is_nan = self.fcmp(FloatPredicate::UNO, x, x);
        let v = self.iselect(is_nan, nan, rounded);
        self.b
            .build_int_truncate(v, self.ctx.i16_type(), "")
            .expect(BUILD)
    }

    /// IEEE half bits to f32, exactly (subnormals, infinities and NaN payloads included).
    fn f16_to_f32(&self, h: I<'c>) -> F<'c> {
        let i32t = self.ctx.i32_type();
        let w = self.b.build_int_z_extend(h, i32t, "").expect(BUILD);
        let sign = self.b.build_and(w, self.i32c(0x8000), "").expect(BUILD);
        let sign = self
            .b
            .build_left_shift(sign, self.i32c(16), "")
            .expect(BUILD);
        let exp = self
            .b
            .build_right_shift(w, self.i32c(10), false, "")
            .expect(BUILD);
        let exp = self.b.build_and(exp, self.i32c(0x1f), "").expect(BUILD);
        let man = self.b.build_and(w, self.i32c(0x3ff), "").expect(BUILD);
        // Normal: rebias the exponent by 127 − 15 = 112.
        let ne = self
            .b
            .build_left_shift(self.iadd(exp, self.i32c(112)), self.i32c(23), "")
            .expect(BUILD);
        let nm = self
            .b
            .build_left_shift(man, self.i32c(13), "")
            .expect(BUILD);
        let normal = self.b.build_or(ne, nm, "").expect(BUILD);
        // Infinity or NaN: exponent all ones.
        let special = self
            .b
            .build_or(self.i32c(0x7f80_0000), nm, "")
            .expect(BUILD);
        // Zero or subnormal: man · 2^−24, exact in f32.
        let mf = self
            .b
            .build_unsigned_int_to_float(man, self.ctx.f32_type(), "")
            .expect(BUILD);
        let sub = self.bits(self.mul(mf, self.f(2f32.powi(-24))));
        let is_sub = self.icmp(IntPredicate::EQ, exp, self.i32c(0));
        let is_special = self.icmp(IntPredicate::EQ, exp, self.i32c(0x1f));
        let mag = self.iselect(is_special, special, normal);
        let mag = self.iselect(is_sub, sub, mag);
        self.float_of_bits(self.b.build_or(mag, sign, "").expect(BUILD))
    }

    /// `x` rounded to nearest even into the 16-bit float type `t` by the GPU's conversion
    /// (`fptrunc`: `cvt.rn.bf16.f32` or `cvt.rn.f16.f32`), its bits zero-extended to i32.
    fn converted(&self, x: F<'c>, t: inkwell::types::FloatType<'c>) -> I<'c> {
        let h = self.b.build_float_trunc(x, t, "").expect(BUILD);
        let h = self
            .b
            .build_bit_cast(h, self.ctx.i16_type(), "")
            .expect(BUILD)
            .into_int_value();
        self.b
            .build_int_z_extend(h, self.ctx.i32_type(), "")
            .expect(BUILD)
    }

    /// f32 to IEEE half bits, round to nearest even (the `half` crate's `f16::from_f32`), through
    /// the Rust math's `round_f16`: scale to the half's quantum, round, then pack exactly. On the
    /// GPU the hardware's conversion (`cvt.rn.f16.f32`, the same IEEE rounding), NaN mapped as on
    /// the host.
    fn f32_to_f16(&self, x: F<'c>) -> I<'c> {
        let b = self.bits(x);
        let sign = self
            .b
            .build_right_shift(b, self.i32c(16), false, "")
            .expect(BUILD);
        let sign = self.b.build_and(sign, self.i32c(0x8000), "").expect(BUILD);
        let man32 = self.b.build_and(b, self.i32c(0x7f_ffff), "").expect(BUILD);
        let nan = self
            .b
            .build_or(
                self.b.build_or(sign, self.i32c(0x7e00), "").expect(BUILD),
                self.b
                    .build_right_shift(man32, self.i32c(13), false, "")
                    .expect(BUILD),
                "",
            )
            .expect(BUILD);
        let v = match self.target {
            Target::Ptx { .. } => self.converted(x, self.ctx.f16_type()),
            Target::Host | Target::Warp => self.f32_to_f16_bits(x, sign),
        };
        let is_nan = self.fcmp(FloatPredicate::UNO, x, x);
        let v = self.iselect(is_nan, nan, v);
        self.b
            .build_int_truncate(v, self.ctx.i16_type(), "")
            .expect(BUILD)
    }

    /// The non-NaN half bits of [`Fx::f32_to_f16`] in integer and f32 IR, `sign` being x's sign
    /// in the half's place.
    fn f32_to_f16_bits(&self, x: F<'c>, sign: I<'c>) -> I<'c> {
        let inf = self.b.build_or(sign, self.i32c(0x7c00), "").expect(BUILD);
        let a = self.fabs(x);
        // q = 2^max(e − 10, −24) where e is x's unbiased exponent.
        let e = self
            .b
            .build_right_shift(self.bits(a), self.i32c(23), false, "")
            .expect(BUILD);
        let small = self.fcmp(FloatPredicate::OLT, a, self.f(2f32.powi(-14)));
        // The biased exponent of q: e − 10 + 127 (normal range) or −24 + 127.
        let qe = self.iselect(
            small,
            self.i32c(103),
            self.b.build_int_sub(e, self.i32c(10), "").expect(BUILD),
        );
        let q = self.float_of_bits(self.b.build_left_shift(qe, self.i32c(23), "").expect(BUILD));
        let r = self.mul(self.roundeven(self.div(a, q)), q);
        // Pack r (now exactly a half value).
        let rb = self.bits(r);
        let re = self
            .b
            .build_right_shift(rb, self.i32c(23), false, "")
            .expect(BUILD);
        let rm = self.b.build_and(rb, self.i32c(0x7f_ffff), "").expect(BUILD);
        let normal = self
            .b
            .build_or(
                self.b
                    .build_left_shift(
                        self.b.build_int_sub(re, self.i32c(112), "").expect(BUILD),
                        self.i32c(10),
                        "",
                    )
                    .expect(BUILD),
                self.b
                    .build_right_shift(rm, self.i32c(13), false, "")
                    .expect(BUILD),
                "",
            )
            .expect(BUILD);
        let subn = self
            .b
            .build_float_to_unsigned_int(
                self.mul(r, self.f(2f32.powi(24))),
                self.ctx.i32_type(),
                "",
            )
            .expect(BUILD);
        let r_small = self.fcmp(FloatPredicate::OLT, r, self.f(2f32.powi(-14)));
        let mag = self.iselect(r_small, subn, normal);
        let v = self.b.build_or(sign, mag, "").expect(BUILD);
        let big = self.fcmp(FloatPredicate::OGE, a, self.f(65520.0));
        self.iselect(big, inf, v)
    }

    // ----- control flow -----

    /// A stack slot of type `t`, allocated at the function's entry (where the optimiser promotes
    /// slots to registers), the builder staying where it was.
    fn entry_alloca(&self, t: impl BasicType<'c>) -> PointerValue<'c> {
        let here = self.b.get_insert_block().expect(BUILD);
        match self.entry.get_first_instruction() {
            Some(first) => self.b.position_before(&first),
            None => self.b.position_at_end(self.entry),
        }
        let slot = self.b.build_alloca(t, "").expect(BUILD);
        self.b.position_at_end(here);
        slot
    }

    /// An f32 (or f64, by `init`'s type) accumulator on the stack, set to `init`.
    pub fn var(&self, init: F<'c>) -> Var<'c> {
        let slot = self.entry_alloca(init.get_type());
        self.b.build_store(slot, init).expect(BUILD);
        Var {
            slot,
            ty: init.get_type().as_basic_type_enum(),
        }
    }

    pub fn get(&self, v: &Var<'c>) -> F<'c> {
        self.b
            .build_load(v.ty, v.slot, "")
            .expect(BUILD)
            .into_float_value()
    }

    pub fn set(&self, v: &Var<'c>, x: F<'c>) {
        self.b.build_store(v.slot, x).expect(BUILD);
    }

    /// A loop's head block, entered from here, its index phi (`start` on entry; the latch adds
    /// the other incoming value) and the index's value. The builder is left in the head.
    fn loop_head(&self, start: I<'c>, prefix: &str) -> (BasicBlock<'c>, PhiValue<'c>, I<'c>) {
        let pre = self.b.get_insert_block().expect(BUILD);
        let head = self
            .ctx
            .append_basic_block(self.func, &format!("{prefix}head"));
        self.b.build_unconditional_branch(head).expect(BUILD);
        self.b.position_at_end(head);
        let i = self.b.build_phi(start.get_type(), "i").expect(BUILD);
        i.add_incoming(&[(&start, pre)]);
        (head, i, i.as_basic_value().into_int_value())
    }

    /// `for i in (start..end).step_by(stride) { body(i) }` (unsigned compare), counted in the
    /// type of `start`, `end` and `stride`; the body gets `i` as i64.
    pub fn strided_loop(
        &mut self,
        start: I<'c>,
        end: I<'c>,
        stride: I<'c>,
        body: impl FnOnce(&mut Self, I<'c>),
    ) {
        let (head, i, iv) = self.loop_head(start, "");
        let step = self.ctx.append_basic_block(self.func, "body");
        let exit = self.ctx.append_basic_block(self.func, "exit");
        let more = self.icmp(IntPredicate::ULT, iv, end);
        self.b
            .build_conditional_branch(more, step, exit)
            .expect(BUILD);
        self.b.position_at_end(step);
        let wide = self.widened(iv);
        body(self, wide);
        let next = self.iadd(iv, stride);
        let latch = self.b.get_insert_block().expect(BUILD);
        i.add_incoming(&[(&next, latch)]);
        self.b.build_unconditional_branch(head).expect(BUILD);
        self.b.position_at_end(exit);
    }

    /// `for i in (start..end).step_by(stride) { body(i) }`, [`UNROLL`](crate::UNROLL)
    /// indices per iteration while that many remain: the iteration emits the loads of all of
    /// them (those at their index or a constant one) first, then their bodies' arithmetic in
    /// order, then every [`Fx::store`], held back to the end. Only for bodies whose indices touch
    /// disjoint elements ([`crate::Op::unrolled`]): the values stored are then the same
    /// as `strided_loop`'s. Counted like `strided_loop`.
    pub fn unrolled_loop(
        &mut self,
        start: I<'c>,
        end: I<'c>,
        stride: I<'c>,
        mut body: impl FnMut(&mut Self, I<'c>),
    ) {
        let copies = crate::UNROLL;
        let (head, i, iv) = self.loop_head(start, "unrolled.");
        let step = self.ctx.append_basic_block(self.func, "unrolled.body");
        let rest = self.ctx.append_basic_block(self.func, "unrolled.rest");
        let last = self.iadd(iv, self.imul(stride, self.int_like(stride, copies - 1)));
        let whole = self.icmp(IntPredicate::ULT, last, end);
        self.b
            .build_conditional_branch(whole, step, rest)
            .expect(BUILD);
        // `step` holds the iteration's indices and, as the bodies ask for them, their loads;
        // the bodies' arithmetic follows in `compute`, their stores at the end.
        self.b.position_at_end(step);
        let at: Vec<I<'c>> = (0..copies)
            .map(|c| self.widened(self.iadd(iv, self.imul(stride, self.int_like(stride, c)))))
            .collect();
        let compute = self.ctx.append_basic_block(self.func, "unrolled.compute");
        self.b.position_at_end(compute);
        *self.iteration.borrow_mut() = Some(Iteration {
            loads: step,
            at: at.clone(),
            stores: vec![],
        });
        for &j in &at {
            body(self, j);
        }
        let held = self.iteration.borrow_mut().take().map(|it| it.stores);
        for (name, j, v) in held.unwrap_or_default() {
            self.store(&name, j, v);
        }
        let end_of_compute = self.b.get_insert_block().expect(BUILD);
        self.b.position_at_end(step);
        self.b.build_unconditional_branch(compute).expect(BUILD);
        self.b.position_at_end(end_of_compute);
        let next = self.iadd(iv, self.imul(stride, self.int_like(stride, copies)));
        i.add_incoming(&[(&next, end_of_compute)]);
        self.b.build_unconditional_branch(head).expect(BUILD);
        // The last indices, fewer than a whole iteration, one at a time.
        self.b.position_at_end(rest);
        self.strided_loop(iv, end, stride, body);
    }

    /// `if cond { then() } else { otherwise() }`.
    pub fn if_else(
        &mut self,
        cond: I<'c>,
        then: impl FnOnce(&mut Self),
        otherwise: impl FnOnce(&mut Self),
    ) {
        let yes = self.ctx.append_basic_block(self.func, "then");
        let no = self.ctx.append_basic_block(self.func, "else");
        let merge = self.ctx.append_basic_block(self.func, "merge");
        self.b.build_conditional_branch(cond, yes, no).expect(BUILD);
        self.b.position_at_end(yes);
        then(self);
        self.b.build_unconditional_branch(merge).expect(BUILD);
        self.b.position_at_end(no);
        otherwise(self);
        self.b.build_unconditional_branch(merge).expect(BUILD);
        self.b.position_at_end(merge);
    }

    /// `if cond { body() }`.
    pub fn when(&mut self, cond: I<'c>, body: impl FnOnce(&mut Self)) {
        self.if_else(cond, body, |_| {});
    }

    /// `for i in start..end { body(i) }`.
    pub fn range(&mut self, start: I<'c>, end: I<'c>, body: impl FnOnce(&mut Self, I<'c>)) {
        let one = self.i64c(1);
        self.strided_loop(start, end, one, body);
    }

    /// The GPU's (tid.x, ntid.x, ctaid.x, nctaid.x), as i64.
    pub fn thread_registers(&self) -> (I<'c>, I<'c>, I<'c>, I<'c>) {
        let read = |name: &str| {
            let f = self.declared(name, self.ctx.i32_type().fn_type(&[], false));
            let v = self.call(f, &[]).into_int_value();
            self.b
                .build_int_z_extend(v, self.ctx.i64_type(), "")
                .expect(BUILD)
        };
        (
            read("llvm.nvvm.read.ptx.sreg.tid.x"),
            read("llvm.nvvm.read.ptx.sreg.ntid.x"),
            read("llvm.nvvm.read.ptx.sreg.ctaid.x"),
            read("llvm.nvvm.read.ptx.sreg.nctaid.x"),
        )
    }

    // ----- lanes: a warp shares a cooperative index on the GPU, the host runs one lane -----

    /// Lanes sharing a cooperative index ([`crate::Op::cooperative`]): the op's on the
    /// GPU (a warp for a row), one on the host.
    pub fn lanes(&self) -> u64 {
        self.lanes
    }

    /// This thread's lane, as the wrapper computed it (0 on the host).
    pub fn lane(&self) -> I<'c> {
        self.lane.unwrap_or_else(|| self.i64c(0))
    }

    /// Sets this thread's lane (the body's lane parameter).
    pub fn set_lane(&mut self, lane: I<'c>) {
        self.lane = Some(lane);
    }

    /// `for j in (start + lane..end).step_by(lanes)`: this lane's share of `start..end`, in
    /// order (the whole range, in order, on the host).
    pub fn lane_range(&mut self, start: I<'c>, end: I<'c>, body: impl FnOnce(&mut Self, I<'c>)) {
        let first = self.iadd(start, self.lane());
        let stride = self.i64c(self.lanes());
        self.strided_loop(first, end, stride, body);
    }

    /// A hint that the cache lines of tensor `name`'s elements `lo..hi` will be read soon (the
    /// host's `llvm.prefetch`, read, high locality, data); `lo..hi` lies inside the kernel's
    /// range.
    pub fn prefetch_lines(&mut self, name: &str, lo: I<'c>, hi: I<'c>) {
        let (p, ptr) = self.ptr(name);
        let (elem, bytes) = match p {
            Param::Tensor(_, Dtype::Fp32) => (self.ctx.f32_type().as_basic_type_enum(), 4),
            Param::Tensor(..) => (self.ctx.i16_type().as_basic_type_enum(), 2),
            _ => panic!("`{name}` is not a tensor"),
        };
        let f = self.intrinsic_fn("llvm.prefetch", &[ptr.get_type().as_basic_type_enum()]);
        let line = self.i64c(64 / bytes);
        self.strided_loop(lo, hi, line, |fx, i| {
            let at = fx.gep(ptr, elem, i);
            // Read, high locality (T0), data cache.
            let [rw, locality, data] = [0, 3, 1].map(|v| fx.i32c(v).into());
            fx.call_void(f, &[at.into(), rw, locality, data]);
        });
    }

    /// `for r in 0..rows`, a column's walk down its rows: on the GPU this lane's share
    /// ([`Fx::lane_range`]). On the host the entry walks the rows outside the columns (each row
    /// read along its length, not a column down a 4 KiB stride) and passes the row as the
    /// lane, so `body` runs at that row only; a column's sum, kept in its output between rows
    /// ([`Fx::start_column`], [`Fx::finish_column`]), takes its terms in the same order either
    /// way.
    pub fn column_rows(&mut self, rows: I<'c>, body: impl FnOnce(&mut Self, I<'c>)) {
        if self.rows_outside {
            let r = self.lane();
            body(self, r);
        } else {
            self.lane_range(self.i64c(0), rows, body);
        }
    }

    /// Σ over `start..end` of `term(j)`: each lane adds its strided share ([`Fx::lane_range`])
    /// from −0.0, as Rust's `sum` starts, then [`Fx::lane_sum`] adds the lanes'. A row's sums.
    pub fn row_sum(
        &mut self,
        start: I<'c>,
        end: I<'c>,
        term: impl Fn(&Self, I<'c>) -> F<'c>,
    ) -> F<'c> {
        let total = self.var(self.f(-0.0));
        self.lane_range(start, end, |fx, j| {
            let v = term(fx, j);
            fx.set(&total, fx.add(fx.get(&total), v));
        });
        self.lane_sum(self.get(&total))
    }

    /// `x` combined over the lanes by `op` with a shuffle butterfly: at each step a lane and its
    /// partner combine the same two values in either order, so every lane ends with the same
    /// bits. `x` itself on the host.
    fn lane_fold(&self, x: F<'c>, op: impl Fn(&Self, F<'c>, F<'c>) -> F<'c>) -> F<'c> {
        if self.lanes == 1 {
            return x;
        }
        assert_eq!(self.lanes, WARP, "shuffles combine the lanes of a warp");
        let mut v = x;
        let mut offset = WARP / 2;
        while offset > 0 {
            let other = self.shfl_xor(v, offset);
            v = op(self, v, other);
            offset /= 2;
        }
        v
    }

    /// Σ of `x` over the lanes (see [`Fx::lane_fold`]).
    pub fn lane_sum(&self, x: F<'c>) -> F<'c> {
        self.lane_fold(x, |fx, a, b| fx.add(a, b))
    }

    /// The max (`maxnum`) of `x` over the lanes.
    pub fn lane_max(&self, x: F<'c>) -> F<'c> {
        self.lane_fold(x, |fx, a, b| fx.maxnum(a, b))
    }

    // ----- warp-wide matrix instructions (the fused attention; the GPU only) -----

    fn gpu_only(&self, what: &str) {
        assert!(
            self.target != Target::Host,
            "{what} exists only on the GPU (and a warp on the host)"
        );
    }

    /// The raw bits of element `i` of the 16-bit tensor `name`, zero-extended to i32.
    pub fn load_bits16(&self, name: &str, i: I<'c>) -> I<'c> {
        let (p, ptr) = self.ptr(name);
        assert!(
            matches!(p, Param::Tensor(_, Dtype::Bf16 | Dtype::Fp16)),
            "`{name}` ({p:?}) is not a 16-bit tensor"
        );
        let h = self.load_i16(ptr, i);
        self.b
            .build_int_z_extend(h, self.ctx.i32_type(), "")
            .expect(BUILD)
    }

    /// Elements `i` and `i + 1` of the 16-bit tensor `name` in one 32-bit load, element `i` in
    /// the low half: `i` must be even and the tensor 4-byte aligned (the fused attention's
    /// callers guarantee both).
    pub fn load_pair16(&self, name: &str, i: I<'c>) -> I<'c> {
        let (p, ptr) = self.ptr(name);
        assert!(
            matches!(p, Param::Tensor(_, Dtype::Bf16 | Dtype::Fp16)),
            "`{name}` ({p:?}) is not a 16-bit tensor"
        );
        let at = self.gep(ptr, self.ctx.i16_type().into(), i);
        let t = self.ctx.i32_type();
        self.b.build_load(t, at, "").expect(BUILD).into_int_value()
    }

    /// `x` rounded to bf16 as every store rounds it, its bits zero-extended to i32.
    pub fn bf16_bits(&self, x: F<'c>) -> I<'c> {
        let h = self.f32_to_bf16(x);
        self.b
            .build_int_z_extend(h, self.ctx.i32_type(), "")
            .expect(BUILD)
    }

    /// Two 16-bit values (i32, zero-extended) in one 32-bit register, `lo` in the low half.
    pub fn pack16(&self, lo: I<'c>, hi: I<'c>) -> I<'c> {
        let hi = self.b.build_left_shift(hi, self.i32c(16), "").expect(BUILD);
        self.b.build_or(lo, hi, "").expect(BUILD)
    }

    /// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` over the warp: D = A·B + C, each
    /// lane passing its fragment registers (layouts: `crate::flash`).
    pub fn mma_bf16(&self, a: [I<'c>; 4], b: [I<'c>; 2], c: [F<'c>; 4]) -> [F<'c>; 4] {
        self.gpu_only("mma.sync");
        let (i, f) = (self.ctx.i32_type(), self.ctx.f32_type());
        if self.target == Target::Warp {
            return self.warp_mma(a, b, c);
        }
        let ret = self.ctx.struct_type(&[f.into(); 4], false);
        let params: Vec<inkwell::types::BasicMetadataTypeEnum> =
            [i.into(); 6].into_iter().chain([f.into(); 4]).collect();
        let mma = self.declared(
            "llvm.nvvm.mma.m16n8k16.row.col.bf16",
            ret.fn_type(&params, false),
        );
        let args: Vec<BasicValueEnum> = a
            .iter()
            .chain(&b)
            .map(|&x| x.into())
            .chain(c.iter().map(|&x| x.into()))
            .collect();
        let d = self.call(mma, &args).into_struct_value();
        std::array::from_fn(|k| {
            self.b
                .build_extract_value(d, k as u32, "")
                .expect(BUILD)
                .into_float_value()
        })
    }

    /// [`Fx::mma_bf16`] on a [`Target::Warp`]: the host's lanes meet in a call that writes
    /// each lane's D through a pointer to four floats.
    fn warp_mma(&self, a: [I<'c>; 4], b: [I<'c>; 2], c: [F<'c>; 4]) -> [F<'c>; 4] {
        let (i, f) = (self.ctx.i32_type(), self.ctx.f32_type());
        let ptr = self.ctx.ptr_type(inkwell::AddressSpace::default());
        let params: Vec<inkwell::types::BasicMetadataTypeEnum> = [i.into(); 6]
            .into_iter()
            .chain([f.into(); 4])
            .chain([ptr.into()])
            .collect();
        let mma = self.declared(
            super::warp::MMA,
            self.ctx.void_type().fn_type(&params, false),
        );
        let out = self.entry_alloca(f.array_type(4));
        let args: Vec<BasicMetadataValueEnum> = a
            .iter()
            .chain(&b)
            .map(|&x| x.into())
            .chain(c.iter().map(|&x| x.into()))
            .chain([out.into()])
            .collect();
        self.call_void(mma, &args);
        std::array::from_fn(|k| {
            let at = self.gep(out, f.into(), self.i64c(k as u64));
            self.b
                .build_load(f, at, "")
                .expect(BUILD)
                .into_float_value()
        })
    }

    /// `x` from the lane whose index differs from this one's by `mask` (`shfl.sync.bfly`; on
    /// a [`Target::Warp`], the host's lanes exchanging it).
    pub fn shfl_xor(&self, x: F<'c>, mask: u64) -> F<'c> {
        self.gpu_only("shfl.sync");
        let (f, i) = (self.ctx.f32_type(), self.ctx.i32_type());
        if self.target == Target::Warp {
            let shfl = self.declared(super::warp::SHFL, f.fn_type(&[f.into(), i.into()], false));
            return self
                .call(shfl, &[x.into(), self.i32c(mask).into()])
                .into_float_value();
        }
        let t = f.fn_type(&[i.into(), f.into(), i.into(), i.into()], false);
        let shfl = self.declared("llvm.nvvm.shfl.sync.bfly.f32", t);
        let args = [
            self.i32c(0xffff_ffff).into(),
            x.into(),
            self.i32c(mask).into(),
            self.i32c(WARP - 1).into(),
        ];
        self.call(shfl, &args).into_float_value()
    }

    /// 2ˣ (`ex2.approx` on the GPU, the host's `exp2` on a [`Target::Warp`]; 2^−∞ = 0).
    pub fn exp2_approx(&self, x: F<'c>) -> F<'c> {
        self.gpu_only("ex2.approx");
        if self.target == Target::Warp {
            return self.f32_intrinsic("llvm.exp2", &[x]);
        }
        self.nvvm_f32("llvm.nvvm.ex2.approx.f", x)
    }

    /// log₂ x (`lg2.approx` on the GPU, the host's `log2` on a [`Target::Warp`]).
    pub fn log2_approx(&self, x: F<'c>) -> F<'c> {
        self.gpu_only("lg2.approx");
        if self.target == Target::Warp {
            return self.f32_intrinsic("llvm.log2", &[x]);
        }
        self.nvvm_f32("llvm.nvvm.lg2.approx.f", x)
    }

    /// This thread's lane on a [`Target::Warp`] (the host's lanes are threads).
    pub fn warp_lane(&self) -> I<'c> {
        let f = self.declared(super::warp::LANE, self.ctx.i64_type().fn_type(&[], false));
        self.call(f, &[]).into_int_value()
    }

    /// `body` on lane 0 only: a cooperative row's scalar outputs.
    pub fn first_lane(&mut self, body: impl FnOnce(&mut Self)) {
        let lane0 = self.icmp(IntPredicate::EQ, self.lane(), self.i64c(0));
        self.when(lane0, body);
    }

    /// Where a column's sum starts: on the host (one lane) the value stored at `name[i]`, which
    /// it continues in row order; on the GPU 0, each lane's share of the rows being added to
    /// `name[i]` by [`Fx::finish_column`].
    pub fn start_column(&self, name: &str, i: I<'c>) -> F<'c> {
        if self.lanes == 1 {
            self.load(name, i)
        } else {
            self.f(0.0)
        }
    }

    /// A column's sum from [`Fx::start_column`] written back: stored on the host, added
    /// atomically on the GPU.
    pub fn finish_column(&self, name: &str, i: I<'c>, sum: F<'c>) {
        if self.lanes == 1 {
            self.store(name, i, sum);
        } else {
            self.add_into(name, i, sum);
        }
    }
}

/// A stack slot holding an accumulator.
pub struct Var<'c> {
    slot: PointerValue<'c>,
    ty: BasicTypeEnum<'c>,
}

const GELU_C: f32 = 0.797_884_6; // sqrt(2/π)
const GELU_A: f32 = 0.044_715;
