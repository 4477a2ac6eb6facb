//! Fail paths of the local checks (`checks/local.rs`) on a real home in a temp dir: host
//! identity, key file modes, the config, quarantine, unclaimed mail, the outbox and disk space.

use crate::doctor::checks::local::{disk_verdict, DISK_FAIL_BYTES, DISK_WARN_BYTES};
use crate::doctor::test_support::*;
use crate::doctor::*;
use crate::mailbox::relay_state;

// ---- local checks --------------------------------------------------------------------------

#[tokio::test]
async fn host_identity_fails_when_not_initialized_and_fix_creates_the_home_0700() {
    let h = uninitialized();
    let r = h.run(&["host-identity", "keystore"]).await;
    let c = one(&r, "host-identity");
    assert_eq!(c.status, Status::Fail);
    assert_eq!(c.fix.as_deref(), Some("agentmbx init"));
    assert_eq!(one(&r, "keystore").status, Status::Skip);
    assert_eq!(r.exit_code(), 1);
    assert!(!h.paths.home().exists(), "nothing written without --fix");
    let r = h.run_at(&["host-identity"], NOW, true).await;
    assert!(one(&r, "host-identity").details[0].starts_with("fixed: created"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(h.paths.home())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(m & 0o777, 0o700);
    }
}

#[tokio::test]
async fn host_identity_ok_names_host_and_fingerprint() {
    let h = initialized();
    let r = h.run(&["host-identity"]).await;
    let c = one(&r, "host-identity");
    assert_eq!(c.status, Status::Ok, "{c:?}");
    assert!(c.summary.contains("doc"));
    assert!(c.summary.contains(&h.public().fingerprint));
}

#[cfg(unix)]
#[tokio::test]
async fn loose_key_file_fails_and_fix_sets_0600() {
    use std::os::unix::fs::PermissionsExt;
    let h = initialized();
    let key = h.paths.host_key();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let r = h.run(&["keystore"]).await;
    let c = one(&r, "keystore");
    assert_eq!(c.status, Status::Fail);
    assert!(c.fix.as_deref().unwrap().starts_with("chmod 600 "));
    let mode = || std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(), 0o644, "nothing changed without --fix");
    let r = h.run_at(&["keystore"], NOW, true).await;
    let c = one(&r, "keystore");
    assert_eq!(c.status, Status::Ok);
    assert!(c.details[0].contains("was 0644, now 0600"), "{c:?}");
    assert_eq!(mode(), 0o600);
}

#[tokio::test]
async fn quarantine_warns_with_the_relay_quarantine_fix() {
    let h = initialized();
    let r = h.run(&["quarantine", "outbox"]).await;
    assert_eq!(
        one(&r, "quarantine").status,
        Status::Skip,
        "no mailbox.db yet"
    );
    assert_eq!(one(&r, "outbox").status, Status::Skip);
    drop(h.mailbox());
    let r = h.run(&["quarantine"]).await;
    assert_eq!(one(&r, "quarantine").status, Status::Ok);
    h.mailbox()
        .with(|c| {
            relay_state::quarantine(
                c, "http://r", "ep1", 3, "envelope", "item", "pk", "bad", b"w", NOW,
            )
        })
        .unwrap();
    let r = h.run(&["quarantine"]).await;
    let c = one(&r, "quarantine");
    assert_eq!(c.status, Status::Warn);
    assert_eq!(c.summary, "1 quarantined relay item(s)");
    assert_eq!(c.fix.as_deref(), Some("agentmbx relay quarantine"));
}

/// Issue 17 (3): mail held for names with no agent here is a warning naming how many wait
/// for which names, with what to do; none is ok.
#[tokio::test]
async fn unclaimed_mail_warns_with_the_names_and_what_to_do() {
    let h = initialized();
    let r = h.run(&["unclaimed"]).await;
    assert_eq!(
        one(&r, "unclaimed").status,
        Status::Skip,
        "no mailbox.db yet"
    );
    drop(h.mailbox());
    let r = h.run(&["unclaimed"]).await;
    assert_eq!(one(&r, "unclaimed").status, Status::Ok);
    h.mailbox()
        .with(|c| {
            c.execute_batch(
                "INSERT INTO messages VALUES ('m1','t','a@work','m1',NULL,'message','s','b','{}','work',1);
                 INSERT INTO messages VALUES ('m2','t','a@work','m2',NULL,'message','s','b','{}','work',1);",
            )?;
            crate::mailbox::unclaimed::hold(c, "m1", "nobody", 1)?;
            crate::mailbox::unclaimed::hold(c, "m2", "nobody", 1)?;
            crate::mailbox::unclaimed::hold(c, "m2", "zoe", 1)
        })
        .unwrap();
    let r = h.run(&["unclaimed"]).await;
    let c = one(&r, "unclaimed");
    assert_eq!(c.status, Status::Warn);
    assert_eq!(
        c.summary,
        "3 message(s) held for name(s) with no agent here: nobody (2), zoe (1)"
    );
    assert!(
        c.details
            .iter()
            .any(|d| d.contains("agentmbx whoami --as <name>")),
        "{c:?}"
    );
    assert_eq!(c.fix.as_deref(), Some("agentmbx inbox --unclaimed"));
}

