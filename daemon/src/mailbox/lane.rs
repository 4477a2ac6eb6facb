//! The LAN-or-relay rule (spec §10; design README "Data flow"), defined once: which transport
//! takes a due outbox row or queued receipt. The LAN first, the relay after
//! [`LAN_FAILURES_BEFORE_RELAY`] failed LAN attempts, when the peer has no LAN address, or while
//! the peer is marked "LAN down" (`peers.lan_down_since`, [`super::lan_memory`]: the decision
//! that its address does not answer, kept per peer so every queued and new row and receipt for
//! it goes to the relay at once); with no relay configured the LAN keeps every row whose peer
//! has an address.
//!
//! The rule has two forms, both written here from the same four facts and one threshold:
//! [`choose`] in Rust, and [`lan_takes_sql`] in SQL (over a `peers p` row and a LAN failure
//! column, binding `:t` = [`LAN_FAILURES_BEFORE_RELAY`] and `:r` = a relay is configured), which
//! the outbox ([`super::outbox::due_for_lan`], [`super::outbox::due_for_relay`]) and the
//! receipt queue ([`super::receipts::due_for_lan`], [`super::receipts::due_for_relay`]) select
//! by: with a relay configured, the relay queries take the negation of the LAN form
//! (`NOT COALESCE((…), 0)`) over the rows they join. The joins themselves are the queries' own:
//! the outbox's relay query also requires `p.pubkey = o.target_pubkey`, and the receipt queue's
//! relay query joins `peers`, so a receipt whose peer row is gone is taken by neither transport
//! (where [`choose`] would say the relay). A test below evaluates the SQL form for every case of
//! the LAN rule and checks it against [`choose`]; `crate::transport::select`'s tests run the
//! outbox's real queries against it. The transports read the rule through `crate::transport::select`, which
//! re-exports it.
//!
//! This module owns no table and never does I/O; it must never import a transport.

/// Failed LAN attempts after which a row (or receipt) moves to the relay (spec §10: "at least
/// twice").
pub const LAN_FAILURES_BEFORE_RELAY: u32 = 2;

/// The transports a row can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// A signed hop to the peer's LAN address (`wire.md` §4).
    Lan,
    /// A push to the relay (`wire.md` §3.5).
    Relay,
}

/// What selection needs to know about one due-or-waiting row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    /// Failed LAN attempts since the peer was last heard from.
    pub lan_failures: u32,
    /// The peer has a pinned LAN address (`peers.addr`): [`LAN_PEER_SQL`].
    pub has_addr: bool,
    /// The peer is marked "LAN down" (`peers.lan_down_since` set, [`super::lan_memory`]).
    pub lan_down: bool,
    /// A relay is configured on this host (`:r` in [`lan_takes_sql`]).
    pub relay_configured: bool,
}

/// The transport that takes a row with these facts when it is due, or `None` when no
/// transport can take it now (no LAN address and no relay: it waits for an address).
/// [`lan_takes_sql`] is the same rule in SQL.
pub fn choose(f: Facts) -> Option<Transport> {
    if !f.relay_configured {
        return f.has_addr.then_some(Transport::Lan);
    }
    if f.has_addr && !f.lan_down && f.lan_failures < LAN_FAILURES_BEFORE_RELAY {
        Some(Transport::Lan)
    } else {
        Some(Transport::Relay)
    }
}

/// "The peer has a LAN address" ([`Facts::has_addr`]) in SQL over a joined `peers p` row: the
/// peer is pinned and has a non-empty `addr`.
pub const LAN_PEER_SQL: &str = "p.pubkey IS NOT NULL AND p.addr IS NOT NULL AND p.addr <> ''";

/// "The LAN takes it" ([`choose`] = `Some(Lan)`) in SQL, over a joined `peers p` row and the
/// LAN failure count column `lan_failures` (e.g. `o.lan_failures`): [`LAN_PEER_SQL`], and fewer
/// than `:t` ([`LAN_FAILURES_BEFORE_RELAY`]) LAN failures with the peer not marked LAN down
/// (`p.lan_down_since IS NULL`), unless no relay is configured (`:r` false). With a relay
/// configured, `NOT COALESCE((this), 0)` is "the relay takes it".
pub fn lan_takes_sql(lan_failures: &str) -> String {
    format!("{LAN_PEER_SQL} AND (({lan_failures} < :t AND p.lan_down_since IS NULL) OR NOT :r)")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-peer mark sends every row to the relay whatever its own LAN failures, and only
    /// with a relay configured (without one the LAN keeps trying the address).
    #[test]
    fn a_peer_marked_lan_down_goes_to_the_relay() {
        let f = |lan_failures, lan_down, relay_configured| Facts {
            lan_failures,
            has_addr: true,
            lan_down,
            relay_configured,
        };
        assert_eq!(choose(f(0, true, true)), Some(Transport::Relay));
        assert_eq!(choose(f(0, false, true)), Some(Transport::Lan));
        assert_eq!(choose(f(0, true, false)), Some(Transport::Lan));
        assert_eq!(choose(f(3, true, false)), Some(Transport::Lan));
    }

    /// The SQL form and [`choose`] agree on every case of the rule: LAN failures around the
    /// threshold, a peer with an address, with an empty one, without one or not pinned, marked
    /// LAN down or not, and a relay configured or not.
    #[test]
    fn the_sql_form_agrees_with_choose() {
        let c = rusqlite::Connection::open_in_memory().unwrap();
        c.execute_batch("CREATE TABLE peers(pubkey TEXT, addr TEXT, lan_down_since INTEGER)")
            .unwrap();
        let peers: [(Option<&str>, Option<&str>, bool); 4] = [
            (Some("k"), Some("127.0.0.1:1"), true),
            (Some("k"), Some(""), false),
            (Some("k"), None, false),
            (None, Some("127.0.0.1:1"), false),
        ];
        let lan = format!("SELECT COALESCE(({}), 0) FROM peers p", lan_takes_sql(":f"));
        let relay = format!(
            "SELECT NOT COALESCE(({}), 0) FROM peers p",
            lan_takes_sql(":f")
        );
        for ((pubkey, addr, has_addr), lan_down) in
            peers.iter().flat_map(|p| [(*p, false), (*p, true)])
        {
            c.execute("DELETE FROM peers", []).unwrap();
            c.execute(
                "INSERT INTO peers VALUES (?1, ?2, ?3)",
                rusqlite::params![pubkey, addr, lan_down.then_some(7i64)],
            )
            .unwrap();
            for lan_failures in 0..=LAN_FAILURES_BEFORE_RELAY + 2 {
                for relay_configured in [true, false] {
                    let ask = |sql: &str| -> bool {
                        c.query_row(
                            sql,
                            rusqlite::named_params! {
                                ":f": lan_failures,
                                ":t": LAN_FAILURES_BEFORE_RELAY,
                                ":r": relay_configured,
                            },
                            |r| r.get(0),
                        )
                        .unwrap()
                    };
                    let want = choose(Facts {
                        lan_failures,
                        has_addr,
                        lan_down,
                        relay_configured,
                    });
                    let case =
                        format!("{pubkey:?} {addr:?} {lan_down} {lan_failures} {relay_configured}");
                    assert_eq!(ask(&lan), want == Some(Transport::Lan), "lan {case}");
                    if relay_configured {
                        assert_eq!(ask(&relay), want == Some(Transport::Relay), "relay {case}");
                    }
                }
            }
        }
    }
}
