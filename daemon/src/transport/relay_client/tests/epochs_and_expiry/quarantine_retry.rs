//! Quarantined relay items are received again whenever what refused them may have changed
//! (`wire.md` §3.5; `pull::RelayClient::retry_quarantined`), whatever reason was recorded first
//! or last: against the real relay of the parent module, with `peers remove` and `peers add`
//! done the way the CLI does them and a rotation learned the way the LAN handler learns it.

use super::*;
use crate::node::unpair;

/// The (kind, reason) of every quarantined item, in seq order.
fn quarantined(node: &Node) -> Vec<(String, String)> {
    let c = node.store.fresh_conn();
    let mut st = c
        .prepare("SELECT kind, reason FROM quarantine ORDER BY seq")
        .unwrap();
    st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// `agentmbx peers remove <host>` on `node`'s store (the peer is not told: it is stopped).
fn peers_remove(node: &Node, host: &str, now: i64) {
    node.store
        .mailbox
        .with(|c| {
            let tx = c.transaction()?;
            unpair::forget_peer(&tx, &node.ident, host, now)?;
            tx.commit()?;
            Ok(())
        })
        .unwrap();
}

/// `agentmbx peers add <host> <key>` on `node`'s store.
fn peers_add(node: &Node, host: &str, key: &str, now: i64) {
    node.store
        .mailbox
        .with(|c| peers::add(c, host, key, now))
        .unwrap();
}

/// The case `quarantine-stuck-after-reason-change`: mail quarantined as `host not paired`, then
/// as `sender host mismatch` once its key is pinned under another name, is received once the
/// key is pinned under the right name, and its delivery receipt settles the sender's row.
#[tokio::test]
async fn mail_refused_under_two_reasons_is_received_once_its_host_is_pinned_right() {
    let (clock, _relay, home, work) = two_hosts().await;
    let home_pub = home.ident.host_key.public().to_b64();
    // home (the case's ra) sends while work (rb) still pins it: the relay accepts the item.
    let (id, _) = send_accepted(&home, &clock, "x").await;
    // work forgets home, then pulls: `host not paired`.
    let now = agentmbx_protocol::clock::Clock::now_ms(&*clock);
    peers_remove(&work, "home", now);
    super::super::super::pass(&work.client).await.unwrap();
    assert_eq!(
        quarantined(&work),
        [("envelope".to_string(), "host not paired".to_string())]
    );
    // home's key pinned under another name: the item is tried again and refused as the
    // envelope names host home (`sender host mismatch`).
    clock.advance(1_000);
    peers_add(&work, "othername", &home_pub, now + 1_000);
    super::super::super::pass(&work.client).await.unwrap();
    assert_eq!(
        quarantined(&work),
        [("envelope".to_string(), "sender host mismatch".to_string())]
    );
    assert_eq!(work.store.scalar::<i64>("SELECT COUNT(*) FROM messages"), 0);
    // The owner fixes the name: unpin, pin as home. The next pass receives it.
    clock.advance(1_000);
    peers_remove(&work, "othername", now + 2_000);
    peers_add(&work, "home", &home_pub, now + 2_000);
    super::super::super::pass(&work.client).await.unwrap();
    assert_eq!(quarantined(&work), []);
    assert_eq!(
        work.store.scalar::<String>(&format!(
            "SELECT d.agent || ' ' || m.from_addr || ' ' || m.subject FROM deliveries d
             JOIN messages m ON m.id = d.msg_id WHERE m.id = '{id}'"
        )),
        "bob alice@home x"
    );
    // Its delivery receipt is queued back to home, goes out on work's next pass, and home's
    // relay-accepted row settles by it.
    assert_eq!(
        work.store.scalar::<String>(&format!(
            "SELECT host || ' ' || state FROM receipt_outbox WHERE msg_id = '{id}'"
        )),
        "home delivered"
    );
    assert_eq!(home.row(&id, "work").state, "relay-accepted");
    super::super::super::pass(&work.client).await.unwrap();
    super::super::super::pass(&home.client).await.unwrap();
    assert_eq!(home.row(&id, "work").state, "delivered");
    assert!(home.alerts().is_empty());
}

/// A receipt pushed by a key its host rotated to is quarantined until this host learns the
/// rotation; learning it makes the receipt retryable, and it settles the row.
#[tokio::test]
async fn a_receipt_from_a_rotated_key_is_received_once_the_rotation_is_learned() {
    let (clock, relay, home, work) = two_hosts().await;
    let (id, _) = send_accepted(&home, &clock, "rotating").await;
    // work rotates; the relay learns it from work, home does not yet.
    clock.advance(60_000);
    let now = agentmbx_protocol::clock::Clock::now_ms(&*clock);
    let (new_work, record) = rotated(&work.ident, now);
    let shared: SharedClock = clock.clone();
    let work_client = RelayClient::new(
        relay.url(),
        relay.pubkey(),
        Arc::new(new_work),
        work.store.mailbox.clone(),
        shared,
    )
    .unwrap();
    // work pulls the mail (sealed for its old enc key) and pushes its receipt with its new key.
    super::super::super::pass(&work_client).await.unwrap();
    assert_eq!(
        work.store
            .scalar::<i64>(&format!("SELECT COUNT(*) FROM messages WHERE id = '{id}'")),
        1
    );
    super::super::super::pass(&work_client).await.unwrap();
    // home does not know that key as work's: quarantined, the row still waits.
    super::super::super::pass(&home.client).await.unwrap();
    assert_eq!(
        quarantined(&home),
        [(
            "receipt".to_string(),
            "receipt for bob@work did not come from work".to_string()
        )]
    );
    assert_eq!(home.row(&id, "work").state, "relay-accepted");
    // Nothing changed: the next pass leaves it alone.
    super::super::super::pass(&home.client).await.unwrap();
    assert_eq!(quarantined(&home).len(), 1);
    // home learns the rotation (as its LAN handler does): the receipt leaves quarantine and the
    // row settles.
    clock.advance(1_000);
    home.store
        .mailbox
        .with(|c| {
            let tx = c.transaction()?;
            let out =
                crate::transport::lan::handlers::rotate::accept_record(&tx, &record, now + 1_000)?;
            assert!(out.rotated.is_some(), "{:?}", out.result);
            tx.commit()?;
            Ok(())
        })
        .unwrap();
    super::super::super::pass(&home.client).await.unwrap();
    assert_eq!(quarantined(&home), []);
    assert_eq!(home.row(&id, "work").state, "delivered");
}
