//! Fail paths of the relay checks (`checks/relay.rs`) against a fake relay info on 127.0.0.1 or
//! a closed port: reachability, the pinned key, enrolment, the enc ad and clock skew.

use std::time::Duration;

use agentmbx_protocol::keys::HostKey;

use crate::doctor;
use crate::doctor::checks::relay::skew_verdict;
use crate::doctor::test_support::*;
use crate::doctor::*;
use crate::mailbox::relay_state;
use crate::transport::relay_client::state::{self, Enrolment, PublishedAd, RelayState, Standing};

fn relay_date_ms() -> i64 {
    state::parse_http_date(RELAY_DATE).unwrap()
}

// ---- relay ---------------------------------------------------------------------------------

#[tokio::test]
async fn relay_checks_skip_without_a_relay() {
    let h = initialized();
    let r = h
        .run(&[
            "relay-reachable",
            "relay-key",
            "relay-enrolled",
            "relay-stream",
            "enc-ad",
            "clock-skew",
        ])
        .await;
    assert!(r.checks.iter().all(|c| c.status == Status::Skip), "{r:?}");
}

#[tokio::test]
async fn unreachable_relay_fails_quickly() {
    let h = initialized();
    h.set_relay(&format!("http://127.0.0.1:{}", closed_port()), None);
    let started = std::time::Instant::now();
    let r = h.run(&["relay-reachable", "clock-skew"]).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    let c = one(&r, "relay-reachable");
    assert_eq!(c.status, Status::Fail);
    // The cause in our words, precisely (not "refused or unreachable").
    assert!(c.summary.contains("connection refused"), "{c:?}");
    assert!(!c.summary.contains("or unreachable"), "{c:?}");
    assert_eq!(one(&r, "clock-skew").status, Status::Skip);
    assert_eq!(r.exit_code(), 1);
}

#[tokio::test]
async fn a_down_relay_says_what_to_check_and_only_warns_while_every_peer_answers_on_the_lan() {
    let h = initialized();
    let url = format!("https://127.0.0.1:{}", closed_port());
    h.set_relay(&url, None);
    let r = h.run(&["relay-reachable"]).await;
    let c = one(&r, "relay-reachable");
    assert_eq!(
        c.status,
        Status::Fail,
        "no peers: the relay is the only route"
    );
    let all = c.details.join("\n");
    for what in [
        "is the URL right?",
        "is the relay running?",
        "proxy:",
        "TLS: the URL starts with https://",
        "firewall:",
    ] {
        assert!(all.contains(what), "{what}: {all}");
    }

    // Every paired peer answers over the LAN: a warning with the reason, not a failure.
    let key = HostKey::generate();
    let public = key.public().to_b64();
    let addr = fake_peer(key, "work", true).await;
    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "work", &public, NOW)?;
            crate::mailbox::peers::set_addr(c, "work", &addr.to_string(), "cli")?;
            Ok(())
        })
        .unwrap();
    let r = h.run(&["relay-reachable"]).await;
    let c = one(&r, "relay-reachable");
    assert_eq!(c.status, Status::Warn, "{c:?}");
    assert!(c.summary.contains("answer over the LAN"), "{c:?}");
    assert_eq!(r.exit_code(), 0);

    // One peer that does not answer: the relay is needed again, so it fails.
    h.mailbox()
        .with(|c| {
            crate::mailbox::peers::add(c, "gone", &HostKey::generate().public().to_b64(), NOW)?;
            crate::mailbox::peers::set_addr(
                c,
                "gone",
                &format!("127.0.0.1:{}", closed_port()),
                "cli",
            )?;
            Ok(())
        })
        .unwrap();
    let r = h.run(&["relay-reachable"]).await;
    assert_eq!(one(&r, "relay-reachable").status, Status::Fail);
}

