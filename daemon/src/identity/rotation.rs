//! Host key rotation, local side (`wire.md` §2.10; spec §2 "Rotation"): new host and enc keys,
//! the record signed by the old and the new host key, and a crash-safe swap.
//!
//! Steps of [`rotate`], each durable before the next:
//! 1. stage the new keys as key store entries `host.key.next` and `enc.key.next`
//!    (failpoint `rotate:after-stage`);
//! 2. append the signed record to `rotations.json` `{records[], delivered:{host: count}}`
//!    (0600, temporary file + fsync + rename; failpoint `rotate:after-log`);
//! 3. retire the current keys: the private enc key goes to the key store as
//!    `enc.key.retired-<fingerprint>`, both public keys to `retired-keys.json`
//!    `{host:[{publicKey,retired_at}], enc:[{publicKey,retired_at}]}` (failpoint
//!    `rotate:after-retire`);
//! 4. swap: each staged key replaces the current one, then its staged entry is deleted
//!    (failpoint `rotate:after-swap-host` between the two keys).
//!
//! [`finish`] runs steps 3–4 again for whatever is staged and is idempotent, so every identity
//! load ([`super::load`]) completes an interrupted rotation. A staged key that the last logged
//! record does not name was never announced: it is discarded and the current keys stay. One
//! file lock (`rotation.lock` in the home) serialises rotating and finishing between processes.
//!
//! Unlike 0.5.x, `retired-keys.json` carries no private key: retired enc keys stay in the key
//! store, so a keyring home never writes a private key to disk.
//!
//! This module never logs key material (only fingerprints), and never swaps a key in whose
//! rotation record is not logged first.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use agentmbx_protocol::failpoint;
use agentmbx_protocol::keys::{self, EncKey, HostKey, PublicKey};
use agentmbx_protocol::rotation::SignedRotation;
use serde::{Deserialize, Serialize};

use super::{
    read_enc, read_host, secret_of, Identity, IdentityError, KeyHistory, ENC_KEY, HOST_KEY,
};
use crate::config::Config;
use crate::fsutil;
use crate::keystore::{self, KeyStore};
use crate::paths::Paths;

/// Staged new host key entry.
pub const HOST_NEXT: &str = "host.key.next";
/// Staged new enc key entry.
pub const ENC_NEXT: &str = "enc.key.next";
/// The rotation log in the home.
pub const ROTATIONS_FILE: &str = "rotations.json";
/// The retired public keys in the home.
pub const RETIRED_FILE: &str = "retired-keys.json";
/// The lock file that serialises rotating and finishing.
pub const LOCK_FILE: &str = "rotation.lock";

/// Every rotation this host made, and per peer how many of them it has taken (`wire.md`
/// §2.10, 0.5.x `RotationLog`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RotationLog {
    /// The records, oldest first.
    pub records: Vec<SignedRotation>,
    /// Peer host name → number of records (from the first) it answered `rotated`/`current`.
    #[serde(default)]
    pub delivered: BTreeMap<String, usize>,
}

/// A retired host key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetiredHost {
    /// Public key, base64.
    #[serde(rename = "publicKey")]
    pub public_key: String,
    /// ISO ms time of the rotation that retired it (the record's `iat`).
    pub retired_at: String,
}

/// A retired enc key (its private half is the key store entry [`retired_enc_name`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetiredEnc {
    /// Public key, base64.
    #[serde(rename = "publicKey")]
    pub public_key: String,
    /// ISO ms time of the rotation that retired it.
    pub retired_at: String,
}

/// `retired-keys.json`: the public halves of retired keys, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetiredKeys {
    /// Retired host keys.
    #[serde(default)]
    pub host: Vec<RetiredHost>,
    /// Retired enc keys.
    #[serde(default)]
    pub enc: Vec<RetiredEnc>,
}

/// What [`rotate`] did.
#[derive(Debug, Clone)]
pub struct Rotated {
    /// The logged record.
    pub record: SignedRotation,
    /// The identity with the new keys.
    pub identity: Identity,
    /// The host key it replaced.
    pub old_key: PublicKey,
}

/// Holds `rotation.lock` (an exclusive OS file lock, released on drop or process exit).
#[derive(Debug)]
pub struct RotationLock {
    _file: File,
}

