//! Two daemons on one host key ([`crate::instance`]): `host-key-clone` (another daemon uses
//! this host's key, as its relay sees it: `fail`) and `peer-key-clone` (a paired peer's key is
//! used by two daemons, as this host's LAN server sees it: `warn`). Both read the `reasons` of
//! the running daemon's `GET /v1/health` (the `daemon` probe); without an answering daemon they
//! skip, since only a running daemon hears the relay and its peers.

use serde_json::Value;

use super::super::{Facts, Outcome, Status};
use super::config_skip;
use super::net::DaemonProbe;
use crate::instance::{HOST_KEY_CLONE, PEER_KEY_CLONE};

/// The daemon's health `reasons` with `code`, or the outcome to report when the daemon's answer
/// cannot tell (skip).
fn reasons<'a>(f: &'a Facts, code: &str) -> Result<Vec<&'a Value>, Outcome> {
    if f.config_invalid().is_some() {
        return Err(config_skip());
    }
    if f.identity.is_err() {
        return Err(Outcome::new(Status::Skip, "this host is not initialized"));
    }
    match &f.probes.daemon {
        Some(DaemonProbe::Answered { status: 200, body, .. })
            if body.get("host").and_then(Value::as_str)
                == f.identity.as_ref().ok().map(|i| i.host.as_str()) =>
        {
            Ok(body
                .get("reasons")
                .and_then(Value::as_array)
                .map(|list| {
                    list.iter()
                        .filter(|r| r.get("code").and_then(Value::as_str) == Some(code))
                        .collect()
                })
                .unwrap_or_default())
        }
        _ => Err(Outcome::new(
            Status::Skip,
            "this host's daemon does not answer (see the daemon check): only a running daemon can tell",
        )),
    }
}

/// `host-key-clone`: `fail` while the relay tells the daemon that two daemon instances
/// alternate on this host key (a copied home, a restored backup, a cloned disk), with what to
/// do; `skip` without a relay or an answering daemon.
pub fn host_key_clone(f: &Facts) -> Result<Outcome, String> {
    let found = match reasons(f, HOST_KEY_CLONE) {
        Ok(r) => r,
        Err(skip) => return Ok(skip),
    };
    let Some(reason) = found.first() else {
        return Ok(match &f.relay_url {
            None => Outcome::new(
                Status::Skip,
                "no relay configured: a relay is what sees two daemons using one host key",
            ),
            Some(url) => Outcome::new(
                Status::Ok,
                format!("{url} reports no other daemon using this host key"),
            ),
        });
    };
    let relay = reason
        .get("relay")
        .and_then(Value::as_str)
        .or(f.relay_url.as_deref())
        .unwrap_or("the relay");
    let fp = f
        .identity
        .as_ref()
        .map(|i| i.fingerprint.clone())
        .unwrap_or_default();
    Ok(Outcome::new(
        Status::Fail,
        format!(
            "another daemon is using this host key ({fp}): {relay} sees two daemon instances alternate on it, so incoming mail is split between them"
        ),
    )
    .detail("a copy of this home runs a daemon too (a restored backup, a cloned disk or VM, a copied directory); each message goes to whichever daemon pulls it first, so each daemon misses some")
    .detail("if the copy is not needed: stop the daemon that runs on it (`agentmbx daemon uninstall`, or stop its service or process there) and remove or archive that copy of the home")
    .detail("if the copy must be a host of its own: stop its daemon, move its home away, run `agentmbx init` in a fresh home there and pair it again with its peers (a new host with its own key)")
    .detail("the report clears within 10 minutes once only one daemon uses this host key (25 minutes after the relay last replaced this daemon's push stream)"))
}

/// `peer-key-clone`: `warn` naming each paired peer whose LAN hops to this host alternate
/// between two daemon instances (its owner runs a copy of its home), with what that owner
/// should do; `ok` otherwise.
pub fn peer_key_clone(f: &Facts) -> Result<Outcome, String> {
    let found = match reasons(f, PEER_KEY_CLONE) {
        Ok(r) => r,
        Err(skip) => return Ok(skip),
    };
    let mut peers: Vec<&str> = found
        .iter()
        .filter_map(|r| r.get("peer").and_then(Value::as_str))
        .collect();
    peers.sort_unstable();
    peers.dedup();
    if found.is_empty() {
        return Ok(Outcome::new(
            Status::Ok,
            "no peer seen with two daemons on one host key",
        ));
    }
    if peers.is_empty() {
        // Health named no peer: doctor could not read this host's api.token.
        return Ok(Outcome::new(
            Status::Warn,
            "a peer runs two daemons with one host key: mail to it is split between its daemons",
        )
        .detail("the daemon names the peer only to a caller with its API token: check that api.token in the home is readable, or see the daemon's log (`peer <name> has two daemons`)"));
    }
    let mut out = Outcome::new(
        Status::Warn,
        format!(
            "{} peer(s) run two daemons with one host key ({}): mail to them is split between their daemons",
            peers.len(),
            peers.join(", ")
        ),
    );
    for p in peers {
        out = out.detail(format!(
            "{p}: its LAN hops to this host alternate between two daemon instances; tell {p}'s owner to stop the daemon of the copied home, or give the copy its own identity (`agentmbx init` in a fresh home) and pair it again"
        ));
    }
    Ok(out.detail("the report clears within 10 minutes once only one daemon uses the peer's key"))
}

#[cfg(test)]
mod tests;
