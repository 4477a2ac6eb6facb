//! `agentmbx mcp` (issue 18, part 1) driven over stdio by the `rmcp` client, as an agent's
//! client drives it, against a real daemon: the handshake and the committed tool list, mail
//! from one agent's session to another's (send, inbox, read, reply in the thread, ack), a
//! retried send with one idempotency key sending once, the guide as resource and prompt, and
//! a stopped (or not yet started) daemon answered by one clear tool error, never a hang.

use crate::helper;

use std::time::Duration;

use crate::helper::{Daemon, Home};
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};

use rmcp::model::{
    CallToolRequestParams, CallToolResult, GetPromptRequestParams, NumberOrString,
    ProgressNotificationParam, ProgressToken, ReadResourceRequestParams, RequestMetaObject,
};
use rmcp::service::{NotificationContext, RunningService};
use rmcp::transport::TokioChildProcess;
use rmcp::{ClientHandler, RoleClient, ServiceExt};
use serde_json::{json, Value};

/// Bound of any one MCP exchange: a hang fails the test instead of stalling it.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

type Client = RunningService<RoleClient, ()>;

/// Starts `agentmbx mcp --as <agent>` in `home` and completes the MCP handshake.
async fn session(home: &Home, agent: &str) -> Client {
    session_with(home, &["mcp", "--as", agent]).await
}

/// Starts `agentmbx <args>` (an `mcp` command) in `home` and completes the MCP handshake.
async fn session_with(home: &Home, args: &[&str]) -> Client {
    let cmd = tokio::process::Command::from(home.command(args));
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("spawn agentmbx mcp");
    tokio::time::timeout(CALL_TIMEOUT, ().serve(transport))
        .await
        .expect("handshake in time")
        .expect("handshake")
}

/// Like [`session`], with `MBX_LOG=<log>` and the server's stderr collected: the task's
/// answer is everything it logged, once it exited.
async fn logged_session(
    home: &Home,
    agent: &str,
    log: &str,
) -> (Client, tokio::task::JoinHandle<String>) {
    let mut cmd = tokio::process::Command::from(home.command(&["mcp", "--as", agent]));
    cmd.env("MBX_LOG", log);
    let (transport, stderr) = TokioChildProcess::builder(cmd)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn agentmbx mcp");
    let mut stderr = stderr.expect("stderr");
    let logs = tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text).await;
        text
    });
    let client = tokio::time::timeout(CALL_TIMEOUT, ().serve(transport))
        .await
        .expect("handshake in time")
        .expect("handshake");
    (client, logs)
}

/// Calls `tool` with `args`; panics on a protocol error or after [`CALL_TIMEOUT`].
async fn call(client: &Client, tool: &str, args: Value) -> CallToolResult {
    let args = args.as_object().cloned().unwrap_or_default();
    let params = CallToolRequestParams::new(tool.to_string()).with_arguments(args);
    tokio::time::timeout(CALL_TIMEOUT, client.call_tool(params))
        .await
        .unwrap_or_else(|_| panic!("{tool} did not answer within {CALL_TIMEOUT:?}"))
        .unwrap_or_else(|e| panic!("{tool}: protocol error {e}"))
}

fn text(r: &CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect()
}

/// A successful call's JSON answer.
async fn ok(client: &Client, tool: &str, args: Value) -> Value {
    let r = call(client, tool, args).await;
    assert_ne!(r.is_error, Some(true), "{tool} failed: {}", text(&r));
    serde_json::from_str(&text(&r)).expect("a JSON answer")
}

/// A failed call's text.
async fn err(client: &Client, tool: &str, args: Value) -> String {
    let r = call(client, tool, args).await;
    assert_eq!(r.is_error, Some(true), "{tool} did not fail: {}", text(&r));
    text(&r)
}