impl RotationLock {
    /// Waits for and takes the home's rotation lock. Errors: the lock file cannot be opened.
    pub fn acquire(paths: &Paths) -> Result<Self, IdentityError> {
        let path = paths.home().join(LOCK_FILE);
        let mut options = std::fs::OpenOptions::new();
        options.create(true).truncate(false).write(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, fsutil::PRIVATE_MODE);
        let file = options
            .open(&path)
            .and_then(|f| f.lock().map(|()| f))
            .map_err(|e| file_err(&path, e))?;
        Ok(RotationLock { _file: file })
    }
}

fn file_err(path: &Path, e: impl std::fmt::Display) -> IdentityError {
    IdentityError::RotationFile {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// The key store entry holding the private half of a retired enc key:
/// `enc.key.retired-<fingerprint of its public key>`.
pub fn retired_enc_name(public: &keys::EncPublicKey) -> String {
    format!("{ENC_KEY}.retired-{}", keys::fingerprint(public.as_bytes()))
}

fn read_json<T: for<'de> Deserialize<'de> + Default>(path: &Path) -> Result<T, IdentityError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| file_err(path, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
        Err(e) => Err(file_err(path, e)),
    }
}

fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), IdentityError> {
    let mut text = serde_json::to_vec(value).map_err(|e| file_err(path, e))?;
    text.push(b'\n');
    fsutil::replace(path, &text, fsutil::PRIVATE_MODE).map_err(|e| file_err(path, e))
}

fn log_path(paths: &Paths) -> PathBuf {
    paths.home().join(ROTATIONS_FILE)
}

fn retired_path(paths: &Paths) -> PathBuf {
    paths.home().join(RETIRED_FILE)
}

/// Reads `rotations.json` (empty when missing). Errors: unreadable or malformed file.
pub fn read_log(paths: &Paths) -> Result<RotationLog, IdentityError> {
    read_json(&log_path(paths))
}

/// Reads `retired-keys.json` (empty when missing).
pub fn read_retired(paths: &Paths) -> Result<RetiredKeys, IdentityError> {
    read_json(&retired_path(paths))
}

/// Records that peer `host` has taken the first `count` records (never lowers a count), under
/// the rotation lock. Errors: lock or file errors.
pub fn record_delivered(paths: &Paths, host: &str, count: usize) -> Result<(), IdentityError> {
    let _lock = RotationLock::acquire(paths)?;
    let mut log = read_log(paths)?;
    let count = count.min(log.records.len());
    let entry = log.delivered.entry(host.to_string()).or_insert(0);
    if *entry >= count {
        return Ok(());
    }
    *entry = count;
    write_json(&log_path(paths), &log)
}

/// The retired keys and rotation log for [`Identity::history`]. A retired enc key whose private
/// half is missing from the store is skipped with a warning (mail sealed to it no longer opens).
pub fn history(paths: &Paths, store: &dyn KeyStore) -> Result<KeyHistory, IdentityError> {
    let retired = read_retired(paths)?;
    let log = read_log(paths)?;
    let mut out = KeyHistory {
        rotations: log.records,
        ..KeyHistory::default()
    };
    for h in &retired.host {
        match PublicKey::from_b64(&h.public_key) {
            Ok(k) => out.retired_host.push(k),
            Err(e) => {
                tracing::warn!(file = %retired_path(paths).display(), error = %e, "skipping a retired host key that does not parse")
            }
        }
    }
    for e in &retired.enc {
        let Ok(public) = keys::EncPublicKey::from_b64(&e.public_key) else {
            tracing::warn!(file = %retired_path(paths).display(), "skipping a retired enc key that does not parse");
            continue;
        };
        let name = retired_enc_name(&public);
        match read_enc(store, &name)? {
            Some(k) if k.public() == public => out.retired_enc.push(k),
            Some(_) => {
                tracing::warn!(entry = %name, "a retired enc key entry holds another key; mail sealed to the retired key will not open")
            }
            None => {
                tracing::warn!(entry = %name, "a retired enc key is missing from the key store; mail sealed to it will not open")
            }
        }
    }
    Ok(out)
}

/// [`finish`] under the rotation lock, but only when something is staged (the common case
/// costs two key store reads and takes no lock).
pub fn finish_if_staged(paths: &Paths, store: &dyn KeyStore) -> Result<bool, IdentityError> {
    if store.get(HOST_NEXT)?.is_none() && store.get(ENC_NEXT)?.is_none() {
        return Ok(false);
    }
    let lock = RotationLock::acquire(paths)?;
    finish(paths, store, &lock)
}

