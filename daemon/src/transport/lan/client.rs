//! The client side of the LAN transport (`wire.md` §2.5, §4 "Outbox client", "Receipts
//! client", "Other client calls"): signed calls to a paired host's LAN server at `addr`
//! (`host:port`, IPv6 as `[ip]:port`).
//!
//! Every request carries the LAN hop (`x-mbx-host`, `x-mbx-ts`, `x-mbx-sig`, `x-mbx-port` = this
//! host's LAN port) signed at send time, and from the daemon also `x-mbx-instance` (its
//! instance id, unsigned and advisory: [`crate::instance`]). Redirects are refused (keys and mail are concerned),
//! connecting may take 3 s and a whole call 15 s. Envelopes and receipts are sent as their
//! persisted wire bytes, byte for byte, never re-serialized (Decision 4).
//!
//! Answers are read in chunks under a cap per route ([`MAX_RESULTS_ANSWER`] for envelope and
//! receipt results, [`MAX_AGENTS_ANSWER`] for the directory, [`MAX_SMALL_ANSWER`] for enc-key and
//! unpair, [`MAX_ANSWER`] otherwise): whatever answers at a stale address cannot stream more than
//! that into memory; past it the call fails with [`LanError::BadAnswer`].
//!
//! This module never trusts an answer for more than it proves: an enc key is taken only when
//! signed by the peer's pinned host key; a delivery answer is not authenticated (0.5.x F5), so
//! callers treat it as the peer's word.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::hop::{self, header};
use agentmbx_protocol::keys::{EncPublicKey, PublicKey};
use agentmbx_protocol::limits::is_name;
use agentmbx_protocol::records::enc_ad_v1_canonical;
use agentmbx_protocol::rotation::{
    RotateAnswer, RotateRequest, RotateResult, SignedRotation, MAX_RECORDS_PER_ANNOUNCE,
};

use crate::identity::Identity;
use crate::mailbox::peers::Peer;

/// A reqwest error of this client in our words ([`crate::net_error::describe`]), naming the
/// limit that fired when it timed out.
/// A failed send as a [`LanError`]: [`LanError::NoConnection`] when the connection was never
/// made ([`reqwest::Error::is_connect`]), else [`LanError::Unreachable`].
fn send_error(e: &reqwest::Error) -> LanError {
    if e.is_connect() {
        LanError::NoConnection(describe(e))
    } else {
        LanError::Unreachable(describe(e))
    }
}

fn describe(e: &reqwest::Error) -> String {
    let limit = if e.is_connect() {
        CONNECT_TIMEOUT
    } else {
        REQUEST_TIMEOUT
    };
    crate::net_error::describe(e, Some(limit))
}

/// Time allowed to connect to a peer (3 s).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Time allowed for one whole call (15 s, `wire.md` §4 "timeouts 3–15 s").
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// Most directory entries taken from one `GET /v1/agents` answer (`wire.md` §4).
pub const MAX_REMOTE_AGENTS: usize = 500;

/// Largest answer read from a peer by default ([`LanClient::call`]; bytes): 1 MiB.
pub const MAX_ANSWER: usize = 1024 * 1024;

/// Largest `/v2/envelopes` or `/v1/receipts` answer read (bytes): 1 MiB, far above 200 results.
pub const MAX_RESULTS_ANSWER: usize = 1024 * 1024;

/// Largest `GET /v1/agents` answer read (bytes): 512 KiB, room for [`MAX_REMOTE_AGENTS`] entries.
pub const MAX_AGENTS_ANSWER: usize = 512 * 1024;

/// Largest `GET /v1/enc-key` or `POST /v1/unpair` answer read (bytes): 64 KiB (a real one is
/// under 1 KiB).
pub const MAX_SMALL_ANSWER: usize = 64 * 1024;

/// The answer `post_envelopes` gives a row the peer's answer did not mention (0.5.x).
pub const MISSING_RESULT: &str = "rejected:missing result";

