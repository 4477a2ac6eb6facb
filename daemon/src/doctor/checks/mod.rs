//! The checks of [`super::CHECKS`], one function each, evaluated over the gathered
//! [`super::Facts`]: `local` (config, identity, key store, outbox, quarantine, unclaimed mail,
//! service, disk space), `mcp_setup` (the agent clients' agentmbx MCP entries),
//! `relay` (reachable, key, enrolment, push stream, enc-key ad, clock skew), `clone` (two daemons on this
//! host's or a peer's key) and `net` (the probes they read, plus the daemon and peer checks). A check never panics and never prints secrets: an `Err`
//! is reported as status `error`.

pub mod clone;
pub mod local;
pub mod mcp_setup;
pub mod net;
pub mod relay;

use super::{shell_quote, Facts, Outcome, Status};

/// The outcome of a check that needs the configuration while `config.toml` does not load (the
/// `config` check says why).
pub fn config_skip() -> Outcome {
    Outcome::new(Status::Skip, "config.toml is invalid")
}

/// Evaluates the check `id` over `f`. Errors: the check could not run (reported as `error`).
pub fn evaluate(id: &str, f: &Facts) -> Result<Outcome, String> {
    match id {
        "config" => local::config(f),
        "host-identity" => local::host_identity(f),
        "keystore" => local::keystore(f),
        "daemon" => daemon(f),
        "host-key-clone" => clone::host_key_clone(f),
        "peers" => peers(f),
        "peer-key-clone" => clone::peer_key_clone(f),
        "relay-reachable" => relay::reachable(f),
        "relay-key" => relay::key(f),
        "relay-enrolled" => relay::enrolled(f),
        "relay-stream" => relay::stream(f),
        "enc-ad" => relay::enc_ad(f),
        "clock-skew" => relay::clock_skew(f),
        "outbox" => local::outbox(f),
        "quarantine" => local::quarantine(f),
        "unclaimed" => local::unclaimed(f),
        "service" => local::service(f),
        "mcp-setup" => mcp_setup::mcp_setup(f),
        "disk-space" => local::disk_space(f),
        other => Err(format!("no such check: {other}")),
    }
}

/// `daemon`: the local API answers `GET /v1/health` as this host and this version
/// (`wire.md` §7 item 3). It tries `api.addr` in the home (the port the daemon last started
/// here bound), then `api_bind`/`api_port` from `config.toml` when they differ; when nothing
/// answers, the finding names each address tried, where it came from and the home, and suggests both
/// `agentmbx daemon` (foreground) and `agentmbx daemon install` (service). Nothing answering (connection refused, timed out), or an answer from
/// another program or another host's daemon, is `fail` (this host's daemon does not answer);
/// this host's daemon running another version is `warn`. A health status `degraded` (with
/// `reasons`) is still this host's daemon answering: the reasons are their own checks
/// (`host-key-clone`, `peer-key-clone`).
fn daemon(f: &Facts) -> Result<Outcome, String> {
    use net::DaemonProbe;
    if f.config_invalid().is_some() {
        return Ok(config_skip());
    }
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
        DaemonProbe::Unreachable {
            addr,
            source,
            also,
            why,
        } => {
            let home = f.paths.home();
            let from = match *source {
                "api.addr" => format!(
                    "{addr} is from {}, written by the daemon last started in this home",
                    f.paths.api_addr_file().display()
                ),
                _ => format!(
                    "{addr} is from config.toml (api_bind, api_port; no daemon has written {} yet)",
                    f.paths.api_addr_file().display()
                ),
            };
            let env = if std::env::var_os(crate::paths::HOME_ENV).is_some_and(|v| !v.is_empty()) {
                format!("MBX_HOME={} ", shell_quote(&home.to_string_lossy()))
            } else {
                String::new()
            };
            let mut out = Outcome::new(
                Status::Fail,
                format!(
                    "daemon not answering on {addr} for the home {} ({why})",
                    home.display()
                ),
            )
            .detail(from);
            for other in also {
                out = out.detail(format!("also tried {other}: not answering either"));
            }
            out
            .detail(format!("start it in the foreground: {env}agentmbx daemon"))
            .detail(format!(
                "or as a user service that starts at login: {env}agentmbx daemon install"
            ))
            .detail(
                "if a daemon runs for another home, set MBX_HOME to that home and run doctor again",
            )
            .fix(format!("{env}agentmbx daemon install"))
        }
        DaemonProbe::Answered { addr, status, body } => {
            let host = body.get("host").and_then(|v| v.as_str());
            let version = body.get("version").and_then(|v| v.as_str());
            let health = body.get("status").and_then(|v| v.as_str());
            if *status != 200 || !matches!(health, Some("ok" | "degraded")) {
                Outcome::new(
                    Status::Fail,
                    format!("{addr} answered HTTP {status}, not an AgentMBX daemon health answer"),
                )
                .detail("another program listens on this host's API port: stop it, or set another api_port in config.toml")
            } else if host != Some(me.host.as_str()) {
                Outcome::new(
                    Status::Fail,
                    format!(
                        "the daemon on {addr} serves host `{}`, not this host `{}`",
                        host.unwrap_or("?"),
                        me.host
                    ),
                )
                .detail("another home's daemon holds this host's API port: stop it, or set another api_port in config.toml")
            } else if version != Some(crate::VERSION) {
                Outcome::new(
                    Status::Warn,
                    format!(
                        "the daemon on {addr} runs version {}, this binary is {}",
                        version.unwrap_or("?"),
                        crate::VERSION
                    ),
                )
                .detail("restart the daemon so it runs this version")
            } else {
                let mut out = Outcome::new(
                    Status::Ok,
                    format!(
                        "daemon answering on {addr} as {} {}",
                        me.host,
                        crate::VERSION
                    ),
                );
                if health == Some("degraded") {
                    out.summary
                        .push_str(" (health degraded: see the checks below)");
                }
                out
            }
        }
    })
}

