//! Where the host's private keys live (design README "Key store"; dependencies.md "OS keyring on
//! headless Linux"): the OS keyring ([`keyring::KeyringStore`]: Secret Service on Linux, the
//! macOS Keychain, the Windows Credential Manager) or 0600 files in the home
//! ([`file::FileStore`]), behind one small trait of named secrets ([`KeyStore`]).
//!
//! The store is chosen once, at `init` ([`choose`]): `MBX_KEYSTORE=keyring|file` when set, else
//! a `key_store` line the owner wrote into `config.toml`, else the OS keyring when it answers a
//! harmless write/read/delete probe, else the file store with one warning that says why and how
//! to choose explicitly. The choice is recorded in `config.toml` (`key_store`), and a keyring
//! home also gets the marker file [`KEYRING_MARKER`] when its keys are complete, so an
//! initialised home always says where its keys are ([`recorded`]). Loading opens that store and
//! nothing else ([`open`]): a different `MBX_KEYSTORE` or `key_store` is an error, never a silent
//! switch, and a missing keyring entry is reported, never replaced by a new identity.
//!
//! Entry names are the file names of the home (`host.key`, `enc.key`, `host.key.next`, …);
//! keyring entries are service [`SERVICE`], account `<name>@<home>` with the home's canonical
//! path, so two homes on one machine never share an entry.
//!
//! This module must never log, print or put in an error the bytes of a secret: [`Secret`]'s
//! `Debug` is redacted and errors name entries and stores only.

pub mod file;
pub mod keyring;
pub mod mock;

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use crate::config::KeyStore as Backend;
use crate::config::{Config, ConfigError};
use crate::paths::Paths;

/// Chooses the key store at `init`, and must agree with the recorded one afterwards.
pub const KEYSTORE_ENV: &str = "MBX_KEYSTORE";

/// Keyring service name of every entry.
pub const SERVICE: &str = "agentmbx";

/// Marker file in a keyring home: present once its keys are in the keyring (the commit point of
/// `init` for that store, as `host.key` is for the file store). It holds no secret.
pub const KEYRING_MARKER: &str = "host.key.keyring";

/// Longest wait for the keyring probe at `init`: a locked keyring that waits for a password
/// prompt counts as not answering.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// A secret text (a key file's JSON). `Debug` never shows it; read it with [`Secret::expose`].
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret text.
    pub fn new(text: impl Into<String>) -> Self {
        Secret(text.into())
    }

    /// The secret text, for parsing or writing it: never log or print it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// A key store could not be chosen, opened, read or written. Messages name entries, paths and
/// stores, never secret values.
#[derive(Debug, thiserror::Error)]
pub enum KeyStoreError {
    /// A key file could not be read or written.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// [`KeyStore::create`] found the entry already there and left it untouched.
    #[error("{name} already exists in {store}; refusing to replace it")]
    Exists {
        /// The entry.
        name: String,
        /// Where (e.g. the home directory or the keyring).
        store: String,
    },
    /// The OS keyring does not answer (no Secret Service, no D-Bus session, locked, timed out).
    #[error("the OS keyring is not available: {why}")]
    Unavailable {
        /// What failed.
        why: String,
    },
    /// The OS keyring answered an operation with an error.
    #[error("the OS keyring failed to {op} {name}: {why}")]
    Keyring {
        /// `read`, `write` or `delete`.
        op: &'static str,
        /// The entry.
        name: String,
        /// The keyring's reason (never the secret).
        why: String,
    },
    /// An entry name outside `[a-z0-9._-]{1,64}`.
    #[error("bad key store entry name {0:?}")]
    BadName(String),
    /// `MBX_KEYSTORE` (or `key_store`) names no store.
    #[error("{var}={value:?} is not a key store: use keyring or file")]
    BadChoice {
        /// The variable or key.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// A choice that contradicts where this home's keys already are.
    #[error("this home keeps its keys in the {recorded} store ({where_}); {source_name} = {requested} cannot switch it: {fix}")]
    Switch {
        /// Where the keys are.
        recorded: Backend,
        /// Where they are, in words.
        where_: String,
        /// `MBX_KEYSTORE` or `config.toml key_store`.
        source_name: &'static str,
        /// The store asked for.
        requested: Backend,
        /// What to do.
        fix: String,
    },
    /// `config.toml` could not be read.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// Named secrets of one home. Implementations: [`file::FileStore`], [`keyring::KeyringStore`],
/// [`mock::MockStore`] (tests).
pub trait KeyStore: Send + Sync + std::fmt::Debug {
    /// Which store this is.
    fn backend(&self) -> Backend;

    /// Where the secrets are, in words (`0600 files in /h`, `the OS keyring (service agentmbx)`).
    fn location(&self) -> String;

    /// The secret named `name`, `None` when there is none.
    fn get(&self, name: &str) -> Result<Option<Secret>, KeyStoreError>;

    /// Creates or replaces `name` atomically (a reader sees the old or the new secret).
    fn put(&self, name: &str, secret: &Secret) -> Result<(), KeyStoreError>;

    /// Creates `name`; [`KeyStoreError::Exists`] (and nothing changed) when it exists.
    fn create(&self, name: &str, secret: &Secret) -> Result<(), KeyStoreError>;

    /// Deletes `name`; deleting a missing entry succeeds.
    fn delete(&self, name: &str) -> Result<(), KeyStoreError>;
}

/// Checks an entry name: 1..=64 of `a-z 0-9 . _ -`, not starting with `.`.
pub fn check_name(name: &str) -> Result<(), KeyStoreError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(KeyStoreError::BadName(name.to_string()))
    }
}

