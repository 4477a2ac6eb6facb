//! Reading a relay's answers under a size cap (spec §1: the relay is untrusted; a hostile or
//! broken relay must not exhaust this host's memory).
//!
//! Every answer body the relay client reads goes through [`read_capped`]: a declared length
//! over the cap is refused before reading, a streamed body as soon as it passes the cap (the
//! connection is dropped with the rest unread). The caps: [`pull_answer_cap`] for a pull page
//! (`GET /v2/relay/items`), [`MAX_ANSWER`] for every other answer (info, challenge, enrol,
//! enc-key, senders, push results, ack, rotate). This module never logs or keeps a body.

use bytes::Bytes;

use agentmbx_protocol::wire::Limits;

use super::{describe, RelayError};

/// Largest answer read for anything but a pull page (bytes): 1 MiB. The largest of them, a
/// push answer, holds at most 200 results with one accept statement each (well under 512 KiB).
pub const MAX_ANSWER: usize = 1024 * 1024;

/// Smallest cap of a pull page (bytes): 16 MiB, room for the default page of 8 MiB of wire
/// bytes (`limits::MAX_PULL_BYTES`) in base64 (4/3) plus the JSON of up to 500 items.
pub const MIN_PULL_ANSWER: usize = 16 * 1024 * 1024;

/// Largest cap of a pull page whatever the relay publishes (bytes): 96 MiB, room for a page of
/// the largest `max_pull_bytes` a relay accepts in its configuration (64 MiB) in base64 plus
/// [`PULL_PAGE_OVERHEAD`].
pub const MAX_PULL_ANSWER: usize = 96 * 1024 * 1024;

/// Room for everything in a pull page but the base64 wire bytes (bytes): 1 MiB, more than the
/// JSON of 500 items (`seq`, `kind`, `item_id`, `sender_pubkey`, field names: under 300 bytes
/// each) and the page's own fields.
pub const PULL_PAGE_OVERHEAD: usize = 1024 * 1024;

// The default page (`limits::MAX_PULL_BYTES` of wire bytes in base64, plus the rest) fits the
// floor.
const _: () = assert!(
    agentmbx_protocol::limits::MAX_PULL_BYTES.div_ceil(3) * 4 + PULL_PAGE_OVERHEAD
        <= MIN_PULL_ANSWER
);

/// The cap of a pull page under the relay's published `limits` (bytes): a page carries at most
/// `max_pull_bytes` wire bytes, or one item of up to `max_item_bytes` (`wire.md` §3.2: always
/// at least one item), base64-encoded, plus [`PULL_PAGE_OVERHEAD`]; never below
/// [`MIN_PULL_ANSWER`] nor above [`MAX_PULL_ANSWER`].
pub fn pull_answer_cap(limits: &Limits) -> usize {
    let wire = usize::try_from(limits.max_pull_bytes.max(limits.max_item_bytes))
        .unwrap_or(usize::MAX)
        .min(MAX_PULL_ANSWER);
    let base64 = wire.div_ceil(3).saturating_mul(4);
    base64
        .saturating_add(PULL_PAGE_OVERHEAD)
        .clamp(MIN_PULL_ANSWER, MAX_PULL_ANSWER)
}

/// Reads the body of `resp` in chunks, at most `cap` bytes (module docs). Errors:
/// [`RelayError::Malformed`] `answer over <cap> bytes` past the cap (nothing of the body is
/// kept); [`RelayError::Unreachable`] when the body breaks off.
pub async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Result<Bytes, RelayError> {
    let over = || RelayError::Malformed(format!("answer over {cap} bytes"));
    let cap_u64 = u64::try_from(cap).unwrap_or(u64::MAX);
    if resp.content_length().is_some_and(|n| n > cap_u64) {
        return Err(over());
    }
    let mut body: Vec<u8> = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| RelayError::Unreachable(describe(&e)))?
    {
        if body.len().saturating_add(chunk.len()) > cap {
            return Err(over());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(body))
}

/// A loopback HTTP/1.1 server for tests that answers every request with a scripted status and
/// body, with a `Content-Length` or streamed in chunks without one (which an axum handler
/// cannot be made to do with a JSON answer).
#[cfg(test)]
pub(crate) mod raw {
    use std::sync::Arc;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// One scripted answer.
    #[derive(Debug, Clone)]
    pub struct RawAnswer {
        /// HTTP status.
        pub status: u16,
        /// The body.
        pub body: Vec<u8>,
        /// Sent with `Transfer-Encoding: chunked` (64 KiB chunks) instead of a length.
        pub chunked: bool,
    }

