//! Transport selection (spec §10; design README "Data flow"): which transport takes a due
//! outbox row or receipt — the LAN first, the relay after two failed LAN attempts.
//!
//! The rule, in one place ([`choose`]), for a `pending` row and for a `repush` row alike (a row
//! a relay accepted and must be pushed again after a new epoch or a rewind, spec §5: it may go
//! over the LAN when the peer is reachable; a `relay-accepted` row is the relay's and no
//! transport sends it):
//! - with no relay configured, the LAN takes it whenever the peer has a LAN address;
//! - otherwise the LAN takes it while `lan_failures <` [`LAN_FAILURES_BEFORE_RELAY`] and the
//!   peer has a LAN address, and the relay takes it once the LAN failed twice or when the peer
//!   has no LAN address;
//! - either way only when due (`next_at ≤ now`): the backoff of a row is respected by both.
//!
//! The decision is also kept per peer (`crate::mailbox::lan_memory`): once the peer's LAN
//! address is found not answering (two failed attempts, or unreachable: refused, or no answer
//! within the LAN race of `crate::transport::lan::deliver`), every queued and new row and receipt
//! for it goes to the relay at once, until a probe (or an address proven by its signed status)
//! finds the address answering again. The per-row count below still applies while the peer is
//! not marked.
//!
//! A verified LAN hop from a peer that is not marked brings `lan_failures` of its waiting rows
//! back below the threshold (`outbox::peer_is_back`), so new and waiting rows go over the LAN
//! again; a row whose LAN attempt then fails once more goes back to the relay (one LAN try per
//! sign of life, so a peer that reaches us while we cannot reach it never keeps mail off the
//! relay). For a marked peer a hop only brings the probe of its address forward
//! (`crate::mailbox::lan_memory::alive`); the mark holds until the address answers.
//!
//! Spec §10 moves a row to the relay only once "the target is enrolled". A relay refusal that
//! shows it is not ([`relay_cannot_reach`]: `rejected:target not enrolled`), or a relay with no
//! usable enc-key ad for the peer, hands the row back the same way (`outbox::back_to_lan`):
//! when the peer has a LAN address its `lan_failures` drops to one below the threshold, so the
//! LAN takes the next attempt (after the row's backoff, which both transports grow), and a LAN
//! failure then gives it to the relay again. Without a LAN address the row stays with the relay.
//!
//! Whichever transport holds a row, or none (no LAN address and no relay: [`choose`] gives
//! `None`), a `pending` row no relay ever accepted ends `undelivered` with an alert after 72 h
//! (`mailbox::outbox`, `wire.md` §4 "Outbox client"); the LAN delivery pass sweeps for them. A
//! `repush` row never ends by that rule: its delivery receipt, a LAN verdict or its deadline
//! (`unconfirmed`, `crate::node::settle`) does.
//!
//! The rule is defined once, below both the store and the transports, in
//! [`crate::mailbox::lane`] ([`choose`] and its SQL form, with a test that they agree on every
//! case); this module re-exports it for the transports and adds the relay's hand-back
//! ([`relay_cannot_reach`]). The SQL of `mailbox::outbox::due_for_lan` / `due_for_relay` (and
//! the receipt queries in `mailbox::receipts`) is built from that form; a test below checks
//! that the outbox queries and [`choose`] agree on every combination. This module never does I/O.

pub use crate::mailbox::lane::{choose, Facts, Transport, LAN_FAILURES_BEFORE_RELAY};

/// The relay's refusal of an envelope item that means the target host is not enrolled there.
pub const TARGET_NOT_ENROLLED: &str = "target not enrolled";

