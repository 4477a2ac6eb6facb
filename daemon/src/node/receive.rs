//! Receiving one sealed envelope (spec §4, `wire.md` §2.3–§2.4, §4 `receive`): parse → shape
//! check → the sender must be a pinned peer, the envelope must come from one of that peer's own
//! agents (`sig.host` and `from` name the peer) and the host signature must verify with its
//! pinned key → open the seal with this host's enc key → dedup by envelope id (the messages
//! table is the dedup set) → store the plaintext copy and deliver to this host's recipients.
//!
//! A refusal is returned as a reason for quarantine; storage failures are returned separately
//! (the item is then retried, never quarantined for a fault of ours).

use rusqlite::Connection;
use serde_json::Value;

use agentmbx_protocol::time::parse_iso_ms;
use agentmbx_protocol::{canonical, envelope, keys::PublicKey, seal};

use crate::identity::Identity;
use crate::mailbox::{messages, peers, unclaimed, MailboxError};
use crate::node::route;

/// What happened to an accepted envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Stored now; delivered to these local agents (names held as unclaimed are not listed).
    Stored {
        /// Local agent names that got a delivery.
        delivered: Vec<String>,
    },
    /// Already stored (a repeat): nothing changed.
    Duplicate,
}

/// Receives `wire` (the sealed envelope bytes) that a relay says `sender_pubkey` pushed as
/// `item_id`. `Ok(Ok(verdict))` accepted, `Ok(Err(reason))` rejected (quarantine it),
/// `Err(_)` a storage fault (retry later).
pub fn receive_sealed(
    conn: &Connection,
    ident: &Identity,
    wire: &[u8],
    item_id: &str,
    sender_pubkey: &str,
    now_ms: i64,
) -> Result<Result<Verdict, String>, MailboxError> {
    let env = match canonical::parse(wire) {
        Ok(v) => v,
        Err(_) => return Ok(Err("malformed: not JSON".into())),
    };
    if let Err(why) = envelope::check_shape(&env) {
        return Ok(Err(format!("bad envelope: {why}")));
    }
    let id = env.get("id").and_then(Value::as_str).unwrap_or_default();
    if id != item_id {
        return Ok(Err("item id is not the envelope id".into()));
    }
    // A key the peer rotated away from still names it: mail pushed before the rotation.
    let Some(peer) = peers::by_any_key(conn, sender_pubkey)? else {
        return Ok(Err("host not paired".into()));
    };
    receive(conn, ident, &env, &peer, now_ms)
}