/// Parses `keyring` / `file` (surrounding spaces ignored, case-insensitive).
pub fn parse_backend(var: &'static str, value: &str) -> Result<Backend, KeyStoreError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "keyring" => Ok(Backend::Keyring),
        "file" => Ok(Backend::File),
        _ => Err(KeyStoreError::BadChoice {
            var,
            value: value.to_string(),
        }),
    }
}

/// Where an initialised home's keys are: [`Backend::Keyring`] when [`KEYRING_MARKER`] exists,
/// [`Backend::File`] when `host.key` does, `None` for a home that is not initialised.
pub fn recorded(paths: &Paths) -> Option<Backend> {
    if paths.home().join(KEYRING_MARKER).symlink_metadata().is_ok() {
        Some(Backend::Keyring)
    } else if paths.host_key().symlink_metadata().is_ok() {
        Some(Backend::File)
    } else {
        None
    }
}

/// The `key_store` line of `config.toml` when the file has one (the owner's explicit choice);
/// `None` without the file or the key. Errors: unreadable or unparseable file.
pub fn configured(paths: &Paths) -> Result<Option<Backend>, KeyStoreError> {
    let path = paths.config_file();
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ConfigError::Read { path, source }.into()),
    };
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::Parse {
            path: path.clone(),
            line: None,
            message: e.message().to_string(),
        })?;
    match table.get("key_store") {
        None => Ok(None),
        Some(toml::Value::String(v)) => parse_backend("key_store", v).map(Some),
        Some(other) => Err(KeyStoreError::BadChoice {
            var: "key_store",
            value: other.to_string(),
        }),
    }
}

/// The key store of an initialised home (or of one whose `init` chose `backend`).
pub fn open_backend(paths: &Paths, backend: Backend) -> Result<Box<dyn KeyStore>, KeyStoreError> {
    Ok(match backend {
        Backend::File => Box::new(file::FileStore::new(paths.home())),
        Backend::Keyring => Box::new(keyring::KeyringStore::for_home(paths.home())?),
    })
}

/// Opens the store an initialised home recorded ([`recorded`]), after checking that neither
/// `MBX_KEYSTORE` nor a `key_store` line asks for another. A home that is not initialised
/// opens the store its configuration names (nothing is read from it then).
/// Errors: [`KeyStoreError::Switch`], [`KeyStoreError::BadChoice`], config errors.
pub fn open(paths: &Paths, config: &Config) -> Result<Box<dyn KeyStore>, KeyStoreError> {
    let backend = resolve(paths, config, |v| std::env::var(v).ok())?;
    open_backend(paths, backend)
}

