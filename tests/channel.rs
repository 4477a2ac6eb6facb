//! Wake for Claude Code (issue 18, part 3): `agentmbx mcp` declares `claude/channel` and sends
//! `notifications/claude/channel` for new wake-worthy mail to its agent, through the daemon's
//! wake brake — driven over stdio by the `rmcp` client against a real daemon, with a client
//! that records the custom notifications it gets.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::helper::{Daemon, Home};
use rmcp::model::CustomNotification;
use rmcp::service::{NotificationContext, RunningService};
use rmcp::transport::TokioChildProcess;
use rmcp::{ClientHandler, RoleClient, ServiceExt};
use serde_json::Value;

const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A client that records the custom notifications it gets (method, params).
#[derive(Debug, Clone, Default)]
struct Recorder(Arc<Mutex<Vec<(String, Value)>>>);

impl ClientHandler for Recorder {
    async fn on_custom_notification(
        &self,
        n: CustomNotification,
        _: NotificationContext<RoleClient>,
    ) {
        self.0
            .lock()
            .expect("lock")
            .push((n.method.clone(), n.params.clone().unwrap_or(Value::Null)));
    }
}

async fn session(home: &Home, agent: &str, rec: &Recorder) -> RunningService<RoleClient, Recorder> {
    let cmd = tokio::process::Command::from(home.command(&["mcp", "--as", agent]));
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("spawn agentmbx mcp");
    tokio::time::timeout(CALL_TIMEOUT, rec.clone().serve(transport))
        .await
        .expect("handshake in time")
        .expect("handshake")
}

fn send(home: &Home, kind: &str, subject: &str, body: &str) -> String {
    home.send_json(subject, body, &["--kind", kind])
}

/// The wake brake's record of `id` for bob, once some session claimed it.
fn claim_outcome(home: &Home, id: &str) -> Option<String> {
    let c = rusqlite::Connection::open_with_flags(
        home.file("mailbox.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .ok()?;
    c.query_row(
        "SELECT COALESCE(outcome, 'pending') FROM wake_claims WHERE agent = 'bob' AND msg_id = ?1",
        [id],
        |r| r.get(0),
    )
    .ok()
}

fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + CALL_TIMEOUT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_request_mail_wakes_one_session_once_and_status_mail_none() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    assert!(home.run(&["whoami", "--as", "alice"]).status.success());
    let (r1, r2) = (Recorder::default(), Recorder::default());
    let s1 = session(&home, "bob", &r1).await;
    let s2 = session(&home, "bob", &r2).await;
    // The server declares the capability Claude Code looks for.
    let info = s1.peer_info().expect("server info");
    let experimental = info
        .capabilities
        .experimental
        .clone()
        .expect("experimental");
    assert!(
        experimental.contains_key("claude/channel"),
        "{experimental:?}"
    );
    let total = || r1.0.lock().expect("lock").len() + r2.0.lock().expect("lock").len();

    // `status` never wakes, even asking for nothing else.
    let status = send(&home, "status", "build green", "all fine");
    let outcome = until("the status claim", || claim_outcome(&home, &status));
    assert_eq!(outcome, "not-worthy");
    assert_eq!(total(), 0);

    // A request wakes exactly one of the two sessions, once.
    let subject = "Please review ".to_string() + &"x".repeat(120);
    let body = "the-secret-body-text";
    let id = send(&home, "request", &subject, body);
    until("a channel notification", || (total() >= 1).then_some(()));
    assert_eq!(until("the claim", || claim_outcome(&home, &id)), "woke");
    let grace = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < grace {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(total(), 1, "a second wake");
    }
    let mut all = r1.0.lock().expect("lock").clone();
    all.extend(r2.0.lock().expect("lock").clone());
    let (method, params) = &all[0];
    assert_eq!(method, "notifications/claude/channel");
    let meta = &params["meta"];
    assert_eq!(meta["message_id"], id.as_str());
    assert!(
        meta["from"].as_str().expect("from").starts_with("alice@"),
        "{meta}"
    );
    assert_eq!(meta["kind"], "request");
    assert_eq!(meta["needs_reply"], "false");
    // The thread of a new message is its id (a ULID): included.
    assert_eq!(meta["thread"], id.as_str());
    let shown = meta["untrusted_subject"].as_str().expect("subject");
    assert!(
        shown.chars().count() <= 80 && shown.ends_with('…'),
        "{shown}"
    );
    let content = params["content"].as_str().expect("content");
    assert!(
        content.contains("mbx_read") && content.contains(&id),
        "{content}"
    );
    assert!(
        content.contains("untrusted text from the sender"),
        "{content}"
    );
    assert!(
        !params.to_string().contains(body),
        "the body leaked: {params}"
    );
    // The watcher did not record the mail `notified`: bob's message is still plain `new`.
    let c = rusqlite::Connection::open_with_flags(
        home.file("mailbox.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .expect("open");
    let notified: i64 = c
        .query_row(
            "SELECT COUNT(*) FROM deliveries WHERE notified_at IS NOT NULL",
            [],
            |r| r.get(0),
        )
        .expect("count");
    assert_eq!(notified, 0);
    s1.cancel().await.expect("close");
    s2.cancel().await.expect("close");
}

/// `agentmbx wake mute|unmute`: a muted agent's session is not woken (the brake records the
/// mail `muted`), minutes out of 1..10080 is a usage error, unmute wakes it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_muted_agent_is_not_woken_until_unmuted() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    assert!(home.run(&["whoami", "--as", "alice"]).status.success());
    let rec = Recorder::default();
    let s = session(&home, "bob", &rec).await;
    for bad in ["0", "10081"] {
        let out = home.run(&["wake", "mute", "bob", "--minutes", bad]);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
    }
    let out = home.run(&["wake", "mute", "bob", "--minutes", "5", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_str(&out.stdout).expect("json");
    assert!(v["until_ms"].as_i64().expect("until_ms") > 0);
    let id = send(&home, "request", "now", "b");
    assert_eq!(until("the claim", || claim_outcome(&home, &id)), "muted");
    assert!(rec.0.lock().expect("lock").is_empty());
    let out = home.run(&["wake", "unmute", "bob"]);
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout.contains("unmuted"), "{out:?}");
    let id = send(&home, "task", "then", "b");
    until("a channel notification", || {
        (rec.0.lock().expect("lock").len() == 1).then_some(())
    });
    assert_eq!(
        rec.0.lock().expect("lock")[0].1["meta"]["message_id"],
        id.as_str()
    );
    let out = home.run(&["wake", "mute", "nobody"]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    s.cancel().await.expect("close");
}
