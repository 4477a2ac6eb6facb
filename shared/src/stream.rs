//! The relay push stream (`GET /v2/relay/stream`, `docs/relay-stream.md`): its JSON text frames,
//! close codes and limits, shared by the relay that serves it and the daemon that reads it.
//!
//! The stream is a faster pull, never a second source of truth (spec §4): a `deliver` frame
//! carries exactly what a pull page would ([`crate::wire::PullItem`] plus the `replay` marker
//! of AgentPeer relay v1), the receiver stores it through the same path, advances
//! received-through only over a contiguous run of seqs and acks with `POST /v2/relay/ack` after
//! its commit. A live frame above a gap never moves the checkpoint: the receiver pulls.
//!
//! This module owns the frame shapes and constants only; it never opens a socket.

use serde::{Deserialize, Serialize};

/// Path of the stream (a WebSocket upgrade of a signed `GET`).
pub const STREAM_PATH: &str = "/v2/relay/stream";

/// Query parameter that carries the single-use stream nonce (`you.stream_nonce` of a signed
/// `GET /v2/relay/info`) inside the signed path.
pub const NONCE_PARAM: &str = "nonce";

/// How long a stream nonce stays usable after the relay handed it out: 120,000 ms.
pub const NONCE_TTL_MS: i64 = 120_000;

/// Largest client frame the relay reads: 64 KiB. A larger one closes the stream with
/// [`close::OVERSIZE`].
pub const MAX_CLIENT_FRAME: usize = 64 * 1024;

/// Bytes of frames one stream may have queued for sending: 256 KiB. Past it the relay drops
/// live frames (never stored items) and sends [`ServerFrame::Lagged`] (during a replay, only
/// at its end and only for what the replay did not carry).
pub const STREAM_QUEUE_BYTES: usize = 256 * 1024;

/// Bytes of frames all streams of one relay process may have queued together: 64 MiB. Past it
/// the relay drops live frames and sends [`ServerFrame::Lagged`], as for one full stream, and
/// a replay whose next chunk does not fit ends early with [`ServerFrame::ResumeComplete`].
pub const RELAY_STREAM_BUDGET_BYTES: usize = 64 * 1024 * 1024;

/// The relay sends [`ServerFrame::Ping`] every 25,000 ms (AgentPeer relay v1).
pub const PING_EVERY_MS: u64 = 25_000;

/// A stream whose client answered no ping for 60,000 ms is closed ([`close::POLICY`]).
pub const PONG_TIMEOUT_MS: u64 = 60_000;

/// WebSocket close codes of the stream (RFC 6455 §7.4; 4000–4999 are ours).
pub mod close {
    /// The relay is shutting down (RFC 6455 "going away"): reconnect with backoff.
    pub const GOING_AWAY: u16 = 1001;
    /// A frame the relay does not accept (binary, not JSON, no `type`), or no pong in time.
    pub const POLICY: u16 = 1008;
    /// A client frame over [`super::MAX_CLIENT_FRAME`].
    pub const OVERSIZE: u16 = 1009;
    /// The relay cannot serve this stream now (its store could not be read): pull, and
    /// reconnect with backoff. A full queue or budget is not a close: it is `lagged`, or a
    /// replay that ends early.
    pub const OVERLOAD: u16 = 1013;
    /// The account token the stream was opened under expired (spec §8): reopen with a fresh one.
    pub const TOKEN_EXPIRED: u16 = 4401;
    /// Authentication failed, or the key was revoked or deny-listed while connected.
    pub const AUTH: u16 = 4403;
    /// Another stream opened for the same host key and replaced this one (a cloned key when it
    /// keeps happening): do not reconnect in a tight loop.
    pub const REPLACED: u16 = 4409;
}

/// A frame the client sends (JSON text with a `type`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientFrame {
    /// Start (or restart) delivery after `after` in `epoch`: the relay replays the stored items
    /// after it, then goes live. A stale epoch is answered [`ServerFrame::Epoch`]; `after < 0`,
    /// or a `resume` sent while a replay runs (before its [`ServerFrame::ResumeComplete`]), is
    /// answered [`ServerFrame::Error`] `bad_frame` and changes nothing.
    Resume {
        /// The epoch the client's received-through belongs to ("" when it has none yet).
        epoch: String,
        /// The client's received-through: replay starts at the next seq.
        after: i64,
    },
    /// The answer to [`ServerFrame::Ping`], with its id.
    Pong {
        /// The ping's id.
        id: u64,
    },
}

