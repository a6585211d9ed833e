//! The text of a stream of refits while serving (`run --stage`, `refit --run --stage`): one
//! line per version and method, then each method summed up against the refit in place.

use std::fmt::Write;

use reshard::runtime::rollout::{MethodSummary, VersionServed};

use super::units::bytes;

/// The table of every version and method, then the summary.
pub fn describe(versions: &[VersionServed], methods: &[MethodSummary]) -> String {
    let mut out = String::from(
        "version  method           refit s   decide s   commit s    pause s   passes during refit   outcome\n",
    );
    for v in versions {
        let passes: u64 = v.ranks.iter().map(|r| r.passes_during_refit).sum();
        let _ = writeln!(
            out,
            "{:>7}  {:<15} {:>8.4}   {:>8.4}   {:>8.4}   {:>8.4}   {:>19}   {}{}",
            v.version,
            v.method,
            v.refit_s,
            v.decide_s,
            v.commit_s,
            v.pause_s(),
            passes,
            v.outcome,
            if v.mixed() {
                "  MIXED VERSIONS SEEN"
            } else {
                ""
            }
        );
        let groups = v.groups();
        if groups.len() > 1 && v.outcome == "commit" {
            let each: Vec<String> = groups
                .iter()
                .map(|(ranks, pause)| format!("{ranks:?} {pause:.4} s"))
                .collect();
            let _ = writeln!(out, "         pause by commit group: {}", each.join(", "));
        }
    }
    out.push_str(
        "\nmethod           refit s    pause s   pause / in-place refit   passes during refit   staging per rank   patches per rank   mixed\n",
    );
    for m in methods {
        let ratio = m
            .pause_over_in_place
            .map_or("-".to_string(), |r| format!("{:.2}%", 100.0 * r));
        let _ = writeln!(
            out,
            "{:<15}  {:>8.4}   {:>8.4}   {:>22}   {:>19}   {:>16}   {:>16}   {}",
            m.method,
            m.refit_s,
            m.pause_s,
            ratio,
            m.passes_during_refit,
            bytes(m.staging_bytes_per_rank),
            bytes(m.patch_bytes_per_rank),
            if m.mixed { "YES" } else { "no" }
        );
    }
    out.push_str(
        "(medians over the versions after the first; pause: the longest gap between two passes of a destination rank's serving engine)\n",
    );
    out
}