fn ids(page: &Value) -> Vec<String> {
    page["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["id"].as_str().expect("id").to_string())
        .collect()
}

#[tokio::test]
async fn two_agents_mail_each_other_through_their_mcp_sessions() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    // alice's server logs at debug: still never a body (rmcp would log whole requests).
    let (alice, alice_log) = logged_session(&home, "alice", "debug").await;
    // bob's session registered bob at start: alice's send to the bare name finds him.
    let bob = session(&home, "bob").await;

    // The tool list and its schemas are the committed ones.
    let tools = tokio::time::timeout(CALL_TIMEOUT, alice.list_all_tools())
        .await
        .expect("tools/list in time")
        .expect("tools/list");
    let committed: Value =
        serde_json::from_str(include_str!("../daemon/mcp-tools.json")).expect("mcp-tools.json");
    assert_eq!(serde_json::to_value(&tools).expect("tools"), committed);

    // The guide: the instructions, the resource and the prompt carry the same text.
    let info = alice.peer_info().expect("server info");
    let guide = info.instructions.clone().expect("instructions");
    assert!(guide.contains("mbx_send"), "{guide}");
    let res = alice
        .read_resource(ReadResourceRequestParams::new("mbx://guide"))
        .await
        .expect("read mbx://guide");
    let res_text = serde_json::to_value(&res.contents).expect("contents");
    assert_eq!(res_text[0]["text"], json!(guide));
    let prompt = alice
        .get_prompt(GetPromptRequestParams::new("mbx_guide"))
        .await
        .expect("get mbx_guide");
    let prompt_text = serde_json::to_value(&prompt.messages).expect("messages");
    assert_eq!(prompt_text[0]["content"]["text"], json!(guide));

    // A send retried with the same idempotency key sends once.
    let send = json!({
        "to": ["bob"], "subject": "build is red", "body": "can you look at the failing test?",
        "kind": "request", "needs_reply": true, "idempotency_key": "retry-me-1",
    });
    let first = ok(&alice, "mbx_send", send.clone()).await;
    let again = ok(&alice, "mbx_send", send).await;
    let id = first["id"].as_str().expect("id").to_string();
    assert_eq!(again["id"], first["id"]);

    let inbox = ok(&bob, "mbx_inbox", json!({})).await;
    assert_eq!(ids(&inbox), vec![id.clone()], "{inbox}");
    let read = ok(&bob, "mbx_read", json!({ "ids": [id] })).await;
    assert_eq!(
        read["messages"][0]["body"],
        "can you look at the failing test?"
    );

    let reply = ok(
        &bob,
        "mbx_reply",
        json!({ "id": id, "body": "on it", "idempotency_key": "bob-reply-1" }),
    )
    .await;
    let reply_id = reply["id"].as_str().expect("reply id").to_string();
    assert_eq!(reply["thread"], first["thread"]);
    let thread = ok(&alice, "mbx_thread", json!({ "id": id })).await;
    assert_eq!(ids(&thread), vec![id.clone(), reply_id.clone()], "{thread}");
    assert_eq!(
        ids(&ok(&alice, "mbx_inbox", json!({})).await),
        vec![reply_id]
    );

    let acked = ok(&bob, "mbx_ack", json!({ "ids": [id], "note": "fixed" })).await;
    assert_eq!(acked["acked"], 1);
    assert!(ids(&ok(&bob, "mbx_inbox", json!({})).await).is_empty());
    assert_eq!(
        ids(&ok(&bob, "mbx_inbox", json!({ "all": true })).await).len(),
        1
    );

    // Search: bob finds the request by a word of its body, alice her own sent copy; a query
    // of FTS syntax is plain words, one with no word and a bound broken are our errors.
    let found = ok(&bob, "mbx_search", json!({ "query": "failing" })).await;
    assert_eq!(ids(&found), vec![id.clone()], "{found}");
    assert_eq!(found["messages"][0]["subject"], "build is red");
    assert!(found["messages"][0].get("body").is_none(), "{found}");
    let found = ok(
        &alice,
        "mbx_search",
        json!({ "query": "\"FAILING\" test* (look", "limit": 50 }),
    )
    .await;
    assert_eq!(ids(&found), vec![id.clone()], "{found}");
    assert!(ids(&ok(&bob, "mbx_search", json!({ "query": "nowhere" })).await).is_empty());
    let e = err(&bob, "mbx_search", json!({ "query": "()" })).await;
    assert!(e.contains("no words"), "{e}");
    let e = err(&bob, "mbx_search", json!({ "query": "x" })).await;
    assert!(e.contains("2 to 200"), "{e}");
    let e = err(&bob, "mbx_search", json!({ "query": "ok", "limit": 51 })).await;
    assert!(e.contains("1 to 50"), "{e}");

    let sent = ok(&alice, "mbx_sent", json!({})).await;
    assert_eq!(ids(&sent), vec![id.clone()], "{sent}");
    let agents = ok(&alice, "mbx_agents", json!({})).await;
    assert!(agents.to_string().contains("\"bob\""), "{agents}");
    let me = ok(&bob, "mbx_whoami", json!({})).await;
    assert!(me.to_string().contains("bob"), "{me}");

    // A bound broken is our error, and nothing is sent.
    let e = err(&alice, "mbx_send", json!({ "to": [], "subject": "s" })).await;
    assert!(e.contains("1 to 20"), "{e}");
    assert_eq!(ids(&ok(&alice, "mbx_sent", json!({})).await).len(), 1);
    // So is an argument of the wrong type or a missing one.
    let e = err(&bob, "mbx_read", json!({ "ids": "not-a-list" })).await;
    assert!(e.contains("Bad arguments for mbx_read"), "{e}");
    let e = err(&bob, "mbx_reply", json!({ "body": "no id" })).await;
    assert!(e.contains("id"), "{e}");

    alice.cancel().await.expect("close alice");
    bob.cancel().await.expect("close bob");
    let log = tokio::time::timeout(CALL_TIMEOUT, alice_log)
        .await
        .expect("alice's server exits")
        .expect("log");
    assert!(log.contains("registered agent alice"), "{log}");
    assert!(!log.contains("failing test"), "a body in the log:\n{log}");
}

