//! Host names: the local handle of a host, as it appears in addresses (`agent@host`), in
//! `config.toml` and on the relay as a label.
//!
//! This module owns the name rule ([`NAME_RE`]) and the fitting of a machine host name to it.
//! It must never do I/O beyond asking the OS for the machine's host name
//! ([`HostName::from_machine`]), and never accept a name that breaks the rule: a [`HostName`]
//! value is valid by construction.

use std::fmt;
use std::str::FromStr;

/// The host name rule, as a regular expression (for docs and messages; the check is
/// hand-written in [`HostName::parse`]): a lowercase letter or digit, then 1 to 39 lowercase
/// letters, digits or hyphens, so 2 to 40 characters in all.
pub const NAME_RE: &str = "^[a-z0-9][a-z0-9-]{1,39}$";

/// Longest host name, in characters (ASCII, so also bytes).
pub const MAX_LEN: usize = 40;

/// Name used when the machine's host name has nothing usable in it.
pub const FALLBACK: &str = "host";

/// A host name that does not follow [`NAME_RE`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid host name {0:?}: it must match {NAME_RE} (2-40 of a-z, 0-9 and '-', not starting with '-')")]
pub struct HostNameError(pub String);

/// A valid host name (matches [`NAME_RE`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostName(String);

impl HostName {
    /// Checks `text` against [`NAME_RE`]. Errors: [`HostNameError`] carrying the text.
    pub fn parse(text: &str) -> Result<Self, HostNameError> {
        let bytes = text.as_bytes();
        let allowed = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-';
        let ok =
            (2..=MAX_LEN).contains(&bytes.len()) && bytes[0] != b'-' && bytes.iter().all(allowed);
        if ok {
            Ok(HostName(text.to_string()))
        } else {
            Err(HostNameError(text.to_string()))
        }
    }

    /// Fits any text to the rule: lowercased, every character outside `[a-z0-9-]` replaced by
    /// `-`, leading and trailing hyphens trimmed, cut to [`MAX_LEN`] characters (and trimmed
    /// again). When nothing valid is left, [`FALLBACK`].
    pub fn fit(raw: &str) -> Self {
        let mapped: String = raw
            .trim()
            .to_lowercase()
            .chars()
            .map(|c| {
                if c.is_ascii_lowercase() || c.is_ascii_digit() {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        let trimmed = mapped.trim_matches('-');
        let cut: String = trimmed.chars().take(MAX_LEN).collect();
        HostName::parse(cut.trim_end_matches('-'))
            .unwrap_or_else(|_| HostName(FALLBACK.to_string()))
    }

    /// The machine's host name (from the OS), fitted with [`HostName::fit`]. Used by `init`
    /// without `--host` and by a daemon that initializes a fresh home by itself.
    pub fn from_machine() -> Self {
        let raw = gethostname::gethostname();
        HostName::fit(&raw.to_string_lossy())
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for HostName {
    type Err = HostNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        HostName::parse(s)
    }
}

impl fmt::Display for HostName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl serde::Serialize for HostName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for HostName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        HostName::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rule_accepts_and_refuses() {
        for ok in ["ab", "host-1", "0x", "a-", &"a".repeat(40)] {
            assert!(HostName::parse(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a", "-ab", "Ab", "a_b", "a.b", "é1", &"a".repeat(41)] {
            assert!(HostName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn fitting_machine_names() {
        assert_eq!(HostName::fit("My.Laptop.local").as_str(), "my-laptop-local");
        assert_eq!(HostName::fit("  --Büro_PC--  ").as_str(), "b-ro-pc");
        assert_eq!(HostName::fit("x").as_str(), FALLBACK);
        assert_eq!(HostName::fit("").as_str(), FALLBACK);
        assert_eq!(HostName::fit("---").as_str(), FALLBACK);
        let long = format!("{}-{}", "a".repeat(39), "b".repeat(10));
        assert_eq!(HostName::fit(&long).as_str(), "a".repeat(39));
        assert!(HostName::parse(HostName::from_machine().as_str()).is_ok());
    }
}
