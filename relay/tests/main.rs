//! Integration tests of the relay crate: `agentmbx-relay`'s one integration-test binary,
//! `integration`. This file owns only the module list; each module is one area (before, a test
//! binary of its own) and keeps its tests' names, so a test's path is `<area>::<test>`
//! (`conformance::<rule>`, `http::…`). `helper` holds the fixtures: the real server over a fresh
//! SQLite store on 127.0.0.1 driven by a manual clock, a client that signs hops, and factories
//! for keys, envelopes, receipts and enc-key ads. The store fixture is read from
//! `relay/tests/fixtures/`.
//!
//! One area: `cargo nextest run -p agentmbx-relay --test integration -E 'test(/^bounds::/)'`.
//!
//! The suite runs under nextest, which gives every test its own process. No test may rely on
//! sharing state with another through this process; `prepare` sets `MBX_RELAY_KEY` in the
//! process environment and relies on having the process to itself (under `cargo test`, run it
//! alone: `cargo test -p agentmbx-relay --test integration prepare::`).

mod helper;

mod authority;
mod bounds;
mod conformance;
mod hardening;
mod http;
mod instances;
mod prepare;
mod retention;
mod store_fixture;
mod stream;
mod trust;
