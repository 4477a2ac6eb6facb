//! `mailbox.db` schema and migrations, driven by `PRAGMA user_version`.

use rusqlite::Connection;

use super::MailboxError;

/// The schema version this binary writes.
pub const SCHEMA_VERSION: u32 = 13;

/// Migrations in order: `(version reached, SQL)`. A new schema change appends a step; each
/// step runs inside the one migration transaction.
const MIGRATIONS: &[(u32, &str)] = &[
    (
        1,
        r#"
CREATE TABLE kv(k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE messages(
  id TEXT PRIMARY KEY, ts TEXT NOT NULL, from_addr TEXT NOT NULL, thread TEXT NOT NULL,
  reply_to TEXT, kind TEXT NOT NULL, subject TEXT NOT NULL, body TEXT NOT NULL,
  envelope TEXT NOT NULL, origin TEXT NOT NULL, received_at INTEGER NOT NULL);
CREATE TABLE deliveries(
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  msg_id TEXT NOT NULL REFERENCES messages(id), agent TEXT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('new','read','acked')),
  updated_at INTEGER NOT NULL, note TEXT, UNIQUE(msg_id, agent));
CREATE INDEX deliveries_agent ON deliveries(agent, seq);
CREATE TABLE peers(
  host TEXT PRIMARY KEY, pubkey TEXT NOT NULL UNIQUE, enc_pub TEXT, enc_ad_iat INTEGER,
  added_at INTEGER NOT NULL);
CREATE TABLE outbox(
  msg_id TEXT NOT NULL REFERENCES messages(id), host TEXT NOT NULL, target_pubkey TEXT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('pending','relay-accepted','rejected','delivered')),
  attempts INTEGER NOT NULL DEFAULT 0, next_at INTEGER NOT NULL, last_error TEXT,
  created_at INTEGER NOT NULL,
  wire BLOB, wire_hash TEXT,
  relay TEXT, epoch TEXT, seq INTEGER, accept TEXT, accept_sig TEXT, accepted_at INTEGER,
  deadline_at INTEGER, settled_at INTEGER,
  PRIMARY KEY(msg_id, host));
CREATE INDEX outbox_due ON outbox(state, next_at);
CREATE TABLE relay_position(
  relay TEXT PRIMARY KEY, epoch TEXT NOT NULL, received_through INTEGER NOT NULL,
  acked_through INTEGER NOT NULL DEFAULT 0, updated_at INTEGER NOT NULL);
CREATE TABLE quarantine(
  id INTEGER PRIMARY KEY AUTOINCREMENT, relay TEXT NOT NULL, epoch TEXT NOT NULL,
  seq INTEGER NOT NULL, kind TEXT NOT NULL, item_id TEXT NOT NULL, sender_pubkey TEXT NOT NULL,
  reason TEXT NOT NULL, wire BLOB NOT NULL, at INTEGER NOT NULL, UNIQUE(relay, epoch, seq));
CREATE TABLE idempotency(
  key TEXT NOT NULL, scope TEXT NOT NULL, request_hash TEXT NOT NULL, status INTEGER NOT NULL,
  response TEXT NOT NULL, created_at INTEGER NOT NULL, PRIMARY KEY(scope, key));
"#,
    ),
    (
        2,
        r#"
-- LAN transport (wire.md §2.7, §2.9, §4): a peer's pinned LAN address and what we last heard.
ALTER TABLE peers ADD COLUMN addr TEXT;
ALTER TABLE peers ADD COLUMN addr_source TEXT;
ALTER TABLE peers ADD COLUMN owner_pubkey TEXT;
ALTER TABLE peers ADD COLUMN last_seen_at INTEGER;
ALTER TABLE peers ADD COLUMN presence_seq INTEGER;
-- Pairing tokens (wire.md §2.9): key = hex of the scrypt-derived K; failures burn at 5.
CREATE TABLE pair_tokens(
  id TEXT PRIMARY KEY, key TEXT NOT NULL, created_at INTEGER NOT NULL,
  expires_at INTEGER NOT NULL, failures INTEGER NOT NULL DEFAULT 0,
  state TEXT NOT NULL CHECK (state IN ('live','used','burned')), used_by TEXT);
-- Pending SAS comparisons (wire.md §2.9, Decision 10: they expire).
CREATE TABLE pair_pending(
  host TEXT PRIMARY KEY, pubkey TEXT NOT NULL, owner_pubkey TEXT, addr TEXT,
  nonce_local TEXT NOT NULL, nonce_remote TEXT NOT NULL, code TEXT NOT NULL,
  created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL);
-- Agent directory: local mailboxes (host = this host) and peers' agents (GET /v1/agents).
CREATE TABLE agents(
  name TEXT NOT NULL, host TEXT NOT NULL, role TEXT, description TEXT,
  last_seen INTEGER NOT NULL, PRIMARY KEY(name, host));
-- Receipts we owe senders (spec §9, wire.md §2.11): queued by the triggers below in the
-- transaction that changes the delivery; `wire` is the signed {rec, sig}, made once.
CREATE TABLE receipt_outbox(
  seq INTEGER PRIMARY KEY AUTOINCREMENT, msg_id TEXT NOT NULL, agent TEXT NOT NULL,
  host TEXT NOT NULL, state TEXT NOT NULL, note TEXT, at INTEGER NOT NULL,
  attempts INTEGER NOT NULL DEFAULT 0, lan_failures INTEGER NOT NULL DEFAULT 0,
  next_at INTEGER NOT NULL, last_error TEXT, wire BLOB, created_at INTEGER NOT NULL);
CREATE INDEX receipt_outbox_due ON receipt_outbox(next_at);
CREATE TRIGGER deliveries_receipt_insert AFTER INSERT ON deliveries
WHEN (SELECT origin FROM messages WHERE id = NEW.msg_id) <> 'local'
BEGIN
  INSERT INTO receipt_outbox(msg_id, agent, host, state, note, at, next_at, created_at)
  SELECT NEW.msg_id, NEW.agent, m.origin,
         CASE NEW.state WHEN 'new' THEN 'delivered' ELSE NEW.state END,
         NEW.note, NEW.updated_at, NEW.updated_at, NEW.updated_at
  FROM messages m WHERE m.id = NEW.msg_id;
END;
CREATE TRIGGER deliveries_receipt_update AFTER UPDATE OF state ON deliveries
WHEN NEW.state <> OLD.state AND (SELECT origin FROM messages WHERE id = NEW.msg_id) <> 'local'
BEGIN
  INSERT INTO receipt_outbox(msg_id, agent, host, state, note, at, next_at, created_at)
  SELECT NEW.msg_id, NEW.agent, m.origin,
         CASE NEW.state WHEN 'new' THEN 'delivered' ELSE NEW.state END,
         NEW.note, NEW.updated_at, NEW.updated_at, NEW.updated_at
  FROM messages m WHERE m.id = NEW.msg_id;
END;
-- Receipts recipients' hosts sent us, newest per (message, recipient) by state rank then seq.
CREATE TABLE remote_receipts(
  msg_id TEXT NOT NULL, recipient TEXT NOT NULL, host TEXT NOT NULL, state TEXT NOT NULL,
  at TEXT NOT NULL, note TEXT, did TEXT, seq INTEGER NOT NULL, record TEXT NOT NULL,
  sig TEXT NOT NULL, received_at INTEGER NOT NULL, PRIMARY KEY(msg_id, recipient));
-- Outbox: `lan_failures` drives transport selection (spec §10); `undelivered` ends a row the
-- LAN gave up on after 72 h (never one the relay accepted); `via` says which transport settled.
CREATE TABLE outbox_v2(
  msg_id TEXT NOT NULL REFERENCES messages(id), host TEXT NOT NULL, target_pubkey TEXT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('pending','relay-accepted','rejected','delivered','undelivered')),
  attempts INTEGER NOT NULL DEFAULT 0, lan_failures INTEGER NOT NULL DEFAULT 0,
  next_at INTEGER NOT NULL, last_error TEXT, created_at INTEGER NOT NULL,
  wire BLOB, wire_hash TEXT,
  relay TEXT, epoch TEXT, seq INTEGER, accept TEXT, accept_sig TEXT, accepted_at INTEGER,
  deadline_at INTEGER, settled_at INTEGER, via TEXT,
  PRIMARY KEY(msg_id, host));
