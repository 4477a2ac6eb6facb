//! Relay checks (`wire.md` §7 item 10, §3.5): reachable, key pinned and matching, enrolled for
//! the current key and epoch, the push stream (`docs/relay-stream.md`), enc-key ad, clock skew. They read the relay state the client keeps
//! in `mailbox.db` ([`crate::transport::relay_client::state`], the same kv keys the client
//! writes: spec gap G13) and the probe of `GET /v2/relay/info`. All skip without a relay (and
//! when `config.toml` is invalid, which hides the relay); enrolment and enc-key ad skip while
//! the relay's key does not match the pin (relay use is stopped) and point at the relay key fix.

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::time::iso_ms;

use super::super::{shell_quote, Facts, Outcome, Status};
use crate::mailbox::relay_state::kv_get;
use crate::transport::relay_client::state::{self, Enrolment, PublishedAd, RelayState, Standing};

/// An enc-key ad expiring within this warns (ms): 7 days.
pub const AD_EXPIRY_WARN_MS: i64 = 7 * 86_400_000;
/// Clock skew above this fails (ms): 5 minutes (the relay's hop window, `wire.md` §2.6).
pub const SKEW_FAIL_MS: i64 = state::HOP_WINDOW_MS;
/// Clock skew above this warns (ms): 30 seconds.
pub const SKEW_WARN_MS: i64 = 30_000;

/// What the daemon does about a missing or stale enrolment.
const DAEMON_ENROLS: &str =
    "the running daemon enrols on its next relay pass (see the daemon check)";

/// The command that turns on clock synchronisation.
const NTP_FIX: &str = if cfg!(target_os = "macos") {
    "sudo systemsetup -setusingnetworktime on"
} else {
    "sudo timedatectl set-ntp true"
};

/// What `mailbox.db` records about the relay.
#[derive(Debug, Default)]
struct Recorded {
    pin: Option<String>,
    pin_from: &'static str,
    expect: Option<String>,
    state: Option<RelayState>,
    epoch: Option<String>,
    enrolment: Option<Enrolment>,
    ad: Option<PublishedAd>,
    queued: i64,
}

fn recorded(f: &Facts, url: &str) -> Result<Recorded, String> {
    let configured = f
        .config
        .as_ref()
        .ok()
        .and_then(|c| c.relay.as_ref())
        .and_then(|r| r.key.clone());
    let Some(m) = &f.mailbox else {
        return Ok(Recorded {
            pin_from: if configured.is_some() {
                "config.toml"
            } else {
                ""
            },
            pin: configured,
            ..Recorded::default()
        });
    };
    let u = url.to_string();
    m.with(|c| {
        let kv_key = kv_get(c, &state::key_kv(&u))?;
        let (pin, pin_from) = match (configured, kv_key) {
            (Some(k), _) => (Some(k), "config.toml"),
            (None, Some(k)) => (Some(k), "first contact"),
            (None, None) => (None, ""),
        };
        Ok(Recorded {
            pin,
            pin_from,
            expect: kv_get(c, &state::expect_kv(&u))?,
            state: state::state(c, &u)?,
            epoch: kv_get(c, &state::epoch_kv(&u))?,
            enrolment: state::enrolment(c, &u)?,
            ad: state::published_ad(c, &u)?,
            queued: crate::mailbox::outbox::relay_counts(c, &u)?.queued,
        })
    })
    .map_err(|e| format!("cannot read the relay state: {e}"))
}

fn fp_of(b64: &str) -> String {
    PublicKey::from_b64(b64).map_or_else(|_| "unparseable".into(), |k| k.fingerprint())
}

/// The configured relay URL, or the skip outcome: "config.toml is invalid" when it does not
/// load, else "no relay configured".
fn relay_url(f: &Facts) -> Result<&str, Outcome> {
    if f.config_invalid().is_some() {
        return Err(super::config_skip());
    }
    f.relay_url
        .as_deref()
        .ok_or_else(|| Outcome::new(Status::Skip, "no relay configured"))
}

/// `agentmbx relay set <url> --key <fingerprint>`, quoted for the shell.
pub fn relay_set_fix(url: &str, fingerprint: &str) -> String {
    format!(
        "agentmbx relay set {} --key {}",
        shell_quote(url),
        shell_quote(fingerprint)
    )
}

