//! The OS keyring key store (the `keyring` crate, platform-native stores): the Secret Service
//! over D-Bus on Linux and the BSDs, the Keychain on macOS, the Credential Manager on Windows.
//!
//! Each secret is one entry, service [`SERVICE`], account `<name>@<home>` with the home's
//! canonical path, so two homes on one machine never share an entry. A write replaces the entry
//! in one call (the store's own atomicity). On platforms without a native store this store
//! reports itself unavailable rather than falling back to the crate's in-memory mock, which
//! would lose the keys at exit.
//!
//! It must never log or put in an error a secret: keyring errors are turned into texts that
//! name the entry and the store's reason, and an undecodable entry is reported without its
//! bytes.

use std::path::Path;

use super::{check_name, Backend, KeyStore, KeyStoreError, Secret, SERVICE};

/// Secrets of one home in the OS keyring.
#[derive(Debug, Clone)]
pub struct KeyringStore {
    home: String,
}

impl KeyringStore {
    /// The store of `home`: accounts end in `@<canonical home path>` (the path as given when it
    /// cannot be resolved). Errors: [`KeyStoreError::Unavailable`] on a platform without a
    /// native keyring.
    pub fn for_home(home: &Path) -> Result<Self, KeyStoreError> {
        native()?;
        let resolved = std::fs::canonicalize(home)
            .or_else(|_| std::path::absolute(home))
            .unwrap_or_else(|_| home.to_path_buf());
        Ok(KeyringStore {
            home: resolved.to_string_lossy().into_owned(),
        })
    }

    /// The keyring account of entry `name`: `<name>@<home>`.
    pub fn account(&self, name: &str) -> String {
        format!("{name}@{}", self.home)
    }

    fn entry(&self, name: &str) -> Result<keyring::Entry, KeyStoreError> {
        check_name(name)?;
        session_bus_hint().map_err(|why| KeyStoreError::Unavailable { why })?;
        keyring::Entry::new(SERVICE, &self.account(name)).map_err(|e| map_err("open", name, e))
    }

    /// Writes, reads back and deletes a random probe entry. `Err` says why the keyring does
    /// not answer (never a secret: the probe value is random and not shown).
    pub fn probe(&self) -> Result<(), String> {
        let mut raw = [0u8; 16];
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut raw);
        let value = Secret::new(hex::encode(raw));
        let check = || -> Result<(), KeyStoreError> {
            self.put("probe", &value)?;
            let back = self.get("probe")?;
            self.delete("probe")?;
            if back.as_ref() != Some(&value) {
                return Err(KeyStoreError::Unavailable {
                    why: "it did not return the value just written".into(),
                });
            }
            Ok(())
        };
        check().map_err(|e| match e {
            KeyStoreError::Unavailable { why } => why,
            other => other.to_string(),
        })
    }
}

/// `Ok` on a platform where the crate has a native store compiled in.
fn native() -> Result<(), KeyStoreError> {
    if cfg!(any(
        target_os = "linux",
        target_os = "freebsd",
        target_os = "openbsd",
        target_os = "macos",
        target_os = "windows"
    )) {
        Ok(())
    } else {
        Err(KeyStoreError::Unavailable {
            why: "this platform has no supported OS keyring".into(),
        })
    }
}

/// A quick reason the Secret Service cannot answer, before any D-Bus call: no session bus
/// address and no `$XDG_RUNTIME_DIR/bus` (Linux and the BSDs; elsewhere always `Ok`).
pub fn session_bus_hint() -> Result<(), String> {
    if !cfg!(any(
        target_os = "linux",
        target_os = "freebsd",
        target_os = "openbsd"
    )) {
        return Ok(());
    }
    let set = |v: &str| std::env::var_os(v).is_some_and(|x| !x.is_empty());
    if set("DBUS_SESSION_BUS_ADDRESS") {
        return Ok(());
    }
    let runtime_bus = std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(&d).join("bus"));
    if runtime_bus.is_some_and(|b| b.exists()) {
        return Ok(());
    }
    Err("no Secret Service: there is no D-Bus session bus (DBUS_SESSION_BUS_ADDRESS is unset and there is no $XDG_RUNTIME_DIR/bus)".into())
}

