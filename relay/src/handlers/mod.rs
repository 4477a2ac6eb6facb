//! One file per relay resource (`wire.md` §3.1). Each handler reads its body under the cap,
//! authenticates, validates, calls the store (off the async runtime) and answers only after the
//! store call returned, i.e. after its transaction committed.

pub mod ack;
pub mod admin;
pub mod enc_key;
pub mod enrol;
pub mod info;
pub mod items_pull;
pub mod items_push;
pub mod rotate;
pub mod senders;
pub mod stream;
