//! `agentmbx relay set <url> [--key <fingerprint>]` and `agentmbx relay info [--json] [--live]`:
//! the owner's side of relay trust (spec §1, §8; `wire.md` §3.5 "Key pinning").
//!
//! `relay set` shows the relay key fingerprint and pins it: trust on first use, or `--key`
//! (16 hex digits in any case, dashes/colons/spaces optional, or the base64 key) to pin only
//! that key. It is also the only way to confirm a changed relay key. It needs an initialized
//! host (exit 3 otherwise, nothing written). It writes `[relay] url, key` in `config.toml` and
//! the pin in `mailbox.db` (kv `relay-key:<url>`, which a running daemon reads each pass, so a
//! key confirmed for the relay it uses takes effect from its next pass). A running daemon
//! watches `config.toml` ([`agentmbx::config_watch`]) and applies a first relay (it starts its
//! relay loop) or another URL (it restarts the loop) when it sees the file change, without a
//! restart; a stopped daemon uses it from its next start. `relay set` cannot see whether a
//! daemon applied it, so it says so and names the checks (the daemon's log line
//! `config changed: relay …`, `agentmbx doctor relay-enrolled`); `restart_needed` in JSON is
//! kept for scripts and is always `false`. It audits
//! `relay.key_confirmed` and clears a `key-mismatch` state and the recorded key change (also
//! when the owner confirms the pinned key after the relay served another one). When the relay
//! cannot be reached, a full `--key` is pinned as given, and a fingerprint is stored as the
//! expectation (kv `relay-key-expect:<url>`): the daemon then pins only a key with that
//! fingerprint. The URL is checked first ([`config::check_relay_url`]: no user information,
//! query, fragment, dot segments, whitespace or control characters, a port in 1..=65535).
//! Exit codes: 2 for a malformed URL or `--key` (nothing read or written), 1 for a key
//! mismatch (recorded and audited `relay.key_changed` as the daemon does; config and pin
//! untouched) or an unreachable relay without `--key`.
//!
//! `relay info` reads `config.toml` and `mailbox.db` only (no daemon needed): the pin, the
//! relay state (with a key mismatch the pinned and served fingerprints and the exact fix
//! command; for `denied` and `revoked` what the owner can do), an unconfirmed key change (`key_change`: which key was served and when, kept after
//! the relay serves the pinned key again, with both confirm commands), epoch, enrolment cache, enc-key ad, allowlist, position and outbox counts. With
//! `--live` it also asks the relay (unsigned info) which key it presents now. It exits 0 only
//! when the recorded state is `ok`; any other state (also none recorded yet) prints the same
//! report and exits 1 ([`NOT_OK_HELP`]), like `systemctl is-active`, so a script can test the
//! relay with the exit status alone.
//!
//! Neither command prints private key material.

use anyhow::Context;
use clap::Args;
use serde_json::{json, Value};

use agentmbx::config::{self, Config, RelayConfig};
use agentmbx::mailbox::relay_state::{self, kv_get};
use agentmbx::mailbox::Mailbox;
use agentmbx::paths::Paths;
use agentmbx::transport::relay_client::{allowlist, pin, state, RelayError};
use agentmbx_protocol::clock::{Clock, SystemClock};
use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::time::iso_ms;

use super::{NotFoundError, UsageError};

/// The exit status of `relay info`, shown in its `--help`.
pub const NOT_OK_HELP: &str = "Exit status: 0 the relay state is ok; 1 any other state (none \
recorded yet, unreachable, key-mismatch, enrol-failed, enc-ad-failed, clock-skew, \
refused-after-enrol, denied, revoked) or a failure: the report is printed all the same and \
--json gives the state; 3 this host is not initialized or no relay is configured.";

/// The `relay set` help after the flags: when a running daemon uses the result.
pub const SET_HELP: &str = "A running daemon reads the pin of the relay it uses on each relay \
pass: confirming a key for that relay takes effect from its next pass. It also watches \
config.toml and applies what `relay set` writes there when it sees the file change, without a \
restart: a first relay starts its relay loop, another URL switches the loop to it (removing the \
[relay] table from config.toml stops it); a stopped daemon uses it from its next start. \
`relay set` cannot see the daemon apply it: the daemon logs `config changed: relay ...`, and \
`agentmbx doctor relay-enrolled` shows whether the host is enrolled with the relay. A daemon \
started with MBX_RELAY_URL keeps that URL. restart_needed in --json is always false (kept for \
scripts). Exit status: 0 pinned, 1 key mismatch or unreachable relay without --key, 2 \
malformed URL or --key, 3 this host is not initialized (run `agentmbx init`).";