/// [`open`]'s decision with an explicit environment (tests).
pub fn resolve(
    paths: &Paths,
    config: &Config,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Backend, KeyStoreError> {
    let Some(recorded) = recorded(paths) else {
        return Ok(config.key_store);
    };
    let where_ = match recorded {
        Backend::Keyring => format!(
            "the OS keyring, service {SERVICE}; marker {}",
            paths.home().join(KEYRING_MARKER).display()
        ),
        Backend::File => format!("0600 files in {}", paths.home().display()),
    };
    if let Some(value) = env(KEYSTORE_ENV).filter(|v| !v.trim().is_empty()) {
        let requested = parse_backend(KEYSTORE_ENV, &value)?;
        if requested != recorded {
            return Err(KeyStoreError::Switch {
                recorded,
                where_,
                source_name: KEYSTORE_ENV,
                requested,
                fix: format!("unset {KEYSTORE_ENV} or set it to {recorded}"),
            });
        }
    }
    if let Some(requested) = configured(paths)? {
        if requested != recorded {
            return Err(KeyStoreError::Switch {
                recorded,
                where_,
                source_name: "config.toml key_store",
                requested,
                fix: format!(
                    "set key_store = \"{recorded}\" in {}",
                    paths.config_file().display()
                ),
            });
        }
    }
    Ok(recorded)
}

/// The store `init` uses, and the warning to show when the automatic choice fell back to files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The chosen store.
    pub backend: Backend,
    /// Set when the OS keyring was tried and did not answer: says why and how to choose.
    pub warning: Option<String>,
}

