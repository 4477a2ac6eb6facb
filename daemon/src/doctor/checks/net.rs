//! Doctor's network probes (`wire.md` §7 items 3, 9, 10): the local API's `GET /v1/health`,
//! each peer's signed `GET /v1/status?challenge=…` (verified against the pinned key) followed
//! by a hop-signed `GET /v1/agents` (the peer accepts our signature), and the relay's
//! `GET /v2/relay/info` with its `Date` header. They run concurrently, each bounded by
//! [`super::super::Options::timeout`]. Only the local API probe sends a token (this host's
//! `api.token`, so health answers its reasons in full). The local API and peer probes never
//! go through a proxy (`HTTP_PROXY` and friends are ignored, as for every LAN call); the relay
//! probe honours the proxy environment exactly as the relay client does.

use std::time::Duration;

use agentmbx_protocol::keys::PublicKey;
use agentmbx_protocol::status::verify_status;
use agentmbx_protocol::wire::RelayInfo;
use serde_json::Value;

use super::super::Facts;
use crate::transport::lan::client::LanClient;
use crate::transport::relay_client::state::parse_http_date;

/// Largest answer a probe reads (bytes).
const MAX_PROBE_ANSWER: usize = 64 * 1024;

/// What the probes found; `None` for a probe that did not run.
#[derive(Debug, Default)]
pub struct Probes {
    /// The local API.
    pub daemon: Option<DaemonProbe>,
    /// The peers, or why they could not be listed.
    pub peers: Option<Result<Vec<PeerProbe>, String>>,
    /// The relay (only when one is configured), or why it did not answer as a relay.
    pub relay: Option<Result<RelayProbe, String>>,
}

/// The local API's answer.
#[derive(Debug)]
pub enum DaemonProbe {
    /// Nothing answered at `addr` (connection refused or timed out).
    Unreachable {
        /// `ip:port` tried.
        addr: String,
        /// Where `addr` came from: `api.addr` (written by the daemon last started in this
        /// home) or `config.toml` (`api_bind`/`api_port`, with their `MBX_*` overrides).
        source: &'static str,
        /// The other addresses tried, none answering (`"ip:port (from config.toml)"`).
        also: Vec<String>,
        /// Why.
        why: String,
    },
    /// Something answered.
    Answered {
        /// `ip:port`.
        addr: String,
        /// HTTP status.
        status: u16,
        /// Parsed body (`Null` when not JSON).
        body: Value,
    },
}

/// One peer's probe.
#[derive(Debug)]
pub struct PeerProbe {
    /// The peer's handle.
    pub host: String,
    /// The LAN address tried, if one is known.
    pub addr: Option<String>,
    /// `Ok(version)` for a status signed by the pinned key whose host then accepted our signed
    /// request, else why not.
    pub result: Result<String, PeerProblem>,
}

/// Why a peer probe did not succeed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerProblem {
    /// No LAN address is known, or nothing answered there (refused, timed out, not a status).
    Unreachable(String),
    /// It answered a status that is not signed by the pinned key (or not for this challenge
    /// and host): a key change or an impostor.
    WrongKey(String),
    /// Its status is genuine, but it does not accept our hop-signed request.
    Refuses(String),
}

impl std::fmt::Display for PeerProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerProblem::Unreachable(w) | PeerProblem::WrongKey(w) | PeerProblem::Refuses(w) => {
                f.write_str(w)
            }
        }
    }
}

/// The relay's unsigned info and its clock.
#[derive(Debug)]
pub struct RelayProbe {
    /// The info answer.
    pub info: RelayInfo,
    /// The relay's `Date` header (ms), if it sent a parseable one.
    pub date_ms: Option<i64>,
}

/// The client for the local API and the peers: never through a proxy.
fn direct_client(timeout: Duration) -> Result<reqwest::Client, String> {
    crate::install_tls_provider();
    reqwest::Client::builder()
        .no_proxy()
        .timeout(timeout)
        .connect_timeout(timeout)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))
}

/// The client for the relay: the relay client's own (proxy environment honoured).
fn relay_http(timeout: Duration) -> Result<reqwest::Client, String> {
    crate::install_tls_provider();
    crate::transport::relay_client::http_client(timeout)
        .map_err(|e| format!("cannot build the HTTP client: {e}"))
}

/// GET `url`: status, `Date` header and body (at most [`MAX_PROBE_ANSWER`] bytes).
async fn get(http: &reqwest::Client, url: &str) -> Result<(u16, Option<String>, Vec<u8>), String> {
    fetch(http.get(url)).await
}

