//! Limits of the protocol, each with the reason for its value (`wire.md` §2.3, §3.1, §3.2; spec §7).

/// Plain body cap in UTF-8 bytes (0.5.x `MAX_BODY`, 256 KiB): larger content goes in refs.
pub const MAX_BODY: usize = 256 * 1024;
/// A sealed body on the wire: base64 of the MAX_BODY plaintext plus the 16-byte AEAD tag,
/// `4·ceil((262144+16)/3)` = 349,548 characters.
pub const MAX_SEALED_BODY: usize = 4 * (MAX_BODY + 16).div_ceil(3);
/// Subject cap in UTF-16 code units (JavaScript `length`).
pub const MAX_SUBJECT: usize = 200;
/// Recipients per envelope accepted from the network.
pub const MAX_RECIPIENTS: usize = 100;
/// Refs per envelope accepted from the network.
pub const MAX_REFS: usize = 100;
/// Cap for `from`, each recipient, `thread`, `reply_to` (UTF-16 code units).
pub const MAX_FIELD: usize = 300;
/// Cap for one ref (UTF-16 code units).
pub const MAX_REF: usize = 2048;
/// Saturating agent-to-agent relay depth in `meta.hop`.
pub const MAX_RELAY_DEPTH: u64 = 1000;
/// Cap for `meta.project` and `meta.project_key` (UTF-16 code units).
pub const MAX_PROJECT: usize = 300;
/// Cap for `meta.local_names` entries.
pub const MAX_LOCAL_NAMES: usize = 100;

/// Relay request body cap in bytes (`RELAY_MAX_BODY`, 8 MiB), checked while streaming (413).
pub const RELAY_MAX_BODY: usize = 8 * 1024 * 1024;
/// Body cap in bytes for challenge, enrol and rotate (small records only).
pub const RELAY_SMALL_BODY: usize = 8192;
/// Largest decoded wire item the relay stores: 768 KiB, so a legal 256 KiB body sealed (its
/// ciphertext appears twice, ~700 KB) always fits (`wire.md` "Resolved details": item size).
pub const MAX_ITEM_BYTES: usize = 768 * 1024;
/// Items per push request.
pub const MAX_BATCH: usize = 200;
/// Items per pull page (`n = clamp(limit, 1, MAX_PULL)`).
pub const MAX_PULL: usize = 500;
/// Approximate byte budget of one pull page (decoded wire bytes); a page always has ≥1 item.
pub const MAX_PULL_BYTES: usize = 8 * 1024 * 1024;
/// Targets per item (one per recipient host).
pub const MAX_TARGETS: usize = 64;
/// Item id length bound (characters).
pub const MAX_ITEM_ID: usize = 300;
/// Relay retention in days (owner decision 3): expires_at = accepted_at + 14 d.
pub const RETENTION_DAYS: u64 = 14;
/// Per target queue: 10,000 items (owner decision 3).
pub const MAX_QUEUE_ITEMS: u64 = 10_000;
/// Per target queue: 50 MiB (read as MiB, as 0.5.x publishes it).
pub const MAX_QUEUE_BYTES: u64 = 50 * 1024 * 1024;
/// Per sender per target share: 2,000 items (spec §7).
pub const MAX_SENDER_ITEMS: u64 = 2_000;
/// Per sender per target share: 20 MiB (spec §7).
pub const MAX_SENDER_BYTES: u64 = 20 * 1024 * 1024;
/// Per proven account: 10,000 items.
pub const MAX_OWNER_ITEMS: u64 = 10_000;
/// Per proven account: 50 MiB.
pub const MAX_OWNER_BYTES: u64 = 50 * 1024 * 1024;
/// Relay hop timestamp window (±ms, `wire.md` §2.6).
pub const RELAY_HOP_WINDOW_MS: i64 = 300_000;
/// LAN hop timestamp window (±ms, `wire.md` §2.5).
pub const LAN_HOP_WINDOW_MS: i64 = 300_000;
/// Host and agent name rule NAME_RE `^[a-z0-9][a-z0-9-]{1,39}$`: maximum length.
pub const MAX_NAME: usize = 40;
/// NAME_RE, the host and agent name rule as a regular expression (what [`is_name`] checks; the
/// local API's OpenAPI document states it as the names' `pattern`).
pub const NAME_RE: &str = "^[a-z0-9][a-z0-9-]{1,39}$";

/// True when `name` matches NAME_RE `^[a-z0-9][a-z0-9-]{1,39}$` (agent and host names).
pub fn is_name(name: &str) -> bool {
    let b = name.as_bytes();
    (2..=MAX_NAME).contains(&b.len())
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

/// Length in UTF-16 code units (JavaScript `String#length`).
pub fn utf16_len(s: &str) -> usize {
    s.encode_utf16().count()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sealed_cap_and_names() {
        assert_eq!(MAX_SEALED_BODY, 349_548);
        assert!(is_name("ab") && is_name(&"a".repeat(40)));
        assert!(!is_name("a") && !is_name(&"a".repeat(41)) && !is_name("-ab") && !is_name("Ab"));
    }
}
