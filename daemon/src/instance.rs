//! This daemon process's instance id, and what it learns about host keys that two daemons use
//! at once (a copied home, a restored backup, a cloned disk): the host side of
//! [`agentmbx_protocol::instance`].
//!
//! - [`Instance::id`]: random per daemon start; sent as the unsigned `x-mbx-instance` header
//!   on every relay hop ([`crate::transport::relay_client::RelayClient`]) and every LAN hop
//!   ([`crate::transport::lan::client::LanClient`]) of the daemon. CLI commands (`doctor`,
//!   `peers`, pairing) send none, so they never count.
//! - [`Instance::note_relay`]: the relay's `you.instance_conflict` from each signed
//!   `GET /v2/relay/info` (once per relay pass). A new detection (it appears, or its
//!   `since_ms` changed) logs one WARN line; it is reported until the relay's answer no longer
//!   carries it, or for at most its window after the relay last said so.
//! - [`Instance::observe_peer`]: the LAN server feeds every verified hop of a pinned peer with
//!   its header into a tracker of its own; a peer whose ids alternate is logged once per
//!   detection and reported for the window after its last alternation.
//! - [`Instance::note_replaced`]: the relay closed this daemon's push stream with 4409
//!   `replaced` (another stream opened with this host key, `docs/relay-stream.md`). Once a
//!   stream replaces ours rather than pulls alternating, the relay's own tracker may no longer
//!   see two daemons, so [`REPLACED_TO_REPORT`] replacements within the window are reported as
//!   the same `host-key-clone` (logged once per detection).
//! - [`Instance::reasons`]: what is reported now, for `GET /v1/health` (`status: "degraded"`
//!   with `reasons`) and through it `agentmbx doctor` (checks `host-key-clone` and
//!   `peer-key-clone`).
//!
//! Advisory only: nothing here changes how mail moves; each message still goes to whichever
//! daemon pulls it (or receives its LAN hop), once.

use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

use agentmbx_protocol::instance::{
    new_instance_id, InstanceConflict, InstanceTracker, Observation, CONFLICT_WINDOW_MS,
};

/// [`Reason::code`] when another daemon uses this host's key (the relay says so).
pub const HOST_KEY_CLONE: &str = "host-key-clone";

/// [`Reason::code`] when a paired peer's key is used by two daemons (seen on the LAN server).
pub const PEER_KEY_CLONE: &str = "peer-key-clone";

/// Push-stream replacements (close 4409) in one run ([`REPLACED_WINDOW_MS`]) that make a
/// `host-key-clone` report: 2 (one replacement can be this daemon's own restart racing its old
/// connection; a second within the window means another daemon keeps opening streams).
pub const REPLACED_TO_REPORT: usize = 2;

/// Two push-stream replacements (close 4409) at most this far apart belong to one run (ms:
/// 25 min, twice the longest wait before the stream is reopened after one, 10 min plus a
/// quarter of jitter): a clone that keeps taking the stream stays reported however long the
/// daemon's backoff grew; a run ends after this long without a replacement.
pub const REPLACED_WINDOW_MS: i64 = 2 * (600_000 + 600_000 / 4);

/// Peers (host name and key) the LAN tracker remembers: 1,024, far above any peer list; past
/// it the peer seen longest ago is forgotten first (a forgotten peer starts over).
pub const MAX_TRACKED_PEERS: usize = 1_024;

/// One thing that makes `GET /v1/health` answer `degraded`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Reason {
    /// [`HOST_KEY_CLONE`] or [`PEER_KEY_CLONE`].
    pub code: &'static str,
    /// What is wrong and what to do, one line.
    pub detail: String,
    /// The peer's host name (`peer-key-clone` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// The relay URL that reported it (`host-key-clone` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub relay: Option<String>,
}

/// A peer as the LAN tracker keys it: its name and pinned key (a re-paired peer with a new key
/// starts over).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PeerKey {
    host: String,
    pubkey: String,
}