/// A result never exceeds 64 KiB: a 200 KB body is cut and marked, with its full size.
#[tokio::test]
async fn a_large_body_is_cut_to_the_result_bound_and_marked() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    let gina = session(&home, "gina").await;
    let body = "0123456789\n".repeat(200_000 / 11);
    let sent = ok(
        &gina,
        "mbx_send",
        json!({ "to": ["gina"], "subject": "big", "body": body }),
    )
    .await;
    let r = call(&gina, "mbx_read", json!({ "ids": [sent["id"]] })).await;
    assert!(text(&r).len() <= 64 * 1024, "{} bytes", text(&r).len());
    let read: Value = serde_json::from_str(&text(&r)).expect("JSON");
    let m = &read["messages"][0];
    assert_eq!(m["body_truncated"]["total_bytes"], body.len());
    assert!(body.starts_with(m["body"].as_str().expect("body")));
    gina.cancel().await.expect("close gina");
}

#[tokio::test]
async fn without_a_daemon_every_tool_says_how_to_start_it_and_nothing_hangs() {
    let home = Home::new();
    let daemon = Daemon::start(&home);
    let carol = session(&home, "carol").await;
    assert!(ok(&carol, "mbx_inbox", json!({})).await["messages"].is_array());
    let _ = daemon.terminate();

    for (tool, args) in [
        ("mbx_inbox", json!({})),
        (
            "mbx_send",
            json!({ "to": ["carol"], "subject": "s", "body": "b" }),
        ),
        ("mbx_agents", json!({})),
        ("mbx_wait", json!({ "timeout_s": 1 })),
    ] {
        let e = err(&carol, tool, args).await;
        assert!(
            e.contains("`agentmbx daemon`") && e.contains("agentmbx daemon install"),
            "{tool}: {e}"
        );
    }
    carol.cancel().await.expect("close carol");
}

