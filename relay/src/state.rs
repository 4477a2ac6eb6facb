//! The relay's shared state: everything a handler can reach ([`RelayState`], behind
//! [`SharedRelay`]).
//!
//! # What it owns
//! The shape of the state and how `serve` and the in-process test relay build it. The router,
//! the accept loop and the background loops are [`crate::server`]'s.
//!
//! # What it must never do
//! Depend on the handlers, the server or the background loops: every one of them reads this
//! state, so it sits below them all.

use std::sync::Arc;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::keys::HostKey;

use crate::authority::challenge::Challenges;
use crate::config::RelayConfig;
use crate::store::RelayStore;

/// Everything a handler can reach.
#[derive(Debug)]
pub struct RelayState {
    /// The store (every call blocks: use `auth::blocking`).
    pub store: Arc<dyn RelayStore>,
    /// The relay key (signs accept statements).
    pub key: HostKey,
    /// The one clock.
    pub clock: SharedClock,
    /// Limits and settings.
    pub config: RelayConfig,
    /// Outstanding enrolment challenges (memory only, bounded).
    pub challenges: Challenges,
    /// Software version reported by info.
    pub version: &'static str,
    /// Requests whose head has been read and whose answer is not yet sent (for status lines,
    /// and for tests that must know a request is in flight).
    pub in_flight: std::sync::atomic::AtomicUsize,
    /// Rate tables and the request-body budget (`RateLimits::new(&config)`).
    pub rates: crate::ratelimit::RateLimits,
    /// The enrolment authority (`authority::from_config(&config.authority, clock)`), asked at
    /// every enrolment and, for the account authority, on every hop.
    pub authority: Arc<dyn crate::authority::EnrolmentAuthority>,
    /// The absolute path of the store's `relay.db`: the `store` of the operation receipts the
    /// relay writes ([`crate::ops::store_db`]).
    pub store_db: String,
    /// Refused pushed items and requests by reason since start (`Default::default()`;
    /// `GET /v2/relay/admin/stats` `refused`).
    pub refused: crate::refusals::Refusals,
    /// Instance ids seen per host key: two daemons on one key (`Instances::default()`).
    pub instances: crate::instances::Instances,
    /// The open push streams and the publish path (`docs/relay-stream.md`).
    pub streams: Arc<crate::stream::hub::Hub>,
    /// Outstanding stream nonces (`you.stream_nonce`), single use, bounded.
    pub nonces: crate::stream::nonce::Nonces,
}

impl RelayState {
    /// The state `serve` runs on: `store`, `key`, `clock`, `config` and the enrolment
    /// `authority` as given, fresh rate tables from `config`, no challenges, no requests in
    /// flight, no refusals counted, no instances seen. `store_db` is the store's `relay.db`
    /// ([`crate::ops::store_db`]). `relay serve` and the in-process test relay both build it here.
    pub fn new(
        store: Arc<dyn RelayStore>,
        key: HostKey,
        clock: SharedClock,
        config: RelayConfig,
        authority: Arc<dyn crate::authority::EnrolmentAuthority>,
        store_db: String,
    ) -> Self {
        RelayState {
            rates: crate::ratelimit::RateLimits::new(&config),
            store,
            key,
            clock,
            config,
            challenges: Challenges::default(),
            version: crate::VERSION,
            in_flight: Default::default(),
            authority,
            store_db,
            refused: Default::default(),
            instances: Default::default(),
            streams: Default::default(),
            nonces: Default::default(),
        }
    }
}

/// Shared handle to [`RelayState`].
pub type SharedRelay = Arc<RelayState>;
