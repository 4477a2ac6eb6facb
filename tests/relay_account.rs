//! Hosts on a relay run with the account authority (spec §8; `wire.md` "Account tokens"), all
//! real processes: `agentmbx relay serve` with `[authority] kind = "account"` against a JWKS
//! this test serves on 127.0.0.1, and two `agentmbx daemon`s whose `[relay] token_command` is a
//! small shell script. The script asks for a token bound to the host's cloud key (it records
//! `MBX_HOST` and `MBX_CLOUD_JKT`) and prints the one this test minted for that key — until
//! then it fails, and the daemon retries. Then mail goes both ways through the relay, every hop
//! carrying the token.

use crate::helper;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;

use serde_json::{json, Value};

use agentmbx_protocol::b64;
use agentmbx_protocol::keys::HostKey;

use crate::helper::mesh::{free_port, open_read_only, Host};
use crate::helper::{command, wait_for, Daemon, RELAY_LISTENING};

const ISSUER: &str = "https://accounts.test";

/// Serves `body` as the JWKS at `http://127.0.0.1:<port>/jwks` for the rest of the test
/// process; returns the URL.
fn serve_jwks(body: String) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let url = format!("http://{}/jwks", listener.local_addr().expect("addr"));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(5)));
            let mut req = Vec::new();
            let mut buf = [0u8; 4096];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let resp = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes());
        }
    });
    url
}

/// An EdDSA JWT over `claims`, signed by `issuer` under kid `k1`.
fn mint(issuer: &HostKey, claims: &Value) -> String {
    let head = b64::encode_url(br#"{"alg":"EdDSA","kid":"k1","typ":"JWT"}"#);
    let body = b64::encode_url(claims.to_string().as_bytes());
    let input = format!("{head}.{body}");
    let sig = b64::decode(&issuer.sign(input.as_bytes())).expect("signature");
    format!("{input}.{}", b64::encode_url(&sig))
}

fn now_s() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970");
    i64::try_from(since.as_secs()).expect("seconds fit i64")
}

/// Sets `[relay] token_command` in a host's config.toml.
fn set_token_command(host: &Host, cmd: &str) {
    let path = host.home.file("config.toml");
    let text = std::fs::read_to_string(&path).expect("config.toml");
    let mut table: toml::Table = text.parse().expect("config.toml is TOML");
    let relay = table
        .get_mut("relay")
        .and_then(toml::Value::as_table_mut)
        .expect("[relay] set by relay set");
    relay.insert("token_command".into(), toml::Value::String(cmd.into()));
    std::fs::write(&path, toml::to_string(&table).expect("TOML")).expect("write config.toml");
}