#[tokio::test]
async fn a_session_started_before_the_daemon_registers_its_agent_at_the_first_call() {
    let home = Home::new();
    // The home does not even exist yet: the session starts anyway.
    let dave = session(&home, "dave").await;
    let e = err(&dave, "mbx_inbox", json!({})).await;
    assert!(e.contains("agentmbx daemon install"), "{e}");

    let _daemon = Daemon::start(&home);
    // Without a registration at this call, dave is no agent here (404 UNKNOWN_AGENT).
    let inbox = ok(&dave, "mbx_inbox", json!({})).await;
    assert!(ids(&inbox).is_empty());
    dave.cancel().await.expect("close dave");
}

/// Without `--as` (nor `MBX_AGENT`), the directory answers, the mailbox tools ask for a name,
/// and `mbx_whoami {name}` registers one and acts as it from then on.
#[tokio::test]
async fn a_session_without_an_agent_asks_for_one_and_mbx_whoami_sets_it() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    let anon = session_with(&home, &["mcp"]).await;
    assert!(ok(&anon, "mbx_agents", json!({})).await["agents"].is_array());
    let e = err(&anon, "mbx_inbox", json!({})).await;
    assert!(e.contains("mbx_whoami"), "{e}");
    let me = ok(
        &anon,
        "mbx_whoami",
        json!({ "name": "ivy", "role": "reviewer", "description": "reviews code" }),
    )
    .await;
    assert!(me.to_string().contains("reviewer"), "{me}");
    assert!(ids(&ok(&anon, "mbx_inbox", json!({})).await).is_empty());
    let agents = ok(&anon, "mbx_agents", json!({})).await;
    assert!(agents.to_string().contains("\"ivy\""), "{agents}");
    anon.cancel().await.expect("close");
}

/// `mbx_wait` on the daemon's long poll (`GET /v1/inbox?wait=`): returns the message another
/// session sends while it waits, and an empty page with a cursor when nothing comes.
#[tokio::test]
async fn mbx_wait_returns_mail_sent_while_it_waits() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    let erin = session(&home, "erin").await;
    let frank = session(&home, "frank").await;

    let empty = ok(&frank, "mbx_wait", json!({ "timeout_s": 1 })).await;
    assert!(ids(&empty).is_empty());
    let cursor = empty["next_cursor"].clone();

    let waiting = {
        let cursor = cursor.clone();
        async move {
            ok(
                &frank,
                "mbx_wait",
                json!({ "timeout_s": 20, "cursor": cursor }),
            )
            .await
        }
    };
    // Sent before or after the wait starts, it comes after the cursor: the wait returns it.
    let sending = async {
        ok(
            &erin,
            "mbx_send",
            json!({ "to": ["frank"], "subject": "ping", "body": "hi" }),
        )
        .await
    };
    let (got, sent) = tokio::join!(waiting, sending);
    assert_eq!(
        ids(&got),
        vec![sent["id"].as_str().expect("id").to_string()]
    );
}

/// A client that records the progress notifications it gets.
#[derive(Debug, Clone, Default)]
struct Progress(Arc<Mutex<Vec<ProgressNotificationParam>>>);

impl ClientHandler for Progress {
    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _: NotificationContext<RoleClient>,
    ) {
        self.0.lock().expect("lock").push(params);
    }
}

