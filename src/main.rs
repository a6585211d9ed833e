//! The `reshard` command: a thin shell over the library (see `cli`).

mod cli;

use std::process::ExitCode;

/// Planning a whole model makes millions of small boxes; mimalloc allocates and frees them
/// several times faster than the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // `reshard plan ... | head` ends quietly, as command-line tools do, instead of panicking
    // on a closed pipe.
    // SAFETY: restoring the default disposition of one signal before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    cli::main()
}
