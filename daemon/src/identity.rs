//! The host identity: its name, its Ed25519 host key (signs envelopes and hops) and its X25519
//! enc key (opens sealed bodies), `wire.md` §2.1, §2.4, §6; plus the keys it rotated away from
//! (`wire.md` §2.10, [`rotation`]).
//!
//! This module owns creating the identity once (`init`) and loading it. Private keys live in the
//! home's key store ([`crate::keystore`]: the OS keyring, or 0600 files `host.key` and `enc.key`
//! in the 0.5.x key-file text, [`KeyFile::to_text`]). The store is chosen at `init` and recorded;
//! loading never switches it. `host.key` (file store) or the keyring marker
//! ([`keystore::KEYRING_MARKER`]) is written last: its presence is what "initialized" means, so
//! an interrupted `init` can simply be run again.
//!
//! It must never overwrite or regenerate an existing key outside a logged rotation (a new
//! identity is a new host to every peer), never log or return private key material, and never
//! mint keys while loading: a key missing from the keyring is an error, not a new identity.

pub mod rotation;

use std::path::PathBuf;

use agentmbx_protocol::keys::{EncKey, HostKey, KeyError, KeyFile, PublicKey};
use agentmbx_protocol::rotation::SignedRotation;
use agentmbx_protocol::seal;
use serde::Serialize;

use crate::config::{self, Config, ConfigError};
use crate::fsutil;
use crate::host_name::HostName;
use crate::keystore::{self, Backend, KeyStore, KeyStoreError, Secret};
use crate::paths::{Paths, PathsError};

/// Key store entry of the host key (`host.key`).
pub const HOST_KEY: &str = "host.key";
/// Key store entry of the enc key (`enc.key`).
pub const ENC_KEY: &str = "enc.key";

/// The identity is missing, incomplete, unreadable, or already exists.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// No `host.key` (nor keyring marker): the host was never initialized.
    #[error("this host is not initialized ({} not found); run `agentmbx init`", .path.display())]
    NotInitialized {
        /// The missing `host.key`.
        path: PathBuf,
    },
    /// `init` found an identity already in place and left it untouched.
    #[error("this host is already initialized ({} exists); refusing to replace its keys", .path.display())]
    AlreadyInitialized {
        /// The existing `host.key` (or keyring marker).
        path: PathBuf,
    },
    /// The host key exists but the enc key does not.
    #[error(
        "{name} is missing from {store} although the host key exists: the identity is incomplete"
    )]
    Incomplete {
        /// The missing entry (`enc.key`).
        name: String,
        /// Where it was looked for.
        store: String,
    },
    /// A keyring home whose keyring has no host key: reported, never replaced.
    #[error("this home keeps its keys in {store}, but it holds no {name} for this home; a new identity is never created in its place: unlock or restore the keyring, or move {} aside and run `agentmbx init` for a new host", .home.display())]
    MissingKey {
        /// The missing entry.
        name: String,
        /// Where it was looked for.
        store: String,
        /// The home directory.
        home: PathBuf,
    },
    /// Keys exist but `config.toml` names no host.
    #[error("{} does not name this host: add host = \"<name>\"", .path.display())]
    NoHostName {
        /// The config file.
        path: PathBuf,
    },
    /// An entry does not hold a valid key (the message never contains key material).
    #[error("{name} in {store}: {source}")]
    BadKey {
        /// The entry.
        name: String,
        /// Where it is.
        store: String,
        /// What is wrong.
        #[source]
        source: KeyError,
    },
    /// A rotation file (`rotations.json`, `retired-keys.json`) or lock could not be used.
    #[error("{}: {message}", .path.display())]
    RotationFile {
        /// The file.
        path: PathBuf,
        /// What is wrong (never key material).
        message: String,
    },
    /// A keyring home whose keyring does not answer here: nothing is created in its place.
    #[error("this home keeps its keys in the OS keyring ({}), which does not answer here: {why}; run agentmbx where that keyring is reachable (e.g. in the desktop session that unlocked it)", .marker.display())]
    KeyringUnavailable {
        /// The home's keyring marker.
        marker: PathBuf,
        /// Why the keyring does not answer.
        why: String,
    },
    /// The key store failed.
    #[error(transparent)]
    KeyStore(#[from] KeyStoreError),
    /// The home directory could not be created.
    #[error(transparent)]
    Paths(#[from] PathsError),
    /// `config.toml` could not be read or updated.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// The keys this host rotated away from, oldest first, and its rotation log (`wire.md` §2.10).
#[derive(Debug, Clone, Default)]
pub struct KeyHistory {
    /// Retired host public keys: still valid to verify this host's own signatures made before
    /// a rotation, never to sign.
    pub retired_host: Vec<PublicKey>,
    /// Retired enc keys: still open mail sealed to them before peers learned the new key.
    pub retired_enc: Vec<EncKey>,
    /// Every rotation this host made, oldest first (what the daemon announces).
    pub rotations: Vec<SignedRotation>,
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
    /// Where the private keys are kept.
    pub key_store: Backend,
    /// Retired keys and rotation records.
    pub history: KeyHistory,
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
    /// Where the private keys are kept: `keyring` or `file`.
    pub keystore: String,
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
            keystore: self.key_store.to_string(),
        }
    }

    /// Opens a sealed body (`wire.md` §2.4) with the current enc key, then with each retired
    /// one, newest first (mail sealed to a key this host rotated away from). Errors: the
    /// current key's error when no key opens it.
    pub fn open_sealed(
        &self,
        enc: &seal::Enc,
        envelope_id: &str,
    ) -> Result<String, seal::OpenError> {
        match seal::open(enc, &self.enc_key, envelope_id) {
            Ok(plain) => Ok(plain),
            Err(first) => self
                .history
                .retired_enc
                .iter()
                .rev()
                .find_map(|k| seal::open(enc, k, envelope_id).ok())
                .ok_or(first),
        }
    }

    /// This host's own host keys, current first, then the retired ones newest first: the keys
    /// that may have made this host's stored signatures.
    pub fn host_keys(&self) -> Vec<PublicKey> {
        std::iter::once(self.host_key.public())
            .chain(self.history.retired_host.iter().rev().cloned())
            .collect()
    }

    /// Whether `key` is this host's current or a retired host key.
    pub fn is_own_key(&self, key: &PublicKey) -> bool {
        self.host_keys().iter().any(|k| k == key)
    }
}