/// A stand-in for the daemon's local API in `home` (`api.addr`, `api.token`): answers
/// `POST /v1/agents` at once and `GET /v1/inbox` after `hold` with an empty page whose
/// `cursor` is `"hana.7"`, as the long poll does on timeout. Returns the inbox requests seen.
fn slow_inbox(home: &Home, hold: Duration) -> Arc<Mutex<Vec<String>>> {
    std::fs::create_dir_all(home.path()).expect("home");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::fs::write(home.file("api.addr"), format!("{addr}\n")).expect("api.addr");
    std::fs::write(home.file("api.token"), "stand-in-token\n").expect("api.token");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let log = log.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().expect("clone"));
                let mut line = String::new();
                let _ = reader.read_line(&mut line);
                let mut len = 0;
                loop {
                    let mut h = String::new();
                    if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                        break;
                    }
                    if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap_or(0);
                    }
                }
                let _ = reader.take(len).read_to_end(&mut Vec::new());
                let body = if line.starts_with("GET /v1/inbox") {
                    log.lock().expect("lock").push(line.clone());
                    std::thread::sleep(hold);
                    r#"{"messages":[],"next_cursor":null,"cursor":"hana.7"}"#
                } else {
                    r#"{"name":"hana"}"#
                };
                let _ = write!(
                    conn,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    seen
}

/// While `mbx_wait` waits it sends progress notifications to a client that gave a progress
/// token, passes its arguments to the long poll, and answers the empty page with the cursor
/// to wait from next.
#[tokio::test]
async fn mbx_wait_sends_progress_while_it_waits_and_returns_the_next_cursor() {
    let home = Home::new();
    let requests = slow_inbox(&home, Duration::from_millis(1500));
    let mut cmd = tokio::process::Command::from(home.command(&["mcp", "--as", "hana"]));
    cmd.env("MBX_MCP_PROGRESS_MS", "200");
    let (transport, _) = TokioChildProcess::builder(cmd)
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("spawn agentmbx mcp");
    let progress = Progress::default();
    let client = tokio::time::timeout(CALL_TIMEOUT, progress.clone().serve(transport))
        .await
        .expect("handshake in time")
        .expect("handshake");

    let mut meta = RequestMetaObject::default();
    meta.set_progress_token(ProgressToken(NumberOrString::Number(7)));
    let mut params = CallToolRequestParams::new("mbx_wait").with_arguments(
        json!({ "timeout_s": 1, "cursor": "hana.3", "from": "ivan" })
            .as_object()
            .cloned()
            .unwrap_or_default(),
    );
    params.meta = Some(meta);
    let r = tokio::time::timeout(CALL_TIMEOUT, client.call_tool(params))
        .await
        .expect("mbx_wait in time")
        .expect("mbx_wait");
    assert_ne!(r.is_error, Some(true), "{}", text(&r));
    let answer: Value = serde_json::from_str(&text(&r)).expect("JSON");
    assert_eq!(answer["next_cursor"], "hana.7");
    assert!(ids(&answer).is_empty());

    // The channel watcher's own polls (`notify=false`) are not mbx_wait's.
    let seen: Vec<String> = requests
        .lock()
        .expect("lock")
        .iter()
        .filter(|l| !l.contains("notify=false"))
        .cloned()
        .collect();
    assert_eq!(seen.len(), 1, "{seen:?}");
    for part in ["as=hana", "wait=1", "cursor=hana.3", "from=ivan"] {
        assert!(seen[0].contains(part), "{part} not in {}", seen[0]);
    }
    let got = progress.0.lock().expect("lock").clone();
    assert!(got.len() >= 2, "{got:?}");
    // The rmcp client puts its own token on each request: all carry that one.
    assert!(got
        .iter()
        .all(|p| p.progress_token == got[0].progress_token));
    assert!(got.windows(2).all(|w| w[0].progress < w[1].progress));
    client.cancel().await.expect("close");
}

