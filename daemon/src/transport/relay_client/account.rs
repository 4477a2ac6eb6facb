//! Account tokens on the host side (spec §8; `wire.md` "Resolved details" → "Account tokens"):
//! what a host needs to enrol on, and talk to, a relay run with the account authority.
//!
//! # What it owns
//! - **The cloud key**: a separate Ed25519 key for account use, entry `cloud.key` of the home's
//!   key store ([`crate::keystore`]), the same store as the host keys: the OS keyring in a
//!   keyring home, else the 0600 file `cloud.key` in the home (the 0.5.x key-file text). It is
//!   created on first use with [`KeyStore::create`], which never replaces an entry, so a race or
//!   a crash never leaves a torn or replaced key. A keyring home that still has a `cloud.key`
//!   file from before moves it into the keyring once (same key, so tokens stay bound) and
//!   removes the file. The account issuer binds tokens to it (`cnf.jkt`, its RFC 7638
//!   thumbprint).
//! - **Its certificate**: `{rec:{v:1, type:"cloud-key", host_pubkey, cloud_jkt, iat}, sig}`
//!   signed by the current host key ([`agentmbx_protocol::cloud_key`]), made in memory when
//!   needed (again after a host key rotation).
//! - **Its proof of possession** for each enrolment: `{cloud_pubkey, sig}`, the cloud key's
//!   signature over canonical(`{v:1, type:"cloud-key-pop", host_pubkey, cloud_jkt,
//!   challenge}`) with the relay's enrolment challenge, so a token stolen from this host cannot
//!   enrol another host key.
//! - **The token**: obtained from `[relay] token_command`, run as `sh -c <command>` with stdin
//!   closed and this environment (nothing secret in it):
//!   - `MBX_RELAY_URL`: the relay (the token's audience / RFC 8707 resource);
//!   - `MBX_CLOUD_JKT`: the thumbprint the token must carry in `cnf.jkt`;
//!   - `MBX_CLOUD_PUBKEY`: the cloud key's public `x` (base64url);
//!   - `MBX_CLOUD_KEY_FILE`: its key file, for an issuer that wants proof of possession — set
//!     only in a file-store home; in a keyring home `MBX_CLOUD_KEY_STORE` names where the entry
//!     is instead (the command reads it from the keyring itself if it needs it);
//!   - `MBX_HOST`, `MBX_HOST_PUBKEY`: this host.
//!
//!   The command must print the token (a JWT, at most [`MAX_TOKEN_BYTES`]) on stdout and exit
//!   0 within [`TOKEN_COMMAND_TIMEOUT`]; it is killed past that. Its stdout is read up to
//!   [`MAX_STDOUT_BYTES`], its stderr up to [`MAX_STDERR_BYTES`]; a failure's error shows the
//!   exit status and the first line of stderr (control characters removed, the token text
//!   redacted), never the token. The token is kept in memory until [`REFRESH_BEFORE_MS`]
//!   before its `exp`, or until the relay refuses it ([`AccountTokens::invalidate`]).
//!
//! # What it must never do
//! Log, print or put in an error the token or the cloud key's private half; write anything but
//! the `cloud.key` entry; replace an existing one; send the token to a relay whose key was not
//! confirmed (the relay client's rule, `super::session`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::AsyncReadExt;

use agentmbx_protocol::clock::SharedClock;
use agentmbx_protocol::cloud_key::{self, CloudCert, CloudPop};
use agentmbx_protocol::keys::{HostKey, KeyFile, PublicKey};

use crate::identity::Identity;
use crate::keystore::{self, Backend, KeyStore, KeyStoreError, Secret};

/// Entry name of the cloud key in the home's key store (in a file-store home, the file name).
pub const CLOUD_KEY_FILE: &str = "cloud.key";

/// Longest a token command may run.
pub const TOKEN_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// Most stdout bytes read from the token command.
pub const MAX_STDOUT_BYTES: usize = 16 * 1024;