/// Chooses the store for a new identity in `home`: `MBX_KEYSTORE`, else `config.toml`'s
/// `key_store`, else the OS keyring when `probe` answers, else files with a warning. `probe`
/// returns why the keyring did not answer. Errors: a bad choice, or the keyring asked for
/// explicitly and not answering ([`KeyStoreError::Unavailable`], with the fix).
pub fn choose(
    paths: &Paths,
    env: impl Fn(&str) -> Option<String>,
    probe: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<Choice, KeyStoreError> {
    let explicit = match env(KEYSTORE_ENV).filter(|v| !v.trim().is_empty()) {
        Some(v) => Some((parse_backend(KEYSTORE_ENV, &v)?, KEYSTORE_ENV)),
        None => configured(paths)?.map(|b| (b, "config.toml key_store")),
    };
    match explicit {
        Some((Backend::File, _)) => Ok(Choice {
            backend: Backend::File,
            warning: None,
        }),
        Some((Backend::Keyring, by)) => match probe(paths.home()) {
            Ok(()) => Ok(Choice {
                backend: Backend::Keyring,
                warning: None,
            }),
            Err(why) => Err(KeyStoreError::Unavailable {
                why: format!(
                    "{why} ({by} asks for the keyring; start a Secret Service, or choose the 0600 file store with {KEYSTORE_ENV}=file)"
                ),
            }),
        },
        None => match probe(paths.home()) {
            Ok(()) => Ok(Choice {
                backend: Backend::Keyring,
                warning: None,
            }),
            Err(why) => Ok(Choice {
                backend: Backend::File,
                warning: Some(format!(
                    "the OS keyring is not available ({why}); this host's keys stay in 0600 files in {}. Set {KEYSTORE_ENV}=file to choose the file store and silence this warning, or make a Secret Service available (e.g. gnome-keyring in a D-Bus session) and set {KEYSTORE_ENV}=keyring",
                    paths.home().display()
                )),
            }),
        },
    }
}

/// Probes the OS keyring for `home` with a harmless write, read and delete of a random value,
/// giving up after [`PROBE_TIMEOUT`]. `Err` says why it does not answer.
pub fn probe_keyring(home: &Path) -> Result<(), String> {
    keyring::session_bus_hint()?;
    let store = keyring::KeyringStore::for_home(home).map_err(|e| e.to_string())?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(store.probe());
    });
    match rx.recv_timeout(PROBE_TIMEOUT) {
        Ok(result) => result,
        Err(_) => Err(format!(
            "it did not answer within {} s (locked, or waiting for a password prompt)",
            PROBE_TIMEOUT.as_secs()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn home() -> (tempfile::TempDir, Paths) {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::at(dir.path());
        (dir, paths)
    }

    #[test]
    fn secrets_never_show_in_debug() {
        let s = Secret::new("{\"privateKey\":\"c2VjcmV0\"}");
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        assert!(!format!("{:?}", Some(s.clone())).contains("c2VjcmV0"));
        assert_eq!(s.expose(), "{\"privateKey\":\"c2VjcmV0\"}");
    }

    #[test]
    fn entry_names_are_checked() {
        let longest = "x".repeat(64);
        for ok in [
            "host.key",
            "enc.key.next",
            "enc.key.retired-1a2b-3c4d-5e6f-7a8b",
            &longest,
        ] {
            check_name(ok).unwrap();
        }
        for bad in ["", ".hidden", "../x", "a/b", "UPPER", &"x".repeat(65)] {
            assert!(
                matches!(check_name(bad), Err(KeyStoreError::BadName(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_keyring_is_chosen_when_it_answers() {
        let (_d, paths) = home();
        let c = choose(&paths, env_of(&[]), |_| Ok(())).unwrap();
        assert_eq!(
            c,
            Choice {
                backend: Backend::Keyring,
                warning: None
            }
        );
    }

    #[test]
    fn files_are_chosen_with_one_warning_that_says_why_and_the_fix() {
        let (_d, paths) = home();
        let c = choose(&paths, env_of(&[]), |_| {
            Err("no D-Bus session bus (DBUS_SESSION_BUS_ADDRESS is unset)".into())
        })
        .unwrap();
        assert_eq!(c.backend, Backend::File);
        let w = c.warning.unwrap();
        assert!(w.contains("DBUS_SESSION_BUS_ADDRESS is unset"), "{w}");
        assert!(w.contains(&paths.home().display().to_string()), "{w}");
        assert!(w.contains("MBX_KEYSTORE=file"), "{w}");
    }

    #[test]
    fn an_explicit_choice_wins_and_a_keyring_that_does_not_answer_is_an_error() {
        let (_d, paths) = home();
        let probed = std::cell::Cell::new(false);
        let c = choose(&paths, env_of(&[(KEYSTORE_ENV, "file")]), |_| {
            probed.set(true);
            Ok(())
        })
        .unwrap();
        assert_eq!(
            c,
            Choice {
                backend: Backend::File,
                warning: None
            }
        );
        assert!(!probed.get(), "an explicit file store is not probed");
        let err = choose(&paths, env_of(&[(KEYSTORE_ENV, "keyring")]), |_| {
            Err("no Secret Service".into())
        })
        .unwrap_err();
        assert!(matches!(err, KeyStoreError::Unavailable { .. }), "{err}");
        assert!(err.to_string().contains("MBX_KEYSTORE=file"), "{err}");
        let err = choose(&paths, env_of(&[(KEYSTORE_ENV, "vault")]), |_| Ok(())).unwrap_err();
        assert!(err.to_string().contains("use keyring or file"), "{err}");
        // The owner's `key_store` line counts as explicit; the environment overrides it.
        std::fs::write(paths.config_file(), "key_store = \"file\"\n").unwrap();
        let c = choose(&paths, env_of(&[]), |_| Ok(())).unwrap();
        assert_eq!(c.backend, Backend::File);
        let c = choose(&paths, env_of(&[(KEYSTORE_ENV, "keyring")]), |_| Ok(())).unwrap();
        assert_eq!(c.backend, Backend::Keyring);
    }

    #[test]
    fn an_initialised_home_never_switches_store() {
        let (_d, paths) = home();
        let config = Config::default();
        assert_eq!(recorded(&paths), None);
        std::fs::write(paths.host_key(), "x").unwrap();
        assert_eq!(recorded(&paths), Some(Backend::File));
        assert_eq!(
            resolve(&paths, &config, env_of(&[])).unwrap(),
            Backend::File
        );
        let err = resolve(&paths, &config, env_of(&[(KEYSTORE_ENV, "keyring")])).unwrap_err();
        assert!(matches!(err, KeyStoreError::Switch { .. }), "{err}");
        assert!(err.to_string().contains("unset MBX_KEYSTORE"), "{err}");

        std::fs::write(paths.home().join(KEYRING_MARKER), "marker").unwrap();
        assert_eq!(recorded(&paths), Some(Backend::Keyring));
        std::fs::write(paths.config_file(), "key_store = \"file\"\n").unwrap();
        let err = resolve(&paths, &config, env_of(&[])).unwrap_err();
        assert!(err.to_string().contains("key_store = \"keyring\""), "{err}");
        std::fs::write(paths.config_file(), "key_store = \"keyring\"\n").unwrap();
        assert_eq!(
            resolve(&paths, &config, env_of(&[(KEYSTORE_ENV, "keyring")])).unwrap(),
            Backend::Keyring
        );
    }
}