#[tokio::test]
async fn outbox_warns_on_pending_rows_older_than_an_hour() {
    let h = initialized();
    let s = crate::testutil::store();
    let me = crate::testutil::identity("doc");
    s.add_peer(&crate::testutil::identity("work"), false);
    s.send(
        &me,
        "alice",
        &["bob@work"],
        "hi",
        "01KDVDNA3VG2MH8KWSQRCWJZ0S",
        NOW,
    )
    .unwrap();
    let facts = |now_ms| Facts {
        paths: h.paths.clone(),
        opts: Options {
            fix: false,
            timeout: DEFAULT_TIMEOUT,
            now_ms,
        },
        config: Ok(Config::load(&h.paths).unwrap()),
        mailbox: Some(Mailbox::open(&s.path).unwrap()),
        relay_url: None,
        identity: Err("unused".into()),
        signer: None,
        probes: Default::default(),
        secrets: Vec::new(),
    };
    let at = checks::local::STUCK_AFTER_MS;
    let fresh = checks::evaluate("outbox", &facts(NOW + at)).unwrap();
    assert_eq!(
        fresh.status,
        Some(Status::Ok),
        "exactly 1 h old is not stuck"
    );
    assert_eq!(fresh.summary, "1 pending");
    let stuck = checks::evaluate("outbox", &facts(NOW + at + 1)).unwrap();
    assert_eq!(stuck.status, Some(Status::Warn));
    assert!(stuck.details[0].starts_with("1 pending row(s) older than 1 h"));
    assert!(stuck.fix.is_some());
    // The peer's route, and why: no LAN address and no relay configured.
    assert_eq!(
        stuck.details.last().map(String::as_str),
        Some("work: no route (no LAN address, no relay)"),
        "{stuck:?}"
    );
    // Its LAN address marked as not answering, a relay configured: the relay, and why.
    let m = Mailbox::open(&s.path).unwrap();
    m.with(|c| {
        c.execute(
            "UPDATE peers SET addr = '127.0.0.1:9' WHERE host = 'work'",
            [],
        )?;
        let route = crate::mailbox::lan_memory::lan_route(c, "work")?;
        crate::mailbox::lan_memory::mark_down(
            c,
            "work",
            crate::mailbox::lan_memory::DownReason::Timeout,
            NOW,
            NOW + 5_000,
            &route,
        )?;
        Ok(())
    })
    .unwrap();
    let mut f = facts(NOW + 1_000);
    f.relay_url = Some("https://relay.example".into());
    let routed = checks::evaluate("outbox", &f).unwrap();
    let last = routed.details.last().cloned().unwrap_or_default();
    assert!(
        last.starts_with("work: relay (LAN unreachable since ")
            && last.ends_with("(timeout), next LAN probe in 4 s)"),
        "{routed:?}"
    );
}

#[test]
fn disk_thresholds_at_and_past_the_limits() {
    assert_eq!(disk_verdict(DISK_FAIL_BYTES - 1), Status::Fail);
    assert_eq!(disk_verdict(DISK_FAIL_BYTES), Status::Warn);
    assert_eq!(disk_verdict(DISK_WARN_BYTES - 1), Status::Warn);
    assert_eq!(disk_verdict(DISK_WARN_BYTES), Status::Ok);
}

#[tokio::test]
async fn disk_space_measures_the_home() {
    let h = initialized();
    let r = h.run(&["disk-space"]).await;
    let c = one(&r, "disk-space");
    assert_ne!(c.status, Status::Error, "{c:?}");
    assert!(c.summary.contains("MiB free"));
}

