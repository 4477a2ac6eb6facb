//! The client refuses answers over their cap without reading the rest.

use super::*;
use crate::transport::lan;

/// A server on 127.0.0.1:0 answering every request 200 with a body that never ends (64 KiB
/// chunks until the client goes away), or — with `declared` — a `content-length` of that many
/// bytes and no body at all. Returns its address and a counter of the bytes it managed to send.
async fn endless_answers(declared: Option<usize>) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = sent.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut tcp, _)) = listener.accept().await else {
                return;
            };
            let counter = counter.clone();
            tokio::spawn(async move {
                // The request head (the body, if any, is small and never read).
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if tcp.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                if let Some(len) = declared {
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n"
                    );
                    let _ = tcp.write_all(answer.as_bytes()).await;
                    let _ =
                        tokio::time::timeout(Duration::from_secs(20), tcp.read(&mut byte)).await;
                    return;
                }
                let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n";
                if tcp.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = vec![b' '; 64 * 1024];
                loop {
                    let frame = format!("{:x}\r\n", chunk.len());
                    if tcp.write_all(frame.as_bytes()).await.is_err()
                        || tcp.write_all(&chunk).await.is_err()
                        || tcp.write_all(b"\r\n").await.is_err()
                    {
                        return;
                    }
                    counter.fetch_add(chunk.len(), std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    (addr, sent)
}

fn over_cap(e: LanError) -> String {
    match e {
        LanError::BadAnswer(m) => m,
        other => panic!("expected a refused oversized answer, got {other:?}"),
    }
}

#[tokio::test]
async fn answers_over_their_cap_are_refused_without_reading_the_rest() {
    use lan::client::{MAX_AGENTS_ANSWER, MAX_RESULTS_ANSWER, MAX_SMALL_ANSWER};
    let n = net().await;
    let (addr, sent) = endless_answers(None).await;
    let peer = beta_peer(&n);
    let wire = n.wire(&testutil::ids().next(T0));
    let started = std::time::Instant::now();

    let e = n
        .client
        .post_envelopes(&addr, std::slice::from_ref(&wire))
        .await
        .unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v2/envelopes over {MAX_RESULTS_ANSWER} bytes")
    );
    let e = n
        .client
        .post_receipts(&addr, &[br#"{"rec":{},"sig":"x"}"#.to_vec()])
        .await
        .unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v1/receipts over {MAX_RESULTS_ANSWER} bytes")
    );
    let e = n.client.get_agents(&addr).await.unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v1/agents over {MAX_AGENTS_ANSWER} bytes")
    );
    let e = n.client.get_enc_key(&addr, &peer).await.unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v1/enc-key over {MAX_SMALL_ANSWER} bytes")
    );
    let e = n.client.unpair(&addr).await.unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v1/unpair over {MAX_SMALL_ANSWER} bytes")
    );
    let e = n
        .client
        .signed_get(&addr, "/v1/anything")
        .await
        .unwrap_err();
    assert_eq!(
        over_cap(e),
        format!(
            "answer to /v1/anything over {} bytes",
            lan::client::MAX_ANSWER
        )
    );
    // Far from the 15 s a call may take: each read stopped at its cap.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    // What the server managed to push is bounded by the caps (plus socket buffers), not by
    // the time the calls were allowed.
    let total = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(total < 64 * 1024 * 1024, "{total} bytes sent");

    // A declared length over the cap is refused before any of the body is read.
    let (addr, _) = endless_answers(Some(512 * 1024 * 1024)).await;
    let e = n.client.get_enc_key(&addr, &peer).await.unwrap_err();
    assert_eq!(
        over_cap(e),
        format!("answer to /v1/enc-key over {MAX_SMALL_ANSWER} bytes")
    );
    let e = n
        .client
        .post_envelopes(&addr, std::slice::from_ref(&wire))
        .await
        .unwrap_err();
    assert!(!e.is_retryable(), "{e:?}");

    // Real answers are far below the caps and still pass.
    assert_eq!(
        n.client.get_enc_key(&n.beta.addr, &peer).await.unwrap(),
        n.beta_enc.to_b64()
    );
}
