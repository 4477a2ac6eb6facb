//! Test fixtures shared by the unit tests of this crate (compiled only for `cargo test`):
//! identities, a real `mailbox.db` in a temp dir, a manual clock, sending through the node, and
//! sealed envelopes as a peer would push them.

use std::path::PathBuf;
use std::sync::Arc;

use agentmbx_protocol::clock::ManualClock;
use agentmbx_protocol::envelope::{self, Draft};
use agentmbx_protocol::keys::{EncKey, EncPublicKey, HostKey};
use agentmbx_protocol::seal;

use crate::host_name::HostName;
use crate::identity::Identity;
use crate::mailbox::{peers, Mailbox};
use crate::node::send::{self, SendOutcome, SendRequest};

/// 2026-01-01T00:01:00.000Z: the start of every manual clock.
pub const T0: i64 = 1_767_225_660_000;

/// A fresh identity named `host`.
pub fn identity(host: &str) -> Identity {
    Identity {
        host: HostName::parse(host).unwrap(),
        host_key: HostKey::generate(),
        enc_key: EncKey::generate(),
        key_store: crate::keystore::Backend::File,
        history: Default::default(),
    }
}

/// A manual clock at [`T0`].
pub fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(T0))
}

/// A real `mailbox.db` in its own temp dir (removed on drop).
#[derive(Debug)]
pub struct Store {
    /// Keeps the directory alive.
    pub _dir: tempfile::TempDir,
    /// Path of `mailbox.db`.
    pub path: PathBuf,
    /// The opened store.
    pub mailbox: Mailbox,
}

/// Opens a new `mailbox.db` in a temp dir.
pub fn store() -> Store {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mailbox.db");
    let mailbox = Mailbox::open(&path).unwrap();
    Store {
        _dir: dir,
        path,
        mailbox,
    }
}

impl Store {
    /// A second, independent connection to the file: sees only what was committed.
    pub fn fresh_conn(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(&self.path).unwrap()
    }

    /// Runs a one-value query on a fresh connection.
    pub fn scalar<T: rusqlite::types::FromSql>(&self, sql: &str) -> T {
        self.fresh_conn().query_row(sql, [], |r| r.get(0)).unwrap()
    }

    /// Pins `peer` under its host name; with `with_enc` its enc key too (as from an ad issued at
    /// [`T0`]).
    pub fn add_peer(&self, peer: &Identity, with_enc: bool) {
        let host = peer.host.to_string();
        let pubkey = peer.host_key.public().to_b64();
        let enc = peer.enc_key.public().to_b64();
        self.mailbox
            .with(|c| {
                peers::add(c, &host, &pubkey, T0)?;
                if with_enc {
                    assert!(peers::set_enc_key(c, &host, &enc, T0)?);
                }
                Ok(())
            })
            .unwrap();
    }

    /// Registers `names` as local mailboxes of host `own` (as `agentmbx whoami --as` does), so
    /// mail to them is delivered rather than refused as a typo.
    pub fn register(&self, own: &str, names: &[&str]) {
        self.mailbox
            .with(|c| {
                for name in names {
                    crate::mailbox::agents::register(c, own, name, None, None, T0)?;
                }
                Ok(())
            })
            .unwrap();
    }

    /// Sends through [`send::send`] in one transaction, committed on success.
    pub fn send(
        &self,
        ident: &Identity,
        from: &str,
        to: &[&str],
        subject: &str,
        id: &str,
        now_ms: i64,
    ) -> Result<SendOutcome, send::SendError> {
        let req = SendRequest {
            from: from.into(),
            to: to.iter().map(|s| s.to_string()).collect(),
            subject: subject.into(),
            body: format!("body of {subject}"),
            kind: None,
            thread: None,
            reply_to: None,
            needs_reply: false,
            refs: vec![],
            new_mailbox: false,
        };
        self.mailbox
            .with(|c| {
                let tx = c.transaction()?;
                let out = send::send(&tx, ident, &req, id.to_string(), now_ms);
                if out.is_ok() {
                    tx.commit()?;
                }
                Ok(out)
            })
            .unwrap()
    }
}

/// The wire bytes `sender` would push: an envelope `from` → `to`, built at `now_ms`, sealed
/// for `recipient` and signed by `sender`'s host key with its host name.
pub fn sealed_wire(
    sender: &Identity,
    recipient: &EncPublicKey,
    id: &str,
    from: &str,
    to: &[&str],
    subject: &str,
    now_ms: i64,
) -> Vec<u8> {
    let draft = Draft {
        from: from.into(),
        to: to.iter().map(|s| s.to_string()).collect(),
        subject: subject.into(),
        body: format!("secret body of {subject}"),
        ..Draft::default()
    };
    let plain = envelope::build(&draft, id.into(), now_ms).unwrap();
    let sealed =
        seal::seal_envelope(&plain, recipient, sender.host.as_str(), &sender.host_key).unwrap();
    sealed.wire_json().into_bytes()
}

/// A monotonic id generator for envelope ids.
pub fn ids() -> agentmbx_protocol::ulid::Generator {
    agentmbx_protocol::ulid::Generator::new()
}