/// The relay's latest word on this host key.
#[derive(Debug, Clone)]
struct RelayNote {
    relay: String,
    conflict: InstanceConflict,
    /// When the relay last said so (ms on [`Instance`]'s monotonic clock).
    told_ms: i64,
}

/// The push-stream replacements (close 4409) one relay reported.
#[derive(Debug, Clone, Default)]
struct Replaced {
    relay: String,
    /// Every replacement since the start (for `doctor`).
    total: u64,
    /// Replacements in the current run: each within [`REPLACED_WINDOW_MS`] of the previous.
    run: usize,
    /// When the last one happened (ms on [`Instance`]'s clock).
    last_ms: i64,
    /// Whether the current run of replacements was already logged as a detection.
    reported: bool,
}

/// This daemon process's instance id and its findings (module docs). One per daemon start,
/// shared by the local API, the LAN server and client, and the relay client.
#[derive(Debug)]
pub struct Instance {
    id: String,
    started: Instant,
    /// How far tests moved this instance's clock ahead (ms).
    #[cfg(test)]
    ahead_ms: std::sync::atomic::AtomicI64,
    relay: Mutex<Option<RelayNote>>,
    replaced: Mutex<Option<Replaced>>,
    peers: Mutex<InstanceTracker<PeerKey>>,
}