INSERT INTO outbox_v2(msg_id, host, target_pubkey, state, attempts, lan_failures, next_at,
  last_error, created_at, wire, wire_hash, relay, epoch, seq, accept, accept_sig, accepted_at,
  deadline_at, settled_at, via)
SELECT msg_id, host, target_pubkey, state, attempts, 2, next_at, last_error, created_at, wire,
  wire_hash, relay, epoch, seq, accept, accept_sig, accepted_at, deadline_at, settled_at,
  CASE WHEN state = 'pending' THEN NULL ELSE 'relay' END
FROM outbox;
DROP TABLE outbox;
ALTER TABLE outbox_v2 RENAME TO outbox;
CREATE INDEX outbox_due ON outbox(state, next_at);
"#,
    ),
    (
        3,
        r#"
-- Keys a peer rotated away from (`wire.md` §2.10): JSON array of base64 host keys, oldest
-- first. They still verify that peer's mail signed before the rotation; never a hop.
ALTER TABLE peers ADD COLUMN prev_keys TEXT NOT NULL DEFAULT '[]';
-- Trust events the owner may need to see later (relay key changed or confirmed, enrolment lost,
-- rotation accepted or refused...): `detail` is JSON, never key material or tokens.
CREATE TABLE audit(
  id INTEGER PRIMARY KEY AUTOINCREMENT, at INTEGER NOT NULL, event TEXT NOT NULL,
  detail TEXT NOT NULL);
CREATE INDEX audit_event ON audit(event, id);
"#,
    ),
    (
        4,
        r#"
-- Durability (spec §5, §6; wire.md §3.5 "Epoch change / rewind", "Settle"): a row a relay
-- accepted that must be pushed again after a new epoch or a rewind is `repush` (it keeps its
-- accept time and deadline; the 72 h rule never ends it), a relay's signed expiry notice ends a
-- row `expired`, and a row with no delivery receipt by its deadline ends `unconfirmed`.
CREATE TABLE outbox_v4(
  msg_id TEXT NOT NULL REFERENCES messages(id), host TEXT NOT NULL, target_pubkey TEXT NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('pending','repush','relay-accepted','rejected','delivered',
    'undelivered','expired','unconfirmed')),
  attempts INTEGER NOT NULL DEFAULT 0, lan_failures INTEGER NOT NULL DEFAULT 0,
  next_at INTEGER NOT NULL, last_error TEXT, created_at INTEGER NOT NULL,
  wire BLOB, wire_hash TEXT,
  relay TEXT, epoch TEXT, seq INTEGER, accept TEXT, accept_sig TEXT, accepted_at INTEGER,
  deadline_at INTEGER, settled_at INTEGER, via TEXT,
  PRIMARY KEY(msg_id, host));