    impl RawAnswer {
        /// A 200 answer of `body`.
        pub fn ok(body: Vec<u8>, chunked: bool) -> Self {
            RawAnswer {
                status: 200,
                body,
                chunked,
            }
        }
    }

    /// A JSON object `{"pad":"xxx…"}` of exactly `len` bytes (`len` ≥ 10).
    pub fn json_of_len(len: usize) -> Vec<u8> {
        let mut body = b"{\"pad\":\"".to_vec();
        body.resize(len - 2, b'x');
        body.extend_from_slice(b"\"}");
        body
    }

    /// Serves on 127.0.0.1 until the handle is aborted; `answer` gets `METHOD /path?query`.
    /// Returns the base URL.
    pub async fn serve(
        answer: impl Fn(&str) -> RawAnswer + Send + Sync + 'static,
    ) -> (String, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let answer = Arc::new(answer);
        let task = tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let answer = answer.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    let end = loop {
                        let Ok(n) = sock.read(&mut buf).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        head.extend_from_slice(&buf[..n]);
                        if let Some(i) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                    };
                    let text = String::from_utf8_lossy(&head[..end]).to_string();
                    let length: usize = text
                        .lines()
                        .filter_map(|l| l.split_once(':'))
                        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
                        .and_then(|(_, v)| v.trim().parse().ok())
                        .unwrap_or(0);
                    let mut have = head.len() - end;
                    while have < length {
                        match sock.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => have += n,
                        }
                    }
                    let line = text.lines().next().unwrap_or("");
                    let mut parts = line.split(' ');
                    let route = format!(
                        "{} {}",
                        parts.next().unwrap_or(""),
                        parts.next().unwrap_or("")
                    );
                    let a = answer(&route);
                    let mut out = format!(
                        "HTTP/1.1 {} X\r\ncontent-type: application/json\r\nconnection: close\r\n",
                        a.status
                    );
                    if a.chunked {
                        out.push_str("transfer-encoding: chunked\r\n\r\n");
                    } else {
                        out.push_str(&format!("content-length: {}\r\n\r\n", a.body.len()));
                    }
                    if sock.write_all(out.as_bytes()).await.is_err() {
                        return;
                    }
                    if a.chunked {
                        for c in a.body.chunks(64 * 1024) {
                            let mut frame = format!("{:x}\r\n", c.len()).into_bytes();
                            frame.extend_from_slice(c);
                            frame.extend_from_slice(b"\r\n");
                            if sock.write_all(&frame).await.is_err() {
                                return;
                            }
                        }
                        let _ = sock.write_all(b"0\r\n\r\n").await;
                    } else {
                        let _ = sock.write_all(&a.body).await;
                    }
                    let _ = sock.shutdown().await;
                });
            }
        });
        (url, task)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::raw::{json_of_len, serve, RawAnswer};
    use super::*;
    use crate::testutil;
    use agentmbx_protocol::clock::SharedClock;
    use agentmbx_protocol::keys::HostKey;

    fn is_over(e: &RelayError, cap: usize) -> bool {
        matches!(e, RelayError::Malformed(m) if *m == format!("answer over {cap} bytes"))
    }

    async fn fetch(url: &str, cap: usize) -> Result<Bytes, RelayError> {
        let resp = reqwest::Client::new()
            .get(format!("{url}/x"))
            .send()
            .await
            .map_err(|e| RelayError::Unreachable(describe(&e)))?;
        read_capped(resp, cap).await
    }

    #[tokio::test]
    async fn an_answer_is_read_up_to_its_cap_and_refused_past_it_declared_or_streamed() {
        crate::install_tls_provider();
        for chunked in [false, true] {
            for (len, fits) in [(MAX_ANSWER, true), (MAX_ANSWER + 1, false)] {
                let (url, task) = serve(move |_| RawAnswer::ok(vec![b'a'; len], chunked)).await;
                let got = fetch(&url, MAX_ANSWER).await;
                if fits {
                    assert_eq!(got.unwrap().len(), MAX_ANSWER, "chunked {chunked}");
                } else {
                    let e = got.unwrap_err();
                    assert!(is_over(&e, MAX_ANSWER), "chunked {chunked}: {e}");
                    assert_eq!(
                        e.to_string(),
                        "malformed relay answer: answer over 1048576 bytes"
                    );
                }
                task.abort();
            }
        }
        // A body far past the cap and streamed is given up without reading it all.
        let (url, task) = serve(|_| RawAnswer::ok(vec![b'a'; 64 * 1024 * 1024], true)).await;
        assert!(is_over(
            &fetch(&url, MAX_ANSWER).await.unwrap_err(),
            MAX_ANSWER
        ));
        task.abort();
    }

    #[test]
    fn the_pull_cap_fits_the_relays_page_bounds() {
        let mut limits = Limits {
            max_item_bytes: agentmbx_protocol::limits::MAX_ITEM_BYTES as u64,
            max_batch: 200,
            max_pull: 500,
            max_pull_bytes: agentmbx_protocol::limits::MAX_PULL_BYTES as u64,
            max_targets: 64,
            retention_days: 14,
            max_queue_items: 1,
            max_queue_bytes: 1,
            max_sender_items: 1,
            max_sender_bytes: 1,
            max_owner_items: 1,
            max_owner_bytes: 1,
        };
        // The default page (8 MiB of wire bytes: 10.7 MiB in base64) fits the floor.
        assert_eq!(pull_answer_cap(&limits), MIN_PULL_ANSWER);
        // A relay configured for larger pages (up to 64 MiB) gets room for them.
        limits.max_pull_bytes = 64 * 1024 * 1024;
        assert_eq!(
            pull_answer_cap(&limits),
            (64usize << 20).div_ceil(3) * 4 + PULL_PAGE_OVERHEAD
        );
        assert!(pull_answer_cap(&limits) <= MAX_PULL_ANSWER);
        // One item larger than the page bound still fits.
        limits.max_pull_bytes = 1;
        limits.max_item_bytes = 20 * 1024 * 1024;
        assert_eq!(
            pull_answer_cap(&limits),
            (20usize << 20).div_ceil(3) * 4 + PULL_PAGE_OVERHEAD
        );
        // Whatever a relay publishes, never past the ceiling.
        limits.max_pull_bytes = u64::MAX;
        assert_eq!(pull_answer_cap(&limits), MAX_PULL_ANSWER);
    }

    fn client(url: &str) -> (testutil::Store, super::super::RelayClient) {
        crate::install_tls_provider();
        let store = testutil::store();
        let clock: SharedClock = testutil::clock();
        let me = Arc::new(testutil::identity("home"));
        let c = super::super::RelayClient::new(
            url,
            HostKey::generate().public(),
            me,
            store.mailbox.clone(),
            clock,
        )
        .unwrap();
        (store, c)
    }

    #[tokio::test]
    async fn every_relay_request_reads_its_answer_under_the_cap() {
        for chunked in [false, true] {
            let (url, task) = serve(move |route| {
                // The pull page route gets a body at the pull floor; everything else 1 byte
                // past the small cap.
                let len = if route.starts_with("GET /v2/relay/items") {
                    MIN_PULL_ANSWER
                } else {
                    MAX_ANSWER + 1
                };
                RawAnswer::ok(json_of_len(len), chunked)
            })
            .await;
            let (_store, c) = client(&url);
            let case = format!("chunked {chunked}");
            // Signed calls.
            let e = c.call("GET", "/v2/relay/info", "").await.unwrap_err();
            assert!(is_over(&e, MAX_ANSWER), "{case}: {e}");
            let e = c
                .call_json::<serde_json::Value>("POST", "/v2/relay/ack", "{}")
                .await
                .unwrap_err();
            assert!(is_over(&e, MAX_ANSWER), "{case}: {e}");
            // Plain posts (challenge and enrol).
            let e = c.enrol().await.unwrap_err();
            assert!(is_over(&e, MAX_ANSWER), "{case}: {e}");
            // Unsigned info of first contact and `relay set`.
            let e = super::super::pin::fetch_info(&url).await.unwrap_err();
            assert!(is_over(&e, MAX_ANSWER), "{case}: {e}");
            // A pull page may be larger: read at its cap, refused past it.
            let (status, body) = c
                .call_capped("GET", "/v2/relay/items?after=0", "", MIN_PULL_ANSWER)
                .await
                .unwrap();
            assert_eq!((status, body.len()), (200, MIN_PULL_ANSWER), "{case}");
            let e = c
                .call_capped("GET", "/v2/relay/items?after=0", "", MIN_PULL_ANSWER - 1)
                .await
                .unwrap_err();
            assert!(is_over(&e, MIN_PULL_ANSWER - 1), "{case}: {e}");
            task.abort();
        }
        // At the small cap the answer is read (and parsed) as before.
        let (url, task) = serve(|_| RawAnswer::ok(json_of_len(MAX_ANSWER), true)).await;
        let (_store, c) = client(&url);
        let v: serde_json::Value = c.call_json("GET", "/v2/relay/info", "").await.unwrap();
        assert_eq!(v["pad"].as_str().unwrap().len(), MAX_ANSWER - 10);
        task.abort();
    }
}