/// Issue 18: `mbx_replay` pages bob's mail with bodies through the real server (count, the
/// 64 KiB result bound when max_bytes asks for more, thread), marking nothing read; bounds are
/// refused before any call.
#[tokio::test]
async fn mbx_replay_pages_history_with_bodies_and_marks_nothing_read() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    let alice = session(&home, "alice").await;
    let bob = session(&home, "bob").await;
    let mut sent = Vec::new();
    for (subject, body) in [
        ("one", "first body".to_string()),
        ("two", "y".repeat(40_000)),
        ("three", "z".repeat(40_000)),
    ] {
        let r = ok(
            &alice,
            "mbx_send",
            json!({ "to": ["bob"], "subject": subject, "body": body }),
        )
        .await;
        sent.push(r["id"].as_str().expect("id").to_string());
    }
    let reply = ok(
        &alice,
        "mbx_send",
        json!({ "to": ["bob"], "subject": "re", "body": "again", "reply_to": sent[0] }),
    )
    .await;
    let reply_id = reply["id"].as_str().expect("id").to_string();

    let page = ok(&bob, "mbx_replay", json!({ "limit": 1 })).await;
    assert_eq!(ids(&page), vec![sent[0].clone()], "{page}");
    assert_eq!(page["messages"][0]["body"], "first body");
    assert_eq!(page["has_more"], true);
    // max_bytes 262144 is capped to the tool's bound: the two 40 kB bodies come one a page.
    let r = call(
        &bob,
        "mbx_replay",
        json!({ "cursor": page["next_cursor"], "max_bytes": 262_144 }),
    )
    .await;
    assert!(text(&r).len() <= 64 * 1024, "{} bytes", text(&r).len());
    let page: Value = serde_json::from_str(&text(&r)).expect("json");
    assert_eq!(ids(&page), vec![sent[1].clone()]);
    assert_eq!(
        page["messages"][0]["body"].as_str().map(str::len),
        Some(40_000)
    );
    // The rest fits the default budget (capped to 61440).
    let page = ok(&bob, "mbx_replay", json!({ "cursor": page["next_cursor"] })).await;
    assert_eq!(ids(&page), vec![sent[2].clone(), reply_id.clone()]);
    assert_eq!(page["has_more"], false);
    // One thread.
    let page = ok(&bob, "mbx_replay", json!({ "thread": sent[0] })).await;
    assert_eq!(ids(&page), vec![sent[0].clone(), reply_id.clone()]);
    // Nothing was marked read.
    let inbox = ok(&bob, "mbx_inbox", json!({})).await;
    let states: Vec<&str> = inbox["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| m["state"].as_str().expect("state"))
        .collect();
    assert_eq!(states, vec!["new"; 4], "{inbox}");
    // Bounds, and another agent's cursor.
    for (args, words) in [
        (json!({ "limit": 0 }), "limit"),
        (json!({ "limit": 201 }), "limit"),
        (json!({ "max_bytes": 2047 }), "max_bytes"),
        (json!({ "max_bytes": 262_145 }), "max_bytes"),
        (json!({ "cursor": "1".repeat(2049) }), "2048"),
    ] {
        let e = err(&bob, "mbx_replay", args.clone()).await;
        assert!(e.contains(words), "{args}: {e}");
    }
    let e = err(&bob, "mbx_replay", json!({ "cursor": "alice.1" })).await;
    assert!(e.contains("another agent"), "{e}");
}

