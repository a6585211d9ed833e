//! The runtime's control plane for the Python path: a job of processes joined through rank 0
//! over its own authenticated links (`reshard_transport::group::Group`), beside whatever
//! carries the data (gloo, NCCL). Agreement, barriers, the two-phase decision and the final
//! verdict are the runtime's own calls, with its deadlines: a rank that dies or stalls makes
//! every other rank's call fail within a bounded time, naming it, whatever the data plane does
//! meanwhile. Every wait releases the GIL.

use std::net::TcpListener;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use reshard_core::agreement::Fingerprint;
use reshard_core::error::{Error, Field};
use reshard_transport::Job;
use reshard_transport::control::Decision;
use reshard_transport::group::{Group, GroupEnv, check_token};

use crate::error;

/// Rank 0's rendezvous port, bound before the others are told where it is.
#[pyclass(module = "reshard._core", name = "ControlListener", frozen)]
pub struct PyControlListener {
    listener: Mutex<Option<TcpListener>>,
    #[pyo3(get)]
    addr: String,
    #[pyo3(get)]
    port: u16,
}

#[pymethods]
impl PyControlListener {
    /// Binds `addr:port` (port 0: one the system picks).
    #[new]
    #[pyo3(signature = (addr, port = 0))]
    fn new(addr: String, port: u16) -> PyResult<PyControlListener> {
        let env = env(0, 1, &addr, port, "reshard")?;
        let listener = Group::bind(&env).map_err(error)?;
        let port = listener.local_addr().map(|a| a.port()).map_err(|e| {
            error(Error::Io {
                path: format!("{addr}:{port}"),
                source: e,
            })
        })?;
        Ok(PyControlListener {
            listener: Mutex::new(Some(listener)),
            addr,
            port,
        })
    }
}

fn env(rank: usize, world: usize, addr: &str, port: u16, token: &str) -> PyResult<GroupEnv> {
    check_token(token).map_err(error)?;
    Ok(GroupEnv {
        rank,
        world,
        master_addr: addr.to_string(),
        master_port: port,
        token: token.to_string(),
        host: reshard_transport::group::host_identity(),
    })
}

/// One process's membership in the job's control plane.
#[pyclass(module = "reshard._core", name = "Control", frozen)]
pub struct PyControl {
    group: Group,
    #[pyo3(get)]
    rank: usize,
    #[pyo3(get)]
    world: usize,
    /// Seconds of the job's timeout.
    #[pyo3(get)]
    timeout: f64,
}

#[pymethods]
impl PyControl {
    /// Joins the job's control plane: rank 0 (on `listener`, from [`PyControlListener`])
    /// waits for every other rank; the others connect to `addr:port`; all within `timeout`
    /// seconds, and each hello carries `token`.
    #[new]
    #[pyo3(signature = (rank, world, addr, port, token, timeout, listener = None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments, one per fact of the job
    fn new(
        py: Python<'_>,
        rank: usize,
        world: usize,
        addr: String,
        port: u16,
        token: String,
        timeout: f64,
        listener: Option<&PyControlListener>,
    ) -> PyResult<PyControl> {
        if world == 0 || rank >= world {
            return Err(error(Error::InvalidOption {
                field: Field::Flag("rank"),
                value: rank.to_string(),
                reason: format!("must be below the world size {world}"),
            }));
        }
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(error(Error::InvalidOption {
                field: Field::Flag("timeout"),
                value: timeout.to_string(),
                reason: "must be a positive number of seconds".into(),
            }));
        }
        let env = env(rank, world, &addr, port, &token)?;
        let bound = match listener {
            Some(l) => l.listener.lock().ok().and_then(|mut g| g.take()),
            None => None,
        };
        let wait = Duration::from_secs_f64(timeout);
        let group = py
            .detach(|| Group::join_on(env, wait, bound))
            .map_err(error)?;
        Ok(PyControl {
            group,
            rank,
            world,
            timeout,
        })
    }

    /// Checks that every rank runs the same job: `fields` are this rank's `(field, value)`
    /// pairs in a fixed order, `refusal` this rank's reason not to run (its bad argument).
    /// A difference or a refusal raises on every rank, naming the rank (and the field).
    #[pyo3(signature = (command, fields, refusal = None))]
    fn agree(
        &self,
        py: Python<'_>,
        command: &str,
        fields: Vec<(String, String)>,
        refusal: Option<String>,
    ) -> PyResult<()> {
        let fingerprint = match refusal {
            Some(why) => Fingerprint::refusal(command, why),
            None => fields
                .into_iter()
                .fold(Fingerprint::new(command), |f, (k, v)| f.with(k, v)),
        };
        py.detach(|| self.group.agree(&fingerprint)).map_err(error)
    }

    /// Waits until every rank is here; raises on every rank if one failed or was lost.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.group.barrier()).map_err(error)
    }

    /// The two-phase decision: this rank votes prepared (`why_not` None) or not (and why).
    /// Returns None for commit, or the `(rank, why)` of every rank that was not prepared
    /// (abort). A rank that voted prepared and lost rank 0 before the decision raises
    /// `InDoubtError`.
    #[pyo3(signature = (why_not = None))]
    fn decide(
        &self,
        py: Python<'_>,
        why_not: Option<String>,
    ) -> PyResult<Option<Vec<(usize, String)>>> {
        let vote = match why_not {
            None => Ok(()),
            Some(why) => Err(why),
        };
        match py.detach(|| self.group.decide(vote)).map_err(error)? {
            Decision::Commit => Ok(None),
            Decision::Abort { ranks } => Ok(Some(ranks)),
        }
    }

    /// The end of the job: every rank says how its part went (`error` None: well); raises
    /// on every rank naming the ranks that failed or were lost.
    #[pyo3(signature = (error_ = None))]
    fn finish(&self, py: Python<'_>, error_: Option<String>) -> PyResult<()> {
        let mine = match error_ {
            None => Ok(serde_json::Value::Null),
            Some(e) => Err(e),
        };
        py.detach(|| self.group.finish(mine))
            .map(drop)
            .map_err(error)
    }

    /// The first rank this process knows to be lost, as `(rank, how)`, or None: at once, no
    /// call made (rank 0 sees its members' control links close and tells the others), so
    /// that a wait on the data plane can stop for it.
    fn lost(&self) -> Option<(usize, String)> {
        self.group.lost()
    }

    fn __repr__(&self) -> String {
        format!(
            "Control(rank={}, world={}, timeout={})",
            self.rank, self.world, self.timeout
        )
    }
}
