//! Unit tests of the process group: the environment it is joined from and its control calls.

use std::collections::HashMap;
use std::io::Write;

use super::super::{Job, screen};
use super::*;

fn parse(vars: &[(&str, &str)]) -> Result<Option<GroupEnv>> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    GroupEnv::from_vars(|name| vars.get(name).cloned())
}

fn job_vars<'a>(extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut vars = vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "29500")];
    for &(k, v) in extra {
        vars.retain(|&(name, _)| name != k);
        vars.push((k, v));
    }
    vars
}

/// The variable an environment error names, and its value.
fn env_error(vars: &[(&str, &str)]) -> (&'static str, String) {
    match parse(&job_vars(vars)) {
        Err(Error::Env { var, value, .. }) => (var, value),
        other => panic!("expected an environment error, got {other:?}"),
    }
}

#[test]
fn world_size_is_bounded() {
    let huge = u64::MAX.to_string();
    assert_eq!(
        env_error(&[("WORLD_SIZE", &huge)]),
        ("WORLD_SIZE", huge.clone())
    );
    let over = (MAX_WORLD + 1).to_string();
    assert_eq!(env_error(&[("WORLD_SIZE", &over)]), ("WORLD_SIZE", over));
    assert_eq!(env_error(&[("WORLD_SIZE", "0")]).0, "WORLD_SIZE");
    assert_eq!(env_error(&[("WORLD_SIZE", "1e8")]).0, "WORLD_SIZE");
    let max = MAX_WORLD.to_string();
    let env = parse(&job_vars(&[("WORLD_SIZE", &max)])).unwrap().unwrap();
    assert_eq!(env.world, MAX_WORLD);
    assert_eq!(
        env_error(&[("RANK", "2")]),
        ("RANK", "2".into()),
        "a rank beyond the world names RANK"
    );
}

#[test]
fn master_port_zero_is_an_error() {
    assert_eq!(
        env_error(&[("MASTER_PORT", "0")]),
        ("MASTER_PORT", "0".into())
    );
    assert_eq!(env_error(&[("MASTER_PORT", "65536")]).0, "MASTER_PORT");
    let env = parse(&job_vars(&[("MASTER_PORT", "1")])).unwrap().unwrap();
    assert_eq!(env.master_port, 1);
}

#[test]
fn an_empty_token_is_an_error_not_the_default() {
    for blank in ["", " ", "\t\n"] {
        assert_eq!(
            env_error(&[("RESHARD_TOKEN", blank)]),
            ("RESHARD_TOKEN", blank.into())
        );
    }
    // a token too long for a hello is refused without being shown
    let long = "s".repeat(MAX_TOKEN_BYTES + 1);
    let (var, value) = env_error(&[("RESHARD_TOKEN", &long)]);
    assert_eq!(var, "RESHARD_TOKEN");
    assert!(!value.contains("sss"), "{value}");
    let env = parse(&job_vars(&[("RESHARD_TOKEN", " secret ")]))
        .unwrap()
        .unwrap();
    assert_eq!(env.token, " secret ");
    let env = parse(&job_vars(&[])).unwrap().unwrap();
    assert_eq!(env.token, DEFAULT_TOKEN);
}

/// A hello of the largest token, every byte escaped in JSON, fits in a hello frame.
#[test]
fn the_largest_token_fits_in_a_hello() {
    let hello = Hello {
        token: "\u{1}".repeat(MAX_TOKEN_BYTES),
        world: MAX_WORLD,
        rank: MAX_WORLD - 1,
        purpose: "control".into(),
        port: u16::MAX,
        pid: u32::MAX,
        host: "\u{1}".repeat(MAX_HOST_BYTES) + "@0123456789abcdef",
    };
    let frame = frame::encode_control(&hello).unwrap();
    assert!(
        (frame.len() - frame::HEADER_BYTES) as u64 <= screen::MAX_HELLO_BYTES,
        "{} bytes",
        frame.len()
    );
}

const WAIT: Duration = Duration::from_secs(20);

fn env(rank: Rank, world: usize, port: u16) -> GroupEnv {
    GroupEnv {
        rank,
        world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        token: "t0ken".into(),
        host: "here".into(),
    }
}

/// Strangers on `addr`: 100 that say nothing, one that sends part of a header, one that
/// announces a gigabyte, one that speaks HTTP. They keep their connections open.
fn strangers(addr: SocketAddr) -> Vec<TcpStream> {
    let deadline = Instant::now() + WAIT;
    let mut all: Vec<TcpStream> = (0..100)
        .map(|_| connect_until(addr, deadline).unwrap())
        .collect();
    let mut partial = connect_until(addr, deadline).unwrap();
    partial.write_all(b"RSHD\x01").unwrap();
    let mut oversized = connect_until(addr, deadline).unwrap();
    let mut header = b"RSHD\x01\0\0\0".to_vec();
    header.extend_from_slice(&(1u64 << 30).to_le_bytes());
    oversized.write_all(&header).unwrap();
    let mut http = connect_until(addr, deadline).unwrap();
    http.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    all.extend([partial, oversized, http]);
    all
}