/// Whether a relay push result (`rejected:<why>`, or `<why>`) shows the relay cannot reach the
/// target (spec §10: "and the target is enrolled"), so the row goes back to the LAN when the
/// peer has a LAN address.
pub fn relay_cannot_reach(result: &str) -> bool {
    result.strip_prefix("rejected:").unwrap_or(result) == TARGET_NOT_ENROLLED
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mailbox::outbox;
    use crate::testutil::{self, T0};

    #[test]
    fn the_rule() {
        let f = |lan_failures, has_addr, relay_configured| Facts {
            lan_failures,
            has_addr,
            lan_down: false,
            relay_configured,
        };
        use Transport::*;
        assert_eq!(choose(f(0, true, true)), Some(Lan));
        assert_eq!(choose(f(1, true, true)), Some(Lan));
        assert_eq!(choose(f(2, true, true)), Some(Relay));
        assert_eq!(choose(f(0, false, true)), Some(Relay));
        assert_eq!(choose(f(5, true, false)), Some(Lan));
        assert_eq!(choose(f(0, false, false)), None);
    }

    #[test]
    fn only_target_not_enrolled_hands_a_row_back() {
        assert!(relay_cannot_reach("rejected:target not enrolled"));
        assert!(relay_cannot_reach("target not enrolled"));
        assert!(!relay_cannot_reach("rejected:quota:target queue full"));
        assert!(!relay_cannot_reach("rejected:conflict"));
        assert!(!relay_cannot_reach("missing result"));
    }

    /// The outbox queries take exactly the rows [`choose`] assigns to each transport, for every
    /// combination of facts, `pending` and `repush` rows alike, only due rows, and never a row
    /// a relay holds (`relay-accepted`).
    #[test]
    fn the_queries_agree_with_the_rule() {
        let s = testutil::store();
        let me = testutil::identity("home");
        let with_addr = testutil::identity("work");
        let without = testutil::identity("lab");
        s.add_peer(&with_addr, true);
        s.add_peer(&without, true);
        s.mailbox
            .with(|c| {
                c.execute(
                    "UPDATE peers SET addr = '127.0.0.1:1' WHERE host = 'work'",
                    [],
                )?;
                Ok(())
            })
            .unwrap();
        let mut gen = testutil::ids();
        let mut cases = Vec::new();
        for lan_failures in 0..=3u32 {
            for host in ["work", "lab"] {
                for state in ["pending", "repush", "relay-accepted"] {
                    for due in [true, false] {
                        let id = gen.next(T0);
                        s.send(&me, "alice", &[&format!("bob@{host}")], "s", &id, T0)
                            .unwrap();
                        // A row not due waits within the backoff of its failed attempts.
                        let next_at = if due { T0 } else { T0 + 1 };
                        let attempts = lan_failures.max(1);
                        s.mailbox
                            .with(|c| {
                                c.execute(
                                    "UPDATE outbox SET lan_failures = ?2, next_at = ?3, state = ?4,
                                       accepted_at = CASE WHEN ?4 <> 'pending' THEN ?3 END,
                                       attempts = ?5
                                     WHERE msg_id = ?1",
                                    rusqlite::params![id, lan_failures, next_at, state, attempts],
                                )?;
                                Ok(())
                            })
                            .unwrap();
                        cases.push((id, lan_failures, host == "work", state, due));
                    }
                }
            }
        }
        for relay_configured in [true, false] {
            let (lan, relay) = s
                .mailbox
                .with(|c| {
                    let ids = |rows: Vec<outbox::Row>| {
                        rows.into_iter().map(|r| r.msg_id).collect::<Vec<_>>()
                    };
                    Ok((
                        ids(outbox::due_for_lan(c, T0, 1000, relay_configured)?),
                        ids(outbox::due_for_relay(c, T0, 1000)?),
                    ))
                })
                .unwrap();
            for (id, lan_failures, has_addr, state, due) in &cases {
                let want = choose(Facts {
                    lan_failures: *lan_failures,
                    has_addr: *has_addr,
                    lan_down: false,
                    relay_configured,
                })
                .filter(|_| *due && *state != "relay-accepted");
                assert_eq!(lan.contains(id), want == Some(Transport::Lan), "{id} lan");
                if relay_configured {
                    assert_eq!(
                        relay.contains(id),
                        want == Some(Transport::Relay),
                        "{id} relay"
                    );
                }
            }
        }
    }
}