/// Most stderr bytes read from the token command (for the error summary).
pub const MAX_STDERR_BYTES: usize = 4 * 1024;

/// Longest token accepted (bytes; the relay's own bound).
pub const MAX_TOKEN_BYTES: usize = 8_192;

/// A cached token is renewed this long before its `exp` (ms), so a request never carries a
/// token that expires in flight.
pub const REFRESH_BEFORE_MS: i64 = 60_000;

/// Longest stderr summary in an error (characters).
const STDERR_SUMMARY_CHARS: usize = 200;

/// Why no token or proof could be produced. The texts never hold a token or key material.
#[derive(Debug, thiserror::Error)]
pub enum AccountError {
    /// The `cloud.key` entry could not be read, parsed or created.
    #[error("{CLOUD_KEY_FILE} in {location}: {message}")]
    CloudKey {
        /// Where the entry is ([`KeyStore::location`]).
        location: String,
        /// What is wrong (never key bytes).
        message: String,
    },
    /// The token command could not be started, failed, timed out or printed no usable token.
    #[error("token_command {0}")]
    Command(String),
}

#[derive(Debug, Clone)]
struct Cached {
    token: String,
    /// Renew from this time on (ms).
    renew_at_ms: i64,
}

#[derive(Default)]
struct State {
    token: Option<Cached>,
    cloud: Option<HostKey>,
    /// The certificate and the host key (base64) that signed it.
    cert: Option<(String, CloudCert)>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("token_cached", &self.token.is_some())
            .field("cloud_key_loaded", &self.cloud.is_some())
            .finish_non_exhaustive()
    }
}

/// Tokens and the certified cloud key for one relay (module docs). Shared by the relay
/// client's calls; one token command runs at a time.
#[derive(Debug)]
pub struct AccountTokens {
    command: String,
    home: PathBuf,
    relay_url: String,
    clock: SharedClock,
    /// The key store of the cloud key; `None`: the home's own, found on first use.
    store: Option<Arc<dyn KeyStore>>,
    state: tokio::sync::Mutex<State>,
}

impl AccountTokens {
    /// Tokens for `relay_url` from `command` (`[relay] token_command`), with the cloud key in
    /// the key store of `home` (the one its host keys are in: [`keystore::recorded`]). Nothing
    /// runs and nothing is read or written until a token or proof is asked for.
    pub fn new(command: &str, home: &Path, relay_url: &str, clock: SharedClock) -> Self {
        AccountTokens {
            command: command.to_owned(),
            home: home.to_path_buf(),
            relay_url: relay_url.trim_end_matches('/').to_owned(),
            clock,
            store: None,
            state: tokio::sync::Mutex::new(State::default()),
        }
    }

