//! Text pictures of 2-D plans: who holds which block, and which transfer fills which block.

use std::fmt::Write;

use reshard::layout::Layout;
use reshard::{Plan, Rank};

const MAX_ROWS: u64 = 16;
const MAX_COLS: u64 = 16;
const LABELS: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";

/// The element a picture cell stands for, when `n` elements are drawn as `cells` cells.
fn sample(n: u64, cells: u64, i: u64) -> u64 {
    (i as u128 * n as u128 / cells as u128) as u64
}

/// The first rank (in mesh order) whose box contains element `(r, c)`.
fn holder(layout: &Layout, r: u64, c: u64) -> Option<Rank> {
    let ranks = layout.mesh().ranks();
    (0..ranks.len()).find_map(|p| {
        let b = layout.region_at(p);
        (b.range(0).contains(&r) && b.range(1).contains(&c)).then_some(ranks[p])
    })
}

/// Three grids side by side (source shards, destination shards, transfers) and a legend, for
/// a 2-D tensor; `None` for other ranks or empty tensors.
pub fn draw(plan: &Plan) -> Option<String> {
    let (src, dst) = (plan.src(), plan.dst());
    let shape = src.shape();
    if shape.len() != 2 || shape.contains(&0) {
        return None;
    }
    let rows = shape[0].min(MAX_ROWS);
    let cols = shape[1].min(MAX_COLS);
    let width = plan
        .ranks()
        .iter()
        .map(|r| r.to_string().len())
        .max()
        .unwrap_or(1);
    // the transfers into the first destination holder of every cell, labelled in plan order
    let labelled: Vec<_> = plan.transfers().iter().take(LABELS.len()).collect();
    let label_of = |r: u64, c: u64| -> String {
        let Some(receiver) = holder(dst, r, c) else {
            return "?".into();
        };
        plan.transfers()
            .iter()
            .position(|t| {
                t.dst == receiver
                    && t.region.range(0).contains(&r)
                    && t.region.range(1).contains(&c)
            })
            .map_or("?".into(), |i| {
                LABELS
                    .get(i)
                    .map_or("#".into(), |&b| (b as char).to_string())
            })
    };
    let rank_cell =
        |l: &Layout, r: u64, c: u64| holder(l, r, c).map_or("-".into(), |k| k.to_string());

    let mut grids: Vec<Vec<String>> = vec![Vec::new(), Vec::new(), Vec::new()];
    for i in 0..rows {
        let r = sample(shape[0], rows, i);
        let mut lines = [String::new(), String::new(), String::new()];
        for j in 0..cols {
            let c = sample(shape[1], cols, j);
            let _ = write!(lines[0], " {:>width$}", rank_cell(src, r, c));
            let _ = write!(lines[1], " {:>width$}", rank_cell(dst, r, c));
            let _ = write!(lines[2], " {:>width$}", label_of(r, c));
        }
        for (g, line) in grids.iter_mut().zip(lines) {
            g.push(line);
        }
    }
    let titles = ["source shards", "destination shards", "transfers"];
    let grid_width = (cols as usize * (width + 1)).max(titles[1].len());
    let mut out = String::new();
    let scale = if rows < shape[0] || cols < shape[1] {
        format!(
            " (one cell per {}x{} elements, roughly)",
            shape[0].div_ceil(rows),
            shape[1].div_ceil(cols)
        )
    } else {
        " (one cell per element)".to_string()
    };
    let _ = writeln!(out, "{}x{} tensor{scale}:", shape[0], shape[1]);
    let head: Vec<String> = titles.iter().map(|t| format!("{t:<grid_width$}")).collect();
    let _ = writeln!(out, "{}", head.join("    ").trim_end());
    for i in 0..rows as usize {
        let line: Vec<String> = grids
            .iter()
            .map(|g| format!("{:<grid_width$}", g[i]))
            .collect();
        let _ = writeln!(out, "{}", line.join("    ").trim_end());
    }
    if src.replication() > 1 || dst.replication() > 1 {
        let _ = writeln!(
            out,
            "(replicated boxes show their first rank; transfers show the ones into it)"
        );
    }
    let _ = writeln!(out);
    for (i, t) in labelled.iter().enumerate() {
        let arrow = if t.is_local() { "local copy on" } else { "->" };
        let who = if t.is_local() {
            format!("{arrow} {}", t.dst)
        } else {
            format!("{} {arrow} {}", t.src, t.dst)
        };
        let _ = writeln!(out, "  {}: {who:<16} {}", LABELS[i] as char, t.region);
    }
    if plan.transfers().len() > LABELS.len() {
        let _ = writeln!(
            out,
            "  #: {} more transfers",
            plan.transfers().len() - LABELS.len()
        );
    }
    Some(out)
}