/// A LAN call that did not give a usable answer.
#[derive(Debug, thiserror::Error)]
pub enum LanError {
    /// Network failure or timeout: the effect is unknown, the caller retries.
    #[error("peer unreachable: {0}")]
    Unreachable(String),
    /// No connection to the peer's address at all (refused, no route, connect timeout): the
    /// request never reached the peer. Spec §10 "unreachable": the caller may decide on the
    /// address at once (`crate::mailbox::lan_memory`).
    #[error("peer unreachable: {0}")]
    NoConnection(String),
    /// The peer answered with an error status.
    #[error("peer answered {status}: {error}")]
    Status {
        /// HTTP status.
        status: u16,
        /// The peer's `error` text (or the raw body, cut at 200 bytes).
        error: String,
    },
    /// 404, 405 or 501 on `POST /v2/envelopes`: the peer is too old to prove senders, and
    /// this host never falls back to `/v1/envelopes`.
    #[error("peer does not support verified-sender delivery (/v2/envelopes); upgrade the receiving AgentMBX; no legacy fallback")]
    NoVerifiedSender {
        /// The HTTP status the peer gave.
        status: u16,
    },
    /// The answer was not what the route promises (unparseable, wrong length, bad signature).
    #[error("bad answer from peer: {0}")]
    BadAnswer(String),
}

impl LanError {
    /// True for failures a later attempt may cure by itself: the network, a timeout, 408, 429
    /// and 5xx answers.
    pub fn is_retryable(&self) -> bool {
        match self {
            LanError::Unreachable(_) | LanError::NoConnection(_) => true,
            LanError::Status { status, .. } => matches!(status, 408 | 429 | 500..=599),
            LanError::NoVerifiedSender { .. } | LanError::BadAnswer(_) => false,
        }
    }
}

/// One envelope's result as the peer answered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvelopeResult {
    /// Envelope id (of the wire it answers).
    pub id: String,
    /// `accepted`, `duplicate` or `rejected:<why>`.
    pub result: String,
}

/// One agent of a peer's directory (`GET /v1/agents`): the same shape this host serves.
pub type RemoteAgent = crate::mailbox::agents::AgentEntry;

/// A peer's `GET /v1/agents` answer: its host name and its agents (at most
/// [`MAX_REMOTE_AGENTS`], NAME_RE names only, entries that do not parse dropped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentsAnswer {
    /// The host name the peer reports.
    pub host: String,
    /// Its agents.
    pub agents: Vec<RemoteAgent>,
}

/// Signed LAN calls from this host.
#[derive(Debug, Clone)]
pub struct LanClient {
    http: reqwest::Client,
    /// This host (signs every hop).
    pub ident: Arc<Identity>,
    /// The one clock (hop timestamps).
    pub clock: SharedClock,
    /// This host's LAN port, sent as `x-mbx-port` (an unsigned hint for address healing).
    pub port: u16,
    /// The daemon's instance, whose id goes in `x-mbx-instance` on every hop (unsigned,
    /// advisory; [`crate::instance`]); `None` (CLI commands): no such header.
    pub instance: Option<Arc<crate::instance::Instance>>,
}

