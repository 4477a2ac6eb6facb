//! Where the host's files live (`MBX_HOME`; design README "Files, configuration and keys").
//!
//! This module owns the file names inside the home directory and the choice of the home itself:
//! `MBX_HOME` when set and non-empty, else the platform data directory from `directories`
//! (`~/.local/share/agentmbx` on Linux, `~/Library/Application Support/agentmbx` on macOS).
//! It never reads or writes the files it names, except creating the home directory
//! ([`Paths::ensure_home`]).

use std::path::{Path, PathBuf};

/// Environment variable that overrides the host home directory.
pub const HOME_ENV: &str = "MBX_HOME";

/// The home directory could not be determined or created.
#[derive(Debug, thiserror::Error)]
pub enum PathsError {
    /// `MBX_HOME` is unset and the platform has no data directory for this user.
    #[error("cannot determine the agentmbx home directory: set MBX_HOME")]
    NoHome,
    /// The home directory could not be created or given mode 0700.
    #[error("cannot create home directory {path}: {source}")]
    Create {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// The host's home directory and the files in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paths {
    home: PathBuf,
}

impl Paths {
    /// A home at an explicit directory (tests, `--home`-style callers).
    pub fn at(home: impl Into<PathBuf>) -> Self {
        Paths { home: home.into() }
    }

    /// `MBX_HOME` when set and non-empty, else the platform data directory.
    /// Errors: [`PathsError::NoHome`] when neither exists.
    pub fn from_env() -> Result<Self, PathsError> {
        match std::env::var_os(HOME_ENV) {
            Some(dir) if !dir.is_empty() => Ok(Paths::at(dir)),
            _ => directories::ProjectDirs::from("", "", "agentmbx")
                .map(|dirs| Paths::at(dirs.data_dir()))
                .ok_or(PathsError::NoHome),
        }
    }

    /// Creates the home directory (and parents) if missing; a directory created here gets
    /// mode 0700 on Unix. An existing directory's mode is left as it is.
    pub fn ensure_home(&self) -> Result<(), PathsError> {
        if self.home.is_dir() {
            return Ok(());
        }
        let mut builder = std::fs::DirBuilder::new();
        builder.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        builder
            .create(&self.home)
            .map_err(|source| PathsError::Create {
                path: self.home.clone(),
                source,
            })
    }

    /// The home directory.
    pub fn home(&self) -> &Path {
        &self.home
    }

    /// `config.toml`: the host configuration ([`crate::config`]).
    pub fn config_file(&self) -> PathBuf {
        self.home.join("config.toml")
    }

    /// `host.key`: the host's Ed25519 key file (0600, [`crate::identity`]).
    pub fn host_key(&self) -> PathBuf {
        self.home.join("host.key")
    }

    /// `enc.key`: the host's X25519 key file (0600, [`crate::identity`]).
    pub fn enc_key(&self) -> PathBuf {
        self.home.join("enc.key")
    }

    /// `api.token`: the local API bearer token (0600, [`crate::token`]).
    pub fn api_token(&self) -> PathBuf {
        self.home.join("api.token")
    }

    /// `daemon.lock`: held (an OS file lock) by the running daemon, so two daemons never
    /// serve one home.
    pub fn daemon_lock(&self) -> PathBuf {
        self.home.join("daemon.lock")
    }

    /// Takes the daemon lock ([`Paths::daemon_lock`]) without waiting: `Ok(Some(file))` holds it
    /// until the file is dropped (the OS releases it when the process ends, even on SIGKILL),
    /// `Ok(None)` when another process holds it. Errors: the lock file cannot be opened.
    pub fn try_lock_daemon(&self) -> std::io::Result<Option<std::fs::File>> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.daemon_lock())?;
        Ok(file.try_lock().is_ok().then_some(file))
    }

    /// `mailbox.db`: the host store.
    pub fn mailbox_db(&self) -> PathBuf {
        self.home.join("mailbox.db")
    }

    /// `api.addr`: the address the running daemon's local API bound (written at start, so CLI
    /// commands find a daemon started with `--api-port 0`).
    pub fn api_addr_file(&self) -> PathBuf {
        self.home.join("api.addr")
    }

    /// `lan.addr`: the `host:port` the running daemon gives peers at pairing (its advertise
    /// address, written at start), so `pair` and `join` offer the address really served.
    pub fn lan_addr_file(&self) -> PathBuf {
        self.home.join("lan.addr")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names() {
        let p = Paths::at("/h");
        assert_eq!(p.config_file(), PathBuf::from("/h/config.toml"));
        assert_eq!(p.host_key(), PathBuf::from("/h/host.key"));
        assert_eq!(p.enc_key(), PathBuf::from("/h/enc.key"));
        assert_eq!(p.api_token(), PathBuf::from("/h/api.token"));
    }

    #[cfg(unix)]
    #[test]
    fn ensure_home_creates_0700() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = Paths::at(dir.path().join("a/b"));
        p.ensure_home().unwrap();
        let mode = std::fs::metadata(p.home()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        p.ensure_home().unwrap();
    }
}