    /// Keeps the cloud key in `store` instead of the home's own (tests: a mock store).
    pub fn with_key_store(mut self, store: Arc<dyn KeyStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// The token for `Authorization: Bearer` (cached until shortly before its `exp`, else
    /// fresh from the command). Errors: [`AccountError`].
    pub async fn bearer(&self, ident: &Identity) -> Result<String, AccountError> {
        let mut state = self.state.lock().await;
        let now = self.clock.now_ms();
        if let Some(c) = state.token.as_ref().filter(|c| now < c.renew_at_ms) {
            return Ok(c.token.clone());
        }
        state.token = None;
        let cloud = self.cloud_key(&mut state).await?.public();
        let (token, exp_ms) = self.run_command(ident, &cloud).await?;
        state.token = Some(Cached {
            token: token.clone(),
            renew_at_ms: exp_ms.saturating_sub(REFRESH_BEFORE_MS),
        });
        Ok(token)
    }

    /// The enrolment `proof` for the relay's `challenge`: `{token, cloud_cert, cloud_pop}` —
    /// the cloud key certified by the current host key, and the cloud key's proof of
    /// possession over the challenge (module docs). Errors: [`AccountError`].
    pub async fn enrol_proof(
        &self,
        ident: &Identity,
        challenge: &str,
    ) -> Result<Value, AccountError> {
        let token = self.bearer(ident).await?;
        let mut state = self.state.lock().await;
        let cloud_key = self.cloud_key(&mut state).await?;
        let cloud = cloud_key.public();
        let pop = CloudPop::sign(cloud_key, &ident.host_key.public(), challenge);
        let host = ident.host_key.public().to_b64();
        let cert = match &state.cert {
            Some((signer, cert)) if *signer == host => cert.clone(),
            _ => {
                let cert = CloudCert::sign(&ident.host_key, &cloud, self.clock.now_ms());
                state.cert = Some((host, cert.clone()));
                cert
            }
        };
        Ok(json!({"token": token, "cloud_cert": cert.to_value(), "cloud_pop": pop.to_value()}))
    }

    /// Forgets the cached token (the relay refused it); the next call runs the command.
    pub async fn invalidate(&self) {
        self.state.lock().await.token = None;
    }

    /// The cloud key's thumbprint (creating the key on first use).
    pub async fn cloud_jkt(&self) -> Result<String, AccountError> {
        let mut state = self.state.lock().await;
        Ok(cloud_key::thumbprint(
            &self.cloud_key(&mut state).await?.public(),
        ))
    }

    /// The path of the `cloud.key` file of a file-store home (a keyring home has no such file
    /// once the key moved into the keyring).
    pub fn cloud_key_path(&self) -> PathBuf {
        self.home.join(CLOUD_KEY_FILE)
    }

    /// The key store of the cloud key: the one given, else the home's ([`keystore::recorded`]:
    /// the OS keyring in a keyring home, else 0600 files in the home).
    fn key_store(&self) -> Result<Arc<dyn KeyStore>, AccountError> {
        if let Some(store) = &self.store {
            return Ok(store.clone());
        }
        let paths = crate::paths::Paths::at(&self.home);
        Ok(match keystore::recorded(&paths) {
            Some(Backend::Keyring) => Arc::new(
                keystore::keyring::KeyringStore::for_home(&self.home).map_err(|e| {
                    AccountError::CloudKey {
                        location: "the OS keyring".into(),
                        message: e.to_string(),
                    }
                })?,
            ),
            _ => Arc::new(keystore::file::FileStore::new(&self.home)),
        })
    }

    async fn cloud_key<'s>(&self, state: &'s mut State) -> Result<&'s HostKey, AccountError> {
        if state.cloud.is_none() {
            let store = self.key_store()?;
            let legacy = self.cloud_key_path();
            let location = store.location();
            // Key stores block (files, D-Bus): off the runtime.
            let key = tokio::task::spawn_blocking(move || {
                load_or_create_cloud_key(store.as_ref(), &legacy)
            })
            .await
            .map_err(|_| AccountError::CloudKey {
                location,
                message: "the key store task failed".into(),
            })??;
            state.cloud = Some(key);
        }
        state.cloud.as_ref().ok_or_else(|| AccountError::CloudKey {
            location: "memory".into(),
            message: "not loaded".into(),
        })
    }

    /// Runs the command; returns the token and its `exp` in ms.
    async fn run_command(
        &self,
        ident: &Identity,
        cloud: &PublicKey,
    ) -> Result<(String, i64), AccountError> {
        let fail = |m: String| AccountError::Command(m);
        let store = self.key_store()?;
        let mut command = tokio::process::Command::new("sh");
        match store.backend() {
            Backend::File => command.env("MBX_CLOUD_KEY_FILE", self.cloud_key_path()),
            Backend::Keyring => command
                .env_remove("MBX_CLOUD_KEY_FILE")
                .env("MBX_CLOUD_KEY_STORE", store.location()),
        };
        let mut child = command
            .arg("-c")
            .arg(&self.command)
            .env("MBX_RELAY_URL", &self.relay_url)
            .env("MBX_CLOUD_JKT", cloud_key::thumbprint(cloud))
            .env(
                "MBX_CLOUD_PUBKEY",
                agentmbx_protocol::b64::encode_url(cloud.as_bytes()),
            )
            .env("MBX_HOST", ident.host.as_str())
            .env("MBX_HOST_PUBKEY", ident.host_key.public().to_b64())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| fail(format!("could not be started: {e}")))?;
        let mut stdout = child
            .stdout
            .take()
            .ok_or_else(|| fail("has no stdout".into()))?;
        let mut stderr = child
            .stderr
            .take()
            .ok_or_else(|| fail("has no stderr".into()))?;
        let run = async {
            let mut out = Vec::new();
            let mut err = Vec::new();
            let mut limited_out = (&mut stdout).take(MAX_STDOUT_BYTES as u64 + 1);
            let mut limited_err = (&mut stderr).take(MAX_STDERR_BYTES as u64);
            let (o, _) = tokio::join!(
                limited_out.read_to_end(&mut out),
                limited_err.read_to_end(&mut err)
            );
            o.map_err(|e| fail(format!("output could not be read: {e}")))?;
            if out.len() > MAX_STDOUT_BYTES {
                return Err(fail(format!("printed more than {MAX_STDOUT_BYTES} bytes")));
            }
            let status = child
                .wait()
                .await
                .map_err(|e| fail(format!("could not be waited for: {e}")))?;
            Ok((status, out, err))
        };
        let (status, out, err) = match tokio::time::timeout(TOKEN_COMMAND_TIMEOUT, run).await {
            Ok(r) => r?,
            Err(_) => {
                let _ = child.start_kill();
                return Err(fail(format!(
                    "timed out after {} s",
                    TOKEN_COMMAND_TIMEOUT.as_secs()
                )));
            }
        };
        let out =
            String::from_utf8(out).map_err(|_| fail("printed text that is not UTF-8".into()))?;
        let token = out.trim();
        if !status.success() {
            let what = status.code().map_or_else(
                || "was killed by a signal".to_owned(),
                |c| format!("exited with status {c}"),
            );
            return Err(fail(format!("{what}{}", stderr_summary(&err, token))));
        }
        let exp_ms = token_exp_ms(token).map_err(|why| fail(format!("printed {why}")))?;
        if exp_ms <= self.clock.now_ms() {
            return Err(fail("printed an expired token".into()));
        }
        Ok((token.to_owned(), exp_ms))
    }
}