/// `receive(env, via)` (`wire.md` §4): every check in order, for an envelope that came from
/// the pinned peer `via` (over the LAN: the hop's verified host; over the relay: the item's
/// verified sender key). Shape → `sig.host` and `from` name `via` (`sender host mismatch`) →
/// the sender's local part is a name (`bad sender address`) → host signature by the pinned key,
/// or by a key the peer retired in a rotation for mail whose `ts` is at most
/// [`peers::RETIRED_KEY_GRACE_MS`] after it (`bad signature`; `signed by a key <host> retired at
/// <iso>: not valid for mail dated after <iso>`) → the sealed body opens (`undecryptable body`)
/// → dedup by id → routing → store + deliveries (and unclaimed rows for direct mail to names
/// with no mailbox here: no delivery and no receipt until that agent registers).
///
/// `Ok(Ok(verdict))` accepted or duplicate, `Ok(Err(reason))` rejected (nothing stored; the
/// reason is the text after `rejected:`), `Err(_)` a storage fault (retry later).
pub fn receive(
    conn: &Connection,
    ident: &Identity,
    env: &Value,
    via: &peers::Peer,
    now_ms: i64,
) -> Result<Result<Verdict, String>, MailboxError> {
    if let Err(why) = envelope::check_shape(env) {
        return Ok(Err(why));
    }
    let id = env
        .get("id")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let Ok(key) = PublicKey::from_b64(&via.pubkey) else {
        return Ok(Err("host not paired".into()));
    };
    // The peer's key vouches only for its own agents: `sig.host` and the host part of `from`
    // must be the peer's name (`wire.md` §4 receive), or a paired host could sign mail "from"
    // an agent of another host.
    let from = env.get("from").and_then(Value::as_str).unwrap_or_default();
    let sig_host = env
        .get("sig")
        .and_then(|s| s.get("host"))
        .and_then(Value::as_str);
    let Some((sender_name, from_host)) = from.rsplit_once('@') else {
        return Ok(Err("sender host mismatch".into()));
    };
    if sig_host != Some(via.host.as_str()) || from_host != via.host {
        return Ok(Err("sender host mismatch".into()));
    }
    if !agentmbx_protocol::limits::is_name(sender_name) {
        return Ok(Err("bad sender address".into()));
    }
    // Mail signed before the peer rotated verifies with a key it retired (`wire.md` §2.10),
    // when it is dated no later than the rotation plus the grace (`peers::check_retired`).
    if !envelope::verify(env, &key) {
        let retired = peers::retired_keys(conn, &via.host)?;
        let ts = env.get("ts").and_then(Value::as_str).and_then(parse_iso_ms);
        if let Err(why) = peers::check_retired(&retired, &via.host, "mail", ts, |k| {
            PublicKey::from_b64(k).is_ok_and(|k| envelope::verify(env, &k))
        }) {
            return Ok(Err(why));
        }
    }
    let Some(enc_v) = env.get("enc").filter(|e| !e.is_null()) else {
        return Ok(Err("envelope body is not sealed".into()));
    };
    let Ok(enc) = serde_json::from_value::<seal::Enc>(enc_v.clone()) else {
        return Ok(Err("undecryptable body".into()));
    };
    // The current enc key, then keys this host rotated away from (`wire.md` §2.10).
    let Ok(plain) = ident.open_sealed(&enc, &id) else {
        return Ok(Err("undecryptable body".into()));
    };
    // Dedup by id, but only against the same sender: a peer that learned an id (as a
    // co-recipient) must not be able to suppress another host's message by sending first.
    match messages::origin_of(conn, &id)? {
        Some(origin) if origin == via.host => return Ok(Ok(Verdict::Duplicate)),
        Some(origin) => return Ok(Err(format!("conflicting id: already stored from {origin}"))),
        None => {}
    }
    let route::Arrival {
        deliver: recipients,
        hold,
    } = route::receive_recipients(conn, ident.host.as_str(), env)?;
    // Mail that names no agent of this host would be stored where no inbox shows it: refuse
    // it instead, where the sender and the owner see it (spec §4: never dropped silently).
    // A broadcast or role address is the exception: it reaches every matching mailbox here,
    // and none matching is a complete delivery, stored (for dedup) with no deliveries. Direct
    // mail for a name this host does not have is neither: it is stored and held as unclaimed
    // (listed by `inbox --unclaimed` and doctor) until that agent registers here.
    if recipients.is_empty() && hold.is_empty() && !is_broadcast(env) {
        return Ok(Err(format!("no recipient on this host ({})", ident.host)));
    }
    let mut stored = env.clone();
    if let Value::Object(map) = &mut stored {
        map.insert("body".into(), Value::String(plain));
    }
    messages::insert(conn, &stored, &via.host, now_ms)?;
    for name in &recipients {
        messages::deliver(conn, &id, name, now_ms)?;
    }
    // No delivery, so no `delivered` receipt: nobody has it yet.
    for name in &hold {
        unclaimed::hold(conn, &id, name, now_ms)?;
    }
    // The sender joins the directory under its host (`wire.md` §4 receive), so a bare-name
    // reply finds its way back.
    conn.execute(
        "INSERT INTO agents(name, host, last_seen) VALUES (?1, ?2, ?3)
         ON CONFLICT(name, host) DO UPDATE SET last_seen = MAX(last_seen, excluded.last_seen)",
        rusqlite::params![sender_name, via.host, now_ms],
    )?;
    let delivered = recipients;
    Ok(Ok(Verdict::Stored { delivered }))
}

