//! The local API bearer token (`api.token` in the home directory).
//!
//! This module owns the token's creation (32 random bytes from the OS, base64url without
//! padding, 43 characters, in a 0600 file created atomically) and its comparison with a
//! presented value in constant time. Agents on this machine read the file to call the API.
//!
//! It must never log, print or put the token in an error message; `Debug` redacts it.

use std::path::{Path, PathBuf};

use subtle::ConstantTimeEq;

use crate::fsutil;

/// Random bytes in a fresh token.
pub const TOKEN_BYTES: usize = 32;

/// The token file could not be created or read, or holds no usable token.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The file could not be read or written.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The token file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file exists but holds no token (empty, or not printable ASCII).
    #[error("{} does not hold a usable token; delete it to have a new one made", .path.display())]
    Malformed {
        /// The token file.
        path: PathBuf,
    },
}

/// The local API bearer token (a secret).
#[derive(Clone, PartialEq, Eq)]
pub struct ApiToken(String);

impl ApiToken {
    /// A fresh token: [`TOKEN_BYTES`] from the OS generator, base64url without padding.
    pub fn generate() -> Self {
        let mut raw = [0u8; TOKEN_BYTES];
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut raw);
        ApiToken(agentmbx_protocol::b64::encode_url(&raw))
    }

    /// Loads the token from `path`, creating the file (0600) with a fresh token when missing.
    /// Surrounding whitespace in the file is ignored. Errors: [`TokenError`].
    pub fn load_or_create(path: &Path) -> Result<Self, TokenError> {
        if let Some(token) = Self::load(path)? {
            return Ok(token);
        }
        let token = Self::generate();
        match fsutil::create_new(
            path,
            format!("{}\n", token.0).as_bytes(),
            fsutil::PRIVATE_MODE,
        ) {
            Ok(()) => {
                tracing::info!(path = %path.display(), "created local API token file");
                Ok(token)
            }
            // Another process made it first: use theirs.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Self::load(path)?
                .ok_or_else(|| TokenError::Malformed {
                    path: path.to_path_buf(),
                }),
            Err(source) => Err(TokenError::Io {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// Loads the token from `path`; `Ok(None)` when the file does not exist.
    pub fn load(path: &Path) -> Result<Option<Self>, TokenError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(TokenError::Io {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        let token = text.trim();
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::Malformed {
                path: path.to_path_buf(),
            });
        }
        Ok(Some(ApiToken(token.to_string())))
    }

    /// True when `presented` equals the token. Constant time in the contents (the length of
    /// the token is not secret).
    pub fn matches(&self, presented: &[u8]) -> bool {
        self.0.as_bytes().ct_eq(presented).into()
    }

    /// The token text: a secret, for the `Authorization` header of a client on this machine.
    pub fn expose_secret(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_once_then_reused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.token");
        let first = ApiToken::load_or_create(&path).unwrap();
        assert_eq!(first.expose_secret().len(), 43);
        let second = ApiToken::load_or_create(&path).unwrap();
        assert_eq!(first, second);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert!(!format!("{first:?}").contains(first.expose_secret()));
    }

    #[test]
    fn compares_exactly() {
        let t = ApiToken::generate();
        assert!(t.matches(t.expose_secret().as_bytes()));
        assert!(!t.matches(b""));
        let mut other = t.expose_secret().as_bytes().to_vec();
        other[0] ^= 1;
        assert!(!t.matches(&other));
        assert!(!t.matches(&t.expose_secret().as_bytes()[..42]));
    }

    #[test]
    fn empty_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.token");
        std::fs::write(&path, "\n").unwrap();
        assert!(matches!(
            ApiToken::load_or_create(&path),
            Err(TokenError::Malformed { .. })
        ));
    }
}