/// A frame the relay sends (JSON text with a `type`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerFrame {
    /// One stored item, exactly as a pull returns it; `replay` is true when it comes from the
    /// ordered replay after a `resume`, false for a live frame sent after its push committed.
    Deliver {
        /// Relay seq.
        seq: i64,
        /// The seq allocated for this target just before `seq` (0 if none): no item for the
        /// target lies strictly between the two. In a replay it is the previous replayed seq
        /// (the `resume`'s `after` for the first). The receiver stores the item only when
        /// `prev_seq <= received_through < seq`; when `received_through < prev_seq` it has a
        /// gap and pulls instead (spec §4: received-through moves only over a contiguous run).
        prev_seq: i64,
        /// `envelope`, `receipt` or `expired`.
        kind: String,
        /// Item id.
        item_id: String,
        /// Pushing host key (the relay key for notices).
        sender_pubkey: String,
        /// Wire bytes, standard base64.
        wire_b64: String,
        /// From the replay (true) or live (false).
        replay: bool,
    },
    /// The replay after a `resume` ended: `replayed` items were sent; `head_seq` is the last
    /// seq allocated for the client. When the replay stopped before the head (a page bound, an
    /// item too large for a frame, the relay-wide budget full), the client pulls the rest.
    ResumeComplete {
        /// Items sent by this replay.
        replayed: u64,
        /// The caller's head seq when the replay ended.
        head_seq: i64,
    },
    /// Sent every [`PING_EVERY_MS`]; answer with [`ClientFrame::Pong`].
    Ping {
        /// Echo it in the pong.
        id: u64,
    },
    /// The relay's epoch: sent when a `resume` names another epoch, and when the epoch changes
    /// while connected. The client runs spec §5's new-epoch handling, then resumes.
    Epoch {
        /// The relay's current epoch.
        epoch: String,
    },
    /// Live frames from `from_seq` on were dropped (a full queue or budget, or an item too
    /// large for the queue): pull from the received-through, then send
    /// [`ClientFrame::Resume`] again. After `lagged` the relay sends no live frame until that
    /// next `resume`.
    Lagged {
        /// No seq the client lacks is below it: the first dropped seq, or the one after the
        /// replay's last when the replay carried the first dropped ones (it need not be a seq
        /// that exists).
        from_seq: i64,
    },
    /// A client frame the relay could not use; the stream stays open.
    Error {
        /// `unknown_frame` (a `type` the relay does not know) or `bad_frame`.
        reason: String,
        /// The unknown `type`, when there was one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        frame_type: Option<String>,
        /// A short human explanation.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_read_and_write_with_their_type_tag() {
        let f: ClientFrame = serde_json::from_str(r#"{"type":"resume","epoch":"e1","after":7}"#)
            .expect("resume parses");
        assert_eq!(
            f,
            ClientFrame::Resume {
                epoch: "e1".into(),
                after: 7
            }
        );
        let s = serde_json::to_string(&ServerFrame::ResumeComplete {
            replayed: 2,
            head_seq: 9,
        })
        .expect("serializes");
        assert_eq!(s, r#"{"type":"resume_complete","replayed":2,"head_seq":9}"#);
        let s = serde_json::to_string(&ServerFrame::Lagged { from_seq: 12 }).expect("serializes");
        assert_eq!(s, r#"{"type":"lagged","from_seq":12}"#);
    }

    #[test]
    fn a_deliver_frame_carries_its_prev_seq() {
        let s = serde_json::to_string(&ServerFrame::Deliver {
            seq: 9,
            prev_seq: 4,
            kind: "envelope".into(),
            item_id: "i".into(),
            sender_pubkey: "k".into(),
            wire_b64: "AA==".into(),
            replay: false,
        })
        .expect("serializes");
        assert_eq!(
            s,
            r#"{"type":"deliver","seq":9,"prev_seq":4,"kind":"envelope","item_id":"i","sender_pubkey":"k","wire_b64":"AA==","replay":false}"#
        );
    }

    #[test]
    fn an_unknown_type_does_not_parse_as_a_client_frame() {
        assert!(serde_json::from_str::<ClientFrame>(r#"{"type":"deliver","seq":1}"#).is_err());
    }
}
