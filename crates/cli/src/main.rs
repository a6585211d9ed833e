//! The `reshard` command: a thin shell over the library (see `cli`).

mod cli;

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::process::ExitCode;

use mimalloc::MiMalloc;

/// Planning a whole model makes millions of small boxes; mimalloc allocates and frees them
/// several times faster than the system allocator.
#[global_allocator]
static ALLOCATOR: Allocator = Allocator;

thread_local! {
    /// Whether this thread is inside the panic hook (printing a message and a backtrace).
    static REPORTING_PANIC: Cell<bool> = const { Cell::new(false) };
}

/// mimalloc, plus one guarantee: an allocation that fails while a panic is being reported ends
/// the process at once. The standard library's panic hook holds its backtrace lock while it
/// prints, and its out-of-memory handler takes the same lock to print another backtrace, so an
/// allocation failure inside the hook (likely when memory is what ran out) would otherwise
/// deadlock the process forever instead of ending it.
struct Allocator;

/// Called when the allocator returns null: outside a panic report, null goes back to the
/// caller (`try_reserve` turns it into an error; other callers abort with a message).
fn allocation_failed() {
    if REPORTING_PANIC.try_with(Cell::get).unwrap_or(false) {
        const MESSAGE: &[u8] = b"error: out of memory while reporting the panic above\n";
        // SAFETY: write(2) and _exit(2) take no locks and allocate nothing.
        unsafe {
            libc::write(2, MESSAGE.as_ptr().cast(), MESSAGE.len());
            libc::_exit(101);
        }
    }
}

// SAFETY: every call forwards to mimalloc with the same arguments and returns its result.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let ptr = unsafe { MiMalloc.alloc(layout) };
        if ptr.is_null() {
            allocation_failed();
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let ptr = unsafe { MiMalloc.alloc_zeroed(layout) };
        if ptr.is_null() {
            allocation_failed();
        }
        ptr
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let new = unsafe { MiMalloc.realloc(ptr, layout, new_size) };
        if new.is_null() {
            allocation_failed();
        }
        new
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { MiMalloc.dealloc(ptr, layout) }
    }
}

fn main() -> ExitCode {
    // `reshard plan ... | head` ends quietly, as command-line tools do, instead of panicking
    // on a closed pipe.
    // SAFETY: restoring the default disposition of one signal before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // the standard report, marked so that the allocator knows a failure now must not wait
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let _ = REPORTING_PANIC.try_with(|r| r.set(true));
        report(info);
        let _ = REPORTING_PANIC.try_with(|r| r.set(false));
    }));
    cli::main()
}