/// Sends `req` and reads its answer (at most [`MAX_PROBE_ANSWER`] bytes): status, `Date`
/// header and body.
async fn fetch(req: reqwest::RequestBuilder) -> Result<(u16, Option<String>, Vec<u8>), String> {
    let mut resp = req.send().await.map_err(|e| describe(&e))?;
    let status = resp.status().as_u16();
    let date = resp
        .headers()
        .get(reqwest::header::DATE)
        .and_then(|d| d.to_str().ok())
        .map(str::to_string);
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| describe(&e))? {
        if body.len() + chunk.len() > MAX_PROBE_ANSWER {
            return Err(format!("answer over {MAX_PROBE_ANSWER} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((status, date, body))
}

/// A probe's network error in our words ([`crate::net_error::describe`]).
fn describe(e: &reqwest::Error) -> String {
    crate::net_error::describe(e, None)
}

/// The proxy the relay client uses for `url` by the standard environment, as `<proxy URL>
/// (<variable>)` with any user name and password replaced by `***`; `None` when no proxy
/// variable applies (none set, or `NO_PROXY` names the host or `*`). `env` reads a variable
/// (`std::env::var` in the doctor; a map in tests). Mirrors reqwest's choice: `HTTPS_PROXY`
/// for https URLs, `HTTP_PROXY` for http ones, then `ALL_PROXY`; each also in lower case.
pub fn proxy_in_use(url: &str, env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let get = |name: &str| {
        [name.to_string(), name.to_ascii_lowercase()]
            .into_iter()
            .find_map(|k| env(&k).filter(|v| !v.trim().is_empty()).map(|v| (k, v)))
    };
    let (scheme, rest) = url.split_once("://")?;
    let host = rest
        .split(['/', '?', '#'])
        .next()
        .unwrap_or("")
        .rsplit('@')
        .next()
        .unwrap_or("");
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.split(':').next().unwrap_or(""),
    }
    .to_ascii_lowercase();
    if let Some((_, no)) = get("NO_PROXY") {
        let exempt = no.split(',').map(str::trim).any(|d| {
            let d = d.trim_start_matches('.').to_ascii_lowercase();
            d == "*" || (!d.is_empty() && (host == d || host.ends_with(&format!(".{d}"))))
        });
        if exempt {
            return None;
        }
    }
    let var = if scheme.eq_ignore_ascii_case("https") {
        "HTTPS_PROXY"
    } else {
        "HTTP_PROXY"
    };
    let (name, value) = get(var).or_else(|| get("ALL_PROXY"))?;
    let value = value.trim();
    let (prefix, rest) = match value.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), value),
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let shown = match rest[..authority_end].rfind('@') {
        Some(at) => format!("{prefix}***{}", &rest[at..]),
        None => value.to_string(),
    };
    Some(format!("{shown} ({name})"))
}

/// The local API addresses to try, each with where it came from: `api.addr` written by the
/// daemon last started in this home (`"api.addr"`), then the configured one (`"config.toml"`,
/// `api_bind`/`api_port` with their `MBX_*` overrides) when it differs (a stale `api.addr`
/// must not hide a daemon on the configured port).
fn api_addrs(f: &Facts) -> Vec<(String, &'static str)> {
    let mut out = Vec::new();
    if let Ok(text) = std::fs::read_to_string(f.paths.api_addr_file()) {
        let t = text.trim();
        if !t.is_empty() {
            out.push((t.to_string(), "api.addr"));
        }
    }
    if let Ok(c) = f.config.as_ref() {
        let configured = std::net::SocketAddr::new(c.api_bind, c.api_port).to_string();
        if !out.iter().any(|(a, _)| *a == configured) {
            out.push((configured, "config.toml"));
        }
    }
    out
}