/// True when the home holds an identity: `host.key` (file store) or the keyring marker exists.
pub fn is_initialized(paths: &Paths) -> bool {
    keystore::recorded(paths).is_some()
}

/// Creates this host's identity: the home directory (0700), the host name in `config.toml`
/// ([`config::record_host`]), the key store ([`keystore::choose`]: `MBX_KEYSTORE`, else
/// `key_store`, else the OS keyring when it answers, else 0600 files with one warning), the enc
/// key (or the one an interrupted `init` left), last the host key, then the store's commit
/// point and `key_store` in `config.toml`.
///
/// The name is `requested`, else the one `config.toml` already records, else the machine's
/// host name fitted to the rule ([`HostName::from_machine`]).
/// Errors: [`IdentityError::AlreadyInitialized`] when an identity exists (nothing is changed),
/// a name conflicting with `config.toml`, a key store that cannot be used, I/O errors.
pub fn init(paths: &Paths, requested: Option<&HostName>) -> Result<Identity, IdentityError> {
    let (identity, created) = init_reporting(paths, requested)?;
    if let Some(warning) = &created.warning {
        tracing::warn!("{warning}");
    }
    Ok(identity)
}

/// Where [`init_reporting`] put the new keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeysCreated {
    /// The store's [`KeyStore::location`], e.g. "0600 files in /home/u/.agentmbx".
    pub location: String,
    /// Set when the OS keyring was tried and did not answer, so the keys fell back to files:
    /// says why, where they are and how to choose ([`keystore::Choice::warning`]).
    pub warning: Option<String>,
}

/// [`init`] that leaves the key store's fall-back warning to the caller (the CLI prints it;
/// its log level hides warnings) and says where the keys went. Errors: as [`init`].
pub fn init_reporting(
    paths: &Paths,
    requested: Option<&HostName>,
) -> Result<(Identity, KeysCreated), IdentityError> {
    paths.ensure_home()?;
    refuse_existing(paths)?;
    let choice = keystore::choose(paths, |v| std::env::var(v).ok(), keystore::probe_keyring)?;
    let store = keystore::open_backend(paths, choice.backend)?;
    let identity = init_with(paths, requested, &*store)?;
    let created = KeysCreated {
        location: store.location(),
        warning: choice.warning,
    };
    Ok((identity, created))
}

