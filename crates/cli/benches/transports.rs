//! Reshard between processes against the raw transports, in one run, on the same bytes:
//! `tcp` against a plain loopback socket stream, `shm` against memcpy. 6 processes, an
//! 8192x8192 bf16 tensor (128 MiB). `cargo bench --bench transports`; results in BENCHMARKS.md.

use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::Instant;

const BYTES: usize = 8192 * 8192 * 2;
const ITERS: usize = 10;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One thread streams the bytes to another over loopback TCP, in 4 MiB writes from one buffer
/// of all the bytes into another: from memory to memory, as a reshard moves them (a single
/// 4 MiB buffer written over and over would stay in the L3 cache).
fn raw_socket_stream() -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let sender = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        let data = vec![7u8; BYTES];
        for _ in 0..ITERS + 2 {
            for piece in data.chunks(4 << 20) {
                s.write_all(piece).unwrap();
            }
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack).unwrap();
        }
    });
    let (mut r, _) = listener.accept().unwrap();
    let mut buf = vec![0u8; BYTES];
    let mut times = Vec::new();
    for i in 0..ITERS + 2 {
        let started = Instant::now();
        r.read_exact(&mut buf).unwrap();
        if i >= 2 {
            times.push(started.elapsed().as_secs_f64());
        }
        r.write_all(&[1]).unwrap();
    }
    sender.join().unwrap();
    median(times)
}

fn memcpy() -> f64 {
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    dst.copy_from_slice(&src);
    let times = (0..ITERS)
        .map(|_| {
            let started = Instant::now();
            black_box(&mut dst).copy_from_slice(black_box(&src));
            started.elapsed().as_secs_f64()
        })
        .collect();
    median(times)
}

/// Median seconds of `reshard run` under `reshard launch --nproc 6`.
fn reshard(transport: &str, src: &str, dst: &str) -> f64 {
    let out = Command::new(env!("CARGO_BIN_EXE_reshard"))
        .args([
            "launch",
            "--nproc",
            "6",
            "--",
            "run",
            "--shape",
            "8192,8192",
            "--dtype",
            "bf16",
        ])
        .args([
            "--src",
            src,
            "--dst",
            dst,
            "--transport",
            transport,
            "--verify",
            "--json",
        ])
        .args(["--iters", &ITERS.to_string(), "--warmup", "2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["verified"], true);
    json["seconds"].as_f64().unwrap()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` lists; nothing to list here
    }
    let gbps = |s: f64| BYTES as f64 / s / 1e9;
    let socket = raw_socket_stream();
    let copy = memcpy();
    println!("raw loopback socket stream: {:.2} GB/s", gbps(socket));
    println!("memcpy (one thread):        {:.2} GB/s", gbps(copy));
    println!();
    println!("| case | transport | reshard | raw | reshard / raw |");
    println!("|---|---|---|---|---|");
    for (name, src, dst) in [
        (
            "4 x S(0) -> 2 x S(1)",
            "mesh=4 place=S(0)",
            "mesh=2 place=S(1)",
        ),
        (
            "2 x S(0) -> 4 x S(1)",
            "mesh=2 place=S(0)",
            "mesh=4 place=S(1)",
        ),
    ] {
        for (transport, raw, raw_name) in [("tcp", socket, "socket"), ("shm", copy, "memcpy")] {
            let t = reshard(transport, src, dst);
            println!(
                "| {name} | {transport} | {:.2} GB/s | {:.2} GB/s ({raw_name}) | {:.0}% |",
                gbps(t),
                gbps(raw),
                100.0 * raw / t
            );
        }
    }
}