#[tokio::test]
async fn relay_key_mismatch_fails_with_the_exact_fix() {
    let h = initialized();
    let served = HostKey::generate();
    let served_fp = served.public().fingerprint();
    let url = fake_relay(&served).await;
    h.set_relay(&url, None);
    let r = h.run(&["relay-reachable", "relay-key"]).await;
    assert_eq!(one(&r, "relay-reachable").status, Status::Ok);
    let c = one(&r, "relay-key");
    assert_eq!(c.status, Status::Warn, "nothing pinned yet: {c:?}");
    assert_eq!(
        c.fix,
        Some(format!("agentmbx relay set {url} --key {served_fp}"))
    );

    h.set_relay(&url, Some(served.public().to_b64()));
    let r = h.run(&["relay-key"]).await;
    assert_eq!(one(&r, "relay-key").status, Status::Ok);

    let pinned = HostKey::generate().public();
    h.set_relay(&url, Some(pinned.to_b64()));
    let r = h.run(&["relay-key"]).await;
    let c = one(&r, "relay-key");
    assert_eq!(c.status, Status::Fail);
    assert!(c.summary.contains(&pinned.fingerprint()));
    assert_eq!(
        c.fix,
        Some(format!("agentmbx relay set {url} --key {served_fp}"))
    );
}

#[tokio::test]
async fn recorded_key_mismatch_fails_while_the_relay_is_down() {
    let h = initialized();
    let url = format!("http://127.0.0.1:{}", closed_port());
    h.set_relay(&url, None);
    let m = h.mailbox();
    m.with(|c| {
        relay_state::kv_set(
            c,
            &state::key_kv(&url),
            &HostKey::generate().public().to_b64(),
        )?;
        state::record_key_mismatch(
            c,
            &url,
            "pinned",
            "aaaa-bbbb-cccc-dddd",
            "1111-2222-3333-4444",
            NOW,
        )
    })
    .unwrap();
    let r = h.run(&["relay-key"]).await;
    let c = one(&r, "relay-key");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert_eq!(
        c.fix,
        Some(format!(
            "agentmbx relay set {url} --key 1111-2222-3333-4444"
        ))
    );
}