/// A relay key that does not match the pin: `(pinned fp, served fp)` from this probe, or as the
/// client recorded it while the relay does not answer.
fn mismatch(f: &Facts, r: &Recorded) -> Option<(String, String)> {
    let pin_fp = r.pin.as_deref().map(fp_of).or(r.expect.clone());
    if let (Some(pin), Some(Ok(p))) = (&pin_fp, &f.probes.relay) {
        let served = fp_of(&p.info.relay_pubkey);
        return (*pin != served).then(|| (pin.clone(), served));
    }
    if matches!(f.probes.relay, Some(Ok(_))) {
        return None;
    }
    let st = r
        .state
        .as_ref()
        .filter(|s| s.state == Standing::KeyMismatch)?;
    Some((
        st.pinned_fp.clone().unwrap_or_else(|| "?".into()),
        st.relay_fp.clone().unwrap_or_else(|| "?".into()),
    ))
}

/// The outcome of a check that needs the relay while its key does not match the pin.
fn stopped_by_mismatch(url: &str, pinned: &str, served: &str) -> Outcome {
    let out = Outcome::new(
        Status::Skip,
        format!("relay use is stopped: the relay presents key {served}, not the pinned {pinned}"),
    )
    .detail("see the relay-key check");
    if served == "?" {
        out
    } else {
        out.fix(relay_set_fix(url, served))
    }
}

/// Whether mail can go through the relay now: `None` without a relay, else whether it answered
/// this probe with the pinned key (or none pinned yet).
pub fn relay_usable(f: &Facts) -> Option<bool> {
    let url = f.relay_url.as_deref()?;
    if !matches!(f.probes.relay, Some(Ok(_))) {
        return Some(false);
    }
    Some(
        recorded(f, url)
            .map(|r| mismatch(f, &r).is_none())
            .unwrap_or(false),
    )
}

/// `relay-reachable`: the relay answers its info.
pub fn reachable(f: &Facts) -> Result<Outcome, String> {
    let url = match relay_url(f) {
        Ok(u) => u,
        Err(skip) => return Ok(skip),
    };
    Ok(match &f.probes.relay {
        None => Outcome::new(Status::Skip, "not probed"),
        Some(Ok(p)) => Outcome::new(
            Status::Ok,
            format!(
                "{url} answers (relay {}, epoch {})",
                p.info.version, p.info.epoch
            ),
        ),
        Some(Err(why)) => {
            let queued = recorded(f, url).map(|r| r.queued).unwrap_or(0);
            let lan_peers = all_peers_on_lan(f);
            let mut out = match lan_peers {
                Some(n) => Outcome::new(
                    Status::Warn,
                    format!(
                        "{url} not reachable: {why}; all {n} peer(s) answer over the LAN, so mail between them still flows"
                    ),
                )
                .detail(
                    "a warning, not a failure: every paired peer takes mail directly; mail for a \
                     peer off this LAN waits in the outbox until the relay answers",
                ),
                None => Outcome::new(Status::Fail, format!("{url} not reachable: {why}")),
            };
            let proxy = super::net::proxy_in_use(url, &|k| std::env::var(k).ok());
            if let Some(proxy) = &proxy {
                out = out.detail(format!("tried through the proxy {proxy}"));
            }
            if queued > 0 {
                out = out.detail(format!(
                    "{queued} pending outbox row(s) wait; they go out when a route answers"
                ));
            }
            for line in relay_down_advice(url, proxy.is_some()) {
                out = out.detail(line);
            }
            out.fix("agentmbx relay info --live")
        }
    })
}

/// The number of paired peers when there is at least one and every one answered the LAN
/// probe with its pinned key and accepted our signature; `None` otherwise (no peers, not
/// probed, or any peer not reachable over the LAN).
fn all_peers_on_lan(f: &Facts) -> Option<usize> {
    let list = f.probes.peers.as_ref()?.as_ref().ok()?;
    (!list.is_empty() && list.iter().all(|p| p.addr.is_some() && p.result.is_ok()))
        .then_some(list.len())
}

