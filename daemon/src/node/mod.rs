//! The host's mail logic, independent of transport: composing and storing what an agent sends
//! ([`send`]), sealing and signing the wire bytes of each target once ([`outbound`]), and
//! verifying, opening and storing what a peer sent ([`receive`]).
//!
//! [`send`] and [`receive`] run inside a caller's transaction; the steps of [`outbound`] open
//! their own on the caller's connection. None touches the network: the transports
//! (`crate::transport`) move wire bytes, this module decides what they mean.

pub mod alert;
pub mod outbound;
pub mod receipts;
pub mod receive;
pub mod route;
pub mod send;
pub mod settle;
pub mod suggest;
pub mod unpair;
