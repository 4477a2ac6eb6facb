//! The relay's own Ed25519 key (spec §1): `MBX_RELAY_KEY` (the base64 seed `relay keygen`
//! prints; removed from the environment once read) or `<store>/relay.key` (JSON key pair, 0600),
//! created on first start. Errors never echo key material.
//!
//! Removing an environment variable races with every other thread reading the environment
//! (`getenv` in libc is not synchronised with `unsetenv`), so it happens only in
//! [`take_env_seed`], which the relay calls from `run::prepare` in the CLI's main thread before
//! the async runtime (or any other thread) starts. [`load_or_create`] never touches the
//! environment: it is handed the seed.

use std::io::Write;
use std::path::Path;

use agentmbx_protocol::keys::{HostKey, KeyFile};

/// Environment variable holding the relay key seed.
pub const RELAY_KEY_ENV: &str = "MBX_RELAY_KEY";

/// Why the relay key could not be had.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// `MBX_RELAY_KEY` is set but is not a 32-byte base64 seed.
    #[error("MBX_RELAY_KEY is not a valid relay key (expected the base64 seed printed by `agentmbx relay keygen`)")]
    BadEnv,
    /// `relay.key` exists but is not a valid key file.
    #[error("{0} is not a valid relay key file")]
    BadFile(String),
    /// I/O on `relay.key`.
    #[error("cannot read or create {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// Where the key came from (for the start-up log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeySource {
    /// `MBX_RELAY_KEY`.
    Env,
    /// An existing `relay.key`.
    File,
    /// A new `relay.key` written now.
    Created,
}

/// Reads `MBX_RELAY_KEY` and removes it from the environment, so child processes and later
/// readers never see the seed. A value that is not UTF-8 is returned lossily (and then refused
/// as [`KeyError::BadEnv`]).
///
/// **Call it only while this is the process's only thread** (before the async runtime starts):
/// see the module docs. `run::prepare` does.
pub fn take_env_seed() -> Option<String> {
    let seed = read_env_seed()?;
    std::env::remove_var(RELAY_KEY_ENV);
    Some(seed)
}

/// Reads `MBX_RELAY_KEY` without removing it (safe with other threads running).
pub fn read_env_seed() -> Option<String> {
    std::env::var_os(RELAY_KEY_ENV).map(|v| v.to_string_lossy().into_owned())
}

/// Loads the relay key: `env_seed` (the value of `MBX_RELAY_KEY`, see [`take_env_seed`]) first,
/// else `<dir>/relay.key`, created (0600, fsynced) when missing.
pub fn load_or_create(
    dir: &Path,
    env_seed: Option<&str>,
) -> Result<(HostKey, KeySource), KeyError> {
    if let Some(seed) = env_seed {
        let key = HostKey::from_seed_b64(seed.trim()).map_err(|_| KeyError::BadEnv)?;
        return Ok((key, KeySource::Env));
    }
    let path = dir.join("relay.key");
    let shown = path.display().to_string();
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let file = KeyFile::parse(&text).map_err(|_| KeyError::BadFile(shown.clone()))?;
            let key = HostKey::from_key_file(&file).map_err(|_| KeyError::BadFile(shown))?;
            Ok((key, KeySource::File))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = HostKey::generate();
            write_new(&path, &key.to_key_file().to_text()).map_err(|source| KeyError::Io {
                path: shown,
                source,
            })?;
            Ok((key, KeySource::Created))
        }
        Err(source) => Err(KeyError::Io {
            path: shown,
            source,
        }),
    }
}

fn write_new(path: &Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    if let Some(parent) = path.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn creates_0600_then_reuses_and_never_echoes() {
        let dir = tempfile::tempdir().unwrap();
        let (k1, s1) = load_or_create(dir.path(), None).unwrap();
        let (k2, s2) = load_or_create(dir.path(), None).unwrap();
        assert_eq!((s1, s2), (KeySource::Created, KeySource::File));
        assert_eq!(k1.public(), k2.public());
        let mode = std::fs::metadata(dir.path().join("relay.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(
            dir.path().join("relay.key"),
            "{\"publicKey\":\"x\",\"privateKey\":\"c2VjcmV0\"}",
        )
        .unwrap();
        let err = load_or_create(dir.path(), None).unwrap_err().to_string();
        assert!(!err.contains("c2VjcmV0"), "{err}");
    }

    #[test]
    fn a_seed_handed_in_wins_and_a_bad_one_is_refused_without_echo() {
        let dir = tempfile::tempdir().unwrap();
        let key = HostKey::generate();
        let seed = key.seed_b64_secret();
        let (k, source) = load_or_create(dir.path(), Some(&format!(" {seed}\n"))).unwrap();
        assert_eq!((k.public(), source), (key.public(), KeySource::Env));
        assert!(
            !dir.path().join("relay.key").exists(),
            "no key file when the seed is given"
        );
        let err = load_or_create(dir.path(), Some("c2VjcmV0"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("MBX_RELAY_KEY"), "{err}");
        assert!(!err.contains("c2VjcmV0"), "{err}");
    }
}