/// What to check when the relay at `url` does not answer, in words a user can act on: the
/// URL, the relay process, proxy variables (`proxied`: one is in use for this URL), TLS
/// against plain HTTP, and a firewall on the relay's port.
pub fn relay_down_advice(url: &str, proxied: bool) -> Vec<String> {
    let parsed = reqwest::Url::parse(url).ok();
    let scheme = parsed.as_ref().map_or("", |u| u.scheme()).to_string();
    let host = parsed
        .as_ref()
        .and_then(|u| u.host_str().map(str::to_string))
        .unwrap_or_else(|| "the relay host".into());
    let port = parsed
        .as_ref()
        .and_then(reqwest::Url::port_or_known_default)
        .map_or_else(|| "its port".to_string(), |p| format!("port {p}"));
    let mut out = vec![
        "what to check:".to_string(),
        format!(
            "  is the URL right? `agentmbx relay info` shows the one configured ({url}); \
             compare it with the one the relay's operator gave"
        ),
        format!(
            "  is the relay running? on {host}, the relay process (`agentmbx relay serve` or the agentmbx-relay service) must be up and listening on {port}"
        ),
    ];
    out.push(if proxied {
        "  proxy: the request went through the proxy above; if the relay is on your network, \
         add its host to NO_PROXY, or unset HTTPS_PROXY/HTTP_PROXY/ALL_PROXY"
            .to_string()
    } else {
        "  proxy: if this network needs one, set HTTPS_PROXY (or HTTP_PROXY for an http:// URL)"
            .to_string()
    });
    out.push(match scheme.as_str() {
        "https" => "  TLS: the URL starts with https://; if the relay serves plain HTTP (no TLS \
                    in front of it), use http:// instead"
            .to_string(),
        _ => "  TLS: the URL starts with http://; if the relay sits behind TLS (a reverse proxy \
              on 443), use https:// instead"
            .to_string(),
    });
    out.push(format!(
        "  firewall: {port} on {host} must be open from this host (try: curl -v {})",
        shell_quote(&format!("{}/v2/relay/info", url.trim_end_matches('/')))
    ));
    out
}

/// `relay-key`: a relay key is pinned and the relay serves it; on a mismatch the exact
/// `agentmbx relay set <url> --key <served fp>` fix.
pub fn key(f: &Facts) -> Result<Outcome, String> {
    let url = match relay_url(f) {
        Ok(u) => u,
        Err(skip) => return Ok(skip),
    };
    let r = recorded(f, url)?;
    let pin_fp = r.pin.as_deref().map(fp_of).or(r.expect.clone());
    let served = match &f.probes.relay {
        Some(Ok(p)) => Some(fp_of(&p.info.relay_pubkey)),
        _ => None,
    };
    if let Some((pin, served_fp)) = mismatch(f, &r) {
        let mut out = if served.is_some() {
            Outcome::new(
                Status::Fail,
                format!(
                    "the relay presents key {served_fp}, not the pinned {pin}: relay use is stopped"
                ),
            )
        } else {
            Outcome::new(
                Status::Fail,
                format!("recorded key mismatch: pinned {pin}, served {served_fp}"),
            )
        }
        .detail("compare the served fingerprint with the one the relay's operator published");
        if served_fp != "?" {
            out = out.fix(relay_set_fix(url, &served_fp));
        }
        return Ok(out);
    }
    Ok(match (pin_fp, served) {
        (None, Some(served)) => Outcome::new(
            Status::Warn,
            format!("no relay key pinned yet; the relay presents {served}"),
        )
        .detail("compare it with the fingerprint the relay's operator published")
        .fix(relay_set_fix(url, &served)),
        (None, None) => Outcome::new(Status::Warn, "no relay key pinned yet").detail(format!(
            "pin the fingerprint the relay's operator published: agentmbx relay set {} --key FINGERPRINT",
            shell_quote(url)
        )),
        (Some(pin), Some(_)) => Outcome::new(
            Status::Ok,
            format!(
                "pinned {pin} ({}), and the relay presents it",
                if r.pin.is_some() {
                    r.pin_from
                } else {
                    "expected"
                }
            ),
        ),
        (Some(pin), None) => Outcome::new(
            Status::Ok,
            format!("pinned {pin}; not compared (the relay did not answer)"),
        ),
    })
}