/// Three ranks as threads join and link up while strangers crowd the rendezvous port and
/// every rank's data-link port; the control channel works afterwards.
#[test]
fn strangers_do_not_stall_the_rendezvous_or_the_data_links() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let master: SocketAddr = ([127, 0, 0, 1], port).into();
    let (groups, _at_rendezvous) = std::thread::scope(|s| {
        let root = s.spawn(move || Group::join(env(0, 3, port), WAIT));
        // rank 0 is listening once these connect; the members come after them
        let crowd = strangers(master);
        let members: Vec<_> = [1, 2]
            .map(|r| s.spawn(move || Group::join(env(r, 3, port), WAIT)))
            .into_iter()
            .collect();
        let mut groups = vec![root.join().unwrap().unwrap()];
        groups.extend(members.into_iter().map(|m| m.join().unwrap().unwrap()));
        (groups, crowd)
    });
    let _at_data_ports: Vec<Vec<TcpStream>> = groups
        .iter()
        .map(|g| strangers(g.addrs[g.env.rank]))
        .collect();
    std::thread::scope(|s| {
        let linking: Vec<_> = groups
            .iter()
            .map(|g| {
                s.spawn(move || {
                    let peers: BTreeSet<Rank> = (0..3).filter(|&p| p != g.env.rank).collect();
                    let links = g.connect_peers(&peers)?;
                    g.barrier()?;
                    Ok::<_, Error>(links)
                })
            })
            .collect();
        for (rank, l) in linking.into_iter().enumerate() {
            let links = l.join().unwrap().unwrap();
            let peers: Vec<Rank> = links.keys().copied().collect();
            let expected: Vec<Rank> = (0..3).filter(|&p| p != rank).collect();
            assert_eq!(peers, expected, "rank {rank}");
        }
    });
}

/// A member whose hello is refused hears why, and the job still forms around it.
#[test]
fn a_wrong_token_is_refused_and_the_job_goes_on() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::thread::scope(|s| {
        let root = s.spawn(move || Group::join(env(0, 2, port), WAIT));
        let mut intruder = env(1, 2, port);
        intruder.token = "wrong".into();
        match Group::join(intruder, WAIT) {
            Err(Error::Refused { reason, .. }) => {
                assert!(reason.contains("RESHARD_TOKEN"), "{reason}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        let member = Group::join(env(1, 2, port), WAIT).unwrap();
        let root = root.join().unwrap().unwrap();
        assert_eq!(root.addrs, member.addrs);
    });
}

/// Every rank learns the host of every rank from the names given at rendezvous, numbered
/// by first rank, and only ranks of one name count as on one host (all on loopback here).
#[test]
fn the_ranks_learn_the_host_map_at_rendezvous() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let names = ["b", "b", "a", "a", "b"];
    let groups: Vec<Group> = std::thread::scope(|s| {
        let joining: Vec<_> = names
            .iter()
            .enumerate()
            .map(|(rank, name)| {
                s.spawn(move || {
                    let env = GroupEnv {
                        host: (*name).into(),
                        ..env(rank, names.len(), port)
                    };
                    Group::join(env, WAIT).unwrap()
                })
            })
            .collect();
        joining.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let expected = reshard_core::topology::HostMap::parse("0,0,1,1,0").unwrap();
    for g in &groups {
        assert_eq!(g.hosts(), &expected, "rank {}", g.env.rank);
    }
    let near: Vec<Rank> = (0..5).filter(|&p| groups[2].same_host(p)).collect();
    assert_eq!(near, [2, 3]);
    assert!(groups[0].same_host(4) && !groups[0].same_host(3));
}

#[test]
fn reshard_host_names_the_host_and_must_be_sensible() {
    let env = parse(&job_vars(&[("RESHARD_HOST", "node-7")]))
        .unwrap()
        .unwrap();
    assert_eq!(env.host, "node-7");
    // unset: the host name, and a hash that tells machines apart
    let env = parse(&job_vars(&[])).unwrap().unwrap();
    assert!(
        env.host.starts_with(&format!("{}@", env::host_name())),
        "{}",
        env.host
    );
    assert_eq!(env.host, parse(&job_vars(&[])).unwrap().unwrap().host);
    for bad in ["", "  "] {
        assert_eq!(
            env_error(&[("RESHARD_HOST", bad)]),
            ("RESHARD_HOST", bad.into())
        );
    }
    let long = "h".repeat(MAX_HOST_BYTES + 1);
    assert_eq!(env_error(&[("RESHARD_HOST", &long)]).0, "RESHARD_HOST");
}
