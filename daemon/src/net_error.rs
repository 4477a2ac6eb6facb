//! Network and socket errors in our own short words.
//!
//! reqwest's text names the whole URL (with its query string, e.g. a status challenge) and
//! nests every layer it went through (`error sending request for url (…): client error
//! (Connect): tcp connect error: Connection refused (os error 111)`); the OS adds
//! `(os error N)`. [`describe`] turns a `reqwest::Error`, a `std::io::Error`, or any error
//! wrapping them into a few words a user can act on (`connection refused`, `timed out after
//! 10 s`, `name not resolved`, `address already in use`, …). Use it wherever such an error
//! reaches a user: a CLI message, a log line, a stored `last_error` shown by `sent`, a relay
//! state shown by `relay info`.

use std::error::Error;
use std::io::ErrorKind;
use std::time::Duration;

/// `e` in our own short words, never with a URL or `(os error N)`:
/// - a timeout: `timed out`, or `timed out after N s` when `timeout` (the client's limit that
///   fired) is given;
/// - a socket failure, by its kind: `connection refused`, `no route to host`, `network
///   unreachable`, `the connection was reset`, `address already in use`, `address not
///   available on this host`, `permission denied`, …;
/// - a name that did not resolve: `name not resolved`;
/// - a TLS failure: `TLS handshake failed: …` (the other end does not speak TLS, or its
///   certificate was refused and why);
/// - an answer that is not HTTP: `the answer was not HTTP`;
/// - an answer that broke off: `the answer broke off` (with the cause when known);
/// - otherwise the innermost cause's text, with URLs and `(os error N)` removed.
pub fn describe(e: &(dyn Error + 'static), timeout: Option<Duration>) -> String {
    let timed_out = || match timeout {
        Some(t) if t.as_millis() % 1000 == 0 => format!("timed out after {} s", t.as_secs()),
        Some(t) => format!("timed out after {} ms", t.as_millis()),
        None => "timed out".to_string(),
    };
    let mut broke_off = false;
    let mut innermost: Option<String> = None;
    let mut current: Option<&(dyn Error + 'static)> = Some(e);
    while let Some(err) = current {
        if let Some(r) = err.downcast_ref::<reqwest::Error>() {
            if r.is_timeout() {
                return timed_out();
            }
            broke_off |= r.is_body() || r.is_decode();
        }
        if let Some(tls) = tls_words(err) {
            return format!("TLS handshake failed: {tls}");
        }
        let text = err.to_string();
        if text.starts_with("dns error") || text.starts_with("failed to lookup address") {
            return "name not resolved".to_string();
        }
        if is_not_http(&text) {
            return "the answer was not HTTP".to_string();
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(words) = io_words(io.kind()) {
                return match words {
                    "timed out" => timed_out(),
                    w if broke_off => format!("the answer broke off: {w}"),
                    w => w.to_string(),
                };
            }
            // A custom io::Error's `source` skips the error it wraps: look at that one.
            if let Some(inner) = io.get_ref() {
                innermost = Some(text);
                current = Some(inner);
                continue;
            }
        }
        innermost = Some(text);
        current = err.source();
    }
    let root = clean(&innermost.unwrap_or_default());
    match (broke_off, root.is_empty()) {
        (true, true) => "the answer broke off".to_string(),
        (true, false) => format!("the answer broke off: {root}"),
        (false, true) => "request failed".to_string(),
        (false, false) => root,
    }
}

/// Our words for a socket error kind; `None` for kinds whose own text says more.
fn io_words(kind: ErrorKind) -> Option<&'static str> {
    Some(match kind {
        ErrorKind::ConnectionRefused => "connection refused",
        ErrorKind::TimedOut => "timed out",
        ErrorKind::HostUnreachable => "no route to host",
        ErrorKind::NetworkUnreachable => "network unreachable",
        ErrorKind::NetworkDown => "the network is down",
        ErrorKind::ConnectionReset => "the connection was reset",
        ErrorKind::ConnectionAborted => "the connection was aborted",
        ErrorKind::NotConnected | ErrorKind::BrokenPipe => "the connection was closed",
        ErrorKind::UnexpectedEof => "the connection closed before the answer was complete",
        ErrorKind::AddrInUse => "address already in use",
        ErrorKind::AddrNotAvailable => "address not available on this host",
        ErrorKind::PermissionDenied => "permission denied",
        _ => return None,
    })
}

/// Whether hyper's text says the answer was not HTTP (e.g. `invalid HTTP version parsed`).
fn is_not_http(text: &str) -> bool {
    text.starts_with("invalid HTTP")
        || text.starts_with("received HTTP/0.9")
        || text.contains("invalid HTTP version")
        || text.contains("invalid HTTP status")
        || text.contains("invalid HTTP header")
        // Bytes before the request was even sent (an SSH banner, say).
        || text == "received unexpected message from connection"
}

/// The TLS library's error `e`, said in words a user can act on; `None` when `e` is not one.
fn tls_words(e: &(dyn Error + 'static)) -> Option<String> {
    use rustls::{CertificateError, Error as Tls};
    Some(match e.downcast_ref::<Tls>()? {
        // The first bytes back were not TLS: typically an HTTP answer to the TLS greeting.
        Tls::InvalidMessage(_) => "the other end does not speak TLS at this address (it \
            answered in plain HTTP); use its http:// URL, or the port where it serves TLS"
            .to_string(),
        Tls::InvalidCertificate(why) => {
            let why = match why {
                CertificateError::UnknownIssuer => {
                    "it is issued by an authority this host does not trust"
                }
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    "it has expired"
                }
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => {
                    "it is issued for another name than the URL's"
                }
                _ => "it is not valid",
            };
            format!("its certificate was refused: {why}")
        }
        _ => "the TLS library refused the exchange".to_string(),
    })
}

/// `text` without URLs (and the `for url ()` around them) and without `(os error N)`.
fn clean(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        // Back up to the scheme's start, then skip to the URL's end.
        let start = rest[..at]
            .rfind(|c: char| !c.is_ascii_alphanumeric() && c != '+' && c != '-' && c != '.')
            .map_or(0, |i| i + 1);
        out.push_str(&rest[..start]);
        let after = &rest[at + 3..];
        let end = after
            .find(|c: char| c.is_whitespace() || c == ')' || c == '"' || c == '\'')
            .unwrap_or(after.len());
        rest = &after[end..];
    }
    out.push_str(rest);
    let mut text = out
        .replace("for url ()", "")
        .replace("()", "")
        .replace("for url", "")
        .replace(" :", ":");
    while let Some(at) = text.find(" (os error ") {
        let end = text[at..].find(')').map_or(text.len(), |i| at + i + 1);
        text.replace_range(at..end, "");
    }
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut chars = text.chars();
    match chars.next() {
        // The OS says `Connection refused`; a clause inside our sentence starts lower case.
        Some(first) if chars.clone().next().is_some_and(char::is_lowercase) => {
            first.to_lowercase().chain(chars).collect()
        }
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;
    use tokio::io::AsyncWriteExt;

    /// No text says `os error`, a URL or its query, or reqwest's layering.
    fn assert_plain(text: &str) {
        for library in [
            "os error",
            "http://",
            "challenge=",
            "error sending request",
            "client error",
            "tcp connect error",
            "hyper",
        ] {
            assert!(!text.contains(library), "{library:?} in {text:?}");
        }
    }

    async fn get(url: &str, timeout: Duration) -> reqwest::Error {
        crate::install_tls_provider();
        reqwest::Client::builder()
            .no_proxy()
            .timeout(timeout)
            .build()
            .unwrap()
            .get(url)
            .send()
            .await
            .unwrap_err()
    }

    fn free_port() -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }

    #[tokio::test]
    async fn refused_connection_is_said_in_two_words_without_the_url() {
        let port = free_port();
        let e = get(
            &format!("http://127.0.0.1:{port}/v1/status?challenge=secret"),
            Duration::from_secs(5),
        )
        .await;
        let text = describe(&e, None);
        assert_eq!(text, "connection refused", "from {e:?}");
        assert_plain(&text);
    }

    #[tokio::test]
    async fn a_silent_server_times_out_after_the_limit() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let held = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(s);
        });
        let e = get(&format!("http://127.0.0.1:{port}/"), Duration::from_secs(1)).await;
        assert_eq!(
            describe(&e, Some(Duration::from_secs(1))),
            "timed out after 1 s"
        );
        assert_eq!(describe(&e, None), "timed out");
        held.abort();
    }

    #[tokio::test]
    async fn an_answer_that_is_not_http_is_named() {
        use tokio::io::AsyncReadExt;
        // One server speaks first (an SSH banner), one answers the request with garbage.
        for speaks_first in [true, false] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                if !speaks_first {
                    let mut buf = [0u8; 1024];
                    let _ = s.read(&mut buf).await;
                }
                let _ = s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n\r\n").await;
                tokio::time::sleep(Duration::from_secs(2)).await;
            });
            let e = get(&format!("http://127.0.0.1:{port}/"), Duration::from_secs(5)).await;
            let text = describe(&e, None);
            assert_eq!(text, "the answer was not HTTP", "from {e:?}");
        }
    }

    #[test]
    fn socket_errors_by_kind() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let e = std::net::TcpListener::bind(taken.local_addr().unwrap()).unwrap_err();
        assert_eq!(describe(&e, None), "address already in use", "from {e:?}");
        for (kind, words) in [
            (ErrorKind::HostUnreachable, "no route to host"),
            (ErrorKind::ConnectionRefused, "connection refused"),
            (
                ErrorKind::AddrNotAvailable,
                "address not available on this host",
            ),
        ] {
            assert_eq!(describe(&io::Error::from(kind), None), words);
        }
        assert_eq!(
            describe(
                &io::Error::from(ErrorKind::TimedOut),
                Some(Duration::from_secs(3))
            ),
            "timed out after 3 s"
        );
    }

    #[test]
    fn other_texts_lose_urls_and_os_codes() {
        let e = io::Error::other(
            "failed for url (http://h:1/v1/status?challenge=abc): Oops here (os error 99)",
        );
        let text = describe(&e, None);
        assert_eq!(text, "failed: Oops here");
        assert_plain(&text);
        let e = io::Error::other("Something odd (os error 5)");
        assert_eq!(describe(&e, None), "something odd");
    }
}
