//! The host's mail logic, independent of transport: composing and storing what an agent sends
//! ([`send`]), sealing and signing the wire bytes of each target once ([`outbound`]), verifying,
//! opening and storing what a peer sent ([`receive`]) through the one inbound path every
//! transport uses ([`inbound`]), and accepting a peer's key rotation ([`rotation`]).
//!
//! [`send`] and [`receive`] run inside a caller's transaction; [`inbound`] and the steps of
//! [`outbound`] open the transactions a transport asks for on the caller's connection. None
//! touches the network: the transports (`crate::transport`) move wire bytes, this module
//! decides what they mean.

pub mod alert;
pub mod inbound;
pub mod outbound;
pub mod receipts;
pub mod receive;
pub mod rotation;
pub mod route;
pub mod send;
pub mod settle;
pub mod suggest;
pub mod unpair;