-- A `pending` row with an accept time was a re-push under schema 3: it is `repush` now.
INSERT INTO outbox_v4(msg_id, host, target_pubkey, state, attempts, lan_failures, next_at,
  last_error, created_at, wire, wire_hash, relay, epoch, seq, accept, accept_sig, accepted_at,
  deadline_at, settled_at, via)
SELECT msg_id, host, target_pubkey,
  CASE WHEN state = 'pending' AND accepted_at IS NOT NULL THEN 'repush' ELSE state END,
  attempts, lan_failures, next_at, last_error, created_at, wire, wire_hash, relay, epoch, seq,
  accept, accept_sig, accepted_at, deadline_at, settled_at, via
FROM outbox;
DROP TABLE outbox;
ALTER TABLE outbox_v4 RENAME TO outbox;
CREATE INDEX outbox_due ON outbox(state, next_at);
CREATE INDEX outbox_deadline ON outbox(state, deadline_at);
"#,
    ),
    (
        5,
        r#"
-- Quarantined envelopes and receipts are received again whenever what refused them may have
-- changed, whatever reason was recorded (`wire.md` §3.5): `retry` = 1 marks an item for the
-- next pass; a retry that is refused again records its reason and clears it. `claimed_host` is
-- the host the item's wire names (an envelope's `sig.host`, a receipt's recipient host).
ALTER TABLE quarantine ADD COLUMN claimed_host TEXT;
ALTER TABLE quarantine ADD COLUMN retry INTEGER NOT NULL DEFAULT 0;
-- Items quarantined before this version are tried once more: their peers may have changed.
UPDATE quarantine SET retry = 1 WHERE kind IN ('envelope', 'receipt');
CREATE INDEX quarantine_retry ON quarantine(relay, id) WHERE retry = 1;
-- Any change to a pin (paired, pinned, unpaired, renamed, rotated: in every path that writes
-- `peers`, in the writer's transaction) marks every quarantined envelope and receipt whose
-- pushing key or claimed host it touches: the old and the new name, the old and the new key
-- and the keys the peer retired.
CREATE TRIGGER peers_quarantine_insert AFTER INSERT ON peers
BEGIN
  UPDATE quarantine SET retry = 1
  WHERE retry = 0 AND kind IN ('envelope', 'receipt')
    AND (sender_pubkey = NEW.pubkey OR claimed_host = NEW.host
         OR sender_pubkey IN (SELECT CASE r.type WHEN 'text' THEN r.value
                                      WHEN 'object' THEN json_extract(r.value, '$.key') END
                              FROM json_each(NEW.prev_keys) AS r));
END;
CREATE TRIGGER peers_quarantine_delete AFTER DELETE ON peers
BEGIN
  UPDATE quarantine SET retry = 1
  WHERE retry = 0 AND kind IN ('envelope', 'receipt')
    AND (sender_pubkey = OLD.pubkey OR claimed_host = OLD.host
         OR sender_pubkey IN (SELECT CASE r.type WHEN 'text' THEN r.value
                                      WHEN 'object' THEN json_extract(r.value, '$.key') END
                              FROM json_each(OLD.prev_keys) AS r));
END;
CREATE TRIGGER peers_quarantine_update AFTER UPDATE OF host, pubkey, prev_keys ON peers
WHEN OLD.host IS NOT NEW.host OR OLD.pubkey IS NOT NEW.pubkey OR OLD.prev_keys IS NOT NEW.prev_keys
BEGIN
  UPDATE quarantine SET retry = 1
  WHERE retry = 0 AND kind IN ('envelope', 'receipt')
    AND (sender_pubkey IN (OLD.pubkey, NEW.pubkey) OR claimed_host IN (OLD.host, NEW.host)
         OR sender_pubkey IN (SELECT CASE r.type WHEN 'text' THEN r.value
                                      WHEN 'object' THEN json_extract(r.value, '$.key') END
                              FROM json_each(NEW.prev_keys) AS r)
         OR sender_pubkey IN (SELECT CASE r.type WHEN 'text' THEN r.value
                                      WHEN 'object' THEN json_extract(r.value, '$.key') END
                              FROM json_each(OLD.prev_keys) AS r));
END;
"#,
    ),
    (
        6,
        r#"
-- When this host last stored a peer's agent directory (`GET /v1/agents`, ms; NULL: never), so
-- "fetched and lists no such agent" can be told from "not fetched yet" (issue 17, point 3):
-- rows of a peer in `agents` also come from mail it sent, not only from its directory.
ALTER TABLE peers ADD COLUMN directory_at INTEGER;
-- Direct mail (`name@<this host>`) for a name with no local mailbox here: stored, not
-- delivered, and no `delivered` receipt, until an agent of that name registers (or sends) on
-- this host, which turns each row into a delivery in the same transaction.
CREATE TABLE unclaimed(
  msg_id TEXT NOT NULL REFERENCES messages(id), name TEXT NOT NULL, since INTEGER NOT NULL,
  PRIMARY KEY(msg_id, name));
CREATE INDEX unclaimed_name ON unclaimed(name, since);
"#,
    ),
    (
        7,
        r#"
-- When a live consumer took a delivery that was still `new` (ms; NULL: never): a long poll
-- (`GET /v1/inbox?wait=`) returned it (spec §9 `notified`, issue 18). Mail from a peer owes its
-- sender a `notified` receipt then, queued in the same transaction.
ALTER TABLE deliveries ADD COLUMN notified_at INTEGER;
CREATE TRIGGER deliveries_receipt_notified AFTER UPDATE OF notified_at ON deliveries
WHEN OLD.notified_at IS NULL AND NEW.notified_at IS NOT NULL AND NEW.state = 'new'
  AND (SELECT origin FROM messages WHERE id = NEW.msg_id) <> 'local'
BEGIN
  INSERT INTO receipt_outbox(msg_id, agent, host, state, note, at, next_at, created_at)
  SELECT NEW.msg_id, NEW.agent, m.origin, 'notified', NULL, NEW.notified_at,
         NEW.notified_at, NEW.notified_at
  FROM messages m WHERE m.id = NEW.msg_id;
END;
"#,
    ),
    (
        8,
        r#"
-- The wake brake (wire.md §4, issue 18 "Wake for Claude Code"; mailbox::brake): one row per
-- thread of each wake of an agent (`wake` numbers the wake), and each message a session
-- claimed a wake for, once per agent, with what came of it (NULL: pending, carried into the
-- next wake; 'woke', 'not-worthy', 'muted', 'thread-cap', 'daily-cap').
CREATE TABLE wakes(
  wake INTEGER NOT NULL, agent TEXT NOT NULL, thread TEXT NOT NULL, at INTEGER NOT NULL,
  PRIMARY KEY(wake, thread));
CREATE INDEX wakes_agent ON wakes(agent, at);
CREATE TABLE wake_claims(
  agent TEXT NOT NULL, msg_id TEXT NOT NULL, thread TEXT NOT NULL, at INTEGER NOT NULL,
  outcome TEXT, PRIMARY KEY(agent, msg_id));
CREATE INDEX wake_claims_pending ON wake_claims(agent, outcome, at);
"#,
    ),
    (
        9,
        r#"
-- Each agent's catchup position (`GET /v1/catchup`, 0.5.x `mbx_catchup`): the delivery seq up
-- to which it has caught up. Moved forward only by a commit; a restart sets it (to 0 or the
-- newest). No row: the beginning.
CREATE TABLE catchup(
  agent TEXT PRIMARY KEY, seq INTEGER NOT NULL, updated_at INTEGER NOT NULL);
"#,
    ),
    (
        10,
        r#"
-- Full-text search over subject and body (issue 19 "Search"; mailbox::search): an FTS5 table
-- with its own copy of each stored message's plaintext subject and body, keyed by `msg_id`
-- (not by the messages table's implicit rowid, which a VACUUM may renumber). The triggers keep
-- it in step inside the transaction that writes the message, whatever path writes it (a local
-- send, LAN or relay receive, an alert); which agent may see a row is decided at query time by
-- its deliveries (and its sender), so mail held as unclaimed becomes searchable by the agent it
-- is delivered to when it is. Mail stored before this version is indexed here.
CREATE VIRTUAL TABLE message_search USING fts5(
  msg_id UNINDEXED, subject, body, tokenize = 'unicode61 remove_diacritics 2');
INSERT INTO message_search(msg_id, subject, body) SELECT id, subject, body FROM messages;
CREATE TRIGGER messages_search_insert AFTER INSERT ON messages
BEGIN
  INSERT INTO message_search(msg_id, subject, body) VALUES (NEW.id, NEW.subject, NEW.body);
END;
CREATE TRIGGER messages_search_update AFTER UPDATE OF subject, body ON messages
BEGIN
  DELETE FROM message_search WHERE msg_id = OLD.id;
  INSERT INTO message_search(msg_id, subject, body) VALUES (NEW.id, NEW.subject, NEW.body);
END;
CREATE TRIGGER messages_search_delete AFTER DELETE ON messages
BEGIN
  DELETE FROM message_search WHERE msg_id = OLD.id;
END;
"#,
    ),
    (
        11,
        r#"
-- Hooks (issue 19 "Hooks", seed 003; mailbox::hooks). Every delivery is queued for the hook
-- runner by the trigger below, in the transaction that commits the delivery, whatever path
-- delivered it; the runner turns each queued row into runs of the hooks it matches and removes
-- it in one transaction, so each delivery is matched once, ever. Mail delivered before this
-- version is not queued.
CREATE TABLE hook_inbox(seq INTEGER PRIMARY KEY, msg_id TEXT NOT NULL, agent TEXT NOT NULL);
CREATE TRIGGER deliveries_hook_inbox AFTER INSERT ON deliveries
BEGIN
  INSERT OR IGNORE INTO hook_inbox(seq, msg_id, agent) VALUES (NEW.seq, NEW.msg_id, NEW.agent);
END;
-- One run of one hook for one message or a coalesced burst: pending -> started (committed
-- before the command is spawned) -> ok | failed | timeout; a run found `started` when the
-- daemon starts is `unknown` and never runs again; `dropped`: its hook left config.toml
-- before it started.
CREATE TABLE hook_runs(
  id INTEGER PRIMARY KEY AUTOINCREMENT, hook TEXT NOT NULL, agent TEXT NOT NULL,
  state TEXT NOT NULL
    CHECK (state IN ('pending','started','ok','failed','timeout','unknown','dropped')),
  count INTEGER NOT NULL DEFAULT 0, created_at INTEGER NOT NULL, due_at INTEGER NOT NULL,
  started_at INTEGER, finished_at INTEGER, exit_code INTEGER, error TEXT);
CREATE INDEX hook_runs_state ON hook_runs(state, due_at);
-- The messages of each run; a message belongs to at most one run of each hook.
CREATE TABLE hook_run_messages(
  hook TEXT NOT NULL, msg_id TEXT NOT NULL,
  run INTEGER NOT NULL REFERENCES hook_runs(id) ON DELETE CASCADE,
  PRIMARY KEY(hook, msg_id));
CREATE INDEX hook_run_messages_run ON hook_run_messages(run);
"#,
    ),
    (
        12,
        r#"
-- Idempotency records are pruned after their horizon on every keyed write (issue 19 part 4,
-- mailbox::idempotency): the prune is one indexed DELETE by age.
CREATE INDEX idempotency_created ON idempotency(created_at);
"#,
    ),
    (
        13,
        r#"
-- Per-peer LAN memory (issue 22 part 2, spec §10; mailbox::lan_memory): the decision "this
-- peer's LAN address does not answer" is kept on the peer, not per row. While lan_down_since
-- (ms) is set and a relay is configured, every queued and new row and receipt for the peer goes
-- to the relay (mailbox::lane); the mark clears only when the address answers again (a probe
-- at lan_probe_at (ms) with its own backoff over lan_probe_fails, or a proven address).
-- lan_down_reason: refused | timeout | unreachable | failed.
ALTER TABLE peers ADD COLUMN lan_down_since INTEGER;
ALTER TABLE peers ADD COLUMN lan_down_reason TEXT;
ALTER TABLE peers ADD COLUMN lan_probe_at INTEGER;
ALTER TABLE peers ADD COLUMN lan_probe_fails INTEGER NOT NULL DEFAULT 0;
-- A LAN verdict that arrived after the relay settled the row and disagrees with it (e.g.
-- `rejected:<why>` after a relay accept): kept for `agentmbx sent`, never applied.
ALTER TABLE outbox ADD COLUMN late_lan_verdict TEXT;
"#,
    ),
];

/// Brings `conn` to [`SCHEMA_VERSION`] in one transaction; refuses a newer file.
pub(super) fn migrate(conn: &mut Connection) -> Result<(), MailboxError> {
    migrate_with(conn, MIGRATIONS)
}

fn migrate_with(conn: &mut Connection, steps: &[(u32, &str)]) -> Result<(), MailboxError> {
    let supported = steps.last().map_or(0, |s| s.0);
    let found: u32 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if found > supported {
        return Err(MailboxError::SchemaTooNew { found, supported });
    }
    if found == supported {
        return Ok(());
    }
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    for (version, sql) in steps.iter().filter(|s| s.0 > found) {
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", version)?;
    }
    tx.commit()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_schema_is_refused_and_older_migrates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.db");
        let mut c = Connection::open(&path).unwrap();
        migrate(&mut c).unwrap();
        // A next schema step applies on top of the current version, in one transaction.
        let mut steps = MIGRATIONS.to_vec();
        let next = SCHEMA_VERSION + 1;
        steps.push((next, "ALTER TABLE peers ADD COLUMN note TEXT;"));
        migrate_with(&mut c, &steps).unwrap();
        let v: u32 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, next);
        // Our binary refuses the newer file.
        let err = migrate(&mut c).unwrap_err();
        assert!(
            err.to_string().contains(&format!("schema version {next}")),
            "{err}"
        );
    }

    #[test]
    fn a_version_1_store_keeps_its_outbox_and_its_rows_stay_on_the_relay() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Connection::open(dir.path().join("m.db")).unwrap();
        migrate_with(&mut c, &MIGRATIONS[..1]).unwrap();
        c.execute_batch(
            "INSERT INTO messages VALUES ('m1','t','a@h','m1',NULL,'message','s','b','{}','local',1);
             INSERT INTO messages VALUES ('m2','t','a@h','m2',NULL,'message','s','b','{}','local',1);
             INSERT INTO peers(host, pubkey, added_at) VALUES ('work','K',1);
             INSERT INTO outbox(msg_id, host, target_pubkey, state, attempts, next_at, created_at)
               VALUES ('m1','work','K','pending',3,5,1);
             INSERT INTO outbox(msg_id, host, target_pubkey, state, next_at, created_at, seq)
               VALUES ('m2','work','K','relay-accepted',5,1,77);",
        )
        .unwrap();
        migrate(&mut c).unwrap();
        let rows: Vec<(String, String, i64, i64, Option<String>)> = c
            .prepare(
                "SELECT msg_id, state, attempts, lan_failures, via FROM outbox ORDER BY msg_id",
            )
            .unwrap()
            .query_map([], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            rows,
            vec![
                ("m1".into(), "pending".into(), 3, 2, None),
                (
                    "m2".into(),
                    "relay-accepted".into(),
                    0,
                    2,
                    Some("relay".into())
                ),
            ]
        );
    }

    #[test]
    fn a_version_3_re_push_becomes_repush_and_the_new_states_are_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Connection::open(dir.path().join("m.db")).unwrap();
        migrate_with(&mut c, &MIGRATIONS[..3]).unwrap();
        c.execute_batch(
            "INSERT INTO messages VALUES ('m1','t','a@h','m1',NULL,'message','s','b','{}','local',1);
             INSERT INTO messages VALUES ('m2','t','a@h','m2',NULL,'message','s','b','{}','local',1);
             INSERT INTO messages VALUES ('m3','t','a@h','m3',NULL,'message','s','b','{}','local',1);
             INSERT INTO outbox(msg_id, host, target_pubkey, state, next_at, created_at)
               VALUES ('m1','work','K','pending',5,1);
             INSERT INTO outbox(msg_id, host, target_pubkey, state, next_at, created_at,
                                accepted_at, deadline_at, seq, wire)
               VALUES ('m2','work','K','pending',5,1,7,99,77,x'01');
             INSERT INTO outbox(msg_id, host, target_pubkey, state, next_at, created_at,
                                accepted_at, deadline_at)
               VALUES ('m3','work','K','relay-accepted',5,1,7,99);",
        )
        .unwrap();
        migrate(&mut c).unwrap();
        type Line = (String, String, Option<i64>, Option<i64>, Option<Vec<u8>>);
        let rows: Vec<Line> = c
            .prepare(
                "SELECT msg_id, state, accepted_at, deadline_at, wire FROM outbox ORDER BY msg_id",
            )
            .unwrap()
            .query_map([], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            rows,
            vec![
                ("m1".into(), "pending".into(), None, None, None),
                (
                    "m2".into(),
                    "repush".into(),
                    Some(7),
                    Some(99),
                    Some(vec![1])
                ),
                (
                    "m3".into(),
                    "relay-accepted".into(),
                    Some(7),
                    Some(99),
                    None
                ),
            ]
        );
        for state in ["repush", "expired", "unconfirmed"] {
            c.execute("UPDATE outbox SET state = ?1 WHERE msg_id = 'm1'", [state])
                .unwrap();
        }
        assert!(c
            .execute("UPDATE outbox SET state = 'lost' WHERE msg_id = 'm1'", [])
            .is_err());
    }

    /// Issue 17 (3): a version 5 store gains `peers.directory_at` (NULL: the directory of a
    /// peer pinned before is not known until the next refresh) and the `unclaimed` table.
    #[test]
    fn a_version_5_store_gains_the_directory_time_and_the_unclaimed_table() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Connection::open(dir.path().join("m.db")).unwrap();
        migrate_with(&mut c, &MIGRATIONS[..5]).unwrap();
        c.execute_batch(
            "INSERT INTO peers(host, pubkey, added_at) VALUES ('work','K',1);
             INSERT INTO agents(name, host, last_seen) VALUES ('bob','work',1);
             INSERT INTO messages VALUES ('m1','t','a@work','m1',NULL,'message','s','b','{}','work',1);",
        )
        .unwrap();
        migrate(&mut c).unwrap();
        let at: Option<i64> = c
            .query_row(
                "SELECT directory_at FROM peers WHERE host = 'work'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(at, None);
        c.execute(
            "INSERT INTO unclaimed(msg_id, name, since) VALUES ('m1', 'zoe', 5)",
            [],
        )
        .unwrap();
        // One row per message and name.
        assert!(c
            .execute(
                "INSERT INTO unclaimed(msg_id, name, since) VALUES ('m1', 'zoe', 6)",
                []
            )
            .is_err());
    }

    /// Issue 18 (3): a version 7 store gains the wake brake's tables, its kv rows (a mute)
    /// kept.
    #[test]
    fn a_version_7_store_gains_the_wake_tables() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Connection::open(dir.path().join("m.db")).unwrap();
        migrate_with(&mut c, &MIGRATIONS[..7]).unwrap();
        c.execute_batch("INSERT INTO kv(k, v) VALUES ('wake-mute:bob', '99');")
            .unwrap();
        migrate(&mut c).unwrap();
        let v: u32 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
        c.execute_batch(
            "INSERT INTO wakes(wake, agent, thread, at) VALUES (1, 'bob', 't', 5);
             INSERT INTO wake_claims(agent, msg_id, thread, at) VALUES ('bob', 'm1', 't', 5);",
        )
        .unwrap();
        assert!(c
            .execute(
                "INSERT INTO wake_claims(agent, msg_id, thread, at) VALUES ('bob', 'm1', 't', 6)",
                []
            )
            .is_err());
        let mute: String = c
            .query_row("SELECT v FROM kv WHERE k = 'wake-mute:bob'", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(mute, "99");
    }

    /// Issue 18: a version 8 store gains the `catchup` table, empty (every agent at the
    /// beginning), keeping its deliveries.
    #[test]
    fn a_version_8_store_gains_the_catchup_positions() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Connection::open(dir.path().join("m.db")).unwrap();
        migrate_with(&mut c, &MIGRATIONS[..8]).unwrap();
        c.execute_batch(
            "INSERT INTO messages VALUES ('m1','t','a@h','m1',NULL,'message','s','b','{}','local',1);
             INSERT INTO deliveries(msg_id, agent, state, updated_at) VALUES ('m1','bob','new',1);",
        )
        .unwrap();
        migrate(&mut c).unwrap();
        let n: i64 = c
            .query_row("SELECT COUNT(*) FROM catchup", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 0);
        c.execute(
            "INSERT INTO catchup(agent, seq, updated_at) VALUES ('bob', 1, 2)",
            [],
        )
        .unwrap();
        // One row per agent.
        assert!(c
            .execute(
                "INSERT INTO catchup(agent, seq, updated_at) VALUES ('bob', 2, 3)",
                []
            )
            .is_err());
        let d: i64 = c
            .query_row("SELECT COUNT(*) FROM deliveries", [], |r| r.get(0))
            .unwrap();
        assert_eq!(d, 1);
    }

    /// Issue 19 (3): a version 9 store with mail gains the search index, built from the mail
    /// it holds, and later inserts keep it in step.
    #[test]
    fn a_version_9_store_with_mail_is_indexed_for_search() {
        use crate::mailbox::search;
        let dir = tempfile::tempdir().unwrap();
        let mut c = Connection::open(dir.path().join("m.db")).unwrap();
        migrate_with(&mut c, &MIGRATIONS[..9]).unwrap();
        c.execute_batch(
            "INSERT INTO messages VALUES ('m1','2026-01-01T00:00:00.000Z','a@h','m1',NULL,'message','Quarterly budget','the numbers are in','{}','local',1);
             INSERT INTO messages VALUES ('m2','2026-01-01T00:00:00.000Z','a@h','m2',NULL,'message','lunch','budget budget budget','{}','work',1);
             INSERT INTO messages VALUES ('m3','2026-01-01T00:00:00.000Z','a@h','m3',NULL,'message','other','unrelated','{}','local',1);
             INSERT INTO deliveries(msg_id, agent, state, updated_at) VALUES ('m1','bob','acked',1);
             INSERT INTO deliveries(msg_id, agent, state, updated_at) VALUES ('m2','bob','new',1);
             INSERT INTO deliveries(msg_id, agent, state, updated_at) VALUES ('m3','bob','new',1);",
        )
        .unwrap();
        migrate(&mut c).unwrap();
        let v: u32 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
        let q = search::parse_query("budget").unwrap();
        let found = |c: &Connection| -> Vec<String> {
            search::search(c, "bob", "h", &q, None, 10)
                .unwrap()
                .messages
                .into_iter()
                .map(|m| m.id)
                .collect()
        };
        let mut got = found(&c);
        got.sort();
        assert_eq!(got, vec!["m1", "m2"]);
        // The trigger indexes what is stored after the migration.
        c.execute_batch(
            "INSERT INTO messages VALUES ('m4','2026-01-01T00:00:00.000Z','a@h','m4',NULL,'message','x','a budget line','{}','local',1);
             INSERT INTO deliveries(msg_id, agent, state, updated_at) VALUES ('m4','bob','new',1);",
        )
        .unwrap();
        assert_eq!(found(&c).len(), 3);
    }

    /// Issue 19 "Hooks": a version 9 store gains the hook tables; its deliveries are not
    /// queued for hooks (no hook runs for old mail), new ones are, in their own transaction.
    #[test]
    fn a_version_9_store_gains_the_hook_queue_for_new_deliveries_only() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Connection::open(dir.path().join("m.db")).unwrap();
        migrate_with(&mut c, &MIGRATIONS[..9]).unwrap();
        c.execute_batch(
            "INSERT INTO messages VALUES ('m1','t','a@h','m1',NULL,'request','s','b','{}','local',1);
             INSERT INTO deliveries(msg_id, agent, state, updated_at) VALUES ('m1','bob','new',1);",
        )
        .unwrap();
        migrate(&mut c).unwrap();
        let queued = |c: &Connection| -> i64 {
            c.query_row("SELECT COUNT(*) FROM hook_inbox", [], |r| r.get(0))
                .unwrap()
        };
        assert_eq!(queued(&c), 0);
        c.execute_batch(
            "INSERT INTO messages VALUES ('m2','t','a@h','m2',NULL,'request','s','b','{}','local',1);
             INSERT INTO deliveries(msg_id, agent, state, updated_at) VALUES ('m2','bob','new',1);
             INSERT OR IGNORE INTO deliveries(msg_id, agent, state, updated_at) VALUES ('m2','bob','new',2);",
        )
        .unwrap();
        assert_eq!(
            queued(&c),
            1,
            "one row per delivery, none for an ignored duplicate"
        );
        assert!(c
            .execute(
                "INSERT INTO hook_runs(hook, agent, state, created_at, due_at) VALUES ('h','bob','done',1,1)",
                []
            )
            .is_err());
    }

    /// Issue 22 (2): a version 12 store gains the per-peer LAN memory, every peer unmarked
    /// (the LAN first, as before), its outbox rows kept with no late LAN verdict.
    #[test]
    fn a_version_12_store_gains_the_lan_memory_unmarked() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Connection::open(dir.path().join("m.db")).unwrap();
        migrate_with(&mut c, &MIGRATIONS[..12]).unwrap();
        c.execute_batch(
            "INSERT INTO messages VALUES ('m1','t','a@h','m1',NULL,'message','s','b','{}','local',1);
             INSERT INTO peers(host, pubkey, added_at, addr) VALUES ('work','K',1,'127.0.0.1:9');
             INSERT INTO outbox(msg_id, host, target_pubkey, state, attempts, next_at, created_at)
               VALUES ('m1','work','K','pending',1,5,1);",
        )
        .unwrap();
        migrate(&mut c).unwrap();
        let v: u32 = c
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
        let peer: (Option<i64>, Option<String>, Option<i64>, i64) = c
            .query_row(
                "SELECT lan_down_since, lan_down_reason, lan_probe_at, lan_probe_fails FROM peers",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .unwrap();
        assert_eq!(peer, (None, None, None, 0));
        let row: (String, i64, Option<String>) = c
            .query_row(
                "SELECT state, next_at, late_lan_verdict FROM outbox WHERE msg_id = 'm1'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap();
        assert_eq!(row, ("pending".into(), 5, None));
    }

    #[test]
    fn a_version_4_quarantine_is_tried_once_more() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Connection::open(dir.path().join("m.db")).unwrap();
        migrate_with(&mut c, &MIGRATIONS[..4]).unwrap();
        c.execute_batch(
            "INSERT INTO quarantine(relay, epoch, seq, kind, item_id, sender_pubkey, reason, wire, at)
               VALUES ('r','e',1,'envelope','a','K','sender host mismatch',x'7b7d',1),
                      ('r','e',2,'receipt','b','K','bad signature',x'7b7d',1),
                      ('r','e',3,'expired','c','K','not from the relay',x'7b7d',1);",
        )
        .unwrap();
        migrate(&mut c).unwrap();
        let rows: Vec<(i64, i64, Option<String>)> = c
            .prepare("SELECT seq, retry, claimed_host FROM quarantine ORDER BY seq")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(rows, vec![(1, 1, None), (2, 1, None), (3, 0, None)]);
    }
}