/// Whether a 401 answer body says the relay refused the account token (`BAD_TOKEN` or
/// `TOKEN_REQUIRED`), so the cached one must not be sent again.
pub fn refused_token(body: &[u8]) -> bool {
    serde_json::from_slice::<agentmbx_protocol::wire::ErrorBody>(body)
        .is_ok_and(|b| matches!(b.code.as_str(), "BAD_TOKEN" | "TOKEN_REQUIRED"))
}

/// `: <first stderr line>` (control characters dropped, `token` redacted, cut to
/// [`STDERR_SUMMARY_CHARS`]), or "" when stderr is empty.
fn stderr_summary(err: &[u8], token: &str) -> String {
    let text = String::from_utf8_lossy(err);
    let mut line = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
        .to_owned();
    if !token.is_empty() {
        line = line.replace(token, "<token>");
    }
    let line: String = line
        .chars()
        .filter(|c| !c.is_control())
        .take(STDERR_SUMMARY_CHARS)
        .collect();
    if line.is_empty() {
        String::new()
    } else {
        format!(": {line}")
    }
}

/// The `exp` (ms) of a JWT, read without verifying it (the relay verifies; the host only needs
/// to know when to renew). Errors say what is wrong with the text, never the text.
pub fn token_exp_ms(token: &str) -> Result<i64, String> {
    if token.is_empty() {
        return Err("no token".into());
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(format!("a token over {MAX_TOKEN_BYTES} bytes"));
    }
    let parts: Vec<&str> = token.split('.').collect();
    let b64url = |s: &str| {
        s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
    };
    if parts.len() != 3
        || parts[..2].iter().any(|p| p.is_empty())
        || !parts.iter().all(|p| b64url(p))
    {
        return Err("something that is not a JWT (one line header.payload.signature)".into());
    }
    use base64::Engine as _;
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(parts[1])
        .map_err(|_| "a JWT whose payload is not base64url".to_owned())?;
    let claims: Value = serde_json::from_slice(&payload)
        .map_err(|_| "a JWT whose payload is not JSON".to_owned())?;
    claims
        .get("exp")
        .and_then(Value::as_i64)
        .and_then(|s| s.checked_mul(1000))
        .ok_or_else(|| "a JWT without an integer exp".to_owned())
}

