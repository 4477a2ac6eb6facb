//! Daemon instance ids and the advisory detection of two daemons running with one host key.
//!
//! Every daemon start picks a random instance id ([`new_instance_id`]) and sends it on every
//! relay and LAN hop in the unsigned header [`INSTANCE_HEADER`] (`x-mbx-instance`). 0.5.x peers
//! and relays ignore unknown headers, so the header changes nothing for them. It is not part of
//! the signed bytes: anyone on the path could change it, so it is trusted for nothing but this
//! advisory detection, and a hop without it (or with a malformed one) never counts.
//!
//! Pulls and LAN hops are stateless, so one switch from id A to id B looks exactly like a
//! restart. A clone (a copied home, a restored backup, a cloned disk) is told apart by
//! *alternation*: an id that was already replaced comes back. A restarted daemon never sends
//! its old id again (the id is random per start), so a return means two live processes.
//! [`InstanceTracker`] records per host key which ids it saw and when, reports a conflict once
//! [`CONFLICT_RETURNS`] returns happen within [`CONFLICT_WINDOW_MS`], and clears it once the
//! window passes with one id.
//!
//! This module owns the id format, the header name and the detection rule. It keeps no global
//! state and reads no clock: callers pass the time (ms, from a monotonic source where they can)
//! and own the tracker (the relay one per process, the daemon one for its LAN server).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use serde::{Deserialize, Serialize};

/// The unsigned hop header carrying the sender daemon's instance id.
pub const INSTANCE_HEADER: &str = "x-mbx-instance";

/// Longest accepted instance id, in bytes. Ours are 32 hex characters; anything longer is
/// ignored, so a sender cannot make a tracker hold large strings.
pub const MAX_INSTANCE_ID: usize = 64;

/// How long an alternation counts, and how long a conflict stays reported after the last one:
/// 10 minutes (600,000 ms).
///
/// Why this value: two clones alternate at their pull interval (2 s by default, configurable
/// up to minutes) and whenever either daemon sends a LAN hop; a daemon that backs off a failing
/// relay still calls it every few minutes. Ten minutes is long enough that two clones on slow
/// timers still alternate inside one window, and long enough that a `doctor` run or the
/// daemon's next info tick sees the conflict after the last alternation; it is short enough
/// that the warning clears soon after one clone is stopped. A restart is never mistaken for a
/// clone whatever the window, because its old id never returns.
pub const CONFLICT_WINDOW_MS: i64 = 10 * 60 * 1000;

/// Returns of an earlier id needed within the window to report a conflict: 3.
///
/// A single request of the previous process that is handled after the new process's first
/// hop (it was still in flight at the restart) makes two returns: A, B, A (A comes back),
/// then B again (B comes back). A third return needs the replaced id to come back once more
/// after that, which a process that has exited cannot do; two live daemons make one return
/// at nearly every switch between them (A, B, A, B, A: three returns by the fifth hop).
pub const CONFLICT_RETURNS: u32 = 3;

/// Ids remembered per key. A clone pair needs 2; a few more cover restarts in between.
const MAX_IDS_PER_KEY: usize = 8;

/// Return times remembered per key: the latest 16. Detection needs [`CONFLICT_RETURNS`]; the
/// cap keeps a key's record a fixed size whatever its hop rate (the header is unsigned, so a
/// caller could alternate ids on every hop), and [`InstanceConflict::returns`] counts up to it.
const MAX_RETURNS_KEPT: usize = 16;

/// A fresh random instance id: 16 random bytes as 32 lowercase hex characters.
pub fn new_instance_id() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

/// True when `id` is a usable instance id: 1..=[`MAX_INSTANCE_ID`] bytes of `[A-Za-z0-9_-]`.
/// Hops with anything else are treated as having no id.
pub fn valid_instance_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_INSTANCE_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A reported conflict: more than one daemon instance used one host key within the window.
///
/// On the wire this is `you.instance_conflict` in a signed-hop `GET /v2/relay/info` answer (an
/// added field 0.5.x ignores; absent when there is none). Advisory only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceConflict {
    /// Distinct instance ids seen for the key within the window (≥ 2).
    pub instances: u32,
    /// Returns of an earlier id counted within the window (counted up to 16: a key keeps its
    /// latest 16 return times).
    pub returns: u32,
    /// When the conflict was first detected (ms, the tracker's time base).
    pub since_ms: i64,
    /// When the latest return was seen (ms, the tracker's time base).
    pub last_ms: i64,
    /// The window, ms ([`CONFLICT_WINDOW_MS`]).
    pub window_ms: i64,
}