/// `(host, jkt)` pairs the token script was asked for so far.
fn requests(dir: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(dir.join("requests"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(h, j)| (h.to_owned(), j.to_owned()))
        .collect()
}

#[test]
fn hosts_with_a_token_command_enrol_on_an_account_relay_and_exchange_mail() {
    let issuer = HostKey::generate();
    let jwks_url = serve_jwks(
        json!({"keys": [{"kty": "OKP", "crv": "Ed25519", "kid": "k1", "use": "sig",
                         "x": b64::encode_url(issuer.public().as_bytes())}]})
        .to_string(),
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let store = dir.path().join("store");
    std::fs::create_dir_all(&store).expect("store dir");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    std::fs::write(
        store.join("relay.toml"),
        format!(
            "[authority]\nkind = \"account\"\nissuer = \"{ISSUER}\"\njwks_url = \"{jwks_url}\"\naudience = \"{url}\"\n"
        ),
    )
    .expect("relay.toml");
    let mut cmd = command(&[
        "relay",
        "serve",
        "--bind",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--store-dir",
        store.to_str().expect("UTF-8 path"),
    ]);
    cmd.env("MBX_LOG", "info");
    let relay = Daemon::spawn(cmd, RELAY_LISTENING).expect("relay started");
    let log = relay.stderr();
    assert!(log.contains("authority=\"account-token\""), "{log}");
    let fingerprint = log
        .split("fingerprint=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("relay fingerprint in the log")
        .to_owned();

    // The token script: records what it was asked for, prints the token minted for it.
    let tokens = dir.path().join("tokens");
    std::fs::create_dir_all(&tokens).expect("tokens dir");
    let script = dir.path().join("token.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nprintf '%s %s\\n' \"$MBX_HOST\" \"$MBX_CLOUD_JKT\" >> '{t}/requests'\n\
             [ \"$MBX_RELAY_URL\" = '{url}' ] || {{ echo \"unexpected relay $MBX_RELAY_URL\" >&2; exit 2; }}\n\
             cat \"{t}/$MBX_HOST.$MBX_CLOUD_JKT\"\n",
            t = tokens.display()
        ),
    )
    .expect("token script");
    let token_command = format!("sh '{}'", script.display());

    let mut a = Host::init("hosta");
    let mut b = Host::init("hostb");
    a.register("alice");
    b.register("bob");
    a.home
        .run(&["peers", "add", "hostb", &b.pubkey])
        .assert_success();
    b.home
        .run(&["peers", "add", "hosta", &a.pubkey])
        .assert_success();
    for host in [&a, &b] {
        host.home
            .run(&["relay", "set", &url, "--key", &fingerprint])
            .assert_success();
        set_token_command(host, &token_command);
    }
    a.start(None);
    b.start(None);

    // Mint a token for each (host, cloud key) the script is asked for.
    for host in ["hosta", "hostb"] {
        let jkt = wait_for(&format!("{host} to ask for a token"), || {
            requests(&tokens)
                .into_iter()
                .find(|(h, _)| h == host)
                .map(|(_, j)| j)
        });
        let now = now_s();
        let token = mint(
            &issuer,
            &json!({"iss": ISSUER, "aud": url, "sub": format!("host-{host}"), "account": "acct-1",
                    "org": "org-1", "cnf": {"jkt": jkt}, "client_id": format!("client-{host}"),
                    "iat": now, "exp": now + 900, "jti": format!("jti-{host}")}),
        );
        let tmp = tokens.join(format!(".{host}.tmp"));
        std::fs::write(&tmp, format!("{token}\n")).expect("token file");
        std::fs::rename(&tmp, tokens.join(format!("{host}.{jkt}"))).expect("token in place");
    }
    for host in [&mut a, &mut b] {
        host.daemon().wait_for_stderr("published the enc-key ad");
    }

    // The relay recorded the account and the cloud-key binding of each host.
    let db = open_read_only(&store.join("relay.db"));
    for host in [&a, &b] {
        let (account, by): (Option<String>, String) = db
            .query_row(
                "SELECT account, authorized_by FROM enrolments WHERE host_pubkey = ?1",
                [&host.pubkey],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .expect("enrolment");
        assert_eq!(
            (account.as_deref(), by.as_str()),
            (Some("acct-1"), "account-token")
        );
        let bound: String = db
            .query_row(
                "SELECT client_id FROM account_bindings WHERE host_pubkey = ?1",
                [&host.pubkey],
                |r| r.get(0),
            )
            .expect("binding");
        assert_eq!(bound, format!("client-{}", host.name));
        #[cfg(unix)]
        assert_eq!(helper::mode(&host.home.file("cloud.key")) & 0o777, 0o600);
    }

    // Mail both ways through the relay.
    let sent = a.send("alice", "bob@hostb", "over the account relay", "hello bob");
    let id = sent["id"].as_str().expect("id").to_owned();
    wait_for("bob to receive alice's mail", || {
        b.inbox_ids("bob").contains(&id).then_some(())
    });
    let reply = b.send("bob", "alice@hosta", "re", "hello alice");
    let rid = reply["id"].as_str().expect("id").to_owned();
    wait_for("alice to receive bob's reply", || {
        a.inbox_ids("alice").contains(&rid).then_some(())
    });
    // The token was fetched once per host and kept (it is valid 15 minutes).
    let asked = requests(&tokens);
    for host in ["hosta", "hostb"] {
        let n = asked.iter().filter(|(h, _)| h == host).count();
        assert!(
            (1..=8).contains(&n),
            "{host} ran the token command {n} times: {asked:?}"
        );
    }
    drop(relay);
}
