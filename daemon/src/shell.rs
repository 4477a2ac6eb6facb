//! Quoting for a POSIX shell: the commands `doctor` prints as fixes and the ones `setup` writes
//! into a client's configuration.
//!
//! # What it must never do
//! Run a shell, or depend on another module of this crate.

/// `arg` quoted for a POSIX shell: unchanged when it is made only of characters no shell treats
/// specially (`A-Z a-z 0-9 _ @ % + = : , . / -`) and not empty, else wrapped in single quotes
/// with each `'` written as `'\''`.
pub fn shell_quote(arg: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_@%+=:,./-".contains(c);
    if !arg.is_empty() && arg.chars().all(plain) {
        return arg.to_string();
    }
    format!("'{}'", arg.replace('\'', "'\\''"))
}

/// `path` quoted for a POSIX shell ([`shell_quote`] of its lossy UTF-8 form).
pub fn shell_path(path: &std::path::Path) -> String {
    shell_quote(&path.to_string_lossy())
}