/// What one observed hop means for its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// Nothing to report (one id, a restart, or a return still under the threshold).
    Quiet,
    /// A conflict was detected by this hop and was not being reported before: log it once and
    /// count it.
    Detected(InstanceConflict),
    /// A conflict already reported goes on.
    Ongoing,
}

#[derive(Debug, Clone)]
struct KeyState {
    /// The id of the latest hop.
    current: String,
    /// Ids seen, with the time each was last seen (ms).
    seen: Vec<(String, i64)>,
    /// Times of the latest returns (ms), oldest first; at most [`MAX_RETURNS_KEPT`].
    returns: VecDeque<i64>,
    /// When the conflict now reported was detected.
    since_ms: Option<i64>,
    /// The latest hop of any id (ms), for eviction.
    last_ms: i64,
}

/// Per-key record of instance ids, bounded in keys and in ids per key.
#[derive(Debug)]
pub struct InstanceTracker<K> {
    keys: HashMap<K, KeyState>,
    max_keys: usize,
    window_ms: i64,
}

impl<K: Eq + Hash + Clone> InstanceTracker<K> {
    /// A tracker holding at most `max_keys` keys (the least recently seen is dropped first),
    /// with the window [`CONFLICT_WINDOW_MS`].
    pub fn new(max_keys: usize) -> Self {
        Self::with_window(max_keys, CONFLICT_WINDOW_MS)
    }

    /// A tracker with another window (ms); for tests.
    pub fn with_window(max_keys: usize, window_ms: i64) -> Self {
        Self {
            keys: HashMap::new(),
            max_keys: max_keys.max(1),
            window_ms,
        }
    }

