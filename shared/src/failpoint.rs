//! Named crash points, compiled into every build and armed only by a spec string: the
//! environment for a binary, or a value a test hands to one in-process daemon (design README
//! "Decisions": failpoints).
//!
//! This module owns the spec grammar, the hit counters and the actions. It must never arm a
//! point by itself: with no spec, every point is a no-op.
//!
//! A spec (`MBX_FAILPOINTS` for binaries) is a comma-separated list of `name[=action][@n]`:
//! - `pause` (default): print `FAILPOINT <name> reached` on stderr and block this thread for
//!   good, so a test can SIGKILL the real process exactly at that boundary;
//! - `abort`: print the same line and abort the process at once;
//! - `hang`: print the same line and never return, without blocking a thread: an async point
//!   ([`Failpoints::hang_point`]) awaits forever, so only that task stops (a hung loop, for the
//!   service watchdog's tests) while the rest of the process runs; at a synchronous point
//!   ([`Failpoints::hit`]) it acts as `pause`;
//! - `@n`: act only on the n-th time the point is reached (1-based; default 1).
//!
//! A [`Failpoints`] value is one armed set with its own counters: the daemon's `run` receives
//! one and hands it to the loops that hit points, so two daemons in one process can have
//! different failpoints. [`Failpoints::from_env`] is the process's own set, read once from
//! `MBX_FAILPOINTS`; the free functions [`hit`], [`hang_point`] and [`armed`] use it (the relay
//! and the one-shot commands).
//!
//! Names used across the code base (spec §5 crash windows): relay `push:before-commit`,
//! `push:after-commit`, `pull:before-response`, `ack:before-commit`, `ack:after-commit`; sender
//! `push:before-send`, `push:after-response`; receiver `receive:after-deliver`,
//! `ack:before-send`, `ack:after-response`. Async points ([`Failpoints::hang_point`]): daemon
//! `lan:deliver-pass` (the start of each LAN delivery pass).
//!
//! With nothing armed, a hit is a scan of an empty list.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Environment variable that arms failpoints.
pub const FAILPOINTS_ENV: &str = "MBX_FAILPOINTS";

/// What an armed failpoint does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Announce on stderr and block forever (the test kills the process).
    Pause,
    /// Announce on stderr and abort the process.
    Abort,
    /// Announce on stderr; the task at an async point ([`Failpoints::hang_point`]) awaits
    /// forever (at a synchronous point, as [`Action::Pause`]).
    Hang,
}

#[derive(Debug)]
struct Armed {
    name: String,
    action: Action,
    nth: u64,
    seen: AtomicU64,
}

/// One armed set of failpoints and their hit counters. Cheap to clone: clones share the set and
/// the counters (an `Arc` inside). [`Failpoints::default`] arms nothing.
#[derive(Debug, Clone, Default)]
pub struct Failpoints(Arc<Vec<Armed>>);

impl Failpoints {
    /// The set a spec arms (grammar in the module docs). Entries that do not parse as an action
    /// or a count fall back to `pause` and 1; empty entries are skipped. Never fails.
    pub fn parse(spec: &str) -> Self {
        Failpoints(Arc::new(parse(spec)))
    }

    /// A set with nothing armed.
    pub fn none() -> Self {
        Self::default()
    }

    /// The process's set, armed by `MBX_FAILPOINTS` (read once, at the first call). Every call
    /// returns a handle to the same set and counters, which the free functions [`hit`],
    /// [`hang_point`] and [`armed`] use too.
    pub fn from_env() -> Self {
        static PROCESS: OnceLock<Failpoints> = OnceLock::new();
        PROCESS
            .get_or_init(|| Self::parse(&std::env::var(FAILPOINTS_ENV).unwrap_or_default()))
            .clone()
    }

