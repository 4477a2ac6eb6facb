//! The host identity: its name, its Ed25519 host key (signs envelopes and hops) and its X25519
//! enc key (opens sealed bodies), `wire.md` §2.1, §2.4, §6.
//!
//! This module owns creating the identity once (`init`) and loading it. Keys live in 0600 files
//! `host.key` and `enc.key` in the home directory, in the 0.5.x key-file text
//! ([`KeyFile::to_text`]), each created atomically with its final mode ([`fsutil::create_new`]).
//! `host.key` is written last: its presence is what "initialized" means, so an interrupted
//! `init` can simply be run again.
//!
//! It must never overwrite or regenerate an existing key (a new identity is a new host to every
//! peer), never log or return private key material, and never mint keys while loading.

use std::path::{Path, PathBuf};

use agentmbx_protocol::keys::{EncKey, HostKey, KeyError, KeyFile};
use serde::Serialize;

use crate::config::{self, Config, ConfigError};
use crate::fsutil;
use crate::host_name::HostName;
use crate::paths::{Paths, PathsError};

/// The identity is missing, incomplete, unreadable, or already exists.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// No `host.key`: the host was never initialized.
    #[error("this host is not initialized ({} not found); run `agentmbx init`", .path.display())]
    NotInitialized {
        /// The missing `host.key`.
        path: PathBuf,
    },
    /// `init` found an identity already in place and left it untouched.
    #[error("this host is already initialized ({} exists); refusing to replace its keys", .path.display())]
    AlreadyInitialized {
        /// The existing `host.key`.
        path: PathBuf,
    },
    /// `host.key` exists but `enc.key` does not.
    #[error("{} is missing although host.key exists: the identity is incomplete", .path.display())]
    Incomplete {
        /// The missing `enc.key`.
        path: PathBuf,
    },
    /// Keys exist but `config.toml` names no host.
    #[error("{} does not name this host: add host = \"<name>\"", .path.display())]
    NoHostName {
        /// The config file.
        path: PathBuf,
    },
    /// A key file does not hold a valid key (the message never contains key material).
    #[error("{}: {source}", .path.display())]
    BadKeyFile {
        /// The key file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: KeyError,
    },
    /// A key file could not be read or written.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The key file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The home directory could not be created.
    #[error(transparent)]
    Paths(#[from] PathsError),
    /// `config.toml` could not be read or updated.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// The host's name and keys, loaded.
#[derive(Debug, Clone)]
pub struct Identity {
    /// This host's name.
    pub host: HostName,
    /// The Ed25519 host key.
    pub host_key: HostKey,
    /// The X25519 enc key.
    pub enc_key: EncKey,
}

/// The public half of an identity, as `whoami --json` and `init --json` print it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PublicIdentity {
    /// Host name.
    pub host: String,
    /// Host public key, standard base64 of 32 bytes.
    pub host_pubkey: String,
    /// `fingerprint(host_pubkey)`, `xxxx-xxxx-xxxx-xxxx` (`wire.md` §2.1).
    pub fingerprint: String,
    /// Enc public key (X25519), standard base64 of 32 bytes.
    pub enc_pub: String,
}

impl Identity {
    /// The public half.
    pub fn public(&self) -> PublicIdentity {
        let public = self.host_key.public();
        PublicIdentity {
            host: self.host.to_string(),
            host_pubkey: public.to_b64(),
            fingerprint: public.fingerprint(),
            enc_pub: self.enc_key.public().to_b64(),
        }
    }
}

/// True when `host.key` exists in the home (the identity's commit point).
pub fn is_initialized(paths: &Paths) -> bool {
    paths.host_key().symlink_metadata().is_ok()
}

/// Creates this host's identity: the home directory (0700), the host name in `config.toml`
/// ([`config::record_host`]), `enc.key` (or the one an interrupted `init` left), and last
/// `host.key`.
///
/// The name is `requested`, else the one `config.toml` already records, else the machine's
/// host name fitted to the rule ([`HostName::from_machine`]).
/// Errors: [`IdentityError::AlreadyInitialized`] when `host.key` exists (nothing is changed),
/// a name conflicting with `config.toml`, I/O errors.
pub fn init(paths: &Paths, requested: Option<&HostName>) -> Result<Identity, IdentityError> {
    paths.ensure_home()?;
    let host_key_path = paths.host_key();
    if is_initialized(paths) {
        return Err(IdentityError::AlreadyInitialized {
            path: host_key_path,
        });
    }
    let recorded = Config::read_file(&paths.config_file())?.and_then(|c| c.host);
    let host = match (requested, recorded) {
        (Some(name), _) => name.clone(),
        (None, Some(name)) => name,
        (None, None) => HostName::from_machine(),
    };
    config::record_host(paths, &host)?;

    let enc_path = paths.enc_key();
    let enc_key = match read_key_file(&enc_path)? {
        Some(file) => EncKey::from_key_file(&file).map_err(|source| IdentityError::BadKeyFile {
            path: enc_path.clone(),
            source,
        })?,
        None => {
            let key = EncKey::generate();
            write_key_file(&enc_path, &key.to_key_file())?;
            key
        }
    };

    let host_key = HostKey::generate();
    write_key_file(&host_key_path, &host_key.to_key_file()).map_err(|e| match e {
        IdentityError::Io { source, .. } if source.kind() == std::io::ErrorKind::AlreadyExists => {
            IdentityError::AlreadyInitialized {
                path: host_key_path.clone(),
            }
        }
        other => other,
    })?;
    tracing::info!(host = %host, home = %paths.home().display(), fingerprint = %host_key.public().fingerprint(), "host initialized");
    Ok(Identity {
        host,
        host_key,
        enc_key,
    })
}

