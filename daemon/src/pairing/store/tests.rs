//! How `store.rs` words a pin conflict, for the other host or for this one's owner.

#![allow(clippy::unwrap_used)]

use crate::pairing::store;
use crate::testutil::{self};

#[test]
fn pin_conflicts_are_worded_for_the_other_host_or_for_this_ones_owner() {
    let s = testutil::store();
    let bob = testutil::identity("bob");
    s.add_peer(&bob, false);
    let bob_key = bob.host_key.public().to_b64();
    let other_key = testutil::identity("bob").host_key.public().to_b64();
    let (server_text, own_text) = s
        .mailbox
        .with(|c| {
            Ok((
                store::pin_conflict(c, "alice", "bob", &other_key)?,
                store::own_pin_conflict(c, "bob", &other_key)?,
            ))
        })
        .unwrap();
    // 0.5.x's 409 answer, and its joiner's own refusal.
    assert_eq!(
        server_text.as_deref(),
        Some("alice already has bob paired with a different key; run 'agentmbx peers remove bob' there first")
    );
    assert_eq!(
        own_text.as_deref(),
        Some("host bob is already paired with a different key; remove it first (agentmbx peers remove bob)")
    );
    // A known key under another name.
    let (server_text, own_text) = s
        .mailbox
        .with(|c| {
            Ok((
                store::pin_conflict(c, "alice", "robert", &bob_key)?,
                store::own_pin_conflict(c, "robert", &bob_key)?,
            ))
        })
        .unwrap();
    assert_eq!(
        server_text.as_deref(),
        Some("alice already has this host key paired as bob; a key has one name")
    );
    assert_eq!(
        own_text.as_deref(),
        Some("this host key is already paired here as bob; a key has one name (agentmbx peers remove bob first)")
    );
    // The same pair again, or a new one: no conflict.
    let none = s
        .mailbox
        .with(|c| {
            Ok((
                store::pin_conflict(c, "alice", "bob", &bob_key)?,
                store::own_pin_conflict(c, "carol", &other_key)?,
            ))
        })
        .unwrap();
    assert_eq!(none, (None, None));
}
