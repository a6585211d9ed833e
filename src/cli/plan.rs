//! `reshard plan`: the transfer plan as a table and a picture, or as JSON.

use std::fmt::Write;

use clap::Args;
use reshard::Plan;
use reshard::plan::PlanJson;

use super::units::bytes;
use super::{Failure, TensorArgs, picture};

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    tensor: TensorArgs,
    /// Print the plan as JSON (the format of the design notes).
    #[arg(long)]
    json: bool,
    /// Print at most this many transfers in the table (JSON always has all).
    #[arg(long, default_value_t = 64)]
    max_rows: usize,
}

pub fn main(args: &PlanArgs) -> Result<(), Failure> {
    let plan = args.tensor.plan()?;
    if args.json {
        let json =
            serde_json::to_string_pretty(&PlanJson::of(&plan)).expect("plan JSON serializes");
        println!("{json}");
    } else {
        print!("{}", describe(&plan, args.max_rows));
    }
    Ok(())
}

/// The layouts, the transfer table, the totals and (for 2-D tensors) the picture.
pub fn describe(plan: &Plan, max_rows: usize) -> String {
    let (src, dst) = (plan.src(), plan.dst());
    let elem = plan.elem_bytes();
    let shape: Vec<String> = src.shape().iter().map(u64::to_string).collect();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "tensor  {} {} ({})",
        shape.join("x"),
        src.dtype(),
        bytes(src.total_bytes())
    );
    let _ = writeln!(out, "src     {src}  ({} ranks)", src.mesh().size());
    let _ = writeln!(out, "dst     {dst}  ({} ranks)", dst.mesh().size());
    let _ = writeln!(out);
    let _ = writeln!(out, "{} transfers:", plan.transfers().len());
    let _ = writeln!(
        out,
        "  {:>6} {:>6}  {:<28} {:>12}",
        "src", "dst", "region", "bytes"
    );
    for t in plan.transfers().iter().take(max_rows) {
        let kind = if t.is_local() { "  (local)" } else { "" };
        let _ = writeln!(
            out,
            "  {:>6} {:>6}  {:<28} {:>12}{kind}",
            t.src,
            t.dst,
            t.region.to_string(),
            t.bytes(elem)
        );
    }
    if plan.transfers().len() > max_rows {
        let _ = writeln!(
            out,
            "  ... {} more (--max-rows, or --json)",
            plan.transfers().len() - max_rows
        );
    }
    let t = plan.totals();
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "remote  {} in {} messages; local copies {}",
        bytes(t.bytes_remote),
        t.messages,
        bytes(t.bytes_local)
    );
    let _ = writeln!(
        out,
        "busiest rank sends {}, receives {}",
        bytes(t.max_rank_send_bytes),
        bytes(t.max_rank_recv_bytes)
    );
    let ratio = if t.bytes_remote > 0 {
        format!(
            "{:.1}x what reshard moves",
            t.gather_broadcast_bytes as f64 / t.bytes_remote as f64
        )
    } else {
        "reshard moves nothing".to_string()
    };
    let _ = writeln!(
        out,
        "gather+broadcast would move {} ({ratio})",
        bytes(t.gather_broadcast_bytes)
    );
    if let Some(picture) = picture::draw(plan) {
        let _ = writeln!(out);
        out.push_str(&picture);
    }
    out
}