// ---- config, fix commands, --fix limits, relay-only peers ---------------------------------

fn append_to_config(h: &Home, line: &str) {
    let mut text = std::fs::read_to_string(h.paths.config_file()).unwrap_or_default();
    text.push_str(line);
    std::fs::write(h.paths.config_file(), text).unwrap();
}

#[tokio::test]
async fn an_invalid_config_fails_the_config_check_and_the_checks_needing_it_skip() {
    let h = initialized();
    let r = h.run(&["config"]).await;
    assert_eq!(one(&r, "config").status, Status::Ok, "{r:?}");
    h.set_relay("http://127.0.0.1:1", None);
    append_to_config(&h, "bogus = 1\n");
    let r = h.run(&[]).await;
    let c = one(&r, "config");
    assert_eq!(c.status, Status::Fail, "{c:?}");
    assert_eq!(c.fix.as_deref(), Some("agentmbx config validate"));
    assert!(c.details[0].contains("bogus"), "{c:?}");
    for id in [
        "host-identity",
        "keystore",
        "daemon",
        "peers",
        "relay-reachable",
        "relay-key",
        "relay-enrolled",
        "relay-stream",
        "enc-ad",
        "clock-skew",
    ] {
        let c = one(&r, id);
        assert_eq!(
            (c.status, c.summary.as_str()),
            (Status::Skip, "config.toml is invalid"),
            "{id}"
        );
    }
    assert_eq!((r.summary.fail, r.summary.error), (1, 0), "{r:?}");
    assert_eq!(r.exit_code(), 1);
    // Named checks alone: the config failure is reported with them, and the run fails.
    let r = h.run(&["host-identity", "relay-key"]).await;
    let ids: Vec<&str> = r.checks.iter().map(|c| c.id).collect();
    assert_eq!(ids, ["config", "host-identity", "relay-key"]);
    assert_eq!(r.exit_code(), 1);
}

#[cfg(unix)]
#[tokio::test]
async fn fix_tightens_a_home_this_user_owns_but_never_a_sticky_or_foreign_one() {
    use std::os::unix::fs::PermissionsExt;
    let h = initialized();
    let home = h.paths.home().to_path_buf();
    let set = |m| std::fs::set_permissions(&home, std::fs::Permissions::from_mode(m)).unwrap();
    let mode = || std::fs::metadata(&home).unwrap().permissions().mode() & 0o7777;

    set(0o1777);
    let c = h.run(&["host-identity"]).await.checks.remove(0);
    assert_eq!(c.status, Status::Warn);
    assert!(c.details[0].contains("mode 1777"), "{c:?}");
    assert_eq!(c.fix, None, "no chmod for a shared directory");
    let c = h
        .run_at(&["host-identity"], NOW, true)
        .await
        .checks
        .remove(0);
    assert_eq!(c.status, Status::Warn, "{c:?}");
    assert!(
        c.details
            .iter()
            .any(|d| d.contains("sticky") && d.contains("1777")),
        "{c:?}"
    );
    assert_eq!(mode(), 0o1777, "--fix left the sticky directory alone");

    set(0o755);
    let c = h.run(&["host-identity"]).await.checks.remove(0);
    assert_eq!(c.fix, Some(format!("chmod 700 {}", shell_path(&home))));
    let c = h
        .run_at(&["host-identity"], NOW, true)
        .await
        .checks
        .remove(0);
    assert_eq!(c.status, Status::Ok, "{c:?}");
    assert_eq!(
        c.details[0],
        format!("fixed: {} was 0755, now 0700", home.display())
    );
    assert_eq!(mode(), 0o700);

    // Another user's directory (only root can hand one over): reported, not changed.
    #[allow(unsafe_code)]
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        use std::os::unix::ffi::OsStrExt;
        set(0o755);
        let c_path = std::ffi::CString::new(home.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; uid/gid 65534 (nobody).
        #[allow(unsafe_code)]
        let rc = unsafe { libc::chown(c_path.as_ptr(), 65534, 65534) };
        assert_eq!(rc, 0);
        let c = h
            .run_at(&["host-identity"], NOW, true)
            .await
            .checks
            .remove(0);
        assert_eq!(c.status, Status::Warn, "{c:?}");
        assert!(
            c.details.iter().any(|d| d.contains("belongs to uid 65534")),
            "{c:?}"
        );
        assert_eq!(c.fix, None);
        assert_eq!(mode(), 0o755);
    }
}