/// A keyring error as [`KeyStoreError`], without secret bytes.
fn map_err(op: &'static str, name: &str, e: keyring::Error) -> KeyStoreError {
    let why = match e {
        keyring::Error::NoStorageAccess(inner) => {
            return KeyStoreError::Unavailable {
                why: format!("no access to the keyring ({inner})"),
            }
        }
        keyring::Error::PlatformFailure(inner) => inner.to_string(),
        keyring::Error::NoEntry => "no such entry".into(),
        keyring::Error::BadEncoding(_) => "the stored value is not UTF-8 text".into(),
        keyring::Error::TooLong(what, max) => format!("{what} is longer than {max}"),
        keyring::Error::Invalid(what, reason) => format!("{what} is invalid: {reason}"),
        keyring::Error::Ambiguous(found) => format!("{} entries match", found.len()),
        _ => "unexpected keyring error".into(),
    };
    // A bus or provider failure means the keyring is not there (no bus, no Secret Service).
    if why.contains("DBus error") || why.contains("org.freedesktop.DBus.Error") {
        return KeyStoreError::Unavailable { why };
    }
    KeyStoreError::Keyring {
        op,
        name: name.to_string(),
        why,
    }
}

impl KeyStore for KeyringStore {
    fn backend(&self) -> Backend {
        Backend::Keyring
    }

    fn location(&self) -> String {
        format!(
            "the OS keyring (service {SERVICE}, accounts <name>@{})",
            self.home
        )
    }

    fn get(&self, name: &str) -> Result<Option<Secret>, KeyStoreError> {
        match self.entry(name)?.get_password() {
            Ok(text) => Ok(Some(Secret::new(text))),
            Err(keyring::Error::NoEntry) => Ok(None),
            Err(e) => Err(map_err("read", name, e)),
        }
    }

    fn put(&self, name: &str, secret: &Secret) -> Result<(), KeyStoreError> {
        self.entry(name)?
            .set_password(secret.expose())
            .map_err(|e| map_err("write", name, e))
    }

    fn create(&self, name: &str, secret: &Secret) -> Result<(), KeyStoreError> {
        if self.get(name)?.is_some() {
            return Err(KeyStoreError::Exists {
                name: name.to_string(),
                store: self.location(),
            });
        }
        self.put(name, secret)
    }

    fn delete(&self, name: &str) -> Result<(), KeyStoreError> {
        match self.entry(name)?.delete_credential() {
            Ok(()) | Err(keyring::Error::NoEntry) => Ok(()),
            Err(e) => Err(map_err("delete", name, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_are_namespaced_by_the_canonical_home() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let sa = KeyringStore::for_home(&a).unwrap();
        let sb = KeyringStore::for_home(&b).unwrap();
        assert_ne!(sa.account("host.key"), sb.account("host.key"));
        let via_dots = KeyringStore::for_home(&a.join("..").join("a")).unwrap();
        assert_eq!(via_dots.account("host.key"), sa.account("host.key"));
        assert!(sa.account("host.key").starts_with("host.key@/"));
        assert!(sa.location().contains(SERVICE));
    }

    #[test]
    fn keyring_errors_never_carry_the_stored_bytes() {
        let e = map_err(
            "read",
            "host.key",
            keyring::Error::BadEncoding(b"c2VjcmV0".to_vec()),
        );
        assert!(!e.to_string().contains("c2VjcmV0"), "{e}");
        assert!(!format!("{e:?}").contains("99, 50"), "{e:?}");
        assert!(e.to_string().contains("host.key"), "{e}");
    }
}
