//! The file key store: each secret is a 0600 file named after its entry in the home directory
//! (`host.key`, `enc.key`, …), in the 0.5.x key-file text.
//!
//! Files are created with their final mode and written whole through [`crate::fsutil`]
//! (temporary sibling, fsync, rename or hard link, directory fsync), so a crash leaves the old or
//! the new secret, never a torn one. It never logs or returns a file's contents except through
//! [`Secret`], and warns (without the contents) when a key file is readable by other users.

use std::path::{Path, PathBuf};

use super::{check_name, Backend, KeyStore, KeyStoreError, Secret};
use crate::fsutil;

/// Secrets as 0600 files in one directory.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// A store in `dir` (the home directory).
    pub fn new(dir: &Path) -> Self {
        FileStore {
            dir: dir.to_path_buf(),
        }
    }

    fn path(&self, name: &str) -> Result<PathBuf, KeyStoreError> {
        check_name(name)?;
        Ok(self.dir.join(name))
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> KeyStoreError + '_ {
    move |source| KeyStoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl KeyStore for FileStore {
    fn backend(&self) -> Backend {
        Backend::File
    }

    fn location(&self) -> String {
        format!("0600 files in {}", self.dir.display())
    }

    fn get(&self, name: &str) -> Result<Option<Secret>, KeyStoreError> {
        let path = self.path(name)?;
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        };
        #[cfg(unix)]
        if let Ok(meta) = std::fs::metadata(&path) {
            use std::os::unix::fs::PermissionsExt;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                tracing::warn!(path = %path.display(), mode = format!("{mode:o}"), "key file is accessible to other users; run chmod 600 on it");
            }
        }
        Ok(Some(Secret::new(text)))
    }

    fn put(&self, name: &str, secret: &Secret) -> Result<(), KeyStoreError> {
        let path = self.path(name)?;
        fsutil::replace(&path, secret.expose().as_bytes(), fsutil::PRIVATE_MODE).map_err(io(&path))
    }

    fn create(&self, name: &str, secret: &Secret) -> Result<(), KeyStoreError> {
        let path = self.path(name)?;
        fsutil::create_new(&path, secret.expose().as_bytes(), fsutil::PRIVATE_MODE).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                KeyStoreError::Exists {
                    name: name.to_string(),
                    store: self.dir.display().to_string(),
                }
            } else {
                io(&path)(e)
            }
        })
    }

    fn delete(&self, name: &str) -> Result<(), KeyStoreError> {
        let path = self.path(name)?;
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_private_atomic_and_never_overwritten_by_create() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path());
        assert!(store.get("host.key").unwrap().is_none());
        store.create("host.key", &Secret::new("one")).unwrap();
        let err = store.create("host.key", &Secret::new("two")).unwrap_err();
        assert!(matches!(err, KeyStoreError::Exists { .. }), "{err}");
        assert!(!err.to_string().contains("two"));
        assert_eq!(store.get("host.key").unwrap().unwrap().expose(), "one");
        store.put("host.key", &Secret::new("three")).unwrap();
        assert_eq!(store.get("host.key").unwrap().unwrap().expose(), "three");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("host.key"))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        store.delete("host.key").unwrap();
        store.delete("host.key").unwrap();
        assert!(store.get("host.key").unwrap().is_none());
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(names.is_empty(), "no temporary file is left: {names:?}");
        assert!(matches!(
            store.put("../escape", &Secret::new("x")),
            Err(KeyStoreError::BadName(_))
        ));
        assert_eq!(store.backend(), Backend::File);
    }
}
