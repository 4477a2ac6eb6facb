//! Capped body reading (`wire.md` §3.1, §4): a request body is read under a cap while
//! streaming; an oversized one is drained (discarded) for up to [`DRAIN_FOR`] so the client
//! still reads the answer, and reported as [`BodyError::TooLarge`] for the server to answer 413
//! in its own error shape.
//!
//! # What it owns
//! The streaming read, the cap on the declared length and on the bytes that arrived, and the
//! drain. Memory follows the bytes that actually arrived, never the declared length: the
//! request is not authenticated yet, so a `content-length` costs the sender nothing.
//!
//! # What it must never do
//! Answer the request (each server has its own error shape), log or keep any byte of a body
//! it refused.

use std::pin::Pin;
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};

/// How long the rest of an oversized body is read and discarded before the 413 is sent
/// (`wire.md` §3.1: "then drain up to 2 s"), so a client still uploading reads the 413 instead
/// of a reset connection.
pub const DRAIN_FOR: Duration = Duration::from_secs(2);

/// The next data chunk of a request body (`None` at its end; trailers are skipped).
async fn next_data(body: &mut Body) -> Option<Result<Bytes, axum::Error>> {
    loop {
        match std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await? {
            Err(e) => return Some(Err(e)),
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    return Some(Ok(data));
                }
            }
        }
    }
}

/// Why [`read_capped`] kept no body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyError {
    /// Declared or grown past the cap; the rest was discarded for up to [`DRAIN_FOR`]
    /// (answer 413).
    TooLarge,
    /// The body broke off (answer 400).
    Broken,
}

/// The streaming body cap, for any server that answers in its own error shape (the relay; the
/// daemon's LAN server, its rotate route and the local API): a declared length over `cap`, or
/// a body that grows past it, keeps nothing more and is discarded for up to [`DRAIN_FOR`] before
/// [`BodyError::TooLarge`] is returned. Memory follows the bytes that arrived.
pub async fn read_capped(mut body: Body, cap: usize) -> Result<Vec<u8>, BodyError> {
    if body.size_hint().lower() > cap as u64 {
        drain(body).await;
        return Err(BodyError::TooLarge);
    }
    let mut buf: Vec<u8> = Vec::new();
    while let Some(data) = next_data(&mut body).await {
        let data = data.map_err(|_| BodyError::Broken)?;
        if data.len() > cap - buf.len() {
            drop(buf);
            drain(body).await;
            return Err(BodyError::TooLarge);
        }
        buf.extend_from_slice(&data);
    }
    Ok(buf)
}

/// Discards the rest of an oversized body for up to [`DRAIN_FOR`].
async fn drain(mut body: Body) {
    let _ = tokio::time::timeout(DRAIN_FOR, async {
        while let Some(Ok(_)) = next_data(&mut body).await {}
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::{Context, Poll};

    /// The relay's largest body (`agentmbx_protocol::limits::RELAY_MAX_BODY`, 8 MiB).
    const CAP: usize = 8 * 1024 * 1024;

    /// A body that declares `declared` bytes in its size hint and then sends only `sent`.
    struct Lying {
        declared: u64,
        sent: Option<Bytes>,
    }

    impl http_body::Body for Lying {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.sent.take().map(|b| Ok(http_body::Frame::data(b))))
        }

        fn size_hint(&self) -> http_body::SizeHint {
            http_body::SizeHint::with_exact(self.declared)
        }
    }

    #[tokio::test]
    async fn memory_follows_the_bytes_that_arrived_not_the_declared_length() {
        let body = Body::new(Lying {
            declared: CAP as u64,
            sent: Some(Bytes::from_static(b"{}")),
        });
        assert_eq!(body.size_hint().lower(), CAP as u64);
        let buf = read_capped(body, CAP).await.unwrap();
        assert_eq!(buf, b"{}");
        assert!(
            buf.capacity() < 4096,
            "{} bytes reserved for a 2-byte body",
            buf.capacity()
        );
        // Over the cap by declaration alone: refused without reading.
        let body = Body::new(Lying {
            declared: CAP as u64 + 1,
            sent: None,
        });
        let e = read_capped(body, CAP).await.unwrap_err();
        assert_eq!(e, BodyError::TooLarge);
    }
}
