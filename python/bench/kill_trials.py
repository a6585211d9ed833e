#!/usr/bin/env python3
"""Kill -9 trials of a refit while serving, across processes.

Every trial launches `reshard launch --nproc N -- refit ... --run --stage --transport tcp`,
waits a random moment, kills one rank process (any rank, rank 0 included) with SIGKILL, and
waits for the job to end. Then it reads what every surviving rank printed on stderr:

    rank R serves version V (METHOD)[, version W staged (in doubt)]

A trial passes when
  * the job ended on its own within the bound (no rank left running, none that the
    launcher had to kill after its grace),
  * at least one surviving destination rank reported what it serves,
  * every surviving destination rank that reported names the same served version V
    (a rank in doubt may keep version W = V + 1 staged; it is listed apart),
  * no surviving rank ended cleanly (no error) while others reported failure mid-stream.

Only the standard library. Only processes this script started are signalled: the launcher,
and the rank processes found as its children.

    python3 python/bench/kill_trials.py --trials 20 --seed 1
    python3 python/bench/kill_trials.py --trials 20 --seed 2 --delta
"""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

SERVES = re.compile(
    r"^\[rank (\d+)\] rank (\d+) serves version (\d+) \(([^)]*)\)"
    r"(?:, version (\d+) staged \(in doubt\))?"
)
ERROR = re.compile(r"^\[rank (\d+)\] error: (.*)$")
LAUNCH_KILLED = re.compile(r"^\[launch\] killed rank (\d+)")
PANIC = re.compile(r"panicked at", re.IGNORECASE)

# what the surviving ranks' errors say about where the kill landed, first match wins
PHASES = [
    ("in doubt", re.compile(r"in doubt", re.IGNORECASE)),
    # the stream was over: the kill landed in the job's final report, nothing stopped short
    ("finish (after the stream)", re.compile(r"exited without reporting")),
    ("exited before voting", re.compile(r"exited before voting", re.IGNORECASE)),
    ("not prepared", re.compile(r"not prepared", re.IGNORECASE)),
    ("abort", re.compile(r"abort", re.IGNORECASE)),
    ("commit", re.compile(r"commit", re.IGNORECASE)),
    ("verdict", re.compile(r"during the verdict")),
    ("barrier", re.compile(r"during the barrier")),
    ("transfer", re.compile(r"did not complete|connection closed during bytes")),
    ("timeout", re.compile(r"timed out|timeout", re.IGNORECASE)),
    ("peer exited", re.compile(r"exited|closed|reset|broken pipe|eof", re.IGNORECASE)),
]

MODEL = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def children_of(pid):
    """Pids of the direct children of `pid` (every thread's children list)."""
    kids = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                kids.extend(int(x) for x in f.read().split())
        except OSError:
            pass
    return sorted(set(kids))


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            try:
                return int(kv[5:])
            except ValueError:
                return None
    return None


def ranks_of(launcher_pid, nproc, deadline):
    """{rank: pid} of the launcher's rank processes, once all of them are up."""
    found = {}
    while time.monotonic() < deadline:
        for pid in children_of(launcher_pid):
            if pid in found.values():
                continue
            r = rank_of(pid)
            if r is not None:
                found[r] = pid
        if len(found) >= nproc:
            break
        time.sleep(0.01)
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def reader(stream, sink):
    for line in iter(stream.readline, b""):
        sink.append(line.decode("utf-8", "replace").rstrip("\n"))
    stream.close()


def command(args, model_path):
    train = args.nproc // 2
    cmd = [
        args.reshard,
        "launch",
        "--nproc",
        str(args.nproc),
        "--grace",
        str(args.grace),
        "--",
        "refit",
        "--model",
        model_path,
        "--train",
        f"fsdp={train}",
        "--infer",
        f"tp={args.nproc - train}",
        "--run",
        "--stage",
    ]
    if args.delta:
        cmd += ["--delta", "--stage-methods", "staged-delta"]
    else:
        cmd += ["--stage-methods", "staged"]
    cmd += ["--steps", str(args.steps), "--transport", "tcp", "--timeout", str(args.timeout)]
    return cmd