impl Default for Instance {
    fn default() -> Self {
        Self::new()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Instance {
    /// A new instance with a fresh random id
    /// ([`agentmbx_protocol::instance::new_instance_id`]) and the 10 min window.
    pub fn new() -> Self {
        Self::with_window(CONFLICT_WINDOW_MS)
    }

    /// [`Self::new`] with another window for peers seen on the LAN (ms); for tests.
    pub fn with_window(window_ms: i64) -> Self {
        Instance {
            id: new_instance_id(),
            started: Instant::now(),
            #[cfg(test)]
            ahead_ms: 0.into(),
            relay: Mutex::new(None),
            replaced: Mutex::new(None),
            peers: Mutex::new(InstanceTracker::with_window(MAX_TRACKED_PEERS, window_ms)),
        }
    }

    /// The instance id sent in `x-mbx-instance` (32 lowercase hex characters).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Now on this instance's monotonic clock (ms since it was made).
    fn now_ms(&self) -> i64 {
        let now = i64::try_from(self.started.elapsed().as_millis()).unwrap_or(i64::MAX);
        #[cfg(test)]
        let now = now.saturating_add(self.ahead_ms.load(std::sync::atomic::Ordering::Relaxed));
        now
    }

    /// Records what `relay` said about this host key in `you.instance_conflict` of a signed
    /// info answer (`None`: nothing, which clears an earlier report). Logs one WARN line when
    /// this is a new detection (none before, another relay, or another `since_ms`) and returns
    /// whether it was.
    pub fn note_relay(&self, relay: &str, conflict: Option<InstanceConflict>) -> bool {
        let now = self.now_ms();
        let mut note = lock(&self.relay);
        let Some(c) = conflict else {
            if note.take().is_some() {
                tracing::info!(relay = %relay, "the relay no longer sees another daemon using this host key");
            }
            return false;
        };
        let new = note
            .as_ref()
            .is_none_or(|n| n.relay != relay || n.conflict.since_ms != c.since_ms);
        if new {
            tracing::warn!(
                relay = %relay,
                instances = c.instances,
                "another daemon is using this host key (a copied home, a restored backup or a cloned disk): the relay sees two daemon instances alternate on it, so incoming mail is split between them; see agentmbx doctor"
            );
        }
        *note = Some(RelayNote {
            relay: relay.to_owned(),
            conflict: c,
            told_ms: now,
        });
        new
    }

    /// Records that `relay` closed this daemon's push stream with 4409 `replaced`. Returns the
    /// number of replacements by that relay since the start, and whether this one made a new
    /// detection ([`REPLACED_TO_REPORT`] in one run, [`REPLACED_WINDOW_MS`]; logged once at
    /// WARN).
    pub fn note_replaced(&self, relay: &str) -> (u64, bool) {
        let now = self.now_ms();
        let mut note = lock(&self.replaced);
        let r = note.get_or_insert_with(Replaced::default);
        if r.relay != relay {
            *r = Replaced {
                relay: relay.to_owned(),
                ..Replaced::default()
            };
        }
        r.total += 1;
        if r.run > 0 && now - r.last_ms > REPLACED_WINDOW_MS {
            // A stable period: a new run.
            r.run = 0;
            r.reported = false;
        }
        r.run += 1;
        r.last_ms = now;
        let new = r.run >= REPLACED_TO_REPORT && !r.reported;
        if new {
            r.reported = true;
            tracing::warn!(
                relay = %relay,
                replaced = r.run,
                "another daemon is using this host key (a copied home, a restored backup or a cloned disk): the relay keeps replacing this daemon's push stream with another one opened with the same key, so incoming mail is split between them; see agentmbx doctor"
            );
        }
        (r.total, new)
    }

    /// Records a verified LAN hop of the pinned peer `host` (key `pubkey`) carrying instance id
    /// `id`. Logs one WARN line naming the peer when this hop detected a conflict, and returns
    /// whether it did.
    pub fn observe_peer(&self, host: &str, pubkey: &str, id: &str) -> bool {
        let now = self.now_ms();
        let key = PeerKey {
            host: host.to_owned(),
            pubkey: pubkey.to_owned(),
        };
        let seen = lock(&self.peers).observe(&key, id, now);
        if !matches!(seen, Observation::Detected(_)) {
            return false;
        }
        tracing::warn!(
            peer = %host,
            "peer {host} has two daemons running with one host key (a copied home, a restored backup or a cloned disk): their LAN hops alternate and mail to {host} is split between them; its owner must stop one; see agentmbx doctor"
        );
        true
    }

    /// What is reported now: this host key (the relay's latest word, for at most its window
    /// after it was said), then each peer with a conflict, by name.
    pub fn reasons(&self) -> Vec<Reason> {
        let now = self.now_ms();
        let mut out = Vec::new();
        if let Some(n) = lock(&self.relay)
            .as_ref()
            .filter(|n| now - n.told_ms <= n.conflict.window_ms)
        {
            out.push(Reason {
                code: HOST_KEY_CLONE,
                detail: format!(
                    "another daemon is using this host key: the relay sees {} daemon instances alternate on it (a copied home, a restored backup or a cloned disk), so incoming mail is split between them; see agentmbx doctor",
                    n.conflict.instances
                ),
                peer: None,
                relay: Some(n.relay.clone()),
            });
        }
        let told = out.iter().any(|r| r.code == HOST_KEY_CLONE);
        if let Some(r) = lock(&self.replaced).as_ref().filter(|r| {
            !told && r.run >= REPLACED_TO_REPORT && now - r.last_ms <= REPLACED_WINDOW_MS
        }) {
            out.push(Reason {
                code: HOST_KEY_CLONE,
                detail: format!(
                    "another daemon is using this host key: the relay replaced this daemon's push stream {} times in a row, each within 25 minutes of the previous, with one opened by another daemon with the same key (a copied home, a restored backup or a cloned disk), so incoming mail is split between them; see agentmbx doctor",
                    r.run
                ),
                peer: None,
                relay: Some(r.relay.clone()),
            });
        }
        let mut peers: Vec<String> = lock(&self.peers)
            .conflicts(now)
            .into_iter()
            .map(|(k, _)| k.host)
            .collect();
        peers.sort();
        peers.dedup();
        out.extend(peers.into_iter().map(|host| Reason {
            code: PEER_KEY_CLONE,
            detail: format!(
                "peer {host} has two daemons running with one host key (its LAN hops alternate between two daemon instances), so mail to {host} is split between them; its owner must stop one"
            ),
            peer: Some(host),
            relay: None,
        }));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conflict(since_ms: i64) -> InstanceConflict {
        InstanceConflict {
            instances: 2,
            returns: 3,
            since_ms,
            last_ms: since_ms,
            window_ms: CONFLICT_WINDOW_MS,
        }
    }

    #[test]
    fn the_relays_word_is_new_once_per_detection_and_clears_when_absent() {
        let me = Instance::new();
        assert_eq!(me.id().len(), 32);
        assert_ne!(me.id(), Instance::new().id());
        assert!(me.reasons().is_empty());
        assert!(!me.note_relay("http://r", None));
        assert!(me.note_relay("http://r", Some(conflict(10))));
        assert!(
            !me.note_relay("http://r", Some(conflict(10))),
            "the same detection"
        );
        let r = me.reasons();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].code, HOST_KEY_CLONE);
        assert_eq!(r[0].relay.as_deref(), Some("http://r"));
        assert!(
            me.note_relay("http://r", Some(conflict(99))),
            "a new detection"
        );
        assert!(!me.note_relay("http://r", None));
        assert!(me.reasons().is_empty());
        assert!(
            me.note_relay("http://r", Some(conflict(99))),
            "back after absence"
        );
    }

    #[test]
    fn a_repeated_stream_replacement_is_reported_as_a_cloned_key() {
        let me = Instance::new();
        assert_eq!(
            me.note_replaced("http://r"),
            (1, false),
            "one may be a restart"
        );
        assert!(me.reasons().is_empty());
        assert_eq!(me.note_replaced("http://r"), (2, true));
        assert_eq!(me.note_replaced("http://r"), (3, false), "logged once");
        let r = me.reasons();
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!(
            (r[0].code, r[0].relay.as_deref()),
            (HOST_KEY_CLONE, Some("http://r"))
        );
        // The relay's own word is not reported twice.
        me.note_relay("http://r", Some(conflict(5)));
        assert_eq!(me.reasons().len(), 1);
    }

    #[test]
    fn replacements_at_the_longest_backoff_stay_reported_and_a_stable_period_ends_the_run() {
        let me = Instance::new();
        let r = "http://r";
        let later = |me: &Instance, ms: i64| {
            me.ahead_ms
                .fetch_add(ms, std::sync::atomic::Ordering::Relaxed);
        };
        me.note_replaced(r);
        assert!(me.note_replaced(r).1, "detected");
        // The daemon's backoff has grown to 10 min + jitter: the clone still takes the stream.
        for _ in 0..5 {
            later(&me, 750_000);
            me.note_replaced(r);
            assert_eq!(me.reasons().len(), 1, "still reported");
        }
        // No replacement for longer than the window: the report ends, a new run starts over.
        later(&me, REPLACED_WINDOW_MS + 1);
        assert!(me.reasons().is_empty());
        assert_eq!(me.note_replaced(r), (8, false), "one may be a restart");
        assert!(me.note_replaced(r).1, "a new detection");
    }

    #[test]
    fn a_peer_whose_ids_alternate_is_reported_by_name() {
        let me = Instance::with_window(60_000);
        let hops = ["a", "b", "a", "b", "a", "b"];
        let detected: Vec<bool> = hops
            .iter()
            .map(|id| me.observe_peer("xb", "KEYB", id))
            .collect();
        assert_eq!(detected, [false, false, false, false, true, false]);
        // Another peer with one id, and one restarted: nothing.
        for id in ["c", "c", "d", "d"] {
            assert!(!me.observe_peer("xc", "KEYC", id));
        }
        let r = me.reasons();
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!(
            (r[0].code, r[0].peer.as_deref()),
            (PEER_KEY_CLONE, Some("xb"))
        );
    }
}
