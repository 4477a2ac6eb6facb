//! Host pairing (`wire.md` §2.9): the one-time token flow (`pair` / `join`) and the
//! commit-reveal 6-digit comparison (`pair --compare` / `pair approve`).

/// In-memory pairing state held by the LAN server: hello nonces, comparison commitments and
/// the pairing rate limits. Lost on restart by design (every entry lives ≤ 2 minutes).
#[derive(Debug, Default)]
pub struct PairingMemory {}