def run_job(cmd, kill_at, rng, nproc, bound):
    """Runs one job; kills a random rank at `kill_at` seconds (None: no kill)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = [], []
    threads = [
        threading.Thread(target=reader, args=(proc.stdout, out), daemon=True),
        threading.Thread(target=reader, args=(proc.stderr, err), daemon=True),
    ]
    for t in threads:
        t.start()
    pids = ranks_of(proc.pid, nproc, t0 + 30)
    started = set(pids.values())
    res = {"killed_rank": None, "kill_s": None, "kill_missed": False, "hang": False, "ranks_found": len(pids)}
    if kill_at is not None:
        victim = rng.randrange(nproc)
        res["killed_rank"] = victim
        delay = t0 + kill_at - time.monotonic()
        if delay > 0:
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                pass
        pid = pids.get(victim)
        res["kill_s"] = round(time.monotonic() - t0, 3)
        if pid is None or proc.poll() is not None or not alive(pid):
            res["kill_missed"] = True
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                res["kill_missed"] = True
    kill_done = time.monotonic()
    try:
        proc.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        res["hang"] = True
        res["still_running"] = sorted(r for r, p in pids.items() if alive(p))
        # only what this script started: the rank processes, then the launcher
        for p in started:
            if alive(p) and p in children_of(proc.pid):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.kill()
        proc.wait()
    for t in threads:
        t.join(timeout=5)
    res["rc"] = proc.returncode
    res["elapsed_s"] = round(time.monotonic() - t0, 3)
    res["end_after_kill_s"] = round(time.monotonic() - kill_done, 3)
    return res, out, err


def judge(res, err, nproc):
    train = nproc // 2
    dest = set(range(train, nproc))
    killed = res["killed_rank"]
    surviving = set(range(nproc)) - ({killed} if killed is not None and not res["kill_missed"] else set())
    serves, doubt, errors, launch_killed, panics = {}, {}, {}, set(), []
    for line in err:
        m = SERVES.match(line)
        if m:
            r = int(m.group(1))
            serves[r] = int(m.group(3))
            if m.group(5) is not None:
                doubt[r] = int(m.group(5))
            continue
        m = ERROR.match(line)
        if m:
            errors.setdefault(int(m.group(1)), []).append(m.group(2))
            continue
        m = LAUNCH_KILLED.match(line)
        if m:
            launch_killed.add(int(m.group(1)))
        if PANIC.search(line):
            panics.append(line)
    reasons = []
    reported = {r: v for r, v in serves.items() if r in dest and r in surviving}
    if res["hang"]:
        reasons.append(f"hang: ranks {res.get('still_running')} still running")
    if launch_killed & surviving:
        reasons.append(
            f"ranks {sorted(launch_killed & surviving)} did not end on their own "
            "(killed by the launcher after its grace)"
        )
    if panics:
        reasons.append(f"panic: {panics[0]}")
    if res["ranks_found"] < nproc:
        reasons.append(f"found only {res['ranks_found']} of {nproc} rank processes")
    failed_mid_stream = bool(errors)
    clean = sorted(r for r in surviving if r not in errors and r not in launch_killed)
    if failed_mid_stream and clean:
        reasons.append(f"ranks {clean} ended without an error while others failed")
    after_stream = any("exited without reporting" in m for e in errors.values() for m in e)
    if failed_mid_stream and not reported and not after_stream:
        reasons.append("no surviving destination rank reported what it serves")
    versions = sorted(set(reported.values()))
    if len(versions) > 1:
        reasons.append(f"destination ranks disagree on the served version: {reported}")
    for r, w in doubt.items():
        if w != serves[r] + 1:
            reasons.append(f"rank {r} in doubt keeps version {w} staged over served {serves[r]}")
    phase = "none (job ended cleanly)" if not errors else "other"
    text = " | ".join(m for r in sorted(errors) for m in errors[r])
    for name, rx in PHASES:
        if rx.search(text) or (name == "in doubt" and doubt):
            phase = name
            break
    if res["hang"]:
        phase = "hang"
    return {
        "pass": not reasons,
        "reasons": reasons,
        "served": {str(r): v for r, v in sorted(reported.items())},
        "in_doubt": {str(r): w for r, w in sorted(doubt.items())},
        "versions": versions,
        "phase": phase,
        "errors": {str(r): e for r, e in sorted(errors.items())},
        "silent_destinations": sorted((dest & surviving) - set(reported)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nproc", type=int, default=8, help="ranks: half fsdp training, half tp inference")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--delta", action="store_true", help="--delta --stage-methods staged-delta")
    ap.add_argument("--timeout", type=float, default=5, help="the ranks' --timeout")
    ap.add_argument("--grace", type=float, default=30, help="the launcher's --grace")
    ap.add_argument("--bound", type=float, default=60, help="seconds a job may run after the kill")
    ap.add_argument("--model", help="an HF config.json (default: a small qwen3 written to a temp file)")
    ap.add_argument(
        "--reshard",
        default=os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "..", "..", "target", "release", "reshard"
        ),
    )
    ap.add_argument(
        "--window",
        type=float,
        help="kill moments are uniform in [0.3, WINDOW] s (default: 0.85 of a clean run)",
    )
    ap.add_argument("--json", action="store_true", help="print every trial as JSON at the end")
    args = ap.parse_args()
    args.reshard = os.path.normpath(args.reshard)

    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(MODEL, tmp)
        tmp.close()
        model = tmp.name
    rng = random.Random(args.seed)
    cmd = command(args, model)
    print("command: " + " ".join(cmd))
    try:
        window = args.window
        if window is None:
            res, out, err = run_job(cmd, None, rng, args.nproc, 300)
            if res["rc"] != 0:
                print("the clean run failed:\n" + "\n".join(err[-20:]))
                return 1
            window = 0.85 * res["elapsed_s"]
            print(f"clean run {res['elapsed_s']:.2f} s; kills uniform in [0.3, {window:.2f}] s")
        trials = []
        for i in range(args.trials):
            kill_at = rng.uniform(0.3, max(0.31, window))
            res, out, err = run_job(cmd, kill_at, rng, args.nproc, args.bound)
            v = judge(res, err, args.nproc)
            trial = {"trial": i, **res, **v}
            trials.append(trial)
            served = ",".join(f"{r}:{x}" for r, x in v["served"].items()) or "-"
            doubt = ",".join(f"{r}:{w}" for r, w in v["in_doubt"].items()) or "-"
            missed = " (missed: rank already gone)" if res["kill_missed"] else ""
            print(
                f"trial {i:2d}  killed rank {res['killed_rank']}{missed} at {res['kill_s']:.2f} s"
                f"  served {served}  in doubt {doubt}  phase {v['phase']}"
                f"  ended {res['end_after_kill_s']:.1f} s after  rc {res['rc']}"
                f"  {'PASS' if v['pass'] else 'FAIL'}",
                flush=True,
            )
            if not v["pass"]:
                for r in v["reasons"]:
                    print(f"    {r}")
                for line in err[-40:]:
                    print(f"    | {line}")
        passed = sum(t["pass"] for t in trials)
        versions = sorted({x for t in trials for x in t["versions"]})
        phases = {}
        for t in trials:
            phases[t["phase"]] = phases.get(t["phase"], 0) + 1
        doubt_trials = sum(1 for t in trials if t["in_doubt"])
        killed0 = sum(1 for t in trials if t["killed_rank"] == 0 and not t["kill_missed"])
        print(
            f"summary: {passed}/{len(trials)} passed; served versions seen {versions}; "
            f"rank 0 killed in {killed0}; trials with ranks in doubt {doubt_trials}; phases "
            + ", ".join(f"{k} {n}" for k, n in sorted(phases.items()))
        )
        if args.json:
            print(
                json.dumps(
                    {"command": cmd, "seed": args.seed, "window_s": window, "trials": trials}, indent=1
                )
            )
        return 0 if passed == len(trials) else 1
    finally:
        if tmp is not None:
            os.unlink(tmp.name)


if __name__ == "__main__":
    sys.exit(main())
