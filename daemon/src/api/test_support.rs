//! The local API served for real on 127.0.0.1:0 over a real `mailbox.db` (the router of
//! `super::router`, called with reqwest), shared by the HTTP tests of every handler module.
//!
//! Fixtures only, never a test.

use std::sync::Arc;

use serde_json::{json, Value};

use agentmbx_protocol::clock::{ManualClock, SharedClock};

use crate::api::{AppState, SharedState};
use crate::identity::Identity;
use crate::testutil::{self, Store};
use crate::token::ApiToken;

pub(crate) struct Api {
    pub(crate) store: Store,
    /// This host (`home`): mail from `work` is sealed for its enc key.
    pub(crate) ident: Arc<Identity>,
    /// The pinned peer `work`.
    pub(crate) work: Identity,
    pub(crate) _clock: Arc<ManualClock>,
    /// The daemon's instance (health reasons).
    pub(crate) instance: Arc<crate::instance::Instance>,
    pub(crate) base: String,
    pub(crate) token: String,
    pub(crate) http: reqwest::Client,
    pub(crate) task: tokio::task::JoinHandle<()>,
    /// The router's state (tests give it a LAN client).
    pub(crate) state: SharedState,
}

impl Drop for Api {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Api {
    pub(crate) async fn start() -> Self {
        Self::start_with(crate::config::ApiRateConfig::default()).await
    }

    /// With the rate classes `rates` (`[api_rate]`).
    pub(crate) async fn start_with(rates: crate::config::ApiRateConfig) -> Self {
        crate::install_tls_provider();
        let store = testutil::store();
        let clock = testutil::clock();
        let ident: Arc<Identity> = Arc::new(testutil::identity("home"));
        let work = testutil::identity("work");
        store.add_peer(&work, true);
        // The agents the tests mail: a bare name known nowhere is refused.
        store.register("home", &["alice", "bob", "carol"]);
        let token = ApiToken::generate();
        let secret = token.expose_secret().to_string();
        let shared: SharedClock = clock.clone();
        let instance: Arc<crate::instance::Instance> = Default::default();
        let state: SharedState = Arc::new(AppState {
            host: ident.host.clone(),
            token,
            version: crate::VERSION,
            clock: shared,
            ident: ident.clone(),
            mailbox: store.mailbox.clone(),
            wake: Arc::new(tokio::sync::Notify::new()),
            ids: std::sync::Mutex::new(agentmbx_protocol::ulid::Generator::new()),
            instance: instance.clone(),
            lan: Default::default(),
            rates: super::rate::ApiRates::new(&rates),
            relay_configured: Default::default(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let served = state.clone();
        let task = tokio::spawn(async move {
            let _ = super::serve(listener, served, std::future::pending()).await;
        });
        Api {
            store,
            ident,
            work,
            _clock: clock,
            instance,
            base,
            token: secret,
            http: reqwest::Client::new(),
            task,
            state,
        }
    }

    pub(crate) async fn post(&self, path: &str, body: &Value, key: Option<&str>) -> (u16, Value) {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(k) = key {
            req = req.header("idempotency-key", k);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    pub(crate) async fn get(&self, path_and_query: &str) -> (u16, Value) {
        let resp = self
            .http
            .get(format!("{}{path_and_query}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    pub(crate) async fn send(&self, to: &[&str], subject: &str) -> String {
        let (status, body) = self
            .post(
                "/v1/messages",
                &json!({"from": "alice", "to": to, "subject": subject, "body": "b"}),
                None,
            )
            .await;
        assert_eq!(status, 201, "{body}");
        body["id"].as_str().unwrap().to_string()
    }

    pub(crate) fn count(&self, table: &str) -> i64 {
        self.store.scalar(&format!("SELECT COUNT(*) FROM {table}"))
    }

    pub(crate) async fn inbox(&self, query: &str) -> (u16, Value) {
        self.get(&format!("/v1/inbox?as=bob{query}")).await
    }
}

pub(crate) fn ids_of(page: &Value) -> Vec<String> {
    page["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

/// Stores a message `id` from `ann@work` to `bob@home` as if it had arrived from the peer, so
/// acking it queues a receipt back to `work` (bob is registered first: mail for a name with no
/// mailbox here would be held, not delivered).
pub(crate) fn receive_from_work(api: &Api, id: &str) {
    api.store.register("home", &["bob"]);
    receive_from_work_to(api, id, &["bob@home"], "from work");
}

/// Stores a message `id` from `ann@work` to `to` with `subject` as if it had arrived from the
/// peer (sealed for this host, its hop signed by `work`); asserts the store took it.
pub(crate) fn receive_from_work_to(api: &Api, id: &str, to: &[&str], subject: &str) {
    let wire = testutil::sealed_wire(
        &api.work,
        &api.ident.enc_key.public(),
        id,
        "ann@work",
        to,
        subject,
        testutil::T0,
    );
    let pk = api.work.host_key.public().to_b64();
    let ident = api.ident.clone();
    api.store
        .mailbox
        .with(|c| {
            let verdict =
                crate::node::receive::receive_sealed(c, &ident, &wire, id, &pk, testutil::T0)?;
            assert!(verdict.is_ok(), "{verdict:?}");
            Ok(())
        })
        .unwrap();
}

impl Api {
    /// Sends `body` (a `POST /v1/messages` request) and returns the answer, asserting 201.
    pub(crate) async fn send_json(&self, body: Value) -> Value {
        let (status, out) = self.post("/v1/messages", &body, None).await;
        assert_eq!(status, 201, "{out}");
        out
    }

    pub(crate) async fn read_as(&self, agent: &str, id: &str) -> Value {
        let (status, m) = self.get(&format!("/v1/messages/{id}?as={agent}")).await;
        assert_eq!(status, 200, "{m}");
        m
    }
}