/// [`init`] into an already chosen `store` (its [`KeyStore::backend`] is what gets recorded).
pub fn init_with(
    paths: &Paths,
    requested: Option<&HostName>,
    store: &dyn KeyStore,
) -> Result<Identity, IdentityError> {
    paths.ensure_home()?;
    refuse_existing(paths)?;
    let recorded = Config::read_file(&paths.config_file())?.and_then(|c| c.host);
    let host = match (requested, recorded) {
        (Some(name), _) => name.clone(),
        (None, Some(name)) => name,
        (None, None) => HostName::from_machine(),
    };
    config::record_host(paths, &host)?;
    let backend = store.backend();

    let enc_key = match read_enc(store, ENC_KEY)? {
        Some(key) => key,
        None => {
            let key = EncKey::generate();
            store.create(ENC_KEY, &secret_of(&key.to_key_file()))?;
            key
        }
    };
    let host_key = match backend {
        Backend::File => {
            let key = HostKey::generate();
            store
                .create(HOST_KEY, &secret_of(&key.to_key_file()))
                .map_err(|e| match e {
                    KeyStoreError::Exists { .. } => IdentityError::AlreadyInitialized {
                        path: paths.host_key(),
                    },
                    other => other.into(),
                })?;
            key
        }
        // In the keyring the commit point is the marker: a host key an interrupted `init` left
        // there was never announced, so it is simply taken.
        Backend::Keyring => match read_host(store, HOST_KEY)? {
            Some(key) => key,
            None => {
                let key = HostKey::generate();
                store.put(HOST_KEY, &secret_of(&key.to_key_file()))?;
                key
            }
        },
    };
    if backend == Backend::Keyring {
        let marker = paths.home().join(keystore::KEYRING_MARKER);
        let text = format!(
            "This home's private keys are in {}.\nThis file holds no secret; it records where the keys are. Do not delete it.\n",
            store.location()
        );
        fsutil::create_new(&marker, text.as_bytes(), fsutil::PRIVATE_MODE).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                IdentityError::AlreadyInitialized {
                    path: marker.clone(),
                }
            } else {
                KeyStoreError::Io {
                    path: marker.clone(),
                    source: e,
                }
                .into()
            }
        })?;
    }
    config::record_key_store(paths, backend)?;
    tracing::info!(host = %host, home = %paths.home().display(), fingerprint = %host_key.public().fingerprint(), keystore = %backend, "host initialized");
    Ok(Identity {
        host,
        host_key,
        enc_key,
        key_store: backend,
        history: KeyHistory::default(),
    })
}

fn refuse_existing(paths: &Paths) -> Result<(), IdentityError> {
    match keystore::recorded(paths) {
        Some(Backend::File) => Err(IdentityError::AlreadyInitialized {
            path: paths.host_key(),
        }),
        Some(Backend::Keyring) => Err(IdentityError::AlreadyInitialized {
            path: paths.home().join(keystore::KEYRING_MARKER),
        }),
        None => Ok(()),
    }
}

/// Loads the identity: keys from the home's recorded key store ([`keystore::open`]), completing
/// an interrupted rotation first ([`rotation::finish`]), the name from `config` (already loaded).
/// Errors: [`IdentityError::NotInitialized`], [`IdentityError::MissingKey`] (keyring entry
/// gone), [`IdentityError::Incomplete`], [`IdentityError::NoHostName`], a key store that does
/// not answer or is asked to switch, bad keys.
pub fn load(paths: &Paths, config: &Config) -> Result<Identity, IdentityError> {
    if !is_initialized(paths) {
        return Err(IdentityError::NotInitialized {
            path: paths.host_key(),
        });
    }
    let store = keystore::open(paths, config)?;
    load_with(paths, config, &*store).map_err(|e| keyring_unavailable(paths, &*store, e))
}

