//! An in-memory key store for tests: behaves as a keyring or a file store would (same trait,
//! same errors), can be made to fail like an unavailable keyring, and lists its entry names so a
//! test can check what was written. It is never chosen by `init` or `load`.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::{check_name, Backend, KeyStore, KeyStoreError, Secret};

/// Secrets in a map.
#[derive(Debug)]
pub struct MockStore {
    backend: Backend,
    entries: Mutex<BTreeMap<String, String>>,
    unavailable: Mutex<Option<String>>,
}

impl MockStore {
    /// An empty store that reports itself as `backend`.
    pub fn new(backend: Backend) -> Self {
        MockStore {
            backend,
            entries: Mutex::new(BTreeMap::new()),
            unavailable: Mutex::new(None),
        }
    }

    /// The entry names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// From now on every operation fails with [`KeyStoreError::Unavailable`] `why` (`None`
    /// restores it).
    pub fn set_unavailable(&self, why: Option<&str>) {
        *self
            .unavailable
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = why.map(str::to_string);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn check(&self, name: &str) -> Result<(), KeyStoreError> {
        check_name(name)?;
        match self
            .unavailable
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
        {
            Some(why) => Err(KeyStoreError::Unavailable { why: why.clone() }),
            None => Ok(()),
        }
    }
}

impl KeyStore for MockStore {
    fn backend(&self) -> Backend {
        self.backend
    }

    fn location(&self) -> String {
        "an in-memory test store".to_string()
    }

    fn get(&self, name: &str) -> Result<Option<Secret>, KeyStoreError> {
        self.check(name)?;
        Ok(self.lock().get(name).map(|s| Secret::new(s.clone())))
    }

    fn put(&self, name: &str, secret: &Secret) -> Result<(), KeyStoreError> {
        self.check(name)?;
        self.lock()
            .insert(name.to_string(), secret.expose().to_string());
        Ok(())
    }

    fn create(&self, name: &str, secret: &Secret) -> Result<(), KeyStoreError> {
        self.check(name)?;
        let mut entries = self.lock();
        if entries.contains_key(name) {
            return Err(KeyStoreError::Exists {
                name: name.to_string(),
                store: self.location(),
            });
        }
        entries.insert(name.to_string(), secret.expose().to_string());
        Ok(())
    }

    fn delete(&self, name: &str) -> Result<(), KeyStoreError> {
        self.check(name)?;
        self.lock().remove(name);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mock_keeps_the_trait_contract_and_fails_like_a_locked_keyring() {
        let store = MockStore::new(Backend::Keyring);
        store.create("enc.key", &Secret::new("s1")).unwrap();
        assert!(matches!(
            store.create("enc.key", &Secret::new("s2")),
            Err(KeyStoreError::Exists { .. })
        ));
        store.put("enc.key.next", &Secret::new("s3")).unwrap();
        assert_eq!(store.names(), vec!["enc.key", "enc.key.next"]);
        store.set_unavailable(Some("locked"));
        let err = store.get("enc.key").unwrap_err();
        assert_eq!(err.to_string(), "the OS keyring is not available: locked");
        store.set_unavailable(None);
        store.delete("enc.key.next").unwrap();
        assert_eq!(store.get("enc.key").unwrap().unwrap().expose(), "s1");
        assert_eq!(store.names(), vec!["enc.key"]);
    }
}
