//! Transports that move wire bytes between hosts. This slice has one: the durable relay
//! ([`relay_client`]); the LAN transport and transport selection come next.

pub mod relay_client;