    /// Records a hop from `key` carrying instance id `id` at `now_ms`. An invalid id (see
    /// [`valid_instance_id`]) is ignored and answers [`Observation::Quiet`].
    pub fn observe(&mut self, key: &K, id: &str, now_ms: i64) -> Observation {
        if !valid_instance_id(id) {
            return Observation::Quiet;
        }
        let window = self.window_ms;
        if !self.keys.contains_key(key) {
            self.make_room(now_ms);
            self.keys.insert(
                key.clone(),
                KeyState {
                    current: id.to_owned(),
                    seen: vec![(id.to_owned(), now_ms)],
                    returns: VecDeque::new(),
                    since_ms: None,
                    last_ms: now_ms,
                },
            );
            return Observation::Quiet;
        }
        let Some(st) = self.keys.get_mut(key) else {
            return Observation::Quiet;
        };
        st.last_ms = now_ms;
        st.seen.retain(|(_, t)| now_ms - *t <= window);
        st.returns.retain(|t| now_ms - *t <= window);
        if st.since_ms.is_some() && st.returns.is_empty() {
            st.since_ms = None;
        }
        if st.current != id {
            let returning = st.seen.iter().any(|(s, _)| s == id);
            if returning {
                if st.returns.len() >= MAX_RETURNS_KEPT {
                    st.returns.pop_front();
                }
                st.returns.push_back(now_ms);
            } else if st.since_ms.is_none() {
                // A never-seen id with no conflict reported: a restart (or a clone's first
                // hop). Returns counted before it belong to earlier processes; forgetting them
                // keeps a stray request of each of several restarts from adding up.
                st.returns.clear();
            }
            st.current = id.to_owned();
        }
        match st.seen.iter_mut().find(|(s, _)| s == id) {
            Some(entry) => entry.1 = now_ms,
            None => {
                if st.seen.len() >= MAX_IDS_PER_KEY {
                    // Drop the id seen longest ago.
                    if let Some(pos) = st
                        .seen
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, (_, t))| *t)
                        .map(|(i, _)| i)
                    {
                        st.seen.remove(pos);
                    }
                }
                st.seen.push((id.to_owned(), now_ms));
            }
        }
        if st.returns.len() as u32 >= CONFLICT_RETURNS {
            if st.since_ms.is_none() {
                st.since_ms = Some(now_ms);
                return Observation::Detected(Self::conflict_of(st, window));
            }
            return Observation::Ongoing;
        }
        if st.since_ms.is_some() {
            Observation::Ongoing
        } else {
            Observation::Quiet
        }
    }

    /// The conflict reported for `key` at `now_ms`, if any: one is reported from its detection
    /// until a whole window passes without a return.
    pub fn conflict(&self, key: &K, now_ms: i64) -> Option<InstanceConflict> {
        let st = self.keys.get(key)?;
        st.since_ms?;
        let last = *st.returns.back()?;
        if now_ms - last > self.window_ms {
            return None;
        }
        let mut c = Self::conflict_of(st, self.window_ms);
        c.instances = st
            .seen
            .iter()
            .filter(|(_, t)| now_ms - *t <= self.window_ms)
            .count()
            .max(2) as u32;
        c.returns = st
            .returns
            .iter()
            .filter(|t| now_ms - **t <= self.window_ms)
            .count() as u32;
        Some(c)
    }

    /// Every key with a conflict reported at `now_ms`.
    pub fn conflicts(&self, now_ms: i64) -> Vec<(K, InstanceConflict)> {
        self.keys
            .keys()
            .filter_map(|k| self.conflict(k, now_ms).map(|c| (k.clone(), c)))
            .collect()
    }

    fn conflict_of(st: &KeyState, window_ms: i64) -> InstanceConflict {
        InstanceConflict {
            instances: st.seen.len().max(2) as u32,
            returns: st.returns.len() as u32,
            since_ms: st.since_ms.unwrap_or(st.last_ms),
            last_ms: st.returns.back().copied().unwrap_or(st.last_ms),
            window_ms,
        }
    }

    /// Drops keys idle for longer than the window; if still full, the least recently seen.
    fn make_room(&mut self, now_ms: i64) {
        if self.keys.len() < self.max_keys {
            return;
        }
        let window = self.window_ms;
        self.keys.retain(|_, st| now_ms - st.last_ms <= window);
        while self.keys.len() >= self.max_keys {
            let Some(oldest) = self
                .keys
                .iter()
                .min_by_key(|(_, st)| st.last_ms)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            self.keys.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: i64 = 1_000;

    #[test]
    fn a_restart_is_not_a_conflict() {
        let mut t = InstanceTracker::with_window(16, W);
        for (i, id) in ["a", "a", "b", "b", "c"].iter().enumerate() {
            assert_eq!(t.observe(&1u8, id, i as i64 * 10), Observation::Quiet);
        }
        assert_eq!(t.conflict(&1, 50), None);
    }

    #[test]
    fn one_stray_hop_of_the_old_process_is_not_a_conflict() {
        // The old process's last request is handled after the new process's first hop: a
        // comes back once, then b goes on alone (two returns, under the threshold).
        let mut t = InstanceTracker::with_window(16, W);
        for (i, id) in ["a", "b", "a", "b", "b", "b"].iter().enumerate() {
            assert_eq!(
                t.observe(&1u8, id, i as i64 * 10),
                Observation::Quiet,
                "hop {i}"
            );
        }
        assert_eq!(t.conflict(&1, 60), None);
    }

    #[test]
    fn stray_hops_of_several_restarts_in_one_window_do_not_add_up() {
        // Three restarts inside one window, each with one request of the old process handled
        // after the new one's first hop: two returns each, never three in a row.
        let mut t = InstanceTracker::with_window(16, W);
        let hops = ["a", "b", "a", "b", "c", "b", "c", "d", "c", "d", "d"];
        for (i, id) in hops.iter().enumerate() {
            assert_eq!(
                t.observe(&1u8, id, i as i64 * 10),
                Observation::Quiet,
                "hop {i}"
            );
        }
        assert_eq!(t.conflict(&1, 110), None);
    }

    #[test]
    fn alternation_is_detected_once_then_ongoing_then_clears_after_the_window() {
        let mut t = InstanceTracker::with_window(16, W);
        t.observe(&1u8, "a", 0);
        t.observe(&1u8, "b", 10);
        assert_eq!(t.observe(&1u8, "a", 20), Observation::Quiet);
        assert_eq!(t.observe(&1u8, "b", 30), Observation::Quiet);
        let Observation::Detected(c) = t.observe(&1u8, "a", 40) else {
            panic!("expected a detection");
        };
        assert_eq!(
            (c.instances, c.returns, c.since_ms, c.window_ms),
            (2, 3, 40, W)
        );
        assert_eq!(t.observe(&1u8, "b", 50), Observation::Ongoing);
        assert!(t.conflict(&1, 50).is_some());
        // Another key is not affected.
        assert_eq!(t.conflict(&2, 50), None);
        // One id from now on: reported until a whole window passes without a return.
        assert_eq!(t.observe(&1u8, "b", 500), Observation::Ongoing);
        assert!(t.conflict(&1, 1_050).is_some(), "still inside the window");
        assert_eq!(t.conflict(&1, 1_051), None);
        assert_eq!(t.observe(&1u8, "b", 1_100), Observation::Quiet);
        // A new alternation after clearing is a new detection.
        t.observe(&1u8, "a", 1_200);
        t.observe(&1u8, "b", 1_210);
        t.observe(&1u8, "a", 1_220);
        assert!(matches!(
            t.observe(&1u8, "b", 1_230),
            Observation::Detected(_)
        ));
    }

    #[test]
    fn returns_older_than_the_window_do_not_add_up() {
        let mut t = InstanceTracker::with_window(16, W);
        t.observe(&1u8, "a", 0);
        t.observe(&1u8, "b", 10);
        t.observe(&1u8, "a", 20); // one return
        t.observe(&1u8, "b", 30); // two returns
        t.observe(&1u8, "a", 1_500);
        t.observe(&1u8, "b", 1_600); // b was last seen at 30: outside the window, not a return
        assert_eq!(t.conflict(&1, 1_600), None);
        assert_eq!(t.observe(&1u8, "a", 1_700), Observation::Quiet); // first return in window
        assert_eq!(t.observe(&1u8, "b", 1_800), Observation::Quiet); // second
    }

    #[test]
    fn invalid_ids_never_count() {
        let mut t = InstanceTracker::with_window(16, W);
        let long = "x".repeat(MAX_INSTANCE_ID + 1);
        for (i, id) in ["", "a b", long.as_str(), "é", "", "a b"]
            .iter()
            .enumerate()
        {
            assert_eq!(t.observe(&1u8, id, i as i64), Observation::Quiet);
        }
        assert_eq!(t.conflict(&1, 10), None);
        assert!(valid_instance_id(&"x".repeat(MAX_INSTANCE_ID)));
        assert!(valid_instance_id(&new_instance_id()));
        assert_eq!(new_instance_id().len(), 32);
        assert_ne!(new_instance_id(), new_instance_id());
    }

    #[test]
    fn keys_and_ids_stay_bounded() {
        let mut t = InstanceTracker::with_window(4, W);
        for k in 0..100u32 {
            t.observe(&k, "a", i64::from(k));
        }
        assert!(t.keys.len() <= 4);
        let mut t = InstanceTracker::with_window(4, W);
        for i in 0..100i64 {
            t.observe(&0u8, &format!("id{i}"), i);
        }
        assert!(t.keys[&0].seen.len() <= MAX_IDS_PER_KEY);
        assert_eq!(
            t.conflict(&0, 100),
            None,
            "a chain of restarts never returns"
        );
        // Two ids alternating on every hop (the header is unsigned): the record stays the same
        // size, and the conflict is still reported.
        let mut t = InstanceTracker::with_window(4, W);
        for i in 0..10_000i64 {
            t.observe(&0u8, if i % 2 == 0 { "a" } else { "b" }, i / 100);
        }
        assert_eq!(t.keys[&0].returns.len(), MAX_RETURNS_KEPT);
        assert_eq!(t.keys[&0].seen.len(), 2);
        let c = t.conflict(&0, 100).expect("reported");
        assert_eq!((c.instances, c.returns), (2, MAX_RETURNS_KEPT as u32));
    }
}