/// Completes a logged rotation (steps 3–4 of the module docs), idempotently: retires the
/// current keys the last record replaces, then swaps each staged key in. A staged key the last
/// logged record does not name is deleted and the current keys stay. Returns whether a staged
/// key was swapped in. Errors: key store and file errors (the state stays completable).
pub fn finish(
    paths: &Paths,
    store: &dyn KeyStore,
    _lock: &RotationLock,
) -> Result<bool, IdentityError> {
    let host_secret = store.get(HOST_NEXT)?;
    let enc_secret = store.get(ENC_NEXT)?;
    let (host_present, enc_present) = (host_secret.is_some(), enc_secret.is_some());
    if !host_present && !enc_present {
        return Ok(false);
    }
    let file = |s: &Option<keystore::Secret>| {
        s.as_ref()
            .and_then(|s| keys::KeyFile::parse(s.expose()).ok())
    };
    let staged_host = file(&host_secret).and_then(|f| HostKey::from_key_file(&f).ok());
    let staged_enc = file(&enc_secret).and_then(|f| EncKey::from_key_file(&f).ok());
    let log = read_log(paths)?;
    let last = log.records.last();
    let names = |r: &SignedRotation| (r.new_key().ok(), r.new_enc_key().ok());
    let (want_host, want_enc) = last.map(names).unwrap_or((None, None));
    let host_ok = matches!((&staged_host, &want_host), (Some(k), Some(w)) if k.public() == *w);
    let enc_ok = matches!((&staged_enc, &want_enc), (Some(k), Some(w)) if k.public() == *w);
    if host_present && !host_ok {
        tracing::warn!(entry = HOST_NEXT, "discarding a staged host key that no logged rotation names: that rotation never happened; the current keys stay");
        store.delete(HOST_NEXT)?;
    }
    if enc_present && !enc_ok {
        tracing::warn!(entry = ENC_NEXT, "discarding a staged enc key that no logged rotation names: that rotation never happened; the current keys stay");
        store.delete(ENC_NEXT)?;
    }
    let (Some(record), true) = (last, host_ok || enc_ok) else {
        return Ok(false);
    };
    let retired_at = record.rec.iat.clone();

    let mut retired = read_retired(paths)?;
    let mut changed = false;
    if let (true, Some(new)) = (host_ok, &want_host) {
        if let Some(cur) = read_host(store, HOST_KEY)? {
            let public = cur.public();
            let b64 = public.to_b64();
            if public != *new && !retired.host.iter().any(|h| h.public_key == b64) {
                retired.host.push(RetiredHost {
                    public_key: b64,
                    retired_at: retired_at.clone(),
                });
                changed = true;
            }
        }
    }
    if let (true, Some(new)) = (enc_ok, &want_enc) {
        if let Some(cur) = read_enc(store, ENC_KEY)? {
            let public = cur.public();
            if public != *new {
                store.put(&retired_enc_name(&public), &secret_of(&cur.to_key_file()))?;
                let b64 = public.to_b64();
                if !retired.enc.iter().any(|e| e.public_key == b64) {
                    retired.enc.push(RetiredEnc {
                        public_key: b64,
                        retired_at: retired_at.clone(),
                    });
                    changed = true;
                }
            }
        }
    }
    if changed {
        write_json(&retired_path(paths), &retired)?;
    }
    failpoint::hit("rotate:after-retire");

    if let (true, Some(key)) = (host_ok, &staged_host) {
        store.put(HOST_KEY, &secret_of(&key.to_key_file()))?;
        store.delete(HOST_NEXT)?;
        failpoint::hit("rotate:after-swap-host");
    }
    if let (true, Some(key)) = (enc_ok, &staged_enc) {
        store.put(ENC_KEY, &secret_of(&key.to_key_file()))?;
        store.delete(ENC_NEXT)?;
    }
    tracing::info!(
        from = %PublicKey::from_b64(&record.rec.old_pub).map(|k| k.fingerprint()).unwrap_or_default(),
        to = %want_host.map(|k| k.fingerprint()).unwrap_or_default(),
        "host key rotation completed"
    );
    Ok(true)
}

