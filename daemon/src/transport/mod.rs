//! Transports that move wire bytes between hosts: the LAN ([`lan`], first choice) and the
//! durable relay ([`relay_client`], after two failed LAN attempts; spec §10), and [`select`], the rule that chooses.

pub mod lan;
pub mod relay_client;
pub mod select;
