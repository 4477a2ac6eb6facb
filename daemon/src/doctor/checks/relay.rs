//! Relay checks (`wire.md` §7 item 10, §3.5): reachable, key pinned and matching, enrolled for
//! the current key and epoch, enc-key ad, clock skew. They read the relay state the client keeps
//! in `mailbox.db` ([`crate::transport::relay_client::state`], the same kv keys the client
//! writes: spec gap G13) and the probe of `GET /v2/relay/info`. All skip without a relay.

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::time::iso_ms;

use super::super::{Facts, Outcome, Status};
use crate::mailbox::relay_state::kv_get;
use crate::transport::relay_client::state::{self, Enrolment, PublishedAd, RelayState, Standing};

/// An enc-key ad expiring within this warns (ms): 7 days.
pub const AD_EXPIRY_WARN_MS: i64 = 7 * 86_400_000;
/// Clock skew above this fails (ms): 5 minutes (the relay's hop window, `wire.md` §2.6).
pub const SKEW_FAIL_MS: i64 = state::HOP_WINDOW_MS;
/// Clock skew above this warns (ms): 30 seconds.
pub const SKEW_WARN_MS: i64 = 30_000;

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

fn no_relay() -> Outcome {
    Outcome::new(Status::Skip, "no relay configured")
}

/// `relay-reachable`: the relay answers its info.
pub fn reachable(f: &Facts) -> Result<Outcome, String> {
    let Some(url) = &f.relay_url else {
        return Ok(no_relay());
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
            Outcome::new(Status::Fail, format!("{url} not reachable: {why}"))
                .detail(format!(
                    "{queued} pending row(s) wait in the outbox; the relay keeps mail for 72 h once it has it"
                ))
                .fix("check the network and the relay URL, then: agentmbx relay info --live")
        }
    })
}

/// `relay-key`: a relay key is pinned and the relay serves it; on a mismatch the exact
/// `agentmbx relay set <url> --key <served fp>` fix.
pub fn key(f: &Facts) -> Result<Outcome, String> {
    let Some(url) = &f.relay_url else {
        return Ok(no_relay());
    };
    let r = recorded(f, url)?;
    let pin_fp = r.pin.as_deref().map(fp_of).or(r.expect.clone());
    let served = match &f.probes.relay {
        Some(Ok(p)) => Some(fp_of(&p.info.relay_pubkey)),
        _ => None,
    };
    if let (Some(pin), Some(served)) = (&pin_fp, &served) {
        if pin != served {
            return Ok(Outcome::new(
                Status::Fail,
                format!(
                    "the relay presents key {served}, not the pinned {pin}: relay use is stopped"
                ),
            )
            .detail("compare the served fingerprint with the one the relay's operator published")
            .fix(format!("agentmbx relay set {url} --key {served}")));
        }
    }
    if let Some(st) = r
        .state
        .as_ref()
        .filter(|s| s.state == Standing::KeyMismatch)
    {
        if served.is_none() {
            return Ok(Outcome::new(
                Status::Fail,
                format!(
                    "recorded key mismatch: pinned {}, served {}",
                    st.pinned_fp.as_deref().unwrap_or("?"),
                    st.relay_fp.as_deref().unwrap_or("?")
                ),
            )
            .fix(st.fix(url).unwrap_or_default()));
        }
    }
    Ok(match (pin_fp, served) {
        (None, Some(served)) => Outcome::new(
            Status::Warn,
            format!("no relay key pinned yet; the relay presents {served}"),
        )
        .fix(format!("agentmbx relay set {url} --key {served}")),
        (None, None) => Outcome::new(Status::Warn, "no relay key pinned yet").fix(format!(
            "agentmbx relay set {url} --key <fingerprint the operator published>"
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

/// `relay-enrolled`: the enrolment cache (kv `relay-enrolled:<url>`, the one the client writes)
/// is for the pinned relay key, the current epoch and this host key; the recorded relay state
/// reports no refusal.
pub fn enrolled(f: &Facts) -> Result<Outcome, String> {
    let Some(url) = &f.relay_url else {
        return Ok(no_relay());
    };
    let me = f
        .identity
        .as_ref()
        .map_err(|e| format!("cannot load the identity: {e}"))?;
    let r = recorded(f, url)?;
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
            out.fix = st.fix(url).or_else(|| Some("agentmbx relay info".into()));
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
        .fix("start the daemon (agentmbx daemon install): it enrols on its first relay pass"));
    };
    Ok(match &r.enrolment {
        None => Outcome::new(Status::Warn, "not enrolled yet")
            .fix("start the daemon (agentmbx daemon install): it enrols on its first relay pass"),
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
            Outcome::new(Status::Warn, format!("the enrolment is for {why}"))
                .detail("the daemon enrols again on its next relay pass")
                .fix("start or restart the daemon")
        }
    })
}

/// `enc-ad`: this host's published v2 enc-key ad names this host's keys and is not expired or
/// within [`AD_EXPIRY_WARN_MS`] of expiry.
pub fn enc_ad(f: &Facts) -> Result<Outcome, String> {
    let Some(url) = &f.relay_url else {
        return Ok(no_relay());
    };
    let me = f
        .identity
        .as_ref()
        .map_err(|e| format!("cannot load the identity: {e}"))?;
    let r = recorded(f, url)?;
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
                .fix("start the daemon: it publishes the ad on its first relay pass"),
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
        .fix("start or restart the daemon: it publishes a new ad"));
    }
    let left = ad.exp - f.opts.now_ms;
    Ok(if left <= 0 {
        Outcome::new(
            Status::Fail,
            format!("the enc-key ad expired at {}", iso_ms(ad.exp)),
        )
        .fix("start the daemon: it renews the ad on its relay pass")
    } else if left < AD_EXPIRY_WARN_MS {
        Outcome::new(
            Status::Warn,
            format!("the enc-key ad expires soon, at {}", iso_ms(ad.exp)),
        )
        .fix("keep the daemon running: it renews the ad before expiry")
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
    if f.relay_url.is_none() {
        return Ok(no_relay());
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
                    _ => out.fix("synchronise the system clock (NTP: timedatectl set-ntp true)"),
                }
            }
        },
    })
}