/// `peers`: each pinned peer with a LAN address answers a status signed by its pinned key and
/// accepts our hop-signed `GET /v1/agents` (`wire.md` §7 item 9, §2.7). A status not signed
/// by the pinned key is `fail` (a key change or an impostor); a peer that does not answer at its
/// address (down or moved), or does not accept our signature, is `warn`. A peer with no LAN
/// address is fine while the relay answers with the pinned key ("via the relay only"), else
/// `warn`.
fn peers(f: &Facts) -> Result<Outcome, String> {
    if f.config_invalid().is_some() {
        return Ok(config_skip());
    }
    let list = match &f.probes.peers {
        None => return Ok(Outcome::new(Status::Skip, "not probed")),
        Some(Err(e)) => return Err(format!("cannot list the peers: {e}")),
        Some(Ok(list)) => list,
    };
    if list.is_empty() {
        return Ok(Outcome::new(Status::Skip, "no peers paired"));
    }
    let relay = relay::relay_usable(f);
    let mut out = Outcome::new(Status::Ok, "");
    let mut bad = 0usize;
    let mut relay_only = 0usize;
    let mut wrong_key = Vec::new();
    for p in list {
        let host = &p.host;
        match (&p.addr, &p.result) {
            (Some(addr), Ok(version)) => {
                out = out.detail(format!(
                    "{host} at {addr}: status signed by the pinned key, accepts our signature (version {version})"
                ));
            }
            (None, _) if relay == Some(true) => {
                relay_only += 1;
                out = out.detail(format!(
                    "{host}: via the relay only (no LAN address known; the relay answers)"
                ));
            }
            (None, _) => {
                bad += 1;
                let why = match relay {
                    None => "and no relay is configured",
                    Some(_) => "and the relay does not answer with its pinned key",
                };
                out = out.detail(format!("{host}: no LAN address known, {why}"));
                out = out.detail(format!(
                    "  when {host} is on this LAN: agentmbx peers addr {} IP:PORT",
                    shell_quote(host)
                ));
            }
            (Some(addr), Err(why)) => {
                bad += 1;
                out = out.detail(format!("{host} at {addr}: {why}"));
                match why {
                    net::PeerProblem::WrongKey(_) => wrong_key.push(host.clone()),
                    net::PeerProblem::Unreachable(_) => {
                        out = out.detail(format!(
                            "  {host} may be down; if it moved: agentmbx peers addr {} IP:PORT",
                            shell_quote(host)
                        ));
                    }
                    net::PeerProblem::Refuses(_) => {
                        out = out.detail(format!(
                            "  {host} does not know this host's current key: pair again"
                        ));
                    }
                }
            }
        }
    }
    if bad == 0 {
        out.summary = if relay_only == 0 {
            format!("{} peer(s) reachable", list.len())
        } else {
            format!(
                "{} peer(s) reachable, {relay_only} of them via the relay only",
                list.len()
            )
        };
    } else if !wrong_key.is_empty() {
        out.status = Some(Status::Fail);
        out.summary = format!(
            "{} of {} peer(s) answered a status not signed by the pinned key; {bad} with problems in all",
            wrong_key.len(),
            list.len()
        );
        out = out.detail(
            "a key change or an impostor: check with the peer's owner, remove it, then pair again to pin its current key",
        );
        out.fix = Some(
            wrong_key
                .iter()
                .map(|h| format!("agentmbx peers remove {}", shell_quote(h)))
                .collect::<Vec<_>>()
                .join("; "),
        );
    } else {
        out.status = Some(Status::Warn);
        out.summary = format!(
            "{bad} of {} peer(s) not reachable or not accepting our signature",
            list.len()
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