/// `GET /v1/health` of the local daemon at each of [`api_addrs`] in turn until one answers,
/// with the API token from `api.token` when there is one (so a `degraded` answer carries each
/// reason's detail, peer and relay, not its code alone). `None` when there is no address to
/// try; [`DaemonProbe::Unreachable`] names the first address and lists the others tried.
async fn probe_daemon(f: &Facts, http: &reqwest::Client) -> Option<DaemonProbe> {
    let token = crate::token::ApiToken::load(&f.paths.api_token())
        .ok()
        .flatten();
    let mut first: Option<(String, &'static str, String)> = None;
    let mut also = Vec::new();
    for (addr, source) in api_addrs(f) {
        let mut req = http.get(format!("http://{addr}/v1/health"));
        if let Some(token) = &token {
            req = req.bearer_auth(token.expose_secret());
        }
        match fetch(req).await {
            Err(why) if first.is_none() => first = Some((addr, source, why)),
            Err(_) => also.push(format!("{addr} (from {source})")),
            Ok((status, _, body)) => {
                return Some(DaemonProbe::Answered {
                    addr,
                    status,
                    body: serde_json::from_slice(&body).unwrap_or(Value::Null),
                })
            }
        }
    }
    let (addr, source, why) = first?;
    Some(DaemonProbe::Unreachable {
        addr,
        source,
        also,
        why,
    })
}

async fn probe_peer(
    http: &reqwest::Client,
    lan: Option<&LanClient>,
    timeout: Duration,
    peer: crate::mailbox::peers::Peer,
) -> PeerProbe {
    use PeerProblem::{Refuses, Unreachable, WrongKey};
    let Some(addr) = peer.addr.clone() else {
        return PeerProbe {
            host: peer.host,
            addr: None,
            result: Err(Unreachable("no LAN address known".into())),
        };
    };
    let challenge = hex::encode(rand::random::<[u8; 16]>());
    let result = async {
        let pinned = PublicKey::from_b64(&peer.pubkey)
            .map_err(|_| WrongKey("pinned key is invalid".into()))?;
        let (status, _, body) = get(
            http,
            &format!("http://{addr}/v1/status?challenge={challenge}"),
        )
        .await
        .map_err(Unreachable)?;
        if status != 200 {
            return Err(Unreachable(format!("answered HTTP {status}")));
        }
        let answer: Value = serde_json::from_slice(&body)
            .map_err(|_| Unreachable("answer is not JSON".to_string()))?;
        let st = verify_status(&answer, &peer.host, &pinned, &challenge)
            .map_err(|e| WrongKey(format!("status not signed by the pinned key: {e}")))?;
        if let Some(lan) = lan {
            match tokio::time::timeout(timeout, lan.get_agents(&addr)).await {
                Err(_) => return Err(Unreachable("signed GET /v1/agents timed out".into())),
                Ok(Err(e)) => {
                    return Err(Refuses(format!(
                        "reachable, but it does not accept our signed request: {e}"
                    )))
                }
                Ok(Ok(_)) => {}
            }
        }
        Ok::<_, PeerProblem>(st.version)
    }
    .await;
    PeerProbe {
        host: peer.host,
        addr: Some(addr),
        result,
    }
}

async fn probe_relay(url: &str, http: &reqwest::Client) -> Result<RelayProbe, String> {
    let (status, date, body) = get(http, &format!("{url}/v2/relay/info")).await?;
    if status != 200 {
        return Err(format!("GET /v2/relay/info answered HTTP {status}"));
    }
    let info: RelayInfo = serde_json::from_slice(&body)
        .map_err(|_| "GET /v2/relay/info did not answer a relay info object".to_string())?;
    Ok(RelayProbe {
        info,
        date_ms: date.as_deref().and_then(parse_http_date),
    })
}

/// Runs the wanted probes concurrently.
pub async fn probe(f: &Facts, daemon: bool, peers: bool, relay: bool) -> Probes {
    let http = match direct_client(f.opts.timeout) {
        Ok(h) => h,
        Err(e) => {
            return Probes {
                daemon: None,
                peers: peers.then(|| Err(e.clone())),
                relay: (relay && f.relay_url.is_some()).then_some(Err(e)),
            }
        }
    };
    let relay_client = relay_http(f.opts.timeout);
    let d = async {
        if daemon {
            probe_daemon(f, &http).await
        } else {
            None
        }
    };
    let lan = f.signer.as_ref().and_then(|ident| {
        let clock: agentmbx_protocol::clock::SharedClock =
            std::sync::Arc::new(agentmbx_protocol::clock::ManualClock::new(f.opts.now_ms));
        let port = f.config.as_ref().map(|c| c.lan_port).unwrap_or(0);
        LanClient::new(ident.clone(), clock, port).ok()
    });
    let p = async {
        if !peers {
            return None;
        }
        let list = match &f.mailbox {
            None => return Some(Ok(Vec::new())),
            Some(m) => m.with(|c| crate::mailbox::peers::list(c)),
        };
        Some(match list {
            Err(e) => Err(e.to_string()),
            Ok(list) => {
                let all = list
                    .into_iter()
                    .map(|peer| probe_peer(&http, lan.as_ref(), f.opts.timeout, peer));
                Ok(futures_join_all(all).await)
            }
        })
    };
    let r = async {
        match (&f.relay_url, relay) {
            (Some(url), true) => Some(match &relay_client {
                Ok(rh) => probe_relay(url, rh).await,
                Err(e) => Err(e.clone()),
            }),
            _ => None,
        }
    };
    let (daemon, peers, relay) = tokio::join!(d, p, r);
    Probes {
        daemon,
        peers,
        relay,
    }
}

/// Awaits all futures concurrently (a small `join_all` on a `JoinSet`-free local set).
async fn futures_join_all<F: std::future::Future>(futs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut pinned: Vec<std::pin::Pin<Box<F>>> = futs.map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = pinned.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, fut) in pinned.iter_mut().enumerate() {
            if out[i].is_some() {
                continue;
            }
            match fut.as_mut().poll(cx) {
                std::task::Poll::Ready(v) => out[i] = Some(v),
                std::task::Poll::Pending => pending = true,
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests;