/// `relay-stream`: what the running daemon's push stream to the relay does, from the record the
/// relay loop keeps (kv `relay-stream:<url>`, [`crate::transport::relay_client::stream::StreamRecord`]): `ok` up (since when)
/// or disabled by config (`relay_stream = false`, `MBX_RELAY_STREAM=0`), `ok` polling because
/// the relay does not offer the stream, `warn` polling because the upgrade was refused, while
/// it reconnects, or when the relay replaced it (with the count: a cloned key?). `skip` without
/// a relay, or when this host's daemon does not answer (only a running daemon keeps a stream).
pub fn stream(f: &Facts) -> Result<Outcome, String> {
    use super::net::DaemonProbe;
    use crate::transport::relay_client::stream::{self, StreamState};
    let url = match relay_url(f) {
        Ok(u) => u,
        Err(skip) => return Ok(skip),
    };
    let interval = f
        .config
        .as_ref()
        .map_or(crate::config::default_relay_pull_interval_ms(), |c| {
            c.relay_pull_interval_ms
        });
    let record = match &f.mailbox {
        Some(m) => m
            .with(|c| stream::read_record(c, url))
            .map_err(|e| format!("cannot read the stream record: {e}"))?,
        None => None,
    };
    let running = matches!(
        f.probes.daemon,
        Some(DaemonProbe::Answered { status: 200, .. })
    );
    let off_here = f.config.as_ref().is_ok_and(|c| !c.relay_stream);
    let disabled = || {
        Outcome::new(
            Status::Ok,
            format!(
                "disabled by config (relay_stream = false or MBX_RELAY_STREAM=0): the daemon pulls every {interval} ms"
            ),
        )
    };
    if !running {
        if off_here {
            return Ok(disabled());
        }
        return Ok(Outcome::new(
            Status::Skip,
            "this host's daemon does not answer (see the daemon check): only a running daemon keeps a push stream",
        ));
    }
    let Some(r) = record else {
        if off_here {
            return Ok(disabled());
        }
        return Ok(Outcome::new(
            Status::Skip,
            "the daemon has not tried the push stream yet (it opens after its first relay pass)",
        ));
    };
    let since = iso_ms(r.since_ms);
    let reason = r.reason.clone().unwrap_or_default();
    let mut out = match r.state {
        StreamState::Disabled => disabled(),
        StreamState::Up => Outcome::new(
            Status::Ok,
            format!("up since {since}: mail arrives as the relay stores it; a pull runs every 5 min as a safety net"),
        ),
        StreamState::Polling if reason.contains("does not offer") => Outcome::new(
            Status::Ok,
            format!("polling every {interval} ms because {reason}; the stream is tried again every 5 min"),
        ),
        StreamState::Polling => Outcome::new(
            Status::Warn,
            format!("polling every {interval} ms because {reason}; the stream is tried again every 5 min"),
        )
        .detail("a reverse proxy in front of the relay must pass WebSocket upgrades (see docs/relay-operator.md)"),
        StreamState::Reconnecting => Outcome::new(
            Status::Warn,
            format!("reconnecting since {since} ({reason}); the daemon pulls every {interval} ms meanwhile"),
        ),
    };
    if r.replaced > 0 {
        out = Outcome {
            status: Some(Status::Warn),
            ..out
        }
        .detail(format!(
            "replaced {} time(s) by another stream opened with this host key (cloned key? see the host-key-clone check)",
            r.replaced
        ));
    }
    Ok(out)
}

/// `relay-enrolled`: the enrolment cache (kv `relay-enrolled:<url>`, the one the client writes)
/// is for the pinned relay key, the current epoch and this host key; the recorded relay state
/// reports no refusal.
pub fn enrolled(f: &Facts) -> Result<Outcome, String> {
    let url = match relay_url(f) {
        Ok(u) => u,
        Err(skip) => return Ok(skip),
    };
    let me = f
        .identity
        .as_ref()
        .map_err(|e| format!("cannot load the identity: {e}"))?;
    let r = recorded(f, url)?;
    if let Some((pin, served)) = mismatch(f, &r) {
        return Ok(stopped_by_mismatch(url, &pin, &served));
    }
    if let Some(st) = &r.state {
        let bad = match st.state {
            Standing::EnrolFailed => Some(if matches!(st.status, Some(401 | 403)) {
                Status::Fail
            } else {
                Status::Warn
            }),
            Standing::Denied | Standing::Revoked => Some(Status::Fail),
            Standing::ClockSkew | Standing::RefusedAfterEnrol => Some(Status::Warn),
            _ => None,
        };
        if let Some(status) = bad {
            let mut out = Outcome::new(status, format!("relay state {} since {}", st.state, st.at));
            if let Some(d) = &st.detail {
                out = out.detail(d.clone());
            }
            if let Some(n) = &st.next_at {
                out = out.detail(format!("next attempt {n}"));
            }
            match st.state {
                Standing::Denied => out = out.detail(state::DENIED_FIX),
                Standing::Revoked => out = out.detail(state::REVOKED_FIX),
                _ => out.fix = Some("agentmbx relay info".into()),
            }
            return Ok(out);
        }
    }
    let epoch = match &f.probes.relay {
        Some(Ok(p)) => Some(p.info.epoch.clone()),
        _ => r.epoch.clone(),
    };
    let (Some(pin), Some(epoch)) = (&r.pin, &epoch) else {
        return Ok(Outcome::new(
            Status::Warn,
            "not enrolled yet (no pinned relay key or epoch known)",
        )
        .detail(DAEMON_ENROLS));
    };
    Ok(match &r.enrolment {
        None => Outcome::new(Status::Warn, "not enrolled yet").detail(DAEMON_ENROLS),
        Some(e) if e.matches(pin, epoch, &me.host_pubkey) => Outcome::new(
            Status::Ok,
            format!(
                "enrolled for relay key {} in epoch {epoch} since {}",
                fp_of(pin),
                e.at
            ),
        ),
        Some(e) => {
            let why = if e.relay_pubkey != *pin {
                format!("another relay key ({})", fp_of(&e.relay_pubkey))
            } else if e.epoch != *epoch {
                format!("epoch {}, the relay is in {epoch}", e.epoch)
            } else {
                "another host key (before a rotation)".to_string()
            };
            Outcome::new(Status::Warn, format!("the enrolment is for {why}")).detail(
                "the running daemon enrols again on its next relay pass (see the daemon check)",
            )
        }
    })
}