/// Loads the `cloud.key` entry of `store`, creating it (never replacing) when it does not exist
/// yet. In a keyring store without the entry, a `legacy_file` left from before (the home's
/// `cloud.key`) is moved in first, so the key — and every token bound to it — stays the same;
/// the file is removed once the keyring holds the key. Blocks (key store I/O).
pub fn load_or_create_cloud_key(
    store: &dyn KeyStore,
    legacy_file: &Path,
) -> Result<HostKey, AccountError> {
    let bad = |message: String| AccountError::CloudKey {
        location: store.location(),
        message,
    };
    let parse = |secret: &Secret| -> Result<HostKey, AccountError> {
        let file = KeyFile::parse(secret.expose()).map_err(|e| bad(e.to_string()))?;
        HostKey::from_key_file(&file).map_err(|e| bad(e.to_string()))
    };
    let get = || -> Result<Option<HostKey>, AccountError> {
        match store.get(CLOUD_KEY_FILE) {
            Ok(Some(secret)) => parse(&secret).map(Some),
            Ok(None) => Ok(None),
            Err(e) => Err(bad(e.to_string())),
        }
    };
    if let Some(key) = get()? {
        return Ok(key);
    }
    let legacy = (store.backend() == Backend::Keyring)
        .then(|| std::fs::read_to_string(legacy_file).ok())
        .flatten();
    let (secret, moved) = match legacy {
        Some(text) => {
            let secret = Secret::new(text);
            let key = parse(&secret)?;
            (secret, Some(key.public()))
        }
        None => (
            Secret::new(HostKey::generate().to_key_file().to_text()),
            None,
        ),
    };
    match store.create(CLOUD_KEY_FILE, &secret) {
        // Another process created it first: use theirs.
        Ok(()) | Err(KeyStoreError::Exists { .. }) => {}
        Err(e) => return Err(bad(format!("cannot create: {e}"))),
    }
    let key = get()?.ok_or_else(|| bad("missing right after it was written".into()))?;
    if let Some(moved) = moved {
        if moved != key.public() {
            // Another process stored another key first; keep the file for the owner to judge.
            tracing::warn!(path = %legacy_file.display(), "the key store holds another cloud key than the old file; the file is kept");
            return Ok(key);
        }
        match std::fs::remove_file(legacy_file) {
            Ok(()) => {
                tracing::info!(from = %legacy_file.display(), to = %store.location(), "moved the cloud key into the key store")
            }
            Err(e) => {
                tracing::warn!(path = %legacy_file.display(), error = %e, "the cloud key is in the key store now; remove its old file")
            }
        }
    } else {
        tracing::info!(store = %store.location(), cloud_jkt = %cloud_key::thumbprint(&key.public()), "created the cloud key for account tokens");
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use agentmbx_protocol::clock::{Clock as _, ManualClock};

    use crate::testutil::T0;

    fn jwt(claims: Value) -> String {
        let enc = |v: &[u8]| agentmbx_protocol::b64::encode_url(v);
        format!(
            "{}.{}.{}",
            enc(br#"{"alg":"EdDSA","kid":"k"}"#),
            enc(claims.to_string().as_bytes()),
            enc(b"sig")
        )
    }

    fn ident() -> Identity {
        crate::testutil::identity("alpha")
    }

    fn tokens(dir: &Path, command: &str, clock: &Arc<ManualClock>) -> AccountTokens {
        AccountTokens::new(command, dir, "http://relay.test/", clock.clone())
    }

    #[test]
    fn exp_is_read_from_a_jwt_and_junk_is_refused_without_echo() {
        assert_eq!(
            token_exp_ms(&jwt(json!({"exp": 1_800_000_000}))),
            Ok(1_800_000_000_000)
        );
        for (bad, why) in [
            (String::new(), "no token"),
            ("a.b".to_owned(), "not a JWT"),
            ("a.b.c d".to_owned(), "not a JWT"),
            (jwt(json!({"exp": "soon"})), "integer exp"),
            (jwt(json!({"exp": 1.5})), "integer exp"),
            ("x".repeat(MAX_TOKEN_BYTES + 1), "over 8192 bytes"),
        ] {
            let e = token_exp_ms(&bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
            assert!(bad.len() < 4 || !e.contains(&bad), "{e}");
        }
    }

    #[test]
    fn the_cloud_key_is_created_once_0600_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CLOUD_KEY_FILE);
        let store = crate::keystore::file::FileStore::new(dir.path());
        let a = load_or_create_cloud_key(&store, &path).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        let b = load_or_create_cloud_key(&store, &path).unwrap();
        assert_eq!(a.public(), b.public());
        std::fs::write(&path, "junk").unwrap();
        let e = load_or_create_cloud_key(&store, &path)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cloud.key"), "{e}");
    }

    /// In a keyring home the cloud key is an entry of the keyring (here a mock), never a file;
    /// a file left from before is moved in once, so the key (and its thumbprint) stays.
    #[tokio::test]
    async fn in_a_keyring_home_the_cloud_key_lives_in_the_key_store() {
        use crate::keystore::mock::MockStore;
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::new(T0));
        let store = Arc::new(MockStore::new(Backend::Keyring));
        let t = tokens(dir.path(), "exit 1", &clock).with_key_store(store.clone());
        let jkt = t.cloud_jkt().await.unwrap();
        assert_eq!(store.names(), vec![CLOUD_KEY_FILE.to_owned()]);
        assert!(!dir.path().join(CLOUD_KEY_FILE).exists(), "no key file");
        // Kept: a new client of the same store has the same key.
        let again = tokens(dir.path(), "exit 1", &clock).with_key_store(store.clone());
        assert_eq!(again.cloud_jkt().await.unwrap(), jkt);

        // A home with the old file: moved into the keyring, same key, file gone.
        let old = tempfile::tempdir().unwrap();
        let legacy = load_or_create_cloud_key(
            &crate::keystore::file::FileStore::new(old.path()),
            &old.path().join(CLOUD_KEY_FILE),
        )
        .unwrap();
        let fresh = Arc::new(MockStore::new(Backend::Keyring));
        let t = tokens(old.path(), "exit 1", &clock).with_key_store(fresh.clone());
        assert_eq!(
            t.cloud_jkt().await.unwrap(),
            cloud_key::thumbprint(&legacy.public())
        );
        assert_eq!(fresh.names(), vec![CLOUD_KEY_FILE.to_owned()]);
        assert!(!old.path().join(CLOUD_KEY_FILE).exists(), "moved");
        // An unavailable keyring is an error naming the entry, never a silent new key.
        let down = Arc::new(MockStore::new(Backend::Keyring));
        down.set_unavailable(Some("no D-Bus session"));
        let t = tokens(dir.path(), "exit 1", &clock).with_key_store(down);
        let e = t.cloud_jkt().await.unwrap_err().to_string();
        assert!(
            e.contains("cloud.key") && e.contains("no D-Bus session"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn the_command_gets_the_binding_and_its_token_is_cached_until_shortly_before_exp() {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::new(T0));
        let exp = T0 / 1000 + 600;
        let token = jwt(json!({"exp": exp}));
        let log = dir.path().join("runs");
        let cmd = format!(
            "echo \"$MBX_RELAY_URL $MBX_CLOUD_JKT $MBX_HOST $MBX_HOST_PUBKEY $MBX_CLOUD_KEY_FILE\" >> {}; echo ' {token} '",
            log.display()
        );
        let t = tokens(dir.path(), &cmd, &clock);
        let me = ident();
        assert_eq!(t.bearer(&me).await.unwrap(), token);
        assert_eq!(t.bearer(&me).await.unwrap(), token);
        let runs = std::fs::read_to_string(&log).unwrap();
        assert_eq!(runs.lines().count(), 1, "cached: {runs}");
        let jkt = t.cloud_jkt().await.unwrap();
        assert_eq!(
            runs.trim(),
            format!(
                "http://relay.test {jkt} alpha {} {}",
                me.host_key.public().to_b64(),
                dir.path().join(CLOUD_KEY_FILE).display()
            )
        );
        // Renewed from 60 s before exp; and at once after invalidate().
        clock.set(exp * 1000 - REFRESH_BEFORE_MS - 1);
        t.bearer(&me).await.unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap().lines().count(), 1);
        clock.set(exp * 1000 - REFRESH_BEFORE_MS);
        t.bearer(&me).await.unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap().lines().count(), 2);
        t.invalidate().await;
        t.bearer(&me).await.unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap().lines().count(), 3);

        // The proof: the token, a certificate of the cloud key by the host key, and the cloud
        // key's proof of possession over the relay's challenge.
        let proof = t.enrol_proof(&me, "the-challenge").await.unwrap();
        assert_eq!(proof["token"], token.as_str());
        let cert = CloudCert::from_value(&proof["cloud_cert"]).unwrap();
        cert.check(&me.host_key.public(), clock.now_ms()).unwrap();
        assert_eq!(cert.rec.cloud_jkt, jkt);
        let pop = CloudPop::from_value(&proof["cloud_pop"]).unwrap();
        assert_eq!(
            pop.check(&me.host_key.public(), "the-challenge").unwrap(),
            jkt
        );
        assert!(pop.check(&me.host_key.public(), "another").is_err());
    }

    #[tokio::test]
    async fn failures_are_summarised_without_the_token() {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::new(T0));
        let me = ident();
        let good = jwt(json!({"exp": T0 / 1000 + 600}));
        let cases = [
            (
                format!("echo {good}; echo \"login needed for {good}\nmore\" >&2; exit 3"),
                "token_command exited with status 3: login needed for <token>",
            ),
            ("exit 0".to_owned(), "token_command printed no token"),
            (
                "echo nope".to_owned(),
                "token_command printed something that is not a JWT (one line header.payload.signature)",
            ),
            (
                format!("echo {}", jwt(json!({"exp": T0 / 1000}))),
                "token_command printed an expired token",
            ),
            (
                "head -c 20000 /dev/zero | tr '\\0' a".to_owned(),
                "token_command printed more than 16384 bytes",
            ),
            ("kill -9 $$".to_owned(), "token_command was killed by a signal"),
        ];
        for (cmd, want) in cases {
            let t = tokens(dir.path(), &cmd, &clock);
            let e = t.bearer(&me).await.unwrap_err().to_string();
            assert_eq!(e, want, "{cmd}");
            assert!(!e.contains(&good), "{e}");
        }
    }

    #[tokio::test]
    async fn a_command_that_hangs_is_killed_at_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::new(T0));
        let t = tokens(dir.path(), "exec sleep 60", &clock);
        let started = std::time::Instant::now();
        let e = t.bearer(&ident()).await.unwrap_err().to_string();
        assert_eq!(e, "token_command timed out after 10 s");
        let took = started.elapsed();
        assert!(
            took >= TOKEN_COMMAND_TIMEOUT && took < TOKEN_COMMAND_TIMEOUT + Duration::from_secs(5),
            "{took:?}"
        );
    }
}
