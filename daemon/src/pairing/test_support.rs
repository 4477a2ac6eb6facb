//! Fixtures of the in-process pairing tests: each host serves the pairing router on 127.0.0.1:0
//! with its own `mailbox.db` and manual clock, and the real client code drives it. Token keys are
//! set directly where the token text does not matter, so scrypt runs only where it is under test.
//!
//! Fixtures only, never a test.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use axum::Router;
use serde_json::Value;

use agentmbx_protocol::clock::{ManualClock, SharedClock};
use agentmbx_protocol::pairing::{self};

use crate::identity::Identity;
use crate::mailbox::peers;
use crate::pairing::client::{self, Local, PairError};
use crate::pairing::store;
use crate::pairing::PairingMemory;
use crate::testutil::{self, Store};
use crate::transport::lan::handlers::pairing as server;
use crate::transport::lan::{LanState, SharedLan};

/// The token key most tests pair with (what scrypt would give for some token).
pub(crate) const KEY: [u8; 32] = [0x4b; 32];

/// A key that matches no token.
pub(crate) const WRONG: [u8; 32] = [0x57; 32];

/// A host serving the pairing routes.
pub(crate) struct Host {
    pub(crate) ident: Arc<Identity>,
    pub(crate) store: Store,
    pub(crate) clock: Arc<ManualClock>,
    /// `127.0.0.1:<port>` of its server (also its advertise address).
    pub(crate) addr: String,
}

pub(crate) async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    addr
}

pub(crate) async fn host(name: &str) -> Host {
    host_with(testutil::identity(name)).await
}

pub(crate) async fn host_with(ident: Identity) -> Host {
    let ident = Arc::new(ident);
    let store = testutil::store();
    let clock = testutil::clock();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let bound = listener.local_addr().unwrap();
    let shared: SharedClock = clock.clone();
    let lan: SharedLan = Arc::new(LanState {
        ident: ident.clone(),
        mailbox: store.mailbox.clone(),
        clock: shared,
        version: "test",
        started_at: agentmbx_protocol::time::iso_ms(testutil::T0),
        port: bound.port(),
        advertise: bound.to_string(),
        self_addrs: vec![bound.ip()],
        wake: Arc::new(tokio::sync::Notify::new()),
        pairing: PairingMemory::default(),
        instance: Default::default(),
    });
    let app = server::router().with_state(lan);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Host {
        ident,
        store,
        clock,
        addr: bound.to_string(),
    }
}

impl Host {
    pub(crate) fn local(&self) -> Local {
        Local {
            ident: self.ident.clone(),
            mailbox: self.store.mailbox.clone(),
            clock: self.clock.clone(),
            advertise: self.addr.clone(),
        }
    }

    pub(crate) fn name(&self) -> String {
        self.ident.host.to_string()
    }

    pub(crate) fn pubkey(&self) -> String {
        self.ident.host_key.public().to_b64()
    }

    pub(crate) fn now(&self) -> i64 {
        use agentmbx_protocol::clock::Clock;
        self.clock.now_ms()
    }

    /// Stores a live token with key `key`, valid `ttl_ms`.
    pub(crate) fn add_token(&self, key: [u8; 32], ttl_ms: i64) {
        let now = self.now();
        self.store
            .mailbox
            .with(|c| store::insert_token(c, &pairing::token_id(&key), &key, now, now + ttl_ms))
            .unwrap();
    }

    pub(crate) fn token_state(&self) -> (String, i64, Option<String>) {
        self.store
            .fresh_conn()
            .query_row(
                "SELECT state, failures, used_by FROM pair_tokens",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap()
    }

    pub(crate) fn peer(&self, host: &str) -> Option<peers::Peer> {
        peers::by_name(&self.store.fresh_conn(), host).unwrap()
    }

    pub(crate) fn pending(&self, host: &str) -> Option<store::Pending> {
        store::pending(&self.store.fresh_conn(), host).unwrap()
    }

    pub(crate) fn approve(&self, host: &str, code: &str) -> Result<client::Paired, PairError> {
        let now = self.now();
        let own = self.name();
        self.store
            .mailbox
            .with(|c| Ok(client::approve(c, &own, host, code, now)))
            .unwrap()
    }
}

pub(crate) fn http() -> reqwest::Client {
    crate::install_tls_provider();
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

pub(crate) async fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let res = http()
        .post(format!("http://{addr}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    (status, res.json().await.unwrap_or(Value::Null))
}

pub(crate) fn refused_text(e: PairError) -> String {
    match e {
        PairError::Refused(text) => text,
        other => panic!("expected a refusal, got {other:?}"),
    }
}