#[tokio::test]
async fn enrolment_must_match_the_key_epoch_and_host_key_the_client_writes() {
    let h = initialized();
    let relay = HostKey::generate();
    let url = fake_relay(&relay).await;
    h.set_relay(&url, Some(relay.public().to_b64()));
    let me = h.public();
    let r = h.run(&["relay-enrolled"]).await;
    assert_eq!(one(&r, "relay-enrolled").status, Status::Warn);
    let write = |epoch: &str| {
        let e = Enrolment {
            relay_pubkey: relay.public().to_b64(),
            epoch: epoch.into(),
            host_pubkey: me.host_pubkey.clone(),
            at: "2026-01-01T00:00:00.000Z".into(),
        };
        h.mailbox()
            .with(|c| state::set_enrolment(c, &url, &e))
            .unwrap();
    };
    write("ep0");
    let c = h.run(&["relay-enrolled"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Warn);
    assert!(
        c.summary.contains("epoch ep0, the relay is in ep1"),
        "{}",
        c.summary
    );
    write("ep1");
    let c = h.run(&["relay-enrolled"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Ok, "{c:?}");

    h.mailbox()
        .with(|c| state::set_state(c, &url, RelayState::new(Standing::Revoked), NOW).map(|_| ()))
        .unwrap();
    let c = h.run(&["relay-enrolled"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Fail);
    assert_eq!(c.fix, None, "no command undoes a revocation");
    assert!(c.details.iter().any(|d| d == state::REVOKED_FIX), "{c:?}");
}

#[tokio::test]
async fn enc_ad_expired_fails_and_near_expiry_warns() {
    let h = initialized();
    let url = format!("http://127.0.0.1:{}", closed_port());
    h.set_relay(&url, None);
    let me = h.public();
    let r = h.run(&["enc-ad"]).await;
    assert_eq!(one(&r, "enc-ad").status, Status::Warn, "no ad yet");
    let exp = NOW + doctor::checks::relay::AD_EXPIRY_WARN_MS;
    let ad = PublishedAd {
        host_pubkey: me.host_pubkey.clone(),
        enc_pub: me.enc_pub.clone(),
        iat: NOW - 1000,
        exp,
        epoch: "ep1".into(),
    };
    h.mailbox()
        .with(|c| state::set_published_ad(c, &url, &ad))
        .unwrap();
    let h = &h;
    let at = |now| async move { h.run_at(&["enc-ad"], now, false).await.checks.remove(0) };
    assert_eq!(at(NOW).await.status, Status::Ok, "exactly 7 days left");
    assert_eq!(at(NOW + 1).await.status, Status::Warn);
    assert_eq!(at(exp - 1).await.status, Status::Warn);
    let c = at(exp).await;
    assert_eq!(c.status, Status::Fail);
    assert!(c.summary.contains("expired"));
}

#[test]
fn skew_thresholds_at_and_past_the_limits() {
    use doctor::checks::relay::{SKEW_FAIL_MS, SKEW_WARN_MS};
    assert_eq!(skew_verdict(SKEW_WARN_MS), Status::Ok);
    assert_eq!(skew_verdict(-SKEW_WARN_MS - 1), Status::Warn);
    assert_eq!(skew_verdict(SKEW_FAIL_MS), Status::Warn);
    assert_eq!(skew_verdict(SKEW_FAIL_MS + 1), Status::Fail);
    assert_eq!(skew_verdict(i64::MIN), Status::Fail);
}

#[tokio::test]
async fn clock_skew_against_the_relay_date() {
    let h = initialized();
    let url = fake_relay(&HostKey::generate()).await;
    h.set_relay(&url, None);
    let date = relay_date_ms();
    let h = &h;
    let at = |now| async move { h.run_at(&["clock-skew"], now, false).await.checks.remove(0) };
    assert_eq!(at(date).await.status, Status::Ok);
    let c = at(date + 31_000).await;
    assert_eq!(c.status, Status::Warn);
    assert_eq!(c.summary, "this clock is 31 s ahead of the relay's");
    let c = at(date - 301_000).await;
    assert_eq!(c.status, Status::Fail);
    assert!(c.fix.is_some());
}

#[tokio::test]
async fn an_unreachable_relay_says_nothing_of_an_empty_outbox_or_of_72_hours() {
    let h = initialized();
    h.set_relay(&format!("http://127.0.0.1:{}", closed_port()), None);
    drop(h.mailbox());
    let r = h.run(&["relay-reachable"]).await;
    let c = one(&r, "relay-reachable");
    assert_eq!(c.status, Status::Fail);
    let all = c.details.join("\n");
    assert!(!all.contains("72 h") && !all.contains("pending"), "{all}");
    assert_eq!(c.fix.as_deref(), Some("agentmbx relay info --live"));
}

#[tokio::test]
async fn a_relay_key_mismatch_stops_enrolment_and_enc_ad_with_the_relay_set_fix() {
    let h = initialized();
    let served = HostKey::generate();
    let url = fake_relay(&served).await;
    let pinned = HostKey::generate().public();
    h.set_relay(&url, Some(pinned.to_b64()));
    let me = h.public();
    // What the client wrote while the pinned key answered: an enrolment and a valid ad.
    h.mailbox()
        .with(|c| {
            state::set_enrolment(
                c,
                &url,
                &Enrolment {
                    relay_pubkey: pinned.to_b64(),
                    epoch: "ep1".into(),
                    host_pubkey: me.host_pubkey.clone(),
                    at: "2026-01-01T00:00:00.000Z".into(),
                },
            )?;
            state::set_published_ad(
                c,
                &url,
                &PublishedAd {
                    host_pubkey: me.host_pubkey.clone(),
                    enc_pub: me.enc_pub.clone(),
                    iat: NOW,
                    exp: NOW + 30 * 86_400_000,
                    epoch: "ep1".into(),
                },
            )
        })
        .unwrap();
    let r = h.run(&["relay-key", "relay-enrolled", "enc-ad"]).await;
    let want = Some(format!(
        "agentmbx relay set {url} --key {}",
        served.public().fingerprint()
    ));
    let key = one(&r, "relay-key");
    assert_eq!((key.status, &key.fix), (Status::Fail, &want));
    for id in ["relay-enrolled", "enc-ad"] {
        let c = one(&r, id);
        assert_eq!(c.status, Status::Skip, "{id}: {c:?}");
        assert!(c.summary.contains("relay use is stopped"), "{id}: {c:?}");
        assert_eq!(c.fix, want, "{id}");
    }
}
