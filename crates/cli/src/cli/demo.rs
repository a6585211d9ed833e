//! `reshard demo`: the seed example, end to end.

use reshard::exec::{self, ExecOptions};
use reshard::fill::Fill;

use super::Failure;
use super::units::bytes;

pub fn main() -> Result<(), Failure> {
    // exactly what `reshard plan --shape 8,8 --dtype bf16 --src ... --dst ...` builds
    let seed = super::TensorArgs {
        shape: "8,8".into(),
        dtype: "bf16".into(),
        dst_dtype: None,
        quant: None,
        scale_dtype: None,
        src: "mesh=2 place=S(0)".into(),
        dst: "mesh=4 place=S(1)".into(),
        min_split_bytes: "64KiB".into(),
        hosts: super::HostArgs {
            hosts: None,
            relay: "on".into(),
        },
    };
    let plan = seed.plan()?;
    println!("reshard demo: the reshard collective on its seed example\n");
    println!("An 8x8 bf16 weight. Training ranks 0 and 1 hold it as two 4x8 row shards");
    println!("(--src \"mesh=2 place=S(0)\"); inference ranks 2..6 need four 8x2 column shards");
    println!("(--dst \"mesh=4 place=S(1)\"). Every inference rank receives one 4x2 block from");
    println!("each training rank, directly: nobody gathers the whole tensor.\n");

    print!("{}", super::plan::describe(&plan, 64));

    println!(
        "\nRunning it: every rank a thread, buffers filled with element i = i (--fill index)."
    );
    let fill = Fill::Index;
    let sources = fill.shards(plan.src())?;
    let mut shards = exec::zeroed_shards(plan.dst())?;
    let stats = exec::run_local(&plan, &sources, &mut shards, &ExecOptions::default())?;
    fill.verify_shards(plan.dst(), &shards)?;
    println!(
        "  done in {:.3} ms; verified: all {} destination bytes are right.",
        stats.elapsed.as_secs_f64() * 1e3,
        stats.bytes_remote() + stats.bytes_local()
    );
    for (rank, buf) in &shards {
        let rows: Vec<String> = buf
            .chunks_exact(4)
            .map(|row| {
                format!(
                    "{:>2} {:>2}",
                    u16::from_le_bytes([row[0], row[1]]),
                    u16::from_le_bytes([row[2], row[3]])
                )
            })
            .collect();
        println!(
            "  rank {rank}'s 8x2 shard, row by row: {}",
            rows.join(" | ")
        );
    }

    let t = plan.totals();
    let full = plan.src().total_bytes();
    println!("\nBytes on the wire:");
    println!(
        "  reshard           {:>8}  (each byte of the tensor once)",
        bytes(t.bytes_remote)
    );
    println!(
        "  gather+broadcast  {:>8}  (all-gather {} between the 2 sources, then {} x {} broadcast)",
        bytes(t.gather_broadcast_bytes),
        bytes(full),
        plan.dst().mesh().size(),
        bytes(full)
    );
    println!(
        "  reshard moves {:.1}x fewer bytes, and no rank ever holds more than its own shard.",
        t.gather_broadcast_bytes as f64 / t.bytes_remote as f64
    );
    println!(
        "\nTry: reshard plan --shape 10,6 --src \"mesh=2x2 place=R,S(0)\" --dst \"mesh=4 place=S(1)\""
    );
    Ok(())
}