/// Turns a keyring that does not answer into [`IdentityError::KeyringUnavailable`], which says
/// where the keys are and what to do.
pub(crate) fn keyring_unavailable(
    paths: &Paths,
    store: &dyn KeyStore,
    e: IdentityError,
) -> IdentityError {
    match e {
        IdentityError::KeyStore(KeyStoreError::Unavailable { why })
            if store.backend() == Backend::Keyring =>
        {
            IdentityError::KeyringUnavailable {
                marker: paths.home().join(keystore::KEYRING_MARKER),
                why,
            }
        }
        other => other,
    }
}

/// [`load`] from an already opened `store`.
pub fn load_with(
    paths: &Paths,
    config: &Config,
    store: &dyn KeyStore,
) -> Result<Identity, IdentityError> {
    if !is_initialized(paths) {
        return Err(IdentityError::NotInitialized {
            path: paths.host_key(),
        });
    }
    rotation::finish_if_staged(paths, store)?;
    load_keys(paths, config, store)
}

/// Reads the keys and history without touching a staged rotation (the caller holds the
/// rotation lock and has finished it).
pub(crate) fn load_keys(
    paths: &Paths,
    config: &Config,
    store: &dyn KeyStore,
) -> Result<Identity, IdentityError> {
    let missing = |name: &str| match store.backend() {
        Backend::File => IdentityError::NotInitialized {
            path: paths.home().join(name),
        },
        Backend::Keyring => IdentityError::MissingKey {
            name: name.to_string(),
            store: store.location(),
            home: paths.home().to_path_buf(),
        },
    };
    let host_key = read_host(store, HOST_KEY)?.ok_or_else(|| missing(HOST_KEY))?;
    let enc_key = read_enc(store, ENC_KEY)?.ok_or_else(|| match store.backend() {
        Backend::File => IdentityError::Incomplete {
            name: ENC_KEY.into(),
            store: store.location(),
        },
        Backend::Keyring => missing(ENC_KEY),
    })?;
    let host = config
        .host
        .clone()
        .ok_or_else(|| IdentityError::NoHostName {
            path: paths.config_file(),
        })?;
    let history = rotation::history(paths, store)?;
    Ok(Identity {
        host,
        host_key,
        enc_key,
        key_store: store.backend(),
        history,
    })
}

/// The key-file text of `file` as a [`Secret`].
pub(crate) fn secret_of(file: &KeyFile) -> Secret {
    Secret::new(file.to_text())
}

fn parse_file(store: &dyn KeyStore, name: &str, secret: &Secret) -> Result<KeyFile, IdentityError> {
    KeyFile::parse(secret.expose()).map_err(|source| IdentityError::BadKey {
        name: name.to_string(),
        store: store.location(),
        source,
    })
}

/// Reads and parses the host key entry `name`; `Ok(None)` when there is none.
pub(crate) fn read_host(
    store: &dyn KeyStore,
    name: &str,
) -> Result<Option<HostKey>, IdentityError> {
    let Some(secret) = store.get(name)? else {
        return Ok(None);
    };
    let file = parse_file(store, name, &secret)?;
    HostKey::from_key_file(&file)
        .map(Some)
        .map_err(|source| IdentityError::BadKey {
            name: name.to_string(),
            store: store.location(),
            source,
        })
}