impl LanClient {
    /// A client for `ident`, stamping hops with `clock` and announcing `port`. Errors:
    /// [`LanError::Unreachable`] if the HTTP client cannot be built (TLS provider missing).
    pub fn new(ident: Arc<Identity>, clock: SharedClock, port: u16) -> Result<Self, LanError> {
        // Peers are on the LAN: never through HTTP(S)_PROXY from the environment.
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| LanError::Unreachable(describe(&e)))?;
        Ok(LanClient {
            http,
            ident,
            clock,
            port,
            instance: None,
        })
    }

    /// This client with the daemon's instance: its hops carry `x-mbx-instance`.
    pub fn with_instance(mut self, instance: Arc<crate::instance::Instance>) -> Self {
        self.instance = Some(instance);
        self
    }

    /// Sends a signed hop `method path` with `body` to `addr` and returns the status and the raw
    /// answer (at most [`MAX_ANSWER`] bytes), whatever the status. `path` is the request target
    /// (a query is not signed). Errors: [`LanError::Unreachable`]; [`LanError::BadAnswer`] for an
    /// answer over the cap.
    pub async fn call(
        &self,
        method: reqwest::Method,
        addr: &str,
        path: &str,
        body: Vec<u8>,
    ) -> Result<(u16, Bytes), LanError> {
        self.call_capped(method, addr, path, body, MAX_ANSWER).await
    }

    /// [`Self::call`] reading at most `max_answer` bytes of the answer (declared or streamed);
    /// past it [`LanError::BadAnswer`] `answer to <path> over <max_answer> bytes`, and the rest
    /// is never read.
    pub async fn call_capped(
        &self,
        method: reqwest::Method,
        addr: &str,
        path: &str,
        body: Vec<u8>,
        max_answer: usize,
    ) -> Result<(u16, Bytes), LanError> {
        let target = hop::normalize_target(path);
        let h = hop::sign_lan_hop(
            &self.ident.host_key,
            self.ident.host.as_str(),
            self.port,
            method.as_str(),
            &target,
            self.clock.now_ms(),
            &body,
        );
        let mut req = self
            .http
            .request(method, format!("http://{addr}{target}"))
            .header(header::HOST, h.host)
            .header(header::TS, h.ts)
            .header(header::SIG, h.sig)
            .header(header::PORT, h.port.to_string())
            .header("content-type", "application/json");
        if let Some(instance) = &self.instance {
            req = req.header(header::INSTANCE, instance.id());
        }
        if !body.is_empty() {
            req = req.body(body);
        }
        let resp = req.send().await.map_err(|e| send_error(&e))?;
        let status = resp.status().as_u16();
        let bytes = read_capped(resp, &target, max_answer).await?;
        Ok((status, bytes))
    }

    /// Signed `POST path` with the JSON `body` bytes as given; the 2xx answer as JSON. Errors:
    /// [`LanError::Unreachable`], [`LanError::Status`], [`LanError::BadAnswer`] (not JSON).
    /// The answer is read up to [`MAX_ANSWER`] bytes (else [`LanError::BadAnswer`]).
    pub async fn signed_post_json(
        &self,
        addr: &str,
        path: &str,
        body: Vec<u8>,
    ) -> Result<Value, LanError> {
        self.post_json_capped(addr, path, body, MAX_ANSWER).await
    }

    /// Signed `GET path`; the 2xx answer as JSON, read up to [`MAX_ANSWER`] bytes. Errors: as
    /// [`Self::signed_post_json`].
    pub async fn signed_get(&self, addr: &str, path: &str) -> Result<Value, LanError> {
        self.get_capped(addr, path, MAX_ANSWER).await
    }

    async fn post_json_capped(
        &self,
        addr: &str,
        path: &str,
        body: Vec<u8>,
        max_answer: usize,
    ) -> Result<Value, LanError> {
        let (status, bytes) = self
            .call_capped(reqwest::Method::POST, addr, path, body, max_answer)
            .await?;
        json_answer(status, &bytes)
    }

    async fn get_capped(
        &self,
        addr: &str,
        path: &str,
        max_answer: usize,
    ) -> Result<Value, LanError> {
        let (status, bytes) = self
            .call_capped(reqwest::Method::GET, addr, path, Vec::new(), max_answer)
            .await?;
        json_answer(status, &bytes)
    }

    /// `POST /v2/envelopes` with the persisted sealed `wires` (body `{"envelopes":[w1,w2,…]}`,
    /// each wire byte for byte). Returns one result per wire, in the order given, matched by
    /// envelope id (a wire the answer does not mention gets [`MISSING_RESULT`]). Errors: as
    /// [`Self::signed_post_json`]; [`LanError::NoVerifiedSender`] on 404/405/501;
    /// [`LanError::BadAnswer`] when the answer has another count of results than wires sent or
    /// is over [`MAX_RESULTS_ANSWER`] bytes.
    pub async fn post_envelopes(
        &self,
        addr: &str,
        wires: &[Vec<u8>],
    ) -> Result<Vec<EnvelopeResult>, LanError> {
        let ids = wires
            .iter()
            .map(|w| {
                serde_json::from_slice::<Value>(w)
                    .ok()
                    .and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_string))
                    .ok_or_else(|| {
                        LanError::BadAnswer("an outgoing wire has no envelope id".into())
                    })
            })
            .collect::<Result<Vec<String>, _>>()?;
        let body = batch_body("envelopes", wires);
        let (status, bytes) = self
            .call_capped(
                reqwest::Method::POST,
                addr,
                "/v2/envelopes",
                body,
                MAX_RESULTS_ANSWER,
            )
            .await?;
        if matches!(status, 404 | 405 | 501) {
            return Err(LanError::NoVerifiedSender { status });
        }
        let answer = json_answer(status, &bytes)?;
        let results = results_of(&answer)?;
        if results.len() != wires.len() {
            return Err(LanError::BadAnswer(format!(
                "{} results for {} envelopes",
                results.len(),
                wires.len()
            )));
        }
        Ok(ids
            .into_iter()
            .map(|id| {
                let result = results
                    .iter()
                    .find(|r| r.get("id").and_then(Value::as_str) == Some(id.as_str()))
                    .and_then(|r| r.get("result").and_then(Value::as_str))
                    .unwrap_or(MISSING_RESULT)
                    .to_string();
                EnvelopeResult { id, result }
            })
            .collect())
    }

    /// `POST /v1/receipts` with the signed receipt `wires` (`{rec, sig}` each, byte for byte);
    /// the results in order. Errors: as [`Self::signed_post_json`]; [`LanError::BadAnswer`] when
    /// the count differs, a result is not a string or the answer is over [`MAX_RESULTS_ANSWER`]
    /// bytes.
    pub async fn post_receipts(
        &self,
        addr: &str,
        wires: &[Vec<u8>],
    ) -> Result<Vec<String>, LanError> {
        let answer = self
            .post_json_capped(
                addr,
                "/v1/receipts",
                batch_body("receipts", wires),
                MAX_RESULTS_ANSWER,
            )
            .await?;
        let results = results_of(&answer)?;
        if results.len() != wires.len() {
            return Err(LanError::BadAnswer(format!(
                "{} results for {} receipts",
                results.len(),
                wires.len()
            )));
        }
        results
            .iter()
            .map(|r| {
                r.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| LanError::BadAnswer("a receipt result is not a string".into()))
            })
            .collect()
    }

    /// `GET /v1/enc-key` of `peer`: its enc public key (base64), taken only if the v1 ad names
    /// `peer.host` and is signed by `peer`'s pinned host key over canonical(`{v:1, host,
    /// enc_pub}`). Errors: as [`Self::signed_get`]; [`LanError::BadAnswer`] for a malformed,
    /// foreign or badly signed ad, or an answer over [`MAX_SMALL_ANSWER`] bytes.
    pub async fn get_enc_key(&self, addr: &str, peer: &Peer) -> Result<String, LanError> {
        let answer = self
            .get_capped(addr, "/v1/enc-key", MAX_SMALL_ANSWER)
            .await?;
        let field = |k: &str| answer.get(k).and_then(Value::as_str);
        let (Some(host), Some(enc_pub), Some(sig)) =
            (field("host"), field("enc_pub"), field("sig"))
        else {
            return Err(LanError::BadAnswer("malformed enc-key answer".into()));
        };
        if answer.get("v").and_then(Value::as_f64) != Some(1.0) {
            return Err(LanError::BadAnswer("malformed enc-key answer".into()));
        }
        if host != peer.host {
            return Err(LanError::BadAnswer(format!(
                "enc-key answer is for host {host}, not {}",
                peer.host
            )));
        }
        if EncPublicKey::from_b64(enc_pub).is_err() {
            return Err(LanError::BadAnswer(
                "enc-key answer has no valid key".into(),
            ));
        }
        let pinned = PublicKey::from_b64(&peer.pubkey)
            .map_err(|_| LanError::BadAnswer("the pinned host key does not parse".into()))?;
        if !pinned.verify(enc_ad_v1_canonical(host, enc_pub).as_bytes(), sig) {
            return Err(LanError::BadAnswer(
                "enc-key answer is not signed by the pinned host key".into(),
            ));
        }
        Ok(enc_pub.to_string())
    }

    /// `GET /v1/agents`: the peer's directory. Errors: as [`Self::signed_get`];
    /// [`LanError::BadAnswer`] when `host` or `agents` is missing, or the answer is over
    /// [`MAX_AGENTS_ANSWER`] bytes.
    pub async fn get_agents(&self, addr: &str) -> Result<AgentsAnswer, LanError> {
        let answer = self
            .get_capped(addr, "/v1/agents", MAX_AGENTS_ANSWER)
            .await?;
        let (Some(host), Some(list)) = (
            answer.get("host").and_then(Value::as_str),
            answer.get("agents").and_then(Value::as_array),
        ) else {
            return Err(LanError::BadAnswer("malformed agents answer".into()));
        };
        let agents = list
            .iter()
            .filter_map(|a| serde_json::from_value::<RemoteAgent>(a.clone()).ok())
            .filter(|a| is_name(&a.name))
            .take(MAX_REMOTE_AGENTS)
            .collect();
        Ok(AgentsAnswer {
            host: host.to_string(),
            agents,
        })
    }

    /// `POST /v1/rotate {records:[…]}` (`wire.md` §2.10): announces this host's key rotations,
    /// oldest first, at most [`MAX_RECORDS_PER_ANNOUNCE`]. Unsigned, as 0.5.x sends it: each
    /// record proves itself against the key the peer pinned, and a peer that already moved its
    /// pin could not verify a hop by the old key anyway. Returns one result per record, in
    /// order. Errors: [`LanError::Unreachable`], [`LanError::Status`] (404: the peer does not
    /// support rotation), [`LanError::BadAnswer`] when the answer is not `{results:[…]}` with one
    /// string per record or is over [`MAX_SMALL_ANSWER`] bytes.
    pub async fn post_rotate(
        &self,
        addr: &str,
        records: &[SignedRotation],
    ) -> Result<Vec<RotateResult>, LanError> {
        if records.len() > MAX_RECORDS_PER_ANNOUNCE {
            return Err(LanError::BadAnswer(format!(
                "at most {MAX_RECORDS_PER_ANNOUNCE} rotation records go in one announcement"
            )));
        }
        let body = RotateRequest {
            records: records
                .iter()
                .map(serde_json::to_value)
                .collect::<Result<_, _>>()
                .map_err(|e| LanError::BadAnswer(e.to_string()))?,
        };
        let body = serde_json::to_vec(&body).map_err(|e| LanError::BadAnswer(e.to_string()))?;
        let target = "/v1/rotate";
        let resp = self
            .http
            .post(format!("http://{addr}{target}"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| send_error(&e))?;
        let status = resp.status().as_u16();
        let bytes = read_capped(resp, target, MAX_SMALL_ANSWER).await?;
        let answer = json_answer(status, &bytes)?;
        let answer: RotateAnswer = serde_json::from_value(answer)
            .map_err(|_| LanError::BadAnswer("malformed rotation answer".into()))?;
        if answer.results.len() != records.len() {
            return Err(LanError::BadAnswer(format!(
                "{} results for {} rotation records",
                answer.results.len(),
                records.len()
            )));
        }
        Ok(answer.results)
    }

    /// `POST /v1/unpair` (body `{}`): tells the peer this host removed it. Errors: as
    /// [`Self::signed_post_json`], the answer capped at [`MAX_SMALL_ANSWER`] bytes.
    pub async fn unpair(&self, addr: &str) -> Result<(), LanError> {
        self.post_json_capped(addr, "/v1/unpair", b"{}".to_vec(), MAX_SMALL_ANSWER)
            .await
            .map(|_| ())
    }
}