/// Whether the envelope's `to` holds a broadcast (`*`) or role (`role:R`) address.
fn is_broadcast(env: &Value) -> bool {
    env.get("to")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .any(|t| t == "*" || t.starts_with("role:"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{self, T0};

    #[test]
    fn mail_for_no_agent_here_and_id_collisions_are_refused() {
        let store = testutil::store();
        let me = testutil::identity("home");
        let peer = testutil::identity("work");
        let other = testutil::identity("lab");
        store.add_peer(&peer, true);
        store.add_peer(&other, true);
        store.register("home", &["bob"]);
        let my_enc = me.enc_key.public();
        let id = "01KDVDND1K20BQNR5GAFG5HETT";
        let pk = |i: &Identity| i.host_key.public().to_b64();

        // Addressed to another host only: nobody here would ever see it.
        let wire =
            testutil::sealed_wire(&peer, &my_enc, id, "ann@work", &["bob@elsewhere"], "s", T0);
        let v = store
            .mailbox
            .with(|c| receive_sealed(c, &me, &wire, id, &pk(&peer), T0))
            .unwrap();
        assert_eq!(v, Err("no recipient on this host (home)".into()));
        assert_eq!(store.scalar::<i64>("SELECT COUNT(*) FROM messages"), 0);

        // Stored from work; the same id again from work is a duplicate.
        let wire = testutil::sealed_wire(&peer, &my_enc, id, "ann@work", &["bob@home"], "s", T0);
        let v = store
            .mailbox
            .with(|c| receive_sealed(c, &me, &wire, id, &pk(&peer), T0))
            .unwrap();
        assert_eq!(
            v,
            Ok(Verdict::Stored {
                delivered: vec!["bob".into()]
            })
        );
        let v = store
            .mailbox
            .with(|c| receive_sealed(c, &me, &wire, id, &pk(&peer), T0))
            .unwrap();
        assert_eq!(v, Ok(Verdict::Duplicate));

        // Another paired host reusing that id cannot pass as a duplicate (and is not stored).
        let wire = testutil::sealed_wire(&other, &my_enc, id, "eve@lab", &["bob@home"], "s", T0);
        let v = store
            .mailbox
            .with(|c| receive_sealed(c, &me, &wire, id, &pk(&other), T0))
            .unwrap();
        assert_eq!(v, Err("conflicting id: already stored from work".into()));
        assert_eq!(store.scalar::<i64>("SELECT COUNT(*) FROM messages"), 1);
        assert_eq!(
            store.scalar::<String>("SELECT from_addr FROM messages"),
            "ann@work"
        );
    }

    /// Issue 17 (3): direct mail for a name with no mailbox here is stored and held, not
    /// delivered and not refused, with no receipt; a repeat is a duplicate; a known name in the
    /// same message is delivered as before.
    #[test]
    fn direct_mail_for_a_name_this_host_does_not_have_is_held_without_a_receipt() {
        let store = testutil::store();
        let me = testutil::identity("home");
        let peer = testutil::identity("work");
        store.add_peer(&peer, true);
        store
            .mailbox
            .with(|c| crate::mailbox::agents::register(c, "home", "bob", None, None, T0))
            .unwrap();
        let pk = peer.host_key.public().to_b64();
        let id = "01KDVDND1K20BQNR5GAFG5HETW";
        let wire = testutil::sealed_wire(
            &peer,
            &me.enc_key.public(),
            id,
            "ann@work",
            &["nobody@home", "bob@home", "nobody@home"],
            "s",
            T0,
        );
        let v = store
            .mailbox
            .with(|c| receive_sealed(c, &me, &wire, id, &pk, T0))
            .unwrap();
        assert_eq!(
            v,
            Ok(Verdict::Stored {
                delivered: vec!["bob".into()]
            })
        );
        assert_eq!(
            store.scalar::<String>("SELECT group_concat(agent) FROM deliveries"),
            "bob"
        );
        assert_eq!(
            store.scalar::<String>("SELECT name FROM unclaimed"),
            "nobody"
        );
        assert_eq!(
            store.scalar::<String>("SELECT group_concat(agent) FROM receipt_outbox"),
            "bob",
            "no receipt for the held name"
        );
        // Mail only for unclaimed names is stored (held), not quarantined.
        let id2 = "01KDVDND1K20BQNR5GAFG5HETX";
        let wire = testutil::sealed_wire(
            &peer,
            &me.enc_key.public(),
            id2,
            "ann@work",
            &["nobody@home"],
            "s",
            T0,
        );
        let v = store
            .mailbox
            .with(|c| receive_sealed(c, &me, &wire, id2, &pk, T0))
            .unwrap();
        assert_eq!(v, Ok(Verdict::Stored { delivered: vec![] }));
        let v = store
            .mailbox
            .with(|c| receive_sealed(c, &me, &wire, id2, &pk, T0))
            .unwrap();
        assert_eq!(v, Ok(Verdict::Duplicate));
        assert_eq!(store.scalar::<i64>("SELECT COUNT(*) FROM unclaimed"), 2);
        assert_eq!(
            store.scalar::<i64>("SELECT COUNT(*) FROM receipt_outbox"),
            1
        );
    }

    #[test]
    fn a_broadcast_matching_no_mailbox_here_is_stored_without_deliveries_and_the_sender_is_known() {
        let store = testutil::store();
        let me = testutil::identity("home");
        let peer = testutil::identity("work");
        store.add_peer(&peer, true);
        let id = "01KDVDND1K20BQNR5GAFG5HETV";
        let wire = testutil::sealed_wire(
            &peer,
            &me.enc_key.public(),
            id,
            "ann@work",
            &["*"],
            "all",
            T0,
        );
        let pk = peer.host_key.public().to_b64();
        let v = store
            .mailbox
            .with(|c| receive_sealed(c, &me, &wire, id, &pk, T0))
            .unwrap();
        assert_eq!(v, Ok(Verdict::Stored { delivered: vec![] }));
        assert_eq!(store.scalar::<i64>("SELECT COUNT(*) FROM messages"), 1);
        assert_eq!(store.scalar::<i64>("SELECT COUNT(*) FROM deliveries"), 0);
        assert_eq!(
            store.scalar::<String>("SELECT name || '@' || host FROM agents"),
            "ann@work"
        );
    }

    #[test]
    fn a_retired_key_signs_mail_only_up_to_15_days_after_the_rotation() {
        let store = testutil::store();
        let me = testutil::identity("home");
        let old = testutil::identity("work");
        let new = testutil::identity("work");
        store.add_peer(&old, true);
        store.register("home", &["bob"]);
        let pk = |i: &Identity| i.host_key.public().to_b64();
        // work rotated at T0 (the record's iat); this host accepted it a minute later.
        store
            .mailbox
            .with(|c| {
                peers::rotate(
                    c,
                    "work",
                    &pk(&old),
                    &pk(&new),
                    &new.enc_key.public().to_b64(),
                    Some(T0),
                    T0 + 60_000,
                )
            })
            .unwrap()
            .unwrap();
        let mut ids = testutil::ids();
        let my_enc = me.enc_key.public();
        let last_ok = T0 + peers::RETIRED_KEY_GRACE_MS;
        let now = last_ok + 1_000;
        let mut got = |signer: &Identity, ts: i64| {
            let id = ids.next(ts);
            let wire =
                testutil::sealed_wire(signer, &my_enc, &id, "ann@work", &["bob@home"], "s", ts);
            let sender = pk(signer);
            store
                .mailbox
                .with(|c| receive_sealed(c, &me, &wire, &id, &sender, now))
                .unwrap()
        };
        // Signed by the retired key before the rotation, and up to the end of the grace.
        let stored = Ok(Verdict::Stored {
            delivered: vec!["bob".into()],
        });
        assert_eq!(got(&old, T0 - 1), stored);
        assert_eq!(got(&old, last_ok), stored);
        // Dated past it: refused, saying why, and nothing stored.
        assert_eq!(
            got(&old, last_ok + 1),
            Err(format!(
                "signed by a key work retired at {}: not valid for mail dated after {}",
                agentmbx_protocol::time::iso_ms(T0),
                agentmbx_protocol::time::iso_ms(last_ok)
            ))
        );
        assert_eq!(store.scalar::<i64>("SELECT COUNT(*) FROM messages"), 2);
        // The pinned key has no such bound.
        assert_eq!(got(&new, last_ok + 1), stored);
        // A key work never held is no signer of its mail at all.
        let stranger = testutil::identity("work");
        let id = ids.next(T0);
        let wire =
            testutil::sealed_wire(&stranger, &my_enc, &id, "ann@work", &["bob@home"], "s", T0);
        let via = store
            .mailbox
            .with(|c| peers::by_name(c, "work"))
            .unwrap()
            .unwrap();
        let env = canonical::parse(&wire).unwrap();
        assert_eq!(
            store
                .mailbox
                .with(|c| receive(c, &me, &env, &via, now))
                .unwrap(),
            Err("bad signature".into())
        );
    }
}