    /// The armed action for this hit of `name`, if it fires now (counts the hit); announces it.
    fn fire(&self, name: &str) -> Option<Action> {
        for armed in self.0.iter() {
            if armed.name == name && armed.seen.fetch_add(1, Ordering::SeqCst) + 1 == armed.nth {
                let mut err = std::io::stderr().lock();
                let _ = writeln!(err, "FAILPOINT {name} reached");
                let _ = err.flush();
                return Some(armed.action);
            }
        }
        None
    }

    /// The crash point `name` is reached. Does nothing unless this set arms it.
    pub fn hit(&self, name: &str) {
        match self.fire(name) {
            Some(Action::Abort) => std::process::abort(),
            Some(Action::Pause | Action::Hang) => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
            None => {}
        }
    }

    /// The async point `name` is reached: with `hang` armed, the calling task awaits forever
    /// (`std::future::pending`), its thread free; `pause` blocks the thread and `abort` aborts,
    /// as in [`Self::hit`]. Does nothing unless this set arms it.
    pub async fn hang_point(&self, name: &str) {
        match self.fire(name) {
            Some(Action::Hang) => std::future::pending::<()>().await,
            Some(Action::Abort) => std::process::abort(),
            Some(Action::Pause) => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
            None => {}
        }
    }

    /// The armed points as `(name, action, nth)`, for a start-up log line.
    pub fn armed(&self) -> Vec<(String, Action, u64)> {
        self.0
            .iter()
            .map(|a| (a.name.clone(), a.action, a.nth))
            .collect()
    }
}

fn parse(spec: &str) -> Vec<Armed> {
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|entry| {
            let (rest, nth) = match entry.rsplit_once('@') {
                Some((r, n)) => (r, n.parse::<u64>().unwrap_or(1).max(1)),
                None => (entry, 1),
            };
            let (name, action) = match rest.split_once('=') {
                Some((n, "abort")) => (n, Action::Abort),
                Some((n, "hang")) => (n, Action::Hang),
                Some((n, _)) => (n, Action::Pause),
                None => (rest, Action::Pause),
            };
            Armed {
                name: name.to_string(),
                action,
                nth,
                seen: AtomicU64::new(0),
            }
        })
        .collect()
}

/// The crash point `name` is reached in the process's set ([`Failpoints::from_env`]). Does
/// nothing unless `MBX_FAILPOINTS` arms it.
pub fn hit(name: &str) {
    Failpoints::from_env().hit(name)
}

/// The async point `name` is reached in the process's set ([`Failpoints::from_env`]); see
/// [`Failpoints::hang_point`]. Does nothing unless `MBX_FAILPOINTS` arms it.
pub async fn hang_point(name: &str) {
    Failpoints::from_env().hang_point(name).await
}

/// The points `MBX_FAILPOINTS` arms, as `(name, action, nth)`, for a start-up log line.
pub fn armed() -> Vec<(String, Action, u64)> {
    Failpoints::from_env().armed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_actions_and_counts() {
        let v =
            parse("push:after-commit, ack:before-send=abort@3,,x=pause,lan:deliver-pass=hang@2");
        assert_eq!(v.len(), 4);
        assert_eq!(
            (v[0].name.as_str(), v[0].action, v[0].nth),
            ("push:after-commit", Action::Pause, 1)
        );
        assert_eq!(
            (v[1].name.as_str(), v[1].action, v[1].nth),
            ("ack:before-send", Action::Abort, 3)
        );
        assert_eq!(v[2].action, Action::Pause);
        assert_eq!(
            (v[3].name.as_str(), v[3].action, v[3].nth),
            ("lan:deliver-pass", Action::Hang, 2)
        );
    }

    #[test]
    fn two_sets_count_and_fire_apart() {
        let a = Failpoints::parse("p=hang@2");
        let b = Failpoints::none();
        let a2 = a.clone();
        a.hit("other");
        assert_eq!(a.fire("p"), None);
        b.hit("p");
        assert!(b.armed().is_empty());
        // The clone shares the counter: this is the second hit of `p`.
        assert_eq!(a2.fire("p"), Some(Action::Hang));
        assert_eq!(a.fire("p"), None);
    }
}