/// Reads the body of `resp` (the answer to `target`) in chunks, at most `cap` bytes: a declared
/// length over the cap is refused before reading, a streamed body as soon as it passes it
/// (the connection is dropped with the rest unread). Errors: [`LanError::BadAnswer`] over the
/// cap; [`LanError::Unreachable`] when the body breaks off.
async fn read_capped(
    mut resp: reqwest::Response,
    target: &str,
    cap: usize,
) -> Result<Bytes, LanError> {
    let over = || LanError::BadAnswer(format!("answer to {target} over {cap} bytes"));
    let cap_u64 = u64::try_from(cap).unwrap_or(u64::MAX);
    if resp.content_length().is_some_and(|n| n > cap_u64) {
        return Err(over());
    }
    let mut body: Vec<u8> = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| LanError::Unreachable(describe(&e)))?
    {
        if body.len() + chunk.len() > cap {
            return Err(over());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(body))
}

/// `{"<key>":[w1,w2,…]}` from wire bytes, without re-serializing them.
fn batch_body(key: &str, wires: &[Vec<u8>]) -> Vec<u8> {
    let len = wires.iter().map(|w| w.len() + 1).sum::<usize>() + key.len() + 8;
    let mut body = Vec::with_capacity(len);
    body.extend_from_slice(b"{\"");
    body.extend_from_slice(key.as_bytes());
    body.extend_from_slice(b"\":[");
    for (i, w) in wires.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(w);
    }
    body.extend_from_slice(b"]}");
    body
}

/// A 2xx answer as JSON; otherwise [`LanError::Status`] with the peer's `error` text.
fn json_answer(status: u16, bytes: &[u8]) -> Result<Value, LanError> {
    if !(200..300).contains(&status) {
        let error = serde_json::from_slice::<Value>(bytes)
            .ok()
            .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
            .unwrap_or_else(|| {
                String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned()
            });
        return Err(LanError::Status { status, error });
    }
    serde_json::from_slice(bytes).map_err(|e| LanError::BadAnswer(e.to_string()))
}

/// The `results` array of an answer.
fn results_of(answer: &Value) -> Result<&Vec<Value>, LanError> {
    answer
        .get("results")
        .and_then(Value::as_array)
        .ok_or_else(|| LanError::BadAnswer("the answer has no results".into()))
}