/// Flags of `relay set`.
#[derive(Debug, Args)]
#[command(after_long_help = SET_HELP)]
pub struct SetArgs {
    /// Relay base URL, e.g. https://relay.example.org or http://127.0.0.1:7374
    pub url: String,
    /// Expected relay key: its fingerprint (16 hex digits, dashes optional) or the base64 key.
    /// Without it the key the relay presents now is pinned (trust on first use).
    #[arg(long, value_name = "FINGERPRINT")]
    pub key: Option<String>,
    /// Print the result as JSON: {url, relay_pubkey, fingerprint, epoch, reachable, pinned,
    /// previous?, restart_needed}
    #[arg(long)]
    pub json: bool,
}

/// Flags of `relay info`.
#[derive(Debug, Args)]
#[command(after_long_help = NOT_OK_HELP)]
pub struct InfoArgs {
    /// Print as JSON: {url, source, pin, state, key_change, fix, epoch, enrolment, backoff,
    /// enc_ad, allowlist, position, outbox, live?}
    #[arg(long)]
    pub json: bool,
    /// Also ask the relay now (unsigned GET /v2/relay/info) which key and epoch it presents
    #[arg(long)]
    pub live: bool,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn fp_of(b64: &str) -> String {
    PublicKey::from_b64(b64).map_or_else(|_| "unparseable".into(), |k| k.fingerprint())
}

/// Runs `relay set` (module docs).
pub fn set(args: SetArgs) -> anyhow::Result<()> {
    let url = config::check_relay_url(&args.url).map_err(|e| UsageError(e.to_string()))?;
    let expected = match &args.key {
        Some(k) => Some(pin::parse_pin(k).ok_or_else(|| {
            UsageError(format!(
                "--key {} is neither a relay key fingerprint (16 hex digits such as 1a2b-3c4d-5e6f-7a8b, as `agentmbx relay serve` and `relay keygen` print it) nor a base64 key",
                config::shown(k)
            ))
        })?),
        None => None,
    };
    let paths = Paths::from_env()?;
    // Nothing is created in a home without an identity (no config.toml, no mailbox.db).
    if !agentmbx::identity::is_initialized(&paths) {
        return Err(
            NotFoundError("this host is not initialized; run `agentmbx init`".into()).into(),
        );
    }
    paths.ensure_home()?;
    let now = SystemClock::from_env()?.now_ms();
    let file = Config::read_file(&paths.config_file())?;
    let previous_url = file
        .as_ref()
        .and_then(|c| c.relay.as_ref())
        .map(|r| r.url.trim_end_matches('/').to_string());
    // A running daemon applies a first relay and another URL from the watched config.toml
    // (agentmbx::config_watch): never a restart. The JSON field stays for scripts.
    let restart_needed = false;
    let file_key = file
        .and_then(|c| c.relay)
        .filter(|r| r.url.trim_end_matches('/') == url)
        .and_then(|r| r.key);
    let mailbox = Mailbox::open(&paths.mailbox_db()).context("cannot open mailbox.db")?;
    let (kv_key, expect) = mailbox.with(|c| {
        Ok((
            kv_get(c, &state::key_kv(&url))?,
            kv_get(c, &state::expect_kv(&url))?,
        ))
    })?;
    // The pin the daemon uses: the configured key, else the one pinned on first contact.
    let pinned = file_key
        .or(kv_key)
        .and_then(|k| PublicKey::from_b64(&k).ok());
    let pinned_fp = pinned.map(|k| k.fingerprint()).or(expect.clone());

    let info = match runtime()?.block_on(pin::fetch_info(&url)) {
        Ok(info) => info,
        Err(e) => {
            let pinning = Pinning {
                expected,
                pinned,
                previous_url,
            };
            return set_unreachable(&args, &url, pinning, &mailbox, &paths, now, e);
        }
    };
    let served = PublicKey::from_b64(&info.relay_pubkey)
        .context("the relay presents an invalid key; nothing was pinned")?;
    let refused = match &expected {
        Some(p) => !p.matches(&served),
        None => pinned_fp
            .as_deref()
            .is_some_and(|fp| fp != served.fingerprint()),
    };
    if let Some(fp) = pinned_fp
        .as_deref()
        .filter(|fp| refused && *fp != served.fingerprint())
    {
        // A changed key, found here rather than by the daemon: recorded and audited the same
        // way (`relay.key_changed`, the key-mismatch state), so `relay info` shows it.
        let how = if pinned.is_some() {
            "pinned"
        } else {
            "expected"
        };
        let served_fp = served.fingerprint();
        mailbox.with(|c| state::record_key_mismatch(c, &url, how, fp, &served_fp, now))?;
    }
    if let Some(p) = &expected {
        if !p.matches(&served) {
            anyhow::bail!(
                "relay key mismatch: expected {}, the relay at {url} presents {}: nothing was pinned and config.toml is unchanged; compare with the fingerprint its operator published (`agentmbx relay serve` prints it)",
                args.key.as_deref().unwrap_or_default(),
                served.fingerprint()
            );
        }
    } else if let Some(fp) = pinned_fp
        .as_deref()
        .filter(|fp| *fp != served.fingerprint())
    {
        anyhow::bail!(
            "the relay at {url} now presents key {}, not the pinned {fp}: relay use stays stopped and config.toml is unchanged; if its operator rotated the relay key, confirm it: agentmbx relay set {url} --key {}",
            served.fingerprint(),
            served.fingerprint()
        );
    }
    config::set_relay(
        &paths,
        Some(&RelayConfig {
            url: url.clone(),
            key: Some(served.to_b64()),
            token_command: None,
        }),
    )?;
    let change = mailbox.with(|c| state::key_change(c, &url))?;
    let done = mailbox.with(|c| state::confirm_key(c, &url, Some(&served), None, now))?;
    let replaced = done
        .previous
        .as_ref()
        .is_some_and(|p| *p != served.fingerprint());
    let how = if done.changed && replaced {
        "confirmed: replaces the pinned key"
    } else if done.changed && change.is_some() {
        "confirmed: keeps the pinned key; the recorded key change is cleared"
    } else if expected.is_some() {
        "matches --key"
    } else if pinned.is_some() {
        "already pinned"
    } else {
        "pinned on first use"
    };
    if args.json {
        let out = json!({"url": url, "relay_pubkey": served.to_b64(), "fingerprint": served.fingerprint(),
                         "epoch": info.epoch, "reachable": true, "pinned": how,
                         "previous": done.previous, "restart_needed": restart_needed});
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("relay: {url}");
        println!("relay key fingerprint: {} ({how})", served.fingerprint());
        if expected.is_none() && pinned.is_none() {
            println!("compare it with the fingerprint the relay operator published, or pin it explicitly: agentmbx relay set {url} --key {}", served.fingerprint());
        }
        if let (true, Some(prev)) = (done.changed && replaced, &done.previous) {
            println!("the previous key {prev} is no longer trusted");
        }
        if let Some(c) = change.filter(|c| c.served != served.fingerprint()) {
            println!("the key {} the relay served is not trusted", c.served);
        }
        println!("{}", daemon_note(previous_url.as_deref(), &url));
    }
    Ok(())
}

/// When a running daemon uses what `relay set` wrote (module docs): the pin of the relay it
/// uses from its next pass; a first or another relay URL when it sees `config.toml` change.
/// `relay set` cannot observe the daemon, so the note says how to check.
fn daemon_note(previous_url: Option<&str>, url: &str) -> String {
    const CHECK: &str =
        "a stopped one uses it from its next start; check with: agentmbx doctor relay-enrolled";
    match previous_url {
        Some(p) if p == url => {
            "a running daemon uses it from its next relay pass (a stopped one from its next start)"
                .to_string()
        }
        Some(p) => format!(
            "a running daemon switches from {p} to the new relay when it re-reads config.toml, which it watches (it logs `config changed: relay.url …`); {CHECK}"
        ),
        None => format!(
            "a running daemon starts using the new relay when it re-reads config.toml, which it watches (it logs `config changed: relay (unset) -> {url}`); {CHECK}"
        ),
    }
}

/// What `relay set` knew before contacting the relay.
struct Pinning {
    /// `--key`, parsed.
    expected: Option<pin::Pin>,
    /// The key pinned for this URL, if any.
    pinned: Option<PublicKey>,
    /// The relay URL `config.toml` named before, if any.
    previous_url: Option<String>,
}

/// `relay set` when the relay cannot be reached (module docs).
fn set_unreachable(
    args: &SetArgs,
    url: &str,
    pinning: Pinning,
    mailbox: &Mailbox,
    paths: &Paths,
    now: i64,
    e: RelayError,
) -> anyhow::Result<()> {
    let Pinning {
        expected,
        pinned,
        previous_url,
    } = pinning;
    let restart_needed = false;
    let why = match &e {
        RelayError::Unreachable(why) => format!("cannot be reached ({why})"),
        other => format!("did not answer as a relay ({other})"),
    };
    let (key, fp) = match expected {
        None => anyhow::bail!(
            "the relay at {url} {why}: nothing was changed; to pin its key without contacting it: agentmbx relay set {url} --key <fingerprint>"
        ),
        Some(pin::Pin::Key(k)) => (Some(k), k.fingerprint()),
        Some(pin::Pin::Fingerprint(fp)) => {
            // Already pinned to exactly that key: keep the full key.
            match pinned.filter(|p| p.fingerprint() == fp) {
                Some(p) => (Some(p), fp),
                None => (None, fp),
            }
        }
    };
    config::set_relay(
        paths,
        Some(&RelayConfig {
            url: url.to_string(),
            key: key.map(|k| k.to_b64()),
            token_command: None,
        }),
    )?;
    mailbox.with(|c| {
        state::confirm_key(
            c,
            url,
            key.as_ref(),
            key.is_none().then_some(fp.as_str()),
            now,
        )
    })?;
    let message = match key {
        Some(_) => format!(
            "the relay at {url} {why} now; pinned key {fp}: the daemon uses the relay only while it presents this key"
        ),
        None => format!(
            "the relay at {url} {why} now; key not pinned yet: the daemon will pin only a key with fingerprint {fp} on first contact, and refuses any other"
        ),
    };
    if args.json {
        let out = json!({"url": url, "relay_pubkey": key.map(|k| k.to_b64()), "fingerprint": fp,
                         "epoch": null, "reachable": false, "pinned": if key.is_some() { "--key" } else { "expected" },
                         "restart_needed": restart_needed});
        println!("{}", serde_json::to_string_pretty(&out)?);
        eprintln!("agentmbx: {message}");
    } else {
        println!("relay: {url}");
        println!(
            "relay key fingerprint: {fp} ({})",
            if key.is_some() {
                "pinned from --key"
            } else {
                "expected"
            }
        );
        println!("{message}");
        println!("{}", daemon_note(previous_url.as_deref(), url));
    }
    Ok(())
}

/// Runs `relay info` (module docs).
pub fn info(args: InfoArgs) -> anyhow::Result<()> {
    let paths = Paths::from_env()?;
    if !agentmbx::identity::is_initialized(&paths) {
        return Err(
            NotFoundError("this host is not initialized; run `agentmbx init`".into()).into(),
        );
    }
    let config = Config::load(&paths)?;
    let Some(relay) = config.relay else {
        return Err(NotFoundError(
            "no relay configured: agentmbx relay set <url> [--key <fingerprint>]".into(),
        )
        .into());
    };
    let url = relay.url.trim_end_matches('/').to_string();
    let db = paths.mailbox_db();
    let mailbox = if db.exists() {
        Some(Mailbox::open(&db).context("cannot open mailbox.db")?)
    } else {
        None
    };
    let u = url.clone();
    let gathered = match &mailbox {
        Some(m) => Some(m.with(|c| {
            Ok((
                kv_get(c, &state::key_kv(&u))?,
                kv_get(c, &state::expect_kv(&u))?,
                state::state(c, &u)?,
                kv_get(c, &state::epoch_kv(&u))?,
                state::enrolment(c, &u)?,
                state::backoff(c, &u)?,
                state::published_ad(c, &u)?,
                allowlist::published(c, &u)?,
                relay_state::position(c, &u)?,
                agentmbx::mailbox::outbox::relay_counts(c, &u)?,
                state::key_change(c, &u)?,
            ))
        })?),
        None => None,
    };
    let (kv_key, expected, st, epoch, enrolment, backoff, ad, senders, position, counts, change) =
        gathered.unwrap_or_default();
    let (pin_key, pin_from) = match (&relay.key, &kv_key) {
        (Some(k), _) => (Some(k.clone()), Some("config.toml")),
        (None, Some(k)) => (Some(k.clone()), Some("first contact")),
        (None, None) => (None, None),
    };
    let pin_fp = pin_key.as_deref().map(fp_of);
    // While the relay serves another key, confirming that key is the fix; once it serves the
    // pinned key again, confirming the pinned key (or, if the operator moved, the other one).
    let fix = st.as_ref().and_then(|s| s.fix(&url)).or_else(|| {
        change
            .as_ref()
            .map(|c| format!("agentmbx relay set {url} --key {}", c.pinned))
    });
    let live = if args.live {
        Some(match runtime()?.block_on(pin::fetch_info(&url)) {
            Ok(i) => {
                let served = fp_of(&i.relay_pubkey);
                json!({"reachable": true, "relay_fp": served, "epoch": i.epoch,
                       "matches_pin": pin_fp.as_deref().or(expected.as_deref()).map(|p| p == served)})
            }
            Err(e) => json!({"reachable": false, "error": e.to_string()}),
        })
    } else {
        None
    };
    let out = json!({
        "url": url,
        "source": if args.live { "mailbox.db and the relay (live)" } else { "mailbox.db (offline)" },
        "pin": {"fingerprint": pin_fp, "relay_pubkey": pin_key, "from": pin_from, "expected": expected},
        "state": st,
        "key_change": change.as_ref().map(|c| json!({
            "how": c.how, "pinned_fp": c.pinned, "served_fp": c.served, "at": c.at,
            "resumed": st.as_ref().is_some_and(|s| s.state != state::Standing::KeyMismatch),
            "confirm_served": format!("agentmbx relay set {url} --key {}", c.served),
            "confirm_pinned": format!("agentmbx relay set {url} --key {}", c.pinned),
        })),
        "fix": fix,
        "epoch": epoch,
        "enrolment": enrolment.as_ref().map(|e| json!({
            "relay_fp": fp_of(&e.relay_pubkey),
            "epoch": e.epoch,
            "host_fp": fp_of(&e.host_pubkey),
            "at": e.at,
            "current": pin_key.as_deref() == Some(e.relay_pubkey.as_str()) && epoch.as_deref() == Some(e.epoch.as_str()),
        })),
        "backoff": backoff.map(|b| json!({"n": b.n, "next_at": iso_ms(b.next_at)})),
        "enc_ad": ad.as_ref().map(|a| json!({
            "enc_fp": state::enc_fp(&a.enc_pub),
            "iat": iso_ms(a.iat),
            "exp": iso_ms(a.exp),
            "epoch": a.epoch,
        })),
        "allowlist": (!senders.digest.is_empty() || senders.failed_digest.is_some()).then(|| json!({
            "published": !senders.digest.is_empty(),
            "count": senders.count,
            "iat": (!senders.digest.is_empty()).then(|| iso_ms(senders.iat)),
            "retry_at": senders.retry_at.map(iso_ms),
        })),
        "position": position,
        "outbox": counts,
    });
    let mut out = out;
    if let Some(l) = live {
        out["live"] = l;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_text(&out);
    }
    // Exit 1 unless the state is ok ([`NOT_OK_HELP`]); the report is out already.
    match st.as_ref().map(|s| s.state) {
        Some(state::Standing::Ok) => Ok(()),
        Some(other) => Err(anyhow::anyhow!(
            "the relay state is {other}, not ok (exit status 1; the report above says why)"
        )),
        None => Err(anyhow::anyhow!(
            "no relay pass recorded yet, so the relay state is not ok (exit status 1)"
        )),
    }
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or("")
}

fn print_text(o: &Value) {
    let url = s(&o["url"]);
    println!("relay: {url}");
    let pin = &o["pin"];
    match (pin["fingerprint"].as_str(), pin["expected"].as_str()) {
        (Some(fp), _) => println!("pinned key: {fp} (from {})", s(&pin["from"])),
        (None, Some(fp)) => {
            println!("pinned key: none yet; only {fp} will be accepted (relay set --key)")
        }
        (None, None) => println!("pinned key: none yet (pinned on first contact)"),
    }
    let st = &o["state"];
    if st.is_null() {
        println!("state: unknown (no relay pass recorded yet)");
    } else {
        let mut line = format!("state: {} since {}", s(&st["state"]), s(&st["at"]));
        if let Some(d) = st["detail"].as_str() {
            line.push_str(&format!(": {d}"));
        }
        println!("{line}");
        if s(&st["state"]) == "key-mismatch" {
            println!(
                "  pinned {}, served {}: no push, pull or enrolment until confirmed",
                s(&st["pinned_fp"]),
                s(&st["relay_fp"])
            );
        }
        if let Some(n) = st["next_at"].as_str() {
            println!("  next attempt: {n}");
        }
    }
    let change = &o["key_change"];
    if !change.is_null() {
        println!(
            "key change: the relay served {} instead of the {} key {} (first {})",
            s(&change["served_fp"]),
            s(&change["how"]),
            s(&change["pinned_fp"]),
            s(&change["at"])
        );
        if change["resumed"] == true {
            println!("  it serves the pinned key again: relay use resumed with the pinned key; the change stays recorded until the owner confirms a key");
            println!(
                "  to trust the other key instead (only if its operator moved to it): {}",
                s(&change["confirm_served"])
            );
        }
    }
    if let Some(f) = o["fix"].as_str() {
        println!("  fix: {f}");
    }
    println!("epoch: {}", o["epoch"].as_str().unwrap_or("none seen yet"));
    let e = &o["enrolment"];
    if e.is_null() {
        let next = st["next_at"].as_str().unwrap_or("after its pause");
        let why = match s(&st["state"]) {
            "revoked" => "this host key is revoked on this relay for good".to_string(),
            "denied" => format!("the relay refuses this host; the daemon tries again at {next}"),
            "key-mismatch" => "none while the relay key is not confirmed".to_string(),
            "clock-skew" | "refused-after-enrol" => {
                format!("refused right after enrolling; the daemon tries again at {next}")
            }
            _ => "the daemon enrols on its next pass".to_string(),
        };
        println!("enrolment: none cached ({why})");
    } else {
        println!(
            "enrolment: relay key {}, epoch {}, host key {} (confirmed {}){}",
            s(&e["relay_fp"]),
            s(&e["epoch"]),
            s(&e["host_fp"]),
            s(&e["at"]),
            if e["current"] == true {
                ""
            } else {
                "; stale, re-checked on the next pass"
            }
        );
    }
    let a = &o["enc_ad"];
    if a.is_null() {
        println!("enc-key ad: none published from this host yet");
    } else {
        println!(
            "enc-key ad: key {} issued {}, expires {} (epoch {})",
            s(&a["enc_fp"]),
            s(&a["iat"]),
            s(&a["exp"]),
            s(&a["epoch"])
        );
    }
    let l = &o["allowlist"];
    if l.is_null() {
        println!("allowlist: not published yet");
    } else if l["published"] == true {
        println!("allowlist: {} sender(s), iat {}", l["count"], s(&l["iat"]));
    } else {
        println!(
            "allowlist: refused by the relay; retried at {}",
            s(&l["retry_at"])
        );
    }
    let p = &o["position"];
    if p.is_null() {
        println!("received_through: nothing pulled yet");
    } else {
        println!(
            "received_through: {} (acked {}) in epoch {}",
            p["received_through"],
            p["acked_through"],
            s(&p["epoch"])
        );
    }
    println!(
        "outbox: {} queued, {} relay-accepted (waiting for the target's receipt), {} to re-push (new epoch), {} unconfirmed, {} expired",
        o["outbox"]["queued"],
        o["outbox"]["relay_accepted"],
        o["outbox"]["repush"],
        o["outbox"]["unconfirmed"],
        o["outbox"]["expired"]
    );
    match o.get("live") {
        Some(l) if l["reachable"] == true => println!(
            "live: the relay presents {} in epoch {}{}",
            s(&l["relay_fp"]),
            s(&l["epoch"]),
            match l["matches_pin"].as_bool() {
                Some(true) => " (matches the pin)",
                Some(false) => " (NOT the pinned key)",
                None => "",
            }
        ),
        Some(l) => println!("live: {}", s(&l["error"])),
        None => println!("(read from mailbox.db without the daemon; --live also asks the relay)"),
    }
}
