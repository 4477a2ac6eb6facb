//! The checks of [`super::CHECKS`], one function each, evaluated over the gathered
//! [`super::Facts`]: `local` (identity, key store, outbox, quarantine, service, disk space),
//! `relay` (reachable, key, enrolment, enc-key ad, clock skew) and `net` (the probes they read,
//! plus the daemon and peer checks). A check never panics and never prints secrets: an `Err`
//! is reported as status `error`.

pub mod local;
pub mod net;
pub mod relay;

use super::{Facts, Outcome, Status};

/// Evaluates the check `id` over `f`. Errors: the check could not run (reported as `error`).
pub fn evaluate(id: &str, f: &Facts) -> Result<Outcome, String> {
    match id {
        "host-identity" => local::host_identity(f),
        "keystore" => local::keystore(f),
        "daemon" => daemon(f),
        "peers" => peers(f),
        "relay-reachable" => relay::reachable(f),
        "relay-key" => relay::key(f),
        "relay-enrolled" => relay::enrolled(f),
        "enc-ad" => relay::enc_ad(f),
        "clock-skew" => relay::clock_skew(f),
        "outbox" => local::outbox(f),
        "quarantine" => local::quarantine(f),
        "service" => local::service(f),
        "disk-space" => local::disk_space(f),
        other => Err(format!("no such check: {other}")),
    }
}

/// `daemon`: the local API answers `GET /v1/health` as this host and this version
/// (`wire.md` §7 item 3): nothing answering (connection refused, timed out) is `fail`; an
/// answer from another program, another host or another version is `warn`.
fn daemon(f: &Facts) -> Result<Outcome, String> {
    use net::DaemonProbe;
    let Ok(me) = &f.identity else {
        return Ok(Outcome::new(Status::Skip, "this host is not initialized"));
    };
    let Some(probe) = &f.probes.daemon else {
        return Ok(Outcome::new(
            Status::Skip,
            "no local API address (config.toml unreadable)",
        ));
    };
    Ok(match probe {
        DaemonProbe::Unreachable { addr, why } => Outcome::new(
            Status::Fail,
            format!("daemon not answering on {addr} ({why})"),
        )
        .fix("agentmbx daemon install (or run `agentmbx daemon`)"),
        DaemonProbe::Answered { addr, status, body } => {
            let host = body.get("host").and_then(|v| v.as_str());
            let version = body.get("version").and_then(|v| v.as_str());
            if *status != 200 || body.get("status").and_then(|v| v.as_str()) != Some("ok") {
                Outcome::new(
                    Status::Warn,
                    format!("{addr} answered HTTP {status}, not an AgentMBX daemon health answer"),
                )
                .fix("check which program listens on that port (api_port in config.toml)")
            } else if host != Some(me.host.as_str()) {
                Outcome::new(
                    Status::Warn,
                    format!(
                        "the daemon on {addr} serves host `{}`, not this host `{}`",
                        host.unwrap_or("?"),
                        me.host
                    ),
                )
                .fix("stop the other daemon, or give this home another api_port")
            } else if version != Some(crate::VERSION) {
                Outcome::new(
                    Status::Warn,
                    format!(
                        "the daemon on {addr} runs version {}, this binary is {}",
                        version.unwrap_or("?"),
                        crate::VERSION
                    ),
                )
                .fix("restart the daemon so it runs this version")
            } else {
                Outcome::new(
                    Status::Ok,
                    format!(
                        "daemon answering on {addr} as {} {}",
                        me.host,
                        crate::VERSION
                    ),
                )
            }
        }
    })
}

/// `peers`: each pinned peer with a LAN address answers a status signed by its pinned key and
/// accepts our hop-signed `GET /v1/agents` (`wire.md` §7 item 9, §2.7). A status not signed
/// by the pinned key is `fail` (a key change or an impostor); an unreachable peer, or one that
/// does not accept our signature, is `warn`.
fn peers(f: &Facts) -> Result<Outcome, String> {
    let list = match &f.probes.peers {
        None => return Ok(Outcome::new(Status::Skip, "not probed")),
        Some(Err(e)) => return Err(format!("cannot list the peers: {e}")),
        Some(Ok(list)) => list,
    };
    if list.is_empty() {
        return Ok(Outcome::new(Status::Skip, "no peers paired"));
    }
    let mut out = Outcome::new(Status::Ok, "");
    let mut bad = 0usize;
    let mut wrong_key = 0usize;
    for p in list {
        match (&p.addr, &p.result) {
            (Some(addr), Ok(version)) => {
                out = out.detail(format!(
                    "{} at {addr}: status signed by the pinned key, accepts our signature (version {version})",
                    p.host
                ));
            }
            (addr, Err(why)) => {
                bad += 1;
                if matches!(why, net::PeerProblem::WrongKey(_)) {
                    wrong_key += 1;
                }
                out = out.detail(format!(
                    "{}{}: {why}",
                    p.host,
                    addr.as_deref()
                        .map(|a| format!(" at {a}"))
                        .unwrap_or_default()
                ));
            }
            (None, Ok(_)) => {}
        }
    }
    if bad == 0 {
        out.summary = format!("{} peer(s) reachable", list.len());
    } else if wrong_key > 0 {
        out.status = Some(Status::Fail);
        out.summary = format!(
            "{wrong_key} of {} peer(s) answered a status not signed by the pinned key; {bad} with problems in all",
            list.len()
        );
        out.fix = Some(
            "agentmbx peers remove <host>, then pair again to pin its current key (check with its owner first)"
                .into(),
        );
    } else {
        out.status = Some(Status::Warn);
        out.summary = format!(
            "{bad} of {} peer(s) not reachable or not accepting our signature",
            list.len()
        );
        out.fix = Some(
            "agentmbx peers addr <host> <ip:port> for a moved peer; re-pair when its key changed"
                .into(),
        );
    }
    Ok(out)
}
