//! The `reshard` command: a thin shell over the library (see `cli`).

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    cli::main()
}
