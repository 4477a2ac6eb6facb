//! `run::prepare` + `run::serve_prepared_until`: the synchronous start-up half of `relay serve`
//! (configuration, relay key from `MBX_RELAY_KEY`, store, listener) runs before any runtime
//! exists and takes the key out of the environment; the async half serves it.
//!
//! This module holds one test, which sets and reads environment variables: that is only safe
//! while no other test thread runs, so it relies on nextest's process per test (under
//! `cargo test`, run it alone).
#![allow(clippy::unwrap_used)] // Tests may unwrap (clippy.toml).

use crate::helper;

use std::net::{IpAddr, Ipv4Addr};

use agentmbx_relay::key::RELAY_KEY_ENV;
use agentmbx_relay::run::{self, ServeError, ServeOptions};

fn options(dir: &std::path::Path) -> ServeOptions {
    ServeOptions {
        bind: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        port: Some(0),
        store_dir: dir.to_path_buf(),
        trust_proxy: None,
    }
}

#[test]
fn prepare_takes_the_key_out_of_the_environment_before_any_runtime_starts() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");

    // A bad relay.toml is refused before anything is opened, naming the key; the variable is
    // read (and removed) first, so it never outlives start-up.
    std::fs::create_dir_all(&store_dir).unwrap();
    std::fs::write(store_dir.join("relay.toml"), "[limits]\nmax_pull = 0\n").unwrap();
    let (line, fingerprint) = run::keygen();
    let seed = line.strip_prefix("MBX_RELAY_KEY=").unwrap().to_owned();
    std::env::set_var(RELAY_KEY_ENV, &seed);
    let err = run::prepare(options(&store_dir)).unwrap_err();
    assert!(matches!(err, ServeError::Config(_)), "{err}");
    assert!(
        err.to_string().contains("limits.max_pull must be 1..=500"),
        "{err}"
    );
    assert!(std::env::var_os(RELAY_KEY_ENV).is_none());
    assert!(!store_dir.join("relay.db").exists(), "nothing opened");
    std::fs::remove_file(store_dir.join("relay.toml")).unwrap();

    // The key comes from the variable, which is gone once prepare returns; no relay.key.
    std::env::set_var(RELAY_KEY_ENV, &seed);
    let prepared = run::prepare(options(&store_dir)).unwrap();
    assert!(
        std::env::var_os(RELAY_KEY_ENV).is_none(),
        "MBX_RELAY_KEY is removed"
    );
    assert_eq!(prepared.relay_fingerprint(), fingerprint);
    assert!(!store_dir.join("relay.key").exists());
    let addr = prepared.local_addr().unwrap();
    assert_ne!(addr.port(), 0, "bound before the runtime starts");

    // A second relay on the same store is refused while this one holds relay.lock
    // (relay.toml sets no wait).
    std::fs::write(store_dir.join("relay.toml"), "lock_wait_ms = 0\n").unwrap();
    let err = run::prepare(options(&store_dir)).unwrap_err();
    assert!(matches!(err, ServeError::Store(_)), "{err}");

    // The runtime starts only now and serves the prepared relay.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(run::serve_prepared_until(prepared, async move {
            let _ = stopped.await;
        }));
        let (status, body, _) = tokio::task::spawn_blocking(move || {
            helper::raw_exchange(
                &addr.to_string(),
                "GET /v2/relay/info HTTP/1.1\r\nhost: relay\r\nconnection: close\r\n\r\n",
                &[],
            )
        })
        .await
        .unwrap();
        assert_eq!(status, 200, "{body}");
        let info: serde_json::Value = serde_json::from_str(&body).unwrap();
        let relay_pub =
            agentmbx_protocol::keys::PublicKey::from_b64(info["relay_pubkey"].as_str().unwrap())
                .unwrap();
        assert_eq!(relay_pub.fingerprint(), fingerprint);
        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    });
}
