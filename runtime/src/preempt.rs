//! Preemption (`runtime.md`, "Long runs"): SIGTERM or SIGINT asks the run to stop after the
//! current step; a second one ends the process at once.
//!
//! The handler only counts: the first signal is recorded for the training loop to read between
//! steps ([`requested`]); the second calls `_exit(128 + signal)`, the one async-signal-safe way
//! out, without unwinding or writing anything. Built on `sigaction` from `libc`, already a
//! dependency, rather than a signal crate: this is all the signal handling schedrun needs.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

static COUNT: AtomicUsize = AtomicUsize::new(0);
static FIRST: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    if COUNT.fetch_add(1, Ordering::SeqCst) == 0 {
        FIRST.store(signal, Ordering::SeqCst);
    } else {
        // SAFETY: `_exit` is async-signal-safe and takes any status.
        unsafe { libc::_exit(128 + signal) }
    }
}

/// Installs the handler for SIGTERM and SIGINT (for the rest of the process).
pub fn install() -> std::io::Result<()> {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed `sigaction` is a valid "no flags, empty mask" value; the handler only
        // touches atomics and calls `_exit`, both async-signal-safe.
        let r = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The first signal received since [`install`], if any.
pub fn requested() -> Option<i32> {
    match FIRST.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The signal's name, for messages.
pub fn name(signal: i32) -> &'static str {
    match signal {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        _ => "a signal",
    }
}
