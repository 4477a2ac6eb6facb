//! Issue 17 (8c): an `https://` relay URL aimed at a relay that speaks plain HTTP is described
//! in our words ("the relay does not speak TLS"), never with the TLS library's text.

use super::super::{describe, http_client};

/// A plain-HTTP server (as `relay serve` without TLS) on 127.0.0.1; returns its port.
async fn plain_http_relay() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = axum::Router::new().route("/v1/info", axum::routing::get(|| async { "{}" }));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    port
}

#[tokio::test]
async fn https_to_a_plain_http_relay_says_the_relay_does_not_speak_tls() {
    crate::install_tls_provider();
    let port = plain_http_relay().await;
    let http = http_client(std::time::Duration::from_secs(5)).unwrap();
    let err = http
        .get(format!("https://127.0.0.1:{port}/v1/info"))
        .send()
        .await
        .unwrap_err();
    let text = describe(&err);
    assert!(
        text.contains("the relay does not speak TLS"),
        "{text} (from {err:?})"
    );
    assert!(text.contains("http://"), "says what to use instead: {text}");
    for library in [
        "InvalidContentType",
        "corrupt message",
        "rustls",
        "certificate",
    ] {
        assert!(!text.contains(library), "{text}");
    }
}