/// Issue 18: `mbx_catchup` lists what arrived since bob's stored position; `commit` moves it
/// past the page (so the next catchup lists only later mail), and `restart` all / now resets
/// it; nothing is marked read.
#[tokio::test]
async fn mbx_catchup_keeps_a_position_that_commit_moves_and_restart_resets() {
    let home = Home::new();
    let _daemon = Daemon::start(&home);
    let alice = session(&home, "alice").await;
    let bob = session(&home, "bob").await;
    let send = |subject: &'static str| {
        let alice = &alice;
        async move {
            let r = ok(
                alice,
                "mbx_send",
                json!({ "to": ["bob"], "subject": subject, "body": subject }),
            )
            .await;
            r["id"].as_str().expect("id").to_string()
        }
    };
    let a = send("a").await;
    let b = send("b").await;
    let page = ok(&bob, "mbx_catchup", json!({})).await;
    assert_eq!(ids(&page), vec![a.clone(), b.clone()], "{page}");
    assert_eq!(page["messages"][1]["body"], "b");
    assert!(page.get("committed").is_none());
    // Not committed: the same again; then committed.
    let page = ok(&bob, "mbx_catchup", json!({ "commit": true })).await;
    assert_eq!(ids(&page), vec![a.clone(), b.clone()]);
    assert_eq!(page["committed"], page["cursor"]);
    assert!(ids(&ok(&bob, "mbx_catchup", json!({})).await).is_empty());
    let c = send("c").await;
    assert_eq!(
        ids(&ok(&bob, "mbx_catchup", json!({})).await),
        vec![c.clone()]
    );
    // Paging before committing: limit 1, then the next page by cursor.
    let d = send("d").await;
    let first = ok(&bob, "mbx_catchup", json!({ "limit": 1 })).await;
    assert_eq!(ids(&first), vec![c.clone()]);
    let second = ok(
        &bob,
        "mbx_catchup",
        json!({ "cursor": first["next_cursor"], "commit": true }),
    )
    .await;
    assert_eq!(ids(&second), vec![d.clone()]);
    assert!(ids(&ok(&bob, "mbx_catchup", json!({})).await).is_empty());
    // Restart from the beginning, then from now.
    let all = ok(&bob, "mbx_catchup", json!({ "restart": "all" })).await;
    assert_eq!(ids(&all), vec![a, b, c, d]);
    let now = ok(&bob, "mbx_catchup", json!({ "restart": "now" })).await;
    assert!(ids(&now).is_empty(), "{now}");
    assert!(ids(&ok(&bob, "mbx_catchup", json!({})).await).is_empty());
    // Nothing was marked read.
    let inbox = ok(&bob, "mbx_inbox", json!({})).await;
    assert!(
        inbox["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .all(|m| m["state"] == "new"),
        "{inbox}"
    );
    let e = err(&bob, "mbx_catchup", json!({ "restart": "later" })).await;
    assert!(e.contains("mbx_catchup"), "{e}");
    let e = err(&bob, "mbx_catchup", json!({ "max_bytes": 1 })).await;
    assert!(e.contains("max_bytes"), "{e}");
}

/// Issue 19 (4): with one send and one poll a second (`[api_rate]`), back-to-back `mbx_send`
/// and `mbx_wait` calls meet 429 `RATE_LIMIT`; the server waits out `retry_after` within its
/// budget and each call succeeds, the sends stored once each.
#[tokio::test]
async fn mcp_calls_wait_out_a_rate_limit_and_succeed() {
    let home = Home::new();
    home.write_config(
        "[api_rate]\nsend_burst = 1\nsend_per_min = 60\nwait_burst = 1\nwait_per_min = 60\n",
    );
    let daemon = Daemon::start(&home);
    let alice = session(&home, "alice").await;
    let _bob = session(&home, "bob").await;
    let started = std::time::Instant::now();
    for n in 0..2 {
        let send = json!({"to": ["bob"], "subject": format!("s{n}"), "body": "b"});
        ok(&alice, "mbx_send", send).await;
    }
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "the second send did not wait for a token: {:?}",
        started.elapsed()
    );
    let started = std::time::Instant::now();
    for _ in 0..2 {
        ok(&alice, "mbx_wait", json!({"timeout_s": 0})).await;
    }
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "the second wait did not wait for a token: {:?}",
        started.elapsed()
    );
    let bob_inbox = helper::request(
        daemon.addr,
        "GET",
        "/v1/inbox?as=bob&limit=50",
        Some(&home.token()),
        &[],
        None,
    );
    assert_eq!(
        bob_inbox.json()["messages"].as_array().map(Vec::len),
        Some(2)
    );
}
