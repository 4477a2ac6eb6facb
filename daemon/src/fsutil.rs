//! Crash-safe file writes for the host's small files (keys, token, config).
//!
//! This module owns one discipline: a file is written in full to a temporary sibling, flushed
//! to disk (`fsync`), then moved into place, and the directory is flushed, so a crash leaves
//! either the old state or the complete new file, never a torn one. Files are created with
//! their final mode (0600 for secrets), never created readable and narrowed later. It must never
//! log or return the contents it writes.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Mode of every file that holds a secret, or that 0.5.x keeps private (config).
pub const PRIVATE_MODE: u32 = 0o600;

/// Creates `path` holding `contents`, with mode `mode` from the moment it exists, and refuses
/// to replace anything: if `path` exists (or another writer wins a race) the result is an
/// [`io::ErrorKind::AlreadyExists`] error and the existing file is untouched.
///
/// The file is written to a temporary sibling and fsynced, then hard-linked to `path` (a
/// rename that cannot replace), the temporary name removed and the directory fsynced.
pub fn create_new(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    if path.symlink_metadata().is_ok() {
        return Err(io::Error::new(io::ErrorKind::AlreadyExists, "file exists"));
    }
    let tmp = write_temp(path, contents, mode)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    linked?;
    sync_parent(path)
}

/// Replaces (or creates) `path` with `contents` atomically: temporary sibling with mode `mode`,
/// fsync, rename over `path`, fsync of the directory.
pub fn replace(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    let tmp = write_temp(path, contents, mode)?;
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_parent(path)
}

/// Writes `contents` to a fresh temporary file beside `path` (created with `mode`), fsynced.
fn write_temp(path: &Path, contents: &[u8], mode: u32) -> io::Result<PathBuf> {
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let mut suffix = [0u8; 6];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut suffix);
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        hex::encode(suffix)
    ));
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, mode);
    #[cfg(not(unix))]
    let _ = mode;
    let mut file = options.open(&tmp)?;
    let written = file.write_all(contents).and_then(|()| file.sync_all());
    if let Err(e) = written {
        drop(file);
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(tmp)
}

/// Flushes the directory entry of `path` (Unix); a no-op elsewhere.
fn sync_parent(path: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        std::fs::File::open(parent)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_new_refuses_to_overwrite_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        create_new(&path, b"one", PRIVATE_MODE).unwrap();
        let err = create_new(&path, b"two", PRIVATE_MODE).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("secret")]);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn replace_overwrites() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c");
        replace(&path, b"a", PRIVATE_MODE).unwrap();
        replace(&path, b"b", PRIVATE_MODE).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"b");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