/// Reads and parses the enc key entry `name`; `Ok(None)` when there is none.
pub(crate) fn read_enc(store: &dyn KeyStore, name: &str) -> Result<Option<EncKey>, IdentityError> {
    let Some(secret) = store.get(name)? else {
        return Ok(None);
    };
    let file = parse_file(store, name, &secret)?;
    EncKey::from_key_file(&file)
        .map(Some)
        .map_err(|source| IdentityError::BadKey {
            name: name.to_string(),
            store: store.location(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keystore::file::FileStore;
    use crate::keystore::mock::MockStore;

    #[test]
    fn init_then_load_then_refuse() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::at(dir.path().join("home"));
        assert!(matches!(
            load(&paths, &Config::default()),
            Err(IdentityError::NotInitialized { .. })
        ));
        let name = HostName::parse("alpha").unwrap();
        let store = FileStore::new(paths.home());
        let made = init_with(&paths, Some(&name), &store).unwrap();
        let config = Config::read_file(&paths.config_file()).unwrap().unwrap();
        assert_eq!(config.key_store, Backend::File);
        let loaded = load(&paths, &config).unwrap();
        assert_eq!(loaded.public(), made.public());
        assert_eq!(loaded.public().keystore, "file");
        assert_eq!(loaded.host.as_str(), "alpha");
        let before = std::fs::read(paths.host_key()).unwrap();
        assert!(matches!(
            init_with(&paths, None, &store),
            Err(IdentityError::AlreadyInitialized { .. })
        ));
        assert_eq!(std::fs::read(paths.host_key()).unwrap(), before);
    }

    #[test]
    fn interrupted_init_keeps_enc_key_and_config_name() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::at(dir.path());
        let store = FileStore::new(dir.path());
        let name = HostName::parse("beta").unwrap();
        let first = init_with(&paths, Some(&name), &store).unwrap();
        std::fs::remove_file(paths.host_key()).unwrap();
        let second = init_with(&paths, None, &store).unwrap();
        assert_eq!(second.host.as_str(), "beta");
        assert_eq!(second.enc_key.public(), first.enc_key.public());
        assert_ne!(second.host_key.public(), first.host_key.public());
    }

    #[test]
    fn missing_enc_key_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::at(dir.path());
        let store = FileStore::new(dir.path());
        init_with(&paths, Some(&HostName::parse("gamma").unwrap()), &store).unwrap();
        std::fs::remove_file(paths.enc_key()).unwrap();
        let config = Config::read_file(&paths.config_file()).unwrap().unwrap();
        assert!(matches!(
            load(&paths, &config),
            Err(IdentityError::Incomplete { .. })
        ));
    }

    #[test]
    fn a_keyring_home_keeps_no_key_file_and_a_lost_entry_is_never_a_new_identity() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::at(dir.path());
        let store = MockStore::new(Backend::Keyring);
        let made = init_with(&paths, Some(&HostName::parse("delta").unwrap()), &store).unwrap();
        assert!(!paths.host_key().exists() && !paths.enc_key().exists());
        assert!(paths.home().join(keystore::KEYRING_MARKER).is_file());
        assert_eq!(store.names(), vec![ENC_KEY, HOST_KEY]);
        assert!(is_initialized(&paths));
        let config = Config::read_file(&paths.config_file()).unwrap().unwrap();
        assert_eq!(config.key_store, Backend::Keyring);
        let loaded = load_with(&paths, &config, &store).unwrap();
        assert_eq!(loaded.public(), made.public());
        assert_eq!(loaded.public().keystore, "keyring");

        store.set_unavailable(Some("no Secret Service"));
        let err = load_with(&paths, &config, &store).unwrap_err();
        assert!(err.to_string().contains("no Secret Service"), "{err}");
        store.set_unavailable(None);
        store.delete(HOST_KEY).unwrap();
        let err = load_with(&paths, &config, &store).unwrap_err();
        assert!(matches!(err, IdentityError::MissingKey { .. }), "{err}");
        assert!(err.to_string().contains("never created"), "{err}");
        assert!(matches!(
            init_with(&paths, None, &store),
            Err(IdentityError::AlreadyInitialized { .. })
        ));
        assert_eq!(store.names(), vec![ENC_KEY], "nothing was minted");
    }

    #[test]
    fn errors_and_debug_never_show_private_keys() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::at(dir.path());
        let store = MockStore::new(Backend::Keyring);
        let id = init_with(&paths, Some(&HostName::parse("eps").unwrap()), &store).unwrap();
        let seed = id.host_key.seed_b64_secret();
        let enc = id.enc_key.private_b64_secret();
        let shown = format!("{id:?} {:?}", store.get(HOST_KEY).unwrap());
        assert!(!shown.contains(&seed) && !shown.contains(&enc), "{shown}");
        let bad = Secret::new(format!("{{\"publicKey\":\"x\",\"privateKey\":\"{seed}\"}}"));
        store.put(HOST_KEY, &bad).unwrap();
        let config = Config::read_file(&paths.config_file()).unwrap().unwrap();
        let err = load_with(&paths, &config, &store).unwrap_err();
        assert!(matches!(err, IdentityError::BadKey { .. }), "{err}");
        assert!(!err.to_string().contains(&seed) && !format!("{err:?}").contains(&seed));
    }
}