/// Loads the identity: keys from their files, the name from `config` (already loaded).
/// Errors: [`IdentityError::NotInitialized`] without `host.key`, [`IdentityError::Incomplete`]
/// without `enc.key`, [`IdentityError::NoHostName`], bad or unreadable key files.
pub fn load(paths: &Paths, config: &Config) -> Result<Identity, IdentityError> {
    let host_path = paths.host_key();
    let host_file = read_key_file(&host_path)?.ok_or_else(|| IdentityError::NotInitialized {
        path: host_path.clone(),
    })?;
    let host_key =
        HostKey::from_key_file(&host_file).map_err(|source| IdentityError::BadKeyFile {
            path: host_path,
            source,
        })?;
    let enc_path = paths.enc_key();
    let enc_file = read_key_file(&enc_path)?.ok_or_else(|| IdentityError::Incomplete {
        path: enc_path.clone(),
    })?;
    let enc_key = EncKey::from_key_file(&enc_file).map_err(|source| IdentityError::BadKeyFile {
        path: enc_path,
        source,
    })?;
    let host = config
        .host
        .clone()
        .ok_or_else(|| IdentityError::NoHostName {
            path: paths.config_file(),
        })?;
    Ok(Identity {
        host,
        host_key,
        enc_key,
    })
}

/// Reads and parses a key file; `Ok(None)` when it does not exist. Warns when the file can be
/// read by group or others.
fn read_key_file(path: &Path) -> Result<Option<KeyFile>, IdentityError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(IdentityError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    #[cfg(unix)]
    if let Ok(meta) = std::fs::metadata(path) {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(path = %path.display(), mode = format!("{mode:o}"), "key file is accessible to other users; run chmod 600 on it");
        }
    }
    KeyFile::parse(&text)
        .map(Some)
        .map_err(|source| IdentityError::BadKeyFile {
            path: path.to_path_buf(),
            source,
        })
}

fn write_key_file(path: &Path, file: &KeyFile) -> Result<(), IdentityError> {
    fsutil::create_new(path, file.to_text().as_bytes(), fsutil::PRIVATE_MODE).map_err(|source| {
        IdentityError::Io {
            path: path.to_path_buf(),
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_then_load_then_refuse() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::at(dir.path().join("home"));
        assert!(matches!(
            load(&paths, &Config::default()),
            Err(IdentityError::NotInitialized { .. })
        ));
        let name = HostName::parse("alpha").unwrap();
        let made = init(&paths, Some(&name)).unwrap();
        let config = Config::read_file(&paths.config_file()).unwrap().unwrap();
        let loaded = load(&paths, &config).unwrap();
        assert_eq!(loaded.public(), made.public());
        assert_eq!(loaded.host.as_str(), "alpha");
        let before = std::fs::read(paths.host_key()).unwrap();
        assert!(matches!(
            init(&paths, None),
            Err(IdentityError::AlreadyInitialized { .. })
        ));
        assert_eq!(std::fs::read(paths.host_key()).unwrap(), before);
    }

    #[test]
    fn interrupted_init_keeps_enc_key_and_config_name() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::at(dir.path());
        let name = HostName::parse("beta").unwrap();
        let first = init(&paths, Some(&name)).unwrap();
        std::fs::remove_file(paths.host_key()).unwrap();
        let second = init(&paths, None).unwrap();
        assert_eq!(second.host.as_str(), "beta");
        assert_eq!(second.enc_key.public(), first.enc_key.public());
        assert_ne!(second.host_key.public(), first.host_key.public());
    }

    #[test]
    fn missing_enc_key_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::at(dir.path());
        init(&paths, Some(&HostName::parse("gamma").unwrap())).unwrap();
        std::fs::remove_file(paths.enc_key()).unwrap();
        let config = Config::read_file(&paths.config_file()).unwrap().unwrap();
        assert!(matches!(
            load(&paths, &config),
            Err(IdentityError::Incomplete { .. })
        ));
    }
}