/// Rotates this host's keys (module docs, steps 1–4) at `now_ms`, under the rotation lock:
/// finishes any earlier rotation first, loads the current identity, stages, logs, retires and
/// swaps. The caller makes sure no daemon is using the keys. Errors: as [`super::load`], key
/// store and file errors; a failure before the log write leaves the old keys in force.
pub fn rotate(paths: &Paths, config: &Config, now_ms: i64) -> Result<Rotated, IdentityError> {
    if !super::is_initialized(paths) {
        return Err(IdentityError::NotInitialized {
            path: paths.host_key(),
        });
    }
    let store = keystore::open(paths, config)?;
    rotate_with(paths, config, &*store, now_ms)
        .map_err(|e| super::keyring_unavailable(paths, &*store, e))
}

/// [`rotate`] with an already opened `store`.
pub fn rotate_with(
    paths: &Paths,
    config: &Config,
    store: &dyn KeyStore,
    now_ms: i64,
) -> Result<Rotated, IdentityError> {
    let lock = RotationLock::acquire(paths)?;
    finish(paths, store, &lock)?;
    let current = super::load_keys(paths, config, store)?;
    let new_host = HostKey::generate();
    let new_enc = EncKey::generate();
    let record = SignedRotation::sign(
        current.host.as_str(),
        &current.host_key,
        &new_host,
        &new_enc.public(),
        now_ms,
    );

    store.put(HOST_NEXT, &secret_of(&new_host.to_key_file()))?;
    store.put(ENC_NEXT, &secret_of(&new_enc.to_key_file()))?;
    failpoint::hit("rotate:after-stage");

    let mut log = read_log(paths)?;
    log.records.push(record.clone());
    write_json(&log_path(paths), &log)?;
    failpoint::hit("rotate:after-log");

    finish(paths, store, &lock)?;
    let identity = super::load_keys(paths, config, store)?;
    tracing::info!(
        host = %identity.host,
        from = %current.host_key.public().fingerprint(),
        to = %identity.host_key.public().fingerprint(),
        "host key rotated"
    );
    Ok(Rotated {
        record,
        identity,
        old_key: current.host_key.public(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host_name::HostName;
    use crate::identity::{init_with, load_with};
    use crate::keystore::file::FileStore;
    use crate::keystore::mock::MockStore;
    use crate::keystore::Backend;
    use agentmbx_protocol::seal;

    const NOW: i64 = 1_767_225_660_000;

    fn home(store_kind: Backend) -> (tempfile::TempDir, Paths, Box<dyn KeyStore>, Config) {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::at(dir.path());
        let store: Box<dyn KeyStore> = match store_kind {
            Backend::File => Box::new(FileStore::new(dir.path())),
            Backend::Keyring => Box::new(MockStore::new(Backend::Keyring)),
        };
        init_with(&paths, Some(&HostName::parse("rot").unwrap()), &*store).unwrap();
        let config = Config::read_file(&paths.config_file()).unwrap().unwrap();
        (dir, paths, store, config)
    }

    #[test]
    fn a_rotation_swaps_keys_logs_the_record_and_keeps_the_old_ones_for_old_mail() {
        for kind in [Backend::File, Backend::Keyring] {
            let (_d, paths, store, config) = home(kind);
            let before = load_with(&paths, &config, &*store).unwrap();
            let sealed_before = seal::seal("old mail", &before.enc_key.public(), "id-1");
            let r = rotate_with(&paths, &config, &*store, NOW).unwrap();
            assert_eq!(r.old_key, before.host_key.public());
            assert_eq!(r.record.check(&before.host_key.public()), Ok(()));
            let after = load_with(&paths, &config, &*store).unwrap();
            assert_eq!(after.host_key.public(), r.record.new_key().unwrap());
            assert_eq!(after.enc_key.public(), r.record.new_enc_key().unwrap());
            assert_ne!(after.enc_key.public(), before.enc_key.public());
            assert_eq!(after.history.rotations, vec![r.record.clone()]);
            assert_eq!(after.history.retired_host, vec![before.host_key.public()]);
            assert!(after.is_own_key(&before.host_key.public()));
            assert_eq!(
                after.open_sealed(&sealed_before, "id-1").unwrap(),
                "old mail"
            );
            let sealed_after = seal::seal("new mail", &after.enc_key.public(), "id-2");
            assert_eq!(
                after.open_sealed(&sealed_after, "id-2").unwrap(),
                "new mail"
            );
            assert!(after
                .open_sealed(
                    &seal::seal("x", &EncKey::generate().public(), "id-3"),
                    "id-3"
                )
                .is_err());
            assert!(store.get(HOST_NEXT).unwrap().is_none());
            assert!(store.get(ENC_NEXT).unwrap().is_none());
            let retired = read_retired(&paths).unwrap();
            assert_eq!(retired.enc.len(), 1);
            let text = std::fs::read_to_string(paths.home().join(RETIRED_FILE)).unwrap();
            assert!(!text.contains(&before.enc_key.private_b64_secret()));
            assert!(!text.contains("privateKey"));
            #[cfg(unix)]
            for f in [ROTATIONS_FILE, RETIRED_FILE] {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(paths.home().join(f))
                    .unwrap()
                    .permissions()
                    .mode();
                assert_eq!(mode & 0o777, 0o600, "{f}");
            }
            // A second rotation chains from the first.
            let r2 = rotate_with(&paths, &config, &*store, NOW + 1).unwrap();
            assert_eq!(r2.record.check(&after.host_key.public()), Ok(()));
            let third = load_with(&paths, &config, &*store).unwrap();
            assert_eq!(third.history.rotations.len(), 2);
            assert_eq!(third.history.retired_enc.len(), 2);
            assert_eq!(
                third.open_sealed(&sealed_before, "id-1").unwrap(),
                "old mail"
            );
        }
    }

    #[test]
    fn finish_completes_a_logged_rotation_at_each_step_and_discards_an_unlogged_one() {
        // Staged but not logged: discarded, the old keys stay.
        let (_d, paths, store, config) = home(Backend::File);
        let old = load_with(&paths, &config, &*store).unwrap();
        store
            .put(HOST_NEXT, &secret_of(&HostKey::generate().to_key_file()))
            .unwrap();
        store
            .put(ENC_NEXT, &secret_of(&EncKey::generate().to_key_file()))
            .unwrap();
        let loaded = load_with(&paths, &config, &*store).unwrap();
        assert_eq!(loaded.public(), old.public());
        assert!(store.get(HOST_NEXT).unwrap().is_none() && store.get(ENC_NEXT).unwrap().is_none());
        assert!(read_log(&paths).unwrap().records.is_empty());

        // Logged, then interrupted after the host swap: the enc swap completes, nothing is
        // retired twice.
        let new_host = HostKey::generate();
        let new_enc = EncKey::generate();
        let rec = SignedRotation::sign("rot", &old.host_key, &new_host, &new_enc.public(), NOW);
        store
            .put(ENC_NEXT, &secret_of(&new_enc.to_key_file()))
            .unwrap();
        write_json(
            &log_path(&paths),
            &RotationLog {
                records: vec![rec],
                ..Default::default()
            },
        )
        .unwrap();
        let mut retired = RetiredKeys::default();
        retired.host.push(RetiredHost {
            public_key: old.host_key.public().to_b64(),
            retired_at: "t".into(),
        });
        write_json(&retired_path(&paths), &retired).unwrap();
        store
            .put(HOST_KEY, &secret_of(&new_host.to_key_file()))
            .unwrap();
        let done = load_with(&paths, &config, &*store).unwrap();
        assert_eq!(done.host_key.public(), new_host.public());
        assert_eq!(done.enc_key.public(), new_enc.public());
        assert_eq!(done.history.retired_host, vec![old.host_key.public()]);
        assert_eq!(done.history.retired_enc.len(), 1);
        assert_eq!(done.history.retired_enc[0].public(), old.enc_key.public());
        // Finishing again changes nothing.
        let lock = RotationLock::acquire(&paths).unwrap();
        assert!(!finish(&paths, &*store, &lock).unwrap());
    }

    #[test]
    fn delivered_counts_only_grow_and_stay_within_the_log() {
        let (_d, paths, store, config) = home(Backend::File);
        rotate_with(&paths, &config, &*store, NOW).unwrap();
        rotate_with(&paths, &config, &*store, NOW + 1).unwrap();
        record_delivered(&paths, "peer", 1).unwrap();
        record_delivered(&paths, "peer", 0).unwrap();
        assert_eq!(read_log(&paths).unwrap().delivered["peer"], 1);
        record_delivered(&paths, "peer", 9).unwrap();
        let log = read_log(&paths).unwrap();
        assert_eq!(log.delivered["peer"], 2);
        assert_eq!(log.records.len(), 2);
    }
}
