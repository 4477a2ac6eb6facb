//! The host's mail logic, independent of transport: composing and storing what an agent sends
//! ([`send`]), verifying, opening and storing what a peer sent ([`receive`]) through the one
//! inbound path every transport uses ([`inbound`]), and accepting a peer's key rotation
//! ([`rotation`]).
//!
//! They run inside a caller's transaction (or open the transactions a transport asks for) and
//! never touch the network: the transports (`crate::transport`) move wire bytes, this module
//! decides what they mean.

pub mod alert;
pub mod inbound;
pub mod receipts;
pub mod receive;
pub mod rotation;
pub mod route;
pub mod send;
pub mod settle;
pub mod suggest;
pub mod unpair;