/// `enc-ad`: this host's published v2 enc-key ad names this host's keys and is not expired or
/// within [`AD_EXPIRY_WARN_MS`] of expiry.
pub fn enc_ad(f: &Facts) -> Result<Outcome, String> {
    let url = match relay_url(f) {
        Ok(u) => u,
        Err(skip) => return Ok(skip),
    };
    let me = f
        .identity
        .as_ref()
        .map_err(|e| format!("cannot load the identity: {e}"))?;
    let r = recorded(f, url)?;
    if let Some((pin, served)) = mismatch(f, &r) {
        return Ok(stopped_by_mismatch(url, &pin, &served));
    }
    if let Some(st) = r
        .state
        .as_ref()
        .filter(|s| s.state == Standing::EncAdFailed)
    {
        let mut out = Outcome::new(
            Status::Warn,
            format!("enc-key ad not published since {}", st.at),
        )
        .fix("agentmbx relay info");
        if let Some(d) = &st.detail {
            out = out.detail(d.clone());
        }
        return Ok(out);
    }
    let Some(ad) = r.ad else {
        return Ok(
            Outcome::new(Status::Warn, "no enc-key ad published at the relay yet")
                .detail("peers cannot seal mail for this host through the relay until it is")
                .detail("the running daemon publishes it on its first relay pass (see the daemon check)"),
        );
    };
    if ad.host_pubkey != me.host_pubkey || ad.enc_pub != me.enc_pub {
        return Ok(Outcome::new(
            Status::Warn,
            format!(
                "the published ad names enc key {}, not this host's current keys",
                state::enc_fp(&ad.enc_pub)
            ),
        )
        .detail(
            "the running daemon publishes a new ad on its next relay pass (see the daemon check)",
        ));
    }
    let left = ad.exp - f.opts.now_ms;
    Ok(if left <= 0 {
        Outcome::new(
            Status::Fail,
            format!("the enc-key ad expired at {}", iso_ms(ad.exp)),
        )
        .detail("the running daemon renews it on its next relay pass (see the daemon check)")
    } else if left < AD_EXPIRY_WARN_MS {
        Outcome::new(
            Status::Warn,
            format!("the enc-key ad expires soon, at {}", iso_ms(ad.exp)),
        )
        .detail("the running daemon renews it before expiry (see the daemon check)")
    } else {
        Outcome::new(
            Status::Ok,
            format!(
                "ad for enc key {} valid until {}",
                state::enc_fp(&ad.enc_pub),
                iso_ms(ad.exp)
            ),
        )
    })
}

/// The verdict for a clock skew of `skew_ms` (either sign).
pub fn skew_verdict(skew_ms: i64) -> Status {
    let a = skew_ms.saturating_abs();
    if a > SKEW_FAIL_MS {
        Status::Fail
    } else if a > SKEW_WARN_MS {
        Status::Warn
    } else {
        Status::Ok
    }
}

/// `clock-skew`: our clock against the relay's `Date` header.
pub fn clock_skew(f: &Facts) -> Result<Outcome, String> {
    if let Err(skip) = relay_url(f) {
        return Ok(skip);
    }
    Ok(match &f.probes.relay {
        None => Outcome::new(Status::Skip, "not probed"),
        Some(Err(_)) => Outcome::new(Status::Skip, "the relay did not answer"),
        Some(Ok(p)) => match p.date_ms {
            None => Outcome::new(Status::Warn, "the relay sent no Date header"),
            Some(date) => {
                // `Date` has 1 s resolution: up to 1 s of the difference is rounding.
                let skew = f.opts.now_ms - date;
                let status = skew_verdict(skew);
                let out = Outcome::new(
                    status,
                    format!(
                        "this clock is {} s {} the relay's",
                        skew.abs() / 1000,
                        if skew >= 0 { "ahead of" } else { "behind" }
                    ),
                );
                match status {
                    Status::Ok => out,
                    _ => out
                        .detail("synchronise the system clock (NTP)")
                        .fix(NTP_FIX),
                }
            }
        },
    })
}

#[cfg(test)]
mod tests;
